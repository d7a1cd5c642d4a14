"""The expert's bytes the zoo prints beside enable()'s (decompshard/check/expert_bytes.py),
counted by hand here for small models whose every collective an expert would write down."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from decompshard.check.expert_bytes import expert_bytes
from decompshard.check.zoo import Built

F64 = 8  # bytes per float64


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(F.relu(self.a(x)))


def _mlp() -> Built:
    torch.manual_seed(0)
    inputs = {"x": torch.randn(8, 6, dtype=torch.float64), "y": torch.randn(8, 3, dtype=torch.float64)}
    return Built(_Mlp().double(), inputs, lambda m, i: F.mse_loss(m(i["x"]), i["y"]), {"a": "colwise", "b": "rowwise"})


def test_ddp_is_every_gradient_once():
    assert expert_bytes(_mlp(), "dp").bytes == (6 * 8 + 8 + 8 * 3 + 3) * F64
    assert expert_bytes(_mlp(), "dp-uneven").bytes == (6 * 8 + 8 + 8 * 3 + 3) * F64


def test_megatron_is_the_row_parallel_output_forward_and_the_column_parallel_input_backward():
    """b's output [8, 3] all-reduced forward, a's input gradient [8, 6] backward."""
    assert expert_bytes(_mlp(), "tp").bytes == (8 * 3 + 8 * 6) * F64


def test_2d_is_ddp_of_the_tp_shards_plus_megatron_on_half_the_batch():
    ddp = (6 * 8 // 2 + 8 // 2 + 8 * 3 // 2 + 3) * F64  # b's bias is replicated under rowwise
    megatron = (4 * 3 + 4 * 6) * F64
    assert expert_bytes(_mlp(), "2d").bytes == ddp + megatron


def test_sync_batch_norm_statistics_are_counted_in_data_parallel():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4), nn.Flatten(), nn.Linear(4 * 2 * 2, 2)).double()
    inputs = {"x": torch.randn(8, 3, 2, 2, dtype=torch.float64), "y": torch.randn(8, 2, dtype=torch.float64)}
    built = Built(model, inputs, lambda m, i: F.mse_loss(m(i["x"]), i["y"]))
    params = (3 * 4 + 4) + (4 + 4) + (16 * 2 + 2)
    assert expert_bytes(built, "dp").bytes == params * F64 + 4 * 4 * F64  # 2C forward + 2C backward


def test_the_zoo_table_prints_the_expert_and_the_ratio():
    from decompshard.check.zoo_run import render

    run = {"verdict": "OK", "detail": "", "op": "", "stage": "", "collectives": 3, "bytes": 3000,
           "first_s": 1.0, "warm_s": 1.0, "expert_bytes": 2000, "expert_note": ""}
    lines = render([{"model": "m", "sharding": "dp", "enable": run, "torch": None}]).splitlines()
    header = [c.strip() for c in lines[0].split("|")]
    row = [c.strip() for c in next(line for line in lines if line.startswith("| m ")).split("|")]
    assert row[header.index("expert's bytes")] == "2 KiB" and row[header.index("enable() / expert")] == "1.50x"
