"""DTensor's private types, its strategy tables and the private state of a DTensor object.

The types are imported at import time: a torch that lacks one fails here, loudly, with
its version in the message, instead of deep inside a sweep. Every read or write of a
DTensor's private attributes (`_local_tensor`, `_spec`) and of the dispatcher
(`DTensor._op_dispatcher`) outside this package goes through an accessor below."""

from __future__ import annotations

import functools
from typing import Any, Sequence

import torch

from decompshard._compat.ops import lazy_attribute
from decompshard._compat.release import SUPPORTED

__all__ = [
    "DTensor", "DTensorSpec", "DecompShardingStrategy", "OpSchema", "OpSpec", "OpStrategy", "OutputSharding",
    "TensorMeta", "TorchPartial", "TorchReplicate", "TorchShard", "TorchShardingPlaceholder", "TorchStridedShard",
    "TupleStrategy", "_compute_local_shape_and_global_offset", "block_spec", "clear_dtensor_caches", "spec_dtensor", "contiguous_spec", "cpp_sharding_cache_clearable",
    "custom_op_handlers", "decomp_strategy_parameters", "dtensor_spec", "fake_one_rank_mesh",
    "full_mesh_filter_keyword", "generate_redistribute_costs", "has_native_strategy", "inferred_schema_info",
    "local_tensor", "op_dispatcher", "op_strategy_func", "placed_dtensor", "propagation_cache_type",
    "rebind_dtensor", "redistribute_cost", "redistribute_local_tensor", "schema_info_slot", "set_dtensor_layout",
    "sharding_propagator", "single_dim_strategy_info", "slab_index", "strategy_reused_from", "unsharded_dtensor",
    "view_family_ops", "view_shape_arg_index", "widened_schema_info",
]

try:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._decompositions import DecompShardingStrategy
    from torch.distributed.tensor._op_schema import OpSchema, OpSpec, OpStrategy, OutputSharding, TupleStrategy
    from torch.distributed.tensor._redistribute import redistribute_local_tensor
    from torch.distributed.tensor._collective_utils import redistribute_cost
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor._ops.single_dim_strategy import _ShardingPlaceholder
    from torch.distributed.tensor.placement_types import (
        Partial as TorchPartial,
        Replicate as TorchReplicate,
        Shard as TorchShard,
        _StridedShard as TorchStridedShard,
    )
except ImportError as e:  # pragma: no cover - exercised only on unsupported torch
    raise ImportError(
        f"decompshard supports torch {SUPPORTED}; torch {torch.__version__} lacks a "
        f"private DTensor API it needs: {e}"
    ) from e


TorchShardingPlaceholder = _ShardingPlaceholder  # a single-dim rule's "shard on some dim"


# ------------------------------------------------------------------ the strategy tables

def sharding_propagator() -> Any:
    """DTensor's process-wide ShardingPropagator (holds every registered strategy)."""
    return DTensor._op_dispatcher.sharding_propagator


def op_dispatcher() -> Any:
    """DTensor's process-wide OpDispatcher (unwraps a call, propagates, redistributes the
    local arguments, runs the local kernel, wraps the results)."""
    return DTensor._op_dispatcher


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions (Python and C++ caches), so a changed
    strategy table or fallback takes effect on the next call."""
    sp = sharding_propagator()
    sp.propagate_op_sharding.cache_clear()
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()


def cpp_sharding_cache_clearable() -> bool:
    """Whether this torch has DTensor's C++ sharding cache and a way to clear it."""
    return getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None) is not None


def propagation_cache_type() -> Any:
    """The LRU cache DTensor's propagator keeps around `propagate_op_sharding_non_cached`
    (`_sharding_prop.LocalLRUCache`): a wrapper put in its place gets a new one around it."""
    from torch.distributed.tensor._sharding_prop import LocalLRUCache

    return LocalLRUCache


def schema_info_slot(op: torch._ops.OpOverload) -> tuple[dict, Any] | None:
    """(the table, the RuntimeSchemaInfo) DTensor reads for `op`'s cache key and pytree
    use, or None: the op-strategy table's first, then the single-dim one's, as DTensor's
    dispatch looks them up (the same two tables in 2.13, 2.14 and 2.15)."""
    sp = sharding_propagator()
    for name in ("op_to_schema_info", "op_to_schema_info_for_single_dim_strategy"):
        table = getattr(sp, name, None)
        if table is not None and op in table:
            return table, table[op]
    return None


def widened_schema_info(info: Any, argnum: int | None, kwargs: Sequence[str]) -> Any:
    """`info` keying DTensor's sharding cache also on the positional arguments from
    `argnum` on and on the keyword arguments `kwargs`."""
    import dataclasses

    keys = list(info.static_kwargkey or [])
    keys += [k for k in kwargs if k not in keys]
    start = info.static_argnum if argnum is None else min(info.static_argnum, argnum)
    return dataclasses.replace(info, static_argnum=start, static_kwargkey=keys or None)


