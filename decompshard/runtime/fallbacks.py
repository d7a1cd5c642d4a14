"""The record of every op `enable()` ran replicated instead of with a derived strategy.

`enable()` never stops a program for an op it cannot derive: the op runs replicated
(always correct) with a one-time warning. A warning proves nothing to a check that
compares numbers: replicated numbers are right, so a check that reads only numbers
cannot tell a derived strategy from a silent fall-back, nor a bug in decompshard (an
internal error caught so the user's program goes on) from an op that cannot be derived.
So each fall-back is also recorded here, with its op and why (`KINDS`), for whoever is
recording: `check`, `check --model` and the zoo wrap each case in
`recording_fallbacks()` and report what it holds; an internal error fails the case.

DTensor caches its sharding decisions (per op and argument metadata), and a cached
decision does not reach the fall-back again, so `recording_fallbacks()` forgets them on
entry: each op met inside is decided, and recorded, afresh.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import asdict, dataclass
from typing import Any, Iterator

from decompshard._compat import clear_dtensor_caches

__all__ = ["DATA_DEPENDENT", "INTERNAL_ERROR", "KINDS", "NO_DECOMPOSITION", "SYMBOLIC", "UNSUPPORTED", "Fallback",
           "FallbackLog", "record", "recording_fallbacks", "summarize"]

# why an op ran replicated: a bug of decompshard's (a failure wherever it is recorded),
# an op decompshard cannot derive (random, no meta kernel, ...), symbolic shapes it does not derive for under
# torch.compile, no decomposition at all, or an output size that depends on values
INTERNAL_ERROR, UNSUPPORTED, SYMBOLIC = "internal error", "unsupported", "symbolic shapes"
NO_DECOMPOSITION, DATA_DEPENDENT = "no decomposition", "data-dependent"
KINDS = (INTERNAL_ERROR, UNSUPPORTED, SYMBOLIC, NO_DECOMPOSITION, DATA_DEPENDENT)


@dataclass(frozen=True)
class Fallback:
    """One op that ran replicated, why (a kind in KINDS) and the message it warned with;
    `count`: how often in the recording."""

    op: str
    kind: str
    message: str
    count: int = 1


class FallbackLog:
    """What one `recording_fallbacks()` saw: each (op, kind) once, with a count."""

    def __init__(self) -> None:
        self._seen: dict[tuple[str, str], Fallback] = {}

    def add(self, op: str, kind: str, message: str) -> None:
        old = self._seen.get((op, kind))
        self._seen[(op, kind)] = Fallback(op, kind, message, old.count + 1 if old else 1)

    @property
    def events(self) -> list[Fallback]:
        return list(self._seen.values())

    def internal_errors(self) -> list[Fallback]:
        return [f for f in self.events if f.kind == INTERNAL_ERROR]

    def as_json(self) -> list[dict[str, Any]]:
        return [asdict(f) for f in self.events]


_lock = threading.Lock()
_active: list[FallbackLog] = []


def record(op: Any, kind: str, message: str) -> None:
    """`op` runs replicated because of `kind` (one of KINDS): tell every recording."""
    if kind not in KINDS:
        raise ValueError(f"unknown fall-back kind {kind!r}")
    with _lock:
        for log in _active:
            log.add(str(op), kind, message)


@contextlib.contextmanager
def recording_fallbacks() -> Iterator[FallbackLog]:
    """Every fall-back to replicated inside the block, in the log it yields (DTensor's
    cached sharding decisions forgotten on entry, so cached ones are met again)."""
    log = FallbackLog()
    clear_dtensor_caches()
    with _lock:
        _active.append(log)
    try:
        yield log
    finally:
        with _lock:
            _active.remove(log)


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """{kind: {op: cases}} over the fall-back rows (`FallbackLog.as_json`) of many cases
    (each case lists an op and kind once)."""
    out: dict[str, dict[str, int]] = {}
    for r in rows:
        ops = out.setdefault(r["kind"], {})
        ops[r["op"]] = ops.get(r["op"], 0) + 1
    return out
