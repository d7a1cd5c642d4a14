"""Value signs the tracer records (dispatch_modes/signs.py) must hold on real data.

A wrong sign fact would turn into a wrong rule (P(max) * c -> P(max) with c < 0), so each
fact is checked by running the primitive on real tensors whose inputs satisfy the
stated input signs, special values (inf, NaN, -0.0) included.
"""

from __future__ import annotations

import pytest
import torch

from decompshard import derive_rules
from decompshard.dispatch_modes import trace
from decompshard.dispatch_modes.signs import NONNEG, NONPOS, UNKNOWN, ZERO, sign_of
from decompshard.rules import has_rule
from decompshard.verify.rule_check import check_rules

aten = torch.ops.aten
SPECIAL = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-30, 3.0, -3.0, 1e30]


def _values(sign: int, n: int = 64, seed: int = 0) -> torch.Tensor:
    """Random float64 values (special ones included) that have sign bits `sign`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.tensor(SPECIAL, dtype=torch.float64), torch.randn(n, generator=g, dtype=torch.float64) * 10])
    if sign == ZERO:
        return torch.where(torch.isnan(x), x, torch.zeros_like(x))
    if sign == NONNEG:
        return torch.where(torch.isnan(x), x, x.abs())
    if sign == NONPOS:
        return torch.where(torch.isnan(x), x, -x.abs())
    return x


def _holds(sign: int, out: torch.Tensor) -> bool:
    nan = torch.isnan(out)
    if sign & NONNEG and not bool((nan | (out >= 0)).all()):
        return False
    return not (sign & NONPOS and not bool((nan | (out <= 0)).all()))


CASES = [
    # (func, input signs, extra non-tensor args)
    (aten.relu.default, [UNKNOWN], ()),
    (aten.abs.default, [UNKNOWN], ()),
    (aten.exp.default, [UNKNOWN], ()),
    (aten.sqrt.default, [UNKNOWN], ()),
    (aten.sigmoid.default, [UNKNOWN], ()),
    (aten.neg.default, [NONNEG], ()),
    (aten.neg.default, [NONPOS], ()),
    (aten.clamp_min.default, [UNKNOWN], (0.0,)),
    (aten.clamp_min.default, [NONPOS], (2.0,)),
    (aten.clamp_min.default, [NONPOS], (-2.0,)),
    (aten.clamp_max.default, [UNKNOWN], (0.0,)),
    (aten.clamp_max.default, [NONNEG], (-1.0,)),
    (aten.clamp_max.default, [NONNEG], (5.0,)),
    (aten.clamp.default, [UNKNOWN], (1.0, -1.0)),  # min > max: everything becomes max
    (aten.clamp.default, [UNKNOWN], (0.0, 0.0)),
    (aten.clamp.default, [NONNEG], (-2.0, 2.0)),
    (aten.pow.Tensor_Scalar, [UNKNOWN], (2,)),
    (aten.pow.Tensor_Scalar, [UNKNOWN], (-2,)),
    (aten.mul.Tensor, [NONNEG, NONPOS], ()),
    (aten.mul.Tensor, [NONPOS, NONPOS], ()),
    (aten.mul.Tensor, [ZERO, UNKNOWN], ()),
    (aten.mul.Scalar, [NONNEG], (-0.5,)),
    (aten.div.Scalar, [NONPOS], (-4.0,)),
    (aten.add.Tensor, [NONNEG, NONNEG], ()),
    (aten.add.Tensor, [NONPOS, NONPOS], ()),
    (aten.sum.dim_IntList, [NONNEG], ([0],)),
    (aten.sum.dim_IntList, [NONPOS], ([0],)),
    (aten.sum.default, [ZERO], ()),
    (aten.amax.default, [NONPOS], ([0],)),
    (aten.amin.default, [NONNEG], ([0],)),
    (aten.prod.dim_int, [NONNEG], (0,)),
    (aten.prod.dim_int, [ZERO], (0,)),
]


@pytest.mark.parametrize("func,in_signs,extra", CASES, ids=[f"{c[0]}-{c[1]}-{c[2]}" for c in CASES])
def test_recorded_sign_holds_on_real_values(func, in_signs, extra):
    tensors = [_values(s, seed=i) for i, s in enumerate(in_signs)]
    args = (*tensors, *extra)
    out = func(*args)
    claimed = sign_of(func, args, {}, tuple(range(len(tensors))), tuple(in_signs), out.dtype)
    assert _holds(claimed, out), f"{func} claims sign bits {claimed}, real output {out}"


def test_signs_are_conservative_where_they_must_be():
    x, f = _values(UNKNOWN), torch.float64
    assert sign_of(aten.div.Scalar, (x, 0.0), {}, (0,), (NONNEG,), f) == UNKNOWN  # x / 0
    assert sign_of(aten.div.Tensor, (x, x + 1), {}, (0, 1), (NONNEG, NONNEG), f) == UNKNOWN  # -0.0 divisor
    assert sign_of(aten.mul.Tensor, (x, x), {}, (0, 1), (UNKNOWN, UNKNOWN), f) == UNKNOWN
    assert sign_of(aten.mul.Tensor, (x, x), {}, (0, 0), (UNKNOWN, UNKNOWN), f) == NONNEG  # x * x
    assert sign_of(aten.sin.default, (x,), {}, (0,), (NONNEG,), f) == UNKNOWN
    assert sign_of(aten.clamp_min.default, (x, float("nan")), {}, (0,), (UNKNOWN,), f) == UNKNOWN
    assert sign_of(aten.relu.default, (x.long(),), {}, (0,), (UNKNOWN,), torch.int64) == UNKNOWN  # ints: none
    # reductions: a sum / max / min keeps the sign, a product only ">= 0" (an empty product is 1)
    assert sign_of(aten.sum.dim_IntList, (x, [0]), {}, (0,), (NONPOS,), f) == NONPOS
    assert sign_of(aten.amax.default, (x, [0]), {}, (0,), (NONNEG,), f) == NONNEG
    assert sign_of(aten.prod.dim_int, (x, 0), {}, (0,), (ZERO,), f) == NONNEG
    assert torch.prod(torch.zeros(0, dtype=f), 0) == 1
    assert sign_of(aten.prod.dim_int, (x, 0), {}, (0,), (NONPOS,), f) == UNKNOWN


def test_tracer_records_signs_and_zero_constants():
    graph = trace(aten._prelu_kernel.default, (torch.randn(3), torch.randn(1)), {}, has_rule)
    by_op = {str(n.op): graph.values[n.outputs[0]].sign for n in graph.nodes}
    assert by_op["aten.relu.default"] == NONNEG and by_op["aten.clamp_max.default"] == NONPOS
    mul = next(n for n in graph.nodes if n.op is aten.mul.Tensor)
    assert mul.in_signs == (UNKNOWN, NONPOS)  # the weight's sign is unknown
    zeros = trace(aten.zeros_like.default, (torch.randn(3),), {}, has_rule)
    assert zeros.values[zeros.outputs[0]].zero
    assert not zeros.values[zeros.inputs[0]].zero


@pytest.mark.parametrize("x,w", [
    (torch.randn(5, 5), torch.tensor([[-1.0]])),
    (torch.randn(4, 6), torch.randn(6)),
    # mixed signs on purpose: on an all-negative x (randn(7) gave one, 1 in 128) with a
    # positive weight, P(min), R -> P(min) holds on every sample, so the ground truth
    # lists a rule the sign analysis cannot know
    (torch.tensor([-1.3, 0.4, -0.2, 2.1, -0.8, 0.9, -2.5]), torch.tensor([0.25])),
])
def test_prelu_flips_max_and_min_of_a_partial_weight(x, w):
    derived = derive_rules(aten._prelu_kernel.default, x, w)
    got = set(derived.as_strings())
    assert {"R, P(max) -> P(min)", "R, P(min) -> P(max)"} <= got
    assert "R, P(max) -> P(max)" not in got and "R, P(sum) -> P(sum)" not in got
    report = check_rules(aten._prelu_kernel.default, (x, w), {}, derived.rules)
    assert not report.incorrect and not report.missed


def test_a_cast_through_bool_or_int_forgets_the_sign():
    """x <= 0 cast to bool is True (1) where x < 0: a sign kept through the cast would
    claim P(max) * 1.0 -> P(min)."""
    def through(dtype):
        def f(x, w):
            nonpos = aten.clamp_max.default(x, 0)
            back = aten._to_copy.default(aten._to_copy.default(nonpos, dtype=dtype), dtype=torch.float32)
            return aten.mul.Tensor(w, back)
        return f

    for dtype in (torch.bool, torch.uint8, torch.int8):
        graph = trace(aten.mul.Tensor, (torch.randn(4), torch.randn(4)), {}, has_rule, decomp=through(dtype))
        mul = graph.nodes[-1]
        assert mul.in_signs[1] == UNKNOWN, dtype
    same = trace(aten.mul.Tensor, (torch.randn(4), torch.randn(4)), {}, has_rule,
                 decomp=lambda x, w: aten._to_copy.default(aten.clamp_max.default(x, 0), dtype=torch.float64))
    assert same.values[same.outputs[0]].sign == NONPOS  # float -> float keeps it
