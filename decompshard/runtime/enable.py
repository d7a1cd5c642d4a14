"""`enable()`: every record decompshard declares, installed into DTensor; `disable()`: all out.

Read this file first. What `enable()` puts into DTensor, in the order it installs it:

1. derived strategies (derived.py): DTensor's decomposition fallback answered with the
   cheapest valid strategy derived from the op's decomposition;
2. support (support/): valid programs DTensor refuses, run anyway;
3. plans (plans/): collective plans, where they move less than DTensor's strategy;
4. steering (steering/): DTensor's own choices re-priced;
5. keyword-tensor routing (DTensor moves only positional tensors).

Under them all, the native guard (fences/): DTensor's native behaviour measured wrong,
fenced. Correctness and performance are separate switches: `guard_native` fences wrong
numbers, `plans` runs the collective plans; both on by default. Where a plan and a fence
share an op, the op's handler is one chain in one order: the plan where it pays, else
the fence's fix, else DTensor's own path (records.Plan.handler).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Iterator

from decompshard._compat import DecompShardingStrategy, clear_dtensor_caches, sharding_propagator
from decompshard.runtime import collectives, plans
from decompshard.runtime.compile_keys import forget_compiled, tag_entry
from decompshard.runtime.registry import STEERING, SUPPORT
from decompshard.runtime.derived import DerivedStrategy, reaches_decompshard
from decompshard.runtime.fences import guard
from decompshard.runtime.support.kwarg_routing import kwarg_routing_entries
from decompshard.runtime.table_patches import Entry, TablePatches, locked

__all__ = ["PLANS_ENV", "disable", "enable", "enabled", "is_enabled", "switched"]

PLANS_ENV = "DECOMPSHARD_PLANS"
_plans_on = True  # what the installed record declares (set before each install)


def plans_wanted(flag: bool | None) -> bool:
    """The plans setting: the argument when given, else the environment variable (on
    unless it says 0, false, no or off)."""
    if flag is not None:
        return bool(flag)
    return os.environ.get(PLANS_ENV, "").strip().lower() not in ("0", "false", "no", "off")


def _declared() -> Iterator[Entry]:
    """What `enable()` puts where, in this order (a declaration reading a table sees the
    entries set before it: a plan finds the guard's fence in its op's slot). First torch's
    compile cache key tag (compile_keys): no graph compiled under other settings is served."""
    yield tag_entry("decompshard", _switches())
    sp = sharding_propagator()
    yield sp, "decomp_strategy", DerivedStrategy(sp.decomp_strategy, _PATCHES)
    yield DecompShardingStrategy, "has_decomp", staticmethod(reaches_decompshard)
    warn = functools.partial(_PATCHES.warn_once, stacklevel=3)
    for support in SUPPORT:
        yield from support.entries(warn)
    if _plans_on:
        yield from plans.entries()
    for steering in STEERING:
        yield from steering.entries(warn)
    yield from kwarg_routing_entries()


def _switches() -> list[str]:
    """What the compile cache key tag says of this installation besides decompshard's
    source: the guard and plans switches, and the ops the plans take."""
    planned = sorted(str(op) for op, _ in plans.plan_ops()) if _plans_on else []
    return [f"guard_native={guard.is_installed()}", f"plans={_plans_on}", *planned]


def _changed(installed: bool) -> None:
    """DTensor's cached decisions forgotten, the collective plans' (made against
    DTensor's), and the code dynamo compiled (compile_keys), whichever way it changed."""
    clear_dtensor_caches()
    collectives.forget_decisions()
    forget_compiled()


_PATCHES = TablePatches(_declared, on_change=_changed)


def enable(guard_native: bool | None = None, plans: bool | None = None) -> None:
    """Route every DTensor op that lacks a strategy through decompshard, and let valid
    programs run that DTensor refuses (module doc). Idempotent; `disable()` undoes all.

    `guard_native`: keep DTensor away from native behaviour measured wrong (fences/); on
    unless False, or, when not given, DECOMPSHARD_GUARD_NATIVE=0. On by default because
    the programs `enable()` lets run reach native strategies that give wrong numbers
    (convolution handlers, batch norm's running statistics, mean losses).
    `plans`: the collective plans (plans/); on unless False, or, when not given,
    DECOMPSHARD_PLANS=0. Each call sets both as it says. The guard's entries lie under
    `enable()`'s own (installed first, taken out last), so changing either while enabled
    takes `enable()`'s out and puts them back."""
    global _plans_on
    want_guard, want_plans = guard.wanted(guard_native), plans_wanted(plans)
    with locked():
        if _PATCHES.is_installed() and guard.is_installed() == want_guard and _plans_on == want_plans:
            return
        _PATCHES.uninstall()
        (guard.install if want_guard else guard.uninstall)()
        _plans_on = want_plans
        _PATCHES.install()


def disable() -> None:
    """Restore DTensor exactly as it was before `enable()`, last installed first out.
    Idempotent."""

    with locked():
        _PATCHES.uninstall()
        guard.uninstall()


def is_enabled() -> bool:
    return _PATCHES.is_installed()


def _state() -> tuple[bool, bool, bool]:
    return is_enabled(), guard.is_installed(), _plans_on


def _restore(state: tuple[bool, bool, bool]) -> None:
    """decompshard, the guard and the plans each as `_state()` found them."""
    was, guarded, planned = state
    with locked():
        if was:
            enable(guard_native=guarded, plans=planned)
        else:
            disable()
            if guarded:  # the guard alone (`guard.install()`)
                guard.install()


@contextlib.contextmanager
def switched(on: bool) -> Iterator[None]:
    """decompshard enabled (True) or torch's own fallback (False) inside, decompshard and
    the guard as they were restored after: the runtime checks run one case both ways."""
    state = _state()
    (enable if on else disable)()
    try:
        yield
    finally:
        _restore(state)


@contextlib.contextmanager
def enabled(guard_native: bool | None = None, plans: bool | None = None) -> Iterator[None]:
    """`with decompshard.enabled(): ...`: enabled inside, decompshard, the guard and the
    plans as they were restored after."""

    state = _state()
    enable(guard_native, plans)
    try:
        yield
    finally:
        _restore(state)
