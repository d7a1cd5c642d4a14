"""The solver: which input placements flow through a recorded graph with no redistribution.

A state is a partial assignment: placements of the op's inputs seen so far plus the
placements of values still live. Nodes are visited in recorded (topological) order; at
each node every rule whose inputs match the state exactly extends it (assigning graph
inputs the node reads for the first time), and a state no rule matches dies there — the
death is recorded as a Rejection, which `explain` turns into a readable reason. States
equal on everything still needed are merged, which keeps ops with 4-6 inputs fast.

The solver never asks where a rule came from and never re-runs the decomposition.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .dispatch_modes.graph import PrimGraph, PrimNode
from .placements import MaybePlacement, P, Placement, R, SingleDimRule, alphabet, is_partial

UNSET = object()  # graph input not read yet
MAX_REJECTIONS = 2000


@dataclass(frozen=True)
class Rejection:
    """A candidate (possibly partial: None = not yet decided) that died at `node`."""

    inputs: tuple[MaybePlacement, ...]
    node: int
    arriving: tuple[MaybePlacement, ...]  # placements of the node's inputs (None: undecided)


@dataclass
class Survivor:
    """A full candidate: input placements, output placements, and how it got there."""

    inputs: tuple[MaybePlacement, ...]
    outputs: tuple[MaybePlacement, ...]
    even_only: bool
    env: dict[int, MaybePlacement]  # placement of every value it touched
    path: tuple[int, ...]  # index of the matched rule in each node's table


@dataclass
class Propagation:
    survivors: list[Survivor] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    n_rejections: int = 0


@dataclass
class _State:
    env: dict[int, MaybePlacement]
    even: bool
    path: tuple[int, ...]


def input_alphabet(graph: PrimGraph, vid: int) -> tuple[Placement, ...]:
    """Placements a graph input may take: no Partial for integer/bool tensors."""
    meta = graph.meta(vid)
    return alphabet(len(meta.shape), partials=meta.dtype.is_floating_point or meta.dtype.is_complex)


def constant_alphabet(value) -> set:
    """A constant is created by the same code on every rank, so every rank holds the same
    value c. That is Replicate, and also P(avg), P(max), P(min) of c (the average, max and
    min of identical copies is c); only an all-zeros constant is also P(sum)."""
    if not (value.meta.dtype.is_floating_point or value.meta.dtype.is_complex):
        return {R}
    out = {R, P("avg")} | ({P("sum")} if value.zero else set())
    if not value.meta.dtype.is_complex:
        out |= {P("max"), P("min")}
    return out


def propagate(
    graph: PrimGraph,
    rules_for: Callable[[PrimNode], Sequence[SingleDimRule]],
    fixed_inputs: Sequence[MaybePlacement] | None = None,
) -> Propagation:
    """Every assignment of input placements that matches a rule at every node.

    With `fixed_inputs` (one placement per graph input) only that candidate is followed,
    which is what `explain` and the lift's re-check need.
    """
    result = Propagation()
    allowed = {v: set(input_alphabet(graph, v)) for v in graph.inputs}
    allowed.update({v.id: constant_alphabet(v) for v in graph.values if v.kind == "const"})
    env0: dict[int, MaybePlacement] = {}
    floating = {v.id for v in graph.values if v.meta.dtype.is_floating_point}
    if fixed_inputs is not None:
        for v, p in zip(graph.inputs, fixed_inputs):
            if p not in allowed[v] and p is not None:
                result.rejections.append(Rejection(tuple(fixed_inputs), -1, (p,)))
                result.n_rejections += 1
                return result
            env0[v] = p
    live_after = _live_after(graph)
    input_ids = set(graph.inputs)
    states = [_State(env0, False, ())]

    for node in graph.nodes:
        if node.constant:  # made locally, identical on every rank: see constant_alphabet
            for st in states:
                st.path += (0,)
            continue
        table = rules_for(node)
        nxt: dict[tuple, _State] = {}
        for st in states:
            matched = False
            for ri, rule in enumerate(table):
                for env in _matches(rule, node, st.env, allowed, floating):
                    matched = True
                    new = _State(env, st.even or rule.even_only, st.path + (ri,))
                    live = tuple(env.get(v) for v in live_after[node.index])
                    nxt.setdefault((live, new.even), new)
            if not matched:
                result.n_rejections += 1
                if len(result.rejections) < MAX_REJECTIONS:
                    result.rejections.append(
                        Rejection(
                            tuple(st.env.get(v) for v in graph.inputs),
                            node.index,
                            tuple(st.env.get(v) for v in node.inputs),
                        )
                    )
        states = _undominated(nxt, live_after[node.index], input_ids, floating)
        if not states:
            return result

    seen: set[tuple] = set()
    for st in states:
        choices = [
            (st.env[v],) if v in st.env else tuple(sorted(allowed[v], key=_order))
            for v in graph.inputs
        ]
        for combo in itertools.product(*choices):
            env = dict(st.env)
            env.update(zip(graph.inputs, combo))
            outs = tuple(None if v is None else env.get(v, R) for v in graph.outputs)
            key = (combo, outs, st.even)
            if key in seen:
                continue
            seen.add(key)
            result.survivors.append(Survivor(combo, outs, st.even, env, st.path))
    return result


# A replicated value is also a valid P(avg), P(max) and P(min) (every rank holds the true
# value, and the average / max / min of identical copies is that value). So a rule that
# wants one of those accepts R as it is — no data moves.
_R_SATISFIES = {P("avg"), P("max"), P("min")}


def _undominated(states: dict[tuple, _State], live: tuple[int, ...], inputs: set, floating: set) -> list[_State]:
    """Drop a state that differs from another only by holding P(avg|max|min) where the
    other holds R on some intermediate or output value (a rule that wants P(avg) on a
    Replicate value makes such copies: unbind_copy's five clones made 4^5 of them).
    Every rule that accepts the P value accepts R too, and both have full local shapes,
    so the R state reaches everything the P state does, and its rules dominate (see
    derive._drop_implied). Graph inputs are never promoted: they name the candidate."""
    promotable = [v not in inputs and v in floating for v in live]
    out = []
    for (placements, even), st in states.items():
        promoted = tuple(
            R if can and p in _R_SATISFIES else p for can, p in zip(promotable, placements)
        )
        if promoted != placements and ((promoted, False) in states or (even and (promoted, True) in states)):
            continue
        out.append(st)
    return out


def _live_after(graph: PrimGraph) -> list[tuple[int, ...]]:
    """For each node, the values whose placement still matters after it: inputs and
    outputs of the op, and anything a later node reads. States equal on these merge."""
    last_use = graph.last_use()
    keep = set(graph.inputs) | {v for v in graph.outputs if v is not None}
    candidates = sorted(keep | set(last_use))
    return [
        tuple(v for v in candidates if v in keep or last_use.get(v, -1) > node.index)
        for node in graph.nodes
    ]


def _matches(rule: SingleDimRule, node: PrimNode, env: dict, allowed: dict, floating: set) -> list[dict]:
    """Every way `rule` extends the state at `node` (none if it does not fit)."""
    envs = [env]
    for v, want in zip(node.inputs, rule.inputs):
        nxt = []
        for e in envs:
            have = e.get(v, UNSET)
            if have is UNSET:
                if v in allowed and want in allowed[v]:
                    nxt.append({**e, v: want})
                if want in _R_SATISFIES and v in floating and R in allowed.get(v, ()):
                    nxt.append({**e, v: R})
            elif have == want or (have == R and want in _R_SATISFIES and v in floating):
                nxt.append(e)
        envs = nxt
        if not envs:
            return []
    out = []
    for e in envs:
        e = dict(e)
        for v, p in zip(node.outputs, rule.outputs):
            if v is not None:
                e[v] = p
        out.append(e)
    return out


def _order(p: Placement) -> tuple:
    """R first, then shards by dim, then partials: the order rules are listed in."""
    if p == R:
        return (0, 0, "")
    if is_partial(p):
        return (2, 0, p.reduce_op)
    return (1, p.dim, "")
