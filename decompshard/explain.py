"""explain: why an op gets (or refuses) a sharding, as a readable propagation trace.

    >>> e = explain(aten.addmv.default, bias, mat, vec, placements="R; S(1); S(0)")
    >>> print(e)          # the trace; e.verdict, e.blocked, e.suggestions for code

The trace follows one candidate (one placement per tensor input) through the recorded
decomposition: every primitive call, the shape of every value it makes, the rule of that
primitive's table that matched and where the rule came from. A candidate either

- survives propagation and the local-shape check: the derived rule(s) it yields;
- survives propagation but is refused by the local-shape check: the check's reason;
- dies at a node (it needs redistribution there): the placements that arrived, the
  nearest rules of that node, and the cheapest change of the op's input placements that
  yields a derived rule.

Nothing here decides anything: the verdict is `propagate` + `check_local` (the solver and
the check `derive_rules` uses); the replay below only reconstructs the placements of a
rejected candidate up to where it died, for display.
"""

from __future__ import annotations

import html
import math
import textwrap
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_flatten_with_path, tree_map

from ._compat import TensorMeta, from_torch_placement
from .derive import DerivedRules, derive_rules, resolve_op, traced
from .dispatch_modes.graph import PrimGraph, PrimNode
from .localcheck import LocalVerdict, check_local
from .placements import (
    MaybePlacement,
    P,
    Partial,
    Placement,
    R,
    Replicate,
    ShardPlaceholder,
    SingleDimRule,
    format_placement,
    format_rule,
    parse_placement,
    parse_placements,
)
from .propagate import Propagation, Survivor, input_alphabet, propagate
from .rules import rules_for

__all__ = ["Explanation", "MeshReport", "Suggestion", "explain", "parse_candidate"]

WIDTH = 110  # long prose lines wrap here
CALL_WIDTH = 58
TABLE_WIDTH = 116  # the decomposition table is fitted to this  # the primitive-call column is cut here so a trace fits in ~110 columns
MAX_SUGGESTIONS = 3
MAX_NEAREST = 3
MAX_MESH_SHOWN = 5


# ------------------------------------------------------------------ result types


@dataclass(frozen=True)
class Change:
    """One input's redistribution: from -> to, and what DTensor would do for it."""

    input: int
    name: str
    src: Placement
    dst: Placement
    how: str  # "all-gather", "local slice, no communication", ...
    weight: int  # 0 local, 1 one collective of a shard, 2 a full gather/reduce, 3 via R

    def __str__(self) -> str:
        return f"input {self.input} ({self.name}) from {self.src} to {self.dst} ({self.how})"


@dataclass(frozen=True)
class Suggestion:
    """A derived rule reachable by redistributing `changes` of the requested inputs."""

    rule: SingleDimRule
    changes: tuple[Change, ...]

    @property
    def cost_key(self) -> tuple:
        return (len(self.changes), sum(c.weight for c in self.changes))

    def __str__(self) -> str:
        what = ", ".join(str(c) for c in self.changes)
        note = " (all-Replicate)" if self.rule.is_trivial() else ""
        return f"redistribute {what} -> rule {format_rule(self.rule)}{note}"


@dataclass(frozen=True)
class NearRule:
    """A rule of the blocking node's table and where it differs from what arrived."""

    index: int  # position in the node's rule table
    rule: SingleDimRule
    differs: tuple[int, ...]  # positions (node inputs) that differ


@dataclass
class Blocked:
    """Where a rejected candidate died: the first node (of the path that got furthest)
    no rule of which accepts the placements that arrived."""

    node: PrimNode | None  # None: the placement is not allowed for a graph input at all
    arriving: tuple[MaybePlacement, ...]
    env: dict[int, MaybePlacement]
    path: tuple[int, ...]  # matched rule index per node before `node`
    nearest: list[NearRule] = field(default_factory=list)
    table_size: int = 0
    reason: str = ""


@dataclass
class SurvivorReport:
    survivor: Survivor
    local: LocalVerdict

    @property
    def ok(self) -> bool:
        return self.local.ok


@dataclass
class MeshReport:
    """N-D strategies ranked by modeled cost (from decompshard.lift.rank_strategies)."""

    mesh_shape: tuple[int, ...]
    current: tuple[tuple[Any, ...], ...]  # torch placements per tensor input, per mesh dim
    strategies: list  # lift.MeshStrategy, best first
    error: str | None = None

    @property
    def chosen(self):
        return next((s for s in self.strategies if s.valid), None)


