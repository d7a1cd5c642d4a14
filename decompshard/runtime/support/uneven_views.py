"""Uneven shards through DTensor's view strategies: redistributed instead of refused.

DTensor's view propagator (`_view_ops.py`: view, reshape, _unsafe_view, squeeze,
unsqueeze, expand, permute, transpose, ...) refuses a view that merges or splits an
unevenly sharded dim: `F.linear` flattens its input, so every transformer with an uneven
data-parallel batch stops at its first linear layer with "Cannot flatten unevenly sharded
tensor" (timm's ViT under TP: "Cannot unflatten ..."). It also accepts some uneven layouts
whose local views are not what it claims ([6, 8, 16] on (S(0), S(0)) of a 2x2 mesh
flattened claims local rows 12, 12, 12, 12; the local views give 16, 8, 16, 8). The
local view runs, but its result is no `Shard` layout, so the input must move first.

Under `enable()` each view-family entry of DTensor's strategy table is wrapped:

1. DTensor's answer is kept when its input layout is even, or when on every rank the
   local op, run as DTensor runs it, gives the local shape the answer's placements claim.
2. Otherwise the sharded mesh dims are moved, the fewest first, each to Replicate or to
   Shard of another dim, keeping what the native strategy accepts and what passes the same
   check (all-Replicate always does). Each survivor is priced by DTensor's own estimate
   (`mesh/cost.dtensor_redistribute_cost`): the move from the current layout plus the move
   back to it, since the ops around the view want the layout the program holds. The
   cheapest is taken, and DTensor redistributes the input as for any op.

A view's backward is a view of the gradient and takes the same path. In-place views
(`squeeze_`) keep DTensor's answer: their `self` cannot be moved. Moved tensors are made
contiguous (support/kwarg_routing.py): an uneven Shard(a) -> Shard(b) move leaves a
narrowed slice of torch's padded all-to-all buffer, which a merging view cannot read.

Limits: a redistributed view is a view of the moved copy, so an in-place write to it does
not reach the input (each op warns once, saying so; views made inside a decomposition are
never written to). The price is communication only: Replicate runs the view's consumer
on the whole batch on every rank. `disable()` puts the original entries back. Tests:
tests/test_uneven_views.py, tests/test_vision_uneven.py.
"""

from __future__ import annotations

import itertools
import math
from typing import Any, Callable, Iterator

import torch

from decompshard._compat import DTensorSpec, OpSchema, OpSpec, OpStrategy, TorchReplicate, TorchShard, TorchStridedShard, sharding_propagator, view_family_ops, view_shape_arg_index
from decompshard.mesh.lift import local_shape_nd
from decompshard.errors import one_line
from decompshard.runtime.table_patches import Entry, WarnOnce
from decompshard.dispatch_modes.clean import clean_dispatch_state
from decompshard.mesh.cost import dtensor_redistribute_cost

__all__ = ["entries"]


def entries(warn_once: WarnOnce) -> Iterator[Entry]:
    """Every view-family entry of DTensor's strategy table, wrapped (`enable()` installs them)."""
    table = sharding_propagator().op_strategy_funcs
    for op in view_family_ops():
        if op._schema.is_mutable:  # squeeze_: DTensor cannot move self (it would relabel a copy)
            continue
        yield table, op, _redistributing_view_strategy(op, table[op], warn_once)


def _redistributing_view_strategy(op: torch._ops.OpOverload, native: Callable, warn_once: WarnOnce) -> Callable:
    def strategy(op_schema: Any) -> Any:
        source = op_schema.args_schema[0] if op_schema.args_schema else None
        if not isinstance(source, OpStrategy) or len(source.strategies) != 1:
            return native(op_schema)  # not a dispatch-time question: leave it to DTensor
        spec = source.strategies[0].output_spec
        if any(not isinstance(s, int) for s in spec.tensor_meta.shape):
            return native(op_schema)  # symbolic shapes: nothing to check here
        try:
            answer = native(op_schema)
        except RuntimeError as e:
            refusal: str = one_line(e, with_type=False)
        else:
            if not _uneven(spec) or all(_fits(op, op_schema, s) for s in answer.strategies):
                return answer
            refusal = f"its answer {_placements_text(answer.strategies[0])} does not match the local views"
        found = _redistributed(op, op_schema, native, spec)
        if not found:  # pragma: no cover - all-Replicate always fits
            raise RuntimeError(f"decompshard: {op}: no layout of {spec} that DTensor's view strategy "
                               f"accepts ({refusal})")
        best = min(found, key=lambda s: sum(itertools.chain.from_iterable(s.redistribute_cost)))
        warn_once(f"view:{op}", (
            f"decompshard: {op} on {_spec_text(spec)}: DTensor's view strategy refuses it ({refusal}); "
            f"redistributing the input to {tuple(best.input_specs[0].placements)} first "
            f"(cheapest valid layout by DTensor's cost model, the move back included). The result views that copy: "
            f"an in-place write to it does not reach the input"))
        return OpStrategy(found)

    strategy.__wrapped__ = native  # type: ignore[attr-defined]
    return strategy


