"""`decompshard <command>`: a thin dispatcher. Each command's module owns its arguments
(`add_arguments(parser)`) and its behaviour (`run(args) -> int`), so this file never grows.
Only the chosen command's module is imported (torch is imported by the commands, when
they run), so `decompshard --help` answers at once.

Every command takes `-v/--verbose` and `-q/--quiet` (`args.verbosity`: 1, 0 or -1; a
command may redefine them), and `--import MODULE` (repeatable): the user's module that
defines custom ops, imported before the command runs (decompshard.user_modules). A
misspelled option prints that command's usage.

Exit codes: 0 success, 2 bad arguments (one-line message on stderr), 1 internal error,
130 interrupted (Ctrl-C: one line on stderr); commands document their own on top.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

from decompshard.errors import UsageError
from decompshard.torch_notices import no_cuda_runtime_notice

COMMANDS = {
    "coverage": ("decompshard.coverage.command", "op coverage tables: native, derived, unsupported and why"),
    "explain": ("decompshard.explain.command", "why an op gets (or refuses) a sharding: a readable trace"),
    "check": ("decompshard.check.command", "runtime check: DTensor with enable() against one device"),
    "doctor": ("decompshard.doctor.command", "what works on this torch: hook points, registries, a smoke run"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(
        prog="decompshard",
        description="DTensor sharding strategies derived from aten decompositions: coverage tables and traces.",
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    modules, parsers = {}, {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = parsers[name] = sub.add_parser(name, help=help_text, conflict_handler="resolve")
        _add_common_arguments(p)
        if name != chosen:  # only the command that runs pays for its imports
            continue
        try:
            modules[name] = importlib.import_module(module_name)
        except ImportError as e:  # a command not installed in this build
            p.set_defaults(_missing=str(e))
            continue
        modules[name].add_arguments(p)
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "_missing", None):
        print(f"decompshard {args.command}: unavailable ({args._missing})", file=sys.stderr)
        return 1
    if extra:  # the command's own usage, not the top level's
        _unrecognized(parsers.get(args.command) or parser, extra)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        with no_cuda_runtime_notice():  # a CUDA build's notice about C++ extensions, on a CPU box
            _import_user_modules(args)
            return int(modules[args.command].run(args) or 0)
    except (UsageError, ValueError) as e:
        print(f"decompshard {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # one line, no traceback; a command may say what it kept
        print(f"decompshard {args.command}: interrupted" + (f" ({e.args[0]})" if e.args else ""),
              file=sys.stderr)
        return 130


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    loud = parser.add_mutually_exclusive_group()
    loud.add_argument("--verbose", "-v", dest="verbosity", action="store_const", const=1, default=0,
                      help="more detail on stderr")
    loud.add_argument("--quiet", "-q", dest="verbosity", action="store_const", const=-1,
                      help="less output: no progress, only results")
    parser.add_argument("--import", dest="imports", action="append", metavar="MODULE", default=[],
                        help="import MODULE first (a dotted name importable from the working directory, or a "
                        "path to a .py file; repeatable): the module that defines your custom ops "
                        "(torch.library.custom_op) and registers their references, so they are named like aten "
                        "ops, e.g. --import mypkg.kernels with mylib.rmsnorm.default")


def _import_user_modules(args: argparse.Namespace) -> None:
    """--import MODULE, in order, before the command runs (its worker processes repeat them)."""
    if getattr(args, "imports", None):
        from decompshard.user_modules import import_user_module

        for spec in args.imports:
            import_user_module(spec)


def _unrecognized(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """argparse's error (usage + one line, exit 2), with the closest option if any."""
    known = [o for a in parser._actions for o in a.option_strings]
    flag = next((x.split("=", 1)[0] for x in extra if x.startswith("--")), None)
    close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6) if flag else []
    hint = f" (did you mean {close[0]}?)" if close else ""
    parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")


class _VersionAction(argparse.Action):
    """--version, computed only when asked (it imports torch)."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, default=argparse.SUPPRESS, nargs=0,
                         help="show decompshard's and torch's versions and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(_version())
        parser.exit()


def _version() -> str:
    """decompshard's version and the torch it runs on: the first thing a bug report needs."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from decompshard._compat import SUPPORTED

    try:
        mine = version("decompshard")
    except PackageNotFoundError:  # run from a checkout without installing
        mine = "unknown (not installed)"
    supported = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED)
    return f"decompshard {mine} (torch {torch.__version__}; supported: torch {supported})"


if __name__ == "__main__":
    sys.exit(main())