@dataclass
class Explanation:
    """What `explain` found; str() / repr() / _repr_html_() render it."""

    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    input_names: tuple[str, ...]
    input_metas: tuple[TensorMeta, ...]
    placements: tuple[Placement, ...] | None  # None: no candidate asked for
    derived: DerivedRules
    propagation: Propagation | None = None
    survivors: list[SurvivorReport] = field(default_factory=list)
    blocked: Blocked | None = None
    suggestions: list[Suggestion] = field(default_factory=list)
    mesh: MeshReport | None = None
    show_all: bool = False

    # ---------------------------------------------------------------- verdict

    @property
    def graph(self) -> PrimGraph | None:
        return self.derived.graph

    @property
    def unsupported_reason(self) -> str | None:
        return self.derived.unsupported_reason

    @property
    def rules(self) -> list[SingleDimRule]:
        """The derived rules whose inputs are exactly the requested placements."""
        if self.placements is None:
            return []
        if all(isinstance(p, Replicate) for p in self.placements):
            return [_trivial_rule(self.graph)] if self.graph is not None else []
        return [r for r in self.derived.rules if r.inputs == self.placements]

    @property
    def verdict(self) -> str:
        """'unsupported', 'accepted', 'refused' (local-shape check), 'rejected', or
        'none' (no candidate given)."""
        if self.unsupported_reason:
            return "unsupported"
        if self.placements is None:
            return "none"
        if self.rules:
            return "accepted"
        if any(not s.ok for s in self.survivors):
            return "refused"
        return "rejected"

    @property
    def accepted(self) -> bool:
        return self.verdict == "accepted"

    @property
    def local_refusal(self) -> str | None:
        """The local-shape check's reason, when it refused every survivor."""
        if self.verdict != "refused":
            return None
        return next(s.local.reason for s in self.survivors if not s.ok)

    # ---------------------------------------------------------------- rendering

    def render(self) -> str:
        return "\n".join(_render(self)).rstrip() + "\n"

    def __str__(self) -> str:
        return self.render()

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return (
            '<pre style="font-family: monospace; white-space: pre; line-height: 1.3">'
            + html.escape(self.render())
            + "</pre>"
        )


# --------------------------------------------------------------------- the API


def explain(
    op: torch._ops.OpOverload | str,
    *args: Any,
    placements: str | Sequence[Any] | None = None,
    mesh: Sequence[int] | str | None = None,
    mesh_placements: str | Sequence[Sequence[Any]] | None = None,
    show_all: bool = False,
    **kwargs: Any,
) -> Explanation:
    """Explain how `op(*args, **kwargs)` shards for the given input placements.

    `placements`: one single-dim placement per tensor input (schema order, lists
    flattened), as a string ("R; S(1); S(0)" or "R, S(1), S(0)") or a sequence of
    decompshard placements, their strings, or torch placements. Without it the result
    shows the derived rule table (as with `show_all`).

    `mesh` (e.g. (2, 4) or "2x4") with `mesh_placements` (per tensor input, one torch
    placement per mesh dim, or the string form "R,S(0); S(1),S(0); S(0),R") adds the
    N-D strategies ranked by the cost model.

    Raises ValueError for an unknown op, a malformed placement, or the wrong number of
    placements.
    """
    op = resolve_op(op)
    names, metas = _tensor_inputs(op, args, kwargs)
    if not metas:
        raise ValueError(f"{op} has no tensor inputs in this call: nothing to shard")
    cand = None if placements is None else parse_candidate(placements, metas, names)
    if (mesh is None) != (mesh_placements is None):
        raise ValueError("mesh and mesh_placements go together: give both or neither")

    derived = derive_rules(op, *args, **kwargs)
    ex = Explanation(op, args, kwargs, names, metas, cand, derived, show_all=show_all)
    if derived.graph is not None and cand is not None:
        _follow(ex)
    if mesh is not None:
        ex.mesh = mesh_report(op, args, kwargs, mesh, mesh_placements, metas, names)
    return ex


def parse_candidate(
    placements: str | Sequence[Any], metas: Sequence[TensorMeta], names: Sequence[str]
) -> tuple[Placement, ...]:
    """The requested placements, checked against the tensor inputs (ValueError if not)."""
    if isinstance(placements, str):
        sep = ";" if ";" in placements else ","
        got = parse_placements(placements, sep)
    else:
        got = tuple(_to_placement(p) for p in placements)
    if len(got) != len(metas):
        raise ValueError(
            f"expected {len(metas)} placements (one per tensor input: {', '.join(names)}), "
            f"got {len(got)}"
        )
    for i, (p, m, name) in enumerate(zip(got, metas, names)):
        if p is None:
            raise ValueError(f"input {i} ({name}) is a tensor: its placement cannot be None")
        if isinstance(p, ShardPlaceholder) and p.dim >= len(m.shape):
            raise ValueError(
                f"input {i} ({name}) has {len(m.shape)} dims: {p} is out of range"
            )
    return got


def _to_placement(p: Any) -> MaybePlacement:
    if isinstance(p, (Replicate, ShardPlaceholder, Partial)) or p is None:
        return p
    if isinstance(p, str):
        return parse_placement(p)
    q = from_torch_placement(p)
    if q is NotImplemented:
        raise ValueError(f"placement {p!r} has no single-dim form (R, S(d), P(op))")
    return q


