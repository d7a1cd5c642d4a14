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
unchanged; the local kernel always gets the original arguments.

The backward of such a slice, `slice_backward(grad, input_sizes, dim, 0, end, 1)`, is the
gradient itself: DTensor's strategy never keeps the sliced dim's shard (it need not with
static sizes, where the whole slice is elided before it is recorded), so the batch was
gathered again in backward. Where `end` is "to the end" (as above), `start` 0 and `step`
1, the sliced dim's shard passes through (DTensor localizes `input_sizes` to the output's
shard itself, 2.13 to 2.15). Tests:
tests/test_symbolic_sizes.py.
"""

from __future__ import annotations

import sys
from typing import Any, Callable, Iterator

import torch

from decompshard._compat import (DTensorSpec, OpSchema, OpSpec, OpStrategy, TorchShardingPlaceholder,
                                 generate_redistribute_costs)
from decompshard.runtime.table_patches import Entry, WarnOnce, wrapped_strategy

__all__ = ["entries", "to_the_end", "whole_slice_dim"]

SLICE = torch.ops.aten.slice.Tensor
SLICE_BACKWARD = torch.ops.aten.slice_backward.default
_END = 3  # slice.Tensor(self, dim=0, start=None, end=None, step=1)


def to_the_end(args: tuple) -> tuple:
    """`args` with an `end` of int64's largest (or more) written None ("to the end")."""
    end = args[_END] if len(args) > _END else None
    if isinstance(end, int) and not isinstance(end, bool) and end >= sys.maxsize:
        return args[:_END] + (None,) + args[_END + 1:]
    return args


def whole_slice_dim(args: tuple) -> int | None:
    """The sliced dim of `slice_backward(grad, input_sizes, dim, start, end, step)` where the
    slice was the whole dim (start 0, step 1, end "to the end"); None otherwise."""
    if len(args) < 6 or not hasattr(args[0], "shape"):
        return None
    dim, start, end, step = args[2:6]
    # plain ints only: comparing a SymInt here would put a guard on it
    whole = all(isinstance(v, int) for v in (start, end, step)) and start == 0 and step == 1 and end >= sys.maxsize
    return dim % len(args[0].shape) if whole and isinstance(dim, int) else None


def _backward(func: Callable) -> Callable:
    def strategy(op: Any, args_schema: Any, kwargs_schema: Any) -> Any:
        rules = func(op, args_schema, kwargs_schema)
        dim = whole_slice_dim(tuple(args_schema))
        if dim is None:
            return rules
        return [*rules, [TorchShardingPlaceholder(dim), TorchShardingPlaceholder(dim)]]

    strategy.__wrapped__ = func  # type: ignore[attr-defined]
    return strategy


def _full_backward(fn: Callable) -> Callable:
    """2.13's op-strategy form of `_backward`: beside DTensor's strategies (the sliced dim
    replicated), each input placement passed through as it is, at no cost (the whole
    slice's backward is its gradient; DTensor localizes `input_sizes` on 2.13 too)."""
    def strategy(op_schema: Any) -> Any:
        found = fn(op_schema)
        grad = op_schema.args_schema[0]
        if whole_slice_dim(tuple(op_schema.args_schema)) is None or not isinstance(grad, OpStrategy):
            return found
        kept = [OpSpec(output_specs=DTensorSpec(s.output_spec.mesh, s.output_spec.placements),
                       redistribute_cost=[generate_redistribute_costs(grad, s.output_spec)])
                for s in grad.strategies]
        return OpStrategy([*found.strategies, *kept])

    strategy.__wrapped__ = fn  # type: ignore[attr-defined]
    return strategy


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
    """The slice strategy and slice_backward's, each wrapped in whichever table holds it
    (single-dim from 2.14, op-strategy on 2.13)."""
    yield from wrapped_strategy(SLICE, single=_single, full=_full)
    yield from wrapped_strategy(SLICE_BACKWARD, single=_backward, full=_full_backward)