def inferred_schema_info(op: torch._ops.OpOverload) -> Any:
    """The RuntimeSchemaInfo (which non-tensor arguments key DTensor's sharding cache)
    torch's decomposition fallback registers for `op` on its first call, made by that
    fallback's own `ensure_schema_info` on a scratch table: nothing is registered."""
    import types

    scratch = types.SimpleNamespace(op_to_schema_info={})
    DecompShardingStrategy(scratch).ensure_schema_info(op)
    return scratch.op_to_schema_info[op]


def single_dim_strategy_info(op: torch._ops.OpOverload) -> Any | None:
    return sharding_propagator().op_single_dim_strategy_funcs.get(op)


def strategy_reused_from(op: torch._ops.OpOverload) -> Any | None:
    """The op whose strategy DTensor registered again for `op` unchanged, or None.

    From 2.14 torch's `_ops/autogen.py` gives each in-place, out and functional variant
    its base op's single-dim strategy wrapped in a closure over `base_op`; 2.13 has no
    such copies. Feature detection: the registered function's closure names `base_op`."""
    info = single_dim_strategy_info(op)
    fn = getattr(info, "func", None)
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
    if code is None or not cells or "base_op" not in code.co_freevars:
        return None
    base = cells[code.co_freevars.index("base_op")].cell_contents
    return base if isinstance(base, torch._ops.OpOverload) and base != op else None


def op_strategy_func(op: torch._ops.OpOverload) -> Any | None:
    return sharding_propagator().op_strategy_funcs.get(op)


def generate_redistribute_costs(src_strategy: Any, dst_spec: Any) -> list[float]:
    """DTensor's cost of moving each of an input's strategies to `dst_spec`: what an
    OpSpec's `redistribute_cost` holds for that input (torch's `_ops.utils`, private)."""
    from torch.distributed.tensor._ops.utils import generate_redistribute_costs as costs

    return costs(src_strategy, dst_spec)


def view_family_ops() -> list[torch._ops.OpOverload]:
    """The ops whose full-mesh strategy is DTensor's view propagator (`_view_ops.py`,
    registered through `register_op_strategy_map`: view, reshape, _unsafe_view,
    squeeze, unsqueeze, expand, permute, transpose, repeat, view_as_real, ...), also
    while decompshard wraps them (`__wrapped__`)."""
    import inspect

    import torch.distributed.tensor._ops._view_ops as view_ops

    def native(fn: Any) -> bool:
        fn = inspect.unwrap(fn)
        return (getattr(fn, "__module__", None) == view_ops.__name__
                and getattr(fn, "__qualname__", "").startswith(view_ops.register_op_strategy_map.__name__))

    return [op for op, fn in sharding_propagator().op_strategy_funcs.items() if native(fn)]


def custom_op_handlers() -> dict:
    """DTensor's per-op handlers that replace its whole dispatch (convolution, as_strided,
    ...): op -> handler(op_call, args, kwargs)."""
    return DTensor._op_dispatcher._custom_op_handlers


def view_shape_arg_index(op: torch._ops.OpOverload) -> int | None:
    """The argument DTensor rewrites from the global to the local output shape before
    running the op locally (view's size, expand's size), or None."""
    idx = sharding_propagator().op_to_shape_and_stride_idx.get(op)
    return idx[0] if isinstance(idx, tuple) else idx


def has_native_strategy(op: torch._ops.OpOverload) -> bool:
    sp = sharding_propagator()
    return (
        op in sp.op_single_dim_strategy_funcs
        or op in sp.op_strategy_funcs
        or op in sp.op_to_rules
    )


@functools.lru_cache(maxsize=None)
def fake_one_rank_mesh(device_type: str = "cpu") -> Any:
    """A size-1 mesh that needs no process group: what torch's own fallback uses."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh(device_type, [0], _init_backend=False, _rank=0)


def decomp_strategy_parameters() -> tuple[str, ...]:
    """The arguments torch's decomposition fallback takes after `self` in
    `propagate_strategy` (torch 2.13: op_schema; 2.14+: op_schema, output_tensor_meta):
    what DTensor's propagator passes to whatever stands in `decomp_strategy`."""
    import inspect

    params = list(inspect.signature(DecompShardingStrategy.propagate_strategy).parameters)
    return tuple(params[1:])


def full_mesh_filter_keyword() -> str:
    """The keyword `expand_to_full_mesh_op_strategy` takes its strategy filter by:
    `is_valid_strategy_cb` (torch 2.13), `full_mesh_strategy_filter` (2.14+)."""
    import inspect

    params = inspect.signature(lazy_attribute("expand_to_full_mesh_op_strategy")).parameters
    for name in ("full_mesh_strategy_filter", "is_valid_strategy_cb"):
        if name in params:
            return name
    raise LookupError("expand_to_full_mesh_op_strategy takes no strategy filter keyword "
                      f"(its parameters: {', '.join(params)})")


