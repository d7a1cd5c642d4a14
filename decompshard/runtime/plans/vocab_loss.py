"""nll_loss over a class-sharded input: the loss half of vocab-parallel cross-entropy.

A column-parallel `lm_head` leaves the logits `Shard(-1)` on the vocabulary; cross-entropy
is `log_softmax` (softmax.py: two per-row all-reduces) then `nll_loss_forward`,
whose DTensor strategies keep the class dim whole, so the logits are all-gathered
(torch 2.13-2.15 alike). torch's `loss_parallel()` context avoids that by hand; this is
the same idea without the context: each rank picks the target's log-probability where
the target falls in its slab of classes (`_compat.slab_index`, torch's `_MaskPartial`
arithmetic) and zero elsewhere, so the loss is a sum over ranks: one all-reduce of a
scalar (`sum`/`mean`) or of one number per row (`none`). The total weight comes from
the target and the class weights, which every rank of the class group holds whole; over
the mesh dims that shard the batch it is all-reduced too, so a mean is the global sum
over the global weight (not a mean of per-rank means). The backward writes `-w[t] *
grad` at each row's target column where that column is local: no collective. The
log_softmax backward after it all-reduces one sum per row. Unlike `loss_parallel()`,
log_softmax's backward is not fused away, so it stays right when log_softmax's output
feeds anything else.

A plain target, class weights or gradient (transformers' labels under
`implicit_replication()`) is read as DTensor reads it, Replicate (`replicated_args`): a
handler gets the call's arguments raw, and the plan declined them before.

Applies when exactly one mesh dim shards the class dim, every rank holds classes (an
empty slab declines), and the other mesh dims shard the batch or replicate.
"""

from __future__ import annotations

from typing import Any

import torch

from decompshard._compat import DTensor, TorchReplicate, TorchShard, local_tensor, placed_dtensor, slab_index
from decompshard.runtime.records import Plan
from decompshard.runtime.collectives import (Priced, Stat, Step, every_rank_holds_slab, local_at, moves_cost, reduce_scalars,
                                             replicated_args, scalars_cost, sharding_dims)

__all__ = ["PLANS"]

NONE, MEAN, SUM = 0, 1, 2  # at::Reduction


class _Layout:
    """Where a call's tensors are and must be for the plan; None fields mean it declines."""

    def __init__(self, x: Any, target: Any, weight: Any):
        self.ok = False
        if not isinstance(x, DTensor) or not isinstance(target, DTensor) or x.device_mesh != target.device_mesh:
            return
        if weight is not None and (not isinstance(weight, DTensor) or weight.device_mesh != x.device_mesh):
            return
        self.x, self.mesh = x, x.device_mesh
        self.c = 1 if x.dim() >= 2 else 0
        dims = sharding_dims(x.placements, [self.c])
        if not dims or len(dims) != 1 or not every_rank_holds_slab(x.shape[self.c], self.mesh.size(dims[0])):
            return
        self.m = dims[0]
        # the target drops the class dim; the batch dims that shard keep their mesh dims
        self.target_placements = tuple(
            TorchReplicate() if i == self.m or not isinstance(p, TorchShard)
            else TorchShard(p.dim - (p.dim > self.c)) for i, p in enumerate(x.placements))
        self.batch_dims = tuple(i for i, p in enumerate(self.target_placements) if isinstance(p, TorchShard))
        self.rep = (TorchReplicate(),) * self.mesh.ndim
        self.moves = [(target, self.target_placements)] + ([(weight, self.rep)] if weight is not None else [])
        self.ok = True

    def picks(self, target: Any, weight: Any, ignore_index: int) -> tuple[torch.Tensor, ...]:
        """(local class index into this rank's slab, where it counts, w[target]) per row."""
        t = local_at(target, self.mesh, self.target_placements)
        valid = t != ignore_index
        safe = torch.where(valid, t, 0)
        idx, outside = slab_index(safe, self.x.shape[self.c], self.mesh, self.m)
        w = valid.to(self.x.dtype) if weight is None else torch.where(valid, local_at(weight, self.mesh, self.rep)[safe], 0.0)
        return idx, valid & ~outside, w


def _dtensor_args(args: tuple) -> tuple | None:
    """The call's arguments as DTensor's own path reads them (a plain target, class
    weights, grad or total weight taken as Replicate where DTensor takes it so:
    transformers' labels under `implicit_replication()`); None where `self` is plain."""
    x = args[1] if len(args) == 7 else args[0]  # the backward's `self` follows grad_output
    if not isinstance(x, DTensor):
        return None
    return replicated_args(args, x.device_mesh)


