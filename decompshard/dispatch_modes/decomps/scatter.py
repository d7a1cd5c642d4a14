"""Decompositions of the reducing scatters torch never decomposes (scatter_reduce,
scatter with reduce=, put, masked_scatter, segment_reduce).

They exist only to derive rules on meta tensors: DTensor then runs the real kernel on
local shards with the derived strategy. So they are written for what the derivation can
see, not for memory: a scatter along `dim` becomes a one-hot comparison of the index with
arange(n) (a constant), a masked copy of src, and a reduction over the index's `dim`.
Then every dim the scatter does not touch is elementwise all the way (S(k) survives), and
a sum over the index's `dim` of a src sharded there is a partial sum (the MoE combine:
`P(sum) self, S(0) index, S(0) src -> P(sum)`); max and min likewise give P(max|min).
Values must match the op for every input (every reduce, include_self, duplicate and
empty index, negative dims, integer and bool dtypes); the tests compare with the op.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten

_SCATTER_REDUCES = ("sum", "prod", "mean", "amax", "amin")


def _identity(reduce: str, dtype: torch.dtype) -> bool | int | float:
    """The value that leaves `reduce` unchanged, in `dtype`'s range (amax's -inf for
    floats, the smallest integer for integers, False for bool)."""
    if reduce in ("sum", "mean"):
        return False if dtype == torch.bool else 0
    if reduce == "prod":
        return True if dtype == torch.bool else 1
    high = reduce == "amin"
    if dtype == torch.bool:
        return high
    if dtype.is_floating_point:
        return float("inf") if high else float("-inf")
    info = torch.iinfo(dtype)
    return info.max if high else info.min


def _reduce_dim(x: torch.Tensor, reduce: str, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """`reduce` of x over `dim`, cast back to `dtype` (integer sums and products wrap the
    way the kernel's in-dtype accumulation does; bool sum is or, bool prod is and)."""
    if reduce in ("sum", "mean"):
        out = aten.sum.dim_IntList(x, [dim])
    elif reduce == "prod":
        out = aten.prod.dim_int(x, dim)
    elif reduce == "amax":
        out = aten.amax.default(x, [dim])
    else:
        out = aten.amin.default(x, [dim])
    return out if out.dtype == dtype else out.to(dtype)


def _combine(a: torch.Tensor, b: torch.Tensor, reduce: str) -> torch.Tensor:
    """a `reduce` b elementwise (bool: or for sum, and for prod, as the kernel's + and *)."""
    if reduce == "sum":
        return aten.logical_or.default(a, b) if a.dtype == torch.bool else aten.add.Tensor(a, b)
    if reduce == "prod":
        return aten.logical_and.default(a, b) if a.dtype == torch.bool else aten.mul.Tensor(a, b)
    if reduce == "amax":
        return aten.maximum.default(a, b)
    return aten.minimum.default(a, b)


def _region(x: torch.Tensor, shape: list[int], dim: int) -> torch.Tensor:
    """x cut down to `shape` in every dim but `dim` (the part of self a smaller index reaches)."""
    for k, n in enumerate(shape):
        if k != dim and n != x.shape[k]:
            x = aten.slice.Tensor(x, k, 0, n)
    return x


def _put_region(base: torch.Tensor, part: torch.Tensor, dim: int, first: int = 0) -> torch.Tensor:
    """base with `part` written over its leading corner (dims other than `dim` may be
    shorter in part): per shorter dim, part cat the rest of base, nested. cat rather than
    slice_scatter, whose DTensor strategy has no Partial rule (cat passes P through)."""
    for k in range(first, base.dim()):
        n = part.shape[k]
        if k != dim and n != base.shape[k]:
            inner = _put_region(aten.slice.Tensor(base, k, 0, n), part, dim, k + 1)
            return aten.cat.default([inner, aten.slice.Tensor(base, k, n, base.shape[k])], k)
    return part


def scatter_reduce_two(self: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor,
                       reduce: str, *, include_self: bool = True) -> torch.Tensor:
    """aten.scatter_reduce.two: out[..., index[i], ...] reduce= src[..., i, ...] along dim.

    One-hot form: hit[..., i, j, ...] = index[..., i, ...] == j (j over self's `dim`,
    placed right after the index's `dim`), src masked to the identity where not hit, then
    reduced over the index's `dim`. The positions of self outside the index's extent in
    other dims are left as they are (cat with the rest of self), as the kernel does."""
    if reduce not in _SCATTER_REDUCES:
        return NotImplemented
    if min(self.dim(), index.dim(), src.dim()) == 0:  # the kernel reads a 0-d tensor as 1-element 1-d
        self1, index1, src1 = (aten.reshape.default(t, [1]) if t.dim() == 0 else t for t in (self, index, src))
        out = scatter_reduce_two(self1, dim, index1, src1, reduce, include_self=include_self)
        return aten.reshape.default(out, []) if self.dim() == 0 else out
    d = dim % self.dim()
    if index.numel() == 0:
        return aten.clone.default(self)
    shape = list(index.shape)
    if list(src.shape) != shape:
        src = _region(src, shape, -1)
    n = self.shape[d]
    dtype = self.dtype
    targets = aten.arange.default(n, dtype=index.dtype, device=index.device)
    targets = aten.view.default(targets, [n] + [1] * (len(shape) - d - 1))
    hit = aten.eq.Tensor(aten.unsqueeze.default(index, d + 1), targets)  # shape[:d+1] + [n] + shape[d+1:]
    spread = aten.unsqueeze.default(src.to(dtype), d + 1)
    fill = aten.full.default([], _identity(reduce, dtype), dtype=dtype, device=self.device)
    reduced = _reduce_dim(aten.where.self(hit, spread, fill), reduce, d, dtype)  # shape with n at d
    base = _region(self, shape, d)
    if reduce == "mean":
        out = _mean(base, reduced, hit, d, include_self)
    elif include_self:  # the identity where nothing lands leaves self as it is
        out = _combine(base, reduced, reduce)
    else:
        out = aten.where.self(aten.any.dim(hit, d), reduced, base)
    return _put_region(self, out, d)


def _mean(base: torch.Tensor, total: torch.Tensor, hit: torch.Tensor, d: int,
          include_self: bool) -> torch.Tensor:
    """The kernel's mean: (self if include_self) + sum of src, over the count of terms
    (a count of 0 taken as 1, so untouched positions keep self); integers floor-divide.
    The count is kept in self's dtype as the kernel keeps it, so an integer count wraps
    the same way (200 hits in int8 divide by -56; 1 + 255 in uint8 is 0, taken as 1).
    A float16/bfloat16 count is rounded once here where the kernel adds ones one by one
    (which stalls at 2048 / 256): past that many hits on one slot the values differ, not
    the rules (DTensor runs the kernel)."""
    count = aten.sum.dim_IntList(hit, [d]).to(base.dtype)
    if include_self:
        total = aten.add.Tensor(base, total)
        count = aten.add.Scalar(count, 1)
    else:
        total = aten.where.self(aten.any.dim(hit, d), total, base)
    count = aten.masked_fill.Scalar(count, aten.eq.Scalar(count, 0), 1)
    if base.dtype.is_floating_point or base.dtype.is_complex:
        return aten.div.Tensor(total, count)
    return aten.div.Tensor_mode(total, count, rounding_mode="floor")


def scatter_reduce_legacy(self: torch.Tensor, dim: int, index: torch.Tensor, src: torch.Tensor,
                          *, reduce: str) -> torch.Tensor:
    """aten.scatter.reduce: reduce='add' | 'multiply' is scatter_reduce's sum | prod with self."""
    mode = {"add": "sum", "multiply": "prod"}.get(reduce)
    if mode is None:
        return NotImplemented
    return scatter_reduce_two(self, dim, index, src, mode, include_self=True)


def scatter_value_reduce(self: torch.Tensor, dim: int, index: torch.Tensor, value: bool | int | float,
                         *, reduce: str) -> torch.Tensor:
    """aten.scatter.value_reduce: a scalar src, converted to self's dtype as the kernel does.
    full_like(index) rather than a constant, so src is laid out like index (a sharded index
    keeps S(k) and the partial count of an add)."""
    src = aten.full_like.default(index, value, dtype=self.dtype)
    return scatter_reduce_legacy(self, dim, index, src, reduce=reduce)


def put(self: torch.Tensor, index: torch.Tensor, source: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """aten.put on self flattened. accumulate=True is a sum-scatter of source into self
    (index wrapped to >= 0 as put does), so a source sharded with its index gives a partial
    sum; accumulate=False is index_put (a write: which duplicate wins is the kernel's)."""
    flat = aten.reshape.default(self, [-1])
    idx = aten.reshape.default(index, [-1])
    src = aten.reshape.default(source, [-1])
    if idx.numel() == 0:
        return aten.clone.default(self)
    if accumulate:
        wrapped = aten.remainder.Scalar(idx, flat.numel())  # put's range is [-numel, numel)
        out = scatter_reduce_two(flat, 0, wrapped, src, "sum", include_self=True)
    else:
        out = aten.index_put.default(flat, [idx], src, False)
    return aten.view.default(out, list(self.shape))


def masked_scatter(self: torch.Tensor, mask: torch.Tensor, source: torch.Tensor) -> torch.Tensor:
    """aten.masked_scatter: the k-th True of the (broadcast) mask, in row-major order,
    takes source's k-th element. The k is a cumsum of the mask; the copy is a gather of
    source at those positions and a where over self."""
    shape = list(torch.broadcast_shapes(self.shape, mask.shape))
    base = aten.reshape.default(aten.expand.default(self, shape), [-1])
    if source.numel() == 0:  # then no element is taken (the op refuses a True mask)
        return aten.view.default(aten.clone.default(base), shape)
    m = aten.reshape.default(aten.expand.default(mask, shape), [-1])
    pos = aten.clamp_min.default(aten.sub.Tensor(aten.cumsum.default(m, 0), 1), 0)
    picked = aten.index_select.default(aten.reshape.default(source, [-1]), 0, pos)
    return aten.view.default(aten.where.self(m, picked, base), shape)


_SEGMENT_REDUCES = {"sum": "sum", "mean": "mean", "prod": "prod", "max": "amax", "min": "amin"}


def segment_reduce(data: torch.Tensor, reduce: str, *, lengths: torch.Tensor | None = None,
                   indices: torch.Tensor | None = None, offsets: torch.Tensor | None = None,
                   axis: int = 0, unsafe: bool = False, initial: float | None = None) -> torch.Tensor:
    """aten.segment_reduce: segment s of `axis` is [start_s, end_s), from lengths (a cumsum)
    or offsets; member[..., s, i] = start_s <= i < end_s is the one-hot, data masked to the
    identity outside it and reduced over `axis`. `initial` starts every segment (an empty one
    is just `initial`); an empty mean without it is 0/0 = NaN, as the kernel gives."""
    mode = _SEGMENT_REDUCES.get(reduce)
    if mode is None or indices is not None or (lengths is None) == (offsets is None):
        return NotImplemented  # the kernel has no `indices` path either
    a = axis % data.dim()
    n = data.shape[a]
    # Dims written non-negative: DTensor's cumsum strategy takes a negative dim for
    # another dim and lets S(0) through cumsum(x, -1) of a 1-d x (torch 2.13).
    last = a  # lengths / offsets are data.shape[:a] + [segments]
    if offsets is not None:
        m = offsets.shape[last] - 1
        start = aten.slice.Tensor(offsets, last, 0, m)
        end = aten.slice.Tensor(offsets, last, 1, m + 1)
    else:
        end = aten.cumsum.default(lengths, last)
        start = aten.sub.Tensor(end, lengths)
    pos = aten.arange.default(n, dtype=end.dtype, device=data.device)
    member = aten.logical_and.default(aten.le.Tensor(aten.unsqueeze.default(start, last + 1), pos),
                                      aten.lt.Tensor(pos, aten.unsqueeze.default(end, last + 1)))
    trail = data.dim() - a - 1
    member = aten.view.default(member, list(member.shape) + [1] * trail)  # [..., S, N, 1...]
    spread = aten.unsqueeze.default(data, a)  # [..., 1, N, ...]
    fill = aten.full.default([], _identity(mode, data.dtype), dtype=data.dtype, device=data.device)
    out = _reduce_dim(aten.where.self(member, spread, fill), mode, a + 1, data.dtype)
    if mode == "mean":
        count = aten.sum.dim_IntList(member, [a + 1]).to(data.dtype)
        if initial is None:
            return aten.div.Tensor(out, count)
        total = aten.add.Scalar(out, initial)
        return aten.where.self(aten.gt.Scalar(count, 0), aten.div.Tensor(total, count),
                               aten.full_like.default(out, initial))
    if initial is None:
        return out
    return _combine(out, aten.full_like.default(out, initial), mode)


DECOMPOSITIONS = {
    aten.scatter_reduce.two: scatter_reduce_two,
    aten.scatter.reduce: scatter_reduce_legacy,
    aten.scatter.value_reduce: scatter_value_reduce,
    aten.put.default: put,
    aten.masked_scatter.default: masked_scatter,
    aten.segment_reduce.default: segment_reduce,
}
