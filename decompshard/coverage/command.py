"""`decompshard coverage`: what DTensor can shard, how, and why not.

    decompshard coverage                         # every aten op reached by torch's OpInfo database
    decompshard coverage --ops "aten.add*,aten.addmv.default"
    decompshard coverage --model mypkg.models:build_model --input-shapes 8,128
    decompshard coverage --format markdown|csv|json --output report.md
    decompshard coverage --diff old.json new.json
    decompshard coverage --verify-native --format json -o native.json   # audit DTensor's own strategies

Exit codes: 0 a completed sweep (whatever it found), 2 bad arguments (one line on stderr).
"""

from __future__ import annotations

import argparse
import fnmatch
import os
import shutil
import sys
import time
from typing import Any, Sequence

import torch

from ..cli import UsageError
from ..derive import resolve_op
from . import report as rep
from .report import Progress
from .sweep import STATUSES, needs_worker, pick_samples, records_for

__all__ = ["add_arguments", "run", "select_ops", "sweep"]

_GLOB = set("*?[")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "Op coverage tables: how DTensor shards each aten op (native, derived, " \
                         "torch-fallback, replicate-only, unsupported) and why not."
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "examples:\n" + __doc__.split("\n\n")[1]
    parser.add_argument("--ops", metavar="PATTERNS",
                        help="comma-separated fnmatch globs over 'aten.<name>.<overload>' of the ops OpInfo "
                        "reaches, or exact overload names (any aten op); default: every op OpInfo reaches")
    parser.add_argument("--model", metavar="MODULE:CALLABLE",
                        help="audit a model instead: the callable returns an nn.Module or (module, example_inputs)")
    parser.add_argument("--input-shapes", metavar="SHAPES",
                        help="with --model: ';'-separated input shapes (float32), e.g. '8,128' or '2,3;2'")
    parser.add_argument("--format", choices=("text", "markdown", "csv", "json"), default="text")
    parser.add_argument("--output", "-o", metavar="FILE", help="write the report here instead of stdout")
    parser.add_argument("--diff", nargs=2, metavar=("OLD", "NEW"), help="compare two --format json reports")
    parser.add_argument("--from", dest="from_json", metavar="REPORT",
                        help="re-render a saved --format json report (e.g. as markdown) instead of sweeping")
    parser.add_argument("--jobs", "-j", type=int, default=min(os.cpu_count() or 1, 8),
                        help="worker processes (default: CPU count, at most 8; 0: in this process, no timeout)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds per op before it is reported as timed out (default 60)")
    parser.add_argument("--samples", type=int, default=2,
                        help="samples per op to derive and verify on, largest first (default 2)")
    parser.add_argument("--opinfo-samples", type=int, default=None, metavar="N",
                        help="run only the first N sample inputs of each OpInfo (faster, reaches fewer ops; "
                        "default: all)")
    parser.add_argument("--no-verify", action="store_true", help="skip the numerical check (no precision/recall)")
    parser.add_argument("--status", metavar="LIST",
                        help=f"table rows to show, comma-separated among {', '.join(STATUSES)} (summary unchanged)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    parser.add_argument("--verify-native", action="store_true",
                        help="audit DTensor's own strategies instead: check each native op's rules numerically and "
                        "run it through DTensor on 4 simulated ranks; report the wrong ones with reproducers "
                        "(--format json: the machine-readable list)")


def _check_args(args: argparse.Namespace) -> list[str] | None:
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
    picked = [f for f, v in (("--ops", args.ops), ("--model", args.model), ("--diff", args.diff),
                             ("--from", args.from_json)) if v]
    if len(picked) > 1:
        raise UsageError(f"{picked[0]} and {picked[1]} cannot be combined")
    if args.output:  # fail before a long sweep, not after it
        folder = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or os.path.isdir(args.output):
            raise UsageError(f"cannot write --output {args.output!r}")
    if not args.status:
        return None
    statuses = [s.strip() for s in args.status.split(",") if s.strip()]
    bad = [s for s in statuses if s not in STATUSES]
    if bad:
        raise UsageError(f"unknown --status {bad[0]!r}; expected some of {', '.join(STATUSES)}")
    return statuses


