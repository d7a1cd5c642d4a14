"""Tests for decompshard.verify.rule_check: hand-checked truths on real tensors.

Every expected verdict here was worked out by hand from the op's math (not copied from
the checker's output), and every test can fail: most assert both a valid and an invalid
verdict on the same op.
"""

from __future__ import annotations

import pytest
import torch

from decompshard.verify.rank_sim import make_local, make_parts
from decompshard.placements import P, Partial, S, SingleDimRule, parse_rule
from decompshard.verify.rule_check import RECALL_CLASSES, check_rule, check_rules, ground_truth, run_rule_on_ranks

aten = torch.ops.aten


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1000 * len(shape) + sum(shape))
    return torch.randn(*shape, generator=g)


def ok(op, args, text: str, kwargs=None, **kw) -> bool | None:
    return check_rule(op, args, kwargs or {}, parse_rule(text), **kw).ok


def rule_set(rules) -> set[str]:
    return {str(r) for r in rules}


# ---------------------------------------------------------------- pointwise & matmul


def test_mul_hand_checked_rules():
    a, b = randn(4, 6, seed=1), randn(4, 6, seed=2)
    assert ok(aten.mul.Tensor, (a, b), "S(0), S(0) -> S(0)") is True
    assert ok(aten.mul.Tensor, (a, b), "P(sum), R -> P(sum)") is True
    assert ok(aten.mul.Tensor, (a, b), "P(sum), P(sum) -> P(sum)") is False  # cross terms
    assert ok(aten.mul.Tensor, (a, b), "P(max), R -> P(max)") is False  # b has negatives
    assert ok(aten.mul.Tensor, (a, b), "S(0), R -> S(0)") is False  # [2,6] * [4,6] raises
    assert ok(aten.mul.Tensor, (a, b), "S(0), S(0) -> S(1)") is False


def test_mul_ground_truth_is_exactly_the_expected_set():
    # Elementwise product of two [4,6] tensors. Reasoning: both operands must be sharded
    # the same way for the local shapes to broadcast (S(d), S(d) -> S(d)); a product is
    # linear in each operand separately, so one P(sum) / P(avg) operand with the other
    # replicated stays P(sum) / P(avg); P(max)/P(min) fail because randn has both signs;
    # two Partial operands fail because of cross terms; R -> P(avg|max|min) outputs
    # are pruned as implied by R. All-R inputs are never listed.
    a, b = randn(4, 6, seed=1), randn(4, 6, seed=2)
    gt = ground_truth(aten.mul.Tensor, (a, b), {})
    assert gt.exhaustive and gt.untestable is None
    assert gt.even_only == []
    assert rule_set(gt.valid) == {
        "S(0), S(0) -> S(0)",
        "S(1), S(1) -> S(1)",
        "P(sum), R -> P(sum)",
        "R, P(sum) -> P(sum)",
        "P(avg), R -> P(avg)",
        "R, P(avg) -> P(avg)",
    }
    assert all(r.source == "ground_truth" for r in gt.valid)


def test_mm_contraction_dim_gives_partial_sum():
    a, b = randn(4, 6, seed=3), randn(6, 5, seed=4)
    assert ok(aten.mm.default, (a, b), "S(1), S(0) -> P(sum)") is True
    assert ok(aten.mm.default, (a, b), "S(1), S(0) -> P(avg)") is False
    assert ok(aten.mm.default, (a, b), "S(0), R -> S(0)") is True
    assert ok(aten.mm.default, (a, b), "S(0), R -> S(1)") is False
    assert ok(aten.mm.default, (a, b), "R, S(1) -> S(1)") is True


def test_abs_is_not_linear_nor_monotone():
    x = randn(4, 6, seed=5)
    assert ok(aten.abs.default, (x,), "P(sum) -> P(sum)") is False
    assert ok(aten.abs.default, (x,), "P(max) -> P(max)") is False
    assert ok(aten.abs.default, (x,), "S(1) -> S(1)") is True