def _tensor_inputs(op, args: tuple, kwargs: dict) -> tuple[tuple[str, ...], tuple[TensorMeta, ...]]:
    """Names (schema names, list elements as name[j]) and metadata of the tensor inputs,
    in the flattened order the graph numbers them."""
    schema_names = [a.name for a in op._schema.arguments]
    names, metas = [], []
    for path, leaf in tree_flatten_with_path((args, kwargs))[0]:
        if not isinstance(leaf, torch.Tensor):
            continue
        where, *rest = path[1:]
        if path[0].idx == 0:
            base = schema_names[where.idx] if where.idx < len(schema_names) else f"arg{where.idx}"
        else:
            base = str(where.key)
        names.append(base + "".join(f"[{k.idx}]" for k in rest if hasattr(k, "idx")))
        metas.append(TensorMeta(tuple(leaf.shape), tuple(leaf.stride()), leaf.dtype))
    return tuple(names), tuple(metas)


def _trivial_rule(graph: PrimGraph) -> SingleDimRule:
    return SingleDimRule(
        (R,) * len(graph.inputs),
        tuple(None if v is None else R for v in graph.outputs),
        source="implied",
    )


# ------------------------------------------------------------- following one candidate


def _follow(ex: Explanation) -> None:
    graph = ex.graph
    cand = ex.placements
    prop = propagate(graph, rules_for, fixed_inputs=cand)
    ex.propagation = prop
    if prop.survivors:
        meta_args, meta_kwargs = _meta_call(ex.args, ex.kwargs)
        trace_at = lambda a, k: traced(graph.op, a, k)  # noqa: E731
        for s in prop.survivors:
            ex.survivors.append(
                SurvivorReport(s, check_local(graph, s, meta_args, meta_kwargs, trace_at))
            )
    else:
        ex.blocked = _blocked(graph, cand, prop)
    if not ex.accepted:
        ex.suggestions = suggestions(ex.derived, cand, ex.input_names, graph)


def _meta_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    return tree_map(
        lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        if isinstance(x, torch.Tensor) else x,
        (args, kwargs),
    )


def _blocked(graph: PrimGraph, cand: tuple, prop: Propagation) -> Blocked:
    if prop.rejections and prop.rejections[0].node < 0:
        bad = next(
            (i, p) for i, (v, p) in enumerate(zip(graph.inputs, cand))
            if p not in input_alphabet(graph, v)
        )
        dtype = str(graph.meta(graph.inputs[bad[0]]).dtype).replace("torch.", "")
        return Blocked(
            None, (bad[1],), {}, (),
            reason=f"{bad[1]} is not allowed for input {bad[0]}: an integer or bool tensor "
            f"({dtype}) cannot hold a pending reduction (Partial)",
        )
    if not prop.rejections:  # cannot happen: no survivor means some state died
        return Blocked(None, (), {}, (), reason="no survivor and no recorded rejection")
    target = max(prop.rejections, key=lambda r: r.node)  # the path that got furthest
    env, path = _state_before(graph, cand, target)
    node = graph.nodes[target.node]
    arriving = target.arriving
    table = rules_for(node)
    near = []
    for i, rule in enumerate(table):
        diff = tuple(
            k for k, (v, have, want) in enumerate(zip(node.inputs, arriving, rule.inputs))
            if have is not None and not _accepts(have, want, graph.meta(v))
        )
        near.append(NearRule(i, rule, diff))
    # fewest differing arguments, then the cheapest way to make them fit (R -> P(sum) is
    # local, S(2) -> S(0) one all-to-all, P(sum) -> P(avg) not direct), then table order
    near.sort(key=lambda n: (
        len(n.differs),
        sum(redistribution(arriving[k], n.rule.inputs[k])[1] for k in n.differs),
        n.index,
    ))
    return Blocked(node, arriving, env, path, near[:MAX_NEAREST], len(table))


# A replicated float value is also a valid P(avg), P(max), P(min): the solver lets a rule
# that wants one of those read R as it is (every rank holds the true value).
_R_READS_AS = {P("avg"), P("max"), P("min")}


def _accepts(have: MaybePlacement, want: MaybePlacement, meta: TensorMeta) -> bool:
    if have == want:
        return True
    return have == R and want in _R_READS_AS and meta.dtype.is_floating_point


def _state_before(graph: PrimGraph, cand: tuple, rej) -> tuple[dict, tuple[int, ...]]:
    """The placements and matched rules of the dying state, up to the node it died at.

    Re-runs the solver itself (not a copy of it) on the graph cut just before that node,
    with the node's inputs as outputs, and takes the survivor whose placements of those
    inputs are the ones that arrived. ({}, ()) if none is found."""
    node = graph.nodes[rej.node]
    cut = PrimGraph(
        op=graph.op, inputs=graph.inputs, outputs=tuple(node.inputs),
        values=graph.values, nodes=graph.nodes[: rej.node],
    )
    try:
        prop = propagate(cut, rules_for, fixed_inputs=cand)
    except Exception:  # noqa: BLE001 - display only
        return {}, ()
    for s in prop.survivors:
        if tuple(s.env.get(v) for v in node.inputs) == tuple(rej.arriving):
            return s.env, s.path
    for s in prop.survivors:  # constants read for the first time: undecided when it died
        if all(a is None or s.env.get(v) == a for v, a in zip(node.inputs, rej.arriving)):
            return s.env, s.path
    return {}, ()


