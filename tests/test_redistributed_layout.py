"""A tensor DTensor redistributes for an op is laid out as its spec claims
(decompshard/runtime/support/kwarg_routing.py `_densify_moved_args`).

Moving an uneven Shard(a) to Shard(b) pads both dims around the all-to-all and narrows
the result, so the last rank holds a slice of a padded buffer while the DTensor says
contiguous. ViT under an uneven data-parallel batch (10 images on 4 ranks, 17 tokens)
hits it: the uneven-view redistribution moves F.linear's [10, 17, 32] input from S(0)
to S(1) before its flatten, and the local `view` to [20, 32] fails on rank 3 ("view size
is not compatible with input tensor's size and stride"). Every case compares the loss
and every gradient with one device on every rank, in float64.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import decompshard
from decompshard.verify.dtensor_case import device_mesh, rank_locals

DT = torch.float64


pytestmark = pytest.mark.usefixtures("world")  # 4 simulated ranks, from conftest.py


def _linear_errors(shape: tuple[int, ...]) -> float:
    """Worst relative error of y, dx, dw over every rank; y = linear(x, w), x sharded S(0)
    on 4 ranks, loss = sum(y**2)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, dtype=DT, generator=g, requires_grad=True)
    w = torch.randn(12, shape[-1], dtype=DT, generator=g, requires_grad=True)
    y = F.linear(x, w)
    y.pow(2).sum().backward()
    mesh = device_mesh((4,))
    with LocalTensorMode(4), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dx = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
        dw = distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_()
        dy = F.linear(dx, dw)
        dy.pow(2).sum().backward()
        pairs = [(dy, y), (dx.grad, x.grad), (dw.grad, w.grad)]
        return max(((v - want.detach()).abs().max() / want.detach().abs().max()).item()
                   for got, want in pairs for v in rank_locals(got.full_tensor(), mesh).values())


def test_linear_whose_input_moves_to_an_uneven_token_shard_matches_one_device():
    # 10 rows on 4 ranks, then 17 tokens on 4 ranks (5, 5, 5, 2): the failing ViT layout
    decompshard.enable()
    try:
        assert _linear_errors((10, 17, 32)) < 1e-13
    finally:
        decompshard.disable()


def test_flatten_of_an_uneven_batch_matches_one_device_on_every_rank():
    # the same move without autograd: [10, 17, 32] S(0) flattened to [170, 32]
    x = torch.randn(10, 17, 32, dtype=DT, generator=torch.Generator().manual_seed(1))
    mesh = device_mesh((4,))
    decompshard.enable()
    try:
        with LocalTensorMode(4), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            z = distribute_tensor(x, mesh, [Shard(0)]).view(170, 32)
            got = rank_locals(z.full_tensor(), mesh)
    finally:
        decompshard.disable()
    assert len(got) == 4 and all(torch.equal(v, x.view(170, 32)) for v in got.values())


def test_flatten_of_a_permuted_uneven_batch_matches_one_device_on_every_rank():
    # a global layout that is not contiguous but takes the view ([10, 17, 32] strides
    # (17, 1, 170)): the moved local tensor must take it too
    x = torch.randn(32, 10, 17, dtype=DT, generator=torch.Generator().manual_seed(2)).permute(1, 2, 0)
    mesh = device_mesh((4,))
    decompshard.enable()
    try:
        with LocalTensorMode(4), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            z = distribute_tensor(x, mesh, [Shard(0)]).view(170, 32)
            got = rank_locals(z.full_tensor(), mesh)
    finally:
        decompshard.disable()
    assert len(got) == 4 and all(torch.equal(v, x.view(170, 32)) for v in got.values())


@pytest.mark.parametrize("name", ["vit-hf", "vit-timm"])
def test_vit_uneven_batch_step_matches_one_device(name):
    from decompshard.check.model import SHARDINGS, run_training_step
    from decompshard.check.zoo import ZOO, build

    run = run_training_step(build(ZOO[name], SHARDINGS["dp-uneven"].batch, seed=0), "dp-uneven",
                            enable=True, measure=False)
    assert run.verdict == "OK", f"{run.verdict} {run.op}: {run.detail}"