def _redistributed(op: Any, op_schema: Any, native: Callable, spec: Any) -> list:
    """Native answers for the input moved on the fewest mesh dims, each checked and
    priced from the current layout."""
    current = tuple(spec.placements)
    sharded = [m for m, p in enumerate(current) if isinstance(p, (TorchShard, TorchStridedShard))]
    ndim = len(spec.tensor_meta.shape)
    for k in range(1, len(sharded) + 1):
        found = []
        seen = set()
        for moved in itertools.combinations(sharded, k):
            options = [[TorchReplicate()] + [TorchShard(d) for d in range(ndim)
                                             if not (type(current[m]) is TorchShard and current[m].dim == d)]
                       for m in moved]
            for choice in itertools.product(*options):
                placements = list(current)
                for m, p in zip(moved, choice):
                    placements[m] = p
                candidate = DTensorSpec(spec.mesh, tuple(placements), tensor_meta=spec.tensor_meta)
                schema = OpSchema(op_schema.op, (OpStrategy([OpSpec(candidate)]),) + tuple(op_schema.args_schema[1:]),
                                  op_schema.kwargs_schema, schema_info=op_schema.schema_info)
                try:
                    answer = native(schema)
                except RuntimeError:
                    continue
                for s in answer.strategies:
                    target = s.input_specs[0]
                    key = (tuple(target.placements), _placements_text(s))
                    if key in seen or not _fits(op, op_schema, s):
                        continue
                    seen.add(key)
                    back = DTensorSpec(spec.mesh, tuple(target.placements), tensor_meta=spec.tensor_meta)
                    cost = dtensor_redistribute_cost(spec, target) + dtensor_redistribute_cost(back, spec)
                    found.append(OpSpec(s.output_specs, input_specs=s.input_specs, redistribute_cost=[[cost]]))
        if found:
            return found
    return []


def _uneven(spec: Any) -> bool:
    """Whether some rank's local shape differs from another's."""
    shapes = {tuple(local_shape_nd(spec.tensor_meta.shape, spec.placements, tuple(spec.mesh.shape), c)) for c in _coords(tuple(spec.mesh.shape))}
    return len(shapes) > 1


def _coords(mesh_shape: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    return itertools.product(*(range(s) for s in mesh_shape))


def _fits(op: Any, op_schema: Any, answer: Any) -> bool:
    """On every rank, the local op DTensor will run (its input moved to the answer's
    input layout, a size argument made local) returns the local shape the answer's
    output placements claim."""

    in_spec = answer.input_specs[0]
    out_spec = answer.output_specs
    if not isinstance(out_spec, DTensorSpec):
        return True
    tm = in_spec.tensor_meta
    rest = list(op_schema.args_schema[1:])
    shape_idx = view_shape_arg_index(op)
    with clean_dispatch_state():
        global_out = tuple(op(torch.empty(tm.shape, dtype=tm.dtype, device="meta"), *rest,
                              **op_schema.kwargs_schema).shape)
        if not any(isinstance(p, (TorchShard, TorchStridedShard)) for p in out_spec.placements):
            return True  # the local op is the global op: DTensor's meta run already made it
        checked = set()
        for coord in _coords(tuple(in_spec.mesh.shape)):
            local_in = local_shape_nd(tm.shape, in_spec.placements, tuple(in_spec.mesh.shape), coord)
            claimed = local_shape_nd(global_out, out_spec.placements, tuple(out_spec.mesh.shape), coord)
            if (local_in, claimed) in checked:
                continue
            checked.add((local_in, claimed))
            args = [torch.empty(local_in, dtype=tm.dtype, device="meta")] + list(rest)
            if shape_idx is not None:  # DTensor makes the size argument local (the output is sharded)
                args[shape_idx] = list(claimed)
            try:
                got = tuple(op(*args, **op_schema.kwargs_schema).shape)
            except RuntimeError:
                return False
            if got != claimed or math.prod(got) != math.prod(claimed):
                return False
    return True


def _placements_text(s: Any) -> str:
    out = s.output_specs
    return str(tuple(out.placements)) if isinstance(out, DTensorSpec) else str(out)


def _spec_text(spec: Any) -> str:
    tm = spec.tensor_meta
    return f"{list(tm.shape)}{tuple(spec.placements)}"
