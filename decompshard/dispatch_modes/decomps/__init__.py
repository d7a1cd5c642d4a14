"""Decompositions decompshard registers for ops torch has none for.

Each entry is plain torch code over aten ops that do have rules; the tracer looks here
last (after torch's decomposition table and CompositeImplicitAutograd).
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from decompshard._compat import torch_decomposition
from decompshard.dispatch_modes.decomps import scatter, search
from decompshard.dispatch_modes.decomps.distance import cdist_backward, cdist_forward

aten = torch.ops.aten


def _addbmm(self, batch1, batch2, *, beta=1, alpha=1):
    # addbmm = beta * self + alpha * sum_b(batch1[b] @ batch2[b])
    prod = aten.sum.dim_IntList(aten.bmm.default(batch1, batch2), [0])
    if beta == 0:
        return aten.mul.Tensor(prod, alpha)
    return aten.add.Tensor(aten.mul.Tensor(self, beta), prod, alpha=alpha)


def _sdpa_flash_cpu_backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal,
                             *, attn_mask=None, scale=None):
    # CPU flash attention's backward (layout [B, H, L, E], logsumexp [B, H, L]), written
    # as the kernel computes it: probabilities from the forward's logsumexp, the softmax
    # correction from the forward's output. Reading `out` and `logsumexp` matters: DTensor
    # runs the real kernel on local shards of them, so they must be sharded like query.
    if dropout_p != 0.0:
        return NotImplemented  # the mask of the forward's dropout is not an input
    L, S, E = query.shape[-2], key.shape[-2], query.shape[-1]
    sc = scale if scale is not None else 1.0 / math.sqrt(E)
    hq, hk = query.shape[1], key.shape[1]
    group = hq // hk
    k, v = key, value
    if group != 1:  # grouped-query attention: each key/value head serves `group` heads
        k = aten.repeat_interleave.self_int(key, group, 1)
        v = aten.repeat_interleave.self_int(value, group, 1)
    scores = aten.mul.Scalar(torch.matmul(query, aten.transpose.int(k, -2, -1)), sc)
    if is_causal:
        keep = torch.ones(L, S, dtype=torch.bool, device=query.device).tril()
        scores = aten.masked_fill.Scalar(scores, aten.logical_not.default(keep), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = aten.masked_fill.Scalar(scores, aten.logical_not.default(attn_mask), float("-inf"))
        else:
            scores = aten.add.Tensor(scores, attn_mask)
    probs = aten.exp.default(aten.sub.Tensor(scores, aten.unsqueeze.default(logsumexp, -1)))
    probs = probs.to(query.dtype)
    grad_v = torch.matmul(aten.transpose.int(probs, -2, -1), grad_out)
    grad_p = torch.matmul(grad_out, aten.transpose.int(v, -2, -1))
    delta = aten.sum.dim_IntList(aten.mul.Tensor(grad_out, out), [-1], True)
    grad_s = aten.mul.Tensor(probs, aten.sub.Tensor(grad_p, delta))
    grad_q = aten.mul.Scalar(torch.matmul(grad_s, k), sc)
    grad_k = aten.mul.Scalar(torch.matmul(aten.transpose.int(grad_s, -2, -1), query), sc)
    if group != 1:
        b = key.shape[0]
        grad_k = aten.sum.dim_IntList(aten.view.default(grad_k, [b, hk, group, S, E]), [2])
        grad_v = aten.sum.dim_IntList(aten.view.default(grad_v, [b, hk, group, S, value.shape[-1]]), [2])
    return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype)


def _unfold(x, dimension, size, step):
    # Windows gathered with a constant index instead of torch's as_strided view: the
    # as_strided form is layout-dependent, so no Partial or Shard rule can pass it.
    if x.dim() == 0:
        return NotImplemented
    dim = dimension % x.dim()
    n_windows = (x.shape[dim] - size) // step + 1
    starts = aten.mul.Tensor(aten.arange.default(n_windows, device=x.device), step)
    idx = aten.add.Tensor(aten.unsqueeze.default(starts, 1), aten.arange.default(size, device=x.device))
    picked = aten.index_select.default(x, dim, aten.reshape.default(idx, [-1]))
    shape = list(x.shape[:dim]) + [n_windows, size] + list(x.shape[dim + 1:])
    windows = aten.view.default(picked, shape)
    order = list(range(dim + 1)) + list(range(dim + 2, len(shape))) + [dim + 1]
    return aten.permute.default(windows, order)


def _complex(real, imag):
    # torch's decomposition writes real and imag into views of an empty complex tensor
    # (copy_ through view_as_real), which the SSA trace refuses; stacking is the same
    # value with no aliasing.
    shape = torch.broadcast_shapes(real.shape, imag.shape)
    pair = aten.stack.default([aten.expand.default(real, shape), aten.expand.default(imag, shape)], -1)
    return aten.view_as_complex.default(pair)


def _polar(abs, angle):
    return _complex(aten.mul.Tensor(abs, aten.cos.default(angle)), aten.mul.Tensor(abs, aten.sin.default(angle)))


def _strided_positions(x, size, stride, storage_offset, *, unique: bool):
    """as_strided(x, size, stride, offset) as a flat index into x, when that is what it is:
    x contiguous from its storage's start, every addressed position one of x's own
    elements, and (for a scatter) no position addressed twice. Then the op is a gather or
    a scatter with a constant index, which passes any Partial through. The positions are
    built from arange like _unfold's, so the trace records them as constants. None when
    the view reaches outside x's elements or overlaps itself: the caller falls back to
    torch's as_strided decomposition, which gets no Partial rule (refuse, not guess).

    The runtime contract is that each rank's local tensor starts at storage offset 0
    with the global strides (the strategy is keyed on them); the implied all-Replicate
    rule of any as_strided op rests on the same contract."""
    offset = x.storage_offset() if storage_offset is None else storage_offset
    size, stride = list(size), list(stride)
    if not x.is_contiguous() or x.storage_offset() != 0 or len(size) != len(stride) or offset < 0:
        return None
    if any(n < 0 for n in size) or any(st < 0 for st in stride):
        return None
    if math.prod(size) == 0:
        return None
    if offset + sum((n - 1) * st for n, st in zip(size, stride)) >= x.numel():
        return None  # reads past x's own elements
    if unique:  # sufficient for no overlap: each stride clears every finer dim's reach
        reach = 0
        for n, st in sorted((p for p in zip(size, stride) if p[0] > 1), key=lambda p: p[1]):
            if st <= reach:
                return None
            reach += (n - 1) * st
    idx = aten.full.default([1] * len(size), offset, dtype=torch.int64, device=x.device)
    for d, (n, st) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[d] = n
        step = aten.mul.Tensor(aten.arange.default(n, dtype=torch.int64, device=x.device), st)
        idx = aten.add.Tensor(idx, aten.view.default(step, shape))
    return aten.reshape.default(idx, [-1])


def _as_strided_copy(x, size, stride, storage_offset=None):
    idx = _strided_positions(x, size, stride, storage_offset, unique=False)
    if idx is None:
        return torch_decomposition(aten.as_strided_copy.default)(x, size, stride, storage_offset)
    picked = aten.index_select.default(aten.reshape.default(x, [-1]), 0, idx)
    return aten.view.default(picked, list(size))


def _as_strided_scatter(self, src, size, stride, storage_offset=None):
    idx = _strided_positions(self, size, stride, storage_offset, unique=True)
    if idx is None:
        return torch_decomposition(aten.as_strided_scatter.default)(self, src, size, stride, storage_offset)
    flat = aten.index_put.default(aten.reshape.default(self, [-1]), [idx], aten.reshape.default(src, [-1]))
    return aten.view.default(flat, list(self.shape))


def _prelu_kernel(x, weight):
    # torch's where(x > 0, x, weight * x) hides that weight only ever meets x <= 0, which
    # is what makes R, P(max) -> P(min) valid. relu(x) + weight * min(x, 0) is the same
    # function for finite weights (the value DTensor computes is the real kernel's
    # anyway), and the tracer sees clamp_max(x, 0) <= 0 (dispatch_modes/signs.py).
    return aten.add.Tensor(aten.relu.default(x), aten.mul.Tensor(weight, aten.clamp_max.default(x, 0)))


def _isin(elements, test_elements, *, assume_unique=False, invert=False):
    # torch's decomposition picks a sort-based algorithm when test_elements is large next
    # to elements: a branch on sizes (so a rank's shard can take the other path) through
    # sort and searchsorted, which mix every element with every other and have no rules.
    # The broadcast comparison is the same function, and DTensor runs the real kernel on
    # each rank anyway; it keeps `elements`' layout visible (S(d), R -> S(d)).
    if elements.numel() == 0 or test_elements.ndim == 0:
        return torch_decomposition(aten.isin.Tensor_Tensor)(
            elements, test_elements, assume_unique=assume_unique, invert=invert)
    x = aten.view.default(elements, list(elements.shape) + [1] * test_elements.ndim)
    dims = list(range(-1, -test_elements.ndim - 1, -1))
    found = aten.any.dims(aten.eq.Tensor(x, test_elements), dims)
    return aten.logical_not.default(found) if invert else found


def _take(x, index):
    # torch's decomposition is `x.reshape(-1)[index]`: Python indexing, which for a 0-d
    # index reads its value (.item(): "data-dependent") instead of calling index.Tensor.
    # index.Tensor is what it calls for every other index, and the same function here.
    return aten.index.Tensor(aten.reshape.default(x, [-1]), [index])


def _linspace(op: torch._ops.OpOverload) -> Callable:
    # torch's decomposition computes start + step * i (and end - step * (n - 1 - i)) with
    # step = (end - start) / (n - 1): start enters through a subtraction, so a P(max)
    # start looks like it turns P(min) halfway. The same values are start * (1 - t) +
    # end * t with t = i / (n - 1) in [0, 1], weights the tracer sees are >= 0 (clamp),
    # so a monotone part passes: P(avg|max|min) on one end with R on the other, and
    # P(avg) or P(sum) on both. DTensor runs the real kernel; the checker judges it.
    # Integer outputs truncate, which is monotone too, but not for unsigned ones (a
    # negative value wraps), so those keep torch's form.
    # (torch's also calls torch.device(None) when no device is given, and fails.)
    def linspace(start, end, steps, *, dtype=None, layout=torch.strided, device=None,
                 pin_memory=False, requires_grad=False):
        tensors = [x for x in (start, end) if isinstance(x, torch.Tensor)]
        device = device if device is not None else tensors[0].device
        out_dtype = dtype or torch.get_default_dtype()
        if steps < 2 or out_dtype.is_complex or not out_dtype.is_signed or any(
                (isinstance(x, torch.Tensor) and x.is_complex()) or isinstance(x, complex) for x in (start, end)):
            return torch_decomposition(op)(start, end, steps, dtype=dtype, layout=layout, device=device,
                                           pin_memory=pin_memory, requires_grad=requires_grad)
        f64 = torch.float64
        i = aten.arange.default(steps, dtype=f64, device=device)
        t = aten.clamp.default(aten.div.Scalar(i, steps - 1), 0, 1)
        one_minus_t = aten.clamp.default(aten.div.Scalar(aten.rsub.Scalar(i, steps - 1), steps - 1), 0, 1)
        a, b = (aten.mul.Tensor(w, x.to(f64) if isinstance(x, torch.Tensor) else x)
                for w, x in ((one_minus_t, start), (t, end)))
        return aten.add.Tensor(a, b).to(out_dtype)

    return linspace


# Preferred over torch's own decomposition for these ops (see _unfold, _complex,
# _prelu_kernel, _strided_positions, _isin, _take, _linspace).
PROJECT_OVERRIDES: dict[torch._ops.OpOverload, Callable] = {
    aten.as_strided_copy.default: _as_strided_copy,
    aten.as_strided_scatter.default: _as_strided_scatter,
    aten._prelu_kernel.default: _prelu_kernel,
    aten.unfold.default: _unfold,
    aten.complex.default: _complex,
    aten.polar.default: _polar,
    aten.unfold_copy.default: lambda x, d, size, step: aten.clone.default(_unfold(x, d, size, step)),
    aten.isin.Tensor_Tensor: _isin,
    aten.take.default: _take,
    aten.linspace.Tensor_Tensor: _linspace(aten.linspace.Tensor_Tensor),
    aten.linspace.Tensor_Scalar: _linspace(aten.linspace.Tensor_Scalar),
    aten.linspace.Scalar_Tensor: _linspace(aten.linspace.Scalar_Tensor),
}


PROJECT_DECOMPOSITIONS: dict[torch._ops.OpOverload, Callable] = {
    aten.addbmm.default: _addbmm,
    aten._cdist_forward.default: cdist_forward,
    aten._cdist_backward.default: cdist_backward,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _sdpa_flash_cpu_backward,
    **search.SEARCH_DECOMPOSITIONS,
    **scatter.DECOMPOSITIONS,
}
