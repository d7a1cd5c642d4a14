"""Channel-parallel convolution: a conv whose weight is sharded on its channels runs on
its local shards, as Megatron's column- and row-parallel layers do, instead of having
its weight all-gathered.

DTensor's convolution strategies (torch 2.13-2.15, `_ops/_conv_ops.py`) have a batch
rule only (input Shard(0), weight Replicate; 2.15 adds spatial sharding of the last
dim), and its custom handlers (`_tp_conv.py`) run the local kernel on whatever they get
(fences/conv_handlers.py). A channel-parallel plan (ResNet's `conv1: colwise, conv2:
rowwise`) therefore has every sharded weight all-gathered, forward and backward. A
convolution is linear in its input and in its weight, channel by channel, so per mesh dim:

* colwise: input Replicate, weight Shard(0), bias Shard(0) -> output Shard(1);
* rowwise: input Shard(1), weight Shard(1) -> output Partial(sum), the bias Partial too;
* grouped (depthwise): input Shard(1), weight Shard(0), bias Shard(0), the groups and
  both channel counts multiples of the mesh dim's size -> output Shard(1), the local
  kernel with groups / size;
* batch: input Shard(0), weight and bias Replicate -> output Shard(0);
* replicated: everything Replicate -> Replicate.

A Replicate tensor a rule wants sharded is cut locally. Backward follows the forward's
rule: colwise gives grad_input Partial(sum), grad_weight and grad_bias Shard(0); rowwise
takes grad_output Replicate and gives grad_input and grad_weight Shard(1), grad_bias
Replicate; grouped keeps Shard(1) / Shard(0); batch gives grad_weight and grad_bias
Partial(sum); grad_output moves by DTensor's own collectives. Decision rule
(`_costs`): the channel-parallel form is taken where it moves fewer bytes than the
weight all-gathers it replaces, both priced by the cost model (a conv's weight can be
larger or smaller than its activations). Any other layout (a dim sharded on two mesh dims, spatial dims, transposed
convolutions, an uneven grouped split, no channel sharding) goes down its chain (the
guard's redistributing fence, or DTensor's own handler). Tests: tests/test_conv_channels.py.
"""

from __future__ import annotations

from typing import Any

import torch

from decompshard._compat import DTensor, TorchPartial, TorchReplicate, TorchShard, contiguous_spec, local_tensor, redistribute_local_tensor, wrap_local_results
from decompshard.mesh.cost import Cost, redistribute_cost
from decompshard.runtime.collectives import Priced, Step
from decompshard.runtime.records import Plan

__all__ = ["PLANS"]

aten = torch.ops.aten
_R = TorchReplicate()
_P = TorchPartial("sum")


def _is(p: Any, dim: int) -> bool:
    return type(p) is TorchShard and p.dim == dim


def _kind(x: Any, w: Any, groups: int, size: int, shapes: tuple) -> str | None:
    """The rule of one mesh dim (of `size` ranks) for input placement `x`, weight `w`."""
    channels_in, channels_out = shapes
    if groups > 1:
        even = groups % size == 0 and channels_in % size == 0 and channels_out % size == 0
        if (_is(x, 1) or isinstance(x, TorchReplicate)) and (_is(w, 0) or isinstance(w, TorchReplicate)) \
                and not (isinstance(x, TorchReplicate) and isinstance(w, TorchReplicate)):
            return "grouped" if even else None
    elif isinstance(x, TorchReplicate) and _is(w, 0):
        return "colwise"
    elif (_is(x, 1) and (_is(w, 1) or isinstance(w, TorchReplicate))) or (isinstance(x, TorchReplicate) and _is(w, 1)):
        return "rowwise"
    if _is(x, 0) and isinstance(w, TorchReplicate):
        return "batch"
    if isinstance(x, TorchReplicate) and isinstance(w, TorchReplicate):
        return "replicated"
    return None


# per rule: placements of (input, weight, bias) for the local kernel, then of
# (output,) forward; backward: grad_output wanted, then (grad_input, grad_weight, grad_bias)
_FORWARD = {
    "colwise": ((_R, TorchShard(0), TorchShard(0)), TorchShard(1)),
    "rowwise": ((TorchShard(1), TorchShard(1), _P), _P),
    "grouped": ((TorchShard(1), TorchShard(0), TorchShard(0)), TorchShard(1)),
    "batch": ((TorchShard(0), _R, _R), TorchShard(0)),
    "replicated": ((_R, _R, _R), _R),
}
_BACKWARD = {
    "colwise": (TorchShard(1), (_P, TorchShard(0), TorchShard(0))),
    "rowwise": (_R, (TorchShard(1), TorchShard(1), _R)),
    "grouped": (TorchShard(1), (TorchShard(1), TorchShard(0), TorchShard(0))),
    "batch": (TorchShard(0), (TorchShard(0), _P, _P)),
    "replicated": (_R, (_R, _R, _R)),
}


