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

from decompshard.derive import _drop_implied
from decompshard.dispatch_modes import trace
from decompshard.placements import SingleDimRule
from decompshard.propagate import _matches, constant_alphabet, input_alphabet, propagate
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
