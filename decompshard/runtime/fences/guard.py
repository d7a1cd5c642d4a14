"""The native guard: DTensor kept away from native behaviour measured wrong.

Why on by default with `decompshard.enable()`: `enable()` makes programs reach DTensor's
native strategies they do not reach without it (a model that stops at CPU attention
without `enable()` runs on to its loss and its convolutions with it), so a wrong number
there is a wrong number under `enable()`. The guard fences wrong numbers only; what makes a program faster is a
plan (runtime/plans/), switched separately. Opt out with `enable(guard_native=False)` or
DECOMPSHARD_GUARD_NATIVE=0 (then nothing of DTensor's native path is touched);
`disable()` removes it, and DTensor's tables hold exactly the objects they held before.

What it fences is `table.FENCES`, one record per fence; each is installed where it was
measured wrong on the running release, or where that release was never measured
(`Fence.installed_here`). A fix is a handler for the op's slot or a wrapper of its
strategy in whichever table holds it (`records.Fix`); each warns once, naming the op and
what it did. The guard can be installed alone (the native audit does), under
`enable()`'s own record: a plan in front of a fenced op wraps the fence's handler.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Iterator

import torch

from decompshard._compat import clear_dtensor_caches, custom_op_handlers
from decompshard.op_names import resolve_op
from decompshard.runtime.compile_keys import forget_compiled, tag_entry
from decompshard.runtime.fences.table import FENCES
from decompshard.runtime.fences.wrong_rules import forget_verdicts
from decompshard.runtime.records import Fence
from decompshard.runtime.table_patches import Entry, TablePatches, WarnOnce, wrapped_strategy

__all__ = ["ENV", "install", "is_installed", "uninstall", "wanted"]

ENV = "DECOMPSHARD_GUARD_NATIVE"
_OFF = ("0", "false", "no", "off")


def wanted(flag: bool | None) -> bool:
    """The guard setting: the argument when given, else the environment variable
    (on unless it says 0, false, no or off)."""
    if flag is not None:
        return bool(flag)
    return os.environ.get(ENV, "").strip().lower() not in _OFF


def _resolve(name: str) -> torch._ops.OpOverload | None:
    try:
        return resolve_op(name)
    except ValueError:  # an overload this torch does not have
        return None


def fence_entries(op: Any, fence: Fence, warn: WarnOnce) -> Iterator[Entry]:
    """The table entries of one fence's fix for `op` (none where its slot is not there
    to fix: no DTensor handler to wrap, someone else's handler, no strategy)."""
    fix = fence.fix
    if fix.handler is not None:
        handlers = custom_op_handlers()
        existing = handlers.get(op)
        if (existing is None) == fix.wraps_dtensor_handler:
            return
        handler = fix.handler(op, fence, warn, existing)
        handler.fence = fence  # the mark a plan's chain looks for (plans.entries)
        yield handlers, op, handler
    yield from wrapped_strategy(op, (lambda func: fix.single(op, fence, warn, func)) if fix.single else None,
                                (lambda fn: fix.full(op, fence, warn, fn)) if fix.full else None)
    if fix.entries is not None:
        yield from fix.entries(op, fence)


def _declared() -> Iterator[Entry]:
    """What the guard puts where: torch's compile cache key tag (compile_keys: no graph
    compiled without these fences is served with them, nor the reverse), then each fence
    installed on this release, in table order."""
    fenced = [(fence, op) for fence in FENCES if fence.installed_here() and (op := _resolve(fence.op)) is not None]
    yield tag_entry("decompshard-guard", [fence.key for fence, _ in fenced])
    for fence, op in fenced:
        yield from fence_entries(op, fence, _warn_once)


def _changed(installed: bool) -> None:
    """Verdicts belong to one installation; DTensor's cached decisions are forgotten, and
    the code dynamo compiled (compile_keys)."""
    if not installed:
        forget_verdicts()
    clear_dtensor_caches()
    forget_compiled()


_PATCHES = TablePatches(_declared, on_change=_changed)
_warn_once = functools.partial(_PATCHES.warn_once, stacklevel=4)


def install() -> None:
    """Every fence installed on this release. Idempotent."""
    _PATCHES.install()


def uninstall() -> None:
    """Put back exactly what `install` replaced. Idempotent."""
    _PATCHES.uninstall()


def is_installed() -> bool:
    return _PATCHES.is_installed()
