"""Steering: what a matmul's backward node will do with its gradient after the op in flight.

A matmul's backward node (`MmBackward0`, `AddmmBackward0`: every `nn.Linear` and
transformers' `Conv1D`) reads its incoming gradient twice: first for the weight's
gradient (`mm_mat2_backward`: `grad.t() @ x`, or `x.t() @ grad`), then for the input's
(`mm_mat1_backward`: `grad @ w.t()`). Where the gradient arrives Partial, DTensor chooses
each mm's strategy alone. For the first it weighs reducing the gradient against gathering
`x` and keeping it Partial; the second then reduces it anyway where its weight is sharded
on the input's features (a row-parallel layer: Llama's `o_proj` behind a vocab-parallel
`lm_head`, `[32, 64]P(sum) @ [64, 32]S(1)`), and the gather bought nothing:
`reduce_once` would have reused the first mm's reduction for the second.

`shared_move` asks DTensor, before the first mm chooses, what the second will do with
the same gradient (its own propagation with the steering on, from the specs the node
saved: the answer enters DTensor's cache, where the second call finds it). Where that is
a pure reduction (`reduce_once.reduced_dims`), it returns the spec the first mm would move
its gradient argument to for `reduce_once` to reuse the result; `kept_partial` then
charges every other candidate that reduction, paid later. Every rank asks alike (shapes
and placements only). Not covered: a node whose saved tensors are not DTensors, a
gradient argument met as a copy (not a view of the node's gradient), `_StridedShard`, a
column-major input (its gradient is computed as `(w @ grad.t()).t()`).
Tests: tests/test_partial_pricing.py.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from decompshard._compat import (DTensor, DTensorSpec, TensorMeta, TorchShard, current_autograd_node, dtensor_spec,
                                 in_backward, linear_node_operands, planned_input_specs, same_sizes)
from decompshard.runtime.steering.reduce_once import reduced_dims

__all__ = ["shared_move", "transposed"]

_MM = torch.ops.aten.mm.default
_ASKING = threading.local()  # on while asking DTensor about the second mm: it asks nothing further


def transposed(spec: Any) -> Any:
    """The spec of a 2-D tensor's `.t()` (its placements and layout transposed); None
    for another rank, no tensor meta, or a placement other than Shard, Replicate, Partial."""
    meta = getattr(spec, "tensor_meta", None)
    if meta is None or len(meta.shape) != 2:
        return None
    placements = []
    for p in spec.placements:
        if type(p) is TorchShard:
            placements.append(TorchShard(1 - p.dim % 2))
        elif p.is_replicate() or p.is_partial():
            placements.append(p)
        else:
            return None
    meta_t = TensorMeta(torch.Size(tuple(meta.shape)[::-1]), tuple(meta.stride)[::-1], meta.dtype)
    return DTensorSpec(spec.mesh, tuple(placements), tensor_meta=meta_t)


def _gradient_arg(args: list, mat1: Any, mat2: Any) -> tuple[int, Any] | None:
    """Which argument of the weight gradient's mm is the node's gradient, and the
    gradient's own spec: (0, grad) for `grad.t() @ mat1`, (1, grad) for
    `mat1.t() @ grad`; None where this mm is not the node's weight gradient. Shapes are
    compared as expressions (`same_sizes`: no guard under torch.compile); shapes equal only
    at this compile's sizes count as different, and the steering steps aside."""
    a, b = args
    grad_shape = (mat1.shape[0], mat2.shape[1])
    mat1_t = transposed(mat1)
    if same_sizes(b.shape, mat1.shape) and b.placements == mat1.placements and same_sizes(a.shape, grad_shape[::-1]):
        return 0, transposed(a)
    if mat1_t is not None and same_sizes(a.shape, mat1_t.shape) and a.placements == mat1_t.placements \
            and same_sizes(b.shape, grad_shape):
        return 1, b
    return None


def _column_major(meta: Any) -> bool:
    """`mm_mat1_backward`'s test for a transposed input (2-D, strides (1, rows))."""
    return len(meta.shape) == 2 and same_sizes(meta.stride, (1, meta.shape[0]))


def shared_move(op_schema: Any) -> tuple[int, Any] | None:
    """For an mm that is a matmul node's weight gradient in backward, with the node's
    gradient arriving Partial: (its gradient argument's index, the spec that argument
    moves to when it moves as the node's input-gradient mm will move the gradient, a pure
    reduction that `reduce_once` reuses). None elsewhere: forward, another op or node, no
    input gradient computed, the second mm keeping the gradient as it is or moving it
    otherwise."""
    if op_schema.op is not _MM or getattr(_ASKING, "on", False) or not in_backward():
        return None
    found = linear_node_operands(current_autograd_node())
    if found is None or not found[2] or not all(isinstance(t, DTensor) for t in found[:2]):
        return None
    mat1, mat2 = dtensor_spec(found[0]), dtensor_spec(found[1])
    if mat1.tensor_meta is None or mat2.tensor_meta is None or _column_major(mat1.tensor_meta):
        return None  # a column-major input's gradient is `(w @ grad.t()).t()`: not asked
    args = list(op_schema.args_spec)
    hit = _gradient_arg(args, mat1, mat2) if len(args) == 2 else None
    weight = transposed(mat2)
    if hit is None or hit[1] is None or weight is None or not any(p.is_partial() for p in hit[1].placements):
        return None
    index, grad = hit
    _ASKING.on = True
    try:
        chosen = planned_input_specs(_MM, (grad, weight))
    finally:
        _ASKING.on = False
    if chosen is None or reduced_dims(grad, chosen[0]) is None:
        return None
    target = chosen[0] if index == 1 else transposed(chosen[0])
    return (index, target) if target is not None else None