# ----------------------------------------------------------------- suggestions


def redistribution(src: Placement, dst: Placement) -> tuple[str, int]:
    """What DTensor does to turn `src` into `dst` on one mesh dim, and a coarse weight
    (0: local only, 1: one collective moving a shard, 2: gather/reduce the whole tensor,
    3: DTensor refuses it directly; it goes through Replicate)."""
    if src == dst:
        return "nothing", 0
    if src is None or dst is None:
        return "not a tensor here", 3
    if isinstance(src, Replicate):
        if isinstance(dst, ShardPlaceholder):
            return "local slice, no communication", 0
        if dst.reduce_op == "sum":
            return "local divide by the mesh size, no communication", 0
        return "no-op: every rank keeps its copy", 0
    if isinstance(src, ShardPlaceholder):
        if isinstance(dst, Replicate):
            return "all-gather", 2
        if isinstance(dst, ShardPlaceholder):
            return "all-to-all", 1
        return "all-gather, then local work; DTensor has no direct S->P", 3
    if isinstance(dst, Replicate):
        return "all-reduce", 2
    if isinstance(dst, ShardPlaceholder):
        return "reduce-scatter", 1
    return "all-reduce, then local work; DTensor has no direct P->P", 3


def suggestions(
    derived: DerivedRules,
    requested: Sequence[Placement],
    names: Sequence[str],
    graph: PrimGraph | None = None,
    limit: int = MAX_SUGGESTIONS,
) -> list[Suggestion]:
    """The derived rules closest to `requested`: fewest inputs changed, then the cheapest
    kind of change (local < one shard-sized collective < full gather/reduce), then the
    derived rules' own order. The all-Replicate rule (always valid) is a candidate too."""
    graph = graph or derived.graph
    pool = list(derived.rules)
    if graph is not None:
        pool.append(_trivial_rule(graph))
    out: list[Suggestion] = []
    seen = set()
    for order, rule in enumerate(pool):
        if rule.inputs in seen or rule.inputs == tuple(requested):
            continue
        seen.add(rule.inputs)
        changes = []
        for i, (have, want) in enumerate(zip(requested, rule.inputs)):
            if have != want and want is not None:
                how, weight = redistribution(have, want)
                changes.append(Change(i, names[i] if i < len(names) else f"#{i}", have, want, how, weight))
        out.append((Suggestion(rule, tuple(changes)), order))
    out.sort(key=lambda so: (so[0].cost_key, so[1]))
    kept: list[Suggestion] = []
    for s, _ in out:  # drop what an earlier, no dearer change of fewer inputs already fixes
        moved = {c.input for c in s.changes}
        if any({c.input for c in k.changes} <= moved and k.cost_key[1] <= s.cost_key[1] for k in kept):
            continue
        kept.append(s)
    return kept[:limit]


# ------------------------------------------------------------------------ mesh


def parse_mesh_shape(mesh: Sequence[int] | str) -> tuple[int, ...]:
    if isinstance(mesh, str):
        parts = [p.strip() for p in mesh.lower().replace("×", "x").split("x")]
        try:
            sizes = tuple(int(p) for p in parts)
        except ValueError:
            raise ValueError(f"malformed mesh {mesh!r}: expected sizes like 2x4") from None
    else:
        sizes = tuple(int(s) for s in mesh)
    if not sizes or any(s < 1 for s in sizes):
        raise ValueError(f"malformed mesh {mesh!r}: sizes must be positive integers")
    return sizes


def parse_mesh_placements(
    text: str | Sequence[Sequence[Any]],
    ndim: int,
    metas: Sequence[TensorMeta],
    names: Sequence[str],
) -> tuple[tuple[Any, ...], ...]:
    """Per tensor input, one torch placement per mesh dim."""
    from ._compat import to_torch_placement

    if isinstance(text, str):
        entries = [e for e in text.split(";")]
        rows = [parse_placements(e, ",") for e in entries]
    else:
        rows = [tuple(_to_placement(p) for p in row) for row in text]
    if len(rows) != len(metas):
        raise ValueError(
            f"expected mesh placements for {len(metas)} tensor inputs ({', '.join(names)}), "
            f"got {len(rows)}"
        )
    out = []
    for i, (row, m) in enumerate(zip(rows, metas)):
        if len(row) != ndim:
            raise ValueError(
                f"input {i} ({names[i]}): expected {ndim} placements (one per mesh dim), "
                f"got {len(row)}"
            )
        for p in row:
            if p is None:
                raise ValueError(f"input {i} ({names[i]}): a tensor placement cannot be None")
            if isinstance(p, ShardPlaceholder) and p.dim >= len(m.shape):
                raise ValueError(f"input {i} ({names[i]}) has {len(m.shape)} dims: {p} is out of range")
        out.append(tuple(to_torch_placement(p) for p in row))
    return tuple(out)


