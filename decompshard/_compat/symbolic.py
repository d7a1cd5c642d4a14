"""Symbolic sizes (torch.compile with dynamic shapes): a SymInt's value at the example
inputs (its hint) and its value at other sizes, read without adding a guard.

`guarding_hint_or_throw` and `has_guarding_hint` are public in
torch.fx.experimental.symbolic_shapes (2.13 to 2.15); a SymInt's sympy expression
(`.node.expr`) and the ShapeEnv's table of hints (`var_to_val`) are private, the same on
2.13 to 2.15. Reading a hint adds no guard: the compiled graph is not specialized on it.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["guard_divisible", "has_hint", "hint_of", "is_symbolic", "symbol_hints", "symbols_of", "value_at",
           "same_sizes", "same_symbolic"]


def is_symbolic(v: Any) -> bool:
    """A SymInt, SymFloat or SymBool (an int, float or bool is not)."""
    return isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool))


def has_hint(v: Any) -> bool:
    """A plain value, or a symbolic one with a hint (backed); unbacked sizes have none."""
    from torch.fx.experimental.symbolic_shapes import has_guarding_hint

    return not is_symbolic(v) or has_guarding_hint(v)


def hint_of(v: Any) -> Any:
    """The value at the example inputs, no guard added; a plain value as it is."""
    if not is_symbolic(v):
        return v
    from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

    return guarding_hint_or_throw(v)


def symbols_of(v: Any) -> frozenset:
    """The free symbols of a SymInt's expression (none for a plain int)."""
    if not isinstance(v, torch.SymInt):
        return frozenset()
    return frozenset(v.node.expr.free_symbols)


def symbol_hints(v: Any) -> dict:
    """{symbol: its hint} for the free symbols of a SymInt."""
    if not isinstance(v, torch.SymInt):
        return {}
    table = v.node.shape_env.var_to_val
    return {s: int(table[s]) for s in v.node.expr.free_symbols if s in table}


def value_at(v: Any, values: Mapping[Any, int]) -> Any:
    """A SymInt's value with its symbols set to `values` (every one must be given), no
    guard added; a plain value as it is."""
    if not isinstance(v, torch.SymInt):
        return v
    return int(v.node.expr.xreplace({s: values[s] for s in v.node.expr.free_symbols}))


def same_symbolic(a: Any, b: Any) -> bool:
    """Whether two sizes are the same expression (structurally: no guard, unlike `==`)."""
    ka = a.node.expr if isinstance(a, torch.SymInt) else a
    kb = b.node.expr if isinstance(b, torch.SymInt) else b
    return bool(ka == kb)


def same_sizes(a: Any, b: Any) -> bool:
    """Whether two size (or stride) sequences are the same expressions, element by element:
    no guard, where `tuple(a) == tuple(b)` would add one per symbolic element (and, against
    a number, specialize the graph to it)."""
    return len(a) == len(b) and all(map(same_symbolic, a, b))


def guard_divisible(v: Any, n: int) -> bool:
    """Whether the size `v` is a multiple of `n`. For a SymInt: False where its hint is
    not (no guard); else True, with a guard on it added to the graph being compiled
    (none where the expression proves it, as `4*s0` for 4): a later size that is not a
    multiple compiles another graph instead of reusing this one."""
    if not isinstance(v, torch.SymInt):
        return int(v) % n == 0
    if hint_of(v) % n:
        return False
    return bool(v % n == 0)  # bool() of a SymBool guards on it