def test_monotone_ops_keep_pmax():
    x = randn(4, 6, seed=6)
    assert ok(aten.relu.default, (x,), "P(max) -> P(max)") is True
    assert ok(aten.relu.default, (x,), "P(sum) -> P(sum)") is False
    assert ok(aten.clamp_min.default, (x, 0.0), "P(max) -> P(max)") is True
    assert ok(aten.clamp_min.default, (x, 0.0), "P(max) -> P(min)") is False
    assert ok(aten.neg.default, (x,), "P(max) -> P(min)") is True  # decreasing map
    assert ok(aten.neg.default, (x,), "P(max) -> P(max)") is False


def test_exp_partial_sum_never_becomes_pmin():
    # Regression: huge parts (exp of large noise) must not loosen the tolerance of a
    # max/min reduction.
    x = randn(4, 6, seed=7)
    assert ok(aten.exp.default, (x,), "P(sum) -> P(min)") is False
    assert ok(aten.exp.default, (x,), "P(sum) -> P(sum)") is False
    assert ok(aten.exp.default, (x,), "P(max) -> P(max)") is True


# ---------------------------------------------------------------- degenerate data guards


def test_derived_samples_catch_data_that_flatters_a_wrong_rule():
    a, b = randn(4, 6, seed=8), randn(4, 6, seed=9)
    # random floats are never equal, so eq() is all-False on every rank for any parts;
    # the "ties" sample has equal elements and exposes the rule.
    assert ok(aten.eq.Tensor, (a, b), "P(sum), R -> R") is False
    gt = ground_truth(aten.eq.Tensor, (a, b), {})
    assert rule_set(gt.valid) == {"S(0), S(0) -> S(0)", "S(1), S(1) -> S(1)"}
    # P(max) through a product is only right for a nonnegative factor; the negated
    # sample catches it even when the caller's factor happens to be positive.
    pos = torch.rand(4, 6, generator=torch.Generator().manual_seed(0)) + 0.1
    assert ok(aten.mul.Tensor, (a, pos), "P(max), R -> P(max)") is False
    # isnan on NaN-free data is all-False whatever the parts; the special sample has NaN.
    assert ok(aten.isnan.default, (a,), "P(sum) -> R") is False
    assert ok(aten.isnan.default, (a,), "S(0) -> S(0)") is True


def test_nan_positions_must_match():
    x = randn(4, 6, seed=10)  # log of negatives gives NaN on every rank alike
    assert ok(aten.log.default, (x,), "S(0) -> S(0)") is True
    assert ok(aten.log.default, (x,), "S(0) -> S(1)") is False


# ---------------------------------------------------------------- uneven shards and [even]


@pytest.mark.parametrize("op,args,even_rule", [
    (aten.mse_loss.default, lambda n: (randn(n, 3, seed=11), randn(n, 3, seed=12), 1),
     "S(0), S(0) -> P(avg) [even]"),
    (aten.mean.dim, lambda n: (randn(n, 3, seed=13), [0]), "S(0) -> P(avg) [even]"),
])
def test_mean_over_sharded_dim_is_even_only(op, args, even_rule):
    plain_rule = even_rule.replace(" [even]", "")
    # size 6 splits evenly at W=2 and W=3
    assert ok(op, args(6), even_rule) is True
    # ... but the unconditional claim also meets W=4 (2,2,2,0): the probe catches it
    res = check_rule(op, args(6), {}, parse_rule(plain_rule))
    assert res.ok is False and 4 in res.world_sizes
    # size 5 never splits evenly at W in (2, 3): the [even] rule cannot be tested there
    res = check_rule(op, args(5), {}, parse_rule(even_rule))
    assert res.ok is None and "evenly" in res.reason
    assert ok(op, args(5), plain_rule) is False
    gt = ground_truth(op, args(6), {})
    assert even_rule in rule_set(gt.even_only)
    assert plain_rule not in rule_set(gt.valid)
    assert all(r.even_only for r in gt.even_only)


