"""The solver: which input placements flow through a recorded graph with no redistribution.

Nodes are visited in recorded (topological) order. Values that some node has read
together form a factor; a factor holds every way its values can be placed so far (the
placements of its graph inputs, of its values still live, and how it got there). At each
node, every rule filters each factor the node reads on its own, and only the matching
combinations are joined into one new factor (assigning graph inputs and constants the
node reads for the first time). Inputs that run through independent chains (block_diag,
cartesian_prod, stack) stay in separate factors until the node that reads them together,
so the work follows the number of rules, not the product of every input's placements.
A combination no rule takes dies there — counted, and recorded as a Rejection (the first
MAX_REJECTIONS of them) that `explain` turns into a readable reason. Entries equal on
everything still needed are merged, and an entry that only holds P(avg|max|min) where
another holds R is dropped (`_undominated`). At the end, the product of the remaining
factors, with every input no node read taking each placement it may, gives the survivors.

The solver never asks where a rule came from and never re-runs the decomposition.
"""

from __future__ import annotations

import itertools
import math
import threading
from dataclasses import dataclass, field
from typing import Callable, Sequence

from decompshard.dispatch_modes.graph import PrimGraph, PrimNode
from decompshard.placements import MaybePlacement, P, Placement, R, SingleDimRule, alphabet, is_partial, is_shard, is_strided

UNSET = object()  # graph input not read yet
MAX_REJECTIONS = 2000


@dataclass(frozen=True)
class Rejection:
    """A candidate (possibly partial: None = not yet decided) that died at `node`."""

    inputs: tuple[MaybePlacement, ...]
    node: int
    arriving: tuple[MaybePlacement, ...]  # placements of the node's inputs (None: undecided)
    reason: str = ""  # set when the death is not "no rule accepts the arriving placements"


@dataclass
class Survivor:
    """A full candidate: input placements, output placements, and how it got there."""

    inputs: tuple[MaybePlacement, ...]
    outputs: tuple[MaybePlacement, ...]
    even_only: bool
    env: dict[int, MaybePlacement]  # placement of every value it touched
    path: tuple[int, ...]  # index of the matched rule in each node's table
    sharded: bool = True  # some value in env is sharded (False: every local shape is global)


