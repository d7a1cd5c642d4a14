"""Which OpInfo samples the capture keeps and the sweep derives on (coverage/sample_pick.py).

OpInfo generators list their degenerate cases first (0-d values, size-1 dims, default
arguments); the capture must keep samples that can show an op's rules, whatever their
place in the generator."""

from __future__ import annotations

import pytest
import torch

from decompshard.coverage import opinfo_samples as o
from decompshard.coverage.opinfo_samples import AtenSample, capture_aten_samples
from decompshard.coverage.sample_pick import features, pick_diverse
from decompshard.coverage.sweep import pick_samples

aten = torch.ops.aten


@pytest.fixture(scope="module")
def captured():
    # every sample of these OpInfos, as the default `decompshard coverage` runs them
    return capture_aten_samples(["searchsorted", "nn.functional.pdist", "hash_tensor"], None, backward=True)


def _p(s: AtenSample) -> float:
    return s.args[1] if len(s.args) > 1 else 2.0


def test_searchsorted_keeps_values_with_dims(captured):
    kept = captured[aten.searchsorted.Tensor]
    assert len(kept) == 4
    assert all(s.args[1].ndim >= 1 for s in kept)  # the OpInfo's first samples have 0-d values
    best = pick_samples(kept, 2)
    assert all(s.args[0].ndim >= 2 and s.args[1].ndim >= 2 for s in best)
    for s in kept:  # still real calls of the op
        assert s.run().shape == s.args[1].shape


def _generator_p_values_at_full_size() -> list[float]:
    """The running torch's pdist OpInfo: the distinct p of its (S, S) samples, in the
    generator's order (the list changes between releases: 2.14 dropped p = 0)."""
    from decompshard._compat import op_db

    info = next(o for o in op_db if o.name == "nn.functional.pdist")
    ps = [s.kwargs.get("p", 2.0) for s in info.sample_inputs("cpu", torch.float32)
          if min(s.input.shape) > 1]
    return list(dict.fromkeys(ps))


def test_pdist_keeps_several_p_and_derives_on_two(captured):
    kept = captured[aten._pdist_forward.default]
    offered = _generator_p_values_at_full_size()
    assert len(offered) >= 4
    # the first distinct p values after the degenerate (1, 1), (1, 5), (5, 1) samples
    assert len(kept) == 4 and {_p(s) for s in kept} == set(offered[:4])
    assert all(tuple(s.args[0].shape) == (5, 5) for s in kept)  # not (1, 1), (1, 5), (5, 1)
    assert len({_p(s) for s in pick_samples(kept, 2)}) == 2
    # backward samples keep theirs too, and stay marked as backward
    back = captured[aten._pdist_backward.default]
    assert all(s.backward for s in back) and len({s.args[2] for s in back}) == 4


def test_hash_tensor_keeps_a_sample_of_rank_two_or_more(captured):
    kept = captured[aten.hash_tensor.default]
    assert max(s.args[0].ndim for s in kept) >= 2
    assert pick_samples(kept, 1)[0].args[0].ndim >= 2


def _sample(*shapes, op=aten.sum.dim_IntList, dim=(0,), keepdim=False) -> AtenSample:
    args = tuple(torch.zeros(s) for s in shapes) + ([*dim], keepdim)
    return AtenSample(op, args, {}, "test")


def test_pick_order_degenerate_last_then_something_new_then_size():
    zero_d = _sample(())
    size_one = _sample((1, 1))
    big = _sample((4, 4))
    bigger_same = _sample((5, 5))
    other_rank = _sample((3,))
    other_value = _sample((4, 4), keepdim=True)
    picked = pick_diverse([zero_d, size_one, big, other_rank, other_value, bigger_same], None)
    # biggest first; then a new argument value and a new rank (the larger first), both
    # beating the bigger sample that adds nothing; the 0-d and all-size-1 samples last
    # (between them: the one with a new rank)
    assert picked == [bigger_same, other_value, other_rank, big, zero_d, size_one]
    assert pick_diverse([zero_d, big], 1) == [big]
    assert pick_diverse([big, _sample((4, 4))], 1) == [big]  # ties keep the given order


def test_a_sample_over_the_budget_comes_after_any_within_it():
    huge = _sample((300, 300))  # 360 KB of float32
    small = _sample((4, 4))
    zero_d = _sample(())
    assert pick_diverse([huge, small, zero_d], None) == [small, huge, zero_d]
    many = AtenSample(aten.cat.default, ([torch.zeros(5, 5) for _ in range(5)], 0), {}, "test")
    few = AtenSample(aten.cat.default, ([torch.zeros(2, 2), torch.zeros(2, 2)], 0), {}, "test")
    assert pick_diverse([many, few], None) == [few, many]
    # a view counts its whole base: the capture keeps (and pickles) the storage
    view = AtenSample(aten.sum.dim_IntList, (torch.zeros(300, 300)[:2, :2], [0], False), {}, "test")
    assert pick_diverse([view, small], 1) == [small]


def test_defaults_count_as_values():
    # the dispatcher drops an argument left at its default: p = 2 reaches _pdist_forward(x)
    x = torch.zeros(5, 5)
    assert features((x,), {}, aten._pdist_forward.default) == features((x, 2.0), {}, aten._pdist_forward.default)
    assert features((x,), {}, aten._pdist_forward.default) != features((x, 1.0), {}, aten._pdist_forward.default)


def test_a_late_large_sample_survives_the_pool_cut(monkeypatch):
    """The pool is cut back as it grows (bounded memory), by the same criterion: a
    large sample after many small ones is still kept."""
    monkeypatch.setattr(o, "_POOL", 8)
    calls = [(aten.sum.dim_IntList, (torch.zeros(i + 1), [0]), {}) for i in range(40)]
    calls.append((aten.sum.dim_IntList, (torch.zeros(6, 7), [1]), {}))
    pools: dict = {}
    o._add(calls, "test", 2, pools, set(), False)
    pool = pools[aten.sum.dim_IntList]
    assert len(pool) < 16
    assert [tuple(s.args[0].shape) for s in o._choose(pool, 2)] == [(6, 7), (40,)]
