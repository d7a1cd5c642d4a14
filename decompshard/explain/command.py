"""`decompshard explain`: a readable propagation trace for one op call and one candidate.

    decompshard explain aten.addmv.default --shapes "4;4,12;12" --placements "R;S(1);S(0)"
    decompshard explain aten.native_layer_norm.default --shapes "2,8,16;;16;16" \\
        --args "[16],1e-5" --all
    decompshard explain aten.addmv.default --shapes "4;4,12;12" --mesh 2x4 \\
        --mesh-placements "R,S(0);S(1),S(0);S(0),R"
    decompshard explain aten.addmv.default --shapes "4;4,12;12" -i     # a small REPL
    decompshard explain --import mypkg.kernels mylib.rmsnorm.default --shapes "8,16;16;" --args 1e-6 \\
        --placements "S(0);R"                                          # a custom op

`--shapes` has one `;`-separated entry per positional argument, from the first: a
comma-separated shape for a tensor (`()` for a 0-d tensor, `|` between the shapes of a
Tensor[] argument), or an empty entry for a non-tensor argument whose value comes from
`--args`. `--args` are Python literals that fill the empty entries in order, then any
further positional arguments. Tensors are meta tensors of `--dtype`.

Exit codes: 0 the placements are accepted as they are (or none were given), 3 they are
rejected or refused (they need redistribution; the trace says where; with --mesh: the
cheapest N-D strategy moves an input), 1 the op cannot be derived (the reason is
printed), 2 bad input (one line on stderr), 130 interrupted. For an op DTensor has its
own strategy for and decompshard derives nothing to compare (aten.mm), that strategy
decides: 0 it takes the placements as they are, 3 DTensor redistributes first.
`-q` prints only the verdict lines; `-v` adds the derivation's size and time on stderr.

The REPL (`-i`) edits lines and keeps a history (readline; the history file is
`explain_history` in $DECOMPSHARD_CACHE_DIR, else ~/.cache/decompshard); Ctrl-C cancels
the line or the command running, Ctrl-D or `quit` leaves. A change of the call that does
not build (bad shapes, args, ...) leaves the working call in place.
"""

from __future__ import annotations

import argparse
import ast
import cmd
import os
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

from decompshard._paths import cache_dir
from decompshard.errors import UsageError, one_line

if TYPE_CHECKING:  # torch is imported when the command runs, not when the CLI builds its parser
    import torch

__all__ = ["Call", "EXIT_NEEDS_REDISTRIBUTION", "ExplainShell", "add_arguments", "build_call", "run"]

