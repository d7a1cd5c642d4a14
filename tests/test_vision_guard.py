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


# ------------------------------------------------------------------ batch norm (guard_batchnorm.py)


def _bn_case(g: torch.Generator, c: int = 64) -> list[torch.Tensor]:
    x = torch.randn(8, c, 4, 4, dtype=torch.float64, generator=g)
    w, b = torch.randn(c, dtype=torch.float64, generator=g), torch.randn(c, dtype=torch.float64, generator=g)
    mean, var = torch.randn(c, dtype=torch.float64, generator=g), torch.rand(c, dtype=torch.float64, generator=g) + 0.5
    return [x, w, b, mean, var]


def _run_bn(mesh, op, training_args: tuple) -> tuple[list, list, list, list]:
    """(one device's outputs, one device's running stats after, DTensor's outputs per rank,
    DTensor's running stats per rank): input Shard(0), everything else replicated, each
    rank with its own copy of the statistics (as on real processes)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from _vision_step import _own_copies

    xs = _bn_case(torch.Generator().manual_seed(3))
    ref_stats = [xs[3].clone(), xs[4].clone()]
    ref = op(xs[0], xs[1], xs[2], *ref_stats, *training_args)
    with LocalTensorMode(4), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = [distribute_tensor(t, mesh, [Shard(0)] if i == 0 else [Replicate()]) for i, t in enumerate(xs)]
        d[3], d[4] = _own_copies(d[3], 4), _own_copies(d[4], 4)
        out = op(*d, *training_args)
        got = [_full(o) for o in out if o is not None and o.numel() > 0]
        stats = [_full(s) for s in d[3:5]]
    return [r for r in ref if r.numel() > 0], ref_stats, got, stats


BN_OPS = [
    (aten.native_batch_norm.default, (True, 0.1, 1e-5)),  # what nn.BatchNorm2d calls on CPU
    (aten._native_batch_norm_legit.default, (True, 0.1, 1e-5)),
    (aten._batch_norm_with_update.default, (0.1, 1e-5)),
]


@pytest.mark.parametrize("op,rest", BN_OPS, ids=lambda x: str(x) if isinstance(x, torch._ops.OpOverload) else None)
def test_batch_norm_training_keeps_running_stats(op, rest):
    """Batch Shard(0) on 4 ranks, 64 channels: DTensor shards the channels and moves the
    replicated running statistics to Shard(0); without the guard the kernel's in-place
    update lands on that chunk (each rank's replica gets a quarter of the channels
    updated), with it every rank's buffers equal one device's."""
    from decompshard.verify_dtensor import device_mesh

    with simulated_world(4):
        mesh = device_mesh((4,))
        for guarded in (False, True):
            decompshard.disable()
            decompshard.enable(guard_native=guarded)
            ref, ref_stats, got, stats = _run_bn(mesh, op, rest)
            for r, g in zip(ref, got):  # the outputs are right either way
                assert all(torch.allclose(v, r) for v in g.values())
            stats_ok = all(torch.allclose(v, r) for r, s in zip(ref_stats, stats) for v in s.values())
            assert stats_ok == guarded, f"guard {guarded}"
        decompshard.disable()


def test_batch_norm_eval_is_untouched():
    """Not training: nothing is updated in place, the handler runs the op as DTensor does."""
    from decompshard.verify_dtensor import device_mesh

    with simulated_world(4):
        mesh = device_mesh((4,))
        for guarded in (False, True):
            decompshard.disable()
            decompshard.enable(guard_native=guarded)
            ref, ref_stats, got, stats = _run_bn(mesh, aten.native_batch_norm.default, (False, 0.1, 1e-5))
            for r, g in zip(ref, got):
                assert all(torch.allclose(v, r) for v in g.values())
            assert all(torch.allclose(v, r) for r, s in zip(ref_stats, stats) for v in s.values())
        decompshard.disable()


def test_resnet18_dp_trains_with_one_device_numbers_and_buffers():
    """torchvision's ResNet-18 in training mode, batch Shard(0) on 4 ranks (8 rows, and 5
    rows with a mean squared error loss: 2, 2, 1, 0), guard on: the loss, every
    gradient and every BatchNorm running statistic equal one device's on every rank."""
    from torch.distributed.tensor import Shard

    from decompshard.check.ecosystem import import_torchvision
    from decompshard.verify_dtensor import device_mesh

    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.resnet18(num_classes=5)
    g = torch.Generator().manual_seed(4)
    cases = [(torch.randn(8, 3, 16, 16, dtype=torch.float64, generator=g), torch.randint(0, 5, (8,), generator=g)),
             (torch.randn(5, 3, 16, 16, dtype=torch.float64, generator=g),
              torch.randn(5, 5, dtype=torch.float64, generator=g))]
    with simulated_world(4):
        mesh = device_mesh((4,))
        decompshard.enable(guard_native=True)
        try:
            for x, y in cases:
                ref = V.reference(model, x, y)
                got = V.dtensor_step(model, x, y, mesh, [Shard(0)])
                assert V.mismatches(got, ref) == [], x.shape[0]
                assert len(got.buffers) == 40 and len(got.grads) == 62
        finally:
            decompshard.disable()


def test_efficientnet_uneven_dp_with_the_default_enable():
    """timm's test EfficientNet (convolutions, depthwise convolutions, batch norm, SiLU),
    5 rows on 4 ranks (2, 2, 1, 0), plain `enable()`: the loss, every gradient and every
    running statistic equal one device's on every rank. Without the guard DTensor's conv
    handler stops it ("expected input[5, 6, 16, 16] to have 24 channels")."""
    from torch.distributed.tensor import Shard

    from decompshard.check.ecosystem import import_timm
    from decompshard.verify_dtensor import device_mesh

    timm = import_timm()
    torch.manual_seed(0)
    model = timm.create_model("test_efficientnet", num_classes=5, pretrained=False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 3, 32, 32, dtype=torch.float64, generator=g)
    y = torch.randn(5, 5, dtype=torch.float64, generator=g)
    ref = V.reference(model, x, y)
    with simulated_world(4):
        mesh = device_mesh((4,))
        decompshard.disable()
        with decompshard.enabled():
            got = V.dtensor_step(model, x, y, mesh, [Shard(0)])
        assert V.mismatches(got, ref) == []
        assert got.buffers and len(got.grads) == len(dict(model.named_parameters()))
        with decompshard.enabled(guard_native=False):
            assert "channels" in V.dtensor_step(model, x, y, mesh, [Shard(0)]).error
