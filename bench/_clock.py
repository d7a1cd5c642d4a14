"""Shared by the benches: time spent building primitive rule tables.

Why: rule tables are the one part of a derivation whose cost the benches report on its
own (the "+tables ceiling" of derive.py, the table column of solver_scaling.py), so both
wrap the one function that builds them, `registry._compute_rules`, the same way.
"""

from __future__ import annotations

import time
from typing import Any


class RuleTableClock:
    """`with RuleTableClock() as clock:` adds every `_compute_rules` call's time to
    `clock.seconds` (set it to 0.0 to start a new measurement) and restores the
    function on exit."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original: Any = None

    def __enter__(self) -> "RuleTableClock":
        from decompshard.rules import registry

        self._original = original = registry._compute_rules

        def timed(node: Any) -> Any:
            t = time.perf_counter()
            try:
                return original(node)
            finally:
                self.seconds += time.perf_counter() - t

        registry._compute_rules = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        from decompshard.rules import registry

        registry._compute_rules = self._original
