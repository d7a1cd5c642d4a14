"""The solver's join, piece by piece, on tiny hand-built factors.

`propagate._join` is where a node meets the factors that placed its inputs: `_side`
groups each factor by what it gives the node, `_side_fits` picks a side's entries a rule
takes, `_fresh_lookup` places values read for the first time, `_takers` pairs rules with
combinations of entries, `_merged` and `_joined_entries` build the new entries. Each is
checked here on a node with a handful of entries, where the right answer can be written
down; the last test checks the whole join against a brute-force scan of every
combination of entries with `_matches` (the one-state semantics).
"""

from __future__ import annotations

import itertools

import torch

from decompshard.dispatch_modes.graph import PrimNode
from decompshard.placements import P, R, S, SingleDimRule
from decompshard.solve.propagate import (
    _DEC,
    _NO_FRESH,
    _Entry,
    _Factor,
    _code,
    _encoded,
    _fresh_lookup,
    _group,
    _join,
    _joined_entries,
    _matches,
    _merged,
    _side,
    _side_fits,
    _takers,
)

aten = torch.ops.aten
r, s0, s1 = _code(R), _code(S(0)), _code(S(1))
psum, pavg = _code(P("sum")), _code(P("avg"))


def _node(inputs: tuple[int, ...], outputs: tuple[int | None, ...], index: int = 7) -> PrimNode:
    return PrimNode(index, aten.add.Tensor, (), {}, inputs, outputs, False)


def _entry(env: dict[int, int], even: bool = False, path: tuple = (), sharded: bool | None = None) -> _Entry:
    if sharded is None:
        sharded = any(p in (s0, s1) for p in env.values())
    return _Entry(dict(env), even, path, sharded)


def _factor(*envs: dict[int, int], values: set[int] | None = None) -> _Factor:
    entries = [_entry(e, path=(k, i, ())) for i, e in enumerate(envs) for k in [100 + i]]
    return _Factor(values or set().union(*(e.keys() for e in envs)), entries)


# ------------------------------------------------------------------ grouping a factor


def test_group_keys_entries_by_placements_at_the_values_in_order():
    entries = [_entry({1: r, 2: s0}), _entry({1: s0, 2: s0}), _entry({1: r, 2: s0, 3: s1})]
    assert _group(entries, [1, 2]) == {(r, s0): [0, 2], (s0, s0): [1]}
    assert _group(entries, [2, 1]) == {(s0, r): [0, 2], (s0, s0): [1]}
    assert _group(entries, []) == {(): [0, 1, 2]}


def test_side_takes_the_positions_its_factor_placed():
    f, g = _factor({1: r}, {1: s0}), _factor({2: r})
    owner = {1: f, 2: g}
    inputs = (2, 1, 3)  # 3: read for the first time
    side = _side(inputs, f, owner, [True, False, True])
    assert (side.pos, side.groups, side.float_at, side.whole) == ((1,), {(r,): [0], (s0,): [1]}, [False], False)
    whole = _side((1, 1), f, owner, [True, True])  # a value read twice: still every input
    assert whole.pos == (0, 1) and whole.whole and whole.groups == {(r, r): [0], (s0, s0): [1]}


# ------------------------------------------------------------------ one side, one rule


def test_side_fits_exact_placements():
    f = _factor({1: r, 2: s0}, {1: s0, 2: s0}, {1: r, 2: r})
    side = _side((1, 2), f, {1: f, 2: f}, [True, True])
    assert _side_fits(side, (r, s0), False, 2, [True, True]) == [0]
    assert _side_fits(side, (s0, s0), False, 2, [True, True]) == [1]
    assert not _side_fits(side, (s1, s0), False, 2, [True, True])


def test_side_fits_reads_a_floating_r_as_p_avg_only_when_floating():
    f = _factor({1: r}, {1: pavg}, {1: psum})
    owner = {1: f}
    floating = _side((1,), f, owner, [True])
    assert _side_fits(floating, (pavg,), True, 1, [True]) == [0, 1]  # R reads as P(avg)
    assert _side_fits(floating, (psum,), False, 1, [True]) == [2]  # never as P(sum)
    integer = _side((1,), f, owner, [False])
    assert _side_fits(integer, (pavg,), True, 1, [False]) == [1]


