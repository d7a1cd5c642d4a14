"""The model zoo in CI: one model per family (transformers causal LM, BERT masked LM,
torchvision ResNet, a ViT) on one uneven and one 2-D sharding, one training step with
`enable()` against one device (loss, every gradient and buffer on every rank).

Cases that fail today because of a bug someone is fixing are strict xfails naming the
bug: they flip (and fail here) when the fix merges, so the mark must be removed then.
The runner itself is tested to fail: a wrong gradient, a wrong loss and a raising op
are reported as such.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from decompshard.check.model import run_training_step
from decompshard.check.zoo import ZOO, Built, build, get_entry

VIEW_STRIDES = ("uneven batch, ViT: a view after the uneven-view redistribution raises 'view size is not "
                "compatible with input tensor's size and stride' (issue 23)")

CASES = [
    ("llama", "dp-uneven", None),
    ("llama", "2d", None),
    ("bert-mlm", "2d-uneven", None),
    ("bert-mlm", "2d", None),
    # BatchNorm's running statistics: each simulated rank holds its own buffer copy
    # (`model.own_copies`), else the in-place update lands once per rank
    ("resnet", "dp-uneven", None),
    ("resnet", "2d", None),
    ("vit-hf", "dp-uneven", VIEW_STRIDES),
    ("vit-hf", "2d", None),
    ("t5", "2d", None),  # T5's layer norm computes in float32: compared at float32's tolerance
]


@pytest.fixture(scope="module")
def world():
    from decompshard.verify_dtensor import simulated_world

    with simulated_world(4):
        yield


def _case(name: str, sharding: str, why: str | None):
    marks = [pytest.mark.xfail(strict=True, reason=why)] if why else []
    return pytest.param(name, sharding, marks=marks, id=f"{name}-{sharding}")


@pytest.mark.parametrize("name,sharding", [_case(*c) for c in CASES])
def test_zoo_step_matches_one_device(world, name, sharding):
    from decompshard.check.model import SHARDINGS

    built = build(ZOO[name], SHARDINGS[sharding].batch, seed=0)
    run = run_training_step(built, sharding, enable=True, measure=False)
    assert run.verdict == "OK", f"{run.verdict} {run.op}: {run.detail}"


# ------------------------------------------------------------------ the runner can fail


class _Nudge(torch.autograd.Function):
    """Identity forward; backward adds `eps` to the gradient, only when it is a DTensor
    (the one-device run is untouched)."""

    @staticmethod
    def forward(ctx, x, eps):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        from torch.distributed.tensor import DTensor

        return (g + _NUDGE["eps"] if isinstance(g, DTensor) else g), None


_NUDGE = {"eps": 0.0}


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8)
        self.b = nn.Linear(8, 3)

    def forward(self, x):
        return self.b(_Nudge.apply(F.hardswish(self.a(x)), 0.0))


def _tiny(loss_scale_on_dtensor: float = 1.0) -> Built:
    from torch.distributed.tensor import DTensor

    torch.manual_seed(0)
    model = _Tiny().to(torch.float64)

    def loss(m, inputs):
        out = F.mse_loss(m(inputs["x"]), inputs["y"])
        return out * loss_scale_on_dtensor if isinstance(out, DTensor) else out

    inputs = {"x": torch.randn(8, 6, dtype=torch.float64), "y": torch.randn(8, 3, dtype=torch.float64)}
    return Built(model, inputs, loss, {"a": "colwise", "b": "rowwise"})


@pytest.mark.parametrize("sharding", ["dp", "2d"])
def test_a_perturbed_gradient_is_wrong(world, sharding, monkeypatch):
    ok = run_training_step(_tiny(), sharding, enable=True, measure=False)
    assert ok.verdict == "OK", ok.detail
    monkeypatch.setitem(_NUDGE, "eps", 1e-6)
    bad = run_training_step(_tiny(), sharding, enable=True, measure=False)
    assert bad.verdict == "WRONG"
    # the loss is untouched (forward is the identity); the layer before the nudge is not
    assert bad.detail.startswith("grad a."), bad.detail


def test_a_perturbed_loss_is_wrong(world):
    bad = run_training_step(_tiny(loss_scale_on_dtensor=1 + 1e-5), "2d-uneven", enable=True, measure=False)
    assert bad.verdict == "WRONG" and bad.detail.startswith("loss"), bad.detail


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
