"""The one mechanism that puts decompshard into DTensor's tables and takes it out again.

`enable()` and the native guard replace entries in DTensor's process-wide tables (custom
op handlers, strategy functions, the sharding propagator's decomposition fallback);
`disable()` must leave every table holding exactly the objects it held before, an empty
slot included, from any thread, however often it is called. A module that patches says
only WHAT it puts where: a declaration, a function that yields `(table, key, value)`
entries (a dict and its key, an object and the name of its attribute, or a `Slot`: a
setting that is neither, such as a torch config value, with its own exact restore). A
`TablePatches` record installs a declaration's entries, remembers what each slot held,
and puts it back; it owns the lock, the saved entries and the warn-once set, so this is
written once. `enable()` holds one record (its hook, the op families around DTensor and
the keyword-tensor routing of DTensor's dispatch), the guard another (it can be switched
alone).

Records stack: every record shares one lock, and what was installed last is taken out
first. Taking out a record with others installed after it takes those out first and puts
them back after (their declarations run again), so two records that touch one slot (one
wrapping the other's entry) always unwind to the object the slot held before either.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

from decompshard._compat import sharding_propagator

__all__ = ["Entry", "Slot", "TablePatches", "WarnOnce", "locked", "where_none", "wrapped_strategy"]

Entry = tuple[Any, Any, Any]  # (a dict, an object whose attribute is the slot, or a Slot; key; value)
WarnOnce = Callable[[str, str], None]  # warn_once(key, message)

_ABSENT = object()  # the slot had no entry
_LOCK = threading.RLock()  # one for every record: install and uninstall never interleave
_STACK: list[TablePatches] = []  # the installed records, in the order they were installed


@dataclass(frozen=True, eq=False)
class Slot:
    """A slot that is not a dict item or an attribute: `put(value)` sets it and returns
    what puts back exactly what it held before (a torch config value, which may hold a
    user's override or none: reading it gives its default, so read-then-write would turn
    "none" into an override). An entry for it is `(slot, slot.name, value)`."""

    name: str
    put: Callable[[Any], Callable[[], None]]


def locked() -> threading.RLock:
    """The lock every record installs and uninstalls under, for a caller that changes
    several records as one step (`enable()`: the guard and its own)."""
    return _LOCK


def _read(table: Any, key: Any) -> Any:
    """What the slot holds itself: a dict's item, or the attribute in the object's own
    `__dict__` (a class's staticmethod object, not what attribute access makes of it)."""
    if isinstance(table, dict):
        return table.get(key, _ABSENT)
    return vars(table).get(key, _ABSENT)


def _write(table: Any, key: Any, value: Any) -> None:
    """Put `value` in the slot, or empty it for `_ABSENT`."""
    if isinstance(table, dict):
        if value is _ABSENT:
            table.pop(key, None)
        else:
            table[key] = value
    elif value is _ABSENT:
        if key in vars(table):
            delattr(table, key)
    else:
        setattr(table, key, value)


def where_none(table: dict, found: Iterable[tuple], make: Callable[..., Any]) -> Iterator[Entry]:
    """An entry `make(op, *rest)` for each `(op, *rest)` found whose op the table has no
    entry for: an entry someone else put there (torch's own, `loss_parallel()`'s) stays."""
    for op, *rest in found:
        if op not in table:
            yield table, op, make(op, *rest)


def wrapped_strategy(op: Any, single: Callable[[Callable], Callable] | None = None,
                     full: Callable[[Callable], Callable] | None = None) -> Iterator[Entry]:
    """The entry putting `op`'s strategy back wrapped, in whichever of DTensor's two tables
    holds it: `single(func)` for a single-dim strategy function (its info record kept),
    `full(fn)` for an op-strategy function; none where that table's wrapper is None or
    neither table holds the op. The one adapter the fences and support read both with."""
    sp = sharding_propagator()
    singles, fulls = sp.op_single_dim_strategy_funcs, sp.op_strategy_funcs
    if op in singles and single is not None:
        yield singles, op, dataclasses.replace(singles[op], func=single(singles[op].func))
    elif op in fulls and full is not None:
        yield fulls, op, full(fulls[op])


class TablePatches:
    """One declaration's entries, installed together and put back exactly, last in first out.

    `install()` and `uninstall()` are idempotent; `on_change(installed)` runs under the
    lock after each real change (DTensor caches its decisions, so they must be forgotten
    then). `add()` sets one more entry while installed (an entry only a call at dispatch
    time can name), put back with the others."""

    def __init__(self, declare: Callable[[], Iterable[Entry]],
                 on_change: Callable[[bool], None] | None = None) -> None:
        self._declare = declare
        self._on_change = on_change
        self._before: dict[tuple[int, Any], tuple[Any, Any]] = {}
        self._warned: dict[str, bool] = {}  # key -> forgotten at the next install
        self._installed = False

    def is_installed(self) -> bool:
        return self._installed

    def install(self) -> None:
        """Set every declared entry, in order (a declaration reading a table sees the
        entries set before it). Idempotent. If the declaration fails, what it set is put
        back before the error goes on."""
        with _LOCK:
            if self._installed:
                return
            self._warned = {k: again for k, again in self._warned.items() if not again}
            self._put_in()

    def uninstall(self) -> None:
        """Put every slot back as it was before `install`, and `add`. Idempotent. Records
        installed after this one are taken out first and installed again after."""
        with _LOCK:
            if not self._installed:
                return
            above = _STACK[_STACK.index(self) + 1:]
            for record in reversed(above):
                record._take_out()
            self._take_out()
            for record in above:
                record._put_in()

    def add(self, table: Any, key: Any, value: Any) -> bool:
        """Set one more entry while installed (False, and nothing set, if not); the
        slot's value before goes back at `uninstall`, in reverse order with the rest."""
        with _LOCK:
            if not self._installed:
                return False
            self._set(table, key, value)
            return True

    def warn_once(self, key: str, message: str, stacklevel: int = 2, per_install: bool = True) -> None:
        """`warnings.warn(message, stacklevel)` the first time `key` is seen: once per
        installation, or once per process where `per_install` is False (a warning about
        an op's derivation, whose result is cached: a `with enabled():` around each
        training step must not repeat it)."""
        if key not in self._warned:
            self._warned[key] = per_install
            warnings.warn(message, stacklevel=stacklevel)

    def _put_in(self) -> None:
        try:
            for table, key, value in self._declare():
                self._set(table, key, value)
        except BaseException:
            self._restore()
            raise
        self._installed = True
        _STACK.append(self)
        if self._on_change is not None:
            self._on_change(True)

    def _take_out(self) -> None:
        self._restore()
        self._installed = False
        _STACK.remove(self)
        if self._on_change is not None:
            self._on_change(False)

    def _set(self, table: Any, key: Any, value: Any) -> None:
        if isinstance(table, Slot):  # the first put's undo restores what it held before
            undo = table.put(value)
            self._before.setdefault((id(table), key), (table, undo))
            return
        self._before.setdefault((id(table), key), (table, _read(table, key)))
        _write(table, key, value)

    def _restore(self) -> None:
        for (_, key), (table, old) in reversed(list(self._before.items())):
            if isinstance(table, Slot):
                old()
            else:
                _write(table, key, old)
        self._before.clear()
