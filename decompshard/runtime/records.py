"""The record types: every intervention `enable()` makes in DTensor, declared as data.

Why records: "what does `enable()` do to this op, and why?" must have one answer a
reader can find, and `explain`, the checks and the docs must read the same answer the
runtime acts on. Each kind lives in its own folder and registry:

* `Plan` (runtime/plans/): performance. The op runs on the shards as they are, with small
  collectives inside, where that is priced below DTensor's own strategy. Own switch.
* `Fence` (runtime/fences/): correctness. DTensor's native behaviour measured wrong on
  some releases, and the fix. The native guard is the set of fences; it fences wrong
  numbers only and never carries a performance plan.
* `Support` (runtime/support/): valid programs DTensor refuses (raises on), run anyway.
* `Steering` (runtime/steering/): DTensor's choice among its own strategies re-priced.

Where a plan and a fence share an op's handler slot, the chain is built in one order
(`Plan.handler`): the plan where it pays, else the fence's fix, else DTensor's own path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from decompshard import _compat
from decompshard.runtime.collectives import Priced
from decompshard.runtime.table_patches import Entry, WarnOnce

__all__ = ["TESTED_RELEASES", "Fence", "Fix", "Handler", "Plan", "Steering", "Support"]

Handler = Callable[[Any, tuple, dict], Any]  # a DTensor custom op handler: (op, args, kwargs) -> result
PriceFn = Callable[[Any, tuple, dict], Optional[Priced]]
RunFn = Callable[[Any, tuple, dict, Priced], Any]


@dataclass(frozen=True)
class Plan:
    """A collective plan for some ops: its price for a call (None: it does not apply to
    the call's placements) and its run (given the price's context; None: it declines
    after all, and the chain goes on). `what` and `applies` are what `explain` prints.
    `over_dtensor_handler`: DTensor has a custom handler of its own for these ops
    (convolution), which the plan goes in front of; otherwise the plan takes an empty
    handler slot (or the guard's fence there) and leaves anyone else's alone."""

    ops: tuple[str, ...]
    what: str
    applies: str
    price: PriceFn
    run: RunFn
    over_dtensor_handler: bool = False

    @property
    def module(self) -> str:
        """Where the plan's code lives, as a path a reader can open."""
        return self.run.__module__.replace(".", "/").removeprefix("decompshard/") + ".py"

    def handler(self, next_handler: Handler) -> Handler:
        """The op's handler: this plan where it applies and is taken, else `next_handler`
        (the guard's fence, or DTensor's own path). The price is computed once and its
        context handed to the run."""

        def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
            priced = self.price(op_call, args, kwargs)
            if priced is not None and priced.taken(op_call, args, kwargs):
                out = self.run(op_call, args, kwargs, priced)
                if out is not None:
                    return out
            return next_handler(op_call, args, kwargs)

        handler.__wrapped__ = next_handler  # type: ignore[attr-defined]
        handler.plan = self  # type: ignore[attr-defined]
        return handler


# The releases every fence was measured on: the native audit's findings file of each, and
# the cases of tests/test_guard_releases.py (DTensor alone wrong where a fence says so).
TESTED_RELEASES: tuple[str, ...] = ("2.13.0", "2.14.1", "2.15.0")


@dataclass(frozen=True)
class Fix:
    """How the guard fixes what a fence names; the fence's `args` parametrize it. One of:

    * `handler(op, fence, warn, existing)`: a handler for the op's slot. With
      `wraps_dtensor_handler` it wraps the handler DTensor has there (`existing`; no
      handler, no fix); otherwise it takes an empty slot only (someone else's handler,
      `loss_parallel()`'s, stays) and `existing` is None;
    * `single(op, fence, warn, func)` / `full(op, fence, warn, fn)`: a wrapper of the op's
      strategy, in whichever of DTensor's two tables holds it (the single-dim table from
      torch 2.14 on for most ops, the full-mesh op-strategy table before);
    * `entries(op, fence)`: anything else (the op's RuntimeSchemaInfo)."""

    what: str
    handler: Callable[..., Handler] | None = None
    wraps_dtensor_handler: bool = False
    single: Callable[..., Callable] | None = None
    full: Callable[..., Callable] | None = None
    entries: Callable[..., Iterator[Entry]] | None = None


@dataclass(frozen=True)
class Fence:
    """One native behaviour of DTensor measured wrong, and its fix: every fact of a fence
    in one record. `wrong_on`: the tested releases on which DTensor alone was measured
    wrong; the guard installs the fence there and on any release nobody measured (a fence
    on a right op costs communication, a missing one costs a wrong number), and steps
    aside where the measurement found torch right, unless `kept_where_right` says why the
    fix is also the cheaper plan. `aspect` names a second fence on the same op."""

    op: str
    wrong: str
    wrong_on: tuple[str, ...]
    fix: Fix
    args: Any = None
    kept_where_right: str = ""
    aspect: str = ""

    @property
    def key(self) -> str:
        """The fence's name: its op, and its aspect where the op has two fences."""
        return f"{self.op}/{self.aspect}" if self.aspect else self.op

    def wrong_here(self, release: str | None = None) -> bool:
        """Whether DTensor alone is to be taken as wrong on `release` (default: the running
        one): measured wrong there, or never measured there."""
        release = _compat.TORCH_RELEASE if release is None else release
        return release not in TESTED_RELEASES or release in self.wrong_on

    def installed_here(self, release: str | None = None) -> bool:
        """Whether the guard installs this fence on `release`."""
        return bool(self.kept_where_right) or self.wrong_here(release)


@dataclass(frozen=True)
class Support:
    """Ops DTensor refuses, and what runs them: `entries(warn)` declares the table entries
    (handlers, strategies) `enable()` installs for them."""

    name: str
    what: str
    entries: Callable[[WarnOnce], Iterator[Entry]]


@dataclass(frozen=True)
class Steering:
    """A re-pricing of DTensor's own choice among its strategies (no new strategy, no
    new handler of an op's own): `entries(warn)` declares what `enable()` installs."""

    name: str
    what: str
    entries: Callable[[WarnOnce], Iterator[Entry]]
