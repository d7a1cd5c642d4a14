"""explain's view of a collective plan: for an op that `enable()` can run with small
collectives inside (runtime/plans/__init__.py), what the plan moves for this call, what
DTensor's single-op strategy moves, and which of the two `enable()` runs.

Nothing is decided here: the call is rebuilt as DTensors (meta local tensors, no data)
on a simulated mesh of the requested shape and placements, and the plan's own pricing
function and test run on it with `enable()` on, as its handler would run them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from decompshard._compat import DTensor, contiguous_spec, tree_flatten, tree_unflatten
from decompshard.errors import one_line
from decompshard.mesh.cost import Cost
from decompshard.mesh.lift import local_shape_nd
from decompshard.runtime.enable import enabled
from decompshard.runtime.plans import plan_for, price
from decompshard.runtime.records import Plan
from decompshard.runtime.collectives import Priced
from decompshard.verify.dtensor_case import device_mesh, simulated_world

__all__ = ["PlanReport", "plan_report"]


@dataclass
class PlanReport:
    """One op's collective plan for one call. `mesh_shape` None: no mesh was given, so
    nothing is priced (the plan's numbers depend on the mesh)."""

    info: Plan
    mesh_shape: tuple[int, ...] | None = None
    priced: Priced | None = None  # None: the plan does not apply to these placements
    dtensor: Cost | None = None  # DTensor's own strategy's moves; None: it has no strategy
    taken: bool = False  # enable() runs the plan for this call
    error: str | None = None  # why it could not be priced

    @property
    def needed(self) -> bool:
        """Whether DTensor's strategy moves anything (else no plan can do better)."""
        return self.dtensor is None or self.dtensor.bytes_moved > 0


def _dtensor(t: torch.Tensor, mesh: Any, placements: Sequence[Any]) -> Any:
    """A DTensor of `t`'s global shape and dtype with a meta local part (rank 0's)."""
    local = torch.empty(local_shape_nd(tuple(t.shape), placements, tuple(mesh.shape), (0,) * mesh.ndim),
                        dtype=t.dtype, device="meta")
    spec = contiguous_spec(mesh, tuple(placements), tuple(t.shape), t.dtype, tuple(t.stride()))
    return DTensor(local, spec, requires_grad=False)


def plan_report(op: Any, args: tuple, kwargs: dict, mesh_shape: Sequence[int] | None,
                current: Sequence[Sequence[Any]] | None) -> PlanReport | None:
    """The op's plan priced for these arguments on `mesh_shape` with the tensor inputs
    at `current` (torch placements per tensor input, flattened order); None where the
    op has no collective plan."""
    info = plan_for(op)
    if info is None:
        return None
    report = PlanReport(info)
    if mesh_shape is None:
        return report
    report.mesh_shape = tuple(mesh_shape)
    try:
        with simulated_world(math.prod(mesh_shape)):
            mesh = device_mesh(tuple(mesh_shape))
            leaves, spec = tree_flatten((args, kwargs))
            rows = iter(current)
            leaves = [_dtensor(x, mesh, next(rows)) if isinstance(x, torch.Tensor) else x for x in leaves]
            dargs, dkwargs = tree_unflatten(leaves, spec)
            with enabled():
                report.priced, report.dtensor, report.taken = price(op, tuple(dargs), dict(dkwargs))
    except Exception as e:  # noqa: BLE001 - display only: say why, the rest of explain stands
        report.error = one_line(e, 200)
    return report
