"""The solver against brute force on random small programs.

The solver merges states and prunes dominated ones (propagate._undominated); brute force
follows every candidate input assignment through every matching rule, with no merging.
After dropping implied and dominated rules (as derive_rules does) both must agree.
"""

from __future__ import annotations

import itertools

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decompshard.solve.derive import _drop_implied
from decompshard.dispatch_modes import trace
from decompshard.placements import SingleDimRule
from decompshard.solve.propagate import _matches, constant_alphabet, input_alphabet, propagate
from decompshard.rules import has_rule, rules_for

aten = torch.ops.aten

UNARY = [aten.relu.default, aten.neg.default, aten.exp.default, aten.clone.default,
         lambda x: aten.sum.dim_IntList(x, [0], True), lambda x: aten.amax.default(x, [1], True),
         lambda x: aten.mul.Tensor(x, -2.0), lambda x: aten.clamp_max.default(x, 0)]
BINARY = [aten.add.Tensor, aten.mul.Tensor, aten.sub.Tensor, aten.maximum.default]

program = st.lists(
    st.tuples(st.booleans(), st.integers(0, 7), st.integers(0, 10), st.integers(0, 10)),
    min_size=1, max_size=5,
)


def _run(steps, inputs):
    pool = list(inputs)
    for binary, k, i, j in steps:
        a, b = pool[i % len(pool)], pool[j % len(pool)]
        if binary:
            pool.append(BINARY[k % len(BINARY)](a, b))
        else:
            pool.append(UNARY[k](a))
    return pool[-1], pool[-2] if len(pool) > 2 else pool[-1]


def _brute_force(graph) -> set[SingleDimRule]:
    allowed = {v: set(input_alphabet(graph, v)) for v in graph.inputs}
    allowed.update({v.id: constant_alphabet(v) for v in graph.values if v.kind == "const"})
    floating = {v.id for v in graph.values if v.meta.dtype.is_floating_point}
    found = set()
    for combo in itertools.product(*(sorted(allowed[v], key=str) for v in graph.inputs)):
        states = [(dict(zip(graph.inputs, combo)), False)]
        for node in graph.nodes:
            if node.constant:
                continue
            states = [
                (env, even or rule.even_only)
                for env0, even in states
                for rule in rules_for(node)
                for env in _matches(rule, node, env0, allowed, floating)
            ]
        for env, even in states:
            outs = tuple(None if v is None else env[v] for v in graph.outputs)
            found.add(SingleDimRule(combo, outs, even))
    return found


@settings(max_examples=60, deadline=None)
@given(program)
def test_solver_matches_brute_force(steps):
    inputs = (torch.randn(4, 6), torch.randn(4, 6))
    graph = trace(aten.add.Tensor, inputs, {}, has_rule, decomp=lambda x, y: _run(steps, (x, y)))
    solved = {SingleDimRule(s.inputs, s.outputs, s.even_only) for s in propagate(graph, rules_for).survivors}
    assert set(_drop_implied(solved)) == set(_drop_implied(_brute_force(graph)))


def test_unbind_copy_states_stay_few():
    """Five clones of replicated slices must not multiply into 4^5 weaker states."""
    graph = trace(aten.unbind_copy.int, (torch.randn(5, 5), 0), {}, has_rule)
    survivors = propagate(graph, rules_for).survivors
    assert len(survivors) < 40
    assert len({(s.inputs, s.outputs) for s in survivors}) == len(survivors)


# Independent inputs: each input runs through its own chain and the chains meet (or not)
# later. The solver keeps them in separate factors and joins them rule by rule at the
# node that reads them together; brute force enumerates every full assignment.
JOIN = [
    lambda xs: aten.cat.default(list(xs), 0),
    lambda xs: aten.cat.default(list(xs), 1),
    lambda xs: aten.stack.default(list(xs), 1),
    lambda xs: aten.add.Tensor(aten.add.Tensor(xs[0], xs[1]), xs[2]),
    lambda xs: aten.where.self(aten.gt.Scalar(xs[0], 0), xs[1], xs[2]),
    lambda xs: (xs[0], aten.mul.Tensor(xs[1], xs[2])),  # outputs stay partly independent
    lambda xs: (xs[0], xs[1]),  # the third input is never read
]

