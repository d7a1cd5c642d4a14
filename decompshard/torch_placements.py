"""decompshard's placements to and from torch's: a rule's single-dim placements, an N-D
placement of a real DTensor (`_S(d, sf)` for torch's _StridedShard)."""

from __future__ import annotations

from typing import Any

from decompshard._compat import TorchPartial, TorchReplicate, TorchShard, TorchShardingPlaceholder, TorchStridedShard
from decompshard.placements import R, Partial, Replicate, ShardPlaceholder, StridedShard

__all__ = ["from_torch_placement", "to_torch_placement"]


def from_torch_placement(p: Any, *, strided: bool = False):
    """torch placement (or single-dim placeholder) -> decompshard's alphabet.

    Returns `NotImplemented` for placements the single-dim alphabet cannot express
    faithfully (a _StridedShard produced from a plain Shard, say); callers drop such rules.
    With `strided` (an N-D placement of a real DTensor, not a rule's), a _StridedShard
    becomes the `StridedShard` the placement grammar writes as `_S(d, sf)`.
    """
    if p is None:
        return None
    if isinstance(p, TorchShardingPlaceholder):
        return ShardPlaceholder(p.dim)
    if isinstance(p, TorchStridedShard):
        return StridedShard(p.dim, p.split_factor) if strided else NotImplemented
    if isinstance(p, TorchShard):
        return ShardPlaceholder(p.dim)
    if isinstance(p, TorchReplicate):
        return R
    if type(p) is TorchPartial:  # subclasses (_NormPartial, _MaskPartial) combine differently
        return Partial(p.reduce_op) if p.reduce_op in ("sum", "avg", "max", "min") else NotImplemented
    return NotImplemented


def to_torch_placement(p: Any) -> Any:
    """decompshard placement -> torch placement (S(d) becomes a plain Shard(d), None stays;
    `_S(d, sf)` a _StridedShard(d, split_factor=sf))."""
    if p is None:
        return None
    if isinstance(p, ShardPlaceholder):
        return TorchShard(p.dim)
    if isinstance(p, StridedShard) and p.inner == 1:
        return TorchStridedShard(p.dim, split_factor=p.sf)
    if isinstance(p, Partial):
        return TorchPartial(p.reduce_op)
    if isinstance(p, Replicate):
        return TorchReplicate()
    raise TypeError(f"not a placement: {p!r}")
