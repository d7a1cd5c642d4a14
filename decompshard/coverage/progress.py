"""Progress of a long coverage step on stderr (stdout stays clean for the report).

On a terminal one line is rewritten in place: count, elapsed time, an ETA from the mean
time per item so far, the current item. Elsewhere (a log, CI) a plain line every
`interval` seconds and at the end. Verbose: one line per item, with the op's status.
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Any, Callable, TextIO

__all__ = ["Progress"]


class Progress:
    """`step(name, record)` after each item, or `update(done, total, name)` when the
    caller counts (the OpInfo capture); `close()` clears the terminal line."""

    def __init__(self, total: int, stream: TextIO | None = None, *, label: str = "ops",
                 enabled: bool = True, verbose: bool = False, interval: float = 5.0, warmup: int = 1,
                 clock: Callable[[], float] = time.monotonic):
        self.total, self.done, self.label, self.warmup = total, 0, label, max(1, warmup)
        self.enabled, self.verbose, self.interval, self.clock = enabled, verbose, interval, clock
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = self.last = clock()
        self.t1: float | None = None  # when the `warmup`-th item finished: the ETA's origin
        self.done1 = 0
        self.shown = False  # a terminal line is on screen

    def step(self, name: str, record: dict[str, Any] | None = None) -> None:
        self.update(self.done + 1, self.total, name, record)

    def update(self, done: int, total: int, name: str, record: dict[str, Any] | None = None) -> None:
        now = self.clock()
        if self.t1 is None or done <= self.warmup:
            self.t1, self.done1 = now, done
        self.done, self.total = done, total
        if not self.enabled:
            return
        if self.verbose:
            self._clear()
            what = f": {record['status']} ({record.get('seconds', 0):.1f} s)" if record else ""
            self._write(f"coverage: [{done}/{total}] {name}{what}\n")
        if self.tty:
            line = f"coverage: {self.label} {done}/{total}, {self._times(now)}  {name}"
            cols = shutil.get_terminal_size((80, 24)).columns - 1
            self._write("\r" + line[:cols].ljust(cols))
            self.shown = True
        elif not self.verbose and (now - self.last >= self.interval or done == total):
            self._write(f"coverage: {self.label} {done}/{total} ({self._times(now)})\n")
            self.last = now

    def _times(self, now: float) -> str:
        """Elapsed time, and an ETA from the items after the first `warmup` ones (the
        first pays for imports or a worker's start; a sweep's registry lookups are
        instant next to the ops it derives), once there are some."""
        elapsed = now - self.t0
        rate_items = self.done - self.done1
        if rate_items < 1 or self.done >= self.total:
            return f"{elapsed:.0f} s"
        eta = (now - self.t1) / rate_items * (self.total - self.done)
        return f"{elapsed:.0f} s, ETA {eta:.0f} s"

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _clear(self) -> None:
        if self.shown:
            cols = shutil.get_terminal_size((80, 24)).columns - 1
            self._write("\r" + " " * cols + "\r")
            self.shown = False

    def close(self) -> None:
        if self.enabled:
            self._clear()
