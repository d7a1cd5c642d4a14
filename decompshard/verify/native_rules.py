"""Audit one op's native (hand-written) DTensor strategy: find what it gets wrong.

decompshard proves its own rules; DTensor's hand-written strategies have no such proof.
For one op and a few sample calls this module asks two questions:

1. **Rules.** torch's single-dim rules for the call (read through the project's rule
   sources: `rules/torch_single_dim.py`, `rules/torch_op_strategy.py`), each checked by
   the numerical checker (`verify.check_rules_at`) at the world sizes where DTensor would
   apply it: every W in 2..4 that leaves each sharded input dim at least W long (torch's
   `is_tensor_shardable`; `allow_uneven_sharding=False` does *not* mean even shards).
   A refuted rule is reported only when a real DTensor run (`run_on_dtensor`) at its
   input placements gives wrong results too: a rule that DTensor never applies as read
   (say, an op strategy that behaves differently on a real mesh than on the 1-rank
   mesh it is queried on) is listed as unconfirmed, not as wrong.
2. **Dispatch.** The op run once through DTensor on 4 simulated ranks at a few input
   layouts (each tensor input alone sharded or partial, every rule's inputs, all on
   S(0)), at whatever strategy torch picks. What a rule cannot show appears here: a
   custom handler that skips the redistribution its strategy asked for (convolution),
   output metadata that does not match the local tensor.

Both run DTensor with `run_on_dtensor`: the pieces of the DTensor runner of
`dtensor_case.py` (its world, mesh and one-device reference) and the one judge
(`judge.py`: values, shapes, layouts, and refused / local kernel error / ranks disagree
for a run that raised), with the audit's own layouts (the checker's single-dim
placements and Partial parts, or exact ones) and without the runner's chunk mend:
DTensor as torch ships it.

Every finding is a `WrongRule` with the placements, shapes, the max error and a
standalone reproducer script (`native_repro.py`). Entry points: `audit_native_op` (the
confirmed findings) and `audit_native_op_detailed` (counts, unconfirmed refutations).
Ops are run on float64 copies of the samples; random ops are skipped.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

import torch

from decompshard._compat import tree_flatten, tree_unflatten
from decompshard._compat import make_local_tensor, op_strategy_func, single_dim_strategy_info
from decompshard.torch_placements import to_torch_placement
from decompshard.verify.rank_sim import OpCase, input_alphabet, leaves_equal, make_local
from decompshard.dispatch_modes.clean import clean_dispatch_state
from decompshard.errors import one_line
from decompshard.verify.dtensor_case import device_mesh, flatten_call, reference, simulated_world, simulation
from decompshard.verify.judge import (
    LOCAL_KERNEL, METADATA, RANKS_DISAGREE, REFUSED, SHAPE, Verdict, judge, judge_raised,
)
from decompshard.placements import (
    P, R, S, MaybePlacement, Partial, SingleDimRule, format_placement, format_rule, is_shard, shard_size,
)
from decompshard.verify.rule_check import check_rules_at
from decompshard.dispatch_modes import trace
from decompshard.errors import UnsupportedOp
from decompshard.rules import torch_op_strategy, torch_single_dim
from decompshard.verify.native_repro import reproducer
from decompshard._compat import clear_dtensor_caches, has_native_strategy

__all__ = ["DISPATCH", "DISPATCH_WORLD_SIZE", "DTensorRun", "KERNEL_ERROR", "LOCAL_KERNEL", "NativeAudit", "RANKS_DISAGREE",
           "REFUSED", "RULE", "WRONG_SHAPE", "WRONG_VALUES", "WrongRule", "audit_native_op", "audit_native_op_detailed",
           "exact_parts", "native_rules_raw", "run_on_dtensor"]

RULE_WORLD_SIZES = (2, 3, 4)
CONFIRM_SAMPLES = ("base", "zeros")
# ops whose result is uninitialized memory: only shapes can be compared
UNINITIALIZED = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                           "new_empty_strided"})
DISPATCH_WORLD_SIZE = 4
MAX_REPLAYS = 64  # earlier calls of the op tried as the one a wrong run's cached decision came from
# Ops whose DTensor result LocalTensorMode cannot simulate: `equal` all-reduces each
# rank's Python bool, which the simulation collapses to one rank's before the all-reduce
# (every layout comes back True; right on 4 gloo processes, torch 2.13.0, 2.14.1, 2.15.0).
NOT_SIMULATED = {"aten.equal.default": "DTensor all-reduces per-rank Python bools, which LocalTensorMode "
                                       "collapses to one rank's: no ground truth under simulation"}
MAX_DISPATCH_LAYOUTS = 24  # per sample: a handful of ms each
RULE, DISPATCH = "rule", "dispatch"
# what the user sees: silently wrong numbers, a full_tensor() of the wrong shape (the
# output's metadata does not match the local tensors), or the local kernel raising on
# shards DTensor accepted
WRONG_VALUES, WRONG_SHAPE, KERNEL_ERROR = "wrong values", "wrong shape", "local kernel error"


@dataclass
class WrongRule:
    """One wrong behaviour of a native strategy, confirmed by a real DTensor run.

    kind: RULE (a rule in torch's strategy table fails the numerical checker, and DTensor
    applying it gives wrong results) or DISPATCH (DTensor's run at the strategy it picks
    disagrees with one device, or feeds the local kernel shards it cannot take).
    `rule` is torch's rule (RULE) or what DTensor effectively did (DISPATCH: the input
    placements it was given -> the output placements it claimed).
    """

    op: str
    kind: str
    rule: str
    input_placements: list[str]
    output_placements: list[str]  # what DTensor's result claimed (empty when it raised)
    world_size: int
    shapes: list[list[int]]
    dtypes: list[str]
    max_error: float | None  # None: shapes differ, no numbers, or the kernel raised
    effect: str  # WRONG_VALUES | WRONG_SHAPE | KERNEL_ERROR
    empty_shard: bool  # some rank holds an empty shard of a sharded input (a dim shorter than 2W-ish)
    reason: str  # the DTensor run's verdict, one line
    checker: str = ""  # the numerical checker's verdict (RULE findings)
    sample: str = ""  # OpInfo name, and the data variant when not the caller's values
    # wrong only after another call of the op (DTensor reuses its cached decision for
    # that call: a cache key without an argument the two calls differ in): that call
    after: str = ""
    script: str = ""  # a standalone reproducer (prints REPRODUCED / NOT REPRODUCED)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class NativeAudit:
    """Everything `audit_native_op_detailed` found for one op."""

    op: str
    wrong: list[WrongRule] = field(default_factory=list)
    unconfirmed: list[dict[str, Any]] = field(default_factory=list)  # refuted rules DTensor got right
    n_samples: int = 0
    n_rules: int = 0  # non-trivial (rule, sample) pairs checked
    n_refuted: int = 0
    n_dispatch_runs: int = 0
    skipped: str = ""  # why nothing was checked
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


# ------------------------------------------------------------------ one DTensor run, in the audit's words


# How a DTensor run ended when it did not return (REFUSED, LOCAL_KERNEL, RANKS_DISAGREE):
# the one judge's words, `judge.error_kind`.


@dataclass
class DTensorRun:
    """What DTensor did with one op call at one input layout."""

    world_size: int
    input_placements: tuple[MaybePlacement, ...]
    output_placements: list[str] = field(default_factory=list)  # per output leaf, torch's words
    ok: bool = True  # every rank's full_tensor() of every output equals the single-device result
    max_error: float | None = None  # largest |difference| (inf: shapes differ; None: no numbers)
    reason: str = ""  # why not ok, in one line
    error_kind: str | None = None  # REFUSED / LOCAL_KERNEL / RANKS_DISAGREE when the call raised
    wrong_shape: bool = False  # some rank's full_tensor() has another shape than one device's

    @property
    def wrong(self) -> bool:
        """Silently wrong numbers or metadata, or a kernel fed shards it cannot take."""
        return not self.ok and self.error_kind != REFUSED


def exact_parts(x: torch.Tensor, p: Partial, world_size: int, seed: int, salt: int) -> list[torch.Tensor]:
    """Parts whose reduction is exactly `x`, in any summation order: P(sum) is
    [2x, -x, 0, ...] (inf and NaN whole on rank 0), P(avg) the same times W (W a power
    of two), P(max|min) the
    checker's random parts (a max is exact anyway). Rounding in a reduction DTensor
    performs would otherwise move a value across a kink (sqrt at 0, a cast to int, an
    `eq`) and look like a bug."""
    if p.reduce_op in ("max", "min") or x.dtype == torch.bool:
        return make_local(x, p, world_size, (seed, False), salt)
    scale = world_size if p.reduce_op == "avg" else 1
    if p.reduce_op == "avg" and (world_size & (world_size - 1)):
        return make_local(x, p, world_size, (seed, False), salt)
    zero = torch.zeros_like(x)
    if world_size < 2:
        return [x.clone()]
    finite = torch.isfinite(x)  # inf and NaN stay whole on rank 0 (inf - inf would be NaN)
    parts = [torch.where(finite, 2 * scale * x, x), torch.where(finite, -scale * x, zero)]
    return [q.contiguous() for q in parts + [zero] * (world_size - 2)]


def _placement_words(value: Any) -> str:
    """One output leaf's placements as torch writes them (or what it is instead)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        return ", ".join(str(p) for p in value.placements)
    return "not a DTensor" if isinstance(value, torch.Tensor) else "not a tensor"


