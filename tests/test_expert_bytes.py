"""The expert's bytes the zoo prints beside enable()'s (decompshard/check/expert_bytes.py),
counted by hand here for small models whose every collective an expert would write down."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from decompshard.check.expert_bytes import expert_bytes
from decompshard.check.zoo import ZOO, Built, build

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


def test_two_blocks_each_count_their_input_even_when_the_first_is_freed():
    """Under no_grad the first block's input is freed before the second's is made, and
    Python may give the new tensor the old one's id: each is still counted (GPT-2's
    count missed its MLP input that way)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(6), nn.Linear(6, 8), nn.Linear(8, 6),
                          nn.LayerNorm(6), nn.Linear(6, 8), nn.Linear(8, 3)).double()
    inputs = {"x": torch.randn(8, 6, dtype=torch.float64), "y": torch.randn(8, 3, dtype=torch.float64)}
    plan = {"1": "colwise", "2": "rowwise", "4": "colwise", "5": "rowwise"}
    built = Built(model, inputs, lambda m, i: F.mse_loss(m(i["x"]), i["y"]), plan)
    assert expert_bytes(built, "tp").bytes == (8 * 6 + 8 * 6 + 8 * 6 + 8 * 3) * F64


class _Experts(nn.Module):
    """Mixtral's layout: raw [experts, 2 x hidden, in] and [experts, out, hidden] weights,
    each token through its top-k experts, weighted."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(3, 2 * 4, 6))
        self.down = nn.Parameter(torch.randn(3, 6, 4))

    def forward(self, x, idx, w):
        out = torch.zeros_like(x)
        for k in range(idx.shape[1]):
            gate, up = torch.einsum("ti,toi->to", x, self.gate_up[idx[:, k]]).chunk(2, dim=-1)
            y = torch.einsum("th,toh->to", F.silu(gate) * up, self.down[idx[:, k]])
            out = out + y * w[:, k, None]
        return out


class _Moe(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(6, 3, bias=False)
        self.experts = _Experts()

    def forward(self, x):
        w, idx = torch.softmax(self.router(x), -1).topk(2, dim=-1)
        return self.experts(x, idx, w)


def test_raw_experts_are_one_megatron_mlp_per_block():
    """Experts sharded on their hidden dim: the block's output all-reduced forward [8, 6];
    backward, its input gradient [8, 6] and the routing weights' [8, 2] (each a sum over
    the sharded hidden dim)."""
    torch.manual_seed(0)
    inputs = {"x": torch.randn(8, 6, dtype=torch.float64), "y": torch.randn(8, 6, dtype=torch.float64)}
    plan = {"experts.gate_up": "packed_colwise", "experts.down": "rowwise"}
    built = Built(_Moe().double(), inputs, lambda m, i: F.mse_loss(m(i["x"]), i["y"]), plan)
    assert expert_bytes(built, "tp").bytes == (8 * 6 + 8 * 6 + 8 * 2) * F64


# ------------------------------------------------------------------ against torch's own Megatron


def _torchtitan_inputs(name: str) -> dict:
    """PrepareModuleInput on the blocks whose layers read one tensor (torchtitan's plan):
    the block's input becomes one replicated DTensor, so q/k/v (gate/up) share its
    input-gradient all-reduce."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import PrepareModuleInput

    if name == "llama":  # LlamaDecoderLayer calls self_attn(hidden_states=...), mlp(x)
        positional = PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),))
        keyword = PrepareModuleInput(input_kwarg_layouts={"hidden_states": Replicate()},
                                     desired_input_kwarg_layouts={"hidden_states": Replicate()})
        return {"model.layers.*.self_attn": keyword, "model.layers.*.mlp": positional}
    # ViTLayer calls attention(x, mask): the mask left as it is
    return {"vit.layers.*.attention": PrepareModuleInput(input_layouts=(Replicate(), None),
                                                         desired_input_layouts=(Replicate(), None))}


@pytest.mark.parametrize("name", ["llama", "vit-hf"])
def test_the_megatron_count_is_what_torchs_own_megatron_moves(world, name):
    """The yardstick tied to a measurement: torch alone running Megatron with local
    outputs and the blocks' inputs shared moves exactly the count."""
    from decompshard.check.model import SHARDINGS, run_training_step

    built = build(ZOO[name], SHARDINGS["tp-local"].batch)
    built.megatron_inputs = _torchtitan_inputs(name)
    run = run_training_step(built, "tp-local", enable=False)
    assert run.verdict == "OK", run.detail
    assert run.bytes == expert_bytes(built, "tp-local").bytes


def test_colwise_parallel_alone_makes_one_all_reduce_per_projection(world):
    """Without the shared block inputs (the zoo's tp-local, transformers' own plan),
    torch's Megatron all-reduces q's, k's and v's input gradient separately, and gate's
    and up's: three activations [8, 8, 32] more than the count (Llama: 112 KiB, 64 KiB)."""
    from decompshard.check.model import SHARDINGS, run_training_step

    built = build(ZOO["llama"], SHARDINGS["tp-local"].batch)
    run = run_training_step(built, "tp-local", enable=False)
    assert run.verdict == "OK", run.detail
    assert run.bytes - expert_bytes(built, "tp-local").bytes == 3 * 8 * 8 * 32 * F64
