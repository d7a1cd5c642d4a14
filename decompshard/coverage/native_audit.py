"""`decompshard coverage --verify-native`: audit every native DTensor strategy OpInfo reaches.

For each aten op with a registered strategy, `native_rules.audit_native_op_detailed` runs
on its two largest OpInfo samples and on the argument variants OpInfo lacks that reach it
(`native_variants.py`: negative dims, ignored targets, class weights, label smoothing,
padding masks)
in a worker process (the coverage sweep's pool:
`sweep.run_jobs`, one job per op with a deadline, so a crash or a hang costs one op).
The result is one JSON document, ready to report upstream::

    {"schema": "decompshard-native-audit/1", "version", "torch_version",
     "run": {..., "negative_dims_failed": {op: why no negative-dim variant was made}},
     "summary": {"ops", "checked", "ops_with_wrong", "wrong_rules", "by_kind",
                 "rules_checked", "rules_refuted", "unconfirmed", "dispatch_runs",
                 "crashed": [op], "timed_out": [op]},
     "ops": [{"op", "registry", "status" (checked | skipped | no sample | crashed |
              timed out), "reason", "n_samples", "n_rules", "n_refuted",
              "n_dispatch_runs", "n_wrong", "unconfirmed", "seconds"}],
     "wrong_rules": [WrongRule as JSON: op, kind, rule, input_placements,
                     output_placements, world_size, shapes, dtypes, max_error, reason,
                     checker, sample, script]}
"""

from __future__ import annotations

import json
import pickle
import sys
import time
from collections import Counter
from typing import Any, Sequence

import torch
from tabulate import tabulate

from decompshard.coverage.report import Progress, package_version
from decompshard.dim_args import dim_arguments
from decompshard.coverage.native_variants import VARIANTS, negative_dim_samples, variant_samples
from decompshard.coverage.opinfo_samples import AtenSample
from decompshard.coverage.sweep import Sample, pick_samples, registry_of, run_jobs

SCHEMA = "decompshard-native-audit/1"


def audit_job(name: str, samples: Sequence[Sample], guarded: bool = False) -> dict[str, Any]:
    """One op's record (runs in a worker). `guarded`: audit DTensor as the native guard
    (`enable(guard_native=True)`) leaves it, so what remains is what the guard misses."""
    from decompshard.runtime.fences import guard
    from decompshard.op_names import resolve_op
    from decompshard.verify.native_rules import audit_native_op_detailed

    op = resolve_op(name)
    rec = _record(str(op), registry_of(op))
    was = guard.is_installed()
    (guard.install if guarded else guard.uninstall)()
    try:
        audit = audit_native_op_detailed(op, list(samples))
    finally:
        (guard.install if was else guard.uninstall)()
    rec.update(
        status="skipped" if audit.skipped and not audit.n_dispatch_runs else "checked",
        reason=audit.skipped, n_samples=audit.n_samples, n_rules=audit.n_rules,
        n_refuted=audit.n_refuted, n_dispatch_runs=audit.n_dispatch_runs, n_wrong=len(audit.wrong),
        unconfirmed=audit.unconfirmed, seconds=audit.seconds, wrong=[w.to_json() for w in audit.wrong],
    )
    return rec


def _job(name: str, samples: list[Sample], guarded: bool = False) -> tuple[str, bytes]:
    """A pool job running `audit_job`; samples that cannot be pickled are dropped."""
    kept = []
    for sample in samples:
        try:
            pickle.dumps(sample)
        except Exception:
            continue
        kept.append(sample)
    return name, pickle.dumps((audit_job, name, kept, guarded))


def _record(op: str, registry: str | None) -> dict[str, Any]:
    return {"op": op, "registry": registry, "status": "checked", "reason": "", "n_samples": 0, "n_rules": 0,
            "n_refuted": 0, "n_dispatch_runs": 0, "n_wrong": 0, "unconfirmed": [], "seconds": 0.0,
            "wrong": [], "native_audit": True}


def _from_pool(name: str, rec: dict[str, Any]) -> dict[str, Any]:
    """A pool failure record (crash, timeout, error) in this report's shape."""
    if rec.get("native_audit"):
        return rec
    reason = rec.get("reason", "")
    out = _record(name, None)
    status = "timed out" if reason.startswith("timed out") else "crashed"
    out.update(status=status, reason=reason, seconds=rec.get("seconds", 0.0))
    return out


