"""Keyword tensors moved as a strategy asks, and per-op overrides of DTensor's answer.

DTensor redistributes only positional tensor arguments: its propagator builds the
redistribution schema with the caller's kwargs_schema, and OpDispatcher.
redistribute_local_args walks args alone ("very rare that we need to reshard kwargs").
decompshard's strategies name a placement for every tensor, keyword ones included
(SDPA's keyword-only attn_mask). `kwarg_routing_entries()` makes DTensor honour them
(installed by enable()'s patch record, which puts every slot back): the strategy records
its keyword targets with `stage_kwarg_targets` while the propagator runs, the
propagator's answer (cached with it, so cache hits carry it too) gets a redistribution
schema naming the moves, and the dispatcher's redistribute_local_args performs them after
the positional ones. The same wrapper lays every moved tensor out contiguously
(`_densify_moved_args`).

The same propagator consults `sharding_overrides()` (per-op replacements of DTensor's
answer) and re-raises an error of the decomposition fallback that is marked
`reaches_caller` as itself."""

from __future__ import annotations

import threading
from typing import Any, Iterator

import torch

from decompshard._compat import (DTensorSpec, OpSchema, op_dispatcher, propagation_cache_type, redistribute_local_tensor,
                                 sharding_propagator, tree_leaves)

__all__ = ["kwarg_routing_active", "kwarg_routing_entries", "sharding_overrides", "stage_kwarg_targets"]

_staged = threading.local()


class _KwargMovingSchema(OpSchema):
    """A redistribution schema that also moves keyword tensors: `kwarg_moves` maps a
    keyword to (current spec, target spec). DTensor's propagation cache key includes the
    keyword specs, so the current spec recorded here is the caller's on every cache hit."""

    kwarg_moves: dict[str, tuple[Any, Any]]


def kwarg_routing_active() -> bool:
    """Whether a strategy function running now may move keyword tensors: DTensor's
    propagator, wrapped by `kwarg_routing_entries`, is the caller (only an installed
    wrapper pushes onto the stack)."""
    return bool(getattr(_staged, "stack", None))


def stage_kwarg_targets(targets: dict[str, Any]) -> None:
    """Called by a strategy function while DTensor's propagator runs it (see
    `kwarg_routing_active`): the keyword tensors' target DTensorSpecs."""
    if not kwarg_routing_active():
        raise RuntimeError("decompshard: keyword tensors can be moved only inside DTensor's routed propagator")
    _staged.stack[-1] = dict(targets)


def _with_kwarg_moves(op_schema: Any, sharding: Any, targets: dict[str, Any]) -> Any:
    moves = {}
    for name, target in targets.items():
        src = op_schema.kwargs_schema.get(name)
        if not isinstance(src, DTensorSpec):
            raise AssertionError(f"{op_schema.op}: keyword {name!r} is not a DTensor argument")
        if tuple(src.placements) != tuple(target.placements):
            moves[name] = (src, DTensorSpec(target.mesh, tuple(target.placements), tensor_meta=src.tensor_meta))
    if not moves:
        return sharding
    base = sharding.redistribute_schema or op_schema
    kwargs = dict(base.kwargs_schema)
    kwargs.update({name: dst for name, (_, dst) in moves.items()})
    schema = _KwargMovingSchema(base.op, base.args_schema, kwargs, schema_info=base.schema_info)
    schema.kwarg_moves = moves
    sharding.redistribute_schema = schema
    sharding.needs_redistribute = True
    return sharding


_SHARDING_OVERRIDES: dict = {}  # op -> override(op_schema, DTensor's OutputSharding) -> OutputSharding


def sharding_overrides() -> dict:
    """The table of per-op overrides of DTensor's propagated sharding (a patch record
    sets and removes its entries): `override(op_schema, sharding)` gets DTensor's answer
    for the op (computed as torch computes it, so its errors and tensor metadata stay
    torch's) and returns it or a replacement. Consulted inside the propagator that
    `kwarg_routing_entries` installs, so a replacement is cached by DTensor (Python
    cache and C++ fast path) like any answer: the override runs once per op schema,
    not per call."""
    return _SHARDING_OVERRIDES


