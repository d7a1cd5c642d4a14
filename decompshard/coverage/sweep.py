"""One coverage record per aten overload, computed in worker processes.

For each op the sweep answers "how does DTensor handle it?":

    native          DTensor has a registered strategy (single-dim, op-strategy or rule);
                    nothing is derived or verified, which keeps the default sweep fast
    derived         decompshard derives at least one non-trivial rule (or, for an in-place
                    view op, enable() relabels self by its twin's native strategy: no rule
                    of its own, probed like the replicated ones below)
    torch-fallback  torch's own decomposition fallback finds a non-trivial rule, we don't
    replicate-only  the op can run, but only with every input Replicate: no derived rule
                    survives, or enable() runs it replicated without deriving (its output
                    size depends on values, or it has no decomposition); the latter are
                    claimed only after a DTensor run under enable() matched one device
                    (runtime_probe.py)
    factory         no tensor argument (arange, zeros, rand, ...): DTensor never dispatches
                    it, so nothing to shard; sharded tensors come from
                    torch.distributed.tensor's own factories or distribute_tensor
    unsupported     nothing can run it sharded; `reason` says why (no decomposition, the
                    blocking primitive, random, a probe that failed, a crash or a timeout)

For a non-native op we derive on its best, most varied samples (`pick_samples`), run torch's fallback
on the same samples, and judge both rule sets against ONE numerical ground truth
(`verify.check_rules` over the union, then split per side), so both sides are scored on
exactly the same truth. Counts are summed over the samples.

Ops run in worker processes (`run_jobs`), one job per op with a deadline. A job that
overruns is killed with its process and a fresh worker takes its place (forkserver: ~25 ms,
torch already imported), so a hang or a segfault costs one op, never the sweep. Samples
are captured once by the parent and shipped pickled: capturing in each worker would
repeat 20-60 s of OpInfo work per worker and again after every recycle.
"""

from __future__ import annotations

import collections
import pickle
import re
import time
from typing import Any, Callable, Iterable, Sequence

import torch

from decompshard._compat import tree_flatten, tree_map

from decompshard import workers as _workers
from decompshard._compat import sharding_propagator
from decompshard.errors import one_line
from decompshard.op_names import resolve_op
from decompshard.solve.derive import DerivedRules, derive_rules
from decompshard.dispatch_modes.tracing import has_decomposition
from decompshard.placements import SingleDimRule, format_rule
from decompshard.verify.rule_check import VerifyReport, check_rules
from decompshard.dispatch_modes.record import exact_clone
from decompshard.coverage.sample_pick import pick_diverse
from decompshard.coverage.torch_fallback import torch_fallback_rules

STATUSES = ("native", "derived", "torch-fallback", "replicate-only", "factory", "unsupported")
STATUS_MEANINGS = {  # the summary table's legend, one line each (see the module docstring)
    "native": "DTensor's own registered strategy",
    "derived": "runs sharded under enable(): rules derived by decompshard (or an in-place view on its twin's)",
    "torch-fallback": "only torch's own decomposition fallback finds a rule",
    "replicate-only": "runs under enable(), on replicated inputs only",
    "factory": "n/a: no tensor argument, DTensor never dispatches it",
    "unsupported": "not claimed to run right on DTensors under enable(); the reason says why",
}
REGISTRY_LABELS = {"single-dim": "single-dim strategy", "op-strategy": "op strategy", "rule": "propagation rule"}
NO_SAMPLE = "no sample inputs (OpInfo does not reach it; derivation needs example arguments)"
FACTORY = ("n/a: no tensor argument, so DTensor never dispatches it; create sharded tensors with "
           "torch.distributed.tensor.zeros/ones/full/empty/rand/randn or distribute_tensor")

Sample = tuple[tuple, dict, str]  # (args, kwargs, label) as shipped to a worker


