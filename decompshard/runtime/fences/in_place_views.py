"""The fix for in-place view ops DTensor leaves at their old shape (`squeeze_`): its in-place
path keeps `self`'s old shape when the placements do not change, so `x.squeeze_(-1)` of
a [4, 3, 1] DTensor stays [4, 3, 1] over [4, 3] locals. The guard runs them as their
out-of-place twin's view of each rank's local tensor and sets self's whole spec
(support/inplace_views.py's handler, which `enable()` uses for the ops without a
strategy of their own).
"""

from __future__ import annotations

from typing import Any, Callable

from decompshard.op_names import resolve_op
from decompshard.runtime.records import Fix
from decompshard.runtime.support.inplace_views import in_place_view_handler
from decompshard.runtime.table_patches import WarnOnce

__all__ = ["FIX"]


def _in_place_view(op: Any, twin: str, warn: WarnOnce) -> Callable:
    """enable()'s in-place view handler, with a warning: DTensor would keep self's shape."""
    run = in_place_view_handler(op, resolve_op(twin))

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        warn(f"inplace-view:{op}", (
            f"decompshard guard: {op}: DTensor's in-place path would keep self's old shape over the "
            f"changed local tensors; running it as {twin}'s view and setting self's whole spec"))
        return run(op_call, args, kwargs)

    return handler


FIX = Fix("run as the out-of-place twin's view of each local tensor, self's whole spec set",
          handler=lambda op, fence, warn, existing: _in_place_view(op, fence.args, warn))
