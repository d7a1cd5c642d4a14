"""Two strategy choices that looked worse than torch's, checked on real numbers.

- mse_loss_backward (mean) with sharded inputs: torch's fallback keeps Shard(0) with no
  collective, and is off by the world size (each rank divides by its local numel);
  decompshard's local-shape check refuses that rule and all-gathers. Not a cost issue.
- reflection pad of an uneven batch (7 rows on 4 ranks): the batch rule is [even] (from
  torch's single-dim strategy for index.Tensor inside the decomposition), so it cannot
  run; among what can, the all-to-all to Shard(1) moves a quarter of the all-gather's
  bytes. With an even batch, Shard(0) is kept with no collective.

Simulated ranks (LocalTensorMode) over a fake process group give real numbers.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import _e2e_model as M
import decompshard
from decompshard.mesh.lift import rank_strategies
from decompshard.runtime.derived import _first_runnable
from decompshard.placements import format_rule

aten = torch.ops.aten
R, S0, S1 = Replicate(), Shard(0), Shard(1)


@pytest.fixture(scope="module")
def mesh4():
    with M.fake_world(64):
        yield M.submesh((4,))
    decompshard.disable()


def _run(fn, tensors, placements, mesh):
    with LocalTensorMode(frozenset(range(mesh.size()))), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = [distribute_tensor(t, mesh, p) for t, p in zip(tensors, placements)]
        with CommDebugMode() as comm:
            out = fn(*ds)
        return M.full(out), tuple(out.placements), comm.get_total_counts()


def test_mse_loss_backward_zero_collective_layout_is_wrong_by_the_world_size(mesh4):
    torch.manual_seed(0)
    g, x, t = torch.randn(()), torch.randn(16, 6), torch.randn(16, 6)
    want = aten.mse_loss_backward.default(g, x, t, 1)  # reduction 1: mean
    fn = lambda *a: aten.mse_loss_backward.default(*a, 1)  # noqa: E731
    try:
        decompshard.disable()
        theirs, their_pl, their_comms = _run(fn, (g, x, t), ([R], [S0], [S0]), mesh4)
        decompshard.enable()
        ours, our_pl, our_comms = _run(fn, (g, x, t), ([R], [S0], [S0]), mesh4)
    finally:
        decompshard.disable()
    assert their_comms == 0 and their_pl == (S0,)
    torch.testing.assert_close(theirs, want * 4)  # each rank divided by its own numel
    torch.testing.assert_close(ours, want)
    assert our_comms == 2  # the two inputs gathered: no 0- or 1-collective layout is right
    # why: the Shard(0) rule exists but fails the local-shape check
    ranking = rank_strategies(aten.mse_loss_backward.default, (g, x, t, 1), {}, (4,), [(R,), (S0,), (S0,)])
    refused = [s for s in ranking if s.input_placements == ((R,), (S0,), (S0,))]
    assert refused and all(not s.valid and "local-shape check" in s.reason for s in refused)


def test_reflection_pad_uneven_batch_keeps_its_sharding(mesh4):
    """The pad's batch rule holds for uneven shards (index on untouched dims,
    rules/project_rules.py): 7 rows on 4 ranks stay S(0) for free. It used to be [even],
    and the lift moved the pad to channels (an all-to-all), handing the next
    convolution a channel-sharded tensor."""
    x7, x8 = torch.randn(7, 8, 16, 16), torch.randn(8, 8, 16, 16)
    pad = [1, 1, 1, 1]
    for x in (x7, x8):
        best = _first_runnable(aten.reflection_pad2d.default, (x, pad), {}, (4,), [(S0,)])
        assert [format_rule(r) for r in best.rules] == ["S(0) -> S(0)"] and best.cost.collectives == ()
    ranking = rank_strategies(aten.reflection_pad2d.default, (x7, pad), {}, (4,), [(S0,)])
    assert ranking[0].input_placements == ((S0,),)
    assert any(s.valid and s.input_placements == ((S1,),) for s in ranking)  # still an option, dearer
    # and both run right on simulated ranks, with no collective
    try:
        decompshard.enable()
        for x in (x7, x8):
            got, _, comms = _run(lambda a: F.pad(a, pad, mode="reflect"), (x,), ([S0],), mesh4)
            torch.testing.assert_close(got, F.pad(x, pad, mode="reflect"))
            assert comms == 0
    finally:
        decompshard.disable()