SHAPE_KEEPING = [0, 1, 2, 3, 6, 7]  # indices into UNARY: the joins need equal shapes
chains = st.tuples(
    st.lists(st.lists(st.sampled_from(SHAPE_KEEPING), max_size=2), min_size=3, max_size=3),
    st.integers(0, len(JOIN) - 1),
    st.lists(st.integers(0, 7), max_size=1),
)


def _run_chains(spec, inputs):
    per_input, join, tail = spec
    xs = []
    for x, steps in zip(inputs, per_input):
        for k in steps:
            x = UNARY[k](x)
        xs.append(x)
    out = JOIN[join](xs)
    if isinstance(out, tuple):
        return out
    for k in tail:
        out = UNARY[k](out)
    return out


@settings(max_examples=40, deadline=None)
@given(chains)
def test_independent_chains_match_brute_force(spec):
    inputs = (torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 6))
    graph = trace(aten.add.Tensor, inputs, {}, has_rule, decomp=lambda x, y, z: _run_chains(spec, (x, y, z)))
    solved = {SingleDimRule(s.inputs, s.outputs, s.even_only) for s in propagate(graph, rules_for).survivors}
    assert set(_drop_implied(solved)) == set(_drop_implied(_brute_force(graph)))


def test_survivors_carry_every_node_and_value():
    """A survivor joined from independent factors still names the rule it matched at every
    node and the placement of every value (explain and the local-shape check read them)."""
    xs = [torch.randn(3, 4) for _ in range(3)]
    graph = trace(aten.block_diag.default, (xs,), {}, has_rule)
    prop = propagate(graph, rules_for)
    assert prop.survivors
    for s in prop.survivors:
        assert len(s.path) == len(graph.nodes)
        for node, ri in zip(graph.nodes, s.path):
            if node.constant:
                continue
            rule = rules_for(node)[ri]
            assert tuple(s.env[v] for v in node.outputs if v is not None) == tuple(
                p for v, p in zip(node.outputs, rule.outputs) if v is not None)


def test_block_diag_rules_are_every_subset_not_every_product():
    """block_diag of n inputs: P(avg|max|min) on any non-empty subset of inputs (R on the
    rest; identical copies are valid parts) and all-P(sum), nothing else: 3 * (2^n - 1) + 1
    rules. Dead combinations (P(sum) next to P(max)) die at the last cat, where the
    independent inputs meet, and are counted without being built one by one."""
    from decompshard import derive_rules
    from decompshard.placements import P, R

    n = 6
    derived = derive_rules(aten.block_diag.default, [torch.randn(3, 4) for _ in range(n)])
    want = {(tuple([P("sum")] * n), (P("sum"),))}
    for op in ("avg", "max", "min"):
        for mask in itertools.product((False, True), repeat=n):
            if any(mask):
                want.add((tuple(P(op) if m else R for m in mask), (P(op),)))
    assert {(r.inputs, r.outputs) for r in derived.rules} == want
    last_cat = len(derived.graph.nodes) - 1
    assert any(r.node == last_cat for r in derived.rejected)


def test_a_fixed_candidate_dies_where_independent_inputs_meet():
    graph = trace(aten.block_diag.default, ([torch.randn(3, 4) for _ in range(3)],), {}, has_rule)
    from decompshard.placements import P, R

    prop = propagate(graph, rules_for, fixed_inputs=(P("sum"), R, P("max")))
    assert not prop.survivors
    assert max(r.node for r in prop.rejections) == len(graph.nodes) - 1