EXIT_NEEDS_REDISTRIBUTION = 3  # rejected or refused: `decompshard explain ... || echo needs redistribution`
EXIT_UNSUPPORTED = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Why an op gets (or refuses) a sharding: a readable propagation trace."
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        '  decompshard explain aten.addmv.default --shapes "4;4,12;12" --placements "R;S(1);S(0)"\n'
        '  decompshard explain aten.native_layer_norm.default --shapes "2,8,16;;16;16" '
        '--args "[16],1e-5" --all\n'
        '  decompshard explain aten.addmv.default --shapes "4;4,12;12" --mesh 2x4 '
        '--mesh-placements "R,S(0);S(1),S(0);S(0),R"\n'
        '  decompshard explain --import mypkg.kernels mylib.rmsnorm.default --shapes "8,16;16;" --args 1e-6 '
        '--placements "S(0);R"\n\n'
        + __doc__.split("\n\n")[-2] + "\n\n" + __doc__.split("\n\n")[-1].rstrip('"\n ')
    )
    parser.add_argument("op", nargs="?", help="the op, e.g. aten.addmv.default, or a custom op (torch.library."
                        "custom_op) named the same way, e.g. mylib.rmsnorm.default, with --import MODULE naming "
                        "the module that defines it (and registers its reference, if it has one)")
    parser.add_argument(
        "--shapes", help="one ';'-separated entry per positional arg: a shape like 4,12 for a "
        "tensor, empty for a non-tensor arg taken from --args, () for a 0-d tensor, "
        "'|' between the shapes of a Tensor[] arg",
    )
    parser.add_argument(
        "--args", dest="op_args", default="", metavar="ARGS",
        help="non-tensor positional args as comma-separated Python literals (e.g. '[16],1e-5'): "
        "they fill the empty --shapes entries in order, then trailing positional args",
    )
    parser.add_argument(
        "--kwargs", dest="op_kwargs", default="", metavar="KWARGS",
        help="keyword args as Python literals, e.g. 'correction=0, keepdim=True'",
    )
    parser.add_argument("--dtype", default="float32", help="dtype of every tensor (default float32)")
    parser.add_argument(
        "--placements", "-p",
        help="one single-dim placement per tensor input, ';'-separated: R, S(d), P(sum|avg|max|min), "
        "e.g. 'R;S(1);S(0)'. A ',' is refused: it separates mesh dims, as in --mesh-placements and check",
    )
    parser.add_argument(
        "--all", dest="show_all", action="store_true",
        help="also every derived rule and a one-line reason per rejected candidate",
    )
    parser.add_argument("--mesh", help="an N-D mesh shape, e.g. 2x4: rank N-D strategies by cost")
    parser.add_argument(
        "--mesh-placements",
        help="with --mesh: per tensor input (';'-separated) its current placement on each mesh "
        "dim (','-separated), e.g. 'R,S(0);S(1),S(0);S(0),R' (the text check --placements takes; "
        "_S(d,k) for a _StridedShard)",
    )
    parser.add_argument(
        "-i", "--interactive", action="store_true",
        help="a small REPL reading commands from stdin (type help)",
    )


def run(args: argparse.Namespace) -> int:
    verbosity = getattr(args, "verbosity", 0)
    if args.interactive:
        call = None
        if args.op is not None:
            call = build_call(args.op, args.shapes, args.op_args, args.dtype, args.op_kwargs)
        shell = ExplainShell(call)
        if args.placements:
            shell.onecmd("placements " + args.placements)
        shell.cmdloop()
        return 0
    if args.op is None:
        raise UsageError("missing the op (e.g. aten.addmv.default); or use --interactive")
    if (args.mesh is None) != (args.mesh_placements is None):
        raise UsageError("--mesh and --mesh-placements go together: give both or neither")
    from decompshard.explain.api import explain

    call = build_call(args.op, args.shapes, args.op_args, args.dtype, args.op_kwargs)
    if args.placements is not None:
        single_dim_placements(args.placements, "--placements")
    t0 = time.perf_counter()
    ex = explain(
        call.op, *call.args, placements=args.placements, mesh=args.mesh,
        mesh_placements=args.mesh_placements, show_all=args.show_all, **call.kwargs,
    )
    if verbosity > 0:
        d = ex.derived
        nodes = len(d.graph.nodes) if d.graph is not None else 0
        print(f"explain: {len(d.rules)} derived rules, {len(d.rejected)} rejected candidates, "
              f"{nodes} primitive calls; {1e3 * (time.perf_counter() - t0):.0f} ms", file=sys.stderr)
    text = ex.render(terminal_width(sys.stdout))
    if verbosity < 0:  # the verdict block only: everything up to the first blank line
        text = text.split("\n\n", 1)[0].rstrip("\n") + "\n"
    sys.stdout.write(text)
    return exit_code(ex.verdict, ex.mesh_verdict)