def _kinds(x: Any, w: Any, groups: int, transposed: bool) -> list[str] | None:
    """The rule of every mesh dim, or None where the call is not channel-parallel."""
    if transposed or not isinstance(x, DTensor) or not isinstance(w, DTensor) or x.device_mesh != w.device_mesh \
            or x.ndim < 3 or w.ndim != x.ndim:
        return None
    mesh = x.device_mesh
    kinds = [_kind(px, pw, groups, mesh.size(d), (x.shape[1], w.shape[0]))
             for d, (px, pw) in enumerate(zip(x.placements, w.placements))]
    if None in kinds or not any(k in ("colwise", "rowwise", "grouped") for k in kinds):
        return None
    # one tensor dim split by at most one mesh dim (the grouped count and the bias
    # split are per mesh dim), every placement one of the rules'
    for dim_users in (("colwise", "grouped"), ("rowwise", "grouped"), ("batch",)):
        if sum(k in dim_users for k in kinds) > 1:
            return None
    return kinds


def _price(shape: Any, dtype: torch.dtype, mesh: Any, src: list, dst: list) -> Cost:
    """A tensor of global `shape` moved from placements `src` to `dst`, priced by the cost
    model from global metadata only, so every rank decides alike."""
    return redistribute_cost(tuple(shape), dtype.itemsize, tuple(src), tuple(dst), tuple(mesh.shape))


def _move(what: str, shape: Any, dtype: torch.dtype, mesh: Any, src: list, dst: list) -> Step:
    """One of the plan's own moves, in words for `explain`, with its price."""
    return Step(what, _price(shape, dtype, mesh, src, dst), dtype.itemsize)


def _at(placements: Any, t: int, p: Any) -> list:
    return [p if d == t else q for d, q in enumerate(placements)]


def _costs(kinds: list[str], x: Any, w: Any, out_shape: Any) -> tuple[tuple[Step, ...], Cost]:
    """The channel-parallel run's moves (fences/conv_handlers.py's layout), and what
    DTensor's way moves instead, forward and backward together:

    * colwise: the backward all-reduce of grad_input against the weight's shard
      all-gathered twice (forward, backward);
    * rowwise: the forward all-reduce of the output against the same weight gathers
      plus the input's shard gathered (where it is channel-sharded);
    * a replicated weight cut locally needs its gradient's shard all-gathered back.

    Why not always the channel-parallel form: a convolution's weight is small beside its
    activations at real resolutions but not at the zoo's (timm's test_efficientnet tp),
    and ResNet's late layers are the other way round (weights far larger than
    activations; docs/results.md). The choice is per call, the same forward and backward
    (same shapes)."""
    mesh = x.device_mesh
    t = next(d for d, k in enumerate(kinds) if k in ("colwise", "rowwise"))
    other = _at(x.placements, t, _R)  # the activations' batch split
    w_replicated = isinstance(w.placements[t], TorchReplicate)
    steps, dtensor = [], Cost()
    if w_replicated:
        steps.append(_move("all-gather of grad_weight's channel shard (the weight was cut locally)", w.shape,
                           w.dtype, mesh, _at(w.placements, t, TorchShard(0)), list(w.placements)))
    else:
        gather = _price(w.shape, w.dtype, mesh, list(w.placements), _at(w.placements, t, _R))
        dtensor = gather + gather
    if kinds[t] == "colwise":
        steps.append(_move("all-reduce(sum) of grad_input (backward)", x.shape, x.dtype, mesh, _at(other, t, _P), other))
    else:
        steps.append(_move("all-reduce(sum) of the output (forward)", out_shape, x.dtype, mesh, _at(other, t, _P), other))
        if _is(x.placements[t], 1):
            dtensor = dtensor + _price(x.shape, x.dtype, mesh, list(x.placements), _at(x.placements, t, _R))
    return tuple(reversed(steps)), dtensor


def _out_shape(x: Any, w: Any, stride: Any, padding: Any, dilation: Any) -> tuple[int, ...]:
    """A (not transposed) convolution's global output shape."""
    spatial = [(d + 2 * padding[i] - dilation[i] * (w.shape[i + 2] - 1) - 1) // stride[i] + 1
               for i, d in enumerate(x.shape[2:])]
    return (x.shape[0], w.shape[0], *spatial)


def _local(t: Any, want: tuple) -> torch.Tensor | None:
    """`t`'s local tensor moved to placements `want` (DTensor's collectives; Replicate to
    Shard or Partial is local)."""
    if t is None:
        return None
    if tuple(t.placements) == want:
        return local_tensor(t)
    src = contiguous_spec(t.device_mesh, t.placements, t.shape, t.dtype, t.stride())
    dst = contiguous_spec(t.device_mesh, want, t.shape, t.dtype, t.stride())
    return redistribute_local_tensor(local_tensor(t), src, dst)


