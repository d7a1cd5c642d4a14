"""Ops whose output size depends on values (nonzero, masked_select, unique, ...), and
ops that return a Python value computed from whole tensors (allclose), run replicated
under `enable()`.

DTensor computes every op's output shape from the global shapes before it runs the op
(a fake-tensor run). For these ops the shape is in the data, the fake run raises
`DynamicOutputShapeException`, and DTensor stops with "Sharding propagation failed"
(Mixtral's MoE routing stops at `aten.nonzero` with a data-parallel batch), whether or
not a strategy exists. No strategy can help: sharded, each rank's output size differs,
and a DTensor's shape must be known before the kernel runs.

On replicated inputs every rank holds the whole tensor and computes the whole answer,
so the op is always right there. Under `enable()` each such op gets a DTensor handler
that does exactly that: all-gather (redistribute to Replicate) every DTensor argument,
run the op on the local tensors, and return replicated DTensors of the shapes the kernel
produced; one warning per op. The ops are found by torch's own tags for them, not by a
list: `torch.Tag.dynamic_output_shape` (the one its fake tensors raise on) and
`torch.Tag.data_dependent_output` (a Python scalar out of tensor data: `allclose`, which
otherwise stops with "does not have a sharding strategy registered"; each rank computes
the same value from the same whole tensors, a bool no shard could give alone).
Out= and in-place overloads, ops DTensor already handles (a custom handler, or a
strategy: `index.Tensor` is data-dependent only with bool indices) are left alone.
`disable()` removes the handlers.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import torch

from decompshard._compat import tree_flatten, tree_map, tree_unflatten
from decompshard._compat import DTensor, DTensorSpec, TensorMeta, TorchReplicate, aten_ops_tagged, custom_op_handlers, has_native_strategy
from decompshard.runtime import fallbacks
from decompshard.runtime.table_patches import Entry, WarnOnce, where_none

__all__ = ["data_dependent_ops", "entries", "replicated_reason"]


@functools.lru_cache(maxsize=1)
def data_dependent_ops() -> tuple[torch._ops.OpOverload, ...]:
    """Every functional aten overload tagged `dynamic_output_shape` or
    `data_dependent_output` that DTensor has no strategy or handler for."""
    handlers = custom_op_handlers()
    found = []
    tagged = aten_ops_tagged(torch.Tag.dynamic_output_shape) + aten_ops_tagged(torch.Tag.data_dependent_output)
    for op in dict.fromkeys(tagged):
        schema = op._schema
        if any(a.alias_info is not None for a in schema.arguments) or any(
                r.alias_info is not None for r in schema.returns):
            continue  # out= / in place: the output cannot be a fresh replicated tensor
        if has_native_strategy(op) or op in handlers:
            continue
        found.append(op)
    return tuple(sorted(found, key=str))


def replicated_reason(op: torch._ops.OpOverload) -> str:
    """Why `enable()` runs `op` (one of `data_dependent_ops()`) on replicated inputs."""
    if torch.Tag.dynamic_output_shape in op.tags:
        return "output size depends on values: runs on replicated inputs under enable() (data_dependent.py)"
    return ("returns a Python value computed from whole tensors: runs on replicated inputs under enable() "
            "(data_dependent.py)")


def entries(warn_once: WarnOnce) -> Iterator[Entry]:
    """The replicated handler for each data-dependent op (`enable()` installs them)."""
    found = ((op,) for op in data_dependent_ops())
    return where_none(custom_op_handlers(), found, lambda op: _replicated_handler(op, warn_once))


def _replicated_handler(op: torch._ops.OpOverload, warn_once: WarnOnce) -> Callable:
    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        dts = [x for x in flat if isinstance(x, DTensor)]
        mesh = dts[0].device_mesh
        if any(x.device_mesh != mesh for x in dts):
            raise RuntimeError(f"decompshard: {op} got DTensors on different meshes")
        if any(not p.is_replicate() for x in dts for p in x.placements):
            message = f"decompshard: {op} has a data-dependent output; running it replicated " \
                      "(its DTensor inputs are all-gathered)"
            fallbacks.record(op, fallbacks.DATA_DEPENDENT, message)
            warn_once(f"data:{op}", message)
        local = [x.full_tensor() if isinstance(x, DTensor) else x for x in flat]
        l_args, l_kwargs = tree_unflatten(local, spec)
        out = op_call(*l_args, **l_kwargs)
        rep = tuple(TorchReplicate() for _ in range(mesh.ndim))

        def wrap(t: Any) -> Any:
            if not isinstance(t, torch.Tensor):
                return t
            meta = TensorMeta(t.shape, t.stride(), t.dtype)
            return DTensor(t, DTensorSpec(mesh, rep, tensor_meta=meta), requires_grad=False)

        return tree_map(wrap, out)

    handler.__name__ = f"replicated_{op._opname}"
    return handler