def mesh_report(op, args, kwargs, mesh, mesh_placements, metas, names) -> MeshReport:
    shape = parse_mesh_shape(mesh)
    current = parse_mesh_placements(mesh_placements, len(shape), metas, names)
    try:
        from .lift import rank_strategies
    except ImportError as e:
        raise ValueError(f"unsupported: lift not available ({e})") from None
    strategies = list(rank_strategies(op, args, kwargs, shape, current))
    return MeshReport(shape, current, strategies)


# ------------------------------------------------------------------- rendering


def _render(ex: Explanation) -> list[str]:
    from tabulate import tabulate

    out: list[str] = []
    sig = ", ".join(
        f"{n}: {_dtype(m.dtype)}{_shape(m.shape)}" for n, m in zip(ex.input_names, ex.input_metas)
    )
    out += _wrap(f"explain {ex.op}({sig})", 8)
    if ex.unsupported_reason:
        out.append(f"unsupported: {ex.unsupported_reason}")
        return out
    graph = ex.graph
    if ex.placements is not None:
        out += _wrap("candidate: " + ", ".join(map(str, ex.placements)), 11)
        out += _wrap("verdict:   " + _verdict_line(ex), 11)
    out.append("")

    if ex.placements is not None:
        env = _display_env(ex)
        out += _inputs_table(ex, env, tabulate)
        out.append("")
        out += _node_table(ex, env, tabulate)
        out.append("")
        out += _outcome(ex, tabulate)
    elif ex.mesh is None or ex.show_all:
        out += decomposition_lines(graph)
        out.append("")

    if ex.show_all or (ex.placements is None and ex.mesh is None):
        out += _all_section(ex)
    if ex.mesh is not None:
        out += _mesh_section(ex, tabulate)
    return out


def decomposition_lines(graph: PrimGraph) -> list[str]:
    """The recorded decomposition as a numbered list, with the source of each primitive's
    rules (no placements)."""
    from tabulate import tabulate

    from .rules.registry import source_of

    rows = []
    for n in graph.nodes:
        src = "constant" if n.constant else (source_of(n.op) or "?")
        rows.append((n.index, _call(graph, n, width=80), src))
    table = tabulate(rows, headers=["#", "primitive call (output shape)", "rules from"], tablefmt="simple")
    return [f"decomposition: {len(graph.nodes)} primitive calls"] + _indent(table)


def _verdict_line(ex: Explanation) -> str:
    v = ex.verdict
    if v == "accepted":
        rules = "; ".join(format_rule(r) for r in ex.rules)
        return f"ACCEPTED, no redistribution needed: {rules}"
    if v == "refused":
        return f"REFUSED by the local-shape check: {ex.local_refusal}"
    b = ex.blocked
    if b is None or b.node is None:
        return "REJECTED: " + (b.reason if b else "no rule matches")
    arriving = ", ".join("?" if p is None else str(p) for p in b.arriving)
    return f"REJECTED at node {b.node.index} ({b.node.op}): no rule accepts ({arriving})"


def _display_env(ex: Explanation) -> dict[int, MaybePlacement]:
    if ex.survivors:
        first = next((s for s in ex.survivors if s.ok), ex.survivors[0])
        return first.survivor.env
    if ex.blocked is not None and ex.blocked.env:
        return ex.blocked.env
    return dict(zip(ex.graph.inputs, ex.placements))


def _inputs_table(ex: Explanation, env, tabulate) -> list[str]:
    g = ex.graph
    rows = []
    for i, (v, name) in enumerate(zip(g.inputs, ex.input_names)):
        m = g.meta(v)
        rows.append((i, name, f"%{v}", _shape(m.shape), _dtype(m.dtype), _p(env.get(v, ex.placements[i]))))
    table = tabulate(rows, headers=["#", "input", "value", "shape", "dtype", "placement"], tablefmt="simple")
    return ["op inputs"] + _indent(table)


