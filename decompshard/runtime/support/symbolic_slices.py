"""Slices to the end keep their shard under symbolic sizes, as they do under static ones.

`x[:, 0:]` and `x[:, :-1]`-style indexing reach DTensor as `aten.slice.Tensor(x, dim,
start, end)`, a full slice of the other dims with `end` = int64's largest ("to the end").
DTensor's slice strategy (the same logic on 2.13 to 2.15) keeps a Shard on the sliced dim
only for a slice it can prove whole (`start == 0` and `end == size`), and clamps `end` to
the size only where `end > size` is statically known. With static sizes it always is.
Under `torch.compile` with symbolic sizes (`dynamic=True`, `mark_dynamic`, a second
sequence length) a size such as `4*s3` has no upper bound sympy knows, `end > 4*s3` is not
provable, the whole slice of the batch dim counts as a real slice of it, and DTensor
all-gathers the batch inside the compiled graph: a tiny Llama in data parallel compiled
with `dynamic=True` gathered its final hidden states (`hidden_states[:, slice_indices, :]`
in transformers' causal-LM head), its labels and its mask inputs, where the static compile
gathers none of them; torch alone the same.

An `end` at int64's largest means "to the end" whatever the size (no dim is larger), so
the strategy is handed `end=None`, which it reads as the size: the placements it chooses
are the ones it chooses for the same slice with static sizes. Any other `end` reaches it
unchanged; the local kernel always gets the original arguments. `slice_backward` is left
as it is (its strategy never keeps the sliced dim's shard, static or not). Tests:
tests/test_symbolic_sizes.py.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable, Iterator

import torch

from decompshard._compat import OpSchema, sharding_propagator
from decompshard.runtime.table_patches import Entry, WarnOnce

__all__ = ["entries", "to_the_end"]

SLICE = torch.ops.aten.slice.Tensor
_END = 3  # slice.Tensor(self, dim=0, start=None, end=None, step=1)


def to_the_end(args: tuple) -> tuple:
    """`args` with an `end` of int64's largest (or more) written None ("to the end")."""
    end = args[_END] if len(args) > _END else None
    if isinstance(end, int) and not isinstance(end, bool) and end >= sys.maxsize:
        return args[:_END] + (None,) + args[_END + 1:]
    return args


def _single(func: Callable) -> Callable:
    def strategy(op: Any, args_schema: Any, kwargs_schema: Any) -> Any:
        return func(op, to_the_end(tuple(args_schema)), kwargs_schema)

    strategy.__wrapped__ = func  # type: ignore[attr-defined]
    return strategy


def _full(fn: Callable) -> Callable:
    def strategy(op_schema: Any) -> Any:
        args = to_the_end(tuple(op_schema.args_schema))
        if args == tuple(op_schema.args_schema):
            return fn(op_schema)
        return fn(OpSchema(op_schema.op, args, op_schema.kwargs_schema, schema_info=op_schema.schema_info))

    strategy.__wrapped__ = fn  # type: ignore[attr-defined]
    return strategy


def entries(warn_once: WarnOnce) -> Iterator[Entry]:
    """The slice strategy, wrapped in whichever table holds it (single-dim from 2.14,
    op-strategy on 2.13)."""
    sp = sharding_propagator()
    single, full = sp.op_single_dim_strategy_funcs, sp.op_strategy_funcs
    if SLICE in single:
        yield single, SLICE, dataclasses.replace(single[SLICE], func=_single(single[SLICE].func))
    elif SLICE in full:
        yield full, SLICE, _full(full[SLICE])