def registry_of(op: torch._ops.OpOverload) -> str | None:
    """Which DTensor registry holds the op, in the order DTensor consults them."""
    sp = sharding_propagator()
    if op in sp.op_single_dim_strategy_funcs:
        return "single-dim"
    if op in sp.op_strategy_funcs:
        return "op-strategy"
    if op in sp.op_to_rules:
        return "rule"
    return None


def is_factory(op: torch._ops.OpOverload) -> bool:
    """No tensor argument in the schema (Tensor, Tensor?, Tensor[]): DTensor dispatches
    only calls that carry a DTensor, so no DTensor program ever reaches the op. Decided
    by the schema, so an OpInfo sample that happens to pass no tensor does not count."""
    return not any("Tensor" in str(a.type) for a in op._schema.arguments)


def runtime_route(op: torch._ops.OpOverload) -> tuple[str, str] | None:
    """(status, reason) for an op `enable()` runs without deriving its rules, in the order
    DTensor consults them: a handler (as_strided's limits, data-dependent ops, in-place
    view ops), then, for an op with no decomposition, the replicated fallback
    (`enable.reaches_decompshard`), reached directly or through an in-place op's
    functional twin; an in-place metadata op none of these takes is unsupported with
    its reason. None: derivation decides. A route other than unsupported is a claim only
    once `runtime_probe` ran it."""
    from decompshard.runtime.support import as_strided
    from decompshard.runtime.support.data_dependent import data_dependent_ops, replicated_reason
    from decompshard.runtime.derived import reaches_decompshard
    from decompshard.runtime.support.inplace import written_back_ops
    from decompshard.runtime.support.inplace_views import in_place_view_ops

    if op in (as_strided.OP, as_strided.OUT_OF_PLACE):
        return "unsupported", as_strided.LIMITS
    if op in data_dependent_ops():
        return "replicate-only", replicated_reason(op)
    twin = dict(in_place_view_ops()).get(op)
    if twin is not None:
        return "derived", (f"in-place view: enable() applies {twin}'s native strategy to self's spec and local "
                           "tensor, no data moved (inplace_views.py)")
    if has_decomposition(op):
        return None
    twin = dict(written_back_ops()).get(op)
    if twin is not None and registry_of(twin) is None and not has_decomposition(twin) and reaches_decompshard(twin):
        return "replicate-only", (f"no decomposition: enable() runs its functional twin {twin} on replicated inputs "
                                  "and writes the result into self (inplace.py)")
    if reaches_decompshard(op):
        return "replicate-only", "no decomposition: runs on replicated inputs under enable()"
    if torch.Tag.inplace_view in op.tags:
        return "unsupported", (
            "changes self's metadata in place (inplace_view) and has no out-of-place twin with a DTensor strategy "
            "to relabel self by (resize_ reallocates self to a new global shape: no placement says how a shard "
            "grows); DTensor cannot move an in-place op's self")
    return None


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]


def pick_samples(samples: Sequence[Any], k: int) -> list[Any]:
    """The k AtenSamples an op is derived and checked on: the best, then each next the best
    that adds a new tensor-rank signature or new argument values (`sample_pick`), so two
    samples show more of the op than the two largest (pdist's p = 2 and p = 0, not p = 2
    twice). Deterministic: ties keep capture order."""
    return pick_diverse(samples, k)


def shapes_text(args: Any, kwargs: Any) -> str:
    return ", ".join(str(list(t.shape)) for t in _tensors(args, kwargs)) or "no tensors"


# ------------------------------------------------------------------ records


def new_record(op: str) -> dict[str, Any]:
    """The JSON object of one op (see report.py for the schema); filled in by the sweep."""
    return {
        "op": op, "status": "unsupported", "reason": "", "registry": None,
        "derived_rules": [], "n_derived": 0, "n_confirmed": 0, "n_incorrect": 0,
        "n_untestable": 0, "n_truth": 0, "n_missed": 0, "missed": [], "incorrect": [],
        "torch_fallback": {"status": "n/a", "reason": "", "n_rules": 0, "n_confirmed": 0,
                           "n_incorrect": 0, "n_missed": 0, "n_truth": 0, "rules": [], "incorrect": []},
        "verified": False, "seconds": 0.0, "samples": [],
    }


