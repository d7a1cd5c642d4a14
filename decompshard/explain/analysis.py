"""explain's decisions: why an op gets (or refuses) a sharding for one candidate.

    >>> a = Analysis.of(aten.addmv.default, bias, mat, vec, placements="R; S(1); S(0)")
    >>> a.verdict, a.blocked, a.suggestions   # render.py draws it (text, HTML)

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

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from decompshard._compat import tree_flatten_with_path, tree_map
from decompshard._compat import TensorMeta
from decompshard.torch_placements import from_torch_placement
from decompshard.op_names import resolve_op
from decompshard.solve.derive import DerivedRules, derive_rules, native_rules, traced, unsupported_inputs
from decompshard.dispatch_modes.graph import PrimGraph, PrimNode
from decompshard.solve.localcheck import LocalVerdict, check_local
from decompshard.placements import MaybePlacement, P, Partial, Placement, R, Replicate, ShardPlaceholder, SingleDimRule, StridedShard, check_placement_rows, format_rule, parse_mesh_shape, parse_placement, parse_placement_rows, parse_placements
from decompshard.solve.propagate import Propagation, Survivor, input_alphabet, propagate
from decompshard.rules import rules_for
from decompshard.torch_placements import to_torch_placement
from decompshard.mesh.lift import rank_strategies
from decompshard.explain.plans import PlanReport, plan_report

__all__ = ["Analysis", "MeshReport", "Suggestion", "parse_candidate", "redistribution", "suggestions"]

MAX_SUGGESTIONS = 3
MAX_NEAREST = 3


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
    """N-D strategies ranked by modeled cost (from decompshard.mesh.lift.rank_strategies)."""

    mesh_shape: tuple[int, ...]
    current: tuple[tuple[Any, ...], ...]  # torch placements per tensor input, per mesh dim
    strategies: list  # lift.MeshStrategy, best first
    error: str | None = None

    @property
    def chosen(self):
        return next((s for s in self.strategies if s.valid), None)

    @property
    def moves(self) -> list[int]:
        """The tensor inputs the chosen strategy needs elsewhere than they are."""
        chosen = self.chosen
        if chosen is None:
            return []
        return [i for i, (have, need) in enumerate(zip(self.current, chosen.input_placements))
                if tuple(have) != tuple(need)]


@dataclass
class Analysis:
    """What `explain` found, as data; render.Explanation (a subclass) draws it."""

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
    # DTensor's own rules when the op has a native strategy (derive.native_rules); None
    # when it has none, or one decompshard cannot read
    native_rules: list[SingleDimRule] | None = None
    # the op's plan with collectives inside (explain/plans.py), priced where a mesh is given
    plan: PlanReport | None = None

    # ---------------------------------------------------------------- verdict

    @property
    def graph(self) -> PrimGraph | None:
        return self.derived.graph

    @property
    def unsupported_reason(self) -> str | None:
        return self.derived.unsupported_reason

    @property
    def native(self) -> str | None:
        """Where DTensor's own strategy for the op comes from, if it has one: DTensor
        then uses that, and the derivation shown is for comparison only."""
        return self.derived.native

    @property
    def native_accepts(self) -> list[SingleDimRule]:
        """DTensor's own rules that take the requested placements as they are."""
        if self.placements is None or self.native_rules is None:
            return []
        return [r for r in self.native_rules if r.inputs == self.placements]

    @property
    def rules(self) -> list[SingleDimRule]:
        """The derived rules whose inputs are exactly the requested placements."""
        if self.placements is None:
            return []
        if all(isinstance(p, Replicate) for p in self.placements):
            return [_trivial_rule(self.graph)] if self.graph is not None else []
        return [r for r in self.derived.rules if r.inputs == self.placements]

    @property
    def native_decides(self) -> bool:
        """DTensor's own strategy decides the op and decompshard derives nothing to compare
        with it (no decomposition): the verdict is that strategy's."""
        return bool(self.native) and self.graph is None and self.native_rules is not None

    @property
    def native_takes(self) -> bool:
        """DTensor's own strategy runs the requested placements as they are."""
        return self.placements is not None and (all(p == R for p in self.placements) or bool(self.native_accepts))

    @property
    def verdict(self) -> str:
        """The single-dim candidate's: 'unsupported', 'accepted', 'refused' (local-shape
        check), 'rejected', or 'none' (no candidate given). Where DTensor's own strategy
        decides (`native_decides`): 'accepted' when it takes the placements as they are,
        else 'rejected' (DTensor redistributes first)."""
        if self.native_decides and self.placements is not None:
            return "accepted" if self.native_takes else "rejected"
        if self.unsupported_reason and not self.native_decides:
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
    def mesh_verdict(self) -> str | None:
        """With a mesh: 'accepted' when the cheapest valid N-D strategy takes every input
        where it is, 'rejected' when it moves one (or there is none); else None (no mesh,
        or DTensor's own strategy decides: the ranking knows only derived strategies)."""
        if self.mesh is None or self.native_decides:
            return None
        return "accepted" if self.mesh.chosen is not None and not self.mesh.moves else "rejected"

    @property
    def local_refusal(self) -> str | None:
        """The local-shape check's reason, when it refused every survivor."""
        if self.verdict != "refused":
            return None
        return next(s.local.reason for s in self.survivors if not s.ok)

    # ---------------------------------------------------------------- building

    @classmethod
    def of(
        cls,
        op: torch._ops.OpOverload | str,
        *args: Any,
        placements: str | Sequence[Any] | None = None,
        mesh: Sequence[int] | str | None = None,
        mesh_placements: str | Sequence[Sequence[Any]] | None = None,
        show_all: bool = False,
        **kwargs: Any,
    ) -> "Analysis":
        """Follow `op(*args, **kwargs)` for one candidate; arguments as `explain()`
        documents them (render.py). Builds an instance of `cls`, so the printable
        subclass comes out of the same code. ValueError for bad input."""
        op = resolve_op(op)
        odd = unsupported_inputs(args, kwargs)
        if odd is not None:
            raise ValueError(f"unsupported: {odd}")
        names, metas = _tensor_inputs(op, args, kwargs)
        if not metas:
            raise ValueError(f"{op} has no tensor inputs in this call: nothing to shard")
        cand = None if placements is None else parse_candidate(placements, metas, names)
        if (mesh is None) != (mesh_placements is None):
            raise ValueError("mesh and mesh_placements go together: give both or neither")

        derived = derive_rules(op, *args, **kwargs)
        ex = cls(op, args, kwargs, names, metas, cand, derived, show_all=show_all)
        if derived.native:
            ex.native_rules = native_rules(op, *args, **kwargs)
        if derived.graph is not None and cand is not None:
            _follow(ex)
        if mesh is not None:
            ex.mesh = mesh_report(op, args, kwargs, mesh, mesh_placements, metas, names)
        ex.plan = plan_report(op, args, kwargs, *((ex.mesh.mesh_shape, ex.mesh.current) if ex.mesh else (None, None)))
        return ex