@dataclass
class Propagation:
    survivors: list[Survivor] = field(default_factory=list)
    rejections: list[Rejection] = field(default_factory=list)
    n_rejections: int = 0


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

    Inside, every placement is a small int (`_code`) and every rule table is encoded once
    (`_encoded`): the solver hashes and compares tuples of placements at every node, and
    int tuples hash in C where placement tuples call a dataclass `__hash__` per item.
    Survivors and rejections are decoded back to placements at the end.
    """
    result = Propagation()
    allowed = {v: set(input_alphabet(graph, v)) for v in graph.inputs}
    allowed.update({v.id: constant_alphabet(v) for v in graph.values if v.kind == "const"})
    floating = frozenset(v.id for v in graph.values if v.meta.dtype.is_floating_point)
    if fixed_inputs is not None:
        for v, p in zip(graph.inputs, fixed_inputs):
            if p not in allowed[v] and p is not None:
                result.rejections.append(Rejection(tuple(fixed_inputs), -1, (p,)))
                result.n_rejections += 1
                return result
            allowed[v] = {p}  # a fixed input is read as this placement and nothing else
    live_after = _live_after(graph)
    input_ids = frozenset(graph.inputs)
    owner: dict[int, _Factor] = {}  # value id -> the factor that placed it
    allowed_c = {v: {_code(p) for p in ps} for v, ps in allowed.items()}

    for node in graph.nodes:
        if node.constant:  # made locally, identical on every rank: see constant_alphabet
            continue
        ins, outs = node.inputs, node.outputs
        touched = list({id(f): f for v in ins if (f := owner.get(v)) is not None}.values())
        joined = _join(node, _encoded(rules_for(node)), touched, owner, allowed_c, floating)
        if len(joined.matched) < math.prod([len(f.entries) for f in touched]):
            _record_deaths(result, graph, node, touched, joined.matched)
        if len(touched) == 1 and owner.keys().isdisjoint(outs):
            # the factor grows by the node's new values: kept, not rebuilt
            factor = touched[0]
            values = factor.values
            for v in (*ins, *outs):
                if v is not None and v not in values:
                    values.add(v)
                    owner[v] = factor
        else:
            factor = _Factor(set().union(*(f.values for f in touched), ins, (v for v in outs if v is not None)), [])
            for v in factor.values:
                owner[v] = factor
        values = factor.values
        live = tuple([v for v in live_after[node.index] if v in values])
        merged: dict[tuple, _Entry] = {}
        for entry in joined.entries:
            merged.setdefault((tuple(map(entry.env.get, live)), entry.even), entry)
        factor.entries = _undominated(merged, live, input_ids, floating)
        if not factor.entries:
            return result

    _collect_survivors(result, graph, owner, allowed)
    return result


# Placement <-> small int, shared by every run (the alphabet is small: R, S(d), P(op), and
# the few strided shards views make). Codes only grow; a new one is published to the
# decoding side and the class sets before the encoding side, under a lock.
_ENC: dict = {None: None}
_DEC: dict = {None: None}
_SHARD_C: set[int] = set()  # codes of S(d) and strided shards
_STRIDED_C: set[int] = set()  # codes of strided shards
_CODE_LOCK = threading.Lock()


def _code(p: MaybePlacement) -> int | None:
    """The int standing for placement `p` inside the solver (None stays None)."""
    c = _ENC.get(p)
    if c is None and p is not None:
        with _CODE_LOCK:
            c = _ENC.get(p)
            if c is None:
                c = len(_DEC) - 1
                _DEC[c] = p
                if is_shard(p):
                    _SHARD_C.add(c)
                if is_strided(p):
                    _STRIDED_C.add(c)
                _ENC[p] = c
    return c


_R_C = _code(R)


# A replicated value is also a valid P(avg), P(max) and P(min) (every rank holds the true
# value, and the average / max / min of identical copies is that value). So a rule that
# wants one of those accepts R as it is — no data moves.
_R_SATISFIES = {P("avg"), P("max"), P("min")}
_RSAT_C = frozenset(_code(P(op)) for op in ("avg", "max", "min"))  # interned in a fixed order


# A rule table encoded once: per rule (input codes, output codes, even_only, some output
# sharded, some input wanted as P(avg|max|min)). Keyed by the table's identity (the
# registry's cache hands out the same tuple each time); the entry holds the table, so its
# id cannot be reused while it is here. Lists (tests' own tables) are encoded per call.
_ENC_TABLES: dict[int, tuple] = {}
_ENC_TABLES_MAX = 4096


def _encoded(table: Sequence[SingleDimRule]) -> tuple:
    cacheable = type(table) is tuple
    if cacheable:
        hit = _ENC_TABLES.get(id(table))
        if hit is not None and hit[0] is table:
            return hit[1]
    enc = []
    for r in table:
        outs = tuple([_code(p) for p in r.outputs])
        ins = tuple([_code(p) for p in r.inputs])
        enc.append((ins, outs, r.even_only, not _SHARD_C.isdisjoint(outs), not _RSAT_C.isdisjoint(ins)))
    enc = tuple(enc)
    if cacheable:
        if len(_ENC_TABLES) >= _ENC_TABLES_MAX:
            _ENC_TABLES.clear()
        _ENC_TABLES[id(table)] = (table, enc)
    return enc


@dataclass(slots=True)
class _Entry:
    """One way a factor's values can be placed: every placement it made (as codes),
    whether some rule on the way holds for even shards only, and the rule matched at
    each node.

    `path` is persistent, (node index, rule index, the parts' paths), so that building
    an entry does not copy every earlier node's choice; `_steps` flattens it."""

    env: dict[int, int | None]
    even: bool
    path: tuple
    sharded: bool = False  # some value it placed is sharded (else no local shape differs)


_NO_PATH: tuple = ()


def _steps(path: tuple, out: dict[int, int]) -> dict[int, int]:
    """The rule index matched at every node a (persistent) entry path went through."""
    stack = [path]
    while stack:
        p = stack.pop()
        if p:
            out[p[0]] = p[1]
            stack.extend(p[2])
    return out


@dataclass(slots=True)
class _Factor:
    """Values whose placements depend on each other (some node read them together),
    and the ways they can be placed. Values in different factors are independent until
    a node reads both; then the two factors are joined at that node."""

    values: set[int]
    entries: list[_Entry]


@dataclass(slots=True)
class _Joined:
    entries: list[_Entry]
    matched: set[tuple[int, ...]]  # combinations of the touched factors' entries some rule took


_NO_FRESH: list = [({}, False)]  # every input of the node already placed: nothing to choose


def _fresh_lookup(node: PrimNode, owner: dict, allowed: dict, floating) -> Callable[[tuple], list]:
    """For one join: the placements a rule wanting `wants` (codes) gives the node's values
    read for the first time (graph inputs, constants), each with whether it shards one.
    Computed once per distinct `wants` (rules often want the same inputs); when every input
    already has an owner factor there is nothing to choose (`_NO_FRESH`)."""
    if all(v in owner for v in node.inputs):
        return lambda wants: _NO_FRESH
    memo: dict[tuple, list] = {}

    def fresh(wants: tuple) -> list:
        found = memo.get(wants)
        if found is None:
            found = memo[wants] = [
                (a, not _SHARD_C.isdisjoint(a.values()))
                for a in _fresh_assignments(wants, node, owner, allowed, floating)
            ]
        return found

    return fresh


@dataclass(slots=True)
class _Side:
    """One touched factor as a node sees it: the node's input positions it placed, and
    its entries grouped by the placements (codes) they hold there, so that the entries a
    rule takes are a dict look-up, not a `_reads` per (entry, input)."""

    factor: _Factor
    pos: tuple[int, ...]
    groups: dict[tuple, list[int]]
    float_at: list[bool]  # per position in `pos`: the input is floating (R reads as P)
    whole: bool  # it placed every input of the node: a rule's inputs are the key as they are


def _group(entries: list[_Entry], vals: Sequence[int]) -> dict[tuple, list[int]]:
    """Entry indices (ascending) by the placements the entries give `vals`."""
    groups: dict[tuple, list[int]] = {}
    for i, e in enumerate(entries):
        env = e.env
        groups.setdefault(tuple([env[v] for v in vals]), []).append(i)
    return groups


def _side(inputs: tuple, factor: _Factor, owner: dict, is_float: list[bool]) -> _Side:
    """`factor` as the node reading `inputs` sees it (`is_float`: per input)."""
    pos = tuple([i for i, v in enumerate(inputs) if owner.get(v) is factor])
    groups = _group(factor.entries, [inputs[i] for i in pos])
    return _Side(factor, pos, groups, [is_float[i] for i in pos], len(pos) == len(inputs))


def _side_fits(side: _Side, wants: tuple, rsat: bool, n_in: int, is_float: list[bool]) -> list[int]:
    """Indices (ascending) of the side's entries that fit a rule wanting `wants` (codes)
    at the side's positions; `rsat`: the rule wants some input as P(avg|max|min), which
    a floating R also meets. A rule shorter than the node's inputs constrains only its
    own (a position past its end makes the key shorter than the groups': nothing fits)."""
    if len(wants) < n_in:
        pos = tuple([i for i in side.pos if i < len(wants)])
        return _fits(side.groups, tuple([wants[i] for i in pos]), [is_float[i] for i in pos])
    key = wants if side.whole else tuple([wants[i] for i in side.pos])
    if not rsat:  # no R-reads-as-P option: one look-up
        return side.groups.get(key, _NONE)
    return _fits(side.groups, key, side.float_at)


def _takers(table: tuple, sides: list[_Side], n_in: int, is_float: list[bool],
            fresh: Callable[[tuple], list]) -> dict[tuple[int, ...], list[tuple[int, list]]]:
    """Per combination of the sides' entries (one index per side) that some rule takes:
    the rules that take it (table order), each with the fresh placements it brings.
    Each rule filters each side on its own, so only matching combinations are built:
    independent inputs cost the rule set's size, not the product of every factor's
    entries. With no side, the one combination is `()`."""
    takers: dict[tuple[int, ...], list[tuple[int, list]]] = {}
    for ri, rule in enumerate(table):
        wants, rsat = rule[0], rule[4]
        per_side = []
        for side in sides:
            fits = _side_fits(side, wants, rsat, n_in, is_float)
            if not fits:
                break
            per_side.append(fits)
        else:
            assignments = fresh(wants)
            if not assignments:
                continue
            took = (ri, assignments)
            for combo in itertools.product(*per_side):
                b = takers.get(combo)
                if b is None:
                    takers[combo] = [took]
                else:
                    b.append(took)
    return takers


def _merged(parts: list[_Entry]) -> tuple[dict, tuple, bool, bool]:
    """One entry from each touched factor, as one: their placements (in the parts'
    order; the dict is a part's own when there is one part, so copy before writing),
    their paths, whether some part is [even], whether some part placed a shard."""
    if len(parts) == 1:  # most nodes read one factor: nothing to merge
        e = parts[0]
        return e.env, (e.path,), e.even, e.sharded
    env: dict[int, int | None] = {}
    for e in parts:
        env.update(e.env)
    return env, tuple([e.path for e in parts]), any([e.even for e in parts]), any([e.sharded for e in parts])


def _joined_entries(node: PrimNode, table: tuple, sides: list[_Side], takers: dict) -> list[_Entry]:
    """The joined factor's entries: combinations in ascending order (entry-major), then
    rule order, then fresh placements' order (as a per-state scan visits them). Each
    holds the parts' placements, the fresh ones and the rule's outputs (in that order),
    is [even] if the rule or a part is, and sharded if anything it placed is."""
    outputs, index = node.outputs, node.index
    out_pairs_memo: dict[int, list] = {}
    entries: list[_Entry] = []
    for combo in sorted(takers):
        base, paths, p_even, p_sharded = _merged([side.factor.entries[i] for side, i in zip(sides, combo)])
        for ri, assignments in takers[combo]:
            _, outs, r_even, out_sharded, _ = table[ri]
            out_pairs = out_pairs_memo.get(ri)
            if out_pairs is None:
                out_pairs = out_pairs_memo[ri] = [(v, p) for v, p in zip(outputs, outs) if v is not None]
            path = (index, ri, paths)
            even = r_even or p_even
            for assigned, fresh_sharded in assignments:
                env = base.copy()
                if assigned:
                    env.update(assigned)
                for v, p in out_pairs:
                    env[v] = p
                entries.append(_Entry(env, even, path, p_sharded or fresh_sharded or out_sharded))
    return entries


def _join(node: PrimNode, table: tuple, touched: list[_Factor], owner: dict, allowed: dict, floating) -> _Joined:
    """Every (entry of each touched factor, rule, placement of values read for the first
    time) that fits the node: one code path for a node that reads no factor (only graph
    inputs and constants), one, or several. `table` is `_encoded`, `allowed` in codes.
    The pieces: `_side` (a factor grouped by what it gives the node's inputs),
    `_takers` (which rules take which combination of entries, `_side_fits` per side),
    `_joined_entries` (the new entries, in a fixed order)."""
    inputs = node.inputs
    is_float = [v in floating for v in inputs]
    sides = [_side(inputs, f, owner, is_float) for f in touched]
    takers = _takers(table, sides, len(inputs), is_float, _fresh_lookup(node, owner, allowed, floating))
    return _Joined(_joined_entries(node, table, sides, takers), set(takers))


def _fits(groups: dict[tuple, list[int]], wants: tuple, is_float: list[bool]) -> list[int]:
    """Indices (ascending) of the entries whose placements at a factor's positions fit
    `wants` (each exactly, or R where a floating value is wanted as P(avg|max|min)),
    looked up in the entries grouped by those placements (all codes)."""
    options = None
    if not _RSAT_C.isdisjoint(wants):
        for j, (w, fl) in enumerate(zip(wants, is_float)):
            if fl and w in _RSAT_C:
                if options is None:
                    options = [(x,) for x in wants]
                options[j] = (w, _R_C)
    if options is None:
        return groups.get(wants, _NONE)
    out: list[int] = []
    hits = 0
    for haves in itertools.product(*options):
        idx = groups.get(haves)
        if idx:
            out += idx
            hits += 1
    if hits > 1:
        out.sort()
    return out


_NONE: list[int] = []


def _reads(have: MaybePlacement, want: MaybePlacement, is_float: bool) -> bool:
    """A value placed `have` fits a rule that wants `want` (R reads as P(avg|max|min))."""
    return have == want or (have == R and want in _R_SATISFIES and is_float)


def _fresh_assignments(wants: tuple, node: PrimNode, owner: dict, allowed: dict, floating) -> list[dict]:
    """Placements (codes) for the graph inputs and constants this node reads for the
    first time that fit a rule wanting `wants` (codes; a wanted P(avg|max|min) may also
    be met by R)."""
    envs: list[dict] = [{}]
    for v, want in zip(node.inputs, wants):
        if v in owner:
            continue
        nxt = []
        for e in envs:
            if v in e:
                have = e[v]
                if have == want or (have == _R_C and want in _RSAT_C and v in floating):
                    nxt.append(e)
                continue
            if v in allowed and want in allowed[v]:
                nxt.append({**e, v: want})
            if want in _RSAT_C and v in floating and _R_C in allowed.get(v, ()):
                nxt.append({**e, v: _R_C})
        envs = nxt
        if not envs:
            return []
    return envs


def _record_deaths(result: Propagation, graph: PrimGraph, node: PrimNode, touched: list[_Factor], matched: set) -> None:
    """Count the combinations of the touched factors' entries no rule took, and record
    the first ones (up to MAX_REJECTIONS) for explain. Inputs of other factors are
    undecided (None) in a record: the death does not depend on them."""
    sizes = [len(f.entries) for f in touched]
    dead = math.prod(sizes) - len(matched)
    if dead <= 0:
        return
    result.n_rejections += dead
    if len(result.rejections) >= MAX_REJECTIONS:
        return
    wanted = tuple(dict.fromkeys((*graph.inputs, *node.inputs)))  # only these are recorded
    seen: list[list] = [[None] * n for n in sizes]  # filled on first use
    g_inputs, n_inputs, index = graph.inputs, node.inputs, node.index
    dec = _DEC
    for combo in itertools.product(*(range(n) for n in sizes)):
        if combo in matched:
            continue
        env: dict[int, MaybePlacement] = {}
        for k, i in enumerate(combo):
            part = seen[k][i]
            if part is None:
                e_env = touched[k].entries[i].env
                part = seen[k][i] = {v: dec[e_env[v]] for v in wanted if v in e_env}
            env.update(part)
        result.rejections.append(
            Rejection(tuple([env.get(v) for v in g_inputs]), index, tuple([env.get(v) for v in n_inputs]))
        )
        if len(result.rejections) >= MAX_REJECTIONS:
            return


def _collect_survivors(result: Propagation, graph: PrimGraph, owner: dict, allowed: dict) -> None:
    """The product of the independent factors left at the end, with every input no node
    read taking each placement it may (`allowed` in placements; decoded here)."""
    factors = list({id(f): f for f in owner.values()}.values())
    unread = [v for v in dict.fromkeys(graph.inputs) if v not in owner]
    seen: set[tuple] = set()
    n = len(graph.nodes)
    producer = graph.producer()
    unread_choices = [[_code(p) for p in sorted(allowed[v], key=_order)] for v in unread]
    g_inputs, g_outputs = graph.inputs, graph.outputs
    dec = _DEC
    strided_c = _STRIDED_C
    for parts in itertools.product(*(f.entries for f in factors)):
        base: dict[int, int | None] = {}
        steps: dict[int, int] = {}
        for e in parts:
            base.update(e.env)
            _steps(e.path, steps)
        even = any(e.even for e in parts)
        sharded = any(e.sharded for e in parts)
        path = tuple([steps.get(i, 0) for i in range(n)])
        for combo in itertools.product(*unread_choices):
            env = {**base, **dict(zip(unread, combo))} if unread else base
            ins = tuple([env[v] for v in g_inputs])
            outs = tuple([None if v is None else env.get(v, _R_C) for v in g_outputs])
            key = (ins, outs, even)
            if key in seen:
                continue
            seen.add(key)
            strided = [(v, dec[p]) for v, p in zip(g_outputs, outs) if p in strided_c] if strided_c else None
            env = {v: dec[p] for v, p in env.items()}
            ins = tuple([dec[p] for p in ins])
            if strided:  # a layout inside the graph only: an op's rule says S(d), R or P
                _record_strided_output(result, graph, producer, env, ins, strided[0])
                continue
            outs = tuple([dec[p] for p in outs])
            result.survivors.append(Survivor(ins, outs, even, env, path, sharded or not _SHARD_C.isdisjoint(combo)))


def _record_strided_output(result: Propagation, graph: PrimGraph, producer: dict, env: dict, ins: tuple, out) -> None:
    v, p = out
    result.n_rejections += 1
    if len(result.rejections) >= MAX_REJECTIONS or v not in producer:
        return
    node = graph.nodes[producer[v]]
    result.rejections.append(Rejection(
        ins, node.index, tuple(env.get(u) for u in node.inputs),
        f"node {node.index} ({node.op}) leaves an output as the strided shard {p}: "
        "a layout inside a decomposition, not a placement of an op's rule"))


def _undominated(states: dict[tuple, "_Entry"], live: tuple[int, ...], inputs: frozenset, floating: frozenset) -> list["_Entry"]:
    """Drop a state that differs from another only by holding P(avg|max|min) where the
    other holds R on some intermediate or output value (a rule that wants P(avg) on a
    Replicate value makes such copies: unbind_copy's five clones made 4^5 of them).
    Every rule that accepts the P value accepts R too, and both have full local shapes,
    so the R state reaches everything the P state does, and its rules dominate (see
    derive._drop_implied). Graph inputs are never promoted: they name the candidate.
    Placements are codes here."""
    promotable = [i for i, v in enumerate(live) if v not in inputs and v in floating]
    if not promotable:
        return list(states.values())
    every = len(promotable) == len(live)
    rsat, r_c = _RSAT_C, _R_C
    out = []
    for (placements, even), st in states.items():
        if not rsat.isdisjoint(placements if every else [placements[i] for i in promotable]):
            promoted = list(placements)
            for i in promotable:
                if promoted[i] in rsat:
                    promoted[i] = r_c
            promoted = tuple(promoted)
            if (promoted, False) in states or (even and (promoted, True) in states):
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
    """Every way `rule` extends one full state at `node` (none if it does not fit): the
    plain one-state semantics that `_join` computes factor by factor (the brute-force
    test in tests/test_propagate.py follows every candidate with it)."""
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
            elif _reads(have, want, v in floating):
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