# ------------------------------------------------------------------ a DTensor's private state

def local_tensor(dt: Any) -> torch.Tensor:
    """The DTensor's own local tensor (its storage, not a copy: writes reach its views)."""
    return dt._local_tensor


def dtensor_spec(dt: Any) -> Any:
    """The DTensor's spec (placements, mesh and global tensor meta), not a copy."""
    return dt._spec


def set_dtensor_layout(dt: Any, shape: Any, stride: Any) -> None:
    """Give a DTensor new global metadata (same placements): the spec its next op reads.
    The wrapper's own sizes and strides are set by `return_and_correct_aliasing`."""
    dt._spec = DTensorSpec(dt.device_mesh, tuple(dt.placements),
                           tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dt.dtype))


def rebind_dtensor(dt: Any, local: torch.Tensor, spec: Any) -> None:
    """Give a DTensor a new local tensor (a view of its own storage, so writes still
    reach every alias) and a whole new spec (placements and global metadata), as
    DTensor's own in-place path does for the spec. The wrapper's sizes and strides are
    set by `return_and_correct_aliasing`."""
    dt._local_tensor = local
    dt._spec = spec


def unsharded_dtensor(local: torch.Tensor, mesh: Any, placements: Any) -> Any:
    """A DTensor around a local tensor whose placements shard nothing (Replicate and
    Partial only: the global shape is the local one). For use inside dispatch (no
    autograd, no checks)."""
    if any(isinstance(p, (TorchShard, TorchStridedShard)) for p in placements):
        raise ValueError(f"unsharded_dtensor: {tuple(placements)} shards the tensor")
    meta = TensorMeta(local.shape, local.stride(), local.dtype)
    return DTensor(local, DTensorSpec(mesh, tuple(placements), tensor_meta=meta), requires_grad=False)


def contiguous_spec(mesh: Any, placements: Any, global_shape: Any, dtype: torch.dtype,
                    stride: Any = None) -> Any:
    """A DTensorSpec of a global shape laid out contiguously (torch's strides: a size-0
    dim counts as 1), or with `stride` where given: what a handler that moves or wraps a
    local tensor itself (batch norm's statistics, a per-row reduction) hands DTensor."""
    shape = torch.Size(global_shape)
    if stride is None:
        acc, rev = 1, []
        for size in reversed(shape):
            rev.append(acc)
            acc *= max(int(size), 1)
        stride = tuple(reversed(rev))
    return DTensorSpec(mesh, tuple(placements), tensor_meta=TensorMeta(shape, tuple(stride), dtype))


def placed_dtensor(local: torch.Tensor, mesh: Any, placements: Any, global_shape: Any) -> Any:
    """A DTensor around a local tensor of a known global shape (contiguous), any placements
    (a per-row statistic that stays on its rows' shards). For use inside dispatch (no
    autograd, no checks)."""
    spec = contiguous_spec(mesh, placements, global_shape, local.dtype)
    return DTensor(local, spec, requires_grad=False)


def spec_dtensor(local: torch.Tensor, spec: Any) -> Any:
    """A DTensor around a local tensor with a spec made for it (`contiguous_spec`,
    `block_spec`). For use inside dispatch (no autograd, no checks)."""
    return DTensor(local, spec, requires_grad=False)


def block_spec(mesh: Any, placements: Sequence[Any], tensor_meta: Any) -> Any:
    """A DTensorSpec whose `_StridedShard`s mean blocks (each rank holds its chunk of
    each of `split_factor` blocks, as a view that flattens a sharded dim gives them),
    not a shard order across mesh dims: DTensor's view propagation marks its own so."""
    return DTensorSpec(mesh, tuple(placements), tensor_meta=tensor_meta, use_strided_shard_as_shard_order=False)


def slab_index(index: torch.Tensor, size: int, mesh: Any, mesh_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global indices into a dim of `size` elements sharded (torch.chunk layout) on one
    mesh dim, made local to this rank's slab: (index - the slab's offset, 0 where the
    index is outside the slab; the mask of those). torch's `_MaskPartial` does this for
    vocab-parallel embeddings and `loss_parallel()`; it reads the rank's coordinate the
    way LocalTensorMode simulates it (a value per simulated rank)."""
    from torch.distributed.tensor.placement_types import _MaskPartial

    placement = _MaskPartial(offset_shape=torch.Size([size]), offset_dim=0)
    local = placement._partition_value(index, mesh, mesh_dim)
    return local, placement.mask_buffer.data
