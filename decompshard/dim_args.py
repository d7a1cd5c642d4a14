"""Dim arguments of aten ops, read from their schemas, and wrapping them to >= 0.

Every aten op accepts a negative dim and wraps it itself (`maybe_wrap_dim`); a DTensor
strategy that compares a dim argument with a placement's dim before wrapping it sees
`-1 != 0` and lets a Shard on the very dim the op works along through (`scan_strategy`:
`cumsum(-1)` of a 1-D tensor on Shard(0) adds up each rank's part alone). The native
audit makes negative-dim variants of OpInfo samples with these names
(coverage/native_variants.py); the native guard wraps them for the ops it found wrong
(runtime/fences/negative_dims.py).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["DIM_ARG_NAMES", "dim_arguments", "wrap_dims"]

# Schema argument names that index a tensor's dims (aten's naming, read from the
# schemas of every op with a DTensor strategy), when their type is int, int[], int? or
# int[]?.
DIM_ARG_NAMES = frozenset({"dim", "dims", "dim0", "dim1", "dim2", "start_dim", "end_dim", "dimension"})
_INT_TYPES = frozenset({"int", "SymInt", "List[int]", "List[SymInt]", "Optional[int]", "Optional[SymInt]",
                        "Optional[List[int]]", "Optional[List[SymInt]]"})


def dim_arguments(op: torch._ops.OpOverload) -> list[tuple[int, str, object]]:
    """(schema position, name, default) of `op`'s arguments that are dims (see
    DIM_ARG_NAMES); default None where the schema has none."""
    return [(i, a.name, a.default_value if a.has_default_value() else None)
            for i, a in enumerate(op._schema.arguments) if a.name in DIM_ARG_NAMES and str(a.type) in _INT_TYPES]


def wrap_dims(value: Any, ndim: int) -> Any:
    """`value` (an int dim or a list of them) with each dim in [-n, 0) replaced by
    dim + n, n = max(ndim, 1) (a 0-d tensor takes dims -1 and 0), as `maybe_wrap_dim`
    does; anything else (dims >= 0, out of range, None, symbolic) is returned as it is,
    so the op still raises its own error."""
    n = max(ndim, 1)
    if isinstance(value, int) and not isinstance(value, bool):
        return value + n if -n <= value < 0 else value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) and not isinstance(v, bool)
                                                          for v in value):
        return type(value)(v + n if -n <= v < 0 else v for v in value)
    return value
