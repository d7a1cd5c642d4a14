"""The placement alphabet and the rule string format (a contract tools parse)."""

import pytest
from hypothesis import given, strategies as st

from decompshard.placements import (
    P, R, S, SingleDimRule, format_rule, local_shape, parse_placement, parse_rule,
    shard_size_and_offset,
)

placement = st.one_of(
    st.just(R), st.builds(S, st.integers(0, 5)), st.sampled_from([P("sum"), P("avg"), P("max"), P("min")])
)


@given(st.lists(placement, min_size=1, max_size=6), st.lists(st.one_of(placement, st.none()), min_size=1, max_size=3), st.booleans())
def test_rule_string_round_trips(ins, outs, even):
    rule = SingleDimRule(tuple(ins), tuple(outs), even_only=even)
    text = format_rule(rule)
    back = parse_rule(text)
    assert back == rule and back.even_only == even
    assert format_rule(back) == text


def test_documented_examples_parse():
    r = parse_rule("P(sum), S(1), S(0) -> P(sum)")
    assert r.inputs == (P("sum"), S(1), S(0)) and r.outputs == (P("sum"),) and not r.even_only
    r = parse_rule("S(0), S(0) -> P(avg) [even]")
    assert r.even_only and r.outputs == (P("avg"),)
    assert parse_rule("S(0) -> S(0), None").outputs == (S(0), None)


@pytest.mark.parametrize("bad", ["Shard(0)", "S(x)", "P(prod)", "S(-1)", "", "R R", "P(sum"])
def test_malformed_placements_raise_value_error(bad):
    with pytest.raises(ValueError):
        parse_placement(bad)


@pytest.mark.parametrize("bad", ["R", "R -> R -> R", "S(0) => S(0)"])
def test_malformed_rules_raise_value_error(bad):
    with pytest.raises(ValueError):
        parse_rule(bad)


def test_shard_geometry_matches_dtensor():
    from torch.distributed.tensor.placement_types import Shard

    for n in range(0, 13):
        for w in (1, 2, 3, 4, 5):
            sizes = []
            for r in range(w):
                got = shard_size_and_offset(n, w, r)
                assert got == tuple(Shard.local_shard_size_and_offset(n, w, r))
                sizes.append(got[0])
            assert sum(sizes) == n
    assert local_shape((5, 4), S(0), 3, 2) == (1, 4)
    assert local_shape((5, 4), P("sum"), 3, 2) == (5, 4)
