"""In-place view ops on DTensors under `enable()` (decompshard/runtime/support/inplace_views.py):
`transpose_`, `unsqueeze_` and `t_` follow their out-of-place twin's native strategy on
self's own local tensor. Without it DTensor has no strategy for them."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor

import decompshard
from decompshard._compat import DTensor, local_tensor
from decompshard.runtime.support.inplace_views import in_place_view_ops
from decompshard.verify.dtensor_case import device_mesh, rank_locals

aten = torch.ops.aten


WORLD_SIZE = 3  # simulated ranks for conftest's `world`
pytestmark = pytest.mark.usefixtures("world")


def _x() -> torch.Tensor:
    return torch.randn(7, 5, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(0))


CASES = [  # (call, placements): Shard on a dim that moves, on one that stays, Partial, Replicate
    (lambda t: t.transpose_(0, 1), [Shard(0)]),
    (lambda t: t.transpose_(1, 2), [Shard(0)]),
    (lambda t: t.transpose_(0, 2), [Shard(2)]),
    (lambda t: t.transpose_(0, 1), [Partial()]),
    (lambda t: t.unsqueeze_(0), [Shard(0)]),
    (lambda t: t.unsqueeze_(2), [Shard(2)]),
    (lambda t: t.unsqueeze_(-1), [Partial()]),
    (lambda t: t.unsqueeze_(1), [Replicate()]),
    (lambda t: t[0].t_(), [Shard(1)]),
    (lambda t: t[0].t_(), [Replicate()]),
    (lambda t: t[0].t_(), [Partial()]),
    (lambda t: t[:6, :1].squeeze_(), [Shard(0)]),  # torch's own squeeze_ strategy kept [7, 1, 4]
    (lambda t: t[:, :1].squeeze_(1), [Shard(2)]),
    (lambda t: t[:, :1].squeeze_((0, 1)), [Replicate()]),
    (lambda t: t[:, :1].squeeze_(), [Partial()]),
]


def _dtensor(x: torch.Tensor, mesh, placement) -> DTensor:
    """Shard/Replicate as DTensor lays them out; Partial(sum) as three random parts.
    (dtensor_case.make_dtensor's parts are views at rank-dependent storage offsets,
    which torch's simulated ranks cannot restride: a simulator artifact.)"""
    if not isinstance(placement, Partial):
        return distribute_tensor(x.clone(), mesh, [placement])
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(x.shape, dtype=x.dtype, generator=g), torch.randn(x.shape, dtype=x.dtype, generator=g)
    parts = LocalTensor({0: a, 1: b, 2: x - a - b})
    return DTensor.from_local(parts, mesh, [placement], run_check=False)


def _check(call, placements) -> None:
    x = _x()
    want = call(x.clone())
    mesh = device_mesh((3,))
    with LocalTensorMode(3), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = _dtensor(x, mesh, placements[0])
        got = call(d)
        assert isinstance(got, DTensor)
        assert tuple(got.shape) == tuple(want.shape) and tuple(got.stride()) == tuple(want.stride())
        # the DTensor's spec describes the local tensor each rank holds
        assert tuple(got._spec.tensor_meta.shape) == tuple(want.shape)
        assert tuple(got.to_local().shape) == tuple(local_tensor(got).shape)
        for v in rank_locals(got.full_tensor(), mesh).values():
            assert torch.allclose(v, want, rtol=0, atol=1e-12)
        y = got * 2 + 1  # a later op reads the new layout
        for v in rank_locals(y.full_tensor(), mesh).values():
            assert torch.allclose(v, want * 2 + 1, rtol=0, atol=1e-12)


@pytest.mark.parametrize("i", range(len(CASES)))
def test_in_place_view_matches_one_device(i):
    call, placements = CASES[i]
    decompshard.enable()
    _check(call, placements)


def test_without_enable_dtensor_has_no_strategy():
    decompshard.disable()
    mesh = device_mesh((3,))
    with LocalTensorMode(3), pytest.raises(NotImplementedError, match="sharding strategy"):
        distribute_tensor(_x(), mesh, [Shard(0)]).transpose_(0, 1)


def test_without_enable_t_in_place_does_not_match_one_device():
    """torch alone: 2.13 has no strategy for `t_`; from 2.14 it reuses `t`'s strategy,
    and DTensor's in-place path keeps the old spec when the placements do not change,
    so a replicated [5, 4] becomes a DTensor of shape [5, 4] over [4, 5] locals."""
    decompshard.disable()
    x = _x()[0]
    mesh = device_mesh((3,))
    with LocalTensorMode(3), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = distribute_tensor(x.clone(), mesh, [Replicate()])
        try:
            d.t_()
        except (NotImplementedError, RuntimeError) as e:
            assert "sharding strategy" in str(e)
            return
        assert tuple(local_tensor(d).shape) == (4, 5)
        assert tuple(d.shape) == (5, 4)  # the DTensor's shape is not its data's


def test_ops_are_found_by_property():
    found = {str(op): str(twin) for op, twin in in_place_view_ops()}
    assert found["aten.transpose_.default"] == "aten.transpose.int"
    assert found["aten.unsqueeze_.default"] == "aten.unsqueeze.default"
    # no strategy of its own on 2.13; from 2.14 torch copies `t`'s, which is not one
    assert found["aten.t_.default"] == "aten.t.default"
    # squeeze_ has its own (wrong) native strategy: the guard gives it the handler;
    # resize_ and as_strided_ have no twin with a strategy
    assert not {"aten.squeeze_.dim", "aten.resize_.default", "aten.as_strided_.default"} & found.keys()


def test_without_enable_squeeze_in_place_keeps_the_old_shape():
    """torch alone (2.13 to 2.15): squeeze_ has squeeze's strategy, and DTensor's in-place
    path keeps the old spec when the placements do not change: a DTensor of shape
    [7, 1, 4] over [7, 4] data, silently."""
    decompshard.disable()
    mesh = device_mesh((3,))
    with LocalTensorMode(3), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = distribute_tensor(_x()[:, :1].clone(), mesh, [Replicate()])
        d.squeeze_()
        assert tuple(local_tensor(d).shape) == (7, 4)
        assert tuple(d.shape) == (7, 1, 4)  # the DTensor's shape is not its data's


def test_autograd_through_an_in_place_view():
    x = _x().requires_grad_()
    w = torch.randn(5, 7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = x * 3
    y.transpose_(0, 1)
    (y * w).sum().backward()
    mesh = device_mesh((3,))
    decompshard.enable()
    with LocalTensorMode(3), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dx = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
        dy = dx * 3
        dy.transpose_(0, 1)
        assert dy.placements == (Shard(1),)
        (dy * distribute_tensor(w, mesh, [Replicate()])).sum().backward()
        for v in rank_locals(dx.grad.full_tensor(), mesh).values():
            assert torch.allclose(v, x.grad, rtol=0, atol=1e-12)
