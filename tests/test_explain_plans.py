"""`explain` for an op with a collective plan (explain/plans.py, runtime/plans/prices.py):
what it says the plan all-reduces and which path enable() takes, held against what the
same call does on simulated ranks under enable() (CommBytes counts its collectives and
the bytes each rank puts in), and the outputs against one device.

The expected numbers come from the shapes (C channels, rows), not from the code.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import decompshard
from decompshard.dispatch_modes.comm_bytes import CommBytes
from decompshard.verify.dtensor_case import device_mesh, simulation

WORLD_SIZE = 4
pytestmark = pytest.mark.usefixtures("world")
aten = torch.ops.aten
MOVES_ACTIVATIONS = {"all_gather_into_tensor", "all_to_all_single", "all_to_all"}


def _meta(*shapes):
    return [torch.empty(s, device="meta") for s in shapes]


def _bn_args(n: int, c: int, hw: int = 4, seed: int = 0) -> list:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, c, hw, hw, generator=g), torch.rand(c, generator=g) + 0.5, torch.randn(c, generator=g),
            torch.zeros(c), torch.ones(c)]


def _run(op, tensors: list, placements: list, rest: tuple, mesh_shape=(WORLD_SIZE,)):
    """The op under enable() on simulated ranks: (outputs ok against one device,
    {collective: bytes}, bytes each rank put in)."""
    want = op(*[t.clone() for t in tensors], *rest)
    mesh = device_mesh(mesh_shape)
    with decompshard.enabled(), simulation(mesh.size()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = [distribute_tensor(t.clone(), mesh, pl) for t, pl in zip(tensors, placements)]
        with CommBytes() as comm:
            got = op(*d, *rest)
        ok = all(torch.allclose(v, w, rtol=1e-5, atol=1e-6)
                 for o, w in zip(got, want) if o.numel()
                 for v in o.full_tensor()._local_tensors.values())
    return ok, dict(comm.bytes_by_kind), comm.bytes


def _explain(op, metas, rest, mesh, mesh_placements):
    return decompshard.explain(op, *metas, *rest, mesh=mesh, mesh_placements=mesh_placements)


BN_REST = (True, 0.1, 1e-5)


def test_batch_sharded_batch_norm_plan_shown_and_taken():
    n, c = 8, 16
    ex = _explain(aten.native_batch_norm.default, _meta((n, c, 4, 4), c, c, c, c), BN_REST, "4", "S(0);R;R;R;R")
    plan = ex.plan
    assert plan is not None and plan.priced is not None and plan.taken
    collectives = [col for s in plan.priced.steps for col in s.cost.collectives]
    assert [col.kind for col in collectives] == ["all_reduce", "all_reduce"]
    numbers = sum(col.bytes // s.itemsize for s in plan.priced.steps for col in s.cost.collectives)
    assert numbers == 2 * c
    assert plan.priced.cost.bytes_moved < plan.dtensor.bytes_moved
    text = str(ex)
    assert "collective plan: batch norm" in text and "enable() runs: the plan" in text
    # what the call does: two all-reduces of C numbers (float32), no activation moved
    ok, counts, nbytes = _run(aten.native_batch_norm.default, _bn_args(n, c), [[Shard(0)]] + [[Replicate()]] * 4,
                              BN_REST)
    assert ok
    assert not MOVES_ACTIVATIONS & set(counts), counts
    assert nbytes == 2 * c * 4


def test_channel_sharded_batch_norm_needs_no_plan():
    n, c = 8, 16
    ex = _explain(aten.native_batch_norm.default, _meta((n, c, 4, 4), c, c, c, c), BN_REST, "4",
                  "S(1);S(0);S(0);S(0);S(0)")
    plan = ex.plan
    assert plan.priced is None and not plan.taken and not plan.needed
    assert "no plan needed" in str(ex)
    ok, counts, nbytes = _run(aten.native_batch_norm.default, _bn_args(n, c), [[Shard(1)]] + [[Shard(0)]] * 4,
                              BN_REST)
    assert ok and nbytes == 0, counts


def test_batch_norm_plan_declined_where_activations_are_smaller():
    """4 rows of 64 channels on 4 ranks: the statistics (2 x 64 per rank) outweigh the
    activation, so DTensor's strategy runs, and the call moves the activation."""
    ex = _explain(aten.native_batch_norm.default, _meta((4, 64), 64, 64, 64, 64), BN_REST, "4", "S(0);R;R;R;R")
    assert ex.plan.priced is not None and not ex.plan.taken
    assert "enable() runs: DTensor's strategy" in str(ex)
    g = torch.Generator().manual_seed(3)
    args = [torch.randn(4, 64, generator=g), torch.rand(64, generator=g) + 0.5, torch.randn(64, generator=g),
            torch.zeros(64), torch.ones(64)]
    ok, counts, _ = _run(aten.native_batch_norm.default, args, [[Shard(0)]] + [[Replicate()]] * 4, BN_REST)
    assert ok and MOVES_ACTIVATIONS & set(counts), counts


def test_softmax_plan_counts_one_number_per_row():
    rows, cols = 6, 16
    ex = _explain(aten._softmax.default, _meta((rows, cols)), (1, False), "4", "S(1)")
    plan = ex.plan
    assert plan.taken
    collectives = [col for s in plan.priced.steps for col in s.cost.collectives]
    assert [col.bytes // 4 for col in collectives] == [rows, rows]
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(1))
    ok, counts, nbytes = _run(lambda a, *r: (aten._softmax.default(a, *r),), [x], [[Shard(1)]], (1, False))
    assert ok and not MOVES_ACTIVATIONS & set(counts) and nbytes == 2 * rows * 4, counts


def test_plan_without_mesh_and_op_without_plan():
    ex = decompshard.explain(aten.native_batch_norm.default, *_meta((8, 16, 4, 4), 16, 16, 16, 16), *BN_REST,
                             placements="S(0);R;R;R;R")
    assert ex.plan is not None and ex.plan.mesh_shape is None and "not priced" in str(ex)
    ex = decompshard.explain(aten.addmv.default, *_meta(4, (4, 12), 12), placements="R;S(1);S(0)")
    assert ex.plan is None and "collective plan" not in str(ex)