def _node_table(ex: Explanation, env, tabulate) -> list[str]:
    g = ex.graph
    blocked = ex.blocked.node.index if ex.blocked and ex.blocked.node else None
    if ex.blocked is not None and ex.blocked.node is None:
        blocked = -1  # died before the first node: nothing was reached
    path = _display_path(ex)
    rows, notes = [], []
    for n in g.nodes:
        call = _call(g, n, width=None)
        if n.constant:
            rows.append([n.index, call, "constant (same on every rank)", ""])
            continue
        if blocked is not None and n.index > blocked:
            rows.append([n.index, call, "(not reached)", ""])
            continue
        if blocked is not None and n.index == blocked:
            arriving = ", ".join(_p(p) for p in ex.blocked.arriving)
            rows.append([n.index, call, f"** NO RULE for ({arriving})", f"{ex.blocked.table_size} rules"])
            continue
        table = rules_for(n)
        if path is not None and n.index < len(path):
            ri = path[n.index]
            rule = table[ri]
            text = format_rule(rule)
            reads = [f"%{v} is R, read as {w}" for v, w in zip(n.inputs, rule.inputs)
                     if env.get(v) == R and w != R]
            if reads:  # the solver lets R stand for P(avg/max/min): no data moves
                text += f" [{len(notes) + 1}]"
                notes.append(f"[{len(notes) + 1}] node {n.index}: {', '.join(reads)} (a replicated "
                             "value is already a valid P(avg)/P(max)/P(min): no data moves)")
            rows.append([n.index, call, text, f"{rule.source} [{ri + 1}/{len(table)}]"])
        else:
            ins = ", ".join(_p(env.get(v)) for v in n.inputs)
            outs = ", ".join("None" if v is None else _p(env.get(v)) for v in n.outputs)
            rows.append([n.index, call, f"{ins} -> {outs}", ""])
    # the call column gets what the other columns leave of TABLE_WIDTH (at least 30)
    others = (max([12, *(len(r[2]) for r in rows)]) + max([15, *(len(r[3]) for r in rows)])
              + 3 + 3 * 2 + 2)  # the "#" column, column gaps, indent
    width = max(30, TABLE_WIDTH - others)
    for r in rows:
        if len(r[1]) > width:
            r[1] = r[1][: width - 3] + "..."
    table = tabulate(
        rows, headers=["#", "primitive call (output shape)", "rule matched", "from [rule k/n]"],
        tablefmt="simple",
    )
    head = f"decomposition: {len(g.nodes)} primitive calls"
    return [head] + _indent(table) + _indent([w for note in notes for w in _wrap(note, 4)])


def _display_path(ex: Explanation) -> tuple[int, ...] | None:
    if ex.survivors:
        first = next((s for s in ex.survivors if s.ok), ex.survivors[0])
        return first.survivor.path
    if ex.blocked is not None:
        return ex.blocked.path
    return None


def _outcome(ex: Explanation, tabulate) -> list[str]:
    g = ex.graph
    out: list[str] = []
    if ex.survivors:
        outs = []
        for k, s in enumerate(ex.survivors):
            surv = s.survivor
            rhs = ", ".join(_p(p) for p in s.local.outputs)
            cond = " [even]" if s.local.even_only else ""
            if s.ok:
                note = "passes the local-shape check"
                if s.local.reason:
                    note += f" ({s.local.reason})"
            else:
                note = f"REFUSED by the local-shape check: {s.local.reason}"
            outs += _wrap(f"  {k + 1}. outputs {rhs}{cond}: {note}", 5)
            if k and surv.path != ex.survivors[0].survivor.path:
                diff = [i for i, (a, b) in enumerate(zip(surv.path, ex.survivors[0].survivor.path)) if a != b]
                outs.append(f"     (takes other rules at nodes {', '.join(map(str, diff))})")
        n = len(ex.survivors)
        out.append(f"survives propagation with {n} output assignment{'s' if n > 1 else ''}"
                   + (" (the trace shows the first that passes)" if n > 1 else ""))
        out += outs
        out += _wrap("  outputs: " + ", ".join(
            "None" if v is None else f"%{v} {_shape(g.meta(v).shape)}" for v in g.outputs), 11)
        if ex.rules:
            out.append("derived rule" + ("s" if len(ex.rules) > 1 else "") + ":")
            for r in ex.rules:
                out.append(f"  {format_rule(r)}" + ("   (implied: all-Replicate)" if r.is_trivial() else ""))
                if r.even_only:
                    out.append("    [even]: holds only when every sharded dim splits evenly over the mesh")
        out.append("")
    if ex.blocked is not None:
        out += _blocked_section(ex, tabulate)
    if ex.suggestions:
        out.append("redistribution that makes it pass (fewest inputs changed, cheapest first):")
        for k, s in enumerate(ex.suggestions):
            if not s.changes:
                continue
            if len(s.changes) == 1:
                out += _wrap(f"  {k + 1}. redistribute {s.changes[0]}", 5)
            else:
                out.append(f"  {k + 1}. redistribute")
                for c in s.changes:
                    out += _wrap(f"       {c}", 9)
            note = "  (all-Replicate, always valid)" if s.rule.is_trivial() else ""
            out.append(f"     -> rule {format_rule(s.rule)}{note}")
        out.append("")
    return out


