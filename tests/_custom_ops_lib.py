"""Custom ops as users write them around fused kernels, for the custom-op tests and the
CLI tests (`--import tests._custom_ops_lib`).

- `dstest_lib::rmsnorm`: x * rsqrt(mean(x^2) + eps) * w; its register_autograd backward
  calls another custom op (`rmsnorm_backward`), so the backward pass dispatches a custom
  op that has no strategy either.
- `dstest_lib::rotary`: rotary position embedding of q and k (the rotate_half form), cos
  and sin given as [batch, seq, head_dim] tables, unsqueezed at `unsqueeze_dim` (2 for
  q/k laid out [b, s, h, d], 1 for [b, h, s, d]), as transformers' apply_rotary_pos_emb.
- `dstest_lib::swiglu`: silu(x @ w_gate) * (x @ w_up), with a plain-torch backward.
- `dstest_lib::silu_mul`: the elementwise form silu(a) * b.
- `dstest_lib::np_rotary`: the same rotary, opaque: its kernel is numpy (stands for a
  C++/Triton kernel); `np_rotary_reference`, its plain-torch twin, is registered at import.
  Its register_autograd backward is an opaque custom op too (`np_rotary_backward`),
  with its own registered reference.
- `dstest_lib::loop_scale`: opaque too, a Python loop over .tolist(); no reference.

`build_model` returns a small model that calls rmsnorm, rotary and swiglu, for
`coverage --model tests._custom_ops_lib:build_model`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import decompshard

# ------------------------------------------------------------------ rmsnorm


@torch.library.custom_op("dstest_lib::rmsnorm", mutates_args=())
def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@rmsnorm.register_fake
def _(x, w, eps):
    return torch.empty_like(x)


@torch.library.custom_op("dstest_lib::rmsnorm_backward", mutates_args=())
def rmsnorm_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad x, grad w): grad w sums over every leading dim, so a batch-sharded x gives a
    partial grad w (derived: Partial(sum), reduced only when someone needs it whole)."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    gw = g * w
    gx = r * gw - x * r.pow(3) * (gw * x).mean(-1, keepdim=True)
    return gx, (g * x * r).sum(tuple(range(x.dim() - 1)))


@rmsnorm_backward.register_fake
def _(g, x, w, eps):
    return torch.empty_like(x), torch.empty_like(w)


def _rmsnorm_setup(ctx, inputs, output):
    x, w, eps = inputs
    ctx.save_for_backward(x, w)
    ctx.eps = eps


def _rmsnorm_bwd(ctx, g):
    x, w = ctx.saved_tensors
    gx, gw = rmsnorm_backward(g, x, w, ctx.eps)
    return gx, gw, None


rmsnorm.register_autograd(_rmsnorm_bwd, setup_context=_rmsnorm_setup)


def rmsnorm_plain(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


# ------------------------------------------------------------------ rotary


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotary_plain(q, k, cos, sin, unsqueeze_dim):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@torch.library.custom_op("dstest_lib::rotary", mutates_args=())
def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rotary_plain(q, k, cos, sin, unsqueeze_dim)


@rotary.register_fake
def _(q, k, cos, sin, unsqueeze_dim):
    return torch.empty_like(q), torch.empty_like(k)


def _rotary_setup(ctx, inputs, output):
    _, _, cos, sin, unsqueeze_dim = inputs
    ctx.save_for_backward(cos, sin)
    ctx.unsqueeze_dim = unsqueeze_dim


def _rotary_bwd(ctx, gq, gk):
    """The transpose of the rotation: g * cos - rotate_half(g * sin). cos/sin get no grad."""
    cos, sin = (t.unsqueeze(ctx.unsqueeze_dim) for t in ctx.saved_tensors)
    return gq * cos - rotate_half(gq * sin), gk * cos - rotate_half(gk * sin), None, None, None


rotary.register_autograd(_rotary_bwd, setup_context=_rotary_setup)


def _from_numpy(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


@torch.library.custom_op("dstest_lib::np_rotary", mutates_args=(), device_types="cpu")
def np_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Opaque: numpy inside (cannot be traced on meta tensors)."""
    c, s = np.expand_dims(cos.numpy(), unsqueeze_dim), np.expand_dims(sin.numpy(), unsqueeze_dim)

    def rot(x):
        x1, x2 = np.split(x, 2, axis=-1)
        return x * c + np.concatenate((-x2, x1), axis=-1) * s

    return _from_numpy(rot(q.numpy())), _from_numpy(rot(k.numpy()))


@np_rotary.register_fake
def _(q, k, cos, sin, unsqueeze_dim):
    return torch.empty_like(q), torch.empty_like(k)


