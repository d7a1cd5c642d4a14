"""The native guard on vision layers and models (decompshard/runtime/fences/conv_handlers.py): it must
never hand DTensor's conv handlers a layout they cannot take, nor warn about a call
they compute right. Every case against one device, float64, on every simulated rank.
"""

from __future__ import annotations

import warnings
from typing import Sequence

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode

import _vision_step as V
import decompshard
from decompshard.verify.dtensor_case import simulated_world

aten = torch.ops.aten


@pytest.fixture(scope="module")
def mesh2x2():
    from decompshard.verify.dtensor_case import device_mesh

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
    with the guard on (it used to raise at convolution_backward). Off, torch 2.13 matches
    too; from 2.14 torch's own convolution_backward strategy raises on the patch
    embedding's backward (its input needs no gradient: guard_masks.py), never a wrong
    number."""
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
        if not guarded and got.error:
            assert "mixes None with placements across mesh dims" in got.error, got.error
            continue
        assert V.mismatches(got, ref) == [], f"guard {guarded}"
        assert len(got.grads) == len(dict(model.named_parameters()))
        assert not [w for w in got.warnings if "convolution" in w], got.warnings
    decompshard.disable()


def _conv_case(groups: int, seed: int) -> tuple:
    """Input, weight, bias and grad_output of a 3x3 conv, 4 -> 8 channels (depthwise-like
    with groups=4: each input channel its own two filters)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 4, 5, 5, dtype=torch.float64, generator=g)
    w = torch.randn(8, 4 // groups, 3, 3, dtype=torch.float64, generator=g)
    b = torch.randn(8, dtype=torch.float64, generator=g)
    go = torch.randn(4, 8, 5, 5, dtype=torch.float64, generator=g)
    return x, w, b, go


_CONV = ([1, 1], [1, 1], [1, 1], False, [0, 0])  # stride, padding, dilation, transposed, output_padding


def _conv_outputs(op, groups: int, args: tuple) -> tuple:
    if op == "forward":
        x, w, b = args
        return (aten.convolution.default(x, w, b, *_CONV, groups),)
    go, x, w = args
    return tuple(aten.convolution_backward.default(go, x, w, [8], *_CONV, groups, [True, True, True]))


def _plain_parts(t: torch.Tensor):
    """Every rank's plain tensor inside `t` (a LocalTensor's parts can be LocalTensors)."""
    if hasattr(t, "_local_tensors"):
        for part in t._local_tensors.values():
            yield from _plain_parts(part)
    else:
        yield t


def _conv_on_mesh(mesh, op: str, groups: int, placements: Sequence[str], guarded: bool = True):
    """`op` on DTensors of the given placements (ConvNeXt-style names: "SP" is
    [Shard(0), Partial(sum)] on the 2x2 mesh; Partial parts random, summing to the value),
    against one device: (max error per output on any rank, or the error text)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    from decompshard.verify.dtensor_case import make_dtensor

    code = {"S": Shard(0), "R": Replicate(), "P": Partial(), "C": Shard(1)}
    x, w, b, go = _conv_case(groups, seed=7)
    plain = (x, w, b) if op == "forward" else (go, x, w)
    ref = _conv_outputs(op, groups, plain)
    decompshard.disable()
    decompshard.enable(guard_native=guarded)
    try:
        with LocalTensorMode(4), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dargs = tuple(make_dtensor(t, mesh, [code[c] for c in p], 0, k)
                          for k, (t, p) in enumerate(zip(plain, placements)))
            try:  # reading the outputs back is part of it: a malformed DTensor raises there
                outs = _conv_outputs(op, groups, dargs)
                fulls = [list(_plain_parts(o.full_tensor())) for o in outs]
            except Exception as e:
                return f"{type(e).__name__}: {e}"
        return [max(float((v - r).abs().max()) if v.shape == r.shape else float("inf") for v in per_rank)
                for per_rank, r in zip(fulls, ref)]
    finally:
        decompshard.disable()


def test_conv_backward_partial_input_from_a_rowwise_mlp(mesh2x2):
    """ConvNeXt on a 2x2 DP x TP mesh: the rowwise MLP leaves the residual stream on
    [Shard(0), Partial(sum)], the next block's depthwise conv (groups=C) saves it, and
    its backward meets grad_output on [Shard(0), Shard(0)]. The guard copied the
    handler's own first move (grad_output to the input's placements) and asked DTensor
    to redistribute S(0) -> P(sum): "redistributing to Partial is for internal use
    only!". DTensor alone fails too: torch 2.13 raises the same; 2.14 and 2.15 return a
    grad_input whose local tensors do not fit its spec (reading it raises "narrow
    unexpectedly changed concrete size", or gives wrong values). Now: grad_input, grad_weight and grad_bias
    match one device on every rank."""
    placements = ["SS", "SP", "RR"]  # grad_output, input, weight
    got = _conv_on_mesh(mesh2x2, "backward", 4, placements)
    assert isinstance(got, list) and max(got) < 1e-10, got
    alone = _conv_on_mesh(mesh2x2, "backward", 4, placements, guarded=False)
    # torch alone raises (2.13: Partial; 2.14/2.15 where a Partial part is a view into a
    # shared buffer: "narrow unexpectedly changed") or, on parts with storage of their
    # own, returns wrong values (2.15: errors of 12 to 947)
    wrong = isinstance(alone, list) and max(alone) > 1e-6
    assert wrong or (isinstance(alone, str) and ("Partial" in alone or "narrow unexpectedly" in alone)), alone


# Layouts a DP x TP model can hand a conv on 2x2 (S: Shard(0) of the batch, or of the
# output channels for a weight; C: Shard(1); P: Partial(sum); R: Replicate), forward
# (input, weight, bias) and backward (grad_output, input, weight), plain and groups=C.
_SPOT = [
    ("forward", 4, ["SP", "RR", "RR"]), ("forward", 4, ["PS", "RS", "RR"]), ("forward", 1, ["PP", "RP", "RP"]),
    ("forward", 1, ["SS", "SR", "RS"]), ("forward", 1, ["RC", "RR", "RR"]),
    ("backward", 4, ["SP", "SP", "RR"]), ("backward", 4, ["SS", "SP", "RS"]), ("backward", 4, ["RS", "PP", "RP"]),
    ("backward", 1, ["PS", "SR", "RR"]), ("backward", 1, ["SP", "PS", "SR"]), ("backward", 1, ["PP", "SS", "RR"]),
    ("backward", 1, ["SS", "RC", "RR"]),
]


@pytest.mark.parametrize("op,groups,placements", _SPOT, ids=lambda v: "-".join(v) if isinstance(v, list) else str(v))
def test_conv_layouts_on_2x2_match_one_device(mesh2x2, op, groups, placements):
    """With the guard on, every layout either computes one device's numbers on every
    rank or (none here) raises: never a wrong number, never a request to redistribute
    to Partial."""
    got = _conv_on_mesh(mesh2x2, op, groups, placements)
    assert isinstance(got, list) and max(got) < 1e-10, got


@pytest.mark.parametrize("sharding", ["2d", "2d-uneven"])
def test_convnext_dp_tp_2x2_zoo_step(mesh2x2, sharding):
    """timm's test ConvNeXt in the model zoo (rowwise MLP, depthwise 7x7 convs,
    downsample convs) on a 2x2 DP x TP mesh, the plain `enable()`: loss and every
    gradient equal one device's on every rank (it raised at convolution_backward)."""
    from decompshard.check.model import SHARDINGS, run_training_step
    from decompshard.check.zoo import ZOO, build

    decompshard.disable()
    built = build(ZOO["convnext"], SHARDINGS[sharding].batch, seed=0)
    run = run_training_step(built, sharding, enable=True, measure=False)
    assert run.verdict == "OK", f"{run.verdict} {run.op}: {run.detail}"


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
    from decompshard.verify.dtensor_case import device_mesh

    with simulated_world(4):
        mesh = device_mesh((4,))
        for guarded in (False, True):
            decompshard.disable()
            decompshard.enable(guard_native=guarded, plans=False)  # the fence alone
            ref, ref_stats, got, stats = _run_bn(mesh, op, rest)
            for r, g in zip(ref, got):  # the outputs are right either way
                assert all(torch.allclose(v, r) for v in g.values())
            stats_ok = all(torch.allclose(v, r) for r, s in zip(ref_stats, stats) for v in s.values())
            assert stats_ok == guarded, f"guard {guarded}"
        decompshard.disable()


def test_batch_norm_eval_is_untouched():
    """Not training: nothing is updated in place, the handler runs the op as DTensor does."""
    from decompshard.verify.dtensor_case import device_mesh

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
    from decompshard.verify.dtensor_case import device_mesh

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
    from decompshard.verify.dtensor_case import device_mesh

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
        with decompshard.enabled(guard_native=False, plans=False):
            assert "channels" in V.dtensor_step(model, x, y, mesh, [Shard(0)]).error
