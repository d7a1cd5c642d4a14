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
from decompshard.runtime.collectives import ROWS_SHARDED, Priced, Stat, Step, moves_cost, sharding_dims
from decompshard.runtime.records import Plan

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


def _forward_args(args: tuple, kwargs: dict) -> tuple[Any, Any, Any]:
    return tuple((list(args) + [kwargs.get("dim"), kwargs.get("half_to_float", False)])[:3])


def _forward_price(op_call: Any, args: tuple, kwargs: dict) -> Priced | None:
    """Two all-reduces of one number per row (None: the plan does not apply)."""
    x, dim, _ = _forward_args(args, kwargs)
    found = _row_dim(x, dim)
    if found is None:
        return None
    d, _ = found
    stat, item = Stat(x.device_mesh, x.placements, x.shape, [d]), _itemsize(x.dtype)
    return Priced((Step("all-reduce(max) of each row's local log-sum-exp", stat.cost(["max"], item), item),
                   Step("all-reduce(sum) of each row's exp(local lse - max)", stat.cost(["sum"], item), item)),
                  (d, stat))


def _backward_price(op_call: Any, args: tuple, kwargs: dict) -> Priced | None:
    """One all-reduce of one number per row, and the gradient moved to the output's
    placements (None: the plan does not apply)."""
    grad, out, dim = args[:3]
    found = _row_dim(out, dim)
    if found is None or not isinstance(grad, DTensor) or grad.device_mesh != out.device_mesh:
        return None
    if sharding_dims(grad.placements, []) is None:  # a Partial gradient: DTensor's business
        return None
    d, _ = found
    stat, item = Stat(out.device_mesh, out.placements, out.shape, [d]), _itemsize(grad.dtype)
    return Priced((Step("all-reduce(sum) of each row's sum of grad (x output)", stat.cost(["sum"], item), item),
                   Step("grad_output to the output's placements", moves_cost([(grad, tuple(out.placements))]),
                        grad.dtype.itemsize)), (d, stat))


def _forward(log: bool):
    def plan(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
        x, _, half_to_float = _forward_args(args, kwargs)
        d, stat = priced.context
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
    def plan(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
        grad, out, _, input_dtype = args[:4]
        d, stat = priced.context
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


_WHAT = "softmax / log_softmax over a sharded dim"
PLANS = (
    Plan(("aten._softmax.default",), _WHAT, ROWS_SHARDED, _forward_price, _forward(log=False)),
    Plan(("aten._log_softmax.default",), _WHAT, ROWS_SHARDED, _forward_price, _forward(log=True)),
    Plan(("aten._softmax_backward_data.default",), _WHAT, ROWS_SHARDED, _backward_price, _backward(log=False)),
    Plan(("aten._log_softmax_backward_data.default",), _WHAT, ROWS_SHARDED, _backward_price, _backward(log=True)),
)