def test_uneven_and_empty_shards():
    y = randn(4, 5, seed=14)  # dim 1 of size 5: shards 3,2 (W=2) and 2,2,1 (W=3)
    assert ok(aten.cumsum.default, (y, 0), "S(1) -> S(1)") is True
    assert ok(aten.cumsum.default, (y, 0), "S(0) -> S(0)") is False  # running sum restarts
    assert ok(aten.cumsum.default, (y, 0), "P(sum) -> P(sum)") is True
    z = randn(2, 3, seed=15)  # dim 0 of size 2 at W=3: shards 1,1,0
    res = check_rule(aten.abs.default, (z,), {}, parse_rule("S(0) -> S(0)"))
    assert res.ok is True and 3 in res.world_sizes
    shards = make_local(z, S(0), 3, (0, False), salt=0)
    assert [s.shape[0] for s in shards] == [1, 1, 0]
    assert torch.equal(torch.cat(shards), z)


def test_channel_shuffle_groups_apply_to_the_local_shard():
    x = randn(2, 8, 3, 3, seed=16)
    assert ok(aten.channel_shuffle.default, (x, 2), "S(1) -> S(1)") is False
    assert ok(aten.channel_shuffle.default, (x, 2), "S(0) -> S(0)") is True
    assert ok(aten.channel_shuffle.default, (x, 2), "S(2) -> S(2)") is True


# ---------------------------------------------------------------- op signatures


def test_multi_output_ops():
    y = randn(4, 5, seed=17)
    op = aten.aminmax.default
    assert ok(op, (y,), "S(0) -> S(0), S(0)", {"dim": 1}) is True
    assert ok(op, (y,), "S(1) -> P(min), P(max)", {"dim": 1}) is True
    assert ok(op, (y,), "S(1) -> P(max), P(min)", {"dim": 1}) is False
    assert ok(op, (y,), "S(1) -> P(min)", {"dim": 1}) is False  # one placement per output
    gt = ground_truth(op, (y,), {"dim": 1})
    assert {"S(0) -> S(0), S(0)", "S(1) -> P(min), P(max)"} <= rule_set(gt.valid)
    sm = aten.std_mean.correction
    assert ok(sm, (y, [1]), "S(0) -> S(0), S(0)", {"correction": 1}) is True
    assert ok(sm, (y, [1]), "S(1) -> P(avg), P(avg)", {"correction": 1}) is False


def test_list_inputs_are_flattened_in_order():
    a, b, c = randn(2, 3, seed=18), randn(3, 2, seed=19), randn(1, 1, seed=20)
    bd = aten.block_diag.default
    assert ok(bd, ([a, b, c],), "P(sum), P(sum), P(sum) -> P(sum)") is True
    assert ok(bd, ([a, b, c],), "P(sum), R, R -> P(sum)") is False  # R blocks summed W times
    assert ok(bd, ([a, b, c],), "R, P(max), R -> P(max)") is True  # zeros off-diagonal
    assert ok(bd, ([a, b],), "P(sum), P(sum), P(sum) -> P(sum)") is False  # arity
    x, z = randn(2, 3, seed=21), randn(3, 3, seed=22)
    assert ok(aten.cat.default, ([x, z],), "S(1), S(1) -> S(1)") is True
    assert ok(aten.cat.default, ([x, z],), "S(0), S(0) -> S(0)") is False  # chunks interleave


def test_integer_inputs_have_no_partial_in_the_alphabet():
    x, idx = randn(4, 6, seed=23), torch.tensor([0, 2, 2, 1, 3])
    op = aten.index_select.default
    assert ok(op, (x, 0, idx), "R, S(0) -> S(0)") is True
    assert ok(op, (x, 0, idx), "S(1), R -> S(1)") is True
    assert ok(op, (x, 0, idx), "P(max), R -> P(max)") is True  # selection commutes with max
    assert ok(op, (x, 0, idx), "S(0), R -> S(0)") is False
    gt = ground_truth(op, (x, 0, idx), {})
    assert all(not isinstance(r.inputs[1], Partial) for r in gt.rules)
    assert {"R, S(0) -> S(0)", "S(1), R -> S(1)", "P(sum), R -> P(sum)"} <= rule_set(gt.valid)