def _refused(run: DTensorRun, reason: str) -> DTensorRun:
    run.ok, run.reason, run.error_kind = False, reason, REFUSED
    return run


def run_on_dtensor(op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None,
                   placements: Sequence[MaybePlacement], world_size: int, *, seed: int = 0,
                   exact: bool = True, values: bool = True) -> DTensorRun:
    """Lay the call's tensor inputs out as `placements` (one single-dim placement per
    tensor input, in flattened schema order) on a 1-D mesh of `world_size` simulated
    ranks, run `op` through DTensor, and compare every rank's full result with one device.

    `exact`: Partial inputs get `exact_parts` (else the checker's random parts for
    `seed`, to reproduce a checker verdict). `values=False` compares shapes and dtypes
    only (ops that return uninitialized memory). Needs a fake process group of at least
    `world_size` ranks (`simulated_world`).
    """
    flat, spec, pos = flatten_call(args, kwargs)
    run = DTensorRun(world_size, tuple(placements))
    if len(pos) != len(placements):
        raise ValueError(f"{len(placements)} placements for {len(pos)} tensor inputs")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = reference(op, flat, spec, pos, seed, backward=False).outputs
            if values and not leaves_equal(ref, reference(op, flat, spec, pos, seed, backward=False).outputs):
                return _refused(run, "one device is not reproducible")
    except Exception as e:
        return _refused(run, f"one device raises: {one_line(e, 200)}")
    # every rank's shard, made before entering the mode (under it, each tensor op
    # on a plain tensor would itself return a per-rank LocalTensor)
    try:
        parts = [[q.clone() for q in (exact_parts(flat[i], p, world_size, seed, k)
                                      if exact and isinstance(p, Partial)
                                      else make_local(flat[i], p, world_size, (seed, False), salt=k))]
                 for k, (i, p) in enumerate(zip(pos, placements))]
    except Exception as e:  # no such layout (a Partial bool, a P(max) complex)
        return _refused(run, f"cannot lay out the inputs: {one_line(e, 200)}")
    try:
        verdict, run.output_placements = _run_laid_out(op, flat, spec, dict(zip(pos, zip(placements, parts))),
                                                       world_size, ref, values)
    except Exception as e:
        verdict = judge_raised(e)
    run.ok, run.reason, run.max_error = verdict.ok, verdict.detail, verdict.max_error
    run.error_kind = verdict.kind if verdict.kind in (REFUSED, LOCAL_KERNEL, RANKS_DISAGREE) else None
    run.wrong_shape = verdict.kind in (SHAPE, METADATA)
    return run


