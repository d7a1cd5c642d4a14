"""`masked_fill_` on a Partial `self`, where the fill keeps the Partial: run on the parts.

DTensor's strategy for `masked_fill_` is pointwise and takes no Partial input, and an
in-place op cannot move its `self`, so DTensor raises on a Partial `self`. torch's own
label-smoothed cross-entropy reaches exactly that on class-sharded logits: it sums the
log-probabilities over the classes (`Partial(sum)` where log_softmax kept them sharded,
the collective plan's layout) and then zeroes the ignored rows in place
(`smooth_loss.masked_fill_(target == ignore_index, 0)`), so `cross_entropy(...,
label_smoothing=...)` raised under `enable()` where torch alone gathers the logits.

Filling a replicated constant keeps a Partial where every part filled alike gives the
filled total (check/project rules `_masked_fill_rules`): `avg`, `max` and `min` for any
value, `sum` for 0. Then each rank fills its own part with the mask at `self`'s
placements (its Partial mesh dims read as Replicate; a mask of another shape only where
`self` shards nothing), nothing moved. Any other call goes to DTensor unchanged.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator

import torch

from decompshard._compat import (DTensor, TorchPartial, TorchReplicate, TorchShard, custom_op_handlers,
                                 dtensor_default_dispatch, local_tensor)
from decompshard.runtime.collectives import local_at, replicated_args
from decompshard.runtime.table_patches import Entry, WarnOnce, where_none

__all__ = ["entries", "kept_by_fill"]


def kept_by_fill(placement: Any, value: Any) -> bool:
    """Whether filling `value` into every part of a tensor placed `placement` fills the
    whole tensor with it (a Replicate or Shard trivially does)."""
    if not isinstance(placement, TorchPartial):
        return True
    return placement.reduce_op in ("avg", "max", "min") or (placement.reduce_op == "sum" and value == 0)


def _mask_placements(self_: Any, mask: Any, value: Any) -> tuple | None:
    """Where the mask must be for this rank's part of `self` (None: the fill does not
    keep `self`'s placements, or the mask cannot be laid out alike)."""
    if not all(kept_by_fill(p, value) for p in self_.placements):
        return None
    if not isinstance(mask, DTensor) or mask.device_mesh != self_.device_mesh:
        return None
    if any(not isinstance(p, (TorchPartial, TorchReplicate, TorchShard)) for p in self_.placements):
        return None
    placements = tuple(TorchReplicate() if isinstance(p, TorchPartial) else p for p in self_.placements)
    if tuple(mask.shape) != tuple(self_.shape) and any(isinstance(p, TorchShard) for p in placements):
        return None
    return placements


def _handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """Each rank fills its own part where the fill keeps `self`'s Partial; else DTensor."""
    self_ = args[0]
    if isinstance(self_, DTensor) and not kwargs and any(isinstance(p, TorchPartial) for p in self_.placements):
        self_, mask, value = replicated_args(args[:3], self_.device_mesh)
        finite = isinstance(value, (bool, int, float)) and math.isfinite(float(value))
        placements = _mask_placements(self_, mask, value) if finite else None
        if placements is not None:
            local_tensor(self_).masked_fill_(local_at(mask, self_.device_mesh, placements), value)
            return self_
    dtensor_default_dispatch(op_call, args, kwargs)  # DTensor's in-place path: self's placements kept
    return args[0]  # an in-place op returns self, as DTensor's dispatch does


def _make(op: Any) -> Callable:
    return _handler


def entries(warn_once: WarnOnce) -> Iterator[Entry]:
    """The handler for `masked_fill_.Scalar` (where its slot is empty)."""
    return where_none(custom_op_handlers(), [(torch.ops.aten.masked_fill_.Scalar,)], _make)
