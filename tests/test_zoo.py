"""The model zoo in CI: one model per family (transformers causal LM, BERT masked LM,
torchvision ResNet, a ViT) on one uneven and one 2-D sharding, one training step with
`enable()` against one device (loss, every gradient and buffer on every rank).

Every case here failed before issue 23's fixes (uneven flatten, mean loss with ignored
targets, conv handler, batch-norm statistics, a strided view after an uneven move); the
full zoo is `python bench/zoo.py`. The runner itself is tested to fail: a wrong gradient, a wrong loss and a raising op
are reported as such.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from decompshard.check.model import run_training_step
from decompshard.check.zoo import ZOO, Built, build, get_entry


CASES = [
    ("llama", "dp-uneven"),
    ("llama", "2d"),
    ("bert-mlm", "2d-uneven"),
    ("bert-mlm", "2d"),
    # BatchNorm's running statistics: each simulated rank holds its own buffer copy
    # (`model.own_copies`), else the in-place update lands once per rank
    ("resnet", "dp-uneven"),
    ("resnet", "2d"),
    ("vit-hf", "dp-uneven"),
    ("vit-hf", "2d"),
    ("t5", "2d"),  # T5's layer norm computes in float32: compared at float32's tolerance
]


@pytest.mark.parametrize("name,sharding", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_zoo_step_matches_one_device(world, name, sharding):
    from decompshard.check.model import SHARDINGS

    built = build(ZOO[name], SHARDINGS[sharding].batch, seed=0)
    run = run_training_step(built, sharding, enable=True, measure=False)
    assert run.verdict == "OK", f"{run.verdict} {run.op}: {run.detail}"


@pytest.mark.parametrize("sharding,ratio", [("dp", 1.1), ("2d", 1.25)])
def test_mixtral_batched_mm_experts_move_what_the_expert_moves(world, sharding, ratio):
    """Mixtral with batched_mm experts (each token's expert weights picked by index):
    the backward of the indexing accumulates each rank's tokens into a Partial(sum)
    weight gradient, reduced once (runtime/plans/index_put.py). Before it, dp moved 6.4x
    DDP's bytes (an all-to-all of every token's weight gradient, then all-gathers)."""
    from decompshard.check.expert_bytes import expert_bytes
    from decompshard.check.model import SHARDINGS

    built = build(ZOO["mixtral-bmm"], SHARDINGS[sharding].batch, seed=0)
    expert = expert_bytes(built, sharding).bytes
    run = run_training_step(built, sharding, enable=True)
    assert run.verdict == "OK", f"{run.verdict} {run.op}: {run.detail}"
    # no all-to-all, and no all-gather but torch 2.15's of `all()`'s 8 booleans (one per
    # sequence, batch-sharded; 2.13 reduces them as a Partial(product), 1 byte): the
    # weights' gradients are never gathered
    moved = [t for t in run.comm_top if t["collective"] in ("shard_dim_alltoall", "all_to_all_single")
             or t["collective"] == "all_gather_into_tensor" and t["bytes"] > 8]
    assert not moved, run.comm_top
    assert run.bytes <= ratio * expert, (run.bytes, expert)


# ------------------------------------------------------------------ the runner can fail


class _Nudge(torch.autograd.Function):
    """Identity forward; backward adds `eps` to the gradient, only when it is a DTensor
    or a simulated rank's local tensor (the one-device run is untouched)."""

    @staticmethod
    def forward(ctx, x, eps):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return (g + _NUDGE["eps"] if type(g) is not torch.Tensor else g), None


_NUDGE = {"eps": 0.0}


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(_Nudge.apply(F.hardswish(self.a(x)), 0.0))


def _tiny(loss_scale_on_dtensor: float = 1.0) -> Built:
    torch.manual_seed(0)
    model = _Tiny().to(torch.float64)

    def loss(m, inputs):  # scaled on DTensors and simulated ranks' local tensors only
        out = F.mse_loss(m(inputs["x"]), inputs["y"])
        return out * loss_scale_on_dtensor if type(out) is not torch.Tensor else out

    inputs = {"x": torch.randn(8, 6, dtype=torch.float64), "y": torch.randn(8, 3, dtype=torch.float64)}
    return Built(model, inputs, loss, {"a": "colwise", "b": "rowwise"})


@pytest.mark.parametrize("sharding", ["dp", "2d", "tp-local"])
def test_a_perturbed_gradient_is_wrong(world, sharding, monkeypatch):
    ok = run_training_step(_tiny(), sharding, enable=True, measure=False)
    assert ok.verdict == "OK", ok.detail
    monkeypatch.setitem(_NUDGE, "eps", 1e-6)
    bad = run_training_step(_tiny(), sharding, enable=True, measure=False)
    assert bad.verdict == "WRONG"
    # the loss is untouched (forward is the identity); the layer before the nudge is not
    assert bad.detail.startswith("grad a."), bad.detail


@pytest.mark.parametrize("sharding", ["2d-uneven", "tp-local"])
def test_a_perturbed_loss_is_wrong(world, sharding):
    bad = run_training_step(_tiny(loss_scale_on_dtensor=1 + 1e-5), sharding, enable=True, measure=False)
    assert bad.verdict == "WRONG" and bad.detail.startswith("loss"), bad.detail


# ------------------------------------------------------------------ beside torch alone