def _run_laid_out(op: Any, flat: list, spec: Any, laid: dict[int, tuple[MaybePlacement, list]],
                  world_size: int, ref: list[Any], values: bool) -> tuple[Verdict, list[str]]:
    """The call on DTensors made of the given per-rank parts (flat index -> placement,
    parts) on the 1-D mesh, every rank simulated and DTensor unmended: the judge's
    verdict on its outputs (a plain tensor judged rank by rank) and the placements each
    output claims."""
    from torch.distributed.tensor import DTensor

    mesh = device_mesh((world_size,))
    with simulation(world_size, mend_chunks=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        new = list(flat)
        for i, (p, local) in laid.items():
            x = flat[i]
            lt = make_local_tensor({r: local[r] for r in range(world_size)})
            new[i] = DTensor.from_local(lt, mesh, [to_torch_placement(p)], run_check=False,
                                        shape=x.shape, stride=x.stride())
        dargs, dkwargs = tree_unflatten(new, spec)
        outs = tree_flatten(op(*dargs, **dkwargs))[0]
        words = [_placement_words(o) for o in outs]
        return judge(outs, ref, what="output", plain="per-rank", values=values, mesh=mesh), words


# ------------------------------------------------------------------ torch's rules, raw


def native_rules_raw(op: torch._ops.OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> list[SingleDimRule]:
    """torch's own non-trivial rules for this call, as torch states them: none of the
    conditions or extras decompshard adds when it uses them as primitive rules, and
    without the [even] mark (torch applies its rules to uneven shards)."""

    source = torch_single_dim if single_dim_strategy_info(op) is not None else (
        torch_op_strategy if op_strategy_func(op) is not None else None)
    if source is None:
        return []
    with clean_dispatch_state():
        try:  # the op itself as the one "primitive" of its own graph
            graph = trace(op, tuple(args), dict(kwargs), lambda _: True, decomp=op)
        except UnsupportedOp:
            return []
        if len(graph.nodes) != 1:
            return []
        try:
            found = source.rules(graph.nodes[0]) or []
        except Exception:  # a strategy function that rejects the call: nothing to check
            return []
    out: dict[tuple, SingleDimRule] = {}
    for r in found:
        rule = SingleDimRule(r.inputs, r.outputs, False, r.source)
        if not rule.is_trivial():
            out.setdefault(rule.key(), rule)
    return list(out.values())


def world_sizes_for(rule: SingleDimRule, tensors: Sequence[torch.Tensor]) -> list[int]:
    """The W at which DTensor would apply the rule: each sharded input dim >= W."""
    sizes = [int(t.shape[p.dim]) for p, t in zip(rule.inputs, tensors) if is_shard(p) and p.dim < t.dim()]
    return [w for w in RULE_WORLD_SIZES if all(s >= w for s in sizes)]


# ------------------------------------------------------------------ layouts to dispatch


def _dispatch_layouts(tensors: Sequence[torch.Tensor], rules: Iterable[SingleDimRule]) -> list[tuple]:
    """Input layouts for the DTensor runs: each input alone sharded on each dim (or
    P(sum) if floating), every rule's inputs, every input on S(0), and (3 inputs or
    more) all but one on S(0); all-R excluded."""
    n = len(tensors)
    base = (R,) * n
    out: list[tuple] = []
    for i, t in enumerate(tensors):
        for p in input_alphabet(t):
            if p == R or (isinstance(p, Partial) and p != P("sum")):
                continue
            out.append(base[:i] + (p,) + base[i + 1:])
    out += [tuple(r.inputs) for r in rules]
    if n > 1 and all(t.dim() >= 1 for t in tensors):
        out.append((S(0),) * n)
        if n > 2:  # all but one on S(0): a layer's weight and bias on out-features, its input replicated
            out += [(S(0),) * i + (R,) + (S(0),) * (n - i - 1) for i in range(n)]
    seen = list(dict.fromkeys(c for c in out if any(p != R for p in c)))
    return seen[:MAX_DISPATCH_LAYOUTS]


# ------------------------------------------------------------------ the audit


def _tensors(args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    return [x for x in tree_flatten((tuple(args), dict(kwargs)))[0] if isinstance(x, torch.Tensor)]


def _unpack(sample: Any) -> tuple[tuple, dict, str]:
    """(args, kwargs, label) from an AtenSample, an (args, kwargs[, label]) tuple."""
    if hasattr(sample, "args") and hasattr(sample, "kwargs"):
        return tuple(sample.args), dict(sample.kwargs), getattr(sample, "opinfo_name", "")
    args, kwargs, *rest = sample
    return tuple(args), dict(kwargs or {}), (rest[0] if rest else "")


def _finding(op: Any, kind: str, rule: str, run: DTensorRun, args: tuple, kwargs: dict,
             label: str, checker: str = "", after: tuple | None = None) -> WrongRule:

    ts = _tensors(args, kwargs)
    if run.error_kind == LOCAL_KERNEL:
        effect = KERNEL_ERROR
    else:
        effect = WRONG_SHAPE if run.wrong_shape else WRONG_VALUES
    empty = any(shard_size(int(t.shape[p.dim]), run.world_size, r) == 0
                for p, t in zip(run.input_placements, ts) if is_shard(p) for r in range(run.world_size))
    return WrongRule(
        op=str(op), kind=kind, rule=rule,
        input_placements=[format_placement(p) for p in run.input_placements],
        output_placements=list(run.output_placements), world_size=run.world_size,
        shapes=[list(t.shape) for t in ts], dtypes=[str(t.dtype).replace("torch.", "") for t in ts],
        max_error=None if run.max_error is None or run.max_error == float("inf") else run.max_error,
        effect=effect, empty_shard=empty, reason=run.reason, checker=checker, sample=label,
        after="" if after is None else _call_words(*after),
        script=reproducer(op, args, kwargs, run.input_placements, run.world_size,
                          values=op._opname not in UNINITIALIZED, after=after),
    )


def _call_words(args: tuple, kwargs: dict, layout: tuple) -> str:
    """An earlier call in a few words: its placements, shapes and other arguments."""
    flat = tree_flatten((args, kwargs))[0]
    shapes = [list(x.shape) for x in flat if isinstance(x, torch.Tensor)]
    other = [x for x in flat if not isinstance(x, torch.Tensor)]
    return (f"the op on ({', '.join(format_placement(p) for p in layout)}), shapes {shapes}, "
            f"other arguments {other!r}")


def _applied(run: DTensorRun, rule: SingleDimRule) -> bool:
    """DTensor ran this very rule: its result claims the rule's output placements (or the
    local kernel failed on the shards, or the ranks disagreed, before it could claim any)."""
    if run.error_kind in (LOCAL_KERNEL, RANKS_DISAGREE):
        return True
    claimed = [p for p in run.output_placements if p not in ("not a DTensor", "not a tensor")]
    return claimed == [format_placement(p) for p in rule.outputs if p is not None]


def _confirm(op: Any, case: OpCase, rule: SingleDimRule, w: int) -> tuple[DTensorRun | None, str]:
    """A DTensor run at the rule's inputs where DTensor applies the rule and gets it
    wrong, on the caller's values or all zeros (values every op accepts: the checker's
    other variants can break an op's preconditions, such as bucketize's sorted
    boundaries, or bring inf - inf into a Partial) with the checker's own Partial draws;
    (None, what DTensor did instead) if there is none."""
    last = None
    seeds = (0, 1, 2) if any(isinstance(p, Partial) for p in rule.inputs) else (0,)
    for sample in case.samples:
        if sample.name not in CONFIRM_SAMPLES:
            continue
        args, kwargs = tree_unflatten(list(sample.leaves), case.spec)
        for seed in seeds:
            run = run_on_dtensor(op, args, kwargs, rule.inputs, w, seed=seed, exact=False)
            if run.wrong and _applied(run, rule):
                return run, sample.name
            last = run
    if last is None:
        return None, "no sample to confirm on"
    if last.ok:
        return None, f"DTensor gives the right result (claims {', '.join(last.output_placements)})"
    if last.wrong:
        return None, f"DTensor is wrong but not by this rule (claims {', '.join(last.output_placements)})"
    return None, f"DTensor refuses: {last.reason}"


def audit_native_op_detailed(op: torch._ops.OpOverload, samples: Sequence[Any], *,
                             dispatch: bool = True) -> NativeAudit:
    """Check `op`'s native rules on each sample and run it through DTensor; see the
    module docstring. `samples`: AtenSamples or (args, kwargs[, label]) tuples."""
    t0 = time.perf_counter()
    audit = NativeAudit(str(op))
    if single_dim_strategy_info(op) is None and op_strategy_func(op) is None:

        audit.skipped = ("only a legacy propagation rule (not readable as single-dim rules)"
                         if has_native_strategy(op) else "no native strategy")
        if not has_native_strategy(op):
            audit.seconds = round(time.perf_counter() - t0, 3)
            return audit
    if torch.Tag.nondeterministic_seeded in op.tags or str(op) in NOT_SIMULATED:
        audit.skipped = NOT_SIMULATED.get(str(op), "random op: no ground truth")
        audit.seconds = round(time.perf_counter() - t0, 3)
        return audit
    seen: set[tuple] = set()
    history: list[tuple] = []  # (args, kwargs, layout) of every DTensor run so far, in order
    values = op._opname not in UNINITIALIZED
    if not values:
        audit.notes.append("uninitialized result: rules not checked, DTensor runs compare shapes only")
    with simulated_world(max(RULE_WORLD_SIZES + (DISPATCH_WORLD_SIZE,))):
        for sample in samples:
            args, kwargs, label = _unpack(sample)
            ts = _tensors(args, kwargs)
            if not ts:
                continue
            audit.n_samples += 1
            rules = native_rules_raw(op, args, kwargs) if not audit.skipped else []
            if values:
                _audit_rules(op, args, kwargs, label, rules, audit, seen)
            if dispatch:
                _audit_dispatch(op, args, kwargs, label, rules, audit, seen, values, history)
    audit.seconds = round(time.perf_counter() - t0, 3)
    return audit


def _audit_rules(op, args, kwargs, label, rules, audit: NativeAudit, seen: set) -> None:
    ts = _tensors(args, kwargs)
    plan = [(r, world_sizes_for(r, ts)) for r in rules]
    plan = [(r, ws) for r, ws in plan if ws]
    if not plan:
        return
    audit.n_rules += len(plan)
    verdicts = check_rules_at(op, args, kwargs, plan)
    refuted = [v for v in verdicts if v.ok is False]
    audit.n_refuted += len(refuted)
    if not refuted:
        return
    case = OpCase(op, args, kwargs)
    for v in refuted:
        w = v.world_sizes[0] if v.world_sizes else RULE_WORLD_SIZES[0]
        run, where = _confirm(op, case, v.rule, w)
        text = format_rule(v.rule)
        if run is None:
            audit.unconfirmed.append({"rule": text, "world_size": w, "checker": v.reason, "dtensor": where,
                                      "shapes": [list(t.shape) for t in ts], "sample": label})
            continue
        key = (RULE, text, tuple(tuple(t.shape) for t in ts))
        if key in seen:
            continue
        seen.add(key)
        c_args, c_kwargs = tree_unflatten(list(next(s for s in case.samples if s.name == where).leaves), case.spec)
        audit.wrong.append(_finding(op, RULE, text, run, c_args, c_kwargs,
                                    label + ("" if where == "base" else f" ({where} values)"), v.reason))


def _audit_dispatch(op, args, kwargs, label, rules, audit: NativeAudit, seen: set, values: bool,
                    history: list[tuple]) -> None:
    ts = _tensors(args, kwargs)
    for layout in _dispatch_layouts(ts, rules):
        run = run_on_dtensor(op, args, kwargs, layout, DISPATCH_WORLD_SIZE, values=values)
        audit.n_dispatch_runs += 1
        history.append((args, kwargs, layout))
        if not run.wrong:
            continue
        ins = ", ".join(format_placement(p) for p in layout)
        outs = ", ".join(run.output_placements) if run.output_placements else (
            "local kernel error" if run.error_kind == LOCAL_KERNEL else "ranks disagree")
        rule = f"{ins} -> {outs}"
        key = (DISPATCH, rule, tuple(tuple(t.shape) for t in ts))
        if key in seen:
            continue
        seen.add(key)
        alone, after = _wrong_after(op, (args, kwargs, layout), history[:-1], values)
        if not alone and after is None:
            audit.unconfirmed.append({"rule": rule, "world_size": DISPATCH_WORLD_SIZE, "checker": "",
                                      "dtensor": "wrong only in the sweep's sequence of calls, not reproduced",
                                      "shapes": [list(t.shape) for t in ts], "sample": label})
            continue
        audit.wrong.append(_finding(op, DISPATCH, rule, run, args, kwargs, label, after=after))


def _wrong_after(op: Any, call: tuple, earlier: list[tuple], values: bool) -> tuple[bool, tuple | None]:
    """Whether a wrong DTensor run is wrong on its own (DTensor's caches cleared first),
    and if not, the latest earlier call of the op after which it is (DTensor reused the
    decision it cached for that call), or None."""
    clear_dtensor_caches()
    if run_on_dtensor(op, *call, DISPATCH_WORLD_SIZE, values=values).wrong:
        return True, None
    for prior in reversed(earlier[-MAX_REPLAYS:]):
        clear_dtensor_caches()
        run_on_dtensor(op, *prior, DISPATCH_WORLD_SIZE, values=values)
        if run_on_dtensor(op, *call, DISPATCH_WORLD_SIZE, values=values).wrong:
            return False, prior
    return False, None


def audit_native_op(op: torch._ops.OpOverload, samples: Sequence[Any]) -> list[WrongRule]:
    """The confirmed wrong behaviours of `op`'s native strategy on these samples (empty:
    nothing found). `samples`: AtenSamples or (args, kwargs[, label]) tuples. Needs no
    process group of its own (a fake one is set up for the duration) and refuses to run
    beside a real one."""
    return audit_native_op_detailed(op, samples).wrong


