"""Small models for `decompshard check --model` tests: a transformer block (attention
through CPU flash attention, layer norm, GELU MLP) and a conv net."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.out(a)
        return x + self.mlp(self.norm2(x))


class ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.hardswish(self.conv(F.pad(x, (1, 1, 1, 1), mode="reflect")))
        return self.head(y.mean((2, 3)))


def block() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return Block(), (torch.randn(4, 6, 16),)


def convnet() -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return ConvNet(), (torch.randn(5, 3, 6, 6),)
