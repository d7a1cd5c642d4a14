"""Whether a fence changed anything: its warning fires only where it did.

A fence runs its correct plan on every call it covers (the plan is what keeps every rank
on the same path); its warning says DTensor alone would have given other numbers, so it
fires only where that is so on this call: `.item()` of a Partial or sharded value where
this rank's own part is not the global value; a mean loss whose ranks hold different
total weights; a negative dim where the wrapped dim changes DTensor's strategy. An even
batch where DTensor alone is right runs the fence's plan in silence.

Under torch.compile nothing is compared (no values; a branch on one would split the
graph): the fence warns as it did before. Simulated ranks (LocalTensorMode): a LocalTensor is compared rank by rank, outside the
simulation (plain arithmetic on each rank's tensor), and differs where any rank differs.
"""

from __future__ import annotations

from typing import Any

import torch

from decompshard._compat import is_fake, outside_simulation, rank_tensors

__all__ = ["differs"]


def _pairs(a: Any, b: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    parts_a, parts_b = rank_tensors(a), rank_tensors(b)
    if parts_a is None and parts_b is None:
        return [(a, b)]
    ranks = parts_a if parts_a is not None else parts_b
    pick = lambda parts, t, r: parts[r] if parts is not None else t  # noqa: E731
    return [(pick(parts_a, a, r), pick(parts_b, b, r)) for r in ranks]


def differs(a: Any, b: Any, rtol: float = 0.0) -> bool:
    """Whether `a` and `b` (tensors, or LocalTensors per simulated rank) differ on any
    rank: another shape, or values apart by more than `rtol` (NaN equals NaN). Under
    torch.compile there are no values to compare, and comparing would break the graph
    (a data-dependent branch: one more graph, a compile-cache miss): a traced call
    counts as changed, so the warning fires there as before."""
    if torch.compiler.is_compiling() or any(isinstance(t, torch.Tensor) and is_fake(t) for t in (a, b)):
        return True
    with outside_simulation():
        for x, y in _pairs(a, b):
            if x.shape != y.shape:
                return True
            hi = torch.complex128 if x.is_complex() or y.is_complex() else torch.float64
            if not torch.allclose(x.to(hi), y.to(hi), rtol=rtol, atol=0.0, equal_nan=True):
                return True
    return False
