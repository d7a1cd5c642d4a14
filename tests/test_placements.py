"""The placement alphabet and the rule string format (a contract tools parse)."""

import pytest
from hypothesis import given, strategies as st

import itertools
import random

import torch

from decompshard.placements import (
    P, PARTIALS, R, S, SingleDimRule, StridedShard, check_placement_rows, format_placement, format_placement_rows,
    format_placements, format_rule, local_shape, parse_placement, parse_placement_rows, parse_placements, parse_rule,
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
    assert local_shape((5, 4), (S(0),), (3,), (2,)) == (1, 4)
    assert local_shape((5, 4), (P("sum"),), (3,), (2,)) == (5, 4)


# ------------------------------------------------------------------ the one grammar

KINDS = ("R", "S", "P", "None", "_S", "_S3")


def _draw(rng: random.Random, kind: str, ndim: int = 4):
    d = rng.randrange(ndim)
    return {"R": lambda: R, "S": lambda: S(d), "P": lambda: rng.choice(PARTIALS), "None": lambda: None,
            "_S": lambda: StridedShard(d, rng.randint(1, 12)),
            "_S3": lambda: StridedShard(d, rng.randint(1, 12), rng.randint(1, 12))}[kind]()


def test_format_then_parse_round_trips_for_every_kind():
    # a seeded property test: one placement, a list, a rule and per-tensor N-D rows, for
    # every placement kind the code can make, read back to what was written
    rng = random.Random(21)
    drawn = set()
    for _ in range(400):
        kinds = [rng.choice(KINDS) for _ in range(rng.randint(1, 6))]
        drawn |= set(kinds)
        ps = tuple(_draw(rng, k) for k in kinds)
        for p in ps:
            assert parse_placement(format_placement(p), strided=True) == p
            assert parse_placement(" " + format_placement(p).replace(",", " , ") + " ", strided=True) == p
        assert parse_placements(format_placements(ps), strided=True) == ps
        rule = SingleDimRule(ps, ps[::-1], even_only=rng.random() < 0.5)
        assert parse_rule(format_rule(rule), strided=True) == rule
        rows = tuple(tuple(_draw(rng, rng.choice(KINDS)) for _ in range(len(ps))) for _ in range(rng.randint(1, 4)))
        text = format_placement_rows(rows)
        assert " " not in text and parse_placement_rows(text) == rows
    assert drawn == set(KINDS)


def test_strided_shards_have_one_spelling_and_read_the_old_one():
    assert format_placement(StridedShard(1, 3)) == "_S(1, 3)"  # torch's str() of _StridedShard(1, split_factor=3)
    assert format_placement_rows([[StridedShard(1, 3), R]]) == "_S(1,3),R"
    for text in ("_S(1,3)", "_S( 1 , 3 )", "SS(1,3)", "SS(1, 3)"):
        assert parse_placement(text, strided=True) == StridedShard(1, 3)
    with pytest.raises(ValueError, match="only inside a traced decomposition"):
        parse_placement("SS(1,3)")  # an op's own rule: never strided


def test_placement_rows_are_checked_against_the_tensors():
    shapes = [(4,), (2, 6)]
    check_placement_rows(parse_placement_rows("S(0),P(sum);_S(1,3),R"), shapes, 2)
    for bad, why in [("S(0),R", "mesh placements for 2 tensor inputs"), ("S(0),R;R", "one per mesh dim"),
                     ("S(3),R;R,R", "out of range"), ("R,R;_S(2,2),R", "out of range"),
                     ("P(sum),P(max);R,R", "one Partial reduce op"), ("None,R;R,R", "cannot be None"),
                     ("_S(0,1),R;R,R", "split factor"), ("_S(0,2,2),R;R,R", "split factor")]:
        with pytest.raises(ValueError, match=why):
            check_placement_rows(parse_placement_rows(bad), shapes, 2)
    with pytest.raises(ValueError, match=r"input 1 \(mat\): expected 2 placements"):
        check_placement_rows(parse_placement_rows("R,R;R"), shapes, 2, names=["bias", "mat"])


def _check_rows(text, shapes, ndim):
    from decompshard.verify.dtensor_case import parse_placements

    return parse_placements(text, shapes, ndim)


def _explain_rows(text, shapes, ndim):
    from decompshard._compat import TensorMeta
    from decompshard.explain.analysis import parse_mesh_placements

    metas = [TensorMeta(torch.Size(s), (1,) * len(s), torch.float32) for s in shapes]
    return parse_mesh_placements(text, ndim, metas, [f"t{i}" for i in range(len(shapes))])


def _rule_rows(text, shapes, ndim):
    # each mesh dim's column, the tensors' placement texts as written, as a rule string
    from decompshard.torch_placements import to_torch_placement
    from decompshard.placements import split_top_level

    rows = [split_top_level(r, ",") for r in text.split(";")]
    cols = [parse_rule(", ".join(r[m] for r in rows) + " -> R", strided=True).inputs for m in range(ndim)]
    return tuple(tuple(to_torch_placement(cols[m][i]) for m in range(ndim)) for i in range(len(rows)))


def _random_rows(rng, shapes, ndim):
    rows = []
    for shape in shapes:
        op = rng.choice(PARTIALS)
        row = [rng.choice([R, op, S(rng.randrange(len(shape))), StridedShard(rng.randrange(len(shape)), rng.randint(2, 4))])
               for _ in range(ndim)]
        rows.append(row)
    return rows


def test_check_explain_and_rule_strings_accept_the_same_text():
    rng = random.Random(7)
    for _ in range(60):
        ndim = rng.randint(1, 3)
        shapes = [tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(1, 3))]
        text = format_placement_rows(_random_rows(rng, shapes, ndim))
        for variant in (text, text.replace(",", ", ").replace(";", " ; "), text.replace("_S(", "SS(")):
            check = _check_rows(variant, shapes, ndim)
            assert _explain_rows(variant, shapes, ndim) == check, variant
            assert _rule_rows(variant, shapes, ndim) == check, variant


