"""The native guard's argument naming: strategies that read an argument by name only.

DTensor's logsumexp strategy (torch 2.13's op strategy and 2.14/2.15's single-dim one)
reads `keepdim` from the keyword arguments, but the dispatcher passes it positionally
(`torch.logsumexp(x, 0, keepdim=True)` reaches DTensor as `(x, [0], True)`), so the
strategy reduces as if keepdim were False: x [8, 4] on Shard(1) comes back claiming
Shard(0) of [1, 4] while each rank holds [1, 2] (full_tensor() [1, 2]), silently wrong.
Found by the native audit (`wrong shape`: the ranks' shapes are not the placements').
The guard hands the strategy such an argument by name, as the strategy reads it; the
local kernel still gets the call's own arguments, and DTensor's cache key already covers
the positional value (its RuntimeSchemaInfo keys from `dim` on).
"""

from __future__ import annotations

from typing import Any, Callable

from decompshard._compat import OpSchema
from decompshard.runtime.records import Fix

__all__ = ["FIX", "naming_op_strategy", "naming_single_dim"]

Warn = Callable[[str, str], None]


def _named(args: tuple, kwargs: dict, index: int, name: str) -> tuple[tuple, dict, bool]:
    """args and kwargs with the argument at `index` passed by `name` instead (a value
    given both ways is left to the strategy as it is); whether anything moved."""
    if len(args) <= index or name in kwargs:
        return args, kwargs, False
    return tuple(args[:index]) + tuple(args[index + 1:]), {**kwargs, name: args[index]}, True


def _message(op: Any, name: str) -> str:
    return (f"decompshard guard: {op}: DTensor's strategy reads `{name}` by name only and the call passes it "
            f"by position (its result would claim the placements of the other value, silently wrong); "
            f"handing it to the strategy by name")


def naming_op_strategy(op: Any, fn: Callable, index: int, name: str, warn: Warn) -> Callable:
    """An op-strategy function (OpSchema -> OpStrategy) that sees the argument by name."""

    def named(op_schema: Any) -> Any:
        args, kwargs, moved = _named(op_schema.args_schema, op_schema.kwargs_schema, index, name)
        if not moved:
            return fn(op_schema)
        warn(f"named:{op}", _message(op, name))
        return fn(OpSchema(op_schema.op, args, kwargs, schema_info=op_schema.schema_info))

    named.__wrapped__ = fn  # type: ignore[attr-defined]
    return named


def naming_single_dim(op: Any, func: Callable, index: int, name: str, warn: Warn) -> Callable:
    """A single-dim strategy function (op, args, kwargs -> rules) that sees the argument by name."""

    def named(op_: Any, args_schema: Any, kwargs_schema: Any) -> Any:
        args, kwargs, moved = _named(tuple(args_schema), dict(kwargs_schema), index, name)
        if not moved:
            return func(op_, args_schema, kwargs_schema)
        warn(f"named:{op}", _message(op, name))
        return func(op_, args, kwargs)

    named.__wrapped__ = func  # type: ignore[attr-defined]
    return named


FIX = Fix("the argument handed to the strategy by name",
          single=lambda op, fence, warn, func: naming_single_dim(op, func, *fence.args, warn),
          full=lambda op, fence, warn, fn: naming_op_strategy(op, fn, *fence.args, warn))