def test_tp_local_runs_on_both_paths_and_enable_communicates_no_more(world):
    """tp-local is Megatron as users write it (parallelize_module, use_local_output=True,
    the rest plain tensors): attention runs on local tensors, so torch alone runs it too.
    Both match one device; enable() makes no more collectives and bytes than torch alone."""
    from decompshard.check.model import SHARDINGS

    built = lambda: build(ZOO["llama"], SHARDINGS["tp-local"].batch, seed=0)  # noqa: E731
    mine = run_training_step(built(), "tp-local", enable=True)
    torch_alone = run_training_step(built(), "tp-local", enable=False)
    assert (mine.verdict, torch_alone.verdict) == ("OK", "OK"), (mine, torch_alone)
    assert mine.collectives and mine.bytes, mine  # the TP layers' all-reduces are counted
    assert mine.collectives <= torch_alone.collectives and mine.bytes <= torch_alone.bytes, (mine, torch_alone)


def test_tp_local_is_na_for_a_plan_megatron_styles_do_not_take(world):
    built = _tiny()
    built.plan = {"a": "qkv_colwise", "b": "rowwise"}
    run = run_training_step(built, "tp-local", enable=True, measure=False)
    assert run.verdict == "n/a" and "qkv_colwise Linear" in run.detail, run


def test_versus_torch_flags_more_communication_and_a_slow_first_step():
    from decompshard.check.zoo_run import versus_torch

    def path(c, b, first):
        return {"verdict": "OK", "collectives": c, "bytes": b, "first_s": first}

    rows = [{"model": "m", "sharding": "tp-local", "enable": path(3, 10, 1.0), "torch": path(3, 10, 1.0)},
            {"model": "m", "sharding": "tp", "enable": path(4, 10, 2.0), "torch": path(3, 10, 1.0)}]
    lines = versus_torch(rows)
    assert len(lines) == 2 and all(line.startswith("m / tp:") for line in lines), lines
    assert "MORE COMMUNICATION" in lines[0] and "2.00x" in lines[1], lines


def test_table_gives_ratios_only_where_both_paths_match_one_device():
    """A torch alone that skipped a collective (ResNet tp: WRONG, 0 bytes) is no baseline."""
    from decompshard.check.zoo_run import render

    def path(verdict, first, warm):
        return {"verdict": verdict, "detail": "", "op": "", "stage": "", "collectives": 1, "bytes": 8,
                "first_s": first, "warm_s": warm}

    rows = [{"model": "a", "sharding": "tp", "enable": path("OK", 3.0, 1.0), "torch": path("OK", 1.0, 1.0)},
            {"model": "b", "sharding": "tp", "enable": path("OK", 3.0, 1.0), "torch": path("WRONG", 1.0, 1.0)}]
    lines = render(rows).splitlines()
    header = [c.strip() for c in lines[0].split("|")]
    at = [header.index("first ratio"), header.index("warm ratio")]
    cells = {line.split("|")[1].strip(): [line.split("|")[i].strip() for i in at]
             for line in lines if line.startswith("| a ") or line.startswith("| b ")}
    assert cells == {"a": ["3.00x", "1.00x"], "b": ["-", "-"]}, cells


def test_an_op_without_a_strategy_is_an_error_naming_it(world):
    """Torch alone has no strategy for hardswish's backward (decompshard derives one)."""
    run = run_training_step(_tiny(), "dp", enable=False, measure=False)
    assert run.verdict == "ERROR" and run.op == "aten.hardswish_backward.default", run
    mine = run_training_step(_tiny(), "dp", enable=True)
    assert mine.verdict == "OK" and mine.collectives and mine.collectives > 0 and mine.bytes > 0
    assert mine.first_s > 0 and mine.warm_s > 0


def test_names_resolve():
    assert get_entry("LlamaForCausalLM") is ZOO["llama"]
    assert get_entry("LlamaConfig") is ZOO["llama"]
    assert get_entry("Qwen3Config").family == "transformers"
    with pytest.raises(ValueError, match="unknown model"):
        get_entry("nosuchmodel")


def test_every_plan_pattern_matches_and_a_stale_one_is_an_error():
    """A plan whose names a library renamed would run 'TP' fully replicated and pass:
    every zoo plan matches, and a pattern matching nothing raises."""
    from decompshard.check.zoo import plan_targets

    for name, entry in ZOO.items():
        built = build(entry, 2)
        assert plan_targets(built.model, built.plan), name
    with pytest.raises(ValueError, match="match no parameter"):
        plan_targets(_Tiny(), {"a": "colwise", "nosuch.*": "rowwise"})


def test_cli_prints_the_zoo_table():
    """`decompshard check --model NAME --sharding ...`: the table, exit 0 when enable()
    gives one-device numbers."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-m", "decompshard", "check", "--model", "vit-hf", "--sharding", "tp",
                        "--no-torch", "-j", "0", "-q"], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    row = next(line for line in p.stdout.splitlines() if line.startswith("| vit-hf"))
    assert [c.strip() for c in row.split("|")[1:4]] == ["vit-hf", "tp", "OK"], row


def test_cli_verbose_names_what_moved_the_bytes():
    """`-v`: under the table, each case's largest collectives (CommBytes.top()), each
    line naming the collective and the aten op (or the gradient redistribution) that
    issued it."""
    import os
    import re
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p = subprocess.run([sys.executable, "-m", "decompshard", "check", "--model", "vit-hf", "--sharding", "tp",
                        "--no-torch", "-j", "0", "-v", "--format", "text"], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    lines = p.stdout.splitlines()
    at = lines.index("vit-hf tp, the most bytes first:")
    listed = [ln for ln in lines[at + 1:] if ln.startswith("  ")]
    assert listed and all(re.search(r"\d+x (all_reduce|all_gather\w*|reduce_scatter\w*|\w*all_to_all\w*) +(aten\.|gradients)",
                                    ln) for ln in listed), listed
