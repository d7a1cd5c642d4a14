"""Batch norm on a batch-sharded input: the statistics all-reduced inside the op (what
DDP users get from SyncBatchNorm), not the activations moved.

DTensor's strategies for batch norm and its backward (torch 2.13 `_ops/_math_ops.py`)
shard the channels only: data parallel's batch-sharded input is moved to Shard(1) and
back around every call, forward and backward (an all-to-all of the activations each way).
One device's batch norm needs only a few numbers per channel summed over the ranks that
split the batch. So, where the input is sharded on the batch only (Shard(0) or Replicate
on every mesh dim) and every per-channel tensor is replicated:

* training forward: per-channel sums all-reduced over the batch's mesh dims, then the
  centred sums of squares likewise (two passes, as one device computes the variance;
  sum-of-squares minus squared sum cancels in float32); the kernel normalizes the local
  shard in its evaluation form with the global mean and biased variance; the output keeps
  the input's placements, the saved mean and invstd are Replicate, and the running
  statistics are updated on every rank as one device does (unbiased, global count);
* training backward: one all-reduce of the stacked per-channel sums of grad_out and
  grad_out * xhat; grad_input local; grad_weight and grad_bias are those sums, Replicate;
* evaluation: the kernel on the local shard, no collective; grad_weight and grad_bias
  Partial(sum) over the batch's mesh dims.

The collectives are DTensor's `redistribute` (Partial(sum) -> Replicate), so they run
under LocalTensorMode, gloo and CommDebugMode alike. Decision rule (`RULE`), from global
shapes and placements only, so every rank decides alike: the plan's all-reduces against
DTensor's way, the activations moved to the channels and back (forward: the input there,
the output back; backward: grad_output and the input there, grad_input back), both
priced by the cost model; always in evaluation, where the plan moves nothing. Otherwise, and for any other layout, the call goes down its chain
(the guard's running-statistics fence, fences/batch_norm_stats.py, or DTensor's own
path). Tests: tests/test_sync_batchnorm.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from decompshard._compat import DTensor, TorchPartial, TorchReplicate, TorchShard, contiguous_spec, local_tensor, wrap_local_results
from decompshard.mesh.cost import Cost, redistribute_cost
from decompshard.runtime.collectives import Priced, Step, moved_local
from decompshard.runtime.records import Plan

__all__ = ["FORWARD_OVERLOADS", "BACKWARD_OVERLOADS", "Layout", "PLANS", "backward_price", "forward_price",
           "layout_of", "to_channels_and_back"]

RULE = ("fewer bytes than DTensor's way, the activations moved to the channels and back (the cost model's bytes; "
        "a tie goes to DTensor); evaluation always")

# schema names that differ between the overloads, mapped to one name
_ALIASES = {"save_var": "save_invstd", "update": "train", "training": "train"}


@dataclass(frozen=True)
class Layout:
    """Which mesh dims shard the input's batch (dim 0) and which its channels (dim 1)."""

    mesh: Any
    batch: tuple[int, ...]
    channel: tuple[int, ...]

    def per_channel(self, dim: int = 0, partial: bool = False) -> tuple:
        """Placements of a per-channel tensor (channels on tensor dim `dim`): sharded with
        the input's channels, Partial(sum) over the batch's mesh dims when `partial`."""
        return tuple(TorchShard(dim) if d in self.channel else
                     TorchPartial("sum") if partial and d in self.batch else TorchReplicate()
                     for d in range(self.mesh.ndim))


