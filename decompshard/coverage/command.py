"""`decompshard coverage`: what DTensor can shard, how, and why not.

    decompshard coverage                         # every aten op reached by torch's OpInfo database
    decompshard coverage --ops "aten.add*,aten.addmv.default"
    decompshard coverage --ops "*_backward*"       # the *_backward* overloads (backward section)
    decompshard coverage --model mypkg.models:build_model --input-shapes 8,128
    decompshard coverage --format markdown|csv|json --output report.md
    decompshard coverage --diff old.json new.json
    decompshard coverage --verify-native --format json -o native.json   # audit DTensor's own strategies

The OpInfo samples are captured once and kept on disk (see --no-cache), so `--ops`
after the first run costs only the ops it names.

Exit codes: 0 a completed sweep (whatever it found), 2 bad arguments (one line on stderr),
130 interrupted (Ctrl-C; with --output, the ops finished so far are written there).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from typing import TYPE_CHECKING, Any, Sequence

from decompshard._paths import cache_dir as default_cache_dir
from decompshard.coverage.op_select import select_ops, split_patterns, validate_globs, validate_patterns
from decompshard.errors import UsageError

if TYPE_CHECKING:
    pass

__all__ = ["add_arguments", "run", "select_ops", "sweep"]

# torch is imported when the command runs, not when the CLI builds its parser
STATUSES = ("native", "derived", "torch-fallback", "replicate-only", "factory", "unsupported")  # = sweep.STATUSES
FORMATS = ("text", "markdown", "csv", "json")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Op coverage tables: how DTensor shards each aten op (native, derived, " \
                         "torch-fallback, replicate-only, factory, unsupported) and why not."
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "examples:\n" + __doc__.split("\n\n")[1] + "\n\n" + __doc__.split("\n\n")[3]
    parser.add_argument("--ops", metavar="PATTERNS",
                        help="comma-separated fnmatch globs over 'aten.<name>.<overload>' of the ops OpInfo "
                        "reaches, or exact overload names (any aten op, or a custom op ns.name.overload from "
                        "--import MODULE: without OpInfo samples it is listed as such; --model derives a custom "
                        "op at its calls' shapes); default: every op OpInfo reaches, forward and backward")
    parser.add_argument("--model", metavar="MODULE:CALLABLE",
                        help="audit a model instead: the callable returns an nn.Module or (module, example_inputs). "
                        "Custom ops it calls (torch.library.custom_op, in forward or backward) are listed and "
                        "derived like aten ops; the module is imported in the worker processes too")
    parser.add_argument("--input-shapes", metavar="SHAPES",
                        help="with --model: ';'-separated input shapes (float32), e.g. '8,128' or '2,3;2'")
    parser.add_argument("--format", choices=FORMATS, default="text",
                        help="text (default: a table sized to the terminal, full lines when piped), "
                        "markdown (GitHub tables), csv (one row per op) or json (the full record, for "
                        "--diff/--from)")
    parser.add_argument("--output", "-o", metavar="FILE", help="write the report here instead of stdout")
    parser.add_argument("--show-rules", action="store_true",
                        help="also list each op's derived rules (text, markdown; a derived_rules column in csv)")
    parser.add_argument("--diff", nargs=2, metavar=("OLD", "NEW"), help="compare two --format json reports")
    parser.add_argument("--from", dest="from_json", metavar="REPORT",
                        help="re-render a saved --format json report (e.g. as markdown) instead of sweeping")
    parser.add_argument("--jobs", "-j", type=int, default=min(os.cpu_count() or 1, 8),
                        help="worker processes (default: CPU count, at most 8; 0: in this process, no timeout)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds per op before it is reported as timed out (default 60)")
    parser.add_argument("--samples", type=int, default=2,
                        help="samples per op to derive and verify on: the largest, then the largest that adds "
                        "new tensor ranks or argument values (default 2)")
    parser.add_argument("--opinfo-samples", type=int, default=None, metavar="N",
                        help="run only the first N sample inputs of each OpInfo (faster, reaches fewer ops; "
                        "default: all)")
    parser.add_argument("--no-cache", action="store_true",
                        help="capture the OpInfo samples afresh and keep nothing on disk (default: reuse the "
                        "capture kept in $DECOMPSHARD_CACHE_DIR, else ~/.cache/decompshard, made by the "
                        "same torch and decompshard)")
    parser.add_argument("--no-verify", action="store_true", help="skip the numerical check (no precision/recall)")
    parser.add_argument("--no-backward", action="store_true",
                        help="forward ops only: do not run the OpInfo samples' backward (default: the ops "
                        "autograd's backward reaches get a section of their own)")
    parser.add_argument("--status", metavar="LIST",
                        help=f"table rows to show, comma-separated among {', '.join(STATUSES)} (summary unchanged)")
    parser.add_argument("--verify-native", action="store_true",
                        help="audit DTensor's own strategies instead: check each native op's rules numerically and "
                        "run it through DTensor on 4 simulated ranks; report the wrong ones with reproducers "
                        "(--format json: the machine-readable list)")
    parser.add_argument("--guard", action="store_true",
                        help="with --verify-native: audit DTensor with decompshard's native guard installed "
                        "(as enable(guard_native=True) leaves it): what the guard does not catch")


def _check_args(args: argparse.Namespace) -> list[str] | None:
    """Every argument check that needs neither torch nor an OpInfo capture."""
    if args.jobs < 0:
        raise UsageError("--jobs must be >= 0")
    if args.timeout <= 0:
        raise UsageError("--timeout must be > 0")
    if args.samples < 1:
        raise UsageError("--samples must be >= 1")
    if args.opinfo_samples is not None and args.opinfo_samples < 1:
        raise UsageError("--opinfo-samples must be >= 1")
    if args.input_shapes and not args.model:
        raise UsageError("--input-shapes needs --model")
    if getattr(args, "guard", False) and not args.verify_native:
        raise UsageError("--guard needs --verify-native")
    picked = [f for f, v in (("--ops", args.ops is not None), ("--model", args.model), ("--diff", args.diff),
                             ("--from", args.from_json)) if v]
    if len(picked) > 1:
        raise UsageError(f"{picked[0]} and {picked[1]} cannot be combined")
    if args.output:  # fail before a long sweep, not after it
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or os.path.isdir(args.output):
            raise UsageError(f"cannot write --output {args.output!r}")
    if args.ops is not None:
        split_patterns(args.ops)  # empty: at once; the names need torch (`sweep` checks them first)
    if not args.status:
        return None
    statuses = [s.strip() for s in args.status.split(",") if s.strip()]
    bad = [s for s in statuses if s not in STATUSES]
    if bad or not statuses:
        raise UsageError(f"unknown --status {(bad or [args.status])[0]!r}; expected some of {', '.join(STATUSES)}")
    return statuses


def _width(output: str | None, stream: Any) -> int | None:
    """Columns for text tables: none for a file; $COLUMNS when set; the terminal's width
    on a terminal; none for a pipe (full lines, for grep)."""
    if output:
        return None
    cols = os.environ.get("COLUMNS", "")
    if cols.strip().isdigit() and int(cols) > 0:
        return int(cols)
    if getattr(stream, "isatty", lambda: False)():
        return shutil.get_terminal_size((120, 24)).columns
    return None


def _emit(text: str, output: str | None) -> None:
    if output:
        try:
            with open(output, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as e:
            raise UsageError(f"cannot write {output!r}: {e.strerror or e}") from None
    else:
        sys.stdout.write(text + "\n")


def run(args: argparse.Namespace) -> int:
    statuses = _check_args(args)
    if args.ops is not None:  # a pattern that matches nothing fails now, in well under a second
        validate_globs(args.ops, None if args.no_cache else default_cache_dir())
    if not (args.diff or args.from_json):  # before this process imports torch (see sweep)
        _start_worker_server(args.jobs)
    from decompshard.coverage import report as rep

    width = _width(args.output, sys.stdout)
    if args.verify_native or args.from_json:
        from decompshard.coverage.native_audit import load_native, native_sweep, render_native

        doc = load_native(args.from_json) if args.from_json else None
        if args.verify_native and (args.model or args.diff):
            raise UsageError("--verify-native works on --ops (or every op), not --model/--diff")
        if args.verify_native and doc is None and not args.from_json:
            doc = native_sweep(args.ops, jobs=args.jobs, timeout=args.timeout, samples_per_op=args.samples,
                               opinfo_samples=args.opinfo_samples, progress=getattr(args, "verbosity", 0) >= 0,
                               guarded=args.guard)
        if doc is not None:
            _emit(render_native(doc, args.format, width or 120), args.output)
            return 0
    if args.diff:
        old, new = (rep.load_report(p) for p in args.diff)
        _emit(rep.render_diff(rep.diff_reports(old, new), args.format, width), args.output)
        return 0
    if args.from_json:
        _emit(rep.render(rep.load_report(args.from_json), args.format, width, statuses, args.show_rules),
              args.output)
        return 0
    verbosity = getattr(args, "verbosity", 0)
    if args.model:
        from decompshard.coverage.model_audit import audit_model

        doc = audit_model(args.model, args.input_shapes, jobs=args.jobs, timeout=args.timeout,
                          samples_per_op=args.samples, progress=verbosity >= 0)
    else:
        partial: dict[str, Any] = {}
        try:
            doc = sweep(args.ops, jobs=args.jobs, timeout=args.timeout, samples_per_op=args.samples,
                        opinfo_samples=args.opinfo_samples, verify=not args.no_verify, verbosity=verbosity,
                        cache=not args.no_cache, partial=partial, backward=not getattr(args, "no_backward", False))
        except KeyboardInterrupt:
            if not args.output or "doc" not in partial:
                raise
            doc = partial["doc"]
            _emit(rep.render(doc, args.format, width, statuses, args.show_rules), args.output)
            raise KeyboardInterrupt(f"{len(doc['ops'])} of {doc['run']['ops_selected']} ops written to "
                                    f"{args.output}") from None
    _emit(rep.render(doc, args.format, width, statuses, args.show_rules), args.output)
    return 0


# ------------------------------------------------------------------ sweep


def _start_worker_server(jobs: int) -> None:
    """The sweep's workers fork from a server process that imports torch and decompshard
    once (workers.start_server: forkserver, sweep preloaded, Ctrl-C the parent's alone).
    Starting that server before this process imports torch and reads the capture lets
    the two run side by side on two cores (`run` starts it right after the checks that
    need no torch, the globs included once their list is on disk)."""
    import multiprocessing as mp

    if jobs <= 0 or "forkserver" not in mp.get_all_start_methods():
        return
    from decompshard.workers import start_server

    start_server(["decompshard.coverage.sweep"])


def mark_backward(records: Sequence[dict[str, Any]], backward_names: set[str]) -> None:
    """Set each record's "backward" field: the report's backward section is these ops."""
    for r in records:
        r["backward"] = r["op"] in backward_names


def _say(text: str) -> None:
    print(f"coverage: {text}", file=sys.stderr, flush=True)


def sweep(patterns: str | None = None, *, jobs: int = 1, timeout: float = 60.0, samples_per_op: int = 2,
          opinfo_samples: int | None = None, verify: bool = True, verbosity: int = 0, cache: bool = True,
          partial: dict[str, Any] | None = None, backward: bool = True) -> dict[str, Any]:
    """Capture OpInfo samples (or read the capture kept on disk), select ops, analyse each
    (workers for the non-native ones), and return the JSON report document.

    `backward`: the capture runs each differentiable sample's backward too; the ops only
    it reaches (and every `*_backward*` op) are marked `"backward": true` (report.py).

    `verbosity`: -1 silent, 0 progress on stderr, 1 a line per op. On Ctrl-C the
    KeyboardInterrupt propagates after `partial["doc"]` is set to the report of the ops
    finished so far (`run.interrupted` true), when the sweep had started."""
    from decompshard.coverage import report as rep
    from decompshard.coverage.opinfo_samples import capture_aten_samples, capture_is_cached, is_backward_op
    from decompshard.coverage.progress import Progress
    from decompshard.coverage.sweep import needs_worker, pick_samples, records_for

    _start_worker_server(jobs)  # (a no-op when `run` started it already)
    if patterns is not None:
        validate_patterns(patterns, default_cache_dir() if cache else None)
    show = verbosity >= 0
    t0 = time.perf_counter()
    cache_dir = default_cache_dir() if cache else None
    cached = capture_is_cached(opinfo_samples, backward=backward, cache_dir=cache_dir)
    if show and not cached:
        _say("capturing aten calls from torch's OpInfo samples (once"
             + (f"; kept in {cache_dir})" if cache_dir else ")"))
    bar = Progress(0, label="OpInfos", enabled=show and not cached)
    try:
        captured = capture_aten_samples(max_samples_per_opinfo=opinfo_samples, cache_dir=cache_dir,
                                        on_opinfo=bar.update, backward=backward)
    finally:
        bar.close()
    t_capture = time.perf_counter() - t0
    if verbosity > 0:
        _say(f"{len(captured)} aten ops with samples, {'read from the cache' if cached else 'captured'} "
             f"in {t_capture:.1f} s")
    ops = select_ops(patterns, [op for op in captured if op.namespace == "aten"])
    backward_names = {str(op) for op in ops if is_backward_op(op, captured.get(op, []))}
    per_op = []
    for op in ops:
        best = pick_samples(captured.get(op, []), samples_per_op)
        per_op.append((op, [(s.args, s.kwargs, s.opinfo_name) for s in best]))
    run_info = {"jobs": jobs, "timeout": timeout, "samples_per_op": samples_per_op,
                "opinfo_samples": opinfo_samples, "verify": verify, "selection": patterns or "default",
                "capture_seconds": round(t_capture, 1), "capture_cached": cached, "backward": backward}
    if show:
        _say(f"sweeping {len(ops)} ops ({len(backward_names)} backward)")
    lookups = sum(1 for op, best in per_op if not needs_worker(op, best))  # instant, done first
    bar = Progress(len(ops), enabled=show, verbose=verbosity > 0, warmup=lookups + 1)
    records: list[dict[str, Any]] = []
    try:
        records_for(per_op, jobs=jobs, timeout=timeout, verify=verify, bar=bar, records=records)
    except KeyboardInterrupt:
        mark_backward(records, backward_names)
        if partial is not None:
            partial["doc"] = rep.build_report(records, run={
                **run_info, "seconds": round(time.perf_counter() - t0, 1), "interrupted": True,
                "ops_selected": len(ops)})
        raise
    mark_backward(records, backward_names)
    doc = rep.build_report(records, run={**run_info, "seconds": round(time.perf_counter() - t0, 1)})
    if show:
        st = doc["summary"]["status"]
        counts = ", ".join(f"{st[s]} {s}" for s in STATUSES if st.get(s))
        if backward_names:
            bst = doc["summary"]["backward"]["status"]
            counts += "; backward ops: " + ", ".join(f"{bst[s]} {s}" for s in STATUSES if bst.get(s))
        _say(f"{len(ops)} ops in {time.perf_counter() - t0:.0f} s (OpInfo samples "
             f"{'from the cache' if cached else 'captured'} in {t_capture:.0f} s): {counts}")
    return doc
