"""The native guard on vision layers and models (decompshard/guard_conv.py): it must
never hand DTensor's conv handlers a layout they cannot take, nor warn about a call
they compute right. Every case against one device, float64, on every simulated rank.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode

import _vision_step as V
import decompshard
from decompshard.dtensor_run import simulated_world

aten = torch.ops.aten


@pytest.fixture(scope="module")
def mesh2x2():
    from decompshard.verify_dtensor import device_mesh

    with simulated_world(4):
        yield device_mesh((2, 2))
    decompshard.disable()


def _conv_backward_args(g: torch.Generator) -> tuple:
    grad_out = torch.randn(4, 6, 5, 5, dtype=torch.float64, generator=g)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, generator=g)
    w = torch.randn(6, 3, 3, 3, dtype=torch.float64, generator=g)
    return grad_out, x, w


def _backward(grad_out, x, w):
    return aten.convolution_backward.default(grad_out, x, w, [6], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                             [True, True, True])


def _full(t) -> dict[int, torch.Tensor]:
    return dict(t.full_tensor()._local_tensors)


def _run_backward(mesh, placements) -> tuple[list[dict[int, torch.Tensor]] | None, str, list[str]]:
    from torch.distributed.tensor import distribute_tensor

    args = _conv_backward_args(torch.Generator().manual_seed(0))
    with LocalTensorMode(4), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dargs = [distribute_tensor(a, mesh, list(p)) for a, p in zip(args, placements)]
        try:
            outs = _backward(*dargs)
        except Exception as e:
            return None, f"{type(e).__name__}: {e}", []
        fulls = [_full(o) for o in outs]
    return fulls, "", [str(w.message) for w in caught if "decompshard guard" in str(w.message)]


def test_conv_backward_batch_on_both_mesh_dims(mesh2x2):
    """grad_output on [Shard(0), Shard(0)], input on [Shard(0), Replicate()]: what ViT's
    patch embedding meets on a 2x2 DP x TP mesh. DTensor's handler moves grad_output to
    the input's placements itself and computes it right; the guard used to move both to
    [Shard(0), Shard(0)] first (the strategy's cheapest), which the handler rejects."""
    from torch.distributed.tensor import Replicate, Shard

    ref = _backward(*_conv_backward_args(torch.Generator().manual_seed(0)))
    placements = [(Shard(0), Shard(0)), (Shard(0), Replicate()), (Replicate(), Replicate())]
    for guarded in (False, True):
        decompshard.disable()
        decompshard.enable(guard_native=guarded)
        fulls, err, warned = _run_backward(mesh2x2, placements)
        assert err == "", f"guard {guarded}: {err}"
        for got, want in zip(fulls, ref):
            for rank, v in got.items():
                assert v.shape == want.shape and torch.allclose(v, want), (guarded, rank)
        assert warned == [], warned  # a call the handler computes right is not "wrong results"
    decompshard.disable()


def test_conv_forward_batch_on_both_mesh_dims(mesh2x2):
    """An input on [Shard(0), Shard(0)]: the forward handler raises on its own; the guard
    moves it to [Shard(0), Replicate()] and the result matches one device."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, 5, 5, dtype=torch.float64, generator=g)
    w = torch.randn(6, 3, 3, 3, dtype=torch.float64, generator=g)
    b = torch.randn(6, dtype=torch.float64, generator=g)
    ref = torch.nn.functional.conv2d(x, w, b, padding=1)
    rep = [Replicate(), Replicate()]
    for guarded in (False, True):
        decompshard.disable()
        decompshard.enable(guard_native=guarded)
        with LocalTensorMode(4), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dx = distribute_tensor(x, mesh2x2, [Shard(0), Shard(0)])
            try:
                out = torch.nn.functional.conv2d(dx, distribute_tensor(w, mesh2x2, rep),
                                                 distribute_tensor(b, mesh2x2, rep), padding=1)
                got, err = _full(out), ""
            except Exception as e:
                got, err = {}, str(e)
        if not guarded:
            assert "already sharded" in err  # DTensor alone: loud
            continue
        assert err == "" and len(got) == 4
        assert all(torch.allclose(v, ref) for v in got.values())
    decompshard.disable()


def _vit():
    from decompshard.check.ecosystem import import_torchvision

    import_torchvision()  # transformers' vision models import it
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16, num_hidden_layers=1,
                    num_attention_heads=2, intermediate_size=32, num_labels=5)
    return ViTForImageClassification(cfg)


def _megatron(name: str, t: torch.Tensor):
    """DP x TP on a 2x2 mesh: q/k/v and fc1 column-parallel, o_proj and fc2 row-parallel."""
    from torch.distributed.tensor import Replicate, Shard

    if any(k in name for k in ("q_proj", "k_proj", "v_proj", "fc1")):
        return [Replicate(), Shard(0)]
    if name.endswith(("o_proj.weight", "fc2.weight")):
        return [Replicate(), Shard(1)]
    return None


def test_vit_dp_tp_2x2_trains_with_the_guard(mesh2x2):
    """transformers' ViTForImageClassification, batch [Shard(0), Replicate()], Megatron
    TP on the second mesh dim: loss and every gradient match one device on every rank
    with the guard on (it used to raise at convolution_backward) and off."""
    from torch.distributed.tensor import Replicate, Shard

    pytest.importorskip("transformers")
    model = _vit()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 8, 8, dtype=torch.float64, generator=g)
    y = torch.randint(0, 5, (4,), generator=g)
    ref = V.reference(model, x, y)
    for guarded in (False, True):
        decompshard.disable()
        decompshard.enable(guard_native=guarded)
        got = V.dtensor_step(model, x, y, mesh2x2, [Shard(0), Replicate()], _megatron)
        assert V.mismatches(got, ref) == [], f"guard {guarded}"
        assert len(got.grads) == len(dict(model.named_parameters()))
        assert not [w for w in got.warnings if "convolution" in w], got.warnings
    decompshard.disable()
