"""The guard's output-mask fix (runtime/fences/output_mask.py): the backward of a convolution
whose input needs no gradient (every network's first layer), on a 2-D mesh, matches one
device. torch 2.14 and 2.15 alone raise there ("strategy position 0 mixes None with placements
across mesh dims"): its single-dim strategy places grad_input although output_mask
leaves it out. On torch 2.13 the same step is right without the guard."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import decompshard
from decompshard._compat import TORCH_VERSION

pytestmark = pytest.mark.usefixtures("world")
WORLD_SIZE = 4
aten = torch.ops.aten


def _step(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """grad of weight and bias, one device or sharded: batch on mesh dim 0, inputs whole on dim 1."""
    from torch.distributed._local_tensor import LocalTensorMode

    mesh = init_device_mesh("cpu", (2, 2))
    with LocalTensorMode(WORLD_SIZE):
        dx = DTensor.from_local(x, mesh, [Replicate(), Replicate()]).redistribute(mesh, [Shard(0), Replicate()])
        dw = DTensor.from_local(w.clone(), mesh, [Replicate(), Replicate()]).requires_grad_()
        db = DTensor.from_local(b.clone(), mesh, [Replicate(), Replicate()]).requires_grad_()
        torch.nn.functional.conv2d(dx, dw, db, padding=1).sum().backward()
        return dw.grad.full_tensor(), db.grad.full_tensor()


def _data():
    g = torch.Generator().manual_seed(0)
    return (torch.randn(6, 3, 5, 5, generator=g, dtype=torch.float64),
            torch.randn(4, 3, 3, 3, generator=g, dtype=torch.float64),
            torch.randn(4, generator=g, dtype=torch.float64))


def _reference(x, w, b):
    w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
    torch.nn.functional.conv2d(x, w, b, padding=1).sum().backward()
    return w.grad, b.grad


def _same(got, ref) -> None:
    from decompshard._compat import rank_tensors

    for g, r in zip(got, ref):
        for t in rank_tensors(g).values():
            torch.testing.assert_close(t, r)


def test_first_conv_backward_on_2d_mesh_matches_one_device():
    x, w, b = _data()
    with decompshard.enabled():
        _same(_step(x, w, b), _reference(x, w, b))


def test_torch_alone_fails_from_2_14():
    """What the guard is for: without it the same step raises on torch 2.14.1 and
    2.15.0 (checked 2026-11-27); on 2.13 it is right."""
    x, w, b = _data()
    decompshard.disable()
    if TORCH_VERSION < (2, 14):
        _same(_step(x, w, b), _reference(x, w, b))
        return
    with pytest.raises(Exception, match="mixes None with placements"):
        _step(x, w, b)
