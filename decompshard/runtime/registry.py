"""The one registry: every record decompshard declares, by kind, in the order `enable()`
installs them.

Why one place: "what does `enable()` do to this op?" has one answer, read from the same
records the runtime installs. The guard's fences go in first (under everything, as they
can be installed alone); then, over derived strategies, the support handlers, the plans
(each in front of its op's fence), the steering. `records_for` answers the question for
one op where a record names its ops (plans, fences); support and steering records name
families of ops, decided per call.
"""

from __future__ import annotations

from typing import Any, Union

from decompshard.op_names import resolve_op
from decompshard.runtime.fences.table import FENCES
from decompshard.runtime.plans import PLANS
from decompshard.runtime.records import Fence, Plan, Steering, Support
from decompshard.runtime.steering import STEERING
from decompshard.runtime.support import SUPPORT

__all__ = ["FENCES", "PLANS", "STEERING", "SUPPORT", "Record", "records_for"]

Record = Union[Plan, Fence, Support, Steering]


def records_for(op: Any) -> list[Record]:
    """The plans and fences that name `op` (an OpOverload or its name), plan first: the
    order of the op's handler chain. A fence listed may step aside on this release
    (`Fence.installed_here`)."""
    name = str(op) if not isinstance(op, str) else str(resolve_op(op))
    plans = [p for p in PLANS if name in p.ops]
    fences = [f for f in FENCES if f.op == name]
    return [*plans, *fences]
