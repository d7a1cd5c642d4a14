"""Rules that shard two inputs along one dim, kept only where the inputs line up.

DTensor cuts every sharded tensor with torch.chunk at its own size along the dim, so
rank r's rows of one input are rank r's rows of another only where both have the same
size there. `gather`'s strategy (every tested release) offers S(d), S(d) -> S(d) for
each dim d but the gathered one whatever the sizes, and an index may be shorter than
its input off the gathered dim (`index.size(d) <= input.size(d)`): with an index of 3
rows and an input of 6 on 2 ranks, rank 1 gathers index rows 2 from input rows 3-5,
silently wrong. The guard drops such a rule at the shapes where the sizes differ;
DTensor then takes its next valid strategy (scatter's strategy checks this itself).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from decompshard._compat import OpStrategy, TensorMeta
from decompshard.torch_placements import from_torch_placement
from decompshard.dispatch_modes.graph import leaves
from decompshard.placements import ShardPlaceholder
from decompshard.runtime.records import Fix

__all__ = ["FIX", "aligned_op_strategy", "aligned_single_dim", "lined_up"]


def lined_up(inputs: Sequence[Any], shapes: Sequence[Sequence[int]]) -> bool:
    """Whether every pair of inputs sharded on the same dim has the same size there
    (torch placements or single-dim placeholders, one per tensor input)."""
    sizes: dict[int, set[int]] = {}
    for p, shape in zip(inputs, shapes):
        q = from_torch_placement(p)
        if isinstance(q, ShardPlaceholder) and q.dim < len(shape):
            sizes.setdefault(q.dim, set()).add(int(shape[q.dim]))
    return all(len(s) == 1 for s in sizes.values())


def _warn(warn: Callable[[str, str], None], op: Any, shapes: Sequence[Sequence[int]]) -> None:
    warn(f"aligned:{op}", (
        f"decompshard guard: {op}: skipping DTensor's native rule(s) sharding inputs of shapes "
        f"{[list(s) for s in shapes]} along a dim they differ on (torch.chunk cuts each at its own "
        f"size: the ranks' pieces do not line up); DTensor uses its next valid strategy"))


def aligned_single_dim(op: Any, func: Callable, warn: Callable[[str, str], None]) -> Callable:
    """`func` (a single-dim strategy: entries list outputs first, then inputs) without
    the entries whose sharded inputs do not line up at the shapes at hand."""

    def aligned(op_: Any, args_schema: Any, kwargs_schema: Any) -> list:
        raw = func(op_, args_schema, kwargs_schema)
        shapes = [tuple(m.shape) for m in leaves((args_schema, kwargs_schema)) if isinstance(m, TensorMeta)]
        kept = [e for e in raw if len(e) < len(shapes) or lined_up(e[len(e) - len(shapes):], shapes)]
        if len(kept) < len(raw):
            _warn(warn, op, shapes)
        return kept

    aligned.__wrapped__ = func  # type: ignore[attr-defined]
    return aligned


def aligned_op_strategy(op: Any, fn: Callable, warn: Callable[[str, str], None]) -> Callable:
    """`fn` (a full-mesh op strategy) without the specs that, on some mesh dim, shard
    inputs that do not line up (torch 2.13's gather)."""

    def aligned(op_schema: Any) -> Any:
        strategy = fn(op_schema)
        if not isinstance(strategy, OpStrategy):
            return strategy
        shapes = [tuple(s.shape) for s in op_schema.args_strategy]

        def ok(spec: Any) -> bool:
            if not spec.input_specs:
                return True
            ndim = len(spec.input_specs[0].placements)
            return all(lined_up([s.placements[d] for s in spec.input_specs], shapes) for d in range(ndim))

        kept = [s for s in strategy.strategies if ok(s)]
        if len(kept) == len(strategy.strategies):
            return strategy
        if not kept:  # no all-Replicate spec to fall back on: refuse rather than guess
            raise RuntimeError(f"decompshard guard: {op} has only strategies whose sharded inputs "
                               f"of shapes {[list(s) for s in shapes]} do not line up")
        _warn(warn, op, shapes)
        return OpStrategy(kept)

    aligned.__wrapped__ = fn  # type: ignore[attr-defined]
    return aligned


FIX = Fix("rules sharding inputs whose sizes differ on the sharded dim dropped at those shapes",
          single=lambda op, fence, warn, func: aligned_single_dim(op, func, warn),
          full=lambda op, fence, warn, fn: aligned_op_strategy(op, fn, warn))