def _blocked_section(ex: Explanation, tabulate) -> list[str]:
    b = ex.blocked
    g = ex.graph
    if b.node is None:
        return [f"rejected before any node: {b.reason}", ""]
    n = b.node
    out = [f"blocked at node {n.index}: {_call(g, n, width=None)}", "  arriving:"]
    prod = g.producer()
    rows = []
    for k, (v, p) in enumerate(zip(n.inputs, b.arriving)):
        rows.append((k, f"%{v}", _shape(g.meta(v).shape), _p(p), _origin(ex, v, prod, b.path)))
    out += _indent(tabulate(rows, headers=["arg", "value", "shape", "placement", "came from"],
                            tablefmt="simple"), 4)
    out.append(f"  nearest of its {b.table_size} rules (fewest arguments differ):")
    rows = []
    for nr in b.nearest:
        what = "\n".join(
            f"arg {k} needs {_p(nr.rule.inputs[k])}, has {_p(b.arriving[k])}" for k in nr.differs
        ) or "matches"
        rows.append((format_rule(nr.rule), nr.rule.source, what))
    out += _indent(tabulate(rows, headers=["rule", "from", "differs"], tablefmt="simple"), 4)
    out.append("")
    return out


def _origin(ex: Explanation, v: int, prod: dict, path: tuple) -> str:
    g = ex.graph
    if v in g.inputs:
        i = g.inputs.index(v)
        return f"op input {i} ({ex.input_names[i]})"
    if v in prod:
        n = g.nodes[prod[v]]
        if n.constant:
            return f"node {n.index} {_short_op(n.op)} (constant)"
        if n.index < len(path):
            rule = rules_for(n)[path[n.index]]
            return f"node {n.index} {_short_op(n.op)}: {format_rule(rule)} ({rule.source})"
        return f"node {n.index} {_short_op(n.op)}"
    return "constant made outside the trace"


def _all_section(ex: Explanation) -> list[str]:
    d = ex.derived
    out = ["every derived rule (all-Replicate implied):"]
    out += _indent(str(d))
    rejected = d.rejected
    out.append("")
    out.append(f"rejected candidates ({len(rejected)}; * = not decided when it died):")
    out += [f"  {c}" for c in rejected] or ["  (none)"]
    out.append("")
    pruned = pruned_placements(ex)
    if pruned:
        out.append("placements that no derived rule uses, per input:")
        for i, p, why in pruned:
            out += _wrap(f"  input {i} ({ex.input_names[i]}) {p}: {why}", 6)
        out.append("")
    return out


def pruned_placements(ex: Explanation) -> list[tuple[int, Placement, str]]:
    """(input, placement, why) for every placement of an input's alphabet that appears in
    no derived rule. The solver never lists these as rejected candidates when the first
    node reading the input has no rule taking them: they are pruned before they exist."""
    g = ex.graph
    if g is None:
        return []
    out = []
    for i, v in enumerate(g.inputs):
        used = {r.inputs[i] for r in ex.derived.rules} | {R}
        reader = next((n for n in g.nodes if v in n.inputs and not n.constant), None)
        for p in input_alphabet(g, v):
            if p in used:
                continue
            if reader is None:
                why = "the input is never read"
            else:
                pos = [j for j, u in enumerate(reader.inputs) if u == v]
                if any(all(r.inputs[j] == p for j in pos) for r in rules_for(reader)):
                    why = (f"node {reader.index} ({_short_op(reader.op)}) takes it, but every candidate "
                           "with it needs redistribution later or fails the local-shape check")
                else:
                    why = f"no rule of node {reader.index} ({_short_op(reader.op)}) takes it"
            out.append((i, p, why))
    return out


def _mesh_section(ex: Explanation, tabulate) -> list[str]:
    m = ex.mesh
    size = "x".join(map(str, m.mesh_shape))
    cur = "; ".join(
        f"{name} ({', '.join(_tp(p) for p in row)})" for name, row in zip(ex.input_names, m.current)
    )
    out = [f"N-D strategies on mesh {size}, ranked by modeled cost (decompshard.cost; "
           "valid first, then cheapest)",
           f"  current: {cur}"]
    if not m.strategies:
        return out + ["  no strategy found", ""]
    chosen = m.chosen
    rows = []
    shown = m.strategies if ex.show_all else m.strategies[:MAX_MESH_SHOWN]
    for k, s in enumerate(shown):
        cost = s.cost
        rows.append((
            k + 1,
            "CHOSEN" if s is chosen else (
                ("" if s.cost is None or s.cost.dtensor_supported else "no-direct")
                if s.valid else "invalid"),
            _us(cost.total_seconds) if cost is not None else "-",
            len(cost.collectives) if cost is not None else "-",
            _us(cost.local_seconds) if cost is not None else "-",
            " | ".join(_p_row(row) for row in _transpose(s.input_placements)),
        ))
    out += _indent(tabulate(
        rows, headers=["rank", "", "total µs", "collectives", "local µs", "inputs needed"],
        tablefmt="simple", disable_numparse=True))
    if len(shown) < len(m.strategies):
        out.append(f"  ... {len(m.strategies) - len(shown)} more (use --all / show_all=True)")
    out.append("")
    for k, s in enumerate(shown):
        tag = " (CHOSEN)" if s is chosen else ("" if s.valid else " (invalid)")
        out.append(f"  #{k + 1}{tag}")
        for d, rule in enumerate(s.rules):
            out.append(f"    mesh dim {d}: {format_rule(rule)}  ({rule.source or 'derived'})")
        outs = " | ".join(_p_row(row) for row in _transpose(s.output_placements))
        out.append(f"    outputs: {outs}")
        if not s.valid and s.reason:
            out.append(f"    invalid: {s.reason}")
        elif s.reason:
            out.append(f"    note: {s.reason}")
        if s.cost is not None:
            out += _cost_lines(ex, s)
    out.append("")
    return out