def _forward_price(op_call: Any, args: tuple, kwargs: dict) -> Priced | None:
    """The loss all-reduced over the class slabs (one number per row for `none`, else a
    scalar, then loss and total weight over the batch's mesh dims), and the target (and
    class weights) moved to the plan's placements (None: the plan does not apply)."""
    args = _dtensor_args(args)
    if args is None:
        return None
    x, target, weight, reduction = args[:4]
    lay = _Layout(x, target, weight)
    if not lay.ok:
        return None
    item = x.dtype.itemsize
    rows = None
    if reduction == NONE:
        rows = Stat(lay.mesh, x.placements, x.shape, [lay.c])
        steps = [Step("all-reduce(sum) of each row's picked log-probability over the class slabs",
                      rows.cost(["sum"], item), item)]
    else:
        steps = [Step("all-reduce(sum) of the loss over the class slabs", scalars_cost(lay.mesh, (lay.m,), item), item),
                 Step("all-reduce(sum) of (loss, total weight) over the batch's mesh dims",
                      scalars_cost(lay.mesh, lay.batch_dims, item, (2,)), item)]
    steps.append(Step("target (and class weights) to the plan's placements", moves_cost(lay.moves), item))
    return Priced(tuple(steps), (lay, rows, args))


def _backward_price(op_call: Any, args: tuple, kwargs: dict) -> Priced | None:
    """No collective: target, weights, grad and total weight moved to the plan's
    placements (None: the plan does not apply)."""
    args = _dtensor_args(args)
    if args is None:
        return None
    grad, x, target, weight, reduction, _, total_weight = args[:7]
    lay = _Layout(x, target, weight)
    if not lay.ok or not isinstance(grad, DTensor) or not isinstance(total_weight, DTensor):
        return None
    grad_placements = lay.target_placements if reduction == NONE and x.dim() > 1 else lay.rep
    moves = lay.moves + [(grad, grad_placements), (total_weight, lay.rep)]
    return Priced((Step("target, weights, grad and total weight to the plan's placements", moves_cost(moves),
                        x.dtype.itemsize),), (lay, grad_placements, args))


def _forward(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
    lay, rows, args = priced.context
    x, target, weight, reduction, ignore_index = args[:5]
    idx, here, w = lay.picks(target, weight, ignore_index)
    picked = torch.gather(local_tensor(x), lay.c, idx.unsqueeze(lay.c)).squeeze(lay.c)
    part = torch.where(here, -picked * w, 0.0)
    if reduction == NONE:
        out = rows.reduce(part.unsqueeze(lay.c), "sum").squeeze(lay.c)
        # the kernel's total weight: 0 for a batch, the target's weight for one row
        total_weight = torch.zeros_like(w.sum()) if x.dim() > 1 else w.sum()
        return (placed_dtensor(out, lay.mesh, lay.target_placements, target.shape),
                placed_dtensor(total_weight, lay.mesh, lay.rep, ()))
    # the loss over the class slabs, then (loss, total weight) together over the batch
    loss = reduce_scalars(part.sum(), lay.mesh, (lay.m,))
    loss, total_weight = reduce_scalars(torch.stack([loss, w.sum().to(loss.dtype)]), lay.mesh, lay.batch_dims).unbind()
    if reduction == MEAN:
        loss = loss / total_weight
    return placed_dtensor(loss, lay.mesh, lay.rep, ()), placed_dtensor(total_weight.clone(), lay.mesh, lay.rep, ())


def _backward(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
    lay, grad_placements, args = priced.context
    grad, x, target, weight, reduction, ignore_index, total_weight = args[:7]
    idx, here, w = lay.picks(target, weight, ignore_index)
    g = local_at(grad, lay.mesh, grad_placements)
    if reduction == MEAN:
        g = g / local_at(total_weight, lay.mesh, lay.rep)
    value = torch.where(here, -w * g, 0.0)
    out = torch.zeros_like(local_tensor(x))
    out.scatter_(lay.c, idx.unsqueeze(lay.c), value.unsqueeze(lay.c).to(out.dtype))
    return placed_dtensor(out, lay.mesh, x.placements, x.shape)


_WHAT = "nll_loss over a class-sharded input (vocab-parallel loss)"
_APPLIES = ("the class dim sharded on exactly one mesh dim, every rank holding classes; the other mesh dims Shard "
            "the batch or Replicate")
PLANS = (
    Plan(("aten.nll_loss_forward.default", "aten.nll_loss2d_forward.default"), _WHAT, _APPLIES, _forward_price,
         _forward),
    Plan(("aten.nll_loss_backward.default", "aten.nll_loss2d_backward.default"), _WHAT, _APPLIES, _backward_price,
         _backward),
)