def test_side_fits_at_part_of_the_inputs():
    f = _factor({1: r}, {1: s0})
    side = _side((9, 1), f, {1: f}, [True, True])  # 9 belongs to no factor
    assert _side_fits(side, (s1, s0), False, 2, [True, True]) == [1]  # only position 1 is the side's
    assert _side_fits(side, (s1, r), False, 2, [True, True]) == [0]


def test_a_short_rule_constrains_only_its_own_inputs():
    f = _factor({1: r}, {1: s0})
    owner = {1: f}
    first = _side((1, 2), f, owner, [True, True])  # the side placed input 0, which the rule covers
    assert _side_fits(first, (s0,), False, 2, [True, True]) == [1]
    # the side placed input 1, past the short rule's end: the key is shorter than the
    # groups', so nothing fits (as before the join was one implementation)
    second = _side((2, 1), f, owner, [True, True])
    assert not _side_fits(second, (s0,), False, 2, [True, True])


# ------------------------------------------------------------------ fresh placements


def test_fresh_lookup_places_new_values_and_reads_r_as_p_avg():
    allowed = {5: {r, s0, pavg}, 6: {r, s0}}
    node = _node((5, 6), (8,))
    fresh = _fresh_lookup(node, {}, allowed, floating={5, 6})
    assert fresh((s0, r)) == [({5: s0, 6: r}, True)]
    assert fresh((pavg, r)) == [({5: pavg, 6: r}, False), ({5: r, 6: r}, False)]
    assert fresh((psum, r)) == []  # not in 5's alphabet
    assert fresh((s0, r)) is fresh((s0, r))  # once per distinct wants


def test_fresh_lookup_with_every_input_owned_chooses_nothing():
    f = _factor({1: r})
    fresh = _fresh_lookup(_node((1, 1), (2,)), {1: f}, {}, floating={1})
    assert fresh((s0, s0)) is _NO_FRESH and _NO_FRESH == [({}, False)]


# ------------------------------------------------------------------ rules x combinations


def test_takers_pair_every_side_combination_a_rule_fits():
    f = _factor({1: r}, {1: s0})
    g = _factor({2: s0}, {2: r}, {2: s0, 4: r})
    owner = {1: f, 2: g}
    node = _node((1, 2), (3,))
    is_float = [True, True]
    sides = [_side(node.inputs, f, owner, is_float), _side(node.inputs, g, owner, is_float)]
    table = _encoded([
        SingleDimRule((R, R), (R,)),
        SingleDimRule((S(0), S(0)), (S(0),)),
        SingleDimRule((S(1), S(1)), (S(1),)),  # no entry fits
        SingleDimRule((R, S(0)), (S(0),)),
    ])
    takers = _takers(table, sides, 2, is_float, _fresh_lookup(node, owner, {}, {1, 2}))
    assert {combo: [ri for ri, _ in took] for combo, took in takers.items()} == {
        (0, 1): [0], (1, 0): [1], (1, 2): [1], (0, 0): [3], (0, 2): [3],
    }


def test_takers_with_no_side_have_the_one_empty_combination():
    node = _node((5,), (6,))
    table = _encoded([SingleDimRule((R,), (R,)), SingleDimRule((S(1),), (S(1),)), SingleDimRule((S(0),), (S(0),))])
    fresh = _fresh_lookup(node, {}, {5: {r, s0}}, {5})
    takers = _takers(table, [], 1, [True], fresh)
    assert list(takers) == [()]
    assert [(ri, a) for ri, a in takers[()]] == [(0, [({5: r}, False)]), (2, [({5: s0}, True)])]
    assert _takers(_encoded([SingleDimRule((S(1),), (S(1),))]), [], 1, [True], fresh) == {}


# ------------------------------------------------------------------ building entries


