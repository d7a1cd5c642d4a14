"""The native guard's dim wrapping: strategies that compare a negative dim unwrapped.

DTensor's `scan_strategy` (cumsum, cumprod, logcumsumexp) hands `dim` to
`common_reduction_strategy` as it was passed, and `replicate_reduction_dims` tests
`placement.dim in reduction_dims`: with `dim=-1` a Shard on the last dim is not
replicated first, each rank scans its own part, and the result is silently wrong
(`cumsum(-1)` of arange(1, 7) on Shard(0) over 3 ranks: [1, 3, 3, 7, 5, 11]). Found by
the native audit's negative-dim variants (coverage/native_variants.py). The guard wraps
the dim arguments (dim_args.py) to >= 0 in the schema the strategy function sees, so it
picks the strategy it picks for the same dim written >= 0; the local kernel still gets
the original arguments (the same dim on a tensor of the same ndim). Calls with dims
>= 0 reach the strategy unchanged. It warns only where the wrapped dim changes the
strategy (a Shard on the scanned dim); `cumsum(-1)` of a batch-sharded tensor gets the
same strategy either way and no warning.
"""

from __future__ import annotations

from typing import Any, Callable

from decompshard._compat import OpSchema, OpStrategy, TensorMeta
from decompshard.dim_args import dim_arguments, wrap_dims
from decompshard.runtime.records import Fix

__all__ = ["FIX", "wrapping_op_strategy", "wrapping_single_dim"]

Warn = Callable[[str, str], None]


def _ndim(x: Any) -> int | None:
    if isinstance(x, OpStrategy):
        return x.ndim
    if isinstance(x, TensorMeta):
        return len(x.shape)
    return None


def _wrapped(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """args and kwargs with the op's dim arguments wrapped against the first
    argument's ndim (the input the dims index); whether anything changed."""
    ndim = _ndim(args[0]) if args else None
    if ndim is None:
        return args, kwargs, False
    new_args, new_kwargs = list(args), dict(kwargs)
    for i, name, _ in dim_arguments(op):
        if i < len(new_args):
            new_args[i] = wrap_dims(new_args[i], ndim)
        elif name in new_kwargs:
            new_kwargs[name] = wrap_dims(new_kwargs[name], ndim)
    new_args_t = tuple(new_args)
    return new_args_t, new_kwargs, new_args_t != tuple(args) or new_kwargs != kwargs


def _described(strategy: Any) -> str:
    """A strategy's placements as text, to tell whether wrapping the dim changed it: an
    OpStrategy's specs (input and output placements per choice), or a single-dim
    strategy's rules."""
    if isinstance(strategy, OpStrategy):
        return str([str(s) for s in strategy.strategies])
    return str(strategy)


def _unwrapped(strategy: Callable[[], Any]) -> str:
    """What DTensor alone decides with the dim as passed (a refusal counts as different)."""
    try:
        return _described(strategy())
    except Exception as e:  # noqa: BLE001 - any refusal differs from the wrapped strategy
        return f"raised {type(e).__name__}"


def _message(op: Any) -> str:
    return (f"decompshard guard: {op}: DTensor's strategy compares a negative dim with the placements' dims "
            f"unwrapped (a Shard on the dim it scans would pass through, silently wrong); giving it the dim "
            f"wrapped to >= 0")


def wrapping_op_strategy(op: Any, fn: Callable, warn: Warn) -> Callable:
    """An op-strategy function (OpSchema -> OpStrategy) that sees wrapped dims."""

    def wrapped(op_schema: Any) -> Any:
        args, kwargs, changed = _wrapped(op, op_schema.args_schema, op_schema.kwargs_schema)
        if not changed:
            return fn(op_schema)
        right = fn(OpSchema(op_schema.op, args, kwargs, schema_info=op_schema.schema_info))
        if _described(right) != _unwrapped(lambda: fn(op_schema)):  # silent where the dim's sign changes nothing
            warn(f"dims:{op}", _message(op))
        return right

    wrapped.__wrapped__ = fn  # type: ignore[attr-defined]
    return wrapped


def wrapping_single_dim(op: Any, func: Callable, warn: Warn) -> Callable:
    """A single-dim strategy function (op, args, kwargs -> rules) that sees wrapped dims."""

    def wrapped(op_: Any, args_schema: Any, kwargs_schema: Any) -> Any:
        args, kwargs, changed = _wrapped(op, tuple(args_schema), dict(kwargs_schema))
        if changed:
            right = func(op_, args, kwargs)
            if _described(right) != _unwrapped(lambda: func(op_, args_schema, kwargs_schema)):
                warn(f"dims:{op}", _message(op))
            return right
        return func(op_, args_schema, kwargs_schema)

    wrapped.__wrapped__ = func  # type: ignore[attr-defined]
    return wrapped


FIX = Fix("the strategy handed the dims wrapped to >= 0",
          single=lambda op, fence, warn, func: wrapping_single_dim(op, func, warn),
          full=lambda op, fence, warn, fn: wrapping_op_strategy(op, fn, warn))
