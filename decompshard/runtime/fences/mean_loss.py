"""The native guard's handler for mean losses DTensor reduces as a mean of per-rank means.

DTensor's native strategy for `nll_loss_forward` / `nll_loss2d_forward` with
`reduction='mean'` and a batch-sharded target runs the kernel's mean on every rank and
labels the result `Partial(avg)`: the average of per-rank means. The loss is the sum of
the counted terms over the sum of their weights (the number of targets that are not
`ignore_index`, or the class weights of the targets), so a mean of means is right only
when every rank holds the same total weight: wrong with ignored targets (every masked-LM
or padded causal-LM batch, `labels=-100`), with class weights (even on an even batch),
NaN on a rank with no counted target; and torch refuses uneven batches outright.

The handler computes what the kernel computes on one device: each rank runs the kernel
with `reduction='sum'` (DTensor's own strategy for the sum, which is right: `Partial(sum)`
of the sum and of the total weight), the two scalars are all-reduced together (one
all-reduce of two numbers per mesh dim the target is sharded on; logits never move for
this), and the loss is their quotient. Output and total weight are `Replicate`, so the
backward (`nll_loss_backward`, whose native strategy divides each row's gradient by the
replicated total weight) gets the global total weight and gives one-device gradients.
Calls that are not a mean over a sharded target go to DTensor unchanged.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from decompshard._compat import TorchPartial, TorchReplicate, dtensor_default_dispatch, dtensor_local_results, dtensor_output_spec, unsharded_dtensor
from decompshard.runtime.fences.changed import differs
from decompshard.runtime.records import Fence, Fix

__all__ = ["FIX", "MEAN", "SUM", "mean_loss_handler"]

SUM, MEAN = 2, 1  # torch's Reduction enum (at::Reduction): None 0, Mean 1, Sum 2


def _bound(op_call: Any, args: tuple, kwargs: dict) -> list[Any]:
    """The call's arguments in schema order (defaults filled in)."""
    out = list(args)
    for a in op_call._schema.arguments[len(args):]:
        out.append(kwargs[a.name] if a.name in kwargs else a.default_value)
    return out


def mean_loss_handler(warn: Callable[[Any], None]) -> Callable:
    """A DTensor custom handler for nll_loss_forward-like ops (self, target, weight,
    reduction, ignore_index) -> (output, total_weight). `warn(op)` is called when it
    replaces DTensor's answer with another number: where this rank's total weight is
    not the ranks' mean (with equal total weights on every rank, an even batch with no
    ignored target, the mean of means is the mean: the handler runs, silent)."""

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        bound = _bound(op_call, args, kwargs)
        if bound[3] != MEAN:
            return dtensor_default_dispatch(op_call, args, kwargs)
        sum_args = tuple(bound[:3]) + (SUM, bound[4])
        out_spec, tw_spec = dtensor_output_spec(op_call, sum_args, {})
        if not any(isinstance(p, TorchPartial) for p in out_spec.placements):
            return dtensor_default_dispatch(op_call, args, kwargs)  # target not sharded: the kernel's mean is global
        sums = all(p.reduce_op == "sum" for p in out_spec.placements if isinstance(p, TorchPartial))
        if tuple(tw_spec.placements) != tuple(out_spec.placements) or not sums:
            raise RuntimeError(f"decompshard guard: {op_call}: loss sum placed {out_spec.placements} but its "
                               f"total weight {tw_spec.placements}; cannot form the mean")
        (total, weight), spec = dtensor_local_results(op_call, sum_args, {})
        mesh = spec[0].mesh
        pair = unsharded_dtensor(torch.stack([total, weight]), mesh, spec[0].placements)
        both = pair.redistribute(mesh, [TorchReplicate()] * mesh.ndim).to_local()
        loss, total_weight = both[0] / both[1], both[1].clone()
        ranks = math.prod(mesh.size(d) for d, p in enumerate(spec[0].placements) if isinstance(p, TorchPartial))
        if differs(weight * ranks, total_weight, rtol=1e-9):  # a rank's total weight is not the mean's
            warn(op_call)
        rep = [TorchReplicate()] * mesh.ndim
        return unsharded_dtensor(loss, mesh, rep), unsharded_dtensor(total_weight, mesh, rep)

    return handler


def _fix(op: Any, fence: Fence, warn: Callable[[str, str], None], existing: Any) -> Callable:
    """The handler; it warns only where DTensor alone was measured wrong (elsewhere it is
    kept as the cheaper plan: the fence's `kept_where_right`)."""
    def say(op_call: Any) -> None:
        warn(f"mean-loss:{op_call}", (
            f"decompshard guard: {op_call}: DTensor's native strategy averages per-rank means (wrong when ranks "
            f"hold different numbers of counted targets or class weights); summing on each rank and dividing by "
            f"the all-reduced total weight instead"))
    return mean_loss_handler(say if fence.wrong_here() else lambda op_call: None)


FIX = Fix("sum on each rank, divide by the all-reduced total weight", handler=_fix)
