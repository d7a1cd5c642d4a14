"""index_add into a tensor sharded along the indexed dim: each rank adds the rows it owns.

Mixtral's expert loop adds each expert's rows into the batch-sharded token buffer at
global token indices (`final.index_add_(0, token_idx, rows)`, written back by
`inplace.py` through the functional `index_add`). No placement rule can keep `self`
sharded there, since the index names global rows, so the derived strategies keep the
indexed dim whole: the whole buffer is all-gathered once per expert. Yet nothing needs to move: each rank adds the source
rows whose index falls in its own slab, at the index made local, and leaves the others
(torch's `_MaskPartial` arithmetic, `_compat.slab_index`, as vocab-parallel embedding
does). The index and the source must be whole along the indexed dim on the mesh dim that
shards it; on the other mesh dims the source is laid out like `self` (Replicate, or
Shard of the same other dim), so this rank's source rows line up with its slab's columns.

Applies when exactly one mesh dim shards `self` along `dim` (plain Shard, every rank
holding rows), the other mesh dims Replicate or Shard another dim, and the index is a
DTensor on the same mesh; taken when it moves fewer bytes than DTensor's strategy
(`Priced.taken`), decided from global shapes and placements only. The backward
(`index_select` of the gradient for the source) is DTensor's own.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from decompshard._compat import DTensor, TorchReplicate, TorchShard, local_tensor, placed_dtensor, slab_index
from decompshard.runtime.records import Plan
from decompshard.runtime.collectives import Priced, Step, every_rank_holds_slab, local_at, moves_cost

__all__ = ["PLANS"]


class _Layout:
    """Where a call's tensors must be for the plan; `ok` False means it declines."""

    def __init__(self, x: Any, dim: int, index: Any, source: Any):
        self.ok = False
        if not all(isinstance(t, DTensor) for t in (x, index, source)) or x.dim() == 0:
            return
        if index.device_mesh != x.device_mesh or source.device_mesh != x.device_mesh or source.dim() != x.dim() \
                or index.dim() != 1:
            return
        self.dim = dim % x.dim()
        sharding = [m for m, p in enumerate(x.placements) if isinstance(p, TorchShard) and p.dim == self.dim]
        plain = all(type(p) is TorchShard or isinstance(p, TorchReplicate) for p in x.placements)
        if len(sharding) != 1 or not plain or not every_rank_holds_slab(x.shape[self.dim], x.device_mesh.size(sharding[0])):
            return
        self.x, self.mesh, self.m = x, x.device_mesh, sharding[0]
        self.source_placements = tuple(TorchReplicate() if m == self.m else p for m, p in enumerate(x.placements))
        self.index_placements = (TorchReplicate(),) * self.mesh.ndim
        self.moves = [(index, self.index_placements), (source, self.source_placements)]
        self.ok = True


def _price(op_call: Any, args: tuple, kwargs: dict) -> Priced | None:
    """Only the index and the source moved to the plan's placements (None: the plan
    does not apply)."""
    x, dim, index, source = args[:4]
    lay = _Layout(x, dim, index, source)
    if not lay.ok:
        return None
    return Priced((Step("index and source to the plan's placements (the indexed dim whole on the mesh dim "
                        "sharding self there); no collective", moves_cost(lay.moves), x.dtype.itemsize),), lay)


def _index_add(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
    lay = priced.context
    x, _, index, source = args[:4]
    alpha = args[4] if len(args) > 4 else kwargs.get("alpha", 1)
    if not math.isfinite(alpha):  # alpha * the zero rows added for other slabs' indices would not be zero
        return None
    idx, outside = slab_index(local_at(index, lay.mesh, lay.index_placements), x.shape[lay.dim], lay.mesh, lay.m)
    rows = local_at(source, lay.mesh, lay.source_placements)
    mask_shape = [-1 if d == lay.dim else 1 for d in range(rows.dim())]
    rows = torch.where(outside.view(mask_shape), torch.zeros((), dtype=rows.dtype), rows)  # added at row 0: adds zero
    out = local_tensor(x).index_add(lay.dim, idx, rows, alpha=alpha)
    return placed_dtensor(out, lay.mesh, x.placements, x.shape)


PLANS = (
    Plan(("aten.index_add.default",), "index_add into a tensor sharded along the indexed dim (each rank adds the rows "
         "it owns)", "self Shard(dim) on exactly one mesh dim, every rank holding rows, the other mesh dims Replicate "
         "or Shard of another dim; a 1-D index", _price, _index_add),
)
