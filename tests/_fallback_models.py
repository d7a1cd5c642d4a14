"""A tiny model for the fall-back tests: a Linear layer, then a reflection pad (its
backward, reflection_pad1d_backward, has no DTensor strategy: `enable()` derives one)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decompshard.check.zoo import Built


class PadNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.pad(self.a(x).unsqueeze(1), (2, 1), mode="reflect").squeeze(1)


def padnet(batch: int = 8, seed: int = 0) -> Built:
    """The zoo's MODULE:CALLABLE form: (batch, seed) -> Built, float64."""
    torch.manual_seed(seed)
    model = PadNet().to(torch.float64)
    inputs = {"x": torch.randn(batch, 6, dtype=torch.float64)}
    return Built(model, inputs, lambda m, i: m(i["x"]).square().mean(), {"a": "colwise"})


def module() -> tuple[nn.Module, tuple]:
    """The `check --model MODULE:CALLABLE` form: (module, example inputs)."""
    torch.manual_seed(0)
    return PadNet(), (torch.randn(4, 6),)