def test_claimed_partial_on_integer_tensors_is_still_checked():
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(-5, 5, (4, 6), generator=g), torch.randint(-5, 5, (4, 6), generator=g)
    assert ok(aten.add.Tensor, (a, b), "P(sum), P(sum) -> P(sum)") is True
    assert ok(aten.mul.Tensor, (a, b), "P(sum), P(sum) -> P(sum)") is False
    assert ok(aten.add.Tensor, (a, b), "S(0), S(0) -> P(avg)") is False  # no integer avg


def test_complex_outputs_never_take_max_min():
    c = randn(4, 6, seed=24).to(torch.complex64) * (1 + 1j)
    assert ok(aten.mul.Tensor, (c, c), "S(0), S(0) -> S(0)") is True
    assert ok(aten.mul.Tensor, (c, c), "P(sum), R -> P(sum)") is True
    res = check_rule(aten.mul.Tensor, (c, c), {}, parse_rule("S(0), S(0) -> P(max)"))
    assert res.ok is False and "not defined" in res.reason


def test_inputs_changed_in_place_must_keep_their_placement():
    # Legacy native_batch_norm updates running stats in place although its schema does not
    # say so. running_mean' = 0.9 * running_mean + 0.1 * batch_mean is affine with a
    # positive slope: P(avg) and P(max) survive it, P(sum) does not (0.1 * mean added W
    # times). A channel-sharded running_mean with replicated x must be rejected on shapes
    # (before any real call: the CPU kernel would write past the shard).
    x, w, b = randn(3, 4, 5, seed=40), randn(4, seed=41), randn(4, seed=42)
    rm, rv = randn(4, seed=43), torch.rand(4, generator=torch.Generator().manual_seed(1)) + 0.5
    args = (x, w, b, rm, rv, True, 0.1, 1e-5)
    op = aten.native_batch_norm.default
    assert ok(op, args, "R, R, R, P(avg), R -> R, R, R") is True
    assert ok(op, args, "R, R, R, P(max), R -> R, R, R") is True
    assert ok(op, args, "R, R, R, P(sum), R -> R, R, R") is False
    res = check_rule(op, args, {}, parse_rule("R, R, R, S(0), R -> R, R, R"))
    assert res.ok is False and "shapes" in res.reason
    # channel sharding is fine (5 channels: shards 3,2 and 2,2,1, none empty)
    x5, v5 = randn(3, 5, 4, seed=46), randn(5, seed=47)
    args5 = (x5, v5, v5, v5, v5.abs() + 0.5, True, 0.1, 1e-5)
    assert ok(op, args5, "S(1), S(0), S(0), S(0), S(0) -> S(1), S(0), S(0)") is True
    assert ok(op, args5, "S(0), R, R, R, R -> S(0), R, R") is False  # batch statistics
    assert ok(aten.add_.Tensor, (randn(4, 6, seed=44), randn(4, 6, seed=45)), "P(sum), R -> P(sum)") is False


def test_malformed_rules_and_random_ops():
    x = randn(4, 6, seed=25)
    res = check_rule(aten.abs.default, (x,), {}, parse_rule("S(5) -> S(5)"))
    assert res.ok is False and "out of range" in res.reason
    assert ok(aten.abs.default, (x,), "S(0), S(0) -> S(0)") is False
    res = check_rule(aten.bernoulli.default, (torch.rand(4),), {}, parse_rule("S(0) -> S(0)"))
    assert res.ok is None and "random" in res.reason
    assert ground_truth(aten.bernoulli.default, (torch.rand(4),), {}).untestable


