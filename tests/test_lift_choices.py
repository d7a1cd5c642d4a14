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
from decompshard.lift import choose, rank_strategies
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


def test_reflection_pad_uneven_batch_all_to_all_is_the_cheaper_of_what_can_run(mesh4):
    x7, x8 = torch.randn(7, 8, 16, 16), torch.randn(8, 8, 16, 16)
    pad = [1, 1, 1, 1]
    ranking = rank_strategies(aten.reflection_pad2d.default, (x7, pad), {}, (4,), [(S0,)])
    keep = next(s for s in ranking if s.input_placements == ((S0,),))
    assert not keep.valid and "needs even shards" in keep.reason and "size 7" in keep.reason
    best = ranking[0]
    gather = next(s for s in ranking if s.valid and s.input_placements == ((R,),))
    assert best.valid and best.input_placements == ((S1,),)
    [a2a], [ag] = best.cost.collectives, gather.cost.collectives
    assert (a2a.kind, ag.kind) == ("all_to_all", "all_gather")
    assert a2a.wire_bytes * 4 == pytest.approx(ag.wire_bytes)  # a quarter of the bytes
    assert best.cost.sort_key() < gather.cost.sort_key()
    # an even batch keeps its sharding for free
    even = choose(aten.reflection_pad2d.default, (x8, pad), {}, (4,), [(S0,)])
    assert [format_rule(r) for r in even.rules] == ["S(0) -> S(0) [even]"] and even.cost.collectives == ()
    # and both run right on simulated ranks
    try:
        decompshard.enable()
        for x in (x7, x8):
            got, _, comms = _run(lambda a: F.pad(a, pad, mode="reflect"), (x,), ([S0],), mesh4)
            torch.testing.assert_close(got, F.pad(x, pad, mode="reflect"))
            assert comms == (1 if x is x7 else 0)
    finally:
        decompshard.disable()
