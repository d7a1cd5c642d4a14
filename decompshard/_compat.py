"""Every private torch API decompshard touches, in one place.

Supported: torch 2.13.x (the reference). The names below moved between 2.10 and 2.13;
anything that fails to import here fails loudly at import time with the version in the
message instead of deep inside a sweep.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from typing import Any, Iterator, Sequence

import torch

__all__ = [
    "FakeTensorMode", "OpOverload", "TorchDispatchMode", "disable_current_modes", "keystr", "tree_flatten", "tree_flatten_with_path", "tree_leaves", "tree_map", "tree_unflatten",
    "DTensor", "DTensorSpec", "DecompShardingStrategy", "OpSchema", "OpSpec", "OpStrategy",
    "TensorMeta", "TorchPartial", "TorchReplicate", "TorchShard", "TorchStridedShard",
    "TupleStrategy", "_ShardingPlaceholder", "_compute_local_shape_and_global_offset", "aten_ops_tagged",
    "clear_dtensor_caches", "custom_op_handlers", "custom_op_overload", "dtensor_default_dispatch", "dtensor_local_results",
    "dtensor_output_sharding", "dtensor_output_spec", "dtensor_planned_moves", "fake_one_rank_mesh", "from_torch_placement",
    "has_native_strategy", "is_dispatchable",
    "kwarg_routing_active", "local_tensor", "op_strategy_func", "contiguous_spec", "placed_dtensor", "rebind_dtensor", "redistribute_cost",
    "redistribute_local_tensor", "return_and_correct_aliasing", "kwarg_routing_entries", "set_dtensor_layout",
    "sharding_propagator",
    "single_dim_strategy_info", "strategy_cost_slots", "strategy_reused_from", "strategy_selection_slot", "slab_index", "stage_kwarg_targets", "to_torch_placement", "torch_decomposition_table",
    "block_spec", "collective_cost_model", "inferred_schema_info", "local_call_sharding", "sharding_overrides", "schema_info_slot", "unsharded_dtensor", "widened_schema_info", "view_family_ops", "view_shape_arg_index",
]

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
SUPPORTED = ((2, 13), (2, 14), (2, 15))
# The running release as the tested-release data names it ("2.14.1"; local build tags
# such as "+cpu" dropped): findings measured on one release (the native audit's, the
# guard's) are looked up by it, never compared as version numbers.
TORCH_RELEASE = torch.__version__.split("+")[0]

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


# ------------------------------------------------------------------ torch's private utilities

# Re-exported as they are: pytree, dispatch modes and op overloads are private modules
# every stage uses; importing them here lists them in one place for the next torch
# release. The heavy ones (OpInfo's database, the comm-mode tables) load on first use through __getattr__, so `import decompshard` stays
# cheap (they are left out of __all__ for that reason).
from torch._ops import OpOverload  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes  # noqa: E402
from torch.utils._pytree import (  # noqa: E402
    keystr, tree_flatten, tree_flatten_with_path, tree_leaves, tree_map, tree_unflatten,
)

_LAZY = {
    "op_db": ("torch.testing._internal.common_methods_invocations", "op_db"),
    "c10d_collective_ops": ("torch.distributed.tensor.debug._comm_mode", "c10d_collective_ops"),
    "expand_to_full_mesh_op_strategy": ("torch.distributed.tensor._ops.utils", "expand_to_full_mesh_op_strategy"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, attr = _LAZY[name]
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value
    return value


def sharding_propagator() -> Any:
    """DTensor's process-wide ShardingPropagator (holds every registered strategy)."""
    return DTensor._op_dispatcher.sharding_propagator


def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding decisions (Python and C++ caches), so a changed
    strategy table or fallback takes effect on the next call."""
    sp = sharding_propagator()
    sp.propagate_op_sharding.cache_clear()
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()


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


def aten_ops_tagged(tag: Any) -> list[torch._ops.OpOverload]:
    """Every aten overload the dispatcher knows that carries `tag`: read from the
    dispatcher's schema table (40 ms for all ~3,000), not by resolving each overload."""
    found = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        base, _, overload = name.partition(".")
        entry = torch._C._get_operation_overload(base, overload)
        if entry is not None and tag in entry[2]:
            found.append(getattr(getattr(torch.ops.aten, base[len("aten::"):]), overload or "default"))
    return found