def test_run_rule_on_ranks_single_world_size():
    a, b = randn(4, 6, seed=26), randn(6, 5, seed=27)
    rule = parse_rule("S(1), S(0) -> P(sum)")
    assert run_rule_on_ranks(aten.mm.default, (a, b), {}, rule, 2).ok is True
    assert run_rule_on_ranks(aten.mm.default, (a, b), {}, rule, 3, seed=5, flipped=True).ok is True
    bad = run_rule_on_ranks(aten.mm.default, (a, b), {}, parse_rule("S(1), R -> P(sum)"), 2)
    assert bad.ok is False and "rank 0" in bad.reason


# ---------------------------------------------------------------- Partial construction


@pytest.mark.parametrize("reduce_op", ["sum", "avg", "max", "min"])
@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_partial_parts_reduce_to_the_value(reduce_op, world_size):
    x = randn(3, 5, seed=28).double()
    for draw in [(0, False), (1, False), (0, True)]:
        parts = torch.stack(make_parts(x, P(reduce_op), world_size, draw, salt=0))
        red = {"sum": parts.sum(0), "avg": parts.mean(0), "max": parts.amax(0), "min": parts.amin(0)}
        assert torch.allclose(red[reduce_op], x, rtol=1e-12, atol=1e-9)
        if reduce_op in ("max", "min"):  # exactly one holder per element, others strict
            holders = (parts == x).sum(0)
            assert torch.equal(holders, torch.ones_like(holders))


def test_flipped_draw_differs_from_its_source():
    x = randn(3, 5, seed=29).double()
    for op in ("sum", "max"):
        p0 = make_parts(x, P(op), 2, (0, False), salt=0)
        p1 = make_parts(x, P(op), 2, (0, True), salt=0)
        assert not torch.equal(p0[1], p1[1])
    holder0 = make_parts(x, P("max"), 3, (0, False), salt=0)[0] == x
    holder1 = make_parts(x, P("max"), 3, (0, True), salt=0)[0] == x
    assert not (holder0 & holder1).any()  # every element's holder moved


def test_flipped_max_min_draw_puts_exact_zeros_on_the_other_ranks():
    x = randn(3, 5, seed=32).double()
    for op, zero_side in (("max", x > 0), ("min", x < 0)):
        parts = torch.stack(make_parts(x, P(op), 3, (0, True), salt=0))
        others = parts != x
        # every non-holder part of an element whose value is beyond zero is exactly 0
        assert torch.equal(others & (parts == 0), others & zero_side.expand_as(others))


def test_count_nonzero_of_a_partial_max_is_not_a_partial_min():
    """count_nonzero(P(max)) -> P(min) holds as long as no rank's part is zero; on a 0-d
    input no value variant refutes it, only parts that hit zero do."""
    claimed = [parse_rule("P(max) -> P(min)"), parse_rule("P(min) -> P(min)")]
    rep = check_rules(aten.count_nonzero.default, (torch.tensor(1.5),), {}, claimed)
    assert [r for r, _ in rep.incorrect] == claimed


# ---------------------------------------------------------------- claimed vs truth


def test_check_rules_report():
    x, y = randn(4, 3, seed=30), randn(4, 3, seed=31)  # dim 0: 4 is even at W=2, not W=3
    claimed = [
        parse_rule("S(0), S(0) -> P(avg) [even]"),  # right
        parse_rule("S(1), S(1) -> P(avg)"),  # wrong: dim 1 (3) is uneven at W=2
        parse_rule("P(sum), R -> P(sum)"),  # wrong: squared error is not linear
    ]
    rep = check_rules(aten.mse_loss.default, (x, y, 1), {}, claimed)
    assert rep.confirmed == [claimed[0]]
    assert [r for r, _ in rep.incorrect] == claimed[1:]
    assert rep.precision == pytest.approx(1 / 3)
    # truth: S(0),S(0) and S(1),S(1) -> P(avg), each [even]; one of two found
    assert rule_set(rep.ground_truth.rules) == {"S(0), S(0) -> P(avg) [even]", "S(1), S(1) -> P(avg) [even]"}
    assert rule_set(rep.missed) == {"S(1), S(1) -> P(avg) [even]"}
    assert rep.recall == pytest.approx(0.5)
    assert rep.recall_by_class["R/S"] == pytest.approx(0.5)
    assert rep.recall_by_class["P(sum)"] is None
    assert set(rep.recall_by_class) == set(RECALL_CLASSES)
    assert rep.exhaustive


