"""Collective plans: ops run on their shards as they are, with small collectives inside.

DTensor runs one strategy per op with nothing moved inside it, so an op that reduces
along a sharded dim has its whole input gathered first. A plan runs the op where the data
is and moves a few numbers per row or channel instead, where that is priced below
DTensor's own strategy (global shapes, placements and the mesh only: every rank decides
alike). Performance only: on by default with `enable()`, off with `enable(plans=False)`
or DECOMPSHARD_PLANS=0, independent of the native guard.

    softmax        softmax / log_softmax and their backward over a sharded dim
    layer_norm     layer norm over a sharded hidden dim, forward and backward
    vocab_loss     nll_loss over a class-sharded input (vocab-parallel cross-entropy)
    index_add      index_add into a tensor sharded along the indexed dim (nothing moved)
    index_put      index_put (accumulate) / scatter_add of values sharded like the index, into a Partial(sum)
    batch_norm     batch norm on a batch-sharded input (SyncBatchNorm's plan)
    conv_channels  convolutions with channel-sharded weights, on their shards
    bool_reductions  all() / any() of a whole sharded tensor: each rank its own part, one byte moved

`PLANS` is the one registry: `entries()` installs each plan's handler (`Plan.handler`:
the plan where it pays, else the next handler in the op's chain), and `explain` prices a
call with the same `Plan.price` the handler decides by.
"""

from __future__ import annotations

import functools
from typing import Any, Iterator

from decompshard._compat import custom_op_handlers, dtensor_default_dispatch
from decompshard.op_names import resolve_op
from decompshard.runtime.collectives import Priced, dtensor_cost
from decompshard.runtime.plans import (batch_norm, bool_reductions, conv_channels, index_add, index_put, layer_norm, softmax,
                                      vocab_loss)
from decompshard.runtime.records import Plan
from decompshard.runtime.table_patches import Entry

__all__ = ["PLANS", "entries", "plan_for", "plan_ops", "price"]

PLANS: tuple[Plan, ...] = (*softmax.PLANS, *layer_norm.PLANS, *vocab_loss.PLANS, *index_add.PLANS, *index_put.PLANS,
                           *batch_norm.PLANS, *conv_channels.PLANS, *bool_reductions.PLANS)


@functools.lru_cache(maxsize=None)
def _by_op() -> dict[Any, Plan]:
    found: dict[Any, Plan] = {}
    for plan in PLANS:
        for name in plan.ops:
            try:
                found[resolve_op(name)] = plan
            except ValueError:  # an overload this torch does not have
                continue
    return found


def plan_for(op: Any) -> Plan | None:
    """The op's collective plan, or None where it has none."""
    return _by_op().get(op)


def plan_ops() -> list[tuple[Any, Plan]]:
    """(op, plan) for every plan whose op this torch has."""
    return list(_by_op().items())


def _next_in_chain(slot: Any, plan: Plan) -> Any:
    """What the plan hands a declined call to: DTensor's default path for an empty slot,
    the guard's fence in the slot, or DTensor's own handler where the plan goes in front
    of it; None where the slot is someone else's (`loss_parallel()`'s), left alone."""
    if slot is None:
        return dtensor_default_dispatch
    if getattr(slot, "fence", None) is not None or plan.over_dtensor_handler:
        return slot
    return None


def entries() -> Iterator[Entry]:
    """Each plan's handler, in front of what its op's handler slot holds (installed after
    the guard's fences, so a fence already in the slot is the plan's fallback)."""
    handlers = custom_op_handlers()
    for op, plan in plan_ops():
        after = _next_in_chain(handlers.get(op), plan)
        if after is not None:
            yield handlers, op, plan.handler(after)


def price(op: Any, args: tuple, kwargs: dict) -> tuple[Priced | None, Any, bool]:
    """(the plan's price, None where it does not apply; DTensor's way's cost, as the plan
    decides by (`Priced.against`, else DTensor's strategy's input moves), None where
    DTensor has no strategy; whether the plan runs the call) for a call on DTensors,
    by the functions the plan's handler decides with. Run it with `enable()` on: DTensor's
    strategy is then the one the plan competes with."""
    plan = plan_for(op)
    if plan is None:
        raise ValueError(f"{op} has no collective plan")
    priced = plan.price(op, args, kwargs)
    native = priced.against if priced is not None and priced.against is not None else dtensor_cost(op, args, kwargs)
    return priced, native, priced is not None and priced.taken(op, args, kwargs)
