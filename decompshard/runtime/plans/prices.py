"""Every op with a plan that runs collectives inside it, and the plan's own price for a call.

Why: `explain` shows, for such an op, what the plan would all-reduce, what that costs
next to DTensor's single-op strategy, and which one `enable()` runs. It must answer with
the functions the plans decide with (each plan module's `PRICES`, sync_batchnorm's
`forward_price` / `backward_price`), not a second copy of their arithmetic that could
drift from them: a `Priced`'s `taken` is the very test the plan's handler applies.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

from decompshard.op_names import resolve_op
from decompshard.runtime.plans import index_add as plan_index_add
from decompshard.runtime.plans import layer_norm as plan_norms
from decompshard.runtime.plans import softmax as plan_softmax
from decompshard.runtime.plans import vocab_loss as plan_vocab_loss
from decompshard.runtime.plans import batch_norm as sync_batchnorm
from decompshard.runtime.fences.table import BATCH_SHARDED_NORM_BACKWARDS, BATCH_SHARDED_NORMS
from decompshard.runtime.collectives import Priced, dtensor_cost

__all__ = ["PlanInfo", "plan_info", "price"]


@dataclass(frozen=True)
class PlanInfo:
    """Where an op's plan lives, what it does, and which placements it takes."""

    module: str
    what: str
    applies: str
    price: Callable[[Any, tuple, dict], Priced | None]
    guard: bool = False  # installed by the native guard (enable()'s default), not by enable() alone


_ROWS = "a Shard of the reduced dim on some mesh dim, the other mesh dims Shard of other dims or Replicate"


def _table() -> dict[str, PlanInfo]:
    out: dict[str, PlanInfo] = {}
    for name, fn in plan_softmax.PRICES.items():
        out[name] = PlanInfo("runtime/plans/softmax.py", "softmax / log_softmax over a sharded dim", _ROWS, fn)
    for name, fn in plan_norms.PRICES.items():
        out[name] = PlanInfo("runtime/plans/layer_norm.py", "layer norm over a sharded hidden dim",
                             _ROWS + "; float32 or float64; weight and bias Shard or Replicate", fn)
    for name, fn in plan_vocab_loss.PRICES.items():
        out[name] = PlanInfo("runtime/plans/vocab_loss.py", "nll_loss over a class-sharded input (vocab-parallel loss)",
                             "the class dim sharded on exactly one mesh dim, every rank holding classes; the other "
                             "mesh dims Shard the batch or Replicate", fn)
    for name, fn in plan_index_add.PRICES.items():
        out[name] = PlanInfo("runtime/plans/index_add.py", "index_add into a tensor sharded along the indexed dim "
                             "(each rank adds the rows it owns)",
                             "self Shard(dim) on exactly one mesh dim, every rank holding rows, the other mesh dims "
                             "Replicate or Shard of another dim; a 1-D index", fn)
    bn = ("runtime/plans/batch_norm.py", "batch norm on a batch-sharded input (SyncBatchNorm's plan)",
          "the input Shard(0) on some mesh dim, the others Shard(1) or Replicate; every per-channel tensor "
          "Replicate or sharded with the channels")
    for name, training in BATCH_SHARDED_NORMS.items():
        out[name] = PlanInfo(*bn, functools.partial(sync_batchnorm.forward_price, training_default=training), True)
    for name in BATCH_SHARDED_NORM_BACKWARDS:
        out[name] = PlanInfo(*bn, sync_batchnorm.backward_price, True)
    return out


@functools.lru_cache(maxsize=None)
def _by_op() -> dict[Any, PlanInfo]:
    found = {}
    for name, info in _table().items():
        try:
            found[resolve_op(name)] = info
        except ValueError:  # an overload this torch does not have
            continue
    return found


def plan_info(op: Any) -> PlanInfo | None:
    """The op's collective plan, or None where it has none."""
    return _by_op().get(op)


def price(op: Any, args: tuple, kwargs: dict) -> tuple[Priced | None, Any, bool]:
    """(the plan's price, None where it does not apply; DTensor's own strategy's cost,
    None where DTensor has none; whether the plan runs the call) for a call on DTensors.
    Run it with `enable()` on: DTensor's strategy is then the one the plan competes with."""
    info = plan_info(op)
    if info is None:
        raise ValueError(f"{op} has no collective plan")
    priced = info.price(op, args, kwargs)
    return priced, dtensor_cost(op, args, kwargs), priced is not None and priced.taken(op, args, kwargs)