def _width(to_terminal: bool) -> int:
    return max(80, min(160, shutil.get_terminal_size((120, 24)).columns)) if to_terminal else 120


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
    width = _width(not args.output and sys.stdout.isatty())
    if args.verify_native or args.from_json:
        from .native_audit import load_native, native_sweep, render_native

        doc = load_native(args.from_json) if args.from_json else None
        if args.verify_native and (args.model or args.diff):
            raise UsageError("--verify-native works on --ops (or every op), not --model/--diff")
        if args.verify_native and doc is None and not args.from_json:
            doc = native_sweep(args.ops, jobs=args.jobs, timeout=args.timeout, samples_per_op=args.samples,
                               opinfo_samples=args.opinfo_samples, progress=not args.quiet)
        if doc is not None:
            _emit(render_native(doc, args.format, width), args.output)
            return 0
    if args.diff:
        old, new = (rep.load_report(p) for p in args.diff)
        _emit(rep.render_diff(rep.diff_reports(old, new), args.format, width), args.output)
        return 0
    if args.from_json:
        _emit(rep.render(rep.load_report(args.from_json), args.format, width, statuses), args.output)
        return 0
    if args.model:
        from .model_audit import audit_model

        doc = audit_model(args.model, args.input_shapes, jobs=args.jobs, timeout=args.timeout,
                          samples_per_op=args.samples, progress=not args.quiet)
    else:
        doc = sweep(args.ops, jobs=args.jobs, timeout=args.timeout, samples_per_op=args.samples,
                    opinfo_samples=args.opinfo_samples, verify=not args.no_verify, progress=not args.quiet)
    _emit(rep.render(doc, args.format, width, statuses), args.output)
    return 0


# ------------------------------------------------------------------ selection


def _normalize(pattern: str) -> str:
    p = pattern.strip().replace("::", ".")
    if p.startswith("torch.ops."):
        p = p[len("torch.ops."):]
    return p if p.startswith("aten.") or p.startswith("aten*") else f"aten.{p}"


def select_ops(patterns: str | None, reached: Sequence[torch._ops.OpOverload]) -> list[torch._ops.OpOverload]:
    """Ops to sweep: every reached op (no patterns), or those matching the comma-separated
    globs, plus exact overload names OpInfo does not reach. A pattern that selects nothing
    is a usage error: a typo should not produce an empty, successful report."""
    if patterns is None:
        return sorted(reached, key=str)
    names = {str(op): op for op in reached}
    chosen: dict[str, torch._ops.OpOverload] = {}
    parts = [p for p in patterns.split(",") if p.strip()]
    if not parts:
        raise UsageError("--ops is empty")
    for raw in parts:
        pat = _normalize(raw)
        if _GLOB & set(pat):
            hits = [n for n in names if fnmatch.fnmatchcase(n, pat)]
            if not hits:
                raise UsageError(f"--ops pattern {raw.strip()!r} matches no aten op reached by OpInfo")
            chosen.update((n, names[n]) for n in hits)
        elif pat in names:
            chosen[pat] = names[pat]
        else:
            try:
                op = resolve_op(pat)
            except ValueError as e:
                raise UsageError(f"--ops: {e}") from None
            chosen[str(op)] = op
    return [chosen[n] for n in sorted(chosen)]


def _validate_exact(patterns: str | None) -> None:
    """Fail fast on a bad exact name, before the (slow) OpInfo capture."""
    for raw in (patterns or "").split(","):
        pat = _normalize(raw) if raw.strip() else ""
        if pat and not (_GLOB & set(pat)):
            try:
                resolve_op(pat)
            except ValueError as e:
                raise UsageError(f"--ops: {e}") from None


# ------------------------------------------------------------------ sweep


def sweep(patterns: str | None = None, *, jobs: int = 1, timeout: float = 60.0, samples_per_op: int = 2,
          opinfo_samples: int | None = None, verify: bool = True, progress: bool = True) -> dict[str, Any]:
    """Capture OpInfo samples, select ops, analyse each (workers for the non-native ones),
    and return the JSON report document."""
    from .opinfo_samples import capture_aten_samples

    _validate_exact(patterns)
    t0 = time.perf_counter()
    if progress:
        print("coverage: capturing aten calls from torch's OpInfo samples...", file=sys.stderr, flush=True)
    captured = capture_aten_samples(max_samples_per_opinfo=opinfo_samples)
    t_capture = time.perf_counter() - t0
    ops = select_ops(patterns, [op for op in captured if op.namespace == "aten"])
    bar = Progress(len(ops), enabled=progress)
    per_op = []
    for op in ops:
        best = pick_samples(captured.get(op, []), samples_per_op)
        per_op.append((op, [(s.args, s.kwargs, s.opinfo_name) for s in best]))
    records = records_for(per_op, jobs=jobs, timeout=timeout, verify=verify, bar=bar)
    n_derived = sum(1 for op, best in per_op if needs_worker(op, best))
    if progress:
        print(f"coverage: {len(ops)} ops in {time.perf_counter() - t0:.0f} s "
              f"(OpInfo capture {t_capture:.0f} s, {n_derived} ops derived{' and verified' if verify else ''})",
              file=sys.stderr, flush=True)
    run_info = {"jobs": jobs, "timeout": timeout, "samples_per_op": samples_per_op,
                "opinfo_samples": opinfo_samples, "verify": verify, "selection": patterns or "default",
                "capture_seconds": round(t_capture, 1), "seconds": round(time.perf_counter() - t0, 1)}
    return rep.build_report(records, run=run_info)
