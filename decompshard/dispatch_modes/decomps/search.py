"""Decompositions for search, distance and conjugation ops torch never decomposes.

searchsorted, _trilinear, _pdist_forward / _pdist_backward and _conj_physical have
neither a DTensor strategy nor a torch decomposition. Each function below is the same
function written over aten ops that have rules, so the tracer derives their sharding
like any other op's. They run only on meta tensors to derive rules: DTensor runs the
real kernel on local shards with the derived strategy, and the numerical check judges
every rule against that real kernel. So they may spend time and memory (a binary search
of log2(n) steps per value, the [N, N, M] difference of every pair of rows), but they
must compute what the kernel computes for every input, since a rule read off a
different function would be wrong for the real one.

hash_tensor (an xor of the elements' 64-bit patterns) is here too: no op with a rule
reduces with xor, so the reduction is a halving tree of bitwise_xor.

Left out, with the reason (coverage keeps it "unsupported: no decomposition"):
- linalg_lstsq: its outputs depend on the LAPACK driver (gels assumes full rank; gelsy,
  gelsd and gelss cut singular values at rcond and return rank / singular_values,
  residuals only for some shapes and drivers), and no op with a rule solves a least
  squares problem; any rewrite over pinv/svd/qr differs from the driver's result.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from decompshard.dispatch_modes.decomps.distance import cdist_backward, cdist_forward

aten = torch.ops.aten


def _searchsorted_side(right: bool, side: str | None) -> bool:
    """True for the upper bound (count of elements <= value). torch's own argument check:
    side wins when given, and side='left' with right=True is an error."""
    if side is None:
        return bool(right)
    if side not in ("left", "right"):
        raise RuntimeError(f"torch.searchsorted(): side can only be 'left' or 'right' but got {side}")
    if side == "left" and right:
        raise RuntimeError("torch.searchsorted(): side and right can't be set to opposites, "
                           "got side of left while right was True")
    return side == "right"


def _searchsorted(sorted_sequence: torch.Tensor, values: torch.Tensor | Any, *, out_int32: bool = False,
                  right: bool = False, side: str | None = None, sorter: torch.Tensor | None = None) -> torch.Tensor:
    # The kernel's binary search, step by step (ATen's cus_lower_bound / cus_upper_bound):
    #   mid = start + (end - start) // 2; go right when !(seq[mid] >= v) (left side) or
    #   !(seq[mid] > v) (right side).
    # A count of the elements below v (a comparison and a sum, which would let a
    # sequence sharded on its last dim give P(sum)) is the same only for a sequence the
    # comparisons see as sorted. With a NaN in it (torch.sort puts NaN last) the kernel's
    # answer depends on the path it takes: searchsorted([1, nan], 1) is 2 on one device,
    # but 0 + 1 = 1 from the shards [1] and [nan]. So the sequence's last dim stays
    # whole; every other dim, and every value, is independent and shards.
    upper = _searchsorted_side(right, side)
    # The kernel compares in result_type(sequence, values): a 0-d or Python value against
    # float32 boundaries is compared in float32, an int sequence against 2.5 in float.
    common = torch.result_type(sorted_sequence, values)
    if not isinstance(values, torch.Tensor):  # the Scalar overload: a 1-D sequence, a 0-d result
        values = aten.scalar_tensor.default(values, dtype=common, device=sorted_sequence.device)
    if sorted_sequence.dim() == 0:
        raise RuntimeError("torch.searchsorted(): boundaries tensor should have positive dimension, "
                           "but got 0 dimension")
    if sorted_sequence.dim() > 1 and tuple(sorted_sequence.shape[:-1]) != tuple(values.shape[:-1]):
        raise RuntimeError("torch.searchsorted(): boundaries tensor should be 1 dimension or the first N-1 "
                           "dimensions of boundaries tensor and input value tensor must match, but we got "
                           f"boundaries tensor {list(sorted_sequence.shape)} and input value tensor "
                           f"{list(values.shape)}")
    if sorter is not None and tuple(sorter.shape) != tuple(sorted_sequence.shape):
        raise RuntimeError("torch.searchsorted(): boundary and sorter must have the same size")
    seq = sorted_sequence.to(common)
    vals = values.to(common)
    out_dtype = torch.int32 if out_int32 else torch.int64
    n = sorted_sequence.shape[-1]
    one_d = sorted_sequence.dim() == 1
    start = aten.zeros_like.default(vals, dtype=torch.int64)
    end = aten.full_like.default(vals, n, dtype=torch.int64)
    # Each step halves end - start (at most n); bit_length(n) steps bring it to 0.
    for _ in range(n.bit_length()):
        active = aten.lt.Tensor(start, end)
        mid = aten.add.Tensor(start, aten.floor_divide.default(aten.sub.Tensor(end, start), 2))
        pos = aten.clamp.default(mid, 0, max(n - 1, 0))  # finished searches read any valid position
        if sorter is not None:
            pos = _read(sorter, pos, one_d)
        mid_val = _read(seq, pos, one_d)
        cmp = aten.gt.Tensor(mid_val, vals) if upper else aten.ge.Tensor(mid_val, vals)
        go_right = aten.logical_and.default(active, aten.logical_not.default(cmp))
        go_left = aten.logical_and.default(active, cmp)
        start = aten.where.self(go_right, aten.add.Tensor(mid, 1), start)
        end = aten.where.self(go_left, mid, end)
    return start.to(out_dtype)


def _read(seq: torch.Tensor, pos: torch.Tensor, one_d: bool) -> torch.Tensor:
    """seq[..., pos]: one boundary per value, the values' batch dims matching seq's. A 1-D
    seq is expanded over the values' batch dims so that gather serves every case: its
    rule keeps an uneven shard of the values (index.Tensor's asks for even ones)."""
    if one_d:
        if pos.dim() == 0:  # one value: nothing to shard
            return aten.index.Tensor(seq, [pos])
        n = seq.shape[0]
        seq = aten.expand.default(aten.view.default(seq, [1] * (pos.dim() - 1) + [n]), list(pos.shape[:-1]) + [n])
    return aten.gather.default(seq, -1, pos)


def _searchsorted_scalar(sorted_sequence: torch.Tensor, value: Any, *, out_int32: bool = False,
                         right: bool = False, side: str | None = None,
                         sorter: torch.Tensor | None = None) -> torch.Tensor:
    if sorted_sequence.dim() != 1:
        raise RuntimeError("torch.searchsorted(): input value can be a scalar only when boundaries tensor "
                           f"dimension is 1, but we got boundaries tensor dim({sorted_sequence.dim()}) "
                           "and input value's dim(0) numel(1)")
    return _searchsorted(sorted_sequence, value, out_int32=out_int32, right=right, side=side, sorter=sorter)


def _trilinear(i1: torch.Tensor, i2: torch.Tensor, i3: torch.Tensor, expand1: list[int], expand2: list[int],
               expand3: list[int], sumdim: list[int], unroll_dim: int = 1) -> torch.Tensor:
    # Each input gets size-1 dims at its expand positions; the result is the product of
    # the three, summed over sumdim (which leaves the output). ATen sums the pairs in
    # another order (sumproduct_pair); the values agree up to rounding and the function
    # is the same, which is all a rule derivation reads. unroll_dim only picks ATen's loop.
    def expanded(x: torch.Tensor, dims: list[int]) -> torch.Tensor:
        for d in sorted(dims):
            x = aten.unsqueeze.default(x, d)
        return x

    prod = aten.mul.Tensor(aten.mul.Tensor(expanded(i1, expand1), expanded(i2, expand2)), expanded(i3, expand3))
    if not sumdim:  # sum.dim_IntList with [] would sum every dim
        return prod
    return aten.sum.dim_IntList(prod, sorted(set(sumdim)))


def _pair_indices(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows i < j of each pdist entry, in pdist's order (row-major upper triangle)."""
    ij = aten.triu_indices.default(n, n, 1, dtype=torch.int64, device=device)
    return aten.select.int(ij, 0, 0), aten.select.int(ij, 0, 1)


def _pdist_forward(x: torch.Tensor, p: float = 2.0) -> torch.Tensor:
    # pdist is the upper triangle (i < j, row-major) of cdist(x, x): the project's cdist
    # decomposition, so both share one set of p cases (0, 1, 2, inf, other), then a
    # constant index into the flat [N * N] matrix. Picking rows first (x[i] - x[j]) would
    # be smaller, but index_select's rule keeps only even column shards, and gather's
    # none with a constant index; the whole matrix keeps x's columns sharded into P(sum)
    # (p = 0, 1) or P(max) (p = inf) at any split.

    if x.dim() != 2:
        raise RuntimeError(f"pdist only supports 2D tensors, got: {x.dim()}D")
    if p < 0:
        raise RuntimeError("pdist only supports non-negative p values")
    if x.shape[1] == 0:  # every distance over no coordinates is 0; p = 1 gives that (amax cannot)
        p = 1.0
    n = x.shape[0]
    i, j = _pair_indices(n, x.device)
    flat = aten.view.default(cdist_forward(x, x, p, 0), [n * n])
    return aten.index_select.default(flat, 0, aten.add.Tensor(aten.mul.Tensor(i, n), j))


def _pdist_backward(grad: torch.Tensor, x: torch.Tensor, p: float, pdist: torch.Tensor) -> torch.Tensor:
    # Row a's gradient sums, over every other row b, grad(a, b) * d dist(x_a, x_b) / d x_a.
    # Written out as symmetric [N, N] matrices of grad and dist (zero diagonal, where the
    # project's cdist backward gives 0), it is cdist's backward of x against itself.

    n = x.shape[0]
    i, j = _pair_indices(n, x.device)
    upper = aten.add.Tensor(aten.mul.Tensor(i, n), j)
    lower = aten.add.Tensor(aten.mul.Tensor(j, n), i)
    slots = aten.cat.default([upper, lower])

    def square(v: torch.Tensor) -> torch.Tensor:
        flat = aten.zeros.default([n * n], dtype=v.dtype, device=v.device)
        flat = aten.index_put.default(flat, [slots], aten.cat.default([v, v]))
        return aten.view.default(flat, [n, n])

    return cdist_backward(square(grad), x, x, p, square(pdist))


def _conj_physical(x: torch.Tensor) -> torch.Tensor:
    # The public conj_physical has a DTensor strategy and calls this kernel for complex
    # tensors; for real ones it is the identity (a copy here, as the kernel returns).
    # Rebuilding the value from real and -imag parts instead would go through
    # view_as_complex, whose rule asks for even shards and passes no Partial.
    if not x.is_complex():
        return aten.clone.default(x)
    return aten.conj_physical.default(x)


def _hash_tensor(x: torch.Tensor, dim: list[int] | None = None, *, keepdim: bool = False,
                 mode: int = 0) -> torch.Tensor:
    # mode 0 (the only one): each element widened to its 64-bit float or integer type,
    # its bits read as uint64, xor-ed over `dim` (every dim when empty). The xor is a
    # halving tree of bitwise_xor over the reduced dims gathered last, so the dims left
    # keep their shards; a reduced dim cannot (there is no Partial for xor).
    if mode != 0:
        raise RuntimeError(f"Unknown hash_tensor mode: {mode}")
    if x.dtype.is_complex or x.dtype in (torch.uint16, torch.uint32, torch.uint64) or x.element_size() == 1 and \
            x.dtype.is_floating_point:
        raise NotImplementedError(f'"xor_sum_cpu" not implemented for {x.dtype}')
    rank = max(x.dim(), 1)
    if any(not -rank <= d < rank for d in dim or ()):
        raise IndexError(f"Dimension out of range (expected to be in range of [{-rank}, {rank - 1}], but got {dim})")
    dims = sorted({d % rank for d in dim}) if dim else list(range(x.dim()))
    if not dim and x.numel() == 0:
        raise RuntimeError("hash_tensor: Expected reduction dim to be specified for input.numel() == 0. "
                           "Specify the reduction dim with the 'dim' argument.")
    for d in dim or dims:
        if x.dim() and x.shape[d] == 0:
            raise IndexError(f"hash_tensor: Expected reduction dim {d} to have non-zero size.")
    if x.dtype.is_floating_point:
        bits = aten.view.dtype(x.to(torch.float64), torch.int64)
    else:
        bits = x.to(torch.int64)  # sign-extends signed types, zero-extends uint8 and bool, as the kernel
    if x.dim() == 0:
        bits = aten.unsqueeze.default(bits, 0)
        dims, keep_shape = [0], []
    else:
        keep_shape = [1 if d in dims else n for d, n in enumerate(x.shape)] if keepdim else \
            [n for d, n in enumerate(x.shape) if d not in dims]
    kept = [d for d in range(bits.dim()) if d not in dims]
    bits = aten.permute.default(bits, kept + dims)
    count = math.prod(bits.shape[len(kept):])
    bits = aten.reshape.default(bits, [bits.shape[d] for d in range(len(kept))] + [count])
    left = None  # the odd ones out, xor-ed on the side (padding's rule asks for even shards)
    while bits.shape[-1] > 1:  # count >= 1: the kernel refuses an empty reduced dim
        n = bits.shape[-1]
        if n % 2:
            last = aten.slice.Tensor(bits, -1, n - 1, n)
            left = last if left is None else aten.bitwise_xor.Tensor(left, last)
            n -= 1
        half = n // 2
        bits = aten.bitwise_xor.Tensor(aten.slice.Tensor(bits, -1, 0, half), aten.slice.Tensor(bits, -1, half, n))
    if left is not None:
        bits = aten.bitwise_xor.Tensor(bits, left)
    acc = aten.select.int(bits, -1, 0)
    return aten.view.dtype(aten.reshape.default(acc, keep_shape), torch.uint64)


SEARCH_DECOMPOSITIONS: dict[torch._ops.OpOverload, Callable] = {
    aten.searchsorted.Tensor: _searchsorted,
    aten.searchsorted.Scalar: _searchsorted_scalar,
    aten._trilinear.default: _trilinear,
    aten._pdist_forward.default: _pdist_forward,
    aten._pdist_backward.default: _pdist_backward,
    aten._conj_physical.default: _conj_physical,
    aten.hash_tensor.default: _hash_tensor,
}