def test_check_rules_weaker_even_claim_is_confirmed():
    x = randn(4, 6, seed=32)
    claimed = [parse_rule("S(0) -> S(0) [even]"), parse_rule("S(1) -> S(1)"),
               parse_rule("P(max) -> P(max)"), parse_rule("P(sum) -> P(sum)")]
    rep = check_rules(aten.relu.default, (x,), {}, claimed)
    assert rep.weaker == [claimed[0]]
    assert rep.confirmed == claimed[:3]
    assert [r for r, _ in rep.incorrect] == [claimed[3]]
    assert rule_set(rep.missed) == {"P(min) -> P(min)"}
    assert rep.recall == pytest.approx(3 / 4)
    assert rep.recall_by_class["P(avg|max|min)"] == pytest.approx(1 / 2)
    assert rep.recall_by_class["P(sum)"] is None


def test_restricted_enumeration_keeps_candidates():
    a, b, c = randn(4, 6, seed=33), randn(4, 6, seed=34), randn(4, 6, seed=35)
    cand = SingleDimRule((P("sum"), P("sum"), P("sum")), (P("sum"),))
    gt = ground_truth(aten.addcmul.default, (a, b, c), {"value": 0.5}, max_combos=50, candidates=[cand])
    assert gt.exhaustive is False
    assert 50 < gt.combos_tested < 7 ** 3 - 1  # pairs + rank groups + candidate, not all
    names = rule_set(gt.valid)
    # addcmul = a + 0.5*b*c: three Partial(sum) inputs overcount a and the product
    assert "P(sum), P(sum), P(sum) -> P(sum)" not in names
    assert {"S(0), S(0), S(0) -> S(0)", "P(sum), P(sum), R -> P(sum)", "P(avg), R, R -> P(avg)"} <= names
    full = ground_truth(aten.addcmul.default, (a, b, c), {"value": 0.5})
    assert full.exhaustive and rule_set(gt.valid) <= rule_set(full.valid)


def test_replicate_output_prunes_implied_partials():
    # layer-norm mean/rstd only depend on x: with x replicated they are R, and R on
    # every rank also satisfies P(avg|max|min), which ground truth does not list.
    x, w, b = randn(4, 6, seed=36), randn(6, seed=37), randn(6, seed=38)
    gt = ground_truth(aten.native_layer_norm.default, (x, [6], w, b, 1e-5), {})
    names = rule_set(gt.rules)
    assert "R, P(sum), P(sum) -> P(sum), R, R" in names
    assert "R, P(sum), P(sum) -> P(sum), P(max), R" not in names
    assert ok(aten.native_layer_norm.default, (x, [6], w, b, 1e-5), "R, P(sum), P(sum) -> P(sum), P(max), R") is True
    assert "S(0), R, R -> S(0), S(0), S(0)" in names


def test_derived_samples_keep_non_contiguous_inputs_and_never_crash_the_checker():
    """A transposed input used to break the lone-zero sample (view(-1) on it raised);
    now every sample is built, and the checker judges the op's rules normally."""
    import torch

    from decompshard.verify.rank_sim import OpCase, _lone_zero

    x = torch.randn(3, 4).t()
    z = _lone_zero(x, 0)
    assert z.stride() == x.stride() and z[-1, -1] == 0 and int((z == 0).sum()) == 1
    case = OpCase(torch.ops.aten.mul.Tensor, (x, torch.randn(4, 3)), {})
    assert not case.untestable and "lone zero" in {s.name for s in case.samples}


# ---------------------------------------------------------------- kernels that disagree with themselves