def failed_record(op: str, reason: str, seconds: float = 0.0) -> dict[str, Any]:
    rec = new_record(op)
    rec["reason"], rec["seconds"] = reason, round(seconds, 3)
    return rec


def _score(claimed: Iterable[SingleDimRule], rep: VerifyReport) -> dict[str, Any]:
    """One side's share of a report made over the union of both sides' rules.

    Same matching as `check_rules`: a truth rule is hit by a confirmed claim with the same
    (inputs, outputs); a truth [even] rule only by a claim that is [even] too."""
    mine = set(claimed)
    confirmed = [r for r in rep.confirmed if r in mine]
    incorrect = [(r, why) for r, why in rep.incorrect if r in mine]
    untestable = [r for r, _ in rep.untestable if r in mine]
    truth = rep.ground_truth
    missed: list[SingleDimRule] = []
    n_truth = 0
    if truth is not None and not truth.untestable:
        ok = {(r.key(), r.even_only) for r in confirmed}
        for t in truth.rules:
            hit = (t.key(), True) in ok or (not t.even_only and (t.key(), False) in ok)
            if not hit:
                missed.append(t)
        n_truth = len(truth.rules)
    return {
        "n_confirmed": len(confirmed), "n_incorrect": len(incorrect), "n_untestable": len(untestable),
        "n_truth": n_truth, "n_missed": len(missed), "missed": [format_rule(r) for r in missed],
        "incorrect": [f"{format_rule(r)}: {why}" for r, why in incorrect],
    }


def blocking_summary(derived: DerivedRules) -> str:
    """Why no non-trivial rule survived: the primitives that refused the candidates."""
    where: collections.Counter[str] = collections.Counter()
    for rej in derived.rejected:
        m = re.search(r"no rule of node \d+ \(([^)]+)\)", rej.reason)
        where[m.group(1) if m else rej.reason.split(";")[0][:60]] += 1
    if not where:
        return "no non-trivial rule survives"
    top = ", ".join(f"{k} ({n})" for k, n in where.most_common(3))
    return f"no non-trivial rule survives; blocked at {top}"


def _analyse_sample(op: torch._ops.OpOverload, sample: Sample, verify: bool) -> dict[str, Any]:
    args, kwargs, label = sample
    t0 = time.perf_counter()
    out: dict[str, Any] = {"shapes": shapes_text(args, kwargs), "opinfo": label}
    fresh = lambda: tree_map(exact_clone, (tuple(args), dict(kwargs)))  # noqa: E731
    try:
        a, k = fresh()
        ds = derive_rules(op, *a, **k)
        ds_rules, ds_reason = list(ds.rules), ds.unsupported_reason
        if ds_reason is None and not ds_rules:
            ds_reason = blocking_summary(ds)
            out["replicate_only"] = True
        else:
            out["replicate_only"] = False
    except Exception as e:  # derive_rules should not raise; a crash is a finding
        ds_rules, ds_reason = [], f"derive error: {one_line(e)}"
        out["replicate_only"] = False
    try:
        a, k = fresh()
        tf = torch_fallback_rules(op, a, k)
        tf_rules, tf_reason = list(tf.rules), tf.unsupported_reason
    except Exception as e:
        tf_rules, tf_reason = [], f"error: {one_line(e)}"
    out.update(derived=[format_rule(r) for r in ds_rules], n_derived=len(ds_rules), reason=ds_reason or "")
    tf_out = {"status": "supported" if tf_rules else ("unsupported" if tf_reason else "replicate-only"),
              "reason": tf_reason or "", "rules": [format_rule(r) for r in tf_rules], "n_rules": len(tf_rules)}
    if verify and _tensors(args, kwargs) and torch.Tag.nondeterministic_seeded not in op.tags:
        try:
            a, k = fresh()
            rep = check_rules(op, a, k, list(dict.fromkeys(ds_rules + tf_rules)))
            out.update(_score(ds_rules, rep))
            out["exhaustive"] = rep.exhaustive
            truth = rep.ground_truth
            if truth is not None:  # why data samples were left out, or nothing could be judged
                out["dropped_samples"] = list(truth.dropped_samples)
                if truth.untestable:
                    out["untestable"] = truth.untestable
            tf_out.update({k: v for k, v in _score(tf_rules, rep).items() if k != "missed"})
        except Exception as e:
            out["verify_error"] = one_line(e)
    out["torch_fallback"] = tf_out
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


