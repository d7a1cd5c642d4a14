"""`as_strided_` / `as_strided` on DTensors where they move no element
(decompshard/runtime/support/as_strided.py): timm's ConvNeXt head pools a channels-last-strided map,
which ATen's adaptive_avg_pool2d restrides with `as_strided_`."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import decompshard
from decompshard._compat import DTensor
from decompshard.verify.dtensor_case import device_mesh, rank_locals

aten = torch.ops.aten


pytestmark = pytest.mark.usefixtures("world")  # 4 simulated ranks, from conftest.py


def _pool_step(batch: int, placements) -> float:
    g = torch.Generator().manual_seed(0)
    # channels-last strides, as ConvNeXt's LayerNorm2d (permute, norm, permute back) leaves them
    x = torch.randn(batch, 5, 5, 6, dtype=torch.float64, generator=g).permute(0, 3, 1, 2).requires_grad_()
    w = torch.randn(batch, 6, 1, 1, dtype=torch.float64, generator=g)
    y = F.adaptive_avg_pool2d(x, 1)
    (y * w).sum().backward()
    mesh = device_mesh((4,))
    with LocalTensorMode(4), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dx = distribute_tensor(x.detach(), mesh, placements).requires_grad_()
        dy = F.adaptive_avg_pool2d(dx, 1)
        assert dy.stride() == y.stride()  # channels-last, as on one device
        (dy * distribute_tensor(w, mesh, placements)).sum().backward()
        return max((v - want).abs().max().item() for got, want in ((dy, y.detach()), (dx.grad, x.grad))
                   for v in rank_locals(got.full_tensor(), mesh).values())


@pytest.mark.parametrize("batch,placements", [(8, [Shard(0)]), (5, [Shard(0)]), (5, [Shard(1)]), (5, [Replicate()])],
                         ids=str)
def test_channels_last_global_pool_matches_one_device(batch, placements):
    decompshard.enable()
    assert _pool_step(batch, placements) < 1e-12
    decompshard.disable()
    with pytest.raises((RuntimeError, NotImplementedError)):
        _pool_step(batch, placements)


def test_as_strided_that_moves_elements_on_a_shard_is_a_clear_error():
    mesh = device_mesh((4,))
    decompshard.enable()
    try:
        with LocalTensorMode(4):
            dx = distribute_tensor(torch.randn(8, 4, dtype=torch.float64), mesh, [Shard(0)])
            with pytest.raises(RuntimeError, match="would move elements"):
                dx.as_strided_((4, 8), (8, 1))
            with pytest.raises(RuntimeError, match="as_strided"):
                dx.as_strided((4, 8), (8, 1))
            r = distribute_tensor(torch.arange(32.0, dtype=torch.float64), mesh, [Replicate()])
            got = r.as_strided((4, 8), (8, 1), 0)  # replicated, among its own elements: right
            assert all(torch.equal(v, torch.arange(32.0, dtype=torch.float64).view(4, 8))
                       for v in rank_locals(got.full_tensor(), mesh).values())
    finally:
        decompshard.disable()


def _storage_case(op, args, kwargs, text, mesh):
    from decompshard.runtime.enable import switched
    from decompshard.verify.dtensor_case import parse_mesh, parse_placements, run_case

    shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
    shape = parse_mesh(mesh)
    return run_case(op, args, kwargs, shape, parse_placements(text, shapes, len(shape)), runtime=switched(True))


@pytest.mark.parametrize("text,mesh", [("R", "4"), ("P(sum)", "4"), ("S(0)", "4"), ("S(1),P(max)", "2x2")])
def test_as_strided_copy_reads_the_global_storage_of_a_transposed_dtensor(text, mesh):
    # distribute_tensor of a transposed tensor holds contiguous locals under a (1, 6)
    # global stride: the derived P -> P rule, run on them, read other elements
    # (max error 3.45 on values of 1.98) on every placement; forward and backward.
    xt = torch.randn(4, 6, dtype=torch.float64).t()
    out = _storage_case(aten.as_strided_copy.default, (xt, (2, 2), (1, 2)), {"storage_offset": 1}, text, mesh)
    assert out.status == "ok", out


@pytest.mark.parametrize("text,mesh", [("R;R", "4"), ("P(sum);R", "4"), ("P(avg);P(avg)", "4"), ("S(0),S(1);R,P(sum)", "2x2")])
def test_as_strided_scatter_writes_the_global_storage_of_a_transposed_dtensor(text, mesh):
    xt = torch.randn(4, 6, dtype=torch.float64).t()
    src = torch.randn(2, 2, dtype=torch.float64)
    out = _storage_case(aten.as_strided_scatter.default, (xt, src, (2, 2), (1, 2)), {}, text, mesh)
    assert out.status == "ok", out


def test_as_strided_copy_of_storage_no_rank_holds_is_a_clear_error():
    mesh = device_mesh((4,))
    decompshard.enable()
    try:
        with LocalTensorMode(4):
            dx = distribute_tensor(torch.randn(8, 4, dtype=torch.float64), mesh, [Replicate()])
            with pytest.raises(RuntimeError, match="addresses storage that no rank holds"):
                aten.as_strided_copy.default(dx, (4, 8), (8, 1), 4)  # past its 32 elements
    finally:
        decompshard.disable()


def test_disable_restores_the_handlers():
    handlers = DTensor._op_dispatcher._custom_op_handlers
    before = dict(handlers)
    decompshard.enable()
    assert handlers[aten.as_strided_.default] is not None
    decompshard.disable()
    assert handlers == before


@pytest.mark.parametrize("batch,mesh_shape", [(8, (4,)), (5, (4,)), (5, (2, 2))], ids=["even", "uneven", "uneven-2x2"])
def test_timm_convnext_dp_step_matches_one_device(batch, mesh_shape):
    from _dp_step import dp_step

    from decompshard.check.ecosystem import import_timm

    import_timm()
    from timm.models.convnext import ConvNeXt

    class WithLoss(torch.nn.Module):
        def __init__(self, m: torch.nn.Module):
            super().__init__()
            self.m = m

        def forward(self, x, y):  # log-softmax + gather: the nll_loss mean is another issue's
            return -F.log_softmax(self.m(x), -1).gather(1, y[:, None]).mean()

    torch.manual_seed(0)
    model = WithLoss(ConvNeXt(in_chans=3, num_classes=5, depths=(1, 1, 1, 1), dims=(8, 8, 8, 8), patch_size=2))
    inputs = {"x": torch.randn(batch, 3, 32, 32, dtype=torch.float64), "y": torch.randint(0, 5, (batch,))}
    decompshard.enable()
    try:
        res = dp_step(model, inputs, lambda loss: loss, mesh_shape)
    finally:
        decompshard.disable()
    assert not res["missing"]
    assert max(res["errors"].values()) < 1e-12, res["errors"]