@torch.library.custom_op("dstest_lib::np_rotary_backward", mutates_args=(), device_types="cpu")
def np_rotary_backward(gq: torch.Tensor, gk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       unsqueeze_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """np_rotary's backward, opaque as well: g * cos - rotate_half(g * sin) in numpy."""
    c, s = np.expand_dims(cos.numpy(), unsqueeze_dim), np.expand_dims(sin.numpy(), unsqueeze_dim)

    def back(g):
        g1, g2 = np.split(g * s, 2, axis=-1)
        return g * c - np.concatenate((-g2, g1), axis=-1)

    return _from_numpy(back(gq.numpy())), _from_numpy(back(gk.numpy()))


@np_rotary_backward.register_fake
def _(gq, gk, cos, sin, unsqueeze_dim):
    return torch.empty_like(gq), torch.empty_like(gk)


@decompshard.reference(np_rotary_backward)
def np_rotary_backward_reference(gq, gk, cos, sin, unsqueeze_dim):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return gq * cos - rotate_half(gq * sin), gk * cos - rotate_half(gk * sin)


def _np_rotary_bwd(ctx, gq, gk):
    cos, sin = ctx.saved_tensors
    gq, gk = np_rotary_backward(gq, gk, cos, sin, ctx.unsqueeze_dim)
    return gq, gk, None, None, None


np_rotary.register_autograd(_np_rotary_bwd, setup_context=_rotary_setup)


@decompshard.reference(np_rotary)  # registered next to the op, as a user would
def np_rotary_reference(q, k, cos, sin, unsqueeze_dim):
    return rotary_plain(q, k, cos, sin, unsqueeze_dim)


# ------------------------------------------------------------------ SwiGLU


def swiglu_plain(x, w_gate, w_up):
    return torch.nn.functional.silu(x @ w_gate) * (x @ w_up)


@torch.library.custom_op("dstest_lib::swiglu", mutates_args=())
def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor) -> torch.Tensor:
    return swiglu_plain(x, w_gate, w_up)


@swiglu.register_fake
def _(x, w_gate, w_up):
    return x.new_empty((*x.shape[:-1], w_gate.shape[-1]))


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_bwd(ctx, g):
    x, wg, wu = ctx.saved_tensors
    h1, h2 = x @ wg, x @ wu
    sg = torch.sigmoid(h1)
    s = h1 * sg
    d2 = g * s
    d1 = g * h2 * sg * (1 + h1 * (1 - sg))
    lead = tuple(range(x.dim() - 2))  # batched x^T @ d summed over the leading dims (no flatten)

    def wgrad(d):
        return (x.mT @ d).sum(lead) if lead else x.mT @ d

    return d1 @ wg.t() + d2 @ wu.t(), wgrad(d1), wgrad(d2)


swiglu.register_autograd(_swiglu_bwd, setup_context=_swiglu_setup)


@torch.library.custom_op("dstest_lib::silu_mul", mutates_args=())
def silu_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(a) * b


@silu_mul.register_fake
def _(a, b):
    return torch.empty_like(a)


def _silu_mul_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _silu_mul_bwd(ctx, g):
    a, b = ctx.saved_tensors
    sg = torch.sigmoid(a)
    return g * b * sg * (1 + a * (1 - sg)), g * a * sg


silu_mul.register_autograd(_silu_mul_bwd, setup_context=_silu_mul_setup)


# ------------------------------------------------------------------ opaque, no reference


@torch.library.custom_op("dstest_lib::loop_scale", mutates_args=())
def loop_scale(x: torch.Tensor) -> torch.Tensor:
    """Opaque: a Python loop over the values."""
    return torch.tensor([v * 2.0 for v in x.reshape(-1).tolist()], dtype=x.dtype).reshape(x.shape)


@loop_scale.register_fake
def _(x):
    return torch.empty_like(x)


# ------------------------------------------------------------------ a model


class Block(nn.Module):
    """norm -> rotary on a q/k projection -> SwiGLU MLP, all custom ops."""

    def __init__(self, dim: int = 16, heads: int = 2, hidden: int = 24):
        super().__init__()
        self.heads = heads
        self.norm_w = nn.Parameter(torch.ones(dim))
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.w_gate = nn.Parameter(torch.randn(dim, hidden) / dim ** 0.5)
        self.w_up = nn.Parameter(torch.randn(dim, hidden) / dim ** 0.5)
        hd = dim // heads
        self.inv_freq = nn.Parameter(1.0 / (100.0 ** (torch.arange(hd) / hd)), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        h = rmsnorm(x, self.norm_w, 1e-6)
        q = self.q(h).view(b, s, self.heads, d // self.heads)
        k = self.k(h).view(b, s, self.heads, d // self.heads)
        pos = torch.ones_like(x[:, :, :1]).cumsum(1) * self.inv_freq  # [b, s, head_dim], from x: a DTensor with x
        cos, sin = pos.cos(), pos.sin()
        q, k = rotary(q, k, cos, sin, 2)
        return swiglu(h + (q * k).reshape(b, s, d), self.w_gate, self.w_up)


def build_model() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Block(), (torch.randn(2, 8, 16),)
