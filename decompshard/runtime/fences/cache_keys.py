"""DTensor's sharding cache keyed on every argument the op's output depends on.

DTensor caches each sharding decision under the tensor specs plus the non-tensor
arguments its op's RuntimeSchemaInfo names. Where that leaves out an argument the
output's shape or layout depends on, a second call that differs only there gets the
first call's output spec: `histc(x, bins=1)` after `histc(x, bins=100)` on a sharded
`x` claims 100 bins while every rank holds 1 (torch keys histc from `min` on), and
`x.to(memory_format=torch.channels_last)` after a plain `x.to(...)` claims the plain
strides (torch keys `_to_copy` on `dtype` only). Found by the native audit as runs
wrong only after an earlier call (`after` in docs/native_audit/). The guard puts the
op's RuntimeSchemaInfo back widened to cover them: right, at the price of one more
cache entry per distinct value.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from decompshard._compat import schema_info_slot, widened_schema_info
from decompshard.runtime.records import Fix

__all__ = ["FIX", "widened_keys"]


def widened_keys(missing: dict[str, tuple[int | None, tuple[str, ...]]],
                 resolve: Callable[[str], Any]) -> Iterator[tuple[dict, Any, Any]]:
    """Table entries giving each op of `missing` (op -> (positional index from which,
    keyword names) the key must cover) a RuntimeSchemaInfo that covers them, in the
    table DTensor reads it from. An op this torch lacks, or registers no info for, is
    skipped (nothing to widen: DTensor then keys on no argument and has no strategy)."""
    for name, (argnum, kwargs) in missing.items():
        op = resolve(name)
        slot = None if op is None else schema_info_slot(op)
        if slot is not None:
            table, info = slot
            yield table, op, widened_schema_info(info, argnum, kwargs)


FIX = Fix("the op's RuntimeSchemaInfo widened to cover the argument",
          entries=lambda op, fence: widened_keys({fence.op: fence.args}, lambda name: op))