def _named(op_call: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The call's arguments by (aliased) schema name, defaults filled in."""
    out = {}
    for i, a in enumerate(op_call._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
        out[_ALIASES.get(a.name, a.name)] = value
    return out


def layout_of(x: Any, others: list[Any]) -> Layout | None:
    """The layout when `x` is sharded on its batch (Shard(0) on at least one mesh dim) and
    otherwise on its channels or not at all (Shard(1), Replicate), and every other tensor
    argument is absent or a DTensor on the same mesh, replicated except that it may be
    sharded with the channels; None otherwise."""
    if not isinstance(x, DTensor) or x.ndim < 2:
        return None
    batch, channel = [], []
    for d, p in enumerate(x.placements):
        if type(p) is TorchShard and p.dim in (0, 1):
            (batch if p.dim == 0 else channel).append(d)
        elif not isinstance(p, TorchReplicate):
            return None
    if not batch:
        return None
    for t in others:
        if t is None:
            continue
        if not isinstance(t, DTensor) or t.device_mesh != x.device_mesh:
            return None
        for d, p in enumerate(t.placements):
            if not (isinstance(p, TorchReplicate) or (d in channel and type(p) is TorchShard and p.dim == 0)):
                return None
    return Layout(x.device_mesh, tuple(batch), tuple(channel))


def to_channels_and_back(x: Any, layout: Layout, moves: int) -> Cost:
    """DTensor's way for a batch-sharded call: `moves` activations of `x`'s shape moved
    between the batch's and the channels' layout (an all-to-all each on the batch's mesh
    dims; its strategies shard the channels only)."""
    channels = tuple(TorchShard(1) if d in layout.batch else p for d, p in enumerate(x.placements))
    one = redistribute_cost(tuple(x.shape), x.dtype.itemsize, tuple(x.placements), channels, tuple(layout.mesh.shape))
    total = Cost()
    for _ in range(moves):
        total = total + one
    return total


def _moved(local: torch.Tensor, layout: Layout, shape: Any, src: tuple, dst: tuple) -> torch.Tensor:
    """`local` (global `shape`) from placements `src` to `dst`: DTensor's own collectives."""
    if src == dst:
        return local
    return moved_local(local, layout.mesh, src, dst, shape)


def _all_reduced(local: torch.Tensor, layout: Layout, shape: Any) -> torch.Tensor:
    """Per-channel partial sums (channels on the last dim) summed over the batch's mesh dims."""
    dim = len(shape) - 1
    return _moved(local, layout, shape, layout.per_channel(dim, partial=True), layout.per_channel(dim))


def _channel_local(t: Any, layout: Layout) -> Any:
    """This rank's channels of a per-channel DTensor (a local slice where it is replicated)."""
    if t is None:
        return None
    return _moved(local_tensor(t), layout, t.shape, tuple(t.placements), layout.per_channel())


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _per_channel(v: torch.Tensor, ndim: int) -> torch.Tensor:
    return v.reshape((1, -1) + (1,) * (ndim - 2))


def _moments(x: Any, layout: Layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The global per-channel mean and biased variance of a batch-sharded `x` (this rank's
    channels), every rank alike: two all-reduces of C numbers each (the sums, then the
    centred sums of squares)."""
    local, channels = local_tensor(x), x.shape[1]
    count = x.numel() // channels
    reduce = [0, *range(2, x.ndim)]
    acc = _opmath(x.dtype)
    mean = _all_reduced(local.sum(reduce, dtype=acc), layout, (channels,)) / count
    centred = local.to(acc) - _per_channel(mean, x.ndim)
    var = _all_reduced((centred * centred).sum(reduce), layout, (channels,)) / count
    return mean, var


def _normalized(local: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor, w: Any, b: Any) -> torch.Tensor:
    """(x - mean) * invstd * weight + bias on the local shard, in plain elementwise ops: the
    kernel itself divides by its row count, and a rank may hold no row (uneven batch)."""
    n = local.ndim
    scale = invstd if w is None else invstd * w.to(invstd.dtype)
    out = (local.to(mean.dtype) - _per_channel(mean, n)) * _per_channel(scale, n)
    if b is not None:
        out = out + _per_channel(b.to(out.dtype), n)
    return out.to(local.dtype)


def _forward_outputs(op_call: Any, x: Any, layout: Layout, out: torch.Tensor, stats: list[torch.Tensor]) -> Any:
    """The op's outputs as DTensors: the normalized tensor on `x`'s placements, the saved
    statistics with the input's channels (empty ones, evaluation's, replicated), and
    `_batch_norm_with_update`'s reserve replicated."""
    mesh, rep = layout.mesh, (TorchReplicate(),) * layout.mesh.ndim
    specs = [contiguous_spec(mesh, x.placements, x.shape, out.dtype, x.stride())]
    specs += [contiguous_spec(mesh, layout.per_channel() if s.numel() else rep, (x.shape[1] if s.numel() else 0,), s.dtype)
              for s in stats]
    if len(op_call._schema.returns) == 4:
        stats = [*stats, torch.empty(0, dtype=torch.uint8, device=out.device)]
        specs.append(contiguous_spec(mesh, rep, (0,), torch.uint8))
    return wrap_local_results(tuple([out, *stats]), tuple(specs))


def _update_running(bufs: list[Any], values: list[torch.Tensor], momentum: float, layout: Layout) -> None:
    """running = (1 - momentum) * running + momentum * value, in place on every rank, each
    buffer in its own placements (the values, on this rank's channels, gathered where a
    buffer holds every channel: one all-gather of 2 x C / shards numbers)."""
    channels = bufs[0].shape[0]
    stacked = torch.stack(values)
    full = None
    for buf, i in zip(bufs, range(len(values))):
        if tuple(buf.placements) == layout.per_channel():
            value = stacked[i]
        else:
            if full is None:
                full = _moved(stacked, layout, (len(values), channels), layout.per_channel(1),
                              (TorchReplicate(),) * layout.mesh.ndim)
            value = full[i]
        with torch.no_grad():
            local_tensor(buf).mul_(1 - momentum).add_((value * momentum).to(buf.dtype))


def _all_reduce_cost(layout: Layout, shape: tuple, dtype: torch.dtype) -> Cost:
    """The price of `_all_reduced` on per-channel sums of global `shape`."""
    dim = len(shape) - 1
    return redistribute_cost(shape, _opmath(dtype).itemsize, layout.per_channel(dim, partial=True),
                             layout.per_channel(dim), tuple(layout.mesh.shape))


def forward_price(op_call: Any, args: tuple, kwargs: dict, training_default: bool | None = None) -> Priced | None:
    """The batch-sharded forward's collectives and its decision (`pays`; evaluation moves
    nothing and always runs), or None where the plan does not apply to the call."""
    a = _named(op_call, args, kwargs)
    x = a["input"]
    train = bool(a.get("train", training_default))
    rm, rv = a.get("running_mean"), a.get("running_var")
    layout = layout_of(x, [a["weight"], a["bias"], rm, rv])
    if layout is None or not x.dtype.is_floating_point or (not train and (rm is None or rv is None)):
        return None
    steps = []
    if train:
        c, item = x.shape[1], _opmath(x.dtype).itemsize
        steps = [Step("all-reduce(sum) of the per-channel sums", _all_reduce_cost(layout, (c,), x.dtype), item),
                 Step("all-reduce(sum) of the per-channel centred sums of squares",
                      _all_reduce_cost(layout, (c,), x.dtype), item)]
        if rm is not None and rv is not None and any(tuple(b.placements) != layout.per_channel() for b in (rm, rv)):
            rep = (TorchReplicate(),) * layout.mesh.ndim
            steps.append(Step("all-gather of the running statistics' update (channel-sharded)",
                              redistribute_cost((2, c), item, layout.per_channel(1), rep, tuple(layout.mesh.shape)),
                              item))
    if not train:
        return Priced((), (a, layout, train), verdict=True, rule=RULE)
    return Priced(tuple(steps), (a, layout, train), rule=RULE, against=to_channels_and_back(x, layout, 2))


def backward_price(op_call: Any, args: tuple, kwargs: dict) -> Priced | None:
    """The batch-sharded backward's collective (training: one all-reduce of 2 x C sums;
    evaluation: none, the parameter gradients stay partial sums) and its decision, or
    None where the plan does not apply."""
    a = _named(op_call, args, kwargs)
    x, dy = a["input"], a["grad_out"]
    train = bool(a["train"])
    stats = ("save_mean", "save_invstd") if train else ("running_mean", "running_var")
    per_channel = [a["weight"], *(a[s] for s in stats)]
    layout = layout_of(x, per_channel)
    if layout is None or not isinstance(dy, DTensor) or tuple(dy.placements) != tuple(x.placements) \
            or dy.shape != x.shape or not x.dtype.is_floating_point \
            or any(t is None or t.numel() != x.shape[1] for t in per_channel[1:]):
        return None
    steps = (Step("all-reduce(sum) of the per-channel sums of grad_out and grad_out * xhat (stacked)",
                  _all_reduce_cost(layout, (2, x.shape[1]), x.dtype), _opmath(x.dtype).itemsize),) if train else ()
    if not train:
        return Priced(steps, (a, layout, train, per_channel), verdict=True, rule=RULE)
    return Priced(steps, (a, layout, train, per_channel), rule=RULE, against=to_channels_and_back(x, layout, 3))


def _run_forward(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
    """The batch-sharded forward (module doc), given its price's context."""
    a, layout, train = priced.context
    x, rm, rv = a["input"], a.get("running_mean"), a.get("running_var")
    eps, local = a["eps"], local_tensor(x)
    w, b = _channel_local(a["weight"], layout), _channel_local(a["bias"], layout)
    if not train:
        mean = _channel_local(rm, layout).to(_opmath(x.dtype))
        invstd = torch.rsqrt(_channel_local(rv, layout).to(mean.dtype) + eps)
        out = _normalized(local, mean, invstd, w, b)
        return _forward_outputs(op_call, x, layout, out, [mean.new_empty(0), mean.new_empty(0)])
    mean, var = _moments(x, layout)
    invstd = torch.rsqrt(var + eps)
    out = _normalized(local, mean, invstd, w, b)
    if rm is not None and rv is not None:
        count = x.numel() // x.shape[1]
        unbiased = var * (count / (count - 1)) if count > 1 else var * float("nan")
        _update_running([rm, rv], [mean, unbiased], a["momentum"], layout)
    return _forward_outputs(op_call, x, layout, out, [mean, invstd])


def _backward_outputs(x: Any, layout: Layout, mask: list[bool], grads: list[Any], partial: bool) -> Any:
    """grad_input on `x`'s placements; grad_weight and grad_bias with the input's channels,
    summed over the batch's mesh dims already or Partial(sum) there (`partial`)."""
    mesh = layout.mesh
    specs = [contiguous_spec(mesh, x.placements, x.shape, x.dtype, x.stride())]
    specs += [contiguous_spec(mesh, layout.per_channel(partial=partial), (x.shape[1],), g.dtype) if g is not None else None
              for g in grads[1:]]
    outs = [g if m else None for g, m in zip(grads, mask)]
    specs = [s if m else None for s, m in zip(specs, mask)]
    return wrap_local_results(tuple(outs), tuple(specs))


def _run_backward(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
    """The batch-sharded backward (module doc), given its price's context: grad_out and
    input share a layout the plan takes, every per-channel tensor is replicated or
    sharded with the channels (the forward took the batch-sharded plan)."""
    a, layout, train, per_channel = priced.context
    x, dy = a["input"], a["grad_out"]
    mask = list(a["output_mask"])
    w, mean, stat = (_channel_local(t, layout) for t in per_channel)
    if not train:  # running statistics: everything local, the parameter gradients partial sums
        grads = _eval_grads(x, local_tensor(dy), w, mean, stat, a["eps"])
        return _backward_outputs(x, layout, mask, grads, partial=True)
    return _backward_outputs(x, layout, mask, _train_grads(x, layout, local_tensor(dy), w, mean, stat),
                             partial=False)


def _train_grads(x: Any, layout: Layout, gl: torch.Tensor, w: Any, mean: torch.Tensor,
                 invstd: torch.Tensor) -> list[torch.Tensor]:
    """One device's training-mode gradients from the local shards and one all-reduce of
    the per-channel sums of grad_out and grad_out * xhat."""
    n, channels = x.ndim, x.shape[1]
    count = x.numel() // channels
    reduce = [0, *range(2, n)]
    acc = mean.dtype
    xhat = (local_tensor(x).to(acc) - _per_channel(mean, n)) * _per_channel(invstd, n)
    g = gl.to(acc)
    sums = _all_reduced(torch.stack([g.sum(reduce), (g * xhat).sum(reduce)]), layout, (2, channels))
    sum_dy, sum_dy_xhat = sums[0], sums[1]
    scale = invstd if w is None else invstd * w.to(acc)
    grad_input = (g - _per_channel(sum_dy / count, n) - xhat * _per_channel(sum_dy_xhat / count, n)) \
        * _per_channel(scale, n)
    wdtype = x.dtype if w is None else w.dtype
    return [grad_input.to(x.dtype), sum_dy_xhat.to(wdtype), sum_dy.to(wdtype)]


def _eval_grads(x: Any, gl: torch.Tensor, w: Any, rm: torch.Tensor, rv: torch.Tensor,
                eps: float) -> list[torch.Tensor]:
    """Evaluation-mode gradients from the local shards: grad_input exact, grad_weight and
    grad_bias this rank's part of their sums."""
    n, reduce = x.ndim, [0, *range(2, x.ndim)]
    acc = _opmath(x.dtype)
    invstd = torch.rsqrt(rv.to(acc) + eps)
    g = gl.to(acc)
    xhat = (local_tensor(x).to(acc) - _per_channel(rm.to(acc), n)) * _per_channel(invstd, n)
    scale = invstd if w is None else invstd * w.to(acc)
    wdtype = x.dtype if w is None else w.dtype
    return [(g * _per_channel(scale, n)).to(x.dtype), (g * xhat).sum(reduce).to(wdtype), g.sum(reduce).to(wdtype)]


# Forward overloads -> the training mode of an overload whose schema has no `training`
# flag (None: it has one).
FORWARD_OVERLOADS: dict[str, bool | None] = {
    "aten.native_batch_norm.default": None,
    "aten._native_batch_norm_legit.default": None,
    "aten._native_batch_norm_legit.no_stats": None,
    "aten._native_batch_norm_legit_no_training.default": False,
    "aten._batch_norm_with_update.default": True,
}
BACKWARD_OVERLOADS: tuple[str, ...] = (
    "aten.native_batch_norm_backward.default",
    "aten.batch_norm_backward.default",
)
_WHAT = "batch norm on a batch-sharded input (SyncBatchNorm's plan)"
_APPLIES = ("the input Shard(0) on some mesh dim, the others Shard(1) or Replicate; every per-channel tensor "
            "Replicate or sharded with the channels")
PLANS = (
    *(Plan((name,), _WHAT, _APPLIES, functools.partial(forward_price, training_default=training), _run_forward)
      for name, training in FORWARD_OVERLOADS.items()),
    Plan(BACKWARD_OVERLOADS, _WHAT, _APPLIES, backward_price, _run_backward),
)
