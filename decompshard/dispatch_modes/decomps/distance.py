"""Pairwise distances (`_cdist_forward`, `_cdist_backward`) as plain elementwise ops and
reductions: torch's own kernels have no decomposition, and `pdist` (search.py) is built
on these two.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def cdist_forward(x1, x2, p, compute_mode):
    # Euclidean and general p-norm distance via broadcasting: exact for every p, no
    # matmul trick (the trick's compute_mode switch changes rounding, not values).
    diff = aten.sub.Tensor(aten.unsqueeze.default(x1, -2), aten.unsqueeze.default(x2, -3))
    if p == 0:
        return aten.sum.dim_IntList(aten.ne.Scalar(diff, 0).to(x1.dtype), [-1])
    if p == 1:  # the same sum as the 1-norm, which a sharded last dim turns into P(sum)
        return aten.sum.dim_IntList(aten.abs.default(diff), [-1])
    if p == float("inf"):
        return aten.amax.default(aten.abs.default(diff), [-1])
    return aten.linalg_vector_norm.default(diff, p, [-1])


def cdist_backward(grad, x1, x2, p, cdist):
    # Gradient w.r.t. x1 of cdist(x1, x2, p) (autograd calls it again with x1, x2 swapped
    # for x2's). Same cases as ATen's cdist backward kernel: zero distances give zero.
    diff = aten.sub.Tensor(aten.unsqueeze.default(x1, -2), aten.unsqueeze.default(x2, -3))
    g = aten.unsqueeze.default(grad, -1)
    d = aten.unsqueeze.default(cdist, -1)
    zero = torch.zeros_like(diff)
    if p == 0:
        return torch.zeros_like(x1)
    if p == 1:
        term = aten.mul.Tensor(aten.sign.default(diff), g)
    elif p == float("inf"):
        hit = aten.eq.Tensor(aten.abs.default(diff), d)
        term = aten.mul.Tensor(aten.mul.Tensor(aten.sign.default(diff), hit.to(diff.dtype)), g)
    elif p == 2:
        term = aten.where.self(aten.eq.Scalar(d, 0), zero, aten.div.Tensor(aten.mul.Tensor(diff, g), d))
    else:
        mag = aten.pow.Tensor_Scalar(aten.abs.default(diff), p - 1)
        term = aten.div.Tensor(aten.mul.Tensor(aten.mul.Tensor(aten.sign.default(diff), mag), g),
                               aten.pow.Tensor_Scalar(d, p - 1))
        term = aten.where.self(aten.eq.Scalar(d, 0), zero, term)
        if p < 1:  # |diff|^(p-1) blows up at diff == 0: ATen takes those terms as 0
            term = aten.where.self(aten.eq.Scalar(diff, 0), zero, term)
    return aten.sum.dim_IntList(term, [-2])
