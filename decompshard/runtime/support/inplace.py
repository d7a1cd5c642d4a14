"""In-place ops without a native DTensor strategy: computed out of place, written back.

DTensor cannot move an in-place op's `self`: it redistributes the arguments into new
local tensors, runs the op on those, and then relabels `self` with the strategy's output
placements while `self`'s own local tensor never saw the op. Native strategies avoid
this (DTensor's `expand_to_full_mesh_op_strategy` drops every in-place strategy that
moves self); decompshard's derived strategies are chosen like an out-of-place op's,
so `index_add_` on a S(0) `self` (Mixtral's expert loop adds each expert's rows into
the batch-sharded output at global token indices) would come back labelled S(1) over the
untouched S(0) shard, and a later op would fail or read wrong values.

No strategy can keep `self` S(0) there: the indices are global. So under `enable()`,
each in-place aten op that has no native strategy but a functional twin
(`index_add_` -> `index_add`) gets a DTensor handler that runs the twin (any strategy,
redistributing freely, as DTensor does for out-of-place ops), redistributes the result
to `self`'s placements, and copies it into `self`'s local tensor: exactly the in-place
op's values, in `self`'s own storage (views of it see the update). Ops that change
metadata (inplace_view: `as_strided_`, `t_`, ...), resize/set, random and multi-output
ops are left alone. `disable()` removes the handlers.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import torch

from decompshard._compat import DTensor, contiguous_spec, custom_op_handlers, has_native_strategy, local_tensor, tree_flatten, tree_unflatten
from decompshard.runtime.collectives import fewer_bytes, moves_cost
from decompshard.runtime.table_patches import Entry, WarnOnce, where_none

__all__ = ["entries", "written_back_ops"]


def _single_tensor_return(op: torch._ops.OpOverload) -> bool:
    returns = op._schema.returns
    return len(returns) == 1 and isinstance(returns[0].type, torch.TensorType)


@functools.lru_cache(maxsize=1)
def written_back_ops() -> tuple[tuple[torch._ops.OpOverload, torch._ops.OpOverload], ...]:
    """(in-place op, functional twin) for every aten in-place overload DTensor has no
    strategy or handler for, that writes its first argument's values and returns it."""
    handlers = custom_op_handlers()
    aten = torch.ops.aten
    found = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        base, _, overload = name[len("aten::"):].partition(".")
        if not base.endswith("_") or base.startswith(("_foreach", "resize", "_resize", "set_", "sparse_")):
            continue
        op = getattr(getattr(aten, base), overload or "default")
        if has_native_strategy(op) or op in handlers:
            continue
        if torch.Tag.inplace_view in op.tags or torch.Tag.nondeterministic_seeded in op.tags:
            continue
        args = op._schema.arguments
        if not args or args[0].alias_info is None or not args[0].alias_info.is_write:
            continue
        if any(a.alias_info is not None and a.alias_info.is_write for a in args[1:]):
            continue
        if not _single_tensor_return(op):
            continue
        packet = getattr(aten, base[:-1], None)
        twin = getattr(packet, overload or "default", None) if packet is not None else None
        if twin is None or not _single_tensor_return(twin) or any(
                a.alias_info is not None for a in twin._schema.arguments):
            continue
        found.append((op, twin))
    return tuple(sorted(found, key=lambda p: str(p[0])))


def entries(warn_once: WarnOnce) -> Iterator[Entry]:
    """The write-back handler for each such in-place op (`enable()` installs them)."""
    return where_none(custom_op_handlers(), written_back_ops(), _write_back_handler)


def _write_back_handler(op: torch._ops.OpOverload, twin: torch._ops.OpOverload) -> Callable:
    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        target = args[0]
        if isinstance(target, DTensor):
            args, kwargs = _reduced_first(target, args, kwargs)
        out = twin(*args, **kwargs)  # DTensor's ordinary path (derived or native strategy)
        if not isinstance(target, DTensor) or not isinstance(out, DTensor):
            raise RuntimeError(f"decompshard: {op} on a {type(target).__name__} self with DTensor arguments: "
                               "make every tensor argument a DTensor")
        if tuple(out.shape) != tuple(target.shape):
            raise RuntimeError(f"decompshard: {op}: the result's shape {tuple(out.shape)} is not self's "
                               f"{tuple(target.shape)}; an in-place op cannot change it")
        if out.device_mesh != target.device_mesh or tuple(out.placements) != tuple(target.placements):
            out = out.redistribute(target.device_mesh, target.placements)
        local_tensor(target).copy_(local_tensor(out))
        return target

    handler.__name__ = f"write_back_{op._opname}"
    return handler


def _reduced_first(target: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments with their Partial mesh dims reduced first, where the cost model
    prices that below reducing the result into `self`. The twin's strategy is chosen as
    for an out-of-place op: Partial arguments make a Partial result for free, and the write-back
    then all-reduces all of `self` (Mixtral: each expert's few rows added into the whole
    token buffer cost one all-reduce of the buffer per expert). Decided from global
    shapes and placements only, so every rank decides alike; both all-reduces priced by
    the cost model."""
    from torch.distributed.tensor import Partial, Replicate

    flat, spec = tree_flatten((args, kwargs))
    dims = {m for t in flat[1:] if isinstance(t, DTensor) and t.device_mesh == target.device_mesh
            for m, p in enumerate(t.placements) if p.is_partial() and not target.placements[m].is_partial()}
    if not dims:
        return args, kwargs
    partial = [i for i, t in enumerate(flat) if i and isinstance(t, DTensor) and any(
        t.placements[m].is_partial() for m in dims if t.device_mesh == target.device_mesh)]
    reduced = {i: [Replicate() if m in dims else p for m, p in enumerate(flat[i].placements)] for i in partial}
    # the twin's result is `self` whole, Partial on `dims`: its write-back all-reduces it
    whole = [Partial("sum") if m in dims else Replicate() for m in range(target.device_mesh.ndim)]
    if not fewer_bytes(moves_cost((flat[i], tuple(reduced[i])) for i in partial),
                       moves_cost([(_spec_at(target, whole), (Replicate(),) * target.device_mesh.ndim)])):
        return args, kwargs
    for i in partial:
        flat[i] = flat[i].redistribute(flat[i].device_mesh, reduced[i])
    return tree_unflatten(flat, spec)


def _spec_at(t: Any, placements: list) -> Any:
    """`t`'s spec with other placements (a price reads only global metadata)."""
    return contiguous_spec(t.device_mesh, tuple(placements), t.shape, t.dtype, t.stride())
