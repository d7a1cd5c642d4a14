"""What decompshard put into DTensor's dispatch tables, and what each entry held before.

`enable()` and the native guard replace entries in DTensor's process-wide tables (custom
op handlers, strategy functions); `disable()` must leave every table holding exactly the
objects it held before, an empty slot included. Each module that patches keeps one
`TablePatches` record, so putting back is written once.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TablePatches"]

_ABSENT = object()  # the slot had no entry


class TablePatches:
    """Entries set in dicts owned by someone else, restorable exactly."""

    def __init__(self) -> None:
        self._before: dict[tuple[int, Any], tuple[dict, Any]] = {}

    def __bool__(self) -> bool:
        return bool(self._before)

    def set(self, table: dict, key: Any, value: Any) -> None:
        """`table[key] = value`, remembering the first value the slot held (or none)."""
        self._before.setdefault((id(table), key), (table, table.get(key, _ABSENT)))
        table[key] = value

    def restore(self) -> None:
        """Put every slot back as it was before the first `set`, in reverse order."""
        for (_, key), (table, old) in reversed(list(self._before.items())):
            if old is _ABSENT:
                table.pop(key, None)
            else:
                table[key] = old
        self._before.clear()
