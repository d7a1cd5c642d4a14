"""Steering: DTensor's choice among its own strategies, re-priced.

DTensor prices a candidate strategy by its input redistributions only, with torch's
cost model, so it picks strategies whose cost shows up later: a Partial output every
consumer reduces again, a `_StridedShard` move priced at nothing, a Partial gradient
reduced once per op that reads it. These add the missing price, or remove the repeat,
without adding a strategy or a handler of an op's own:

    kept_partial     a Partial output priced at the reduction it will cost, per mesh dim;
                     a gather shrunk by chunking a replicated mesh dim owes the re-gather;
                     a weight gradient keeping a Partial gradient its node reduces anyway
                     owes that reduction (node_reads: what the node's next mm will do)
    strided_blocks   packed projections kept in their `_StridedShard` blocks
    reduce_once      a Partial gradient reduced once per backward node

`STEERING` lists them in the order `enable()` installs them.
"""

from __future__ import annotations

from decompshard.runtime.records import Steering
from decompshard.runtime.steering import kept_partial, reduce_once, strided_blocks

__all__ = ["STEERING"]

STEERING: tuple[Steering, ...] = (
    Steering("kept_partial", "a Partial output priced at the reduction it will cost", kept_partial.entries),
    Steering("strided_blocks", "packed projections kept in their _StridedShard blocks", strided_blocks.entries),
    Steering("reduce_once", "a Partial gradient reduced once per backward node", reduce_once.entries),
)