def kwarg_routing_entries() -> Iterator[tuple[Any, str, Any]]:
    """The entries (object, attribute, value) that route keyword tensors: DTensor's
    sharding propagator and its dispatcher's redistribute_local_args, wrapped as
    instance attributes (the propagator's cache a new one around the wrapper), so that
    keyword tensor targets staged by a strategy are redistributed and every moved tensor
    is contiguous (`_densify_moved_args`). For a patch record to set and put back."""
    sp = sharding_propagator()
    dispatcher = op_dispatcher()
    original_propagate = sp.propagate_op_sharding_non_cached
    original_redistribute = dispatcher.redistribute_local_args

    def propagate_op_sharding_non_cached(op_schema: Any) -> Any:
        stack = _staged.__dict__.setdefault("stack", [])
        stack.append(None)
        try:
            sharding = original_propagate(op_schema)
        except NotImplementedError as e:
            # DTensor turns any error of the decomposition fallback into "does not have a
            # sharding strategy registered"; a refusal the user must act on (a wrong
            # registered reference) reaches them as itself
            if getattr(e.__cause__, "reaches_caller", False):
                raise e.__cause__ from None
            raise
        finally:
            targets = stack.pop()
        override = _SHARDING_OVERRIDES.get(op_schema.op)
        if override is not None:
            sharding = override(op_schema, sharding)
        return sharding if not targets else _with_kwarg_moves(op_schema, sharding, targets)

    def redistribute_local_args(op_info: Any, suggested_input_schema: Any, use_val: bool) -> None:
        original_redistribute(op_info, suggested_input_schema, use_val)
        for name, (src, dst) in getattr(suggested_input_schema, "kwarg_moves", {}).items():
            op_info.local_kwargs[name] = _dense_after_move(
                suggested_input_schema.op, redistribute_local_tensor(op_info.local_kwargs[name], src, dst), dst)
        _densify_moved_args(op_info, suggested_input_schema)

    yield sp, "propagate_op_sharding_non_cached", propagate_op_sharding_non_cached
    yield sp, "propagate_op_sharding", propagation_cache_type()(propagate_op_sharding_non_cached)
    yield dispatcher, "redistribute_local_args", redistribute_local_args


def _densify_moved_args(op_info: Any, suggested_input_schema: Any) -> None:
    """The positional tensors DTensor just redistributed for an op, each made contiguous.

    Moving an uneven Shard(a) to Shard(b) (an all-to-all) pads both dims, then narrows
    the result: the local tensor is a slice of a padded buffer ([10, 17, 30] from S(0)
    to S(1) on 4 ranks: rank 3 holds rows 2 of 5, strides (150, 30, 1)). A local `view`
    that merges the narrowed dim with the one before it then fails on that rank ("view
    size is not compatible ...", ViT under an uneven batch, whose 17 tokens the
    uneven-view redistribution shards), though the view is valid on the global tensor.
    A contiguous local tensor takes every view; it is what DTensor's own
    `distribute_tensor` and collectives produce, and what enable()'s `_LocalLayoutSpec`
    assumes of a moved input."""
    if op_info.args_tree_spec is not None:
        targets = tuple(tree_leaves(suggested_input_schema.args_schema))
    else:
        targets = suggested_input_schema.args_schema
    local_args = list(op_info.local_args)
    for i, spec in enumerate(op_info.flat_args_schema):
        target = targets[i] if i < len(targets) else None
        if isinstance(spec, DTensorSpec) and isinstance(target, DTensorSpec) and spec != target:
            local_args[i] = _dense_after_move(suggested_input_schema.op, local_args[i], target)
    op_info.local_args = tuple(local_args)


def _dense_after_move(op: Any, local: Any, target: Any) -> Any:
    """`local`, just redistributed to `target`, made contiguous if the move left it
    otherwise. A copy changes no value. Mutating ops keep DTensor's tensor (their write
    must land where DTensor put it); symbolic shapes are left alone (asking would
    specialize a compiled graph)."""
    if not isinstance(local, torch.Tensor) or op._schema.is_mutable:
        return local
    tm = target.tensor_meta
    if tm is not None and any(not isinstance(v, int) for v in (*tm.shape, *tm.stride)):
        return local
    return local if local.is_contiguous() else local.contiguous()
