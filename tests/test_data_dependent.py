"""Ops whose output size depends on values run replicated under `enable()`
(decompshard/runtime/support/data_dependent.py); without it DTensor stops at them."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import decompshard
from decompshard._compat import DTensor
from decompshard.runtime.support.data_dependent import data_dependent_ops
from decompshard.verify.dtensor_case import device_mesh, rank_locals

aten = torch.ops.aten


pytestmark = pytest.mark.usefixtures("world")  # 4 simulated ranks, from conftest.py


def _x():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 4, dtype=torch.float64, generator=g)
    return torch.where(x > 0.3, x.round(), torch.zeros_like(x))  # zeros and repeats


CASES = {
    "nonzero": (lambda x: torch.nonzero(x), [Shard(0)]),
    "where": (lambda x: torch.stack(torch.where(x != 0)), [Shard(1)]),
    "masked_select": (lambda x: torch.masked_select(x, x > 0), [Shard(0)]),
    "unique": (lambda x: torch.stack(torch.unique(x, return_counts=True)), [Shard(0)]),
    "unique_dim": (lambda x: torch.unique(x, dim=0), [Shard(1)]),
    "unique_consecutive": (lambda x: torch.unique_consecutive(x.flatten()), [Shard(0)]),
    "bincount": (lambda x: torch.bincount(x.abs().flatten().long()), [Shard(0)]),
    "repeat_interleave": (lambda x: torch.repeat_interleave(x.abs().flatten().long()), [Shard(0)]),
}


def _run(fn, placements):
    x = _x()
    mesh = device_mesh((4,))
    with LocalTensorMode(4), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = fn(distribute_tensor(x, mesh, placements))
        assert isinstance(got, DTensor)
        return max((v - fn(x)).abs().max().item() if v.shape == fn(x).shape else float("inf")
                   for v in rank_locals(got.full_tensor(), mesh).values())


@pytest.mark.parametrize("name", sorted(CASES))
def test_data_dependent_op_matches_one_device(name):
    fn, placements = CASES[name]
    decompshard.enable()
    assert _run(fn, placements) == 0
    decompshard.disable()
    with pytest.raises(RuntimeError):
        _run(fn, placements)


def test_found_by_tag_and_removed_by_disable():
    ops = set(data_dependent_ops())
    assert {aten.nonzero.default, aten.masked_select.default, aten._unique2.default,
            aten.unique_dim.default, aten.unique_consecutive.default} <= ops
    assert aten.nonzero.out not in ops and aten.index.Tensor not in ops  # out=, native strategy
    handlers = DTensor._op_dispatcher._custom_op_handlers
    before = dict(handlers)
    decompshard.enable()
    assert ops <= set(handlers)
    decompshard.disable()
    assert handlers == before


def test_masked_select_backward_matches_one_device():
    x = _x().requires_grad_()
    torch.masked_select(x, x.detach() > 0).pow(2).sum().backward()
    mesh = device_mesh((4,))
    decompshard.enable()
    with LocalTensorMode(4), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dx = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
        mask = distribute_tensor(x.detach() > 0, mesh, [Replicate()])
        torch.masked_select(dx, mask).pow(2).sum().backward()
        errs = [(v - x.grad).abs().max().item() for v in rank_locals(dx.grad.full_tensor(), mesh).values()]
    decompshard.disable()
    assert max(errs) < 1e-12
