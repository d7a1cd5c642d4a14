"""`all()` / `any()` of a whole sharded tensor (runtime/plans/bool_reductions.py): each
rank reduces its own part and one byte moves, where DTensor (2.14, 2.15) gathers the
tensor. transformers' masks call `.all()` on a batch-sharded boolean tensor.

Real DTensors on simulated meshes (1-D of 3 with uneven and empty parts, 2x2, 2x2x2),
random placements (any Shard, strided shards, Replicate; Partial where the tensor is
floating, which the plan declines), values all True, one False, all False and random:
every rank's result against one device.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import decompshard
from decompshard._compat import TORCH_VERSION
from decompshard.verify.dtensor_case import device_mesh, random_placements, simulation
from decompshard.verify.ranks import per_rank_values

WORLD_SIZE = 8
pytestmark = pytest.mark.usefixtures("world")


def _values(shape, seed):
    g = torch.Generator().manual_seed(seed)
    one_false = torch.ones(shape, dtype=torch.bool)
    one_false.view(-1)[int(torch.randint(one_false.numel(), (1,), generator=g))] = False
    return {"all true": torch.ones(shape, dtype=torch.bool), "one false": one_false,
            "all false": torch.zeros(shape, dtype=torch.bool), "random": torch.rand(shape, generator=g) > 0.5,
            "float": torch.randn(shape, generator=g).round()}


def _reduced(t, mesh, placements):
    """(all, any) on every rank, and the collectives the two calls ran."""
    with simulation(mesh.size()):
        d = distribute_tensor(t, mesh, placements)
        with CommDebugMode() as comm:
            a, b = d.all(), d.any()
        values = [{bool(v) for v in per_rank_values(r.full_tensor(), mesh.size()).values()} for r in (a, b)]
    return values, {str(k): v for k, v in comm.get_comm_counts().items() if v}


@pytest.mark.parametrize("mesh_shape, shape", [((3,), (7, 5)), ((3,), (2, 5)), ((2, 2), (7, 5)), ((2, 2, 2), (6, 4))],
                         ids=["3-uneven", "3-empty-part", "2x2", "2x2x2"])
def test_all_and_any_match_one_device_on_random_placements(mesh_shape, shape):
    mesh = device_mesh(mesh_shape)
    rng = random.Random(0)
    decompshard.enable()
    try:
        for name, t in _values(shape, seed=len(mesh_shape)).items():
            for (placements,) in (random_placements([shape], [t.is_floating_point()], mesh_shape, rng)
                                  for _ in range(4)):
                values, _ = _reduced(t, mesh, placements)
                assert values == [{bool(t.all())}, {bool(t.any())}], (name, placements)
    finally:
        decompshard.disable()


@pytest.mark.skipif(TORCH_VERSION < (2, 14), reason="torch 2.13 keeps all() Partial(product), moving nothing")
@pytest.mark.parametrize("plans", [True, False])
def test_a_batch_sharded_mask_is_not_gathered(plans):
    """The mask's `.all()`: one byte all-reduced per call with the plan; DTensor alone
    (`enable(plans=False)`) all-gathers the tensor."""
    mesh = device_mesh((2, 2))
    t = torch.ones(8, 6, dtype=torch.bool)
    decompshard.enable(plans=plans)
    try:
        values, comms = _reduced(t, mesh, [Shard(0), Replicate()])
    finally:
        decompshard.disable()
    assert values == [{True}, {True}]
    gathered = any("all_gather" in k for k in comms)
    assert gathered != plans, comms