_SUMMED = ("n_confirmed", "n_incorrect", "n_untestable", "n_truth", "n_missed")


def analyse_op(name: str, samples: Sequence[Sample], verify: bool = True) -> dict[str, Any]:
    """The coverage record of one op: registry lookup, or derive + fallback + verify."""
    t0 = time.perf_counter()
    op = resolve_op(name)
    rec = new_record(str(op))
    reg = registry_of(op)
    if reg is not None:
        rec.update(status="native", registry=reg, reason=f"registered {REGISTRY_LABELS[reg]}")
        return rec
    if is_factory(op):
        rec.update(status="factory", reason=FACTORY)
        return rec
    route = runtime_route(op)
    if route is not None and route[0] == "unsupported":
        rec["reason"] = route[1]
        return rec
    if route is not None:
        rec["reason"] = f"{route[1]}; unchecked: {NO_SAMPLE}"
        if samples:
            from decompshard.coverage.runtime_probe import probe

            ok, why = probe(op, samples)
            rec["status"], rec["reason"] = (route[0], route[1]) if ok else ("unsupported", f"{route[1]}, but {why}")
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        return rec
    if not has_decomposition(op):
        rec["reason"] = "no decomposition (and no DTensor strategy)"
        return rec
    if not samples:
        rec["reason"] = NO_SAMPLE
        return rec
    per = [_analyse_sample(op, s, verify) for s in samples]
    rec["samples"] = per
    rec["derived_rules"] = list(dict.fromkeys(r for s in per for r in s["derived"]))
    rec["missed"] = list(dict.fromkeys(r for s in per for r in s.get("missed", ())))
    rec["incorrect"] = [f"[{s['shapes']}] {x}" for s in per for x in s.get("incorrect", ())]
    rec["n_derived"] = sum(s["n_derived"] for s in per)
    rec["verified"] = any("exhaustive" in s for s in per)
    for key in _SUMMED:
        rec[key] = sum(s.get(key, 0) for s in per)
    tf = rec["torch_fallback"]
    tf["rules"] = list(dict.fromkeys(r for s in per for r in s["torch_fallback"]["rules"]))
    tf["incorrect"] = [f"[{s['shapes']}] {x}" for s in per for x in s["torch_fallback"].get("incorrect", ())]
    for key in ("n_rules", *_SUMMED):
        tf[key] = sum(s["torch_fallback"].get(key, 0) for s in per)
    tf.pop("n_untestable", None)
    tf_status = [s["torch_fallback"]["status"] for s in per]
    tf["status"] = next((st for st in ("supported", "replicate-only") if st in tf_status), "unsupported")
    tf_reasons = [(s["shapes"], s["torch_fallback"]["reason"]) for s in per if s["torch_fallback"]["reason"]]
    if tf["status"] == "supported":
        tf["reason"] = "; ".join(f"on [{sh}]: {why}" for sh, why in tf_reasons)
    else:
        tf["reason"] = tf_reasons[0][1] if tf_reasons else ""
    rec["status"], rec["reason"] = _classify(per, tf["status"])
    rec["seconds"] = round(time.perf_counter() - t0, 3)
    return rec