def single_dim_placements(text: str, what: str) -> str:
    """The 1-D candidate's text, unless it has a ',' between placements: ';' separates the
    tensor inputs and ',' the mesh dims (check, --mesh-placements), so 'R,S(1),S(0)' could
    mean three inputs or one input on a 3-D mesh. Never guessed: a UsageError says which."""
    from decompshard.placements import split_top_level

    if all(len(split_top_level(part, ",")) < 2 for part in text.split(";")):
        return text
    semi = "" if ";" in text else f" ({';'.join(p.strip() for p in split_top_level(text, ','))!r})"
    raise UsageError(f"{what} {text!r}: separate the tensor inputs' placements with ';'{semi}; a ',' separates "
                     "mesh dims, as in check --placements: for an N-D mesh use --mesh and --mesh-placements")


def exit_code(verdict: str, mesh_verdict: str | None = None) -> int:
    """0 accepted (or nothing asked), 3 rejected/refused (the single-dim candidate, or the
    N-D one: the cheapest strategy moves an input), 1 unsupported."""
    if verdict == "unsupported":
        return EXIT_UNSUPPORTED
    return EXIT_NEEDS_REDISTRIBUTION if verdict in ("rejected", "refused") or mesh_verdict == "rejected" else 0


def terminal_width(stream: Any) -> int:
    """$COLUMNS when set, the terminal's width on a terminal, else the trace's usual 120."""
    cols = os.environ.get("COLUMNS", "")
    if cols.strip().isdigit() and int(cols) > 0:
        return int(cols)
    if getattr(stream, "isatty", lambda: False)():
        return shutil.get_terminal_size((120, 24)).columns
    return 120


# ------------------------------------------------------------- building the call


@dataclass
class Call:
    """An op with meta-tensor arguments built from the command-line text."""

    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict = field(default_factory=dict)
    shapes: str = ""
    op_args: str = ""
    dtype: str = "float32"
    op_kwargs: str = ""

    def describe(self) -> str:
        parts = []
        for a, v in zip(_positional(self.op), self.args):
            parts.append(f"{a.name}={_describe(v)}")
        parts += [f"{k}={_describe(v)}" for k, v in self.kwargs.items()]
        return f"{self.op}({', '.join(parts)})"


def _describe(v: Any) -> str:
    import torch

    from decompshard.explain.render import DTYPE_NAMES

    if isinstance(v, torch.Tensor):
        return f"{DTYPE_NAMES.get(v.dtype, str(v.dtype))}[{','.join(map(str, v.shape))}]"
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
        return "[" + ", ".join(_describe(x) for x in v) + "]"
    return repr(v)


def parse_dtype(name: str) -> "torch.dtype":
    import torch

    from decompshard.explain.render import DTYPE_NAMES

    text = name.strip().removeprefix("torch.")
    short = {v: k for k, v in DTYPE_NAMES.items()}
    dt = short.get(text) or getattr(torch, text, None)
    if not isinstance(dt, torch.dtype):
        raise UsageError(f"unknown dtype {name!r}: expected e.g. float32, bfloat16, int64")
    return dt


def parse_shape(text: str) -> tuple[int, ...]:
    s = text.strip()
    if s in ("()", "[]", "scalar"):
        return ()
    s = s.strip("()[]")
    try:
        dims = tuple(int(p) for p in s.replace("x", ",").split(","))
    except ValueError:
        raise UsageError(f"malformed shape {text.strip()!r}: expected sizes like 4,12 or () for 0-d") from None
    if any(d < 0 for d in dims):
        raise UsageError(f"malformed shape {text.strip()!r}: sizes must be >= 0")
    return dims


def parse_literals(text: str) -> list[Any]:
    if not text or not text.strip():
        return []
    try:
        value = ast.literal_eval("[" + text + "]")
    except (ValueError, SyntaxError):
        raise UsageError(
            f"malformed --args {text!r}: expected comma-separated Python literals, e.g. '[16],1e-5'"
        ) from None
    return list(value)


