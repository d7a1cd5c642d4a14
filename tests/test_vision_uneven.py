"""Vision layers on an uneven data-parallel batch (5 rows on 4 ranks: 2, 2, 1, 0).

Reflection and replication pads (no DTensor strategy; decompshard derives theirs) decompose to `index.Tensor`
with the batch dim untouched. Torch's strategy for index states its rules without
`allow_uneven_sharding`, which decompshard reads as [even]; so on an uneven batch the
pad's batch rule was refused and the lift sharded the pad on channels, handing the
next convolution a channel-sharded tensor ("expected input[5, 2, 8, 8] to have 8
channels"). decompshard's own index rule (rules/project_rules.py) keeps the batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import _vision_step as V
import decompshard
from decompshard import derive_rules
from decompshard.verify.native_rules import run_on_dtensor
from decompshard.placements import S

aten = torch.ops.aten

PADS = [
    (aten.reflection_pad2d.default, ([1, 1, 1, 1],)),
    (aten.replication_pad2d.default, ([1, 1, 1, 1],)),
    (aten.reflection_pad1d.default, ([2, 1],)),
    (aten.replication_pad3d.default, ([1, 1, 1, 1, 1, 1],)),
]


@pytest.mark.parametrize("op,rest", PADS, ids=lambda x: str(x) if isinstance(x, torch._ops.OpOverload) else None)
def test_batch_rule_holds_for_uneven_batches(world, op, rest):
    shape = {"1d": (5, 8, 6), "2d": (5, 8, 6, 6), "3d": (5, 8, 4, 4, 4)}[str(op).split("_pad")[1][:2]]
    x = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    assert "S(0) -> S(0)" in derive_rules(op, x, *rest).as_strings()  # not "... [even]"
    with decompshard.enabled():
        for batch in (5, 3):  # 2, 2, 1, 0 and 1, 1, 1, 0 rows
            run = run_on_dtensor(op, (x[:batch], *rest), {}, (S(0),), 4)
            assert run.ok, f"{op} batch {batch}: {run.reason}"
            assert run.output_placements == ["S(0)"], (batch, run.output_placements)


class PadConvNet(nn.Module):
    """conv -> reflection pad -> conv: the pad sits between two convolutions, so its
    input has 8 channels (enough to shard on 4 ranks)."""

    def __init__(self, mode: str = "reflect") -> None:
        super().__init__()
        self.mode = mode
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.pad(F.relu(self.c1(x)), (1, 1, 1, 1), mode=self.mode)
        return self.head(self.c2(y).mean((2, 3)))


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_pad_conv_net_uneven_batch_matches_one_device(world, mode):
    """One training step, batch Shard(0) of 5 rows on 4 ranks (2, 2, 1, 0), with enable() (guard on
    and off): the loss and every gradient equal one device's on every rank."""
    from torch.distributed.tensor import Shard

    from decompshard.verify.dtensor_case import device_mesh

    torch.manual_seed(0)
    model = PadConvNet(mode)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 6, 6, dtype=torch.float64, generator=g)
    y = torch.randn(5, 5, dtype=torch.float64, generator=g)  # mse: no nll_loss on the way
    ref = V.reference(model, x, y)
    for guarded in (False, True):
        decompshard.disable()
        decompshard.enable(guard_native=guarded)
        got = V.dtensor_step(model, x, y, device_mesh((4,)), [Shard(0)])
        assert V.mismatches(got, ref) == [], f"guard {guarded}"
        assert len(got.grads) == 6
        # the pad kept the batch: nothing for the guard to move at the convolutions
        assert not [w for w in got.warnings if "convolution" in w], got.warnings
    decompshard.disable()