def _classify(per: list[dict[str, Any]], tf_status: str) -> tuple[str, str]:
    """Status and reason from the per-sample results (best sample wins)."""
    reasons = [s["reason"] for s in per if s["reason"]]
    if any(s["n_derived"] for s in per):
        notes = [f"on [{s['shapes']}]: {s['reason']}" for s in per if s["reason"]]
        return "derived", "; ".join(notes)
    if not any(s["shapes"] != "no tensors" for s in per):
        return "unsupported", "its samples pass no tensor (nothing to shard or check)"
    reason = reasons[0] if reasons else "no non-trivial rule survives"
    if tf_status == "supported":
        return "torch-fallback", reason
    if any(s.get("replicate_only") for s in per) or tf_status == "replicate-only":
        return "replicate-only", reason
    return "unsupported", reason


# ------------------------------------------------------------------ workers


def _run_job(job: tuple) -> dict[str, Any]:
    """A job is `(name, samples, verify)` for `analyse_op`, or `(fn, name, *args)`: any
    module-level function returning a record (the native audit uses this pool too)."""
    return job[0](*job[1:]) if callable(job[0]) else analyse_op(*job)


def _run_payload(payload: bytes) -> dict[str, Any]:
    return _run_job(pickle.loads(payload))


def run_jobs(jobs: Sequence[tuple[str, bytes]], workers: int, timeout: float,
             on_result: Callable[[str, dict[str, Any]], None]) -> None:
    """Run pickled jobs (see `_run_job`) on `workers` processes (0: in this process, no
    timeout), in decompshard's crash-isolating pool (`_workers.run_jobs`). A job that
    raises, crashes its worker or overruns its deadline becomes the op's record as
    unsupported, with the reason."""

    def failed(name: str, reason: str, seconds: float) -> None:
        on_result(name, failed_record(name, reason, seconds))

    _workers.run_jobs([(name, _run_payload, (payload,)) for name, payload in jobs], workers, timeout,
                      on_result, failed)


def needs_worker(op: torch._ops.OpOverload, samples: Sequence[Any]) -> bool:
    """Only ops with samples and no DTensor strategy that derive or need a runtime probe
    do real work; the rest are registry lookups done in the parent."""
    if not samples or registry_of(op) is not None or is_factory(op):
        return False
    route = runtime_route(op)
    return route[0] != "unsupported" if route is not None else has_decomposition(op)


def make_job(name: str, samples: Sequence[Sample], verify: bool) -> tuple[str, bytes]:
    """Pickle one job; a sample that cannot be pickled is dropped."""
    try:
        return name, pickle.dumps((name, list(samples), verify))
    except Exception:
        kept = []
        for s in samples:
            try:
                pickle.dumps(s)
                kept.append(s)
            except Exception:
                continue
        return name, pickle.dumps((name, kept, verify))


def records_for(samples_by_op: Sequence[tuple[torch._ops.OpOverload, Sequence[Sample]]], *, jobs: int,
                timeout: float, verify: bool, bar: Any,
                records: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One record per op: registry lookups here, derivations in the worker pool.

    Shared by the OpInfo sweep and the --model audit, so both classify ops the same way.
    Records are appended to `records` as they finish, so a caller keeps them on Ctrl-C."""
    records = [] if records is None else records
    job_list = []
    for op, samples in samples_by_op:
        if needs_worker(op, samples):
            job_list.append(make_job(str(op), samples, verify))
        else:  # a registry lookup, no sample or no decomposition: nothing to run
            records.append(analyse_op(str(op), []))
            bar.step(str(op), records[-1])

    def done(name: str, record: dict[str, Any]) -> None:
        records.append(record)
        bar.step(name, record)

    try:
        run_jobs(job_list, jobs, timeout, done)
    finally:
        bar.close()
    return records