def parse_kwargs(text: str) -> dict[str, Any]:
    if not text or not text.strip():
        return {}
    try:
        call = ast.parse(f"f({text})", mode="eval").body
        if not isinstance(call, ast.Call) or call.args or any(k.arg is None for k in call.keywords):
            raise ValueError
        return {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    except (ValueError, SyntaxError):
        raise UsageError(
            f"malformed --kwargs {text!r}: expected name=literal pairs, e.g. 'keepdim=True'"
        ) from None


def _positional(op) -> list:
    return [a for a in op._schema.arguments if not a.kwarg_only]


def _tensor_kind(t) -> str | None:
    """'tensor', 'optional' (Tensor?), 'list' (Tensor[] / Tensor?[]) or None."""
    import torch

    T = torch._C.TensorType.get()
    if t.isSubtypeOf(T):
        return "tensor"
    if isinstance(t, torch._C.OptionalType) and t.getElementType().isSubtypeOf(T):
        return "optional"
    if isinstance(t, torch._C.ListType):
        el = t.getElementType()
        if el.isSubtypeOf(T) or (
            isinstance(el, torch._C.OptionalType) and el.getElementType().isSubtypeOf(T)
        ):
            return "list"
    return None


def build_call(
    op_name: str, shapes: str | None, op_args: str = "", dtype: str = "float32", op_kwargs: str = ""
) -> Call:
    """Meta-tensor arguments for `op_name` from the CLI text, checked against its schema.

    Raises UsageError / ValueError (exit 2) for an unknown op, a wrong number of shapes or
    args, a shape where the schema has no tensor (or the reverse), or arguments the op
    itself rejects."""
    import torch

    from decompshard.op_names import resolve_op

    op = resolve_op(op_name)
    pos = _positional(op)
    sig = ", ".join(f"{a.name}: {a.type}" for a in pos)
    if shapes is None:
        raise UsageError(f"missing --shapes: one ';'-separated entry per positional argument of {op}({sig})")
    dt = parse_dtype(dtype)
    entries = shapes.split(";")
    queue = parse_literals(op_args)
    n_literals = len(queue)
    kwargs = parse_kwargs(op_kwargs)

    def meta(shape):
        return torch.empty(shape, dtype=dt, device="meta")

    if len(entries) > len(pos):
        raise UsageError(
            f"{op} takes {len(pos)} positional arguments ({sig}); got {len(entries)} --shapes entries"
        )
    values: list[Any] = []
    for i, entry in enumerate(entries):
        a = pos[i]
        kind = _tensor_kind(a.type)
        if entry.strip():
            if kind is None:
                raise UsageError(
                    f"argument {i} ({a.name}: {a.type}) is not a tensor: leave its --shapes "
                    "entry empty and give its value in --args"
                )
            if kind == "list":
                values.append([meta(parse_shape(s)) for s in entry.split("|")])
            else:
                values.append(meta(parse_shape(entry)))
            continue
        if not queue:
            if kind in ("tensor", "list"):
                raise UsageError(f"argument {i} ({a.name}: {a.type}) is a tensor: give its shape in --shapes")
            raise UsageError(
                f"argument {i} ({a.name}: {a.type}) has an empty --shapes entry, but --args has "
                f"no value left for it ({n_literals} given)"
            )
        values.append(_literal_for(i, a, kind, queue.pop(0)))
    for v in queue:  # trailing positional arguments
        i = len(values)
        if i >= len(pos):
            raise UsageError(
                f"{op} takes {len(pos)} positional arguments ({sig}); --shapes and --args give "
                f"{len(entries) + n_literals}"
            )
        values.append(_literal_for(i, pos[i], _tensor_kind(pos[i].type), v))
    missing = [a for a in pos[len(values):] if not a.has_default_value()]
    if missing:
        raise UsageError(
            f"{op} needs {len(values) + len(missing)} positional arguments ({sig}); got "
            f"{len(values)}: missing {', '.join(a.name for a in missing)}"
        )
    known = {a.name for a in op._schema.arguments}
    unknown = [k for k in kwargs if k not in known]
    if unknown:
        raise UsageError(f"{op} has no argument {unknown[0]!r} ({sig})")
    _check_runs(op, tuple(values), kwargs)
    return Call(op, tuple(values), kwargs, shapes, op_args, dtype, op_kwargs)


def _literal_for(i: int, a, kind: str | None, v: Any) -> Any:
    if kind in ("tensor", "list"):
        raise UsageError(f"argument {i} ({a.name}: {a.type}) is a tensor: give its shape in --shapes")
    if kind == "optional" and v is not None:
        raise UsageError(
            f"argument {i} ({a.name}: {a.type}) is a tensor or None: give its shape in --shapes, "
            "or None in --args"
        )
    return v


def _check_runs(op, args: tuple, kwargs: dict) -> None:
    """The op itself on the meta tensors: wrong shapes are a usage error, not a trace."""
    try:
        op(*args, **kwargs)
    except NotImplementedError:
        pass  # no meta kernel: the decomposition may still work; derive reports it
    except Exception as e:  # noqa: BLE001 - the op's own argument checks
        raise UsageError(f"{op} rejects these arguments: {one_line(e, 200, with_type=False)}") from None


# ------------------------------------------------------------------------- REPL


HISTORY_FILE = "explain_history"
_COMMAND_OF = {"op_name": "op", "shapes": "shapes", "op_args": "args", "op_kwargs": "kwargs", "dtype": "dtype"}
HISTORY_LENGTH = 1000


class ExplainShell(cmd.Cmd):
    """Keeps an op call; each line is a candidate (e.g. `R;S(1);S(0)`) or a command.

    On a terminal (stdin is the process's own terminal) lines are read with readline:
    editing, Up/Down history kept across sessions, Tab completes command names; Ctrl-C
    cancels the line being typed or the command running and returns to the prompt.
    Elsewhere (a pipe, a test's StringIO) lines are read plainly and Ctrl-C stops it."""

    intro_text = (
        "Type placements (one per tensor input, ';'-separated, e.g. R;S(1);S(0)), or: all, "
        "mesh 2x4 R,S(0);..., graph, op NAME, shapes ..., args ..., help, quit."
    )

    def __init__(self, call: Call | None = None, stdin: TextIO | None = None,
                 stdout: TextIO | None = None):
        super().__init__(stdin=stdin or sys.stdin, stdout=stdout or sys.stdout)
        tty = hasattr(self.stdin, "isatty") and self.stdin.isatty()
        # input() (readline) only for the real terminal; pipes and tests read self.stdin
        self.use_rawinput = tty and self.stdin is sys.stdin and _readline() is not None
        self.prompt = "explain> " if tty else ""
        self.call = call
        self.pending: dict[str, str | None] = {}  # an op switch waiting for shapes that fit it
        self.show_all = False
        self.fields: dict[str, str | None] = {  # the call's text, as the CLI options give it
            "op_name": str(call.op) if call else None, "shapes": call.shapes if call else None,
            "op_args": call.op_args if call else "", "dtype": call.dtype if call else "float32",
            "op_kwargs": call.op_kwargs if call else "",
        }
        self.intro = self._banner()

    # -- plumbing

    def _say(self, text: str = "") -> None:
        self.stdout.write(text if text.endswith("\n") else text + "\n")

    def _banner(self) -> str:
        head = "decompshard explain (interactive). "
        if self.call is None:
            return head + "Set the call first: op NAME, then shapes ... (and args ...).\n" + self.intro_text
        return head + f"call: {self.call.describe()}\n" + self.intro_text

    def cmdloop(self, intro: str | None = None) -> None:
        """cmd's loop, with history loaded and saved around it; on a terminal Ctrl-C
        cancels the current line (or command) and the loop goes on."""
        self._history(load=True)
        try:
            while True:
                try:
                    super().cmdloop(intro)
                    return
                except KeyboardInterrupt:
                    if not self.use_rawinput:
                        raise
                    self.stdout.write("\n")  # the terminal shows ^C; the next prompt starts clean
                    intro = ""
        finally:
            self._history(load=False)

    def _history(self, load: bool) -> None:
        rl = _readline() if self.use_rawinput else None
        if rl is None:
            return
        path = os.path.join(cache_dir(), HISTORY_FILE)
        try:
            if load:
                if os.path.exists(path):
                    rl.read_history_file(path)
            else:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                rl.set_history_length(HISTORY_LENGTH)
                rl.write_history_file(path)
        except OSError:  # an unreadable or unwritable history only loses the history
            pass

    def onecmd(self, line: str) -> bool:
        try:
            return super().onecmd(line)
        except (UsageError, ValueError) as e:
            self._say(f"error: {e}")
            return False

    def emptyline(self) -> bool:
        return False

    def default(self, line: str) -> bool:
        text = line.strip()
        if text in ("EOF",):
            return True
        if any(c in text for c in "()") or text in ("R",) or ";" in text or "," in text:
            return self.do_placements(text)
        self._say(f"error: unknown command {text.split()[0]!r} (type help)")
        return False

    def _need_call(self) -> Call:
        if self.call is None:
            raise UsageError("no op call yet: set it with `op NAME` and `shapes ...` (and `args ...`)")
        return self.call

    def _rebuild(self, **changes: str | None) -> None:
        """Apply new call text, only if it builds a call: a bad `shapes` (args, kwargs,
        dtype) leaves the working call as it was. A new op usually needs new shapes, so an
        `op` that does not build with the current ones waits (pending) for the next change
        of shapes/args/... that makes it build; the working call stays until then."""
        fields = {**self.fields, **self.pending, **changes}
        if fields["op_name"] is None or fields["shapes"] is None:  # no call yet: collect the parts
            self.fields, self.pending, self.call = fields, {}, None
            self._say("ok; now set " + ("op NAME" if fields["op_name"] is None else "shapes ..."))
            return
        try:
            call = build_call(fields["op_name"], fields["shapes"], fields["op_args"], fields["dtype"],
                              fields["op_kwargs"])
        except (UsageError, ValueError) as e:
            self._say(f"error: {e}")
            if self.call is None:  # nothing to protect: keep collecting the parts
                self.fields, self.pending = fields, {}
                self._say("no call set: fix it with op / shapes / args / kwargs / dtype")
                return
            if "op_name" in changes or "op_name" in self.pending:
                self.pending = {k: v for k, v in {**self.pending, **changes}.items() if v != self.fields.get(k)}
                what = ", ".join(f"{_COMMAND_OF[k]} {v}" for k, v in self.pending.items())
                self._say(f"pending: {what} (set shapes/args/kwargs that fit it; `call` shows the working call)")
            self._say(f"still: {self.call.describe()}")
            return
        self.fields, self.pending, self.call = fields, {}, call
        self._say(f"call: {self.call.describe()}")

    # -- commands

    def do_placements(self, arg: str) -> bool:
        """placements R;S(1);S(0)   explain this candidate (typing the placements alone works too)"""
        call = self._need_call()
        if not arg.strip():
            raise UsageError("placements: expected e.g. R;S(1);S(0)")
        single_dim_placements(arg.strip(), "placements")
        from decompshard.explain.api import explain

        ex = explain(call.op, *call.args, placements=arg, show_all=self.show_all, **call.kwargs)
        self._say(ex.render(terminal_width(self.stdout)))
        return False

    do_p = do_placements

    def do_all(self, arg: str) -> bool:
        """all   every derived rule, and a one-line reason per rejected candidate"""
        call = self._need_call()
        from decompshard.explain.api import explain

        ex = explain(call.op, *call.args, show_all=True, **call.kwargs)
        self._say(ex.render(terminal_width(self.stdout)))
        return False

    do_rules = do_all

    def do_verbose(self, arg: str) -> bool:
        """verbose on|off   append the --all section to every trace"""
        self.show_all = arg.strip().lower() in ("", "on", "1", "true", "yes")
        self._say(f"verbose {'on' if self.show_all else 'off'}")
        return False

    def do_graph(self, arg: str) -> bool:
        """graph   the recorded decomposition (no placements)"""
        call = self._need_call()
        from decompshard.solve.derive import derive_rules
        from decompshard.explain.render import decomposition_lines

        d = derive_rules(call.op, *call.args, **call.kwargs)
        if d.graph is None:
            self._say(f"unsupported: {d.unsupported_reason}")
        else:
            self._say("\n".join(decomposition_lines(d.graph, call.op)))
        return False

    def do_mesh(self, arg: str) -> bool:
        """mesh 2x4 R,S(0);S(1),S(0);S(0),R   rank N-D strategies from these current placements
        (per tensor input, one placement per mesh dim)"""
        call = self._need_call()
        parts = arg.strip().split(None, 1)
        if len(parts) != 2:
            raise UsageError("mesh: expected `mesh 2x4 R,S(0);S(1),S(0);S(0),R`")
        from decompshard.explain.api import explain

        ex = explain(call.op, *call.args, mesh=parts[0], mesh_placements=parts[1],
                     show_all=self.show_all, **call.kwargs)
        self._say(ex.render(terminal_width(self.stdout)))
        return False

    def do_op(self, arg: str) -> bool:
        """op aten.addmv.default   switch to another op (keeps shapes/args; change them next if needed)"""
        if not arg.strip():
            raise UsageError("op: expected an op name, e.g. aten.addmv.default")
        from decompshard.op_names import resolve_op

        resolve_op(arg.strip())  # fail early on unknown ops
        self._rebuild(op_name=arg.strip())
        return False

    def do_shapes(self, arg: str) -> bool:
        """shapes 4;4,12;12   new --shapes (';'-separated, empty entry: value from args)"""
        self._rebuild(shapes=_unquote(arg))
        return False

    def do_args(self, arg: str) -> bool:
        """args [16],1e-5   new --args (Python literals)"""
        self._rebuild(op_args=_unquote(arg))
        return False

    def do_kwargs(self, arg: str) -> bool:
        """kwargs keepdim=True   new --kwargs"""
        self._rebuild(op_kwargs=_unquote(arg))
        return False

    def do_dtype(self, arg: str) -> bool:
        """dtype bfloat16   dtype of every tensor"""
        self._rebuild(dtype=arg.strip() or "float32")
        return False

    def do_call(self, arg: str) -> bool:
        """call   show the current op call"""
        self._say(f"call: {self._need_call().describe()}")
        return False

    def do_help(self, arg: str) -> bool:
        """help [command]   this list, or one command's help"""
        if arg.strip():
            return super().do_help(arg)
        self._say(self.intro_text)
        for name in ("placements", "all", "mesh", "graph", "verbose", "call", "op", "shapes",
                     "args", "kwargs", "dtype", "help", "quit"):
            doc = (getattr(self, f"do_{name}").__doc__ or "").strip().splitlines()[0]
            self._say(f"  {doc}")
        return False

    def do_quit(self, arg: str) -> bool:
        """quit   leave (also: exit, Ctrl-D)"""
        return True

    do_exit = do_quit
    do_q = do_quit

    def do_EOF(self, arg: str) -> bool:  # noqa: N802 - cmd's name for end of input
        """Ctrl-D leaves"""
        if self.prompt:
            self._say()
        return True


def _readline() -> Any:
    """The readline module (line editing, history), or None where Python has none."""
    try:
        import readline
    except ImportError:  # pragma: no cover - e.g. some Windows builds
        return None
    return readline


def _unquote(text: str) -> str:
    s = text.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "'\"":
        try:
            return shlex.split(s)[0]
        except ValueError:
            return s[1:-1]
    return s