# ------------------------------------------------------------------- candidates


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


def _to_placement(p: Any, *, strided: bool = False) -> MaybePlacement:
    """A placement given as an object (ours, torch's) or text, in the grammar's types;
    strided shards only where they can be (`strided`: an N-D placement, not a rule's)."""
    if isinstance(p, (Replicate, ShardPlaceholder, Partial)) or p is None:
        return p
    if isinstance(p, StridedShard) and strided:
        return p
    if isinstance(p, str):
        return parse_placement(p, strided=strided)
    q = from_torch_placement(p, strided=strided)
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


def _follow(ex: Analysis) -> None:
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


def parse_mesh_placements(
    text: str | Sequence[Sequence[Any]],
    ndim: int,
    metas: Sequence[TensorMeta],
    names: Sequence[str],
) -> tuple[tuple[Any, ...], ...]:
    """Per tensor input, one torch placement per mesh dim: the text `check --placements`
    takes (placements.py's grammar and checks), converted to torch's types."""

    if isinstance(text, str):
        rows = parse_placement_rows(text)
    else:
        rows = tuple(tuple(_to_placement(p, strided=True) for p in row) for row in text)
    check_placement_rows(rows, [m.shape for m in metas], ndim, names)
    return tuple(tuple(to_torch_placement(p) for p in row) for row in rows)


def mesh_report(op, args, kwargs, mesh, mesh_placements, metas, names) -> MeshReport:
    shape = parse_mesh_shape(mesh)
    current = parse_mesh_placements(mesh_placements, len(shape), metas, names)
    strategies = list(rank_strategies(op, args, kwargs, shape, current))
    return MeshReport(shape, current, strategies)