@pytest.mark.parametrize("bad", ["R,X", "S(x),R", "P(mean),R", "S(-1),R", "Shard(0),R", "_S(0),R", "R,R,"])
def test_check_explain_and_rule_strings_reject_the_same_text(bad):
    with pytest.raises(ValueError, match="malformed placement"):
        _check_rows(bad, [(4, 4)], 2)
    with pytest.raises(ValueError, match="malformed placement"):
        _explain_rows(bad, [(4, 4)], 2)
    with pytest.raises(ValueError, match="malformed placement"):
        parse_rule(bad + " -> R", strided=True)


# ------------------------------------------------------------------ the one local-shape function


def test_local_shape_is_torchs_on_every_placement_kind():
    # our alphabet, N-D, uneven sizes and strided shards whose factor leaves the dim
    # uneven, against torch's _compute_local_shape_and_global_offset
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

    from decompshard.torch_placements import to_torch_placement

    rng = random.Random(3)
    for _ in range(300):
        nd = rng.randint(1, 3)
        mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        shape = tuple(rng.randint(0, 13) for _ in range(nd))
        ours = [rng.choice([R, rng.choice(PARTIALS), S(rng.randrange(nd)), StridedShard(rng.randrange(nd), rng.randint(2, 4))])
                for _ in mesh]
        theirs = [to_torch_placement(p) for p in ours]
        for coord in itertools.product(*(range(m) for m in mesh)):
            want = tuple(_compute_local_shape_and_global_offset(shape, mesh, list(coord), theirs)[0])
            assert local_shape(shape, ours, mesh, coord) == want, (shape, ours, mesh, coord)


def test_local_shape_of_an_inner_strided_shard_is_what_the_ranks_hold():
    # _S(d, sf, inner) has no torch form: the dim is sf blocks of `a` units of `inner`
    # elements, each block's units chunked over the ranks
    for sf, a, inner, w in itertools.product((1, 2, 3), (1, 4, 5), (1, 2, 3), (2, 3)):
        x = torch.arange(sf * a * inner).view(sf, a, inner)
        for r in range(w):
            held = torch.cat([blk.chunk(w, 0)[r] if r < len(blk.chunk(w, 0)) else blk[:0] for blk in x]).numel()
            assert local_shape((sf * a * inner, 7), (StridedShard(0, sf, inner),), (w,), (r,)) == (held, 7)
