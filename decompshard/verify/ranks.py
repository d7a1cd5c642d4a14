"""Every simulated rank's value of a tensor: what both the DTensor runner and the judge
read (LocalTensorMode holds all ranks in one process; a real group shows its own)."""

from __future__ import annotations

import itertools
from typing import Any, Sequence

import torch

from decompshard._compat import rank_tensors, simulating_ranks

__all__ = ["every_rank_full", "mesh_coords", "per_rank_values", "rank_locals"]


def per_rank_values(t: torch.Tensor, n: int) -> dict[int, torch.Tensor]:
    """Each simulated rank's tensor (LocalTensorMode gives a plain tensor where every
    rank holds the same). A rank's entry can itself be per rank (a collective run on the
    simulator's per-rank chunks nests them): rank r's value is then its own entry r."""
    lt = rank_tensors(t)
    out = dict(lt) if lt is not None else {r: t for r in range(n)}
    for r, v in out.items():
        while (inner := rank_tensors(v)) is not None and r in inner:
            v = inner[r]
        out[r] = v
    return out


def rank_locals(t: torch.Tensor, mesh: Any) -> dict[int, torch.Tensor]:
    """The local values this process can see, by rank index within `mesh` (row-major):
    every rank when simulated, this process's own rank in a real process group."""
    if simulating_ranks():
        return per_rank_values(t, mesh.size())
    coord = mesh.get_coordinate()
    return {mesh_coords(tuple(mesh.shape)).index(tuple(coord)): t}


def every_rank_full(value: Any, mesh: Any) -> dict[int, Any]:
    """Every visible rank's copy of the global value of one result (a DTensor's
    `full_tensor()`, gathered by each rank; a plain value as each rank holds it)."""
    from torch.distributed.tensor import DTensor

    return rank_locals(value.full_tensor() if isinstance(value, DTensor) else value, mesh)


def mesh_coords(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Every rank's coordinate on a mesh of this shape, in rank (row-major) order."""
    return list(itertools.product(*(range(s) for s in mesh_shape)))
