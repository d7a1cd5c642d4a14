"""In-place view ops (`transpose_`, `unsqueeze_`, `t_`) on DTensors, under `enable()`.

DTensor has strategies for `transpose`, `unsqueeze` and `t` but none for their in-place
forms, so `x.transpose_(0, 1)` on a DTensor stops with "does not have a sharding strategy
registered". No decomposition helps: the op changes `self`'s metadata, and `self` cannot
be redistributed first. None is needed: the out-of-place twin's native strategy maps
`self`'s placements to the view's without moving data (`Shard(0)` of [7, 5] transposed
is `Shard(1)` of [5, 7]), so each rank takes the twin's view of its own local tensor and
`self` takes the twin's whole output spec. Registering the twin's strategy for the
in-place op would be wrong: DTensor's in-place path keeps `self`'s old spec when the
placements do not change, leaving the old shape over transposed locals. The handler
raises if the twin's strategy would move `self`.

The ops are found by property, not by name: tagged `inplace_view`, no strategy or handler
of their own, and an out-of-place twin (the name without the trailing underscore, the
same arguments) with a native strategy. A strategy torch copied from the twin does not
count as the op's own: from 2.14 torch registers `t`'s for `t_`, the wrong registration
above, so the handler takes `t_` too. `squeeze_` has a strategy of its own, as wrong on
2.13 to 2.15; the native guard gives it this handler per release (fences/table.py,
fences/in_place_views.py). `resize_`, `set_` and `as_strided_` have no such twin
(`as_strided_`: support/as_strided.py). `disable()` removes the handlers. Tests:
tests/test_inplace_views.py.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterator

import torch

from decompshard._compat import (
    aten_ops_tagged, custom_op_handlers, dtensor_output_sharding, has_native_strategy, local_tensor, rebind_dtensor,
    return_and_correct_aliasing, strategy_reused_from,
)
from decompshard.runtime.table_patches import Entry, WarnOnce, where_none

__all__ = ["entries", "in_place_view_handler", "in_place_view_ops"]


def _arguments(op: torch._ops.OpOverload) -> list[tuple[str, str]]:
    return [(a.name, str(a.type)) for a in op._schema.arguments]


@functools.lru_cache(maxsize=1)
def in_place_view_ops() -> tuple[tuple[torch._ops.OpOverload, torch._ops.OpOverload], ...]:
    """(in-place view op, out-of-place twin with a native strategy) for every aten
    `inplace_view` overload DTensor has no strategy or handler for."""

    handlers = custom_op_handlers()
    found = []
    for op in aten_ops_tagged(torch.Tag.inplace_view):
        own_strategy = has_native_strategy(op) and strategy_reused_from(op) is None
        if own_strategy or op in handlers or not op._opname.endswith("_"):
            continue
        packet = getattr(torch.ops.aten, op._opname[:-1], None)
        if packet is None:
            continue
        twins = [getattr(packet, name) for name in packet.overloads()]
        twin = next((t for t in twins if _arguments(t) == _arguments(op) and has_native_strategy(t)), None)
        if twin is not None:
            found.append((op, twin))
    return tuple(sorted(found, key=lambda p: str(p[0])))


def entries(warn_once: WarnOnce) -> Iterator[Entry]:
    """The handler for each in-place view op (`enable()` installs them)."""
    return where_none(custom_op_handlers(), in_place_view_ops(), in_place_view_handler)


def in_place_view_handler(op: torch._ops.OpOverload, twin: torch._ops.OpOverload) -> Callable:
    """A handler running `op` as `twin`'s view of each rank's local tensor, `self` given
    the twin's whole output spec (the native guard also gives it to squeeze_, whose own
    strategy DTensor's in-place path applies without changing `self`'s shape)."""

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        target = args[0]
        spec, moves, local_op, rest, local_kwargs = dtensor_output_sharding(twin, args, kwargs)
        if moves:
            raise RuntimeError(
                f"decompshard: {op} on a DTensor {tuple(target.shape)} {tuple(target.placements)}: {twin}'s "
                "strategy would redistribute self first, and an in-place op cannot move self (it would "
                f"relabel a copy); use the out-of-place {twin} or redistribute self first")
        # the twin's view of the local tensor, not the op in place on it: the same
        # storage and metadata, and torch's simulated ranks (LocalTensor) recurse on an
        # in-place view op when every rank's shard has the same shape
        rebind_dtensor(target, local_op(local_tensor(target), *rest, **local_kwargs), spec)
        return return_and_correct_aliasing(op_call, args, kwargs, target)

    handler.__name__ = f"in_place_view_{op._opname}"
    return handler
