"""layer norm over a sharded hidden dim, forward and backward, without moving the input.

DTensor's strategies for `native_layer_norm` and its backward keep the normalized dims
whole, so an input sharded on the hidden dim is all-gathered, and its weight and bias
with it (torch 2.13-2.15 alike). The statistics a row needs from the other ranks are
two sums (forward: the sum, then the sum of squared deviations; one all-reduce each,
one number per row) and, backward, two more sums stacked into one all-reduce. Output
and input gradient stay on the input's placements, the weight and bias are used (and
their gradients returned) on the matching slabs of the hidden dim; the returned mean
and rstd are replicated over the hidden dim's mesh dims.

float32 and float64 only: for half precision the CPU kernel keeps its statistics in
float32, which this plan does not reproduce bit for bit, so those go to DTensor.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from decompshard._compat import DTensor, TorchPartial, TorchReplicate, TorchShard, local_tensor, placed_dtensor
from decompshard.runtime.collectives import ROWS_SHARDED, Priced, Step, Stat, local_at, moves_cost, sharding_dims
from decompshard.runtime.records import Plan

__all__ = ["PLANS"]


class _Norm:
    """One call's layout: the normalized dims, their statistics, the parameters' slabs."""

    def __init__(self, x: Any, normalized_shape: Any):
        self.ok = False
        if not isinstance(x, DTensor) or x.dtype not in (torch.float32, torch.float64):
            return
        k = len(normalized_shape)
        self.axis = x.dim() - k
        self.reduced = tuple(range(self.axis, x.dim()))
        if not k or not sharding_dims(x.placements, self.reduced) or 0 in x.shape:
            return
        self.x, self.mesh = x, x.device_mesh
        self.count = math.prod(x.shape[self.axis:])
        self.stat = Stat(self.mesh, x.placements, x.shape, self.reduced)
        # weight and bias: the slab of the hidden dims this rank's input holds
        self.param_placements = tuple(
            TorchShard(p.dim - self.axis) if isinstance(p, TorchShard) and p.dim >= self.axis else TorchReplicate()
            for p in x.placements)
        # their gradients: summed over the rows, so a mesh dim sharding rows leaves a partial sum
        self.grad_param_placements = tuple(
            TorchPartial("sum") if isinstance(p, TorchShard) and p.dim < self.axis else q
            for p, q in zip(x.placements, self.param_placements))
        self.ok = True

    def param(self, p: Any) -> torch.Tensor | None:
        return None if p is None else local_at(p, self.mesh, self.param_placements)

    def moves(self, *params: Any) -> list:
        return [(p, self.param_placements) for p in params if p is not None]

    def wrap(self, t: torch.Tensor, placements: tuple, shape: Any) -> Any:
        return placed_dtensor(t.contiguous(), self.mesh, placements, shape)


def _params_ok(norm: _Norm, *params: Any) -> bool:
    return all(p is None or (isinstance(p, DTensor) and p.device_mesh == norm.mesh
                             and sharding_dims(p.placements, []) is not None) for p in params)


def _forward_price(op_call: Any, args: tuple, kwargs: dict) -> Priced | None:
    """Two all-reduces of one number per row, and the weight and bias moved to the input's
    hidden slab (None: the plan does not apply)."""
    x, normalized_shape, weight, bias = args[:4]
    norm = _Norm(x, normalized_shape)
    if not norm.ok or not _params_ok(norm, weight, bias):
        return None
    item = x.dtype.itemsize
    return Priced((Step("all-reduce(sum) of each row's sum", norm.stat.cost(["sum"], item), item),
                   Step("all-reduce(sum) of each row's sum of squared deviations", norm.stat.cost(["sum"], item), item),
                   Step("weight and bias to the input's hidden slab", moves_cost(norm.moves(weight, bias)), item)),
                  norm)


def _backward_price(op_call: Any, args: tuple, kwargs: dict) -> Priced | None:
    """One all-reduce of two numbers per row, and grad, mean, rstd and weight moved to the
    plan's placements (None: the plan does not apply)."""
    grad, x, normalized_shape, mean, rstd, weight, bias = args[:7]
    norm = _Norm(x, normalized_shape)
    if not norm.ok or not _params_ok(norm, weight, bias, grad, mean, rstd):
        return None
    stats = [(grad, tuple(x.placements)), (mean, norm.stat.placements), (rstd, norm.stat.placements)]
    item = x.dtype.itemsize
    return Priced((Step("all-reduce(sum) of each row's sums of grad*w and grad*w*xhat (stacked)",
                        norm.stat.cost(["sum"], item, width=2), item),
                   Step("weight, grad_out, mean and rstd to the plan's placements",
                        moves_cost(norm.moves(weight) + stats), item)),
                  (norm, stats))


def _forward(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
    x, normalized_shape, weight, bias, eps = args[:5]
    norm = priced.context
    xl = local_tensor(x)
    mean = norm.stat.reduce(xl.sum(norm.reduced, keepdim=True), "sum") / norm.count
    centered = xl - mean
    var = norm.stat.reduce((centered * centered).sum(norm.reduced, keepdim=True), "sum") / norm.count
    rstd = torch.rsqrt(var + eps)
    out = centered * rstd
    w, b = norm.param(weight), norm.param(bias)
    if w is not None:
        out = out * w
    if b is not None:
        out = out + b
    return (norm.wrap(out, tuple(x.placements), x.shape), norm.wrap(mean, norm.stat.placements, norm.stat.shape),
            norm.wrap(rstd, norm.stat.placements, norm.stat.shape))


def _backward(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
    grad, x, normalized_shape, mean, rstd, weight, bias, mask = args[:8]
    norm, stats = priced.context
    g, m, r = (local_at(t, norm.mesh, pl) for t, pl in stats)
    xhat = (local_tensor(x) - m) * r
    w = norm.param(weight)
    gw = g * w if w is not None else g
    both = torch.stack([gw.sum(norm.reduced, keepdim=True), (gw * xhat).sum(norm.reduced, keepdim=True)], dim=-1)
    both = norm.stat.reduce(both, "sum") / norm.count
    rows = tuple(range(norm.axis))

    def over_rows(t: torch.Tensor) -> torch.Tensor:
        return t.sum(rows) if rows else t

    shape = x.shape[norm.axis:]
    grad_input = r * (gw - both[..., 0] - xhat * both[..., 1]) if mask[0] else None
    grad_weight = over_rows(g * xhat) if mask[1] and weight is not None else None
    grad_bias = over_rows(g) if mask[2] and bias is not None else None
    return (None if grad_input is None else norm.wrap(grad_input, tuple(x.placements), x.shape),
            None if grad_weight is None else norm.wrap(grad_weight, norm.grad_param_placements, shape),
            None if grad_bias is None else norm.wrap(grad_bias, norm.grad_param_placements, shape))


_WHAT = "layer norm over a sharded hidden dim"
_APPLIES = ROWS_SHARDED + "; float32 or float64; weight and bias Shard or Replicate"
PLANS = (
    Plan(("aten.native_layer_norm.default",), _WHAT, _APPLIES, _forward_price, _forward),
    Plan(("aten.native_layer_norm_backward.default",), _WHAT, _APPLIES, _backward_price, _backward),
)
