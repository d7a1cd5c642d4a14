"""`all()` / `any()` of a whole sharded tensor: each rank reduces its own part, one byte moves.

transformers' attention masks test a batch-sharded boolean tensor with `.all()` before
`.item()`. DTensor 2.14 and 2.15 gather the whole tensor first: all/any are not linear,
and its `Partial("product")` rule for them (2.13) was refuted (the native guard fences
that `.item()` on 2.13). Yet a full `all` is the AND of every rank's own `all`, whatever
the layout (Shard, `_StridedShard`, uneven or empty parts: an empty part's `all` is True,
its `any` False, the identities), and `any` the OR: each rank reduces its local tensor
and one byte is all-reduced (min for `all`, max for `any`, as uint8) over each mesh dim
that splits the tensor. The result is Replicate, as DTensor's.

Applies to `all.default` / `any.default` of a DTensor with no Partial placement (a
Partial's parts are not the tensor's parts); taken where it moves fewer bytes than
DTensor's strategy (`Priced.taken`): a gathered tensor of more than a few elements.
The reductions over some dims (`all.dim`) are DTensor's own.
"""

from __future__ import annotations

from typing import Any

import torch

from decompshard._compat import DTensor, TorchReplicate, local_tensor, placed_dtensor
from decompshard.runtime.collectives import Priced, Step, reduce_scalars, scalars_cost
from decompshard.runtime.records import Plan

__all__ = ["PLANS"]

_REDUCE = {"all": "min", "any": "max"}


def _split_dims(x: Any) -> list[int] | None:
    """The mesh dims that split `x` (None where one holds a Partial: the plan declines)."""
    dims = []
    for m, p in enumerate(x.placements):
        if p.is_partial():
            return None
        if not isinstance(p, TorchReplicate):
            dims.append(m)
    return dims


def _price(op_call: Any, args: tuple, kwargs: dict) -> Priced | None:
    x = args[0] if args else None
    if not isinstance(x, DTensor):
        return None
    dims = _split_dims(x)
    if not dims:
        return None
    return Priced((Step(f"each rank's own {op_call._opname}; one byte all-reduced per mesh dim splitting the tensor",
                        scalars_cost(x.device_mesh, dims, 1), 1),), dims)


def _reduce(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
    x, dims = args[0], priced.context
    local = op_call(local_tensor(x))
    mine = local.to(torch.uint8).reshape(1)
    reduced = reduce_scalars(mine, x.device_mesh, dims, _REDUCE[op_call._opname]).reshape(()).to(local.dtype)
    return placed_dtensor(reduced, x.device_mesh, (TorchReplicate(),) * x.device_mesh.ndim, torch.Size(()))


PLANS = (
    Plan(("aten.all.default", "aten.any.default"), "all() / any() of a whole tensor: each rank reduces its own part, "
         "one byte all-reduced (min / max) per mesh dim splitting it", "a DTensor with no Partial placement, split on "
         "some mesh dim (any Shard layout, uneven or empty parts too)", _price, _reduce),
)