def _cost_lines(ex: Explanation, s) -> list[str]:
    """The strategy's cost, per input redistribution (collectives and local work), when
    the per-input prices add up to the strategy's total; else the total's own lines."""
    total = s.cost.total_seconds
    head = f"    cost {_us(total)} µs (collectives {_us(total - s.cost.local_seconds)} µs, " \
        f"local work {_us(s.cost.local_seconds)} µs)" + (
            "" if s.cost.dtensor_supported else "; DTensor's redistribute rejects a step")
    out = [head]
    per_input = []
    try:
        from .cost import MeshShape, redistribute_cost

        mesh = MeshShape(ex.mesh.mesh_shape)
        for name, meta, src, dst in zip(ex.input_names, ex.input_metas, ex.mesh.current, s.input_placements):
            itemsize = torch.empty((), dtype=meta.dtype).element_size()
            c = redistribute_cost(tuple(meta.shape), itemsize, tuple(src), tuple(dst), mesh)
            per_input.append((name, src, dst, c))
    except Exception:  # noqa: BLE001 - display only: fall back to the summed lines
        per_input = []
    if per_input and math.isclose(sum(c.total_seconds for *_, c in per_input), total,
                                  rel_tol=1e-6, abs_tol=1e-12):
        for name, src, dst, c in per_input:
            if tuple(src) == tuple(dst):
                continue
            out.append(f"      {name}: {_p_row(src)} -> {_p_row(dst)}, {_us(c.total_seconds)} µs")
            out += [f"        - {line}" for line in c.explain()]
        if all(tuple(a) == tuple(b) for _, a, b, _ in per_input):
            out.append("      no input moves: free")
    else:
        out += [f"      - {line}" for line in s.cost.explain()]
    return out


def _transpose(placements) -> list[tuple]:
    """per-tensor rows of per-mesh-dim placements, whichever way round they come."""
    return [tuple(row) if isinstance(row, (tuple, list)) else row for row in placements]


def _p_row(row) -> str:
    if row is None:
        return "None"
    return "(" + ", ".join(_tp(p) for p in row) + ")"


# --------------------------------------------------------------- small formatters


def _p(p: MaybePlacement) -> str:
    return "?" if p is None else format_placement(p)


def _tp(p: Any) -> str:
    """A torch placement in the short alphabet (S(d), R, P(op)); None -> None."""
    if p is None:
        return "None"
    q = from_torch_placement(p)
    if q is NotImplemented:
        if hasattr(p, "split_factor"):
            return f"SS({p.dim},{p.split_factor})"
        return str(p)
    return format_placement(q)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.2f}"


_DTYPES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


def _dtype(dt: torch.dtype) -> str:
    return _DTYPES.get(dt, str(dt).replace("torch.", ""))


def _shape(shape: Sequence[int]) -> str:
    return "[" + ",".join(str(s) for s in shape) + "]"


def _short_op(op) -> str:
    return str(op).removeprefix("aten.")


def _call(g: PrimGraph, n: PrimNode, width: int | None = CALL_WIDTH) -> str:
    ids = iter(n.inputs)

    def sub(x):
        return _Id(next(ids)) if isinstance(x, TensorMeta) else x

    args, kwargs = tree_map(sub, (n.args, n.kwargs), is_leaf=lambda x: isinstance(x, TensorMeta))
    parts = [_arg(a) for a in args] + [f"{k}={_arg(v)}" for k, v in kwargs.items()]
    outs = ", ".join("_" if v is None else f"%{v}{_shape(g.meta(v).shape)}" for v in n.outputs)
    text = f"{outs} = {_short_op(n.op)}({', '.join(parts)})"
    if width is not None and len(text) > width:
        text = text[: width - 3] + "..."
    return text


class _Id:
    def __init__(self, v: int):
        self.v = v

    def __repr__(self) -> str:
        return f"%{self.v}"


def _arg(a: Any) -> str:
    if isinstance(a, torch.dtype):
        return _dtype(a)
    if isinstance(a, float):
        return f"{a:g}"
    if isinstance(a, torch.memory_format):
        return str(a).replace("torch.", "")
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]"
    return repr(a)


def _wrap(text: str, hang: int, width: int = WIDTH) -> list[str]:
    """Wrap a long line at `width`, continuation lines indented by `hang`."""
    return textwrap.wrap(
        text, width=width, subsequent_indent=" " * hang, break_long_words=False,
        break_on_hyphens=False,
    ) or [text]


def _indent(text: str | list[str], n: int = 2) -> list[str]:
    lines = text.splitlines() if isinstance(text, str) else text
    return [" " * n + line for line in lines]

