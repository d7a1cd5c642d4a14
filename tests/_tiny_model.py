"""A tiny model for `decompshard coverage --model` tests: its forward + backward hit native
ops (linear's addmm/t, view), decomp-only ops decompshard derives (pixel_shuffle and, in
backward, pixel_unshuffle; addmv) — so an audit shows more than one status."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 36)
        self.w = torch.nn.Parameter(torch.randn(8, 36))
        self.b = torch.nn.Parameter(torch.randn(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.pixel_shuffle(self.lin(x).reshape(-1, 9, 2, 2), 3)  # (N, 1, 6, 6)
        v = y.sum(0).flatten()  # (36,)
        return torch.addmv(self.b, self.w, v)


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return Tiny()


def build_with_inputs() -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return Tiny(), (torch.randn(2, 16),)


def not_a_model() -> int:
    return 3