def native_sweep(patterns: str | None = None, *, jobs: int = 1, timeout: float = 60.0, samples_per_op: int = 2,
                 opinfo_samples: int | None = None, progress: bool = True, guarded: bool = False) -> dict[str, Any]:
    """Capture OpInfo samples, pick the native ops among the selected ones, audit each
    (`guarded`: with the native guard installed in every worker)."""
    from decompshard.coverage.op_select import select_ops, validate_patterns
    from decompshard.coverage.opinfo_samples import capture_aten_samples

    if patterns is not None:
        validate_patterns(patterns)
    t0 = time.perf_counter()
    if progress:
        print("native audit: capturing aten calls from torch's OpInfo samples...", file=sys.stderr, flush=True)
    captured = capture_aten_samples(max_samples_per_opinfo=opinfo_samples)
    t_capture = time.perf_counter() - t0
    variants = variant_samples()
    reached = [op for op in {**captured, **variants} if op.namespace == "aten"]
    ops = [op for op in select_ops(patterns, reached) if registry_of(op) is not None]
    negative, unmade = negative_dim_variants(captured, ops, samples_per_op, jobs, timeout)
    records: list[dict[str, Any]] = []
    job_list = []
    for op in ops:
        chosen = audit_samples(captured.get(op, []), variants.get(op, []), samples_per_op, negative.get(op, []))
        if not chosen:
            rec = _record(str(op), registry_of(op))
            rec.update(status="no sample", reason="no sample inputs with a tensor")
            records.append(rec)
            continue
        job_list.append(_job(str(op), [(s.args, s.kwargs, s.opinfo_name) for s in chosen], guarded))
    bar = Progress(len(job_list), enabled=progress)

    def done(name: str, rec: dict[str, Any]) -> None:
        records.append(_from_pool(name, rec))
        bar.step(name)

    try:
        run_jobs(job_list, jobs, timeout, done)
    finally:
        bar.close()
    seconds = time.perf_counter() - t0
    if progress:
        print(f"native audit: {len(ops)} native ops in {seconds:.0f} s (OpInfo capture {t_capture:.0f} s)",
              file=sys.stderr, flush=True)
    run = {"jobs": jobs, "timeout": timeout, "samples_per_op": samples_per_op, "opinfo_samples": opinfo_samples,
           "variants": [v.name for v in VARIANTS], "negative_dims": True,
           "negative_dims_failed": unmade, "guard": guarded,
           "selection": patterns or "default", "capture_seconds": round(t_capture, 1), "seconds": round(seconds, 1)}
    return build_native_report(records, run)


def audit_samples(opinfo: Sequence[Any], variants: Sequence[Any], k: int, negative: Sequence[Any] = ()) -> list[Any]:
    """An op's samples for the audit: its k largest OpInfo samples, the same calls with
    negative dims (`negative`, from `negative_dim_variants`: where DTensor's
    `scan_strategy` lets a Shard on the scanned dim through), then every argument
    variant that reaches it (native_variants.py: ignored targets, class weights, label
    smoothing, padding masks; values OpInfo never passes, which is where DTensor's
    mean-of-means losses go wrong)."""
    return pick_samples(opinfo, k) + list(negative) + list(variants)


def negative_dim_variants(captured: dict[Any, list[Any]], ops: Sequence[Any], k: int, jobs: int,
                          timeout: float) -> tuple[dict[Any, list[Any]], dict[str, str]]:
    """op -> the k largest of its OpInfo samples again with negative dims, for the ops
    with a dim argument; and op -> why none could be made, where making them failed.
    Made in the pool: each is checked against the original on one device, and some
    kernels that never wrap their dims (`_fft_c2r`) crash on them."""
    job_list = [_negative_job(str(op), captured[op], k) for op in ops if captured.get(op) and dim_arguments(op)]
    by_name = {str(op): op for op in ops}
    out: dict[Any, list[Any]] = {}
    failed: dict[str, str] = {}

    def done(name: str, rec: dict[str, Any]) -> None:
        op = by_name[name]
        if "negative_dims" not in rec:  # the pool's failure record
            failed[name] = rec.get("reason", "failed")
        out[op] = [AtenSample(op, a, kw, label) for a, kw, label in rec.get("negative_dims", [])]

    run_jobs(job_list, jobs, timeout, done)
    return out, dict(sorted(failed.items()))