def custom_op_handlers() -> dict:
    """DTensor's per-op handlers that replace its whole dispatch (convolution, as_strided,
    ...): op -> handler(op_call, args, kwargs)."""
    return DTensor._op_dispatcher._custom_op_handlers


def local_tensor(dt: Any) -> torch.Tensor:
    """The DTensor's own local tensor (its storage, not a copy: writes reach its views)."""
    return dt._local_tensor


def set_dtensor_layout(dt: Any, shape: Any, stride: Any) -> None:
    """Give a DTensor new global metadata (same placements): the spec its next op reads.
    The wrapper's own sizes and strides are set by `return_and_correct_aliasing`."""
    dt._spec = DTensorSpec(dt.device_mesh, tuple(dt.placements),
                           tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dt.dtype))


def return_and_correct_aliasing(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """torch's own fix-up for a subclass handler's result (an in-place view op updates
    the wrapper's metadata; a mutated input is returned as itself)."""
    from torch.utils._python_dispatch import return_and_correct_aliasing as fix

    return fix(func, args, kwargs, out)


def view_shape_arg_index(op: torch._ops.OpOverload) -> int | None:
    """The argument DTensor rewrites from the global to the local output shape before
    running the op locally (view's size, expand's size), or None."""
    idx = sharding_propagator().op_to_shape_and_stride_idx.get(op)
    return idx[0] if isinstance(idx, tuple) else idx


@functools.lru_cache(maxsize=None)  # one answer per overload, asked on every derive_rules call
def is_dispatchable(op: torch._ops.OpOverload) -> bool:
    """Whether the dispatcher knows the overload. torch.ops also lists TorchScript-only
    overloads (aten.add_.t, on Python lists); most questions about them (can it
    decompose? its tags?) raise a RuntimeError from deep inside torch."""
    try:
        torch._C._dispatch_find_schema_or_throw(op._schema.name, op._schema.overload_name)
    except RuntimeError:
        return False
    return True


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


def torch_decomposition_table() -> dict:
    from torch._decomp import decomposition_table

    return decomposition_table


def torch_decomposition(op: Any) -> Any:
    """torch's own decomposition of `op`: its decomposition table, then
    CompositeImplicitAutograd; None if it has neither."""
    table = torch_decomposition_table()
    if op in table:
        return table[op]
    try:
        return op.decompose if op._can_decompose() else None
    except RuntimeError:  # an overload the dispatcher lacks (is_dispatchable)
        return None


def custom_op_implementation(op: Any) -> Any:
    """The Python implementation of a `torch.library.custom_op` (torch's CustomOpDef):
    its CPU kernel, else its default (all-device) kernel, else the function it was
    defined with; None for any other op, and for a custom op that mutates or aliases
    its arguments (its implementation writes into inputs; not traced)."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace in ("aten", "prims"):
        return None
    try:
        from torch._library.custom_ops import _maybe_get_opdef

        opdef = _maybe_get_opdef(op)
    except Exception:  # an op torch's custom-op registry does not know how to look up
        return None
    if opdef is None:
        return None
    schema = op._schema
    if any(a.alias_info is not None for a in schema.arguments) or any(
            r.alias_info is not None for r in schema.returns):
        return None
    backend = getattr(opdef, "_backend_fns", {}) or {}
    return backend.get("cpu") or backend.get(None) or getattr(opdef, "_init_fn", None)


def custom_op_overload(obj: Any) -> Any:
    """The OpOverload behind a `torch.library.custom_op` object (torch's CustomOpDef);
    None for anything else."""
    from torch._library.custom_ops import CustomOpDef

    return obj._opoverload if isinstance(obj, CustomOpDef) else None


def from_torch_placement(p: Any, *, strided: bool = False):
    """torch placement (or single-dim placeholder) -> decompshard's alphabet.

    Returns `NotImplemented` for placements the single-dim alphabet cannot express
    faithfully (a _StridedShard produced from a plain Shard, say); callers drop such rules.
    With `strided` (an N-D placement of a real DTensor, not a rule's), a _StridedShard
    becomes the `StridedShard` the placement grammar writes as `_S(d, sf)`.
    """
    from decompshard.placements import R, Partial, ShardPlaceholder, StridedShard

    if p is None:
        return None
    if isinstance(p, _ShardingPlaceholder):
        return ShardPlaceholder(p.dim)
    if isinstance(p, TorchStridedShard):
        return StridedShard(p.dim, p.split_factor) if strided else NotImplemented
    if isinstance(p, TorchShard):
        return ShardPlaceholder(p.dim)
    if isinstance(p, TorchReplicate):
        return R
    if type(p) is TorchPartial:  # subclasses (_NormPartial, _MaskPartial) combine differently
        return Partial(p.reduce_op) if p.reduce_op in ("sum", "avg", "max", "min") else NotImplemented
    return NotImplemented


def to_torch_placement(p: Any) -> Any:
    """decompshard placement -> torch placement (S(d) becomes a plain Shard(d), None stays;
    `_S(d, sf)` a _StridedShard(d, split_factor=sf))."""
    from decompshard.placements import Partial, Replicate, ShardPlaceholder, StridedShard

    if p is None:
        return None
    if isinstance(p, ShardPlaceholder):
        return TorchShard(p.dim)
    if isinstance(p, StridedShard) and p.inner == 1:
        return TorchStridedShard(p.dim, split_factor=p.sf)
    if isinstance(p, Partial):
        return TorchPartial(p.reduce_op)
    if isinstance(p, Replicate):
        return TorchReplicate()
    raise TypeError(f"not a placement: {p!r}")


def dtensor_local_results(op_call: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """DTensor's own path for one call, stopped before wrapping: propagate the sharding,
    redistribute the inputs as the chosen strategy asks, run the local kernel. Returns
    (local results, output spec). For a custom handler that post-processes the local
    results (the guard's mean-loss handler)."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    local = dispatcher._dispatch_get_local_results_slow_path(op_call, args, op_info)
    return local, op_info.output_sharding.output_spec


def dtensor_output_spec(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """The output spec DTensor's sharding propagation chooses for this call (no run)."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    return op_info.output_sharding.output_spec


def dtensor_output_sharding(op_call: Any, args: tuple, kwargs: dict) -> tuple[Any, bool, Any, tuple, dict]:
    """DTensor's sharding propagation for this call, not run: (output spec with its
    tensor meta, whether the chosen strategy moves an input first, and the local call
    DTensor would make: op, the arguments after `self`, kwargs). The local call differs
    from this one where DTensor rewrites it without moving anything (`squeeze.default`
    on a shard becomes `squeeze.dims` of the global size-1 dims: a shard's own size-1
    dims are not the tensor's)."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    rs = sharding.redistribute_schema
    if not sharding.needs_redistribute or rs is None:
        return sharding.output_spec, False, op_call, tuple(args[1:]), dict(kwargs)
    moves = any(isinstance(a, DTensorSpec) and (not isinstance(b, DTensorSpec) or a.placements != b.placements)
                for a, b in zip(op_info.schema.args_schema, rs.args_schema))
    return sharding.output_spec, moves, rs.op, tuple(rs.args_schema[1:]), dict(rs.kwargs_schema)


def rebind_dtensor(dt: Any, local: torch.Tensor, spec: Any) -> None:
    """Give a DTensor a new local tensor (a view of its own storage, so writes still
    reach every alias) and a whole new spec (placements and global metadata), as
    DTensor's own in-place path does for the spec. The wrapper's sizes and strides are
    set by `return_and_correct_aliasing`."""
    dt._local_tensor = local
    dt._spec = spec


def dtensor_default_dispatch(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """What DTensor does for an op without a custom handler, for a handler that only
    takes some calls: the local results wrapped in DTensors with the chosen specs."""
    local, spec = dtensor_local_results(op_call, args, kwargs)
    return DTensor._op_dispatcher.wrap(local, spec)


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


def dtensor_planned_moves(op_call: Any, args: tuple, kwargs: dict) -> list[tuple[Any, Any]] | None:
    """DTensor's own plan for one call, not run: (current spec, the spec its chosen strategy
    moves it to) for each positional tensor argument; None where DTensor has no strategy
    (it would raise). For a handler that runs a cheaper plan only when DTensor's moves
    more (runtime/plans/install.py)."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    try:
        dispatcher.sharding_propagator.propagate(op_info)
    except Exception:  # noqa: BLE001 - whatever DTensor raises, its own path would raise it too
        return None
    sharding = op_info.output_sharding
    current = list(op_info.schema.args_spec)
    target = sharding.redistribute_schema.args_spec if sharding.redistribute_schema is not None else current
    return list(zip(current, target))
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


# ------------------------------------------------------------------ keyword tensor arguments
#
# DTensor redistributes only positional tensor arguments: its propagator builds the
# redistribution schema with the caller's kwargs_schema, and OpDispatcher.
# redistribute_local_args walks args alone ("very rare that we need to reshard kwargs").
# decompshard's strategies name a placement for every tensor, keyword ones included
# (SDPA's keyword-only attn_mask). `kwarg_routing_entries()` makes DTensor honour
# them (installed by enable()'s patch record, which puts every slot back): the strategy records its keyword targets with `stage_kwarg_targets` while the
# propagator runs, the propagator's answer (cached with it, so cache hits carry it too)
# gets a redistribution schema naming the moves, and the dispatcher's
# redistribute_local_args performs them after the positional ones. The same wrapper lays
# every moved tensor out contiguously (`_densify_moved_args`).

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


def strategy_cost_slots() -> list[tuple[Any, str, str]]:
    """Where DTensor prices the candidate strategies of a native op, and only there (not
    where it plans a redistribution it has chosen): `(module, attribute, kind)`.
    kind "spec": `redistribute_cost(current_spec, target_spec) -> cost`, as
    `_ops.utils` holds it for `generate_redistribute_costs` (op-strategy functions and
    their full-mesh expansion); kind "step": `_compute_placement_transition_cost(cur,
    tgt, mesh_topo, mesh_dim, comm_bytes_gb) -> (cost, comm_bytes_gb after)`, as
    `_ops.single_dim_strategy` holds it for its search over input placements. Feature
    detection: a slot this torch lacks is left out."""
    import importlib

    found = []
    for module_name, attribute, kind in (("torch.distributed.tensor._ops.utils", "redistribute_cost", "spec"),
                                         ("torch.distributed.tensor._ops.single_dim_strategy",
                                          "_compute_placement_transition_cost", "step")):
        module = importlib.import_module(module_name)
        if callable(vars(module).get(attribute)):
            found.append((module, attribute, kind))
    return found


def strategy_selection_slot() -> tuple[Any, str] | None:
    """Where DTensor chooses one of an op's candidate strategies by their summed input
    redistribution costs: `(module, attribute)` of `_sharding_prop._select_min_cost_strategy
    (strategy, op_schema=None) -> OpSpec` (every supported torch calls it through the
    module's global), or None where this torch lacks it (feature detection)."""
    import torch.distributed.tensor._sharding_prop as sp

    if callable(vars(sp).get("_select_min_cost_strategy")):
        return sp, "_select_min_cost_strategy"
    return None


__all__ += ["current_autograd_node", "dispatch_args_in_flight", "dispatch_redistribute_slot", "is_fake", "on_backward_end"]


def dispatch_redistribute_slot() -> tuple[Any, str] | None:
    """Where DTensor's dispatcher moves an op's inputs (`(owner, attribute)`): the
    `_dispatch` module's `redistribute_local_tensor(local, current_spec, target_spec, *,
    async_op, ...)`, which `OpDispatcher.redistribute_local_args` calls through the module
    global on every call (so a wrapper put there is seen at once and gone after
    `disable()`). Identical on 2.13-2.15; None where missing (feature detection)."""
    import torch.distributed.tensor._dispatch as dispatch

    if callable(vars(dispatch).get("redistribute_local_tensor")):
        return dispatch, "redistribute_local_tensor"
    return None


@functools.lru_cache(maxsize=1)
def _slow_path_code() -> Any:
    import torch.distributed.tensor._dispatch as dispatch

    fn = vars(dispatch.OpDispatcher).get("_dispatch_get_local_results_slow_path")
    return getattr(fn, "__code__", None)


def dispatch_args_in_flight(depth: int = 8) -> tuple | None:
    """The DTensor arguments of the op whose inputs DTensor is moving now on this thread:
    the `args` of `OpDispatcher._dispatch_get_local_results_slow_path`, found among the
    `depth` innermost frames by its code object; None outside it.

    Why a frame and not a wrapper: the C++ dispatch fetches that method once per process
    and keeps the bound method (`DEFINE_CACHING_PYTHON_IMPORT_GETTER` in
    python_variable.cpp, 2.13-2.15), so a wrapper put on the class after the first DTensor
    op is never called, and one put there before it is called for the rest of the process,
    `disable()` or not. Reading the frame changes nothing torch holds."""
    code = _slow_path_code()
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code is code:
            args = frame.f_locals.get("args")
            return args if isinstance(args, tuple) else None
        frame = frame.f_back
    return None


def current_autograd_node() -> Any:
    """The autograd node whose backward (or hooks) this thread runs now; None outside one."""
    return torch._C._current_autograd_node()


def on_backward_end(callback: Any) -> None:
    """Run `callback()` when the backward pass running now ends (the engine's queue)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def is_fake(t: Any) -> bool:
    """Whether `t` is a FakeTensor (tracing: no data to reuse)."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return bool(fake(t))


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread now (its
    graph task id is -1 outside one): a pricing that differs between forward and backward
    asks here."""
    return torch._C._current_graph_task_id() != -1


@functools.lru_cache(maxsize=None)
def collective_cost_model() -> Any:
    """DTensor's own pricing of one collective on one mesh dim (`_collective_utils`):
    a namespace with `allreduce_cost(gb, mesh_topo, mesh_dim)`, `reduce_scatter_cost`,
    `MeshTopoInfo.build_from_mesh(mesh)` and `spec_to_bytes(spec)`, so that a surcharge
    on its strategy choice is in its units."""
    import types

    import torch.distributed.tensor._collective_utils as cu

    return types.SimpleNamespace(allreduce_cost=cu.allreduce_cost, reduce_scatter_cost=cu.reduce_scatter_cost,
                                 allgather_cost=cu.allgather_cost,
                                 MeshTopoInfo=cu.MeshTopoInfo, spec_to_bytes=cu.spec_to_bytes)


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


def block_spec(mesh: Any, placements: Sequence[Any], tensor_meta: Any) -> Any:
    """A DTensorSpec whose `_StridedShard`s mean blocks (each rank holds its chunk of
    each of `split_factor` blocks, as a view that flattens a sharded dim gives them),
    not a shard order across mesh dims: DTensor's view propagation marks its own so."""
    return DTensorSpec(mesh, tuple(placements), tensor_meta=tensor_meta, use_strided_shard_as_shard_order=False)


def local_call_sharding(op_schema: Any, output_specs: Any, local_args: Sequence[Any] | None = None) -> Any:
    """An OutputSharding of `output_specs` (each with its tensor meta); where `local_args`
    is given, the local call takes those positional arguments in place of the global
    ones, each tensor argument given as the spec DTensor moves it to first (its own spec:
    no move): the mechanism DTensor uses to make a view's size argument local
    (`redistribute_schema` with `use_val_from_redistribute_schema`), kept on DTensor's
    cached dispatch path."""
    if local_args is None:
        return OutputSharding(output_specs)
    schema = OpSchema(op_schema.op, tuple(local_args), dict(op_schema.kwargs_schema),
                      schema_info=op_schema.schema_info)
    return OutputSharding(output_specs, schema, needs_redistribute=True, use_val_from_redistribute_schema=True)


def kwarg_routing_entries() -> Iterator[tuple[Any, str, Any]]:
    """The entries (object, attribute, value) that route keyword tensors: DTensor's
    sharding propagator and its dispatcher's redistribute_local_args, wrapped as
    instance attributes (the propagator's cache a new one around the wrapper), so that
    keyword tensor targets staged by a strategy are redistributed and every moved tensor
    is contiguous (`_densify_moved_args`). For a patch record to set and put back."""
    from torch.distributed.tensor._redistribute import redistribute_local_tensor
    from torch.distributed.tensor._sharding_prop import LocalLRUCache

    sp = sharding_propagator()
    dispatcher = DTensor._op_dispatcher
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
    yield sp, "propagate_op_sharding", LocalLRUCache(propagate_op_sharding_non_cached)
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
    from torch.utils._pytree import tree_leaves

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


# ------------------------------------------------------------------ simulated ranks
#
# The DTensor runner (verify/dtensor_case.py) simulates every rank of a mesh in this
# process: a fake process group (FakeStore, from torch's test utilities) and
# LocalTensorMode (torch.distributed._local_tensor), both private. Imported on first use:
# neither is needed outside a simulated run.

__all__ += ["fake_store", "local_tensor_mode", "make_local_tensor", "per_rank_call", "rank_tensors",
            "simulating_ranks", "simulator_chunks"]


def fake_store() -> Any:
    """The store of a "fake" process group (collectives that move no data)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def local_tensor_mode(ranks: Any) -> Any:
    """LocalTensorMode over `ranks`: every tensor op runs once per simulated rank."""
    from torch.distributed._local_tensor import LocalTensorMode

    return LocalTensorMode(ranks)


def make_local_tensor(per_rank: dict) -> Any:
    """A LocalTensor holding a different plain tensor per simulated rank."""
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor(per_rank)


def rank_tensors(t: Any) -> dict | None:
    """A LocalTensor's plain tensor per simulated rank; None for anything else."""
    return getattr(t, "_local_tensors", None)


def simulating_ranks() -> bool:
    """Whether a LocalTensorMode is active (one process plays every rank)."""
    from torch.distributed._local_tensor import local_tensor_mode as active_mode

    return active_mode() is not None


@contextlib.contextmanager
def outside_simulation() -> Iterator[None]:
    """LocalTensorMode off inside (if one is active): plain arithmetic on one rank's
    tensors stays plain, instead of running once per simulated rank."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    with maybe_disable_local_tensor_mode():
        yield


def per_rank_call(fn: Any) -> Any:
    """`fn(tensor, ...)` run on each simulated rank's tensor separately (outside the
    mode), its results (a tensor or a list of them) put back together as LocalTensors."""
    from torch.distributed._local_tensor import LocalTensor, maybe_disable_local_tensor_mode

    def wrapped(tensor: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        per_rank = rank_tensors(tensor)
        if per_rank is None:
            return fn(tensor, *rest, **kwargs)
        with maybe_disable_local_tensor_mode():
            results = {r: fn(t, *rest, **kwargs) for r, t in per_rank.items()}
        first = next(iter(results.values()))
        if isinstance(first, torch.Tensor):
            return LocalTensor(results)
        return [LocalTensor({r: p[i] for r, p in results.items()}) for i in range(len(first))]

    return wrapped


@contextlib.contextmanager
def simulator_chunks() -> Iterator[None]:
    """Mend one LocalTensorMode gap for the duration: DTensor and its collectives split
    tensors with `torch.chunk`, which returns fewer pieces when a dim is short or empty.
    With ranks of unequal local sizes (an uneven or empty shard on another mesh dim) the
    simulated ranks disagree on the count and the simulator fails ('NoneType' object has
    no attribute 'requires_grad'; "Sizes of tensors must match" in an all-gather). Each
    real process splits its own tensor; we run the two splitting helpers per rank, which
    is what they do there. Process-wide (DTensor's `Shard._custom_chunk` and
    `torch._utils._chunk_or_narrow_cat` are patched) and only for the simulation:
    tests/test_check_gloo.py runs such cases on real gloo processes."""
    import torch._utils as tutils

    original_chunk = TorchShard.__dict__["_custom_chunk"]
    original_cat = tutils._chunk_or_narrow_cat
    TorchShard._custom_chunk = staticmethod(per_rank_call(original_chunk.__func__))
    tutils._chunk_or_narrow_cat = per_rank_call(original_cat)
    try:
        yield
    finally:
        TorchShard._custom_chunk = original_chunk
        tutils._chunk_or_narrow_cat = original_cat


# ------------------------------------------------------------------ capability probes
#
# `decompshard doctor` asks the running torch for every hook point above, by feature
# detection (an attribute, a signature, an import), never by its version number: on a
# release nobody has tested, what is found is what counts. Each probe returns one line
# describing what it found, or raises with the reason it is not there in the shape
# decompshard uses.

__all__ += ["Probe", "decomp_strategy_parameters", "full_mesh_filter_keyword", "hook_probes", "registry_probes"]

Probe = tuple[str, bool, str]  # (hook point, found as decompshard uses it, one line: what or why not)


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

    params = inspect.signature(__getattr__("expand_to_full_mesh_op_strategy")).parameters
    for name in ("full_mesh_strategy_filter", "is_valid_strategy_cb"):
        if name in params:
            return name
    raise LookupError("expand_to_full_mesh_op_strategy takes no strategy filter keyword "
                      f"(its parameters: {', '.join(params)})")


def _require(found: bool, why: str) -> None:
    if not found:
        raise LookupError(why)


def _probe_propagator() -> str:
    sp = sharding_propagator()
    for table in ("op_single_dim_strategy_funcs", "op_strategy_funcs", "op_to_rules", "op_to_schema_info"):
        _require(isinstance(getattr(sp, table, None), dict), f"{type(sp).__name__}.{table} is not a dict")
    return f"{type(sp).__module__}.{type(sp).__name__}"


def _probe_decomp_strategy() -> str:
    fallback = sharding_propagator().decomp_strategy
    for attr in ("propagate_strategy", "ensure_schema_info", "sharding_prop"):
        _require(hasattr(fallback, attr), f"decomp_strategy ({type(fallback).__name__}) has no {attr}")
    return type(fallback).__name__ + (" (decompshard's: enable() is on)" if type(fallback) is not
                                      DecompShardingStrategy else " (torch's own fallback)")


def _probe_has_decomp() -> str:
    import inspect

    fn = inspect.getattr_static(DecompShardingStrategy, "has_decomp")
    _require(isinstance(fn, staticmethod), f"DecompShardingStrategy.has_decomp is a {type(fn).__name__}, "
             "not the staticmethod DTensor's propagator calls on the class")
    return "a staticmethod DTensor's propagator calls on the class"


def _probe_custom_handlers() -> str:
    handlers = custom_op_handlers()
    _require(isinstance(handlers, dict), f"_custom_op_handlers is a {type(handlers).__name__}, not a dict")
    return f"{len(handlers)} ops have a handler"


def _probe_redistribute_local_args() -> str:
    import inspect

    params = list(inspect.signature(DTensor._op_dispatcher.redistribute_local_args).parameters)
    _require(len(params) == 3, f"redistribute_local_args takes ({', '.join(params)}); decompshard wraps "
             "(op_info, suggested_input_schema, use_val)")
    for attr in ("unwrap_to_op_info", "_dispatch_get_local_results_slow_path", "wrap"):
        _require(hasattr(DTensor._op_dispatcher, attr), f"OpDispatcher has no {attr}")
    return f"({', '.join(params)})"


def _probe_propagation_cache() -> str:
    from torch.distributed.tensor._sharding_prop import LocalLRUCache

    sp = sharding_propagator()
    _require(callable(getattr(sp, "propagate_op_sharding_non_cached", None)),
             "the propagator has no propagate_op_sharding_non_cached")
    _require(hasattr(sp.propagate_op_sharding, "cache_clear"), "propagate_op_sharding has no cache_clear")
    cpp = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None) is not None
    return f"{LocalLRUCache.__name__} over propagate_op_sharding_non_cached" + ("; C++ cache clearable" if cpp else "")


def _probe_placeholder() -> str:
    _require(_ShardingPlaceholder(0).dim == 0, "_ShardingPlaceholder(0).dim is not 0")
    return f"{_ShardingPlaceholder.__module__}._ShardingPlaceholder"


def _probe_strided_shard() -> str:
    p = TorchStridedShard(1, split_factor=3)
    _require((p.dim, p.split_factor) == (1, 3), "_StridedShard(1, split_factor=3) does not keep its dim and factor")
    return "_StridedShard(dim, split_factor=)"


def _probe_custom_chunk() -> str:
    import torch._utils as tutils

    _require(isinstance(TorchShard.__dict__.get("_custom_chunk"), staticmethod),
             "Shard._custom_chunk is not a staticmethod of Shard")
    _require(callable(getattr(tutils, "_chunk_or_narrow_cat", None)), "torch._utils has no _chunk_or_narrow_cat")
    return "Shard._custom_chunk and torch._utils._chunk_or_narrow_cat (the simulator's chunk mend)"


def _probe_local_tensor() -> str:
    from torch.distributed._local_tensor import (  # noqa: F401
        LocalTensor, LocalTensorMode, local_tensor_mode, maybe_disable_local_tensor_mode,
    )

    return "torch.distributed._local_tensor: LocalTensorMode, LocalTensor"


def _probe_fake_store() -> str:
    store = fake_store()
    return f"{type(store).__module__}.{type(store).__name__}"


def _probe_filter_keyword() -> str:
    return f"{full_mesh_filter_keyword()}="


def _probe_custom_op_registry() -> str:
    from torch._library.custom_ops import CustomOpDef, _maybe_get_opdef  # noqa: F401

    return "torch._library.custom_ops: CustomOpDef, _maybe_get_opdef"


def _probe_one_rank_mesh() -> str:
    mesh = fake_one_rank_mesh()
    return f"DeviceMesh(_init_backend=False): shape {tuple(mesh.shape)}"


def _probe_op_db() -> str:
    db = __getattr__("op_db")
    _require(len(db) > 0, "OpInfo's op_db is empty")
    return f"{len(db)} OpInfo entries"


_HOOK_PROBES = (
    ("DTensor._op_dispatcher.sharding_propagator", _probe_propagator),
    ("sharding_propagator.decomp_strategy", _probe_decomp_strategy),
    ("DecompShardingStrategy.has_decomp", _probe_has_decomp),
    ("custom op handlers (_custom_op_handlers)", _probe_custom_handlers),
    ("OpDispatcher.redistribute_local_args", _probe_redistribute_local_args),
    ("propagate_op_sharding cache", _probe_propagation_cache),
    ("_ShardingPlaceholder", _probe_placeholder),
    ("_StridedShard", _probe_strided_shard),
    ("Shard._custom_chunk", _probe_custom_chunk),
    ("LocalTensorMode", _probe_local_tensor),
    ("FakeStore", _probe_fake_store),
    ("expand_to_full_mesh_op_strategy filter keyword", _probe_filter_keyword),
    ("custom op registry", _probe_custom_op_registry),
    ("one-rank DeviceMesh (no process group)", _probe_one_rank_mesh),
    ("OpInfo database (op_db)", _probe_op_db),
)


def _run_probe(name: str, probe: Any) -> Probe:
    from decompshard.errors import one_line

    try:
        return name, True, probe()
    except Exception as e:  # any way of not being there is an answer, not a crash
        return name, False, one_line(e, 200)


def hook_probes() -> list[Probe]:
    """Every hook point decompshard patches or reads, each found or not (with why)."""
    return [_run_probe(name, probe) for name, probe in _HOOK_PROBES]


def _table_size(table: str) -> Any:
    def probe() -> str:
        entries = getattr(sharding_propagator(), table)
        return f"{len(entries)} ops"
    return probe


def _probe_covered() -> str:
    sp = sharding_propagator()
    return f"{len(set(sp.op_single_dim_strategy_funcs) | set(sp.op_strategy_funcs) | set(sp.op_to_rules))} ops"


def _probe_single_dim_entries() -> str:
    import dataclasses

    table = sharding_propagator().op_single_dim_strategy_funcs
    _require(len(table) > 0, "op_single_dim_strategy_funcs is empty")
    info = next(iter(table.values()))
    _require(dataclasses.is_dataclass(info) and callable(getattr(info, "func", None)),
             f"its entries are {type(info).__name__}, not a dataclass with a func (the guard replaces func)")
    return f"{type(info).__name__} with func"


def _probe_decomposition_table() -> str:
    table = torch_decomposition_table()
    uncovered = sum(1 for op in table if isinstance(op, OpOverload) and not has_native_strategy(op))
    return f"{len(table)} ops, {uncovered} of them without a DTensor strategy (the decomposition fallback's)"


_REGISTRY_PROBES = (
    ("op_single_dim_strategy_funcs", _table_size("op_single_dim_strategy_funcs")),
    ("op_strategy_funcs", _table_size("op_strategy_funcs")),
    ("op_to_rules", _table_size("op_to_rules")),
    ("ops with a DTensor strategy (the three tables)", _probe_covered),
    ("op_to_schema_info", _table_size("op_to_schema_info")),
    ("single-dim strategy entries", _probe_single_dim_entries),
    ("decomposition table", _probe_decomposition_table),
)


def registry_probes() -> list[Probe]:
    """The shapes of DTensor's strategy registries and torch's decomposition table."""
    return [_run_probe(name, probe) for name, probe in _REGISTRY_PROBES]
