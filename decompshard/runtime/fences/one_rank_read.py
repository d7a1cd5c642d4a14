"""The fix for reads of one rank's part: `_local_scalar_dense` (`.item()`), which DTensor runs
on each rank's local tensor without asking any strategy (the sharding propagator
special-cases it), so `.item()` of a Partial loss returns each rank's own part and of a
sharded tensor its shard. The guard's handler redistributes the input to Replicate first,
and warns where a rank's own part was not the global value (a Partial(product) of `all()`
whose every part is True reads True alone: no warning).
"""

from __future__ import annotations

from typing import Any, Callable

from decompshard._compat import DTensor, TorchReplicate
from decompshard.runtime.fences.changed import differs
from decompshard.runtime.records import Fix
from decompshard.runtime.table_patches import WarnOnce

__all__ = ["FIX"]


def _replicated_read(op: Any, warn: WarnOnce) -> Callable:
    """A handler for an op DTensor runs on each rank's local part without asking any
    strategy (`_local_scalar_dense`: the sharding propagator special-cases it): the
    input is redistributed to Replicate first, so every rank reads the global value."""

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        if isinstance(x, DTensor) and not all(isinstance(p, TorchReplicate) for p in x.placements):
            own, placements = x.to_local(), tuple(x.placements)
            x = x.redistribute(x.device_mesh, [TorchReplicate()] * x.device_mesh.ndim)
            if differs(own, x.to_local()):  # silent where this rank's own part is the global value
                warn(f"read:{op}", (
                    f"decompshard guard: {op}: DTensor would read each rank's own part of a "
                    f"{placements} tensor (`.item()` of a partial or sharded value), here not the global "
                    f"value; redistributing to Replicate first"))
        local = x.to_local() if isinstance(x, DTensor) else x
        return op_call(local, *args[1:], **kwargs)

    return handler


FIX = Fix("the input redistributed to Replicate before the read",
          handler=lambda op, fence, warn, existing: _replicated_read(op, warn))