def _reduced(local: torch.Tensor, mesh: Any, placements: tuple, shape: Any) -> tuple[torch.Tensor, Any]:
    """An activation (rowwise output, colwise grad_input) with its Partial(sum) mesh
    dims all-reduced now, as Megatron's row- and column-parallel layers do, and its spec.
    Left Partial, every consumer reduces it on its own (BatchNorm's forward, and its
    backward again on the saved input: ResNet tp 2x the all-reduces) and DTensor carries
    a Partial gradient through linear ops where it grows (ResNet's stem: max_pool2d's
    backward, 4x the bytes before the reduction)."""
    spec = contiguous_spec(mesh, placements, shape, local.dtype)
    if not any(isinstance(p, TorchPartial) for p in placements):
        return local, spec
    done = contiguous_spec(mesh, tuple(_R if isinstance(p, TorchPartial) else p for p in placements), shape,
                           local.dtype)
    return redistribute_local_tensor(local, spec, done), done


def _local_groups(groups: int, kinds: list[str], mesh: Any) -> int:
    for d, k in enumerate(kinds):
        if k == "grouped":
            groups //= mesh.size(d)
    return groups


_RULE = ("fewer bytes than DTensor's way, forward and backward together: the weight's all-gathers, and the input's "
         "where it is channel-sharded (the cost model's bytes; a tie goes to DTensor); grouped (depthwise): always")


def _priced(kinds: list[str], x: Any, w: Any, out_shape: Any) -> Priced:
    if "grouped" in kinds:  # no activation moves: always taken
        return Priced((), kinds, verdict=True, rule=_RULE)
    steps, dtensor = _costs(kinds, x, w, out_shape)
    return Priced(steps, kinds, rule=_RULE, against=dtensor)


def _forward_price(op_call: Any, args: tuple, kwargs: dict) -> Priced | None:
    """Where the forward's layout is one of the rules: the plan, taken where it pays."""
    if len(args) != 9:
        return None
    x, w, b, stride, padding, dilation, transposed, output_padding, groups = args
    kinds = _kinds(x, w, groups, transposed)
    if kinds is None or kwargs or (b is not None and (not isinstance(b, DTensor) or b.device_mesh != x.device_mesh)):
        return None
    return _priced(kinds, x, w, _out_shape(x, w, stride, padding, dilation))


def _backward_price(op_call: Any, args: tuple, kwargs: dict) -> Priced | None:
    """Where the backward's layout is one of the rules: the plan, taken where it pays."""
    if len(args) != 11:
        return None
    dy, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = args
    kinds = _kinds(x, w, groups, transposed)
    if kinds is None or kwargs or not isinstance(dy, DTensor) or dy.device_mesh != x.device_mesh:
        return None
    return _priced(kinds, x, w, dy.shape)


def _forward(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
    x, w, b, stride, padding, dilation, transposed, output_padding, groups = args
    kinds = priced.context
    mesh = x.device_mesh
    want = [tuple(_FORWARD[k][0][i] for k in kinds) for i in range(3)]
    local = aten.convolution.default(_local(x, want[0]), _local(w, want[1]), _local(b, want[2]), stride, padding,
                                     dilation, transposed, output_padding, _local_groups(groups, kinds, mesh))
    shape = (x.shape[0], w.shape[0], *local.shape[2:])  # spatial dims are never sharded here
    local, spec = _reduced(local, mesh, tuple(_FORWARD[k][1] for k in kinds), shape)
    return wrap_local_results(local, spec)


def _backward(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
    dy, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = args
    kinds = priced.context
    mesh = x.device_mesh
    inputs = [tuple(_FORWARD[k][0][i] for k in kinds) for i in range(2)]
    local_w = _local(w, inputs[1])
    local_bias = None if bias_sizes is None else [local_w.shape[0]]
    grads = aten.convolution_backward.default(
        _local(dy, tuple(_BACKWARD[k][0] for k in kinds)), _local(x, inputs[0]), local_w, local_bias, stride,
        padding, dilation, transposed, output_padding, _local_groups(groups, kinds, mesh), mask)
    shapes = (x.shape, w.shape, (w.shape[0],))
    grads, specs = list(grads), [None] * 3
    for i, g in enumerate(grads):
        if g is not None:
            specs[i] = contiguous_spec(mesh, tuple(_BACKWARD[k][1][i] for k in kinds), shapes[i], g.dtype)
    if grads[0] is not None:
        grads[0], specs[0] = _reduced(grads[0], mesh, specs[0].placements, x.shape)
    return wrap_local_results(tuple(grads), tuple(specs))


_WHAT = "convolution with its weight sharded on its channels, run on the shards as they are (channel-parallel)"
_APPLIES = ("the weight sharded on its output channels (colwise), input channels (rowwise) or groups (depthwise) on "
            "one mesh dim, the activations laid out to match; the batch Shard(0) or Replicate on the others")
PLANS = (
    Plan(("aten.convolution.default",), _WHAT, _APPLIES, _forward_price, _forward, over_dtensor_handler=True),
    Plan(("aten.convolution_backward.default",), _WHAT, _APPLIES, _backward_price, _backward,
         over_dtensor_handler=True),
)