def test_kernel_whose_value_depends_on_memory_layout_witnesses_no_rule():
    """CPU hardtanh_backward gives 0 for (grad -inf, self NaN) in its vectorised loop and
    -inf in its scalar loop (a strided tensor, or a contiguous tensor's tail), so on the
    NaN/inf sample a rank's shard disagreed with the global result for S(0), S(0) -> S(0),
    which holds elementwise by definition. That sample is now dropped with the reason;
    the rule is judged on the other samples, where wrong rules of the same op still fail."""
    from decompshard.verify.rank_sim import OpCase

    g = torch.full((16,), float("-inf"), dtype=torch.float64)
    x = torch.full((16,), float("nan"), dtype=torch.float64)
    strided = lambda t: torch.empty(t.shape + (2,), dtype=t.dtype)[..., 0].copy_(t)  # noqa: E731
    vec = aten.hardtanh_backward.default(g, x, -1.0, 1.0)
    scal = aten.hardtanh_backward.default(strided(g), strided(x), -1.0, 1.0)
    assert not torch.allclose(vec, scal, equal_nan=True)  # the premise: torch disagrees with itself

    args = (randn(5, 5), randn(5, 5, seed=1), -1.0, 1.0)
    case = OpCase(aten.hardtanh_backward.default, args, {})
    assert "special" not in {s.name for s in case.samples}
    assert any(d.startswith("special: ") and "depends on memory layout" in d for d in case.dropped), case.dropped
    assert {"base", "ties", "negated", "lone zero", "zeros"} <= {s.name for s in case.samples}
    op = aten.hardtanh_backward.default
    assert ok(op, args, "S(0), S(0) -> S(0)") is True
    assert ok(op, args, "S(1), S(1) -> S(1)") is True
    # deliberately wrong rules of the same op are still caught on the remaining samples
    assert ok(op, args, "S(0), R -> S(0)") is False  # grad sharded, self not: shapes disagree
    assert ok(op, args, "R, P(sum) -> P(sum)") is False  # not linear in self
    assert ok(op, args, "P(max), R -> P(max)") is True  # linear in grad, where self is inside (-1, 1)
    assert ok(op, args, "S(0), S(1) -> S(0)") is False

    # the caller's own data is never dropped: a kernel that disagrees with itself there
    # turns the probe off (nothing dropped, verdicts as before: conservative)
    case = OpCase(op, (g, x, -1.0, 1.0), {})
    assert not case.untestable and not any("memory layout" in d for d in case.dropped), case.dropped


def test_layout_consistent_kernels_keep_every_sample():
    """The layout probe must not drop samples of kernels that agree with themselves
    (non-contiguous inputs included), nor probe ops that read strides by definition."""
    from decompshard.verify.rank_sim import OpCase

    for op, args in [(aten.mul.Tensor, (randn(4, 6), randn(4, 6, seed=1))),
                     (aten.mm.default, (randn(5, 3).t(), randn(5, 4))),
                     (aten.hardtanh_backward.default, (randn(3), randn(3, seed=1), -1.0, 1.0))]:
        case = OpCase(op, args, {})
        assert not case.untestable and not case.dropped, (op, case.dropped)
        assert len(case.samples) == 6
    # CPU native_group_norm_backward reads every input as contiguous (garbage from a
    # strided one, whatever the values): the probe is off for it, no sample is dropped
    x = randn(2, 6, 3)
    w = randn(6, seed=2)
    _, mean, rstd = aten.native_group_norm.default(x, w, None, 2, 6, 3, 2, 1e-5)
    gn_args = (randn(2, 6, 3, seed=1), x, mean, rstd, w, 2, 6, 3, 2, [True, True, True])
    case = OpCase(aten.native_group_norm_backward.default, gn_args, {})
    assert not case.untestable and not any("memory layout" in d for d in case.dropped), case.dropped
    # as_strided reads x's memory layout by definition: a strided copy changes its values
    x = randn(4, 4)
    case = OpCase(aten.as_strided.default, (x, [2, 3], [3, 1], 1), {})
    assert not case.untestable and not any("memory layout" in d for d in case.dropped), case.dropped
