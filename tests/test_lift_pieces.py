"""The best-first search's named pieces (mesh/lift.py) and the lower bound's (mesh/cost.py).

- Seeded random cases (ops with derived rules, 1-D/2-D/3-D meshes, Partial / strided /
  uneven placements): the search's order against brute force over every strategy.
- Each piece on cases small enough to check by hand or by brute force: the bound of a
  prefix is never above the exact cost of any completion, the key's rounding never lifts
  it above, the classes of equivalent choices cost alike, the early [even] check.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from decompshard.mesh import cost as C
from decompshard.mesh import lift
from decompshard.placements import format_rule
from decompshard.solve.derive import derive_rules

aten = torch.ops.aten
R, S0, S1 = Replicate(), Shard(0), Shard(1)
PSUM = Partial("sum")


# ------------------------------------------------------------------ seeded cases


def golden_cases():
    """(op, args, tensors, current, mesh) for the pinned cases: seeded, deterministic."""
    ops = [
        (aten.addmv.default, lambda: (torch.randn(7), torch.randn(7, 12), torch.randn(12))),
        (aten.addr.default, lambda: (torch.randn(8, 6), torch.randn(8), torch.randn(6))),
        (aten.mse_loss.default, lambda: (torch.randn(7, 3), torch.randn(7, 3))),
        (aten.pixel_shuffle.default, lambda: (torch.randn(2, 8, 3, 3), 2)),
        (aten.rot90.default, lambda: (torch.randn(16, 6), 1, [1, 0])),
        (aten.renorm.default, lambda: (torch.randn(9, 6), 2, 0, 1.0)),
        (aten.mse_loss_backward.default, lambda: (torch.randn(()), torch.randn(8, 5), torch.randn(8, 5), 1)),
        (aten.channel_shuffle.default, lambda: (torch.randn(2, 12, 5), 3)),
    ]
    rng = random.Random(21)
    for n in range(40):
        op, build = ops[n % len(ops)]
        torch.manual_seed(n)
        args = build()
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        n_dims = (1, 2, 3)[n % 3]
        sizes = tuple(rng.choice([1, 2, 3, 4]) for _ in range(n_dims))
        flattened = (tuple(range(n_dims)),) if n_dims > 1 and rng.random() < 0.3 else ()

        def placement(t):
            options = [R, R, PSUM, Partial("max"), Partial("avg")]
            if t.dim():
                d = rng.randrange(t.dim())
                options += [Shard(d), Shard(d), Shard(-1), _StridedShard(d, split_factor=2)]
            return rng.choice(options)

        current = [tuple(placement(t) for _ in sizes) for t in tensors]
        yield op, args, tensors, current, C.MeshShape(sizes, flattened=flattened)


def test_the_search_yields_the_brute_force_order_on_seeded_cases():
    """On every seeded case small enough to enumerate: the keys `cheapest_first` yields
    never decrease, and the first is the least key of all full strategies (each priced
    independently of the search's tables). An expected answer computed here, not recorded
    from the code under test."""
    checked = 0
    for op, args, tensors, current, mesh in golden_cases():
        choices = lift.candidate_rules(derive_rules(op, *args), len(tensors))
        if len(choices) ** mesh.ndim > 600:
            continue
        exact = _exact_keys(choices, tensors, current, mesh)
        yielded = [lift.candidate_key(cost, tuple(choices.index(r) for r in combo))
                   for combo, _, _, cost in itertools.islice(lift.cheapest_first(choices, tensors, current, mesh), 40)]
        assert yielded == sorted(yielded), (op, current, mesh.sizes)
        assert yielded[0] == min(exact.values()), (op, current, mesh.sizes)
        checked += 1
    assert checked >= 20


# ------------------------------------------------------------------ the search's pieces


def _problem(op, args, current, sizes, flattened=()):
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    derived = derive_rules(op, *args)
    choices = lift.candidate_rules(derived, len(tensors))
    mesh = C.MeshShape(sizes, flattened=flattened)
    return derived, choices, tensors, mesh, lift.search_tables(choices, tensors, current, mesh)


def _exact_keys(choices, tensors, current, mesh, raw=False):
    """Every full strategy's exact `candidate_key` (`raw`: unrounded), priced
    independently of the tables."""
    out = {}
    for order in itertools.product(range(len(choices)), repeat=mesh.ndim):
        ins, _ = lift.expand(tuple(choices[c] for c in order), current)
        cost = C.Cost()
        for t, src, dst in zip(tensors, current, ins):
            cost = cost + C.redistribute_cost(tuple(t.shape), t.element_size(), tuple(src), dst, mesh)
        out[order] = ((not cost.dtensor_supported, cost.total_seconds, len(cost.collectives), cost.bytes_moved)
                      if raw else lift.candidate_key(cost, order))
    return out


ADMISSIBLE_CASES = [
    (aten.addmv.default, (torch.randn(7), torch.randn(7, 12), torch.randn(12)), [(R, S0), (S1, PSUM), (S0, R)], (2, 3), ()),
    (aten.addmv.default, (torch.randn(8), torch.randn(8, 12), torch.randn(12)), [(PSUM, R), (S0, S1), (R, S0)], (2, 2), ((0, 1),)),
    (aten.mse_loss.default, (torch.randn(7, 6), torch.randn(7, 6)), [(S0, S1, R), (Partial("max"), S0, S1)], (2, 2, 2), ((0, 1, 2),)),
    (aten.rot90.default, (torch.randn(16, 6), 1, [1, 0]), [(S0, R, _StridedShard(1, split_factor=2))], (2, 4, 2), ()),
    (aten.pixel_shuffle.default, (torch.randn(2, 8, 3, 3), 2), [(S1, Shard(2), Partial("avg"))], (3, 2, 1), ()),
]


@pytest.mark.parametrize("op,args,current,sizes,flattened", ADMISSIBLE_CASES)
def test_prefix_bound_never_exceeds_any_completion(op, args, current, sizes, flattened):
    """Brute force: for every prefix (the empty one and every full strategy included),
    each component of its key is <= that of every completion's exact key, and so are the
    unrounded bound's (what makes the search's order the sorted enumeration's)."""
    _, choices, tensors, mesh, tables = _problem(op, args, current, sizes, flattened)
    exact = _exact_keys(choices, tensors, current, mesh)
    raw = _exact_keys(choices, tensors, current, mesh, raw=True)
    tight = 0
    for k in range(mesh.ndim + 1):
        for prefix in itertools.product(range(len(choices)), repeat=k):
            bound = lift.prefix_bound(tables, prefix)
            key = lift.prefix_key(bound, prefix)
            completions = [prefix + rest for rest in itertools.product(range(len(choices)), repeat=mesh.ndim - k)]
            least = [min(exact[o][j] for o in completions) for j in range(4)]
            assert all(key[j] <= least[j] for j in range(4)), (prefix, key, least)
            least_raw = [min(raw[o][j] for o in completions) for j in range(4)]
            assert all(bound[j] <= least_raw[j] * (1 + 1e-12) + 1e-15 for j in range(4)), (prefix, bound, least_raw)
            tight += k == mesh.ndim and key[:4] == tuple(least)
    # and it is not trivially low: without fused groups (where a dim is charged a share
    # only), some full strategies' bounds tie with their cost
    assert tight or flattened


def test_prefix_key_rounding_never_lifts_a_bound_above_the_exact_key():
    """Bounds are float sums in another order than the exact model's: a bound equal to
    the exact value but for ~1e-14 relative noise must not round above the exact key.
    The cases are picked where plain rounding would (so the test can fail)."""
    lifted = {"seconds": 0, "count": 0, "bytes": 0}
    for k in range(1, 200):
        secs = (k + 0.5) * 1e-9  # a rounding boundary: nudge down until it rounds down
        while round(secs, C.SECONDS_DIGITS) > k * 1e-9 + 1e-12:
            secs = math.nextafter(secs, 0.0)
        # 10 significant digits and a half (exact in binary), less one ulp: rounds down
        nbytes = math.nextafter(1234567890.5 + 10 * k, 0.0)
        exact = (round(secs, C.SECONDS_DIGITS), k, C.bytes_key(nbytes))
        bound = (False, secs * (1 + 1e-14), k * (1 + 2e-16) + 1e-15, nbytes * (1 + 1e-14))
        key = lift.prefix_key(bound, ())
        assert key[0] is False and key[1:4] <= exact and key[1] <= exact[0] and key[3] <= exact[2], (k, key, exact)
        assert key[2] == k  # a count of k less float noise is k: no higher, and no lower
        lifted["seconds"] += round(bound[1], C.SECONDS_DIGITS) > exact[0]
        lifted["count"] += math.ceil(bound[2]) > exact[1]
        lifted["bytes"] += C.bytes_key(bound[3]) > exact[2]
    assert all(lifted.values()), lifted
    # and a fractional count (shares of fused collectives) is rounded up to a whole one
    assert lift.prefix_key((True, 0.0, 0.5, 0.0), (3,)) == (True, 0.0, 1, 0.0, (3,))
    assert lift.prefix_key((False, 0.0, 2.25, 0.0), ()) [2] == 3


def test_remaining_bounds_by_hand():
    bounds = [[(False, 1.0, 1.0, 10.0), (False, 2.0, 0.0, 5.0)],
              [(True, 3.0, 1.0, 1.0), (True, 1.0, 2.0, 2.0)]]
    rest = lift.remaining_bounds(bounds)
    assert rest[2] == lift.ZERO_BOUND
    assert rest[1] == (True, 1.0, 1.0, 1.0)  # every choice of dim 1 is unsupported
    assert rest[0] == (True, 2.0, 1.0, 6.0)  # per component, not per choice


def test_search_tables_are_consistent():
    current = [(R, S0), (S1, PSUM), (S0, R)]
    _, choices, tensors, mesh, t = _problem(aten.addmv.default, (torch.randn(8), torch.randn(8, 12), torch.randn(12)),
                                            current, (2, 2))
    for m in range(mesh.ndim):
        for c, rule in enumerate(choices):
            ins, outs = lift.expand((rule,) * mesh.ndim, current)
            assert t.cols[m][c] == (tuple(i[m] for i in ins), tuple(None if o is None else o[m] for o in outs))
            for i in range(len(tensors)):
                assert t.unknown[i][m][t.tid[m][c][i]] == t.model[m][c][i]
    # the members of the classes partition the choices, each class led by its lowest
    for m in range(mesh.ndim):
        flat = sorted(c for g in t.members[m].values() for c in g)
        assert flat == list(range(len(choices)))
        assert all(g[0] == lead and g == sorted(g) for lead, g in t.members[m].items())


def test_equivalent_choices_cost_the_same_in_every_strategy():
    current = [(R, R), (R, S1), (R, S0)]  # Replicate on mesh dim 0: P(avg|max|min) there is free
    _, choices, tensors, mesh, t = _problem(aten.addmv.default, (torch.randn(8), torch.randn(8, 12), torch.randn(12)),
                                            current, (2, 2))
    assert any(len(g) > 1 for g in t.members[0].values())  # there is something to merge
    exact = _exact_keys(choices, tensors, current, mesh)
    for g in t.members[0].values():
        for other in range(len(choices)):
            assert len({exact[(c, other)][:4] for c in g}) == 1, (g, other)
    # a mesh dim of size 1: every non-shard target is free there
    _, _, _, _, t1 = _problem(aten.addmv.default, (torch.randn(8), torch.randn(8, 12), torch.randn(12)),
                              [(PSUM, R), (S0, R), (R, R)], (1, 2))
    assert len(t1.members[0]) < len(choices)


def test_dim_alone_bounds_are_zero_when_a_choice_keeps_the_inputs():
    args = (torch.randn(8), torch.randn(8, 12), torch.randn(12))
    _, choices, _, _, t = _problem(aten.addmv.default, args, [(PSUM, R), (S1, S0), (S0, S0)], (2, 2))
    assert lift.dim_alone_bounds(t, 0) == [lift.ZERO_BOUND]  # P(sum), S(1), S(0) -> P(sum) keeps them
    per_choice = lift.dim_alone_bounds(t, 1)  # no rule has P(sum), S(0), S(0): every choice moves one
    assert len(per_choice) == len(choices) and all(b != lift.ZERO_BOUND for b in per_choice)
    assert all(b[1] > 0 for b in per_choice)


def test_cuts_unevenly_and_expand_prefix():
    """mse_loss of 7 rows on 4 ranks: the [even] S(0) rule cannot run on mesh dim 0, so
    with `even` the expansion leaves it out; of 8 rows, it stays (8 columns: S(1) stays)."""
    for rows, cut in ((7, True), (8, False)):
        args = (torch.randn(rows, 8), torch.randn(rows, 8))
        derived, choices, _, mesh, t = _problem(aten.mse_loss.default, args, [(S0,), (S0,)], (4,))
        even = [derived.surely_even(r) for r in choices]
        c = next(c for c, r in enumerate(choices) if format_rule(r) == "S(0), S(0) -> P(avg) [even]")
        assert even[c] and lift.cuts_unevenly(t, even, (c,)) is cut
        assert not lift.cuts_unevenly(t, even, (0,))  # all-Replicate shards nothing
        full = list(lift.expand_prefix(t, (), None))
        assert [e[1] for e in full] == [(x,) for x in t.members[0]]  # one child per class, rule order
        assert all(e[0] == lift.prefix_key(lift.prefix_bound(t, e[1]), e[1]) and e[2] is None for e in full)
        pruned = [e[1] for e in lift.expand_prefix(t, (), even)]
        assert ((c,) not in pruned) is cut and len(pruned) == len(full) - cut


def test_priced_entry_stands_for_its_class():
    args = (torch.randn(8), torch.randn(8, 12), torch.randn(12))
    current = [(R, R), (R, S1), (R, S0)]
    _, choices, tensors, mesh, t = _problem(aten.addmv.default, args, current, (2, 2))
    lead = next(c for c, g in t.members[0].items() if len(g) > 1)
    key, order, (cost, bare, same) = lift.priced_entry(t, (lead, 0))
    assert order == (lead, 0) and key == bare + ((lead, 0),)
    assert key == lift.candidate_key(lift.price(t, (lead, 0)), (lead, 0))
    assert key == _exact_keys(choices, tensors, current, mesh)[(lead, 0)]
    assert list(same) == [(c, x) for c in t.members[0][lead] for x in t.members[1][0]][1:]


# ------------------------------------------------------------------ the lower bound's pieces


def _pl(p, ndim=2):
    return C.model_placement(p, ndim)


def test_first_collective_by_hand():
    s0, s1, r, psum = _pl(S0), _pl(S1), _pl(R), _pl(PSUM)
    assert C._first_collective(s0, r, 100.0, 4) == (C.ALL_GATHER, 400.0)  # gathered output
    assert C._first_collective(s0, psum, 100.0, 4) == (C.ALL_GATHER, 400.0)  # via Replicate
    assert C._first_collective(psum, r, 100.0, 4) == (C.ALL_REDUCE, 100.0)
    assert C._first_collective(psum, s0, 100.0, 4) == (C.ALL_TO_ALL, 100.0)  # reduce-scatter or worse
    assert C._first_collective(s0, s1, 100.0, 4) == (C.ALL_TO_ALL, 100.0)


def test_local_work_bound_by_hand():
    shape, bw = (8, 6), C.H100.memory_bandwidth
    sliced = C._local_work_bound(shape, 4, _pl(S0), 4, [[]], 1, C.H100)  # 2 x 6 floats copied
    assert sliced == C.CostBound(False, 96 / bw, 0.0, 96.0)
    divided = C._local_work_bound(shape, 4, _pl(PSUM), 4, [[]], 1, C.H100)  # the whole 8 x 6 divided
    assert divided == C.CostBound(False, 384 / bw, 0.0, 384.0)
    assert C._local_work_bound(shape, 4, _pl(Partial("max")), 4, [[]], 1, C.H100) == C.CostBound()
    assert C._local_work_bound(shape, 4, _pl(S0), 4, [], 1, C.H100) == C.CostBound()  # no pass runs it
    # the least of the passes: another dim dividing dim 1 by 3 in one of them
    assert C._local_work_bound(shape, 4, _pl(S0), 4, [[], [(1, 3)]], 1, C.H100).bytes == 2 * 2 * 2 * 4
    # exact where it is the whole story: R -> S(0) on one mesh dim
    exact = C.redistribute_cost(shape, 4, [R], [S0], C.MeshShape((4,)))
    assert (exact.total_seconds, exact.bytes_moved) == (sliced.seconds, sliced.bytes)


def test_local_work_passes_by_hand():
    row = lambda src, dst: C.target_row(_pl(src), _pl(dst), 2)  # noqa: E731
    assert C._local_work_passes(_pl(S0), 1, [row(R, R)], False) == {False}
    assert C._local_work_passes(_pl(PSUM), 1, [row(S0, S0)], True) == {True}
    # Shard(1) target with dim 0 kept at S(0): the nesting of tensor dim 1 is kept
    assert C._local_work_passes(_pl(S1), 1, [row(S0, S0)], True) == {True}
    # dim 0 moving S(1) -> S(0): the nesting of tensor dim 1 differs, first-to-last only
    assert C._local_work_passes(_pl(S1), 1, [row(S1, S0)], True) == {False}


def test_fused_share_bound_by_hand():
    t = C.H100
    b = C._fused_share_bound(_pl(R), 2, 1000.0, 4, t)
    assert b == C.CostBound(False, t.collective_launch_latency / 4 + min(t.intra_node_latency, t.inter_node_latency),
                            0.25, 0.5 * 1000.0 / 4)
    assert C._fused_share_bound(_pl(PSUM), 2, 1000.0, 4, t).unsupported


def test_collective_bound_is_the_exact_cost_of_one_plain_collective():
    """One mesh dim, no copies: the bound is the collective itself, to the bit."""
    mesh = C.MeshShape((4,))
    for src, dst in ((S0, R), (PSUM, R), (S0, S1), (PSUM, S0)):
        a, b = _pl(src), _pl(dst)
        got = C._collective_bound((64, 64), 4, [a], [b], 0, mesh, C.H100, [], a.kind == "S")
        exact = C.redistribute_cost((64, 64), 4, [src], [dst], mesh)
        assert got.collectives == len(exact.collectives) == 1
        assert got.seconds <= exact.total_seconds and got.bytes <= exact.bytes_moved
        if (src, dst) in ((PSUM, R), (S0, S1)):  # no chunk copy on the outermost dim
            assert (got.seconds, got.bytes) == (exact.total_seconds, exact.bytes_moved), (src, dst)
    assert C._chunk_copy_bytes((8, 6), 4, [], (), 0) == 0.0  # dim 0 is outermost: no copy
    assert C._chunk_copy_bytes((8, 6), 4, [], (), 1) == 2 * 48 * 4  # gathering dim 1 copies
