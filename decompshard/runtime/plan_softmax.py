"""softmax / log_softmax over a sharded dim, forward and backward, without moving the input.

DTensor's strategies for `_softmax`, `_log_softmax` and their backward ops keep the
softmax dim whole, so a `Shard(dim)` input is all-gathered (torch 2.13-2.15 alike). The
softmax of a row needs only two numbers per row from the other ranks: each rank's
log-sum-exp of its part, combined as `m = max_r lse_r`, `lse = m + log(sum_r
exp(lse_r - m))` (an all-reduce(max) and an all-reduce(sum) of one number per row; an
empty shard's lse is -inf and adds nothing). The backward needs one per-row sum. Output
and gradient stay on the input's placements.
"""

from __future__ import annotations

from typing import Any

import torch

from decompshard._compat import DTensor, local_tensor, placed_dtensor
from decompshard.runtime.row_reduce import Stat, cheaper_than_dtensor, moves_cost, sharding_dims

__all__ = ["PLANS"]

_LOW = (torch.float16, torch.bfloat16)


def _row_dim(x: Any, dim: int) -> tuple[int, tuple[int, ...]] | None:
    """(the wrapped dim, the mesh dims sharding it) when this plan applies to x."""
    if not isinstance(x, DTensor) or x.dim() == 0:
        return None
    d = dim % x.dim()
    mesh_dims = sharding_dims(x.placements, [d])
    if not mesh_dims or x.shape[d] == 0:
        return None
    return d, mesh_dims


def _itemsize(dtype: torch.dtype) -> int:
    return 4 if dtype in _LOW else dtype.itemsize


def _forward(log: bool):
    def plan(op_call: Any, args: tuple, kwargs: dict) -> Any:
        x, dim, half_to_float = (list(args) + [kwargs.get("dim"), kwargs.get("half_to_float", False)])[:3]
        found = _row_dim(x, dim)
        if found is None:
            return None
        d, _ = found
        stat = Stat(x.device_mesh, x.placements, x.shape, [d])
        if not cheaper_than_dtensor(stat.cost(["max", "sum"], _itemsize(x.dtype)), op_call, args, kwargs):
            return None
        local = local_tensor(x)
        comp = local.float() if local.dtype in _LOW else local
        part = torch.logsumexp(comp, d, keepdim=True)  # -inf on an empty shard
        top = stat.reduce(part, "max")
        lse = top + torch.log(stat.reduce(torch.exp(part - top), "sum"))
        out = comp - lse if log else torch.exp(comp - lse)
        out = out.to(torch.float32 if half_to_float else x.dtype)
        return placed_dtensor(out, x.device_mesh, x.placements, x.shape)
    return plan


def _backward(log: bool):
    def plan(op_call: Any, args: tuple, kwargs: dict) -> Any:
        grad, out, dim, input_dtype = args[:4]
        found = _row_dim(out, dim)
        if found is None or not isinstance(grad, DTensor) or grad.device_mesh != out.device_mesh:
            return None
        if sharding_dims(grad.placements, []) is None:  # a Partial gradient: DTensor's business
            return None
        d, _ = found
        stat = Stat(out.device_mesh, out.placements, out.shape, [d])
        cost = stat.cost(["sum"], _itemsize(grad.dtype)) + moves_cost([(grad, tuple(out.placements))])
        if not cheaper_than_dtensor(cost, op_call, args, kwargs):
            return None
        if tuple(grad.placements) != tuple(out.placements):
            grad = grad.redistribute(out.device_mesh, out.placements)
        g, o = local_tensor(grad), local_tensor(out)
        if log:
            gi = g - torch.exp(o) * stat.reduce(g.sum(d, keepdim=True), "sum")
        else:
            go = g * o
            gi = go - o * stat.reduce(go.sum(d, keepdim=True), "sum")
        return placed_dtensor(gi.to(input_dtype), out.device_mesh, out.placements, out.shape)
    return plan


PLANS = {
    "aten._softmax.default": _forward(log=False),
    "aten._log_softmax.default": _forward(log=True),
    "aten._softmax_backward_data.default": _backward(log=False),
    "aten._log_softmax_backward_data.default": _backward(log=True),
}
