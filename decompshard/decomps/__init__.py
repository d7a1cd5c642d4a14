"""Decompositions decompshard registers for ops torch has none for.

Each entry is plain torch code over aten ops that do have rules; the tracer looks here
last (after torch's decomposition table and CompositeImplicitAutograd).
"""

from __future__ import annotations

from typing import Callable

import torch

aten = torch.ops.aten


def _addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    # addbmm = beta * self + alpha * sum_b(batch1[b] @ batch2[b])
    prod = aten.sum.dim_IntList(aten.bmm.default(batch1, batch2), [0])
    if beta == 0:
        return aten.mul.Tensor(prod, alpha)
    return aten.add.Tensor(aten.mul.Tensor(self, beta), prod, alpha=alpha)


def _cdist_forward(x1, x2, p, compute_mode):
    # Euclidean and general p-norm distance via broadcasting: exact for every p, no
    # matmul trick (the trick's compute_mode switch changes rounding, not values).
    diff = aten.sub.Tensor(aten.unsqueeze.default(x1, -2), aten.unsqueeze.default(x2, -3))
    if p == 0:
        return aten.sum.dim_IntList(aten.ne.Scalar(diff, 0).to(x1.dtype), [-1])
    if p == float("inf"):
        return aten.amax.default(aten.abs.default(diff), [-1])
    return aten.linalg_vector_norm.default(diff, p, [-1])


PROJECT_DECOMPOSITIONS: dict[torch._ops.OpOverload, Callable] = {
    aten.addbmm.default: _addbmm,
    aten._cdist_forward.default: _cdist_forward,
}