def test_merged_keeps_the_parts_order_and_their_flags():
    a = _Entry({1: r, 2: s0}, False, ("a",), True)
    b = _Entry({3: psum, 1: r}, True, ("b",), False)
    env, paths, even, sharded = _merged([a, b])
    assert list(env.items()) == [(1, r), (2, s0), (3, psum)] and paths == (("a",), ("b",))
    assert (even, sharded) == (True, True)
    one = _merged([b])
    assert one == (b.env, (("b",),), True, False) and one[0] is b.env  # caller copies
    assert _merged([]) == ({}, (), False, False)


def test_joined_entries_come_entry_major_then_rule_order():
    f = _factor({1: r}, {1: s0})
    f.entries[1].even = True  # a part's [even] carries over
    owner = {1: f}
    node = _node((1, 5), (3,), index=4)
    sides = [_side(node.inputs, f, owner, [True, True])]
    table = _encoded([
        SingleDimRule((S(0), R), (S(0),)),
        SingleDimRule((R, R), (R,)),
        SingleDimRule((R, S(1)), (S(1),), even_only=True),
    ])
    takers = _takers(table, sides, 2, [True, True], _fresh_lookup(node, owner, {5: {r, s1}}, {1, 5}))
    entries = _joined_entries(node, table, sides, takers)
    got = [(e.env, e.even, e.path, e.sharded) for e in entries]
    p0, p1 = f.entries[0].path, f.entries[1].path
    assert got == [
        ({1: r, 5: r, 3: r}, False, (4, 1, (p0,)), False),
        ({1: r, 5: s1, 3: s1}, True, (4, 2, (p0,)), True),
        ({1: s0, 5: r, 3: s0}, True, (4, 0, (p1,)), True),
    ]
    assert entries[0].env is not f.entries[0].env  # a copy: the factor's entry is untouched
    assert f.entries[0].env == {1: r}


def test_an_output_with_no_value_is_not_placed():
    node = _node((5,), (None, 6))
    table = _encoded([SingleDimRule((S(0),), (None, S(0)))])
    takers = _takers(table, [], 1, [True], _fresh_lookup(node, {}, {5: {s0}}, {5}))
    (e,) = _joined_entries(node, table, [], takers)
    assert e.env == {5: s0, 6: s0} and None not in e.env


# ------------------------------------------------------------------ the whole join


def _decode(env: dict) -> dict:
    return {v: _DEC[p] for v, p in env.items()}


def test_join_of_two_factors_and_a_fresh_input_matches_brute_force():
    """Every combination of entries x rule x fresh placement the one-state semantics
    (`_matches`) allows is built, in entry-major then rule order, and nothing else."""
    f = _factor({1: r}, {1: s0}, {1: pavg}, {1: s1})
    g = _factor({2: r, 4: s0}, {2: s0, 4: r}, {2: r, 4: r})
    owner = {1: f, 2: g, 4: g}
    rules = [
        SingleDimRule((R, R, R), (R,)),
        SingleDimRule((S(0), S(0), S(0)), (S(0),)),
        SingleDimRule((P("avg"), R, R), (P("avg"),)),
        SingleDimRule((P("avg"), P("avg"), R), (P("avg"),), even_only=True),
        SingleDimRule((R, S(0), S(1)), (S(0),)),
    ]
    allowed_p = {5: {R, S(0), S(1)}}
    allowed = {5: {_code(p) for p in allowed_p[5]}}
    floating = {1, 2, 5}
    node = _node((1, 2, 5), (3,))
    joined = _join(node, _encoded(rules), [f, g], owner, allowed, floating)

    expected, matched = [], set()
    for i, j in itertools.product(range(len(f.entries)), range(len(g.entries))):
        state = {**_decode(f.entries[i].env), **_decode(g.entries[j].env)}
        for ri, rule in enumerate(rules):
            for env in _matches(rule, node, state, allowed_p, floating):
                expected.append((env, rule.even_only, ri))
                matched.add((i, j))
    got = [(_decode(e.env), e.even, e.path[1]) for e in joined.entries]
    assert got == expected
    assert joined.matched == matched
    assert len(matched) < len(f.entries) * len(g.entries)  # some combinations die