def negated_job(name: str, samples: Sequence[Sample], k: int) -> dict[str, Any]:
    """`negative_dim_samples` in a worker, as (args, kwargs, label) tuples."""
    from decompshard.op_names import resolve_op

    op = resolve_op(name)
    made = negative_dim_samples([AtenSample(op, a, kw, label) for a, kw, label in samples], k)
    return {"negative_dims": [(s.args, s.kwargs, s.opinfo_name) for s in made]}


def _negative_job(name: str, samples: Sequence[Any], k: int) -> tuple[str, bytes]:
    kept = []
    for s in samples:
        try:
            pickle.dumps((s.args, s.kwargs))
        except Exception:
            continue
        kept.append((s.args, s.kwargs, s.opinfo_name))
    return name, pickle.dumps((negated_job, name, kept, k))


def build_native_report(records: Sequence[dict[str, Any]], run: dict[str, Any]) -> dict[str, Any]:
    records = sorted(records, key=lambda r: r["op"])
    wrong = [w for r in records for w in r.pop("wrong", [])]
    for r in records:
        r.pop("native_audit", None)
    status = Counter(r["status"] for r in records)
    summary = {
        "ops": len(records), "checked": status.get("checked", 0),
        "ops_with_wrong": sum(1 for r in records if r["n_wrong"]), "wrong_rules": len(wrong),
        "by_kind": dict(Counter(w["kind"] for w in wrong)),
        "rules_checked": sum(r["n_rules"] for r in records), "rules_refuted": sum(r["n_refuted"] for r in records),
        "unconfirmed": sum(len(r["unconfirmed"]) for r in records),
        "dispatch_runs": sum(r["n_dispatch_runs"] for r in records),
        "crashed": [r["op"] for r in records if r["status"] == "crashed"],
        "timed_out": [r["op"] for r in records if r["status"] == "timed out"],
    }
    return {"schema": SCHEMA, "version": package_version(), "torch_version": torch.__version__, "run": run,
            "summary": summary, "ops": records, "wrong_rules": wrong}


# ------------------------------------------------------------------ rendering


def load_native(path: str) -> dict[str, Any] | None:
    """A saved native audit (`--format json`), or None if the file is something else
    (a coverage report: `--from` renders those as before)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return None  # the coverage report loader says what is wrong with it
    if isinstance(doc, dict) and doc.get("schema") == SCHEMA and isinstance(doc.get("wrong_rules"), list):
        return doc
    return None


def render_native(doc: dict[str, Any], fmt: str = "text", width: int = 120) -> str:
    """json: the document; text/markdown: a summary and one row per wrong behaviour;
    csv: the wrong behaviours without scripts."""
    if fmt == "json":
        return json.dumps(doc, indent=1)
    rows = [[w["op"], w["kind"], w["rule"], w["world_size"], "; ".join(map(str, w["shapes"])),
             "-" if w["max_error"] is None else f"{w['max_error']:.3g}", _cut(w["reason"], 70)]
            for w in doc["wrong_rules"]]
    headers = ["op", "kind", "placements -> DTensor's claim", "W", "shapes", "max err", "what happens"]
    if fmt == "csv":
        import csv
        import io

        buf = io.StringIO()
        wr = csv.writer(buf)
        wr.writerow(headers)
        wr.writerows(rows)
        return buf.getvalue().rstrip("\n")
    s = doc["summary"]
    lines = [
        f"native audit (torch {doc['torch_version']}"
        f"{', native guard on' if doc['run'].get('guard') else ''}): {s['ops']} native ops, {s['checked']} checked, "
        f"{s['rules_checked']} rule checks ({s['rules_refuted']} refuted, {s['unconfirmed']} of those "
        f"not reproduced by DTensor), {s['dispatch_runs']} DTensor runs; {doc['run'].get('seconds', '?')} s",
        f"wrong: {s['wrong_rules']} behaviours in {s['ops_with_wrong']} ops "
        f"({', '.join(f'{k} {v}' for k, v in sorted(s['by_kind'].items())) or 'none'})",
    ]
    if s["crashed"] or s["timed_out"]:
        lines.append(f"isolated: crashed {s['crashed'] or '-'}; timed out {s['timed_out'] or '-'}")
    if rows:
        lines += ["", tabulate(rows, headers=headers, tablefmt="github" if fmt == "markdown" else "simple")]
    return "\n".join(lines)


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"
