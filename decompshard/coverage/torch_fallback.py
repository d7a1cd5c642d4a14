"""What torch's own decomposition fallback derives, in our rule format.

torch 2.13 ships a fallback for ops with a decomposition but no DTensor strategy:
`torch.distributed.tensor._decompositions.DecompShardingStrategy`. On a DTensor call it

1. builds candidate input placements from the placements *present on the inputs*
   (plus Replicate, with Shard expanded to every tensor dim),
2. for each candidate re-traces the decomposition on meta tensors of the global shape
   under `PlacementTrackingMode`, on a fake 1-rank mesh, asking the full sharding
   propagator at every inner op and raising `RuntimeError` whenever an inner op would
   need its inputs redistributed,
3. aborts the whole op on `NotImplementedError` / `GuardOnDataDependentSymNode`
   (a factory op such as `zeros` inside the decomposition, an inner op with neither a
   strategy nor a decomposition, ...), drops the candidate on
   `RuntimeError`/`KeyError`/`IndexError`.

`torch_fallback_rules` runs torch's own step 2 (`DecompShardingStrategy.
_propagate_through_decomp`, not a copy) over the WHOLE single-dim alphabet, so we can
compare what torch can derive with what we derive. `torch_fallback_first_call` times the
call a real DTensor dispatch makes when every input is `Shard(0)`.

Placement translation: ours -> torch for inputs (`S(d)` -> `Shard(d)`, `R` ->
`Replicate()`, `P(x)` -> `Partial(x)`); torch -> ours for outputs (`Shard(d)` and
`_StridedShard(d, ...)` -> `S(d)`, `Replicate()` -> `R`, `Partial(x)` -> `P(x)`,
`None` -> `None`). Two Partial subclasses need care: `_MaskPartial` (masked lookups) is a
true pending sum -> `P(reduce_op)`; `_NormPartial(p)` is a pending p-norm (combine by
sum of p-th powers), which is `P(sum)` only for p in {0, 1} (`P(max)`/`P(min)` for
+-inf) and otherwise has no counterpart in our alphabet: such torch rules are reported
in `FallbackResult.unrepresentable`, not in `.rules`.

Private torch APIs are used (`_propagate_through_decomp`, `_get_fake_mesh`,
`propagate_op_sharding.cache_clear`, ...); all of them live in this module.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import torch

from decompshard._compat import OpOverload
from decompshard._compat import tree_flatten, tree_map

from decompshard.torch_placements import to_torch_placement
from decompshard.errors import one_line
from decompshard.placements import (
    PARTIALS,
    MaybePlacement,
    Partial,
    R,
    ShardPlaceholder,
    SingleDimRule,
    format_placement,
)

__all__ = [
    "FallbackResult",
    "FirstCallResult",
    "UnrepresentablePlacement",
    "default_candidates",
    "from_torch_placement",
    "tensor_inputs",
    "to_torch_placement",
    "torch_fallback_first_call",
    "torch_fallback_first_call_details",
    "torch_fallback_rules",
]

SOURCE = "torch-fallback"


# ----------------------------------------------------------------------------- results


@dataclass
class FallbackResult:
    """What torch's fallback derives for one op and one set of (global) input shapes.

    rules: the non-trivial rules found (`source="torch-fallback"`), in candidate order.
    unsupported_reason: None if torch's fallback handles the op; otherwise one line
        saying why the whole op is rejected (torch would raise NotImplementedError on
        dispatch).
    seconds: wall time of the derivation.
    n_candidates: candidate input-placement combinations tried.
    n_accepted: candidates torch accepted (the all-Replicate one included).
    rejected: first line of each per-candidate rejection -> how many candidates.
    unrepresentable: torch rules (in torch's notation) whose output placement has no
        counterpart in our alphabet (e.g. `_NormPartial(2)`), left out of `rules`.
    """

    op: OpOverload
    rules: list[SingleDimRule] = field(default_factory=list)
    unsupported_reason: str | None = None
    seconds: float = 0.0
    n_candidates: int = 0
    n_accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    unrepresentable: list[str] = field(default_factory=list)

    @property
    def supported(self) -> bool:
        return self.unsupported_reason is None

    def rule_strings(self) -> list[str]:
        return [str(r) for r in self.rules]


@dataclass
class FirstCallResult:
    """One timed first DTensor dispatch through torch's fallback (all inputs Shard(0))."""

    seconds: float
    strategies: list[str] | None  # torch's OpStrategy entries, e.g. "(S(0), R) -> S(0)"
    error: str | None  # propagate_strategy raised (first line)
    world: str  # how the 2-rank mesh was made


class UnrepresentablePlacement(ValueError):
    pass


# ----------------------------------------------------------------------------- placements


def _torch_placement_types():
    from torch.distributed.tensor.placement_types import Partial as TPartial, Replicate as TReplicate, Shard as TShard
    from decompshard._compat import TorchStridedShard as _StridedShard

    return TShard, _StridedShard, TReplicate, TPartial


def from_torch_placement(p: Any) -> MaybePlacement:
    """Torch -> ours, for judging torch's claims as generously as they can be read:
    _StridedShard reads as S(d) and a p-norm partial with p in {0, 1, +-inf} as the
    reduction it is (the engine's own conversion, `torch_placements.from_torch_placement`,
    refuses both). Raises UnrepresentablePlacement for e.g. `_NormPartial(2)`."""
    TShard, TStrided, TReplicate, TPartial = _torch_placement_types()
    if p is None:
        return None
    if isinstance(p, (TShard, TStrided)):
        return ShardPlaceholder(p.dim)
    if isinstance(p, TReplicate):
        return R
    if isinstance(p, TPartial):
        norm_type = getattr(p, "norm_type", None)
        if norm_type is not None:  # _NormPartial: pending p-norm
            if norm_type in (0, 1):
                return Partial("sum")
            if norm_type == math.inf:
                return Partial("max")
            if norm_type == -math.inf:
                return Partial("min")
            raise UnrepresentablePlacement(f"{p} (pending {norm_type}-norm)")
        # Partial and _MaskPartial: a pending reduction with `reduce_op`.
        try:
            return Partial(p.reduce_op)
        except ValueError as e:
            raise UnrepresentablePlacement(str(p)) from e
    raise UnrepresentablePlacement(f"{p!r}")


# ----------------------------------------------------------------------------- inputs


def tensor_inputs(args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
    """Tensor inputs in schema order: the tensor leaves of tree_flatten((args, kwargs))."""
    return [x for x in tree_flatten((tuple(args), dict(kwargs)))[0] if isinstance(x, torch.Tensor)]


def _allows_partial(t: torch.Tensor) -> bool:
    return t.dtype.is_floating_point or t.dtype.is_complex


def default_candidates(
    args: Sequence[Any], kwargs: dict[str, Any]
) -> Iterator[tuple[MaybePlacement, ...]]:
    """Every combination over the tensor inputs: R, S(d) for each dim, and for
    floating (or complex) inputs P(sum|avg|max|min). R is first, so the all-R
    combination comes first."""
    per_input = []
    for t in tensor_inputs(args, kwargs):
        opts: list[MaybePlacement] = [R, *(ShardPlaceholder(d) for d in range(t.ndim))]
        if _allows_partial(t):
            opts.extend(PARTIALS)
        per_input.append(opts)
    return itertools.product(*per_input)


def _sharding_propagator():
    from decompshard._compat import sharding_propagator

    return sharding_propagator()


def _specs(args: Sequence[Any], kwargs: dict[str, Any], mesh, placement_of) -> tuple[tuple, dict]:
    """Replace each tensor by a DTensorSpec (global shape/stride/dtype as TensorMeta)."""
    from decompshard._compat import DTensorSpec, TensorMeta

    def to_spec(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            meta = TensorMeta(x.shape, x.stride(), x.dtype)
            return DTensorSpec(mesh, (placement_of(x),), tensor_meta=meta)
        return x

    a, k = tree_map(to_spec, (tuple(args), dict(kwargs)))
    return tuple(a), dict(k)


# ----------------------------------------------------------------------------- rules


def torch_fallback_rules(
    op: OpOverload,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    candidates: Iterable[Sequence[MaybePlacement]] | None = None,
) -> FallbackResult:
    """Run torch's decomposition fallback for every candidate input placement.

    Each candidate gives one placement per tensor input (schema order, lists of tensors
    flattened); default: the whole alphabet (`default_candidates`). For each, torch's
    own `DecompShardingStrategy._propagate_through_decomp` re-traces the decomposition
    on a fake 1-rank mesh with redistribution banned. Error handling mirrors torch's
    `propagate_strategy`: NotImplementedError / GuardOnDataDependentSymNode abort the op
    (so does any other unexpected exception, which torch's sharding propagator turns
    into NotImplementedError); RuntimeError / KeyError / IndexError reject the
    candidate; no accepted candidate at all means torch fails the op too.
    """
    kwargs = dict(kwargs or {})
    result = FallbackResult(op)
    t0 = time.perf_counter()
    try:
        sp = _sharding_propagator()
        ds = sp.decomp_strategy
        result.unsupported_reason = _refused_outright(ds, op, args, kwargs)
        if result.unsupported_reason is not None:
            return result
        call = _fallback_call(ds, op, args, kwargs)
        seen: set[SingleDimRule] = set()
        accepted: list[list[Any]] = []  # torch's single_dim_strategies: outputs + inputs
        for cand in default_candidates(args, kwargs) if candidates is None else candidates:
            cand = tuple(cand)
            full = call.torch_candidate(op, cand)
            result.n_candidates += 1
            if _run_candidate(result, ds, call, cand, full, seen, accepted):
                return result
        _judge_the_op(result, sp, call, accepted)
        return result
    finally:
        result.seconds = time.perf_counter() - t0


def _refused_outright(ds, op: OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> str | None:
    """Why torch's fallback refuses the op before trying any candidate, or None."""
    if not ds.has_decomp(op):
        return f"NotImplementedError: No decomposition found for {op}"
    if not tensor_inputs(args, kwargs):
        # torch's propagate_strategy returns None when no input is a DTensor.
        return "no tensor inputs (torch's fallback needs a DTensor input)"
    return None


@dataclass
class _FallbackCall:
    """The op's call as torch's fallback sees it: its schema on the fake 1-rank mesh,
    and where its DTensorSpecs sit among the flattened leaves (the order of torch's
    `_get_candidate_placements`), which is where a candidate's placements go."""

    mesh: Any
    op_schema: Any
    n_leaves: int
    spec_positions: list[int]

    def torch_candidate(self, op: OpOverload, cand: tuple[MaybePlacement, ...]) -> list[Any]:
        """One torch placement (or None) per leaf: `cand`'s at the tensors' positions."""
        if len(cand) != len(self.spec_positions):
            raise ValueError(
                f"candidate {cand} has {len(cand)} placements; {op} has "
                f"{len(self.spec_positions)} tensor inputs"
            )
        full: list[Any] = [None] * self.n_leaves
        for pos, p in zip(self.spec_positions, cand):
            full[pos] = to_torch_placement(p)
        return full


def _fallback_call(ds, op: OpOverload, args: Sequence[Any], kwargs: dict[str, Any]) -> _FallbackCall:
    from decompshard._compat import DTensorSpec
    from decompshard._compat import OpSchema

    _, _, TReplicate, _ = _torch_placement_types()
    fake_mesh = ds._get_fake_mesh("cpu")
    args_schema, kwargs_schema = _specs(args, kwargs, fake_mesh, lambda _t: TReplicate())
    op_schema = OpSchema(op, args_schema, kwargs_schema)
    # Same leaf order as torch's _get_candidate_placements / to_meta.
    leaves = tree_flatten(list(args_schema) + list(kwargs_schema.values()))[0]
    spec_positions = [i for i, x in enumerate(leaves) if isinstance(x, DTensorSpec)]
    assert len(spec_positions) == len(tensor_inputs(args, kwargs))
    return _FallbackCall(fake_mesh, op_schema, len(leaves), spec_positions)


def _give_up(result: FallbackResult, reason: str) -> None:
    """Torch fails the whole op: no rule of it stands."""
    result.unsupported_reason = reason
    result.rules.clear()
    result.unrepresentable.clear()


def _run_candidate(result: FallbackResult, ds, call: _FallbackCall, cand: tuple[MaybePlacement, ...],
                   full: list[Any], seen: set[SingleDimRule], accepted: list[list[Any]]) -> bool:
    """Torch's step 2 for one candidate, recorded in `result` (and `accepted`, torch's
    single-dim strategies); True when torch gives up on the whole op."""
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    try:
        out = ds._propagate_through_decomp(call.op_schema, tuple(full), call.mesh)
    except (NotImplementedError, GuardOnDataDependentSymNode) as e:
        _give_up(result, one_line(e))
        return True
    except (RuntimeError, KeyError, IndexError) as e:
        reason = one_line(e)
        result.rejected[reason] = result.rejected.get(reason, 0) + 1
        return False
    except Exception as e:  # torch: propagate_strategy raises -> op unsupported
        _give_up(result, one_line(e))
        return True
    result.n_accepted += 1
    outs = out if isinstance(out, tuple) else (out,)
    accepted.append(list(outs) + full)
    _record_rule(result, cand, outs, seen)
    return False


def _record_rule(result: FallbackResult, cand: tuple[MaybePlacement, ...], outs: tuple,
                 seen: set[SingleDimRule]) -> None:
    """An accepted candidate as one of our rules (new, non-trivial ones only), or as an
    unrepresentable torch rule when an output placement has no counterpart here."""
    try:
        ours = tuple(from_torch_placement(p) for p in outs)
    except UnrepresentablePlacement:
        lhs = ", ".join(format_placement(p) for p in cand)
        rhs = ", ".join("None" if p is None else str(p) for p in outs)
        result.unrepresentable.append(f"{lhs} -> {rhs}")
        return
    rule = SingleDimRule(cand, ours, even_only=False, source=SOURCE)
    if rule.is_trivial() or rule in seen:
        return
    seen.add(rule)
    result.rules.append(rule)


def _judge_the_op(result: FallbackResult, sp, call: _FallbackCall, accepted: list[list[Any]]) -> None:
    """After every candidate: torch fails the op when none was accepted, or when its
    expansion of the accepted ones to the mesh fails."""
    if result.n_accepted == 0 and result.n_candidates > 0:
        first = next(iter(result.rejected), "no candidate")
        result.unsupported_reason = (
            "no candidate accepted (torch: 'Sharding propagation should have produced "
            f"at least Replicate() strategy'); first rejection: {first}"
        )
        result.rules.clear()
    elif accepted:
        # torch's propagate_strategy then expands the single-dim strategies to the
        # mesh; a failure there fails the op too (e.g. tensor-list inputs such as
        # _chunk_cat's: "input_specs(2) != strategies(0: 0 args + 0 kwargs)").
        n_outputs = len(accepted[-1]) - call.n_leaves
        reason = _expansion_error(sp, call.op_schema, call.mesh, accepted, n_outputs)
        if reason is not None:
            _give_up(result, f"mesh expansion failed: {reason}")


def _expansion_error(sp, op_schema, mesh, single_dim_strategies, n_outputs) -> str | None:
    """Run torch's expansion step exactly as `propagate_strategy` does; the error, if any."""
    from decompshard._compat import expand_to_full_mesh_op_strategy

    try:
        strategy_schema = sp._wrap_with_op_strategy(op_schema)
        expand_to_full_mesh_op_strategy(
            mesh, strategy_schema, single_dim_strategies, input_index=n_outputs
        )
    except Exception as e:
        return one_line(e)
    return None


# ----------------------------------------------------------------------------- first call


@contextlib.contextmanager
def _two_rank_mesh() -> Iterator[tuple[Any, str]]:
    """A 1-D mesh of 2 ranks for the current process (rank 0).

    With no default process group, a fake one (world size 2) is created for the
    duration and destroyed afterwards, so no global state is left behind for code that
    later initialises its own group. With a group already initialised, the mesh is
    built without touching the backend (`_init_backend=False, _rank=0`).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if dist.is_initialized():
        yield DeviceMesh("cpu", [0, 1], _init_backend=False, _rank=0), "existing-pg"
        return
    from decompshard._compat import fake_store

    dist.init_process_group("fake", rank=0, world_size=2, store=fake_store())
    try:
        yield DeviceMesh("cpu", [0, 1]), "fake-pg(world_size=2)"
    finally:
        dist.destroy_process_group()


def _clear_torch_caches() -> None:
    sp = _sharding_propagator()
    sp.propagate_op_sharding.cache_clear()
    # lru_cache on a method: cache_clear clears it for every instance.
    type(sp)._propagate_tensor_meta_cached.cache_clear()


_WARMED_UP = False


def _warm_up(mesh) -> None:
    """Pay the process's one-time costs (fake-tensor machinery, lazy imports) once, on
    an unrelated op, so they are not billed to the first op timed."""
    global _WARMED_UP
    if _WARMED_UP:
        return
    x = torch.empty(2, 2)
    _time_first_call(torch.ops.aten.mse_loss.default, (x, x), {}, mesh, False)
    _WARMED_UP = True


def _time_first_call(op, args, kwargs, mesh, include_sharding_prop: bool):
    from decompshard._compat import OpSchema

    _, _, TReplicate, _ = _torch_placement_types()
    TShard = _torch_placement_types()[0]
    sp = _sharding_propagator()
    args_schema, kwargs_schema = _specs(
        args, kwargs, mesh, lambda t: TShard(0) if t.ndim > 0 else TReplicate()
    )
    # What DTensor's dispatcher builds (schema_info is None on an op's first call).
    op_schema = OpSchema(op, args_schema, kwargs_schema, schema_info=sp.op_to_schema_info.get(op))
    _clear_torch_caches()
    strategies = error = None
    t0 = time.perf_counter()
    try:
        if include_sharding_prop:
            out_sharding = sp.propagate_op_sharding_non_cached(op_schema)
            strategies = [_describe_output_sharding(out_sharding, op_schema)]
        else:
            sp.decomp_strategy.ensure_schema_info(op)  # torch does this before propagating
            strat = sp.decomp_strategy.propagate_strategy(op_schema)
            strategies = None if strat is None else [str(s) for s in strat.strategies]
    except Exception as e:  # torch's propagator would turn this into NotImplementedError
        error = one_line(e)
    seconds = time.perf_counter() - t0
    _clear_torch_caches()
    return seconds, strategies, error


def _describe_output_sharding(out_sharding: Any, op_schema: Any) -> str:
    """'(S(0), S(0), R) -> S(0) [redistribute]': the chosen input/output placements."""

    def plc(spec: Any) -> str:
        if spec is None:
            return "None"
        return ", ".join(str(p) for p in spec.placements)

    outs = out_sharding.output_spec
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    schema = out_sharding.redistribute_schema or op_schema
    ins = ", ".join(plc(s) for s in schema.args_spec)
    tag = " [redistribute]" if out_sharding.needs_redistribute else ""
    return f"({ins}) -> {', '.join(plc(o) for o in outs)}{tag}"


def torch_fallback_first_call_details(
    op: OpOverload,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    include_sharding_prop: bool = False,
) -> FirstCallResult:
    """Time the first DTensor dispatch of `op` through torch's fallback.

    Every tensor input is a DTensorSpec with `Shard(0)` (0-dim tensors: `Replicate()`)
    on a 1-D mesh of 2 ranks (fake process group), torch's sharding caches are cleared,
    and `DecompShardingStrategy.propagate_strategy` runs on that real OpSchema: its
    candidate set is what `_get_candidate_placements` makes of the inputs ({Replicate,
    Shard(0)} with Shard expanded to every dim), each candidate re-traced on the fake
    1-rank mesh, then expanded to the 2-rank mesh. With `include_sharding_prop` the
    whole `propagate_op_sharding_non_cached` (fake-tensor shape propagation, fallback,
    min-cost strategy selection) is timed instead. One-time process warm-up is excluded.
    """
    kwargs = dict(kwargs or {})
    with _two_rank_mesh() as (mesh, world):
        _warm_up(mesh)
        seconds, strategies, error = _time_first_call(op, args, kwargs, mesh, include_sharding_prop)
    return FirstCallResult(seconds, strategies, error, world)


def torch_fallback_first_call(
    op: OpOverload, args: Sequence[Any], kwargs: dict[str, Any] | None = None
) -> float:
    """Seconds of the first `DecompShardingStrategy.propagate_strategy` call DTensor
    makes when every tensor input is Shard(0) (see `torch_fallback_first_call_details`)."""
    return torch_fallback_first_call_details(op, args, kwargs).seconds
