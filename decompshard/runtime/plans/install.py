"""Plans with small collectives inside an op, chosen where they move less than DTensor's.

DTensor runs one strategy per op with nothing moved inside it, so an op that reduces
along a sharded dim (softmax, a norm over the hidden dim, cross-entropy over a sharded
vocabulary) has its whole input gathered first. The plans here run such an op on the
shards as they are and all-reduce per-row statistics in between (`row_reduce.py`):

* softmax / log_softmax and their backward ops over a sharded dim (`plan_softmax.py`);
* nll_loss over a class-sharded input, the second half of vocab-parallel cross-entropy
  (`plan_vocab_loss.py`);
* layer norm over a sharded hidden dim, forward and backward (`plan_norms.py`);
* index_add into a tensor sharded along the indexed dim, which moves nothing at all:
  each rank adds the rows it owns (`plan_index_add.py`, Mixtral's expert loop).

Each plan declines (returns None) unless its placements apply and the cost model prices
it below DTensor's own strategy, from global shapes, placements and the mesh only, so
every rank chooses alike; a declined call goes on as it would have gone (DTensor's
path, or the native guard's handler). `enable()` installs them, `disable()` removes
them: the plans go into `ACTIVE`, and one handler per op (`planned_or`) consults it.
The guard's own handler for nll_loss (guard_losses.py) is wrapped the same way, so
whichever of the two holds the op's handler slot, the plan is tried first.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from decompshard._compat import custom_op_handlers, dtensor_default_dispatch
from decompshard.op_names import resolve_op
from decompshard.runtime.plans import index_add as plan_index_add
from decompshard.runtime.plans import layer_norm as plan_norms
from decompshard.runtime.plans import softmax as plan_softmax
from decompshard.runtime.plans import vocab_loss as plan_vocab_loss
from decompshard.runtime.table_patches import Entry, WarnOnce, where_none

__all__ = ["ACTIVE", "entries", "planned_or", "plan_ops"]

ACTIVE: dict[Any, Callable] = {}  # op -> plan, while enable() is installed


def _named_plans() -> dict[str, Callable]:
    return {**plan_softmax.PLANS, **plan_vocab_loss.PLANS, **plan_norms.PLANS, **plan_index_add.PLANS}


def plan_ops() -> list[tuple[Any, Callable]]:
    """(op, plan) for every plan whose op this torch has."""
    found = []
    for name, plan in _named_plans().items():
        try:
            found.append((resolve_op(name), plan))
        except ValueError:  # an overload this torch does not have
            continue
    return found


def planned_or(fallback: Callable) -> Callable:
    """A DTensor custom handler: the op's active plan where it takes the call, else
    `fallback(op_call, args, kwargs)`."""

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        plan = ACTIVE.get(op_call)
        if plan is not None:
            out = plan(op_call, args, kwargs)
            if out is not None:
                return out
        return fallback(op_call, args, kwargs)

    handler.__wrapped__ = fallback  # type: ignore[attr-defined]
    return handler


def entries(warn: WarnOnce) -> Iterator[Entry]:
    """What `enable()` puts where: every plan into `ACTIVE`, and a handler for each op
    that has none (an op whose handler is someone else's, `loss_parallel()`'s, keeps
    it; the guard's nll_loss handler consults `ACTIVE` itself)."""
    found = plan_ops()
    for op, plan in found:
        yield ACTIVE, op, plan
    yield from where_none(custom_op_handlers(), [(op,) for op, _ in found],
                          lambda op: planned_or(dtensor_default_dispatch))
