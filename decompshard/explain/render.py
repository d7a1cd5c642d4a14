"""explain as text: the inputs table, the numbered decomposition with the rule each
primitive matched, the blocking node, suggestions, `--all` and the mesh ranking.

What is drawn is decided in analysis.py (which imports nothing from here); the row
builders (`input_rows`, `node_rows`, ...) are shared with the HTML view (notebook.py).
Everything fits a width (`render_lines(ex, width)`, 120 by default): prose wraps, and
the primitive-call column of the decomposition gets what the other columns leave.
"""

from __future__ import annotations

import contextvars
import math
import textwrap
from typing import Any, Sequence

import torch

from decompshard._compat import tree_map
from decompshard._compat import TensorMeta
from decompshard.torch_placements import from_torch_placement
from decompshard.dispatch_modes.graph import PrimGraph, PrimNode
from decompshard.placements import MaybePlacement, Placement, R, SingleDimRule, format_placement, format_rule
from decompshard.solve.propagate import input_alphabet
from decompshard.rules import rules_for
from decompshard.explain.analysis import Analysis
from decompshard.dispatch_modes.tracing import decomposition_origin
from decompshard.rules.registry import source_of
from decompshard.mesh.cost import MeshShape, redistribute_cost

__all__ = ["DEFAULT_WIDTH", "came_from", "decomposition_heading", "decomposition_lines", "display_env",
           "display_path", "input_rows", "mesh_verdict_line", "node_rows", "plan_lines", "render_lines",
           "verdict_line"]

DEFAULT_WIDTH = 120  # str(explanation); the CLI passes the terminal's width
CALL_WIDTH = 58  # a primitive call in a one-line mention is cut here
MAX_MESH_SHOWN = 5
_WIDTH: contextvars.ContextVar[int] = contextvars.ContextVar("explain_width", default=DEFAULT_WIDTH)


def render_lines(ex: Analysis, width: int = DEFAULT_WIDTH) -> list[str]:
    """The trace as lines of at most about `width` columns (tables shrink their widest
    free-text column; a line can exceed it only where a single token is longer)."""
    token = _WIDTH.set(max(60, width))
    try:
        return _render_lines(ex)
    finally:
        _WIDTH.reset(token)


def _render_lines(ex: Analysis) -> list[str]:
    from tabulate import tabulate

    out: list[str] = []
    sig = ", ".join(
        f"{n}: {dtype_name(m.dtype)}{_shape(m.shape)}" for n, m in zip(ex.input_names, ex.input_metas)
    )
    out += _wrap(f"explain {ex.op}({sig})", 8)
    if ex.native:
        out += _wrap("native:    " + _native_line(ex), 11)
    if ex.unsupported_reason and not ex.native_decides:
        out.append(f"unsupported: {ex.unsupported_reason}")
        return out
    graph = ex.graph
    if ex.placements is not None:
        out += _wrap("candidate: " + ", ".join(map(str, ex.placements)), 11)
        out += _wrap("verdict:   " + _verdict_line(ex), 11)
    if ex.mesh is not None:  # the N-D verdict: does the cheapest strategy move an input
        out += _wrap("verdict:   " + mesh_verdict_line(ex), 11)
    out.append("")
    if ex.native_decides:  # nothing derived to trace: DTensor's own rules are the answer
        return out + _native_rules_section(ex)

    if ex.placements is not None:
        env = display_env(ex)
        out += _inputs_table(ex, env, tabulate)
        out.append("")
        out += _node_table(ex, env, tabulate)
        out.append("")
        out += _outcome(ex, tabulate)
    elif ex.mesh is None or ex.show_all:
        out += decomposition_lines(graph, ex.op)
        out.append("")

    if ex.show_all or (ex.placements is None and ex.mesh is None):
        out += _all_section(ex)
    if ex.mesh is not None:
        out += _mesh_section(ex, tabulate)
    if ex.plan is not None:
        out += plan_lines(ex)
    return out


def plan_lines(ex: Analysis) -> list[str]:
    """The op's collective plan (explain/plans.py): its collectives for this call, their
    bytes next to DTensor's strategy's, and which one enable() runs."""
    r = ex.plan
    where = r.info.module
    out = _wrap(f"collective plan: {r.info.what} ({where})", 2)
    if r.mesh_shape is None:
        return out + _wrap("  not priced: its collectives depend on the mesh; give --mesh and --mesh-placements "
                           "(e.g. --mesh 4 --mesh-placements \"S(0);R;...\"; from Python mesh=, mesh_placements=)",
                           4) + [""]
    if r.error:
        return out + _wrap(f"  not priced: {r.error}", 4) + [""]
    size = "x".join(map(str, r.mesh_shape))
    native = "no strategy (DTensor would raise)" if r.dtensor is None else _moved(r.dtensor)
    if r.priced is None:
        out += _wrap(f"  the plan does not apply to these placements on mesh {size} (it takes: {r.info.applies})", 4)
        out += _wrap(f"  DTensor's strategy moves: {native}", 4)
        out += _native_lines(r.dtensor)
        out += ["  enable() runs: DTensor's strategy" + ("" if r.needed else " (it moves nothing: no plan needed)"), ""]
        return out
    p = r.priced
    out.append(f"  on mesh {size}, the plan's steps:" if p.steps else f"  on mesh {size}, the plan moves nothing")
    for k, step in enumerate(p.steps):
        out += _wrap(f"    {k + 1}. {step.what}: " + _step_numbers(step), 7)
    collectives = [c for s in p.steps for c in s.cost.collectives]
    numbers = sum(int(c.bytes // s.itemsize) for s in p.steps for c in s.cost.collectives)
    out.append(f"  the plan moves:           {_moved(p.cost)}" + (f"; {_numbers(numbers)} in its collectives"
                                                                    if collectives else ""))
    out.append(f"  DTensor's strategy moves: {native}")
    out += _native_lines(r.dtensor)
    choice = "the plan" if r.taken else "DTensor's strategy"
    out += _wrap(f"  enable() runs: {choice} (it decides by {p.rule})", 4)
    return out + [""]


def _step_numbers(step: Any) -> str:
    """A step's collectives: numbers in the message (its kind where the step's words do
    not start with it), group, bytes each rank sends."""
    if not step.cost.collectives:
        return "local work only, " + _bytes(step.cost.local_bytes) if step.cost.local_bytes else "nothing moves"
    parts = []
    for c in step.cost.collectives:
        kind = c.kind.replace("_", "-")
        parts.append(("" if step.what.startswith(kind) else kind + " of ")
                     + _numbers(int(c.bytes // step.itemsize)) + " " + _collective_where(c))
    return "; ".join(parts)


def _numbers(n: int) -> str:
    return f"{n} number{'s' if n != 1 else ''}"


def _collective_where(c: Any) -> str:
    return f"over {c.label or f'mesh dims {c.mesh_dims}'} ({c.group_size} ranks), {_bytes(c.wire_bytes)} sent per rank"


def _native_lines(cost: Any) -> list[str]:
    """DTensor's strategy's collectives (message size: the gathered / reduced tensor, the
    largest shard's) and local copies."""
    if cost is None:
        return []
    out = [f"    - {c.kind.replace('_', '-')} of {_bytes(c.bytes)} {_collective_where(c)}" for c in cost.collectives]
    return out + [f"    - local {w.what} on mesh dim {w.mesh_dim}: {_bytes(w.bytes)} read+write" for w in cost.local_work]


def _moved(cost: Any) -> str:
    """The bytes a plan is compared on (the cost model's: sent per rank plus local copies)."""
    n = len(cost.collectives)
    return f"{_bytes(cost.bytes_moved)} ({n} collective{'s' if n != 1 else ''}" + (
        f", {_bytes(cost.local_bytes)} of it local copies)" if cost.local_bytes else ")")


def _bytes(n: float) -> str:
    if n >= 1 << 20:
        return f"{n / (1 << 20):.2f} MiB"
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n:.0f} B"


def decomposition_heading(op: Any, graph: PrimGraph) -> str:
    """'decomposition: N primitive calls', and for a custom op whose code was traced
    (its implementation or its registered reference)."""

    origin = decomposition_origin(op) if op is not None else ""
    return f"decomposition: {len(graph.nodes)} primitive calls" + (f" (traced: {origin})" if origin else "")


def decomposition_lines(graph: PrimGraph, op: Any = None) -> list[str]:
    """The recorded decomposition as a numbered list, with the source of each primitive's
    rules (no placements)."""
    from tabulate import tabulate


    rows = []
    for n in graph.nodes:
        src = "constant" if n.constant else (source_of(n.op) or "?")
        rows.append((n.index, _call(graph, n, width=_WIDTH.get() - 40), src))
    table = tabulate(rows, headers=["#", "primitive call (output shape)", "rules from"], tablefmt="simple")
    return [decomposition_heading(op, graph)] + _indent(table)


def _native_line(ex: Analysis) -> str:
    head = (f"DTensor has its own strategy for this op ({ex.native}) and uses it; decompshard.enable() "
            + ("never replaces it." if ex.plan is None else
               "replaces it only with the collective plan at the end, where that moves less."))
    if ex.native_decides:  # the verdict below is that strategy's
        why = ex.unsupported_reason.split(": ", 1)[0]  # e.g. 'no decomposition'
        return head + f" decompshard derives nothing to compare it with ({why})."
    tail = " Below, for comparison only: what decompshard derives from the op's decomposition."
    if ex.native_rules is None:
        return head + " (decompshard cannot read that strategy.)" + tail
    if ex.placements is None:
        return head + tail
    if all(p == R for p in ex.placements) or ex.native_accepts:
        took = "; ".join(format_rule(r) for r in ex.native_accepts) or "all-Replicate"
        return head + f" It runs this candidate as it is: {took}." + tail
    cand = ", ".join(map(str, ex.placements))
    return head + f" None of its rules takes ({cand}) as it is: DTensor redistributes first." + tail


def verdict_line(ex: Analysis) -> str:
    """The one-line verdict (also the HTML view's headline)."""
    return _verdict_line(ex)


def _verdict_line(ex: Analysis) -> str:
    v = ex.verdict
    if ex.native_decides:
        if v == "accepted":
            took = "; ".join(format_rule(r) for r in ex.native_accepts) or "all-Replicate"
            return f"ACCEPTED by DTensor's own strategy, no redistribution needed: {took}"
        cand = ", ".join(map(str, ex.placements))
        near = _native_nearest(ex)
        return (f"REDISTRIBUTED first by DTensor: none of its own rules takes ({cand}) as it is"
                + (f"; the nearest: {format_rule(near[0])}" if near else ""))
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


def mesh_verdict_line(ex: Analysis) -> str:
    """The N-D verdict: the cheapest valid strategy, and the inputs it moves, if any."""
    m = ex.mesh
    size = "x".join(map(str, m.mesh_shape))
    if ex.native_decides:
        return (f"on mesh {size}: DTensor's own strategy decides, mesh dim by mesh dim from the rules below; "
                "decompshard ranks only the strategies it derives, and derives none here")
    chosen = m.chosen
    if chosen is None:
        return f"on mesh {size}: REJECTED, no valid N-D strategy"
    if not m.moves:
        return f"on mesh {size}: ACCEPTED, no redistribution needed: the cheapest strategy (#1) takes every input as it is"
    moved = "; ".join(f"{ex.input_names[i]} {_p_row(m.current[i])} -> {_p_row(chosen.input_placements[i])}"
                      for i in m.moves)
    cost = "" if chosen.cost is None else f", {_us(chosen.cost.total_seconds)} µs modeled"
    return f"on mesh {size}: REDISTRIBUTE first: the cheapest strategy (#1{cost}) moves {moved}"


def _native_rules_section(ex: Analysis) -> list[str]:
    """DTensor's own rules for this call, nearest to the candidate first (fewest inputs
    that differ): what DTensor picks from when it redistributes."""
    rules = _native_nearest(ex)
    shown = rules if ex.show_all else rules[:MAX_MESH_SHOWN]
    out = [f"DTensor's own rules for this call ({len(rules)}, all-Replicate implied"
           + (", nearest to the candidate first" if ex.placements is not None else "") + "):"]
    out += [f"  {format_rule(r)}" for r in shown]
    if len(shown) < len(rules):
        out.append(f"  ... {len(rules) - len(shown)} more (use --all / show_all=True)")
    return out + [""]


def _native_nearest(ex: Analysis) -> list[SingleDimRule]:
    """DTensor's own rules but all-Replicate, fewest inputs unlike the candidate first."""
    rules = [r for r in ex.native_rules or [] if not r.is_trivial()]
    if ex.placements is not None:
        rules.sort(key=lambda r: sum(a != b for a, b in zip(r.inputs, ex.placements)))
    return rules


def display_env(ex: Analysis) -> dict[int, MaybePlacement]:
    """The placement of every value the trace shows: the first survivor that passes, or
    the dying state up to where it died, or just the requested inputs."""
    if ex.survivors:
        first = next((s for s in ex.survivors if s.ok), ex.survivors[0])
        return first.survivor.env
    if ex.blocked is not None and ex.blocked.env:
        return ex.blocked.env
    return dict(zip(ex.graph.inputs, ex.placements))


def display_path(ex: Analysis) -> tuple[int, ...] | None:
    """The rule index matched at each node, for the state `display_env` shows."""
    if ex.survivors:
        first = next((s for s in ex.survivors if s.ok), ex.survivors[0])
        return first.survivor.path
    if ex.blocked is not None:
        return ex.blocked.path
    return None



INPUT_HEAD = ["#", "input", "value", "shape", "dtype", "placement"]
NODE_HEAD = ["#", "primitive call (output shape)", "rule matched", "from [rule k/n]"]


def input_rows(ex: Analysis, env: dict[int, MaybePlacement]) -> list[tuple]:
    """One row per op input: INPUT_HEAD."""
    g = ex.graph
    rows = []
    for i, (v, name) in enumerate(zip(g.inputs, ex.input_names)):
        m = g.meta(v)
        rows.append((i, name, f"%{v}", _shape(m.shape), dtype_name(m.dtype), _p(env.get(v, ex.placements[i]))))
    return rows


def node_rows(ex: Analysis, env: dict[int, MaybePlacement]) -> tuple[list[list], list[str], dict[int, str]]:
    """(rows as NODE_HEAD with the full call text, footnotes, node index -> its state:
    'constant', 'matched', 'blocked', 'not reached' or 'free' (no rule table consulted))."""
    g = ex.graph
    blocked = ex.blocked.node.index if ex.blocked and ex.blocked.node else None
    if ex.blocked is not None and ex.blocked.node is None:
        blocked = -1  # died before the first node: nothing was reached
    path = display_path(ex)
    rows, notes, state = [], [], {}
    for n in g.nodes:
        call = _call(g, n, width=None)
        if n.constant:
            rows.append([n.index, call, "constant (same on every rank)", ""])
            state[n.index] = "constant"
            continue
        if blocked is not None and n.index > blocked:
            rows.append([n.index, call, "(not reached)", ""])
            state[n.index] = "not reached"
            continue
        if blocked is not None and n.index == blocked:
            arriving = ", ".join(_p(p) for p in ex.blocked.arriving)
            rows.append([n.index, call, f"** NO RULE for ({arriving})", f"{ex.blocked.table_size} rules"])
            state[n.index] = "blocked"
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
            state[n.index] = "matched"
        else:
            ins = ", ".join(_p(env.get(v)) for v in n.inputs)
            outs = ", ".join("None" if v is None else _p(env.get(v)) for v in n.outputs)
            rows.append([n.index, call, f"{ins} -> {outs}", ""])
            state[n.index] = "free"
    return rows, notes, state


def _inputs_table(ex: Analysis, env, tabulate) -> list[str]:
    table = tabulate(input_rows(ex, env), headers=INPUT_HEAD, tablefmt="simple")
    return ["op inputs"] + _indent(table)


def _node_table(ex: Analysis, env, tabulate) -> list[str]:
    rows, notes, _ = node_rows(ex, env)
    # the call column gets what the other columns leave of the width (at least 30; at
    # least 24 once "from [rule k/n]" is on two lines, for a narrow terminal)
    def others() -> int:
        longest = [max(len(line) for line in str(r[3]).splitlines() or [""]) for r in rows]
        return (max([12, *(len(r[2]) for r in rows)]) + max([15, *longest])
                + 3 + 3 * 2 + 2)  # the "#" column, column gaps, indent

    head = list(NODE_HEAD)
    width = _WIDTH.get() - 4 - others()
    if width < 30:
        for r in rows:
            r[3] = r[3].replace(" [", "\n[", 1)
        head[1] = "call (output shape)"
        width = max(24, _WIDTH.get() - 4 - others())
    for r in rows:
        if len(r[1]) > width:
            r[1] = r[1][: width - 3] + "..."
    table = tabulate(rows, headers=head, tablefmt="simple")
    head = decomposition_heading(ex.op, ex.graph)
    return [head] + _indent(table) + _indent([w for note in notes for w in _wrap(note, 4)])


def _outcome(ex: Analysis, tabulate) -> list[str]:
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


def _blocked_section(ex: Analysis, tabulate) -> list[str]:
    b = ex.blocked
    g = ex.graph
    if b.node is None:
        return [f"rejected before any node: {b.reason}", ""]
    n = b.node
    out = [f"blocked at node {n.index}: {_call(g, n, width=None)}", "  arriving:"]
    prod = g.producer()
    rows = []
    for k, (v, p) in enumerate(zip(n.inputs, b.arriving)):
        rows.append([k, f"%{v}", _shape(g.meta(v).shape), _p(p), came_from(ex, v, prod, b.path)])
    head = ["arg", "value", "shape", "placement", "came from"]
    fixed = tabulate([r[:4] for r in rows], headers=head[:4], tablefmt="simple").splitlines()
    room = _WIDTH.get() - 4 - 2 - max(len(line) for line in fixed)
    if room >= 24:  # "came from" wraps in its cell when the line would be too long
        rows = [[*r[:4], "\n".join(_wrap(r[4], 0, room))] for r in rows]
    out += _indent(tabulate(rows, headers=head, tablefmt="simple"), 4)
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


def came_from(ex: Analysis, v: int, prod: dict, path: tuple) -> str:
    """Where a value arriving at the blocking node came from, and the rule that placed
    it: one wording for the terminal and the notebook."""
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


def _all_section(ex: Analysis) -> list[str]:
    d = ex.derived
    out = ["every derived rule (all-Replicate implied):"]
    out += _indent(str(d))
    rejected = d.rejected
    out.append("")
    out.append(f"rejected candidates ({len(rejected)}; * = not decided when it died):")
    out += [line for c in rejected for line in _wrap(f"  {c}", 4)] or ["  (none)"]
    out.append("")
    pruned = pruned_placements(ex)
    if pruned:
        out.append("placements that no derived rule uses, per input:")
        for i, p, why in pruned:
            out += _wrap(f"  input {i} ({ex.input_names[i]}) {p}: {why}", 6)
        out.append("")
    return out


def pruned_placements(ex: Analysis) -> list[tuple[int, Placement, str]]:
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


def _mesh_section(ex: Analysis, tabulate) -> list[str]:
    m = ex.mesh
    size = "x".join(map(str, m.mesh_shape))
    cur = "; ".join(
        f"{name} ({', '.join(_tp(p) for p in row)})" for name, row in zip(ex.input_names, m.current)
    )
    out = [f"N-D strategies on mesh {size}, ranked by modeled cost (decompshard.mesh.cost; "
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


def _cost_lines(ex: Analysis, s) -> list[str]:
    """The strategy's cost, per input redistribution (collectives and local work), when
    the per-input prices add up to the strategy's total; else the total's own lines."""
    total = s.cost.total_seconds
    head = f"    cost {_us(total)} µs (collectives {_us(total - s.cost.local_seconds)} µs, " \
        f"local work {_us(s.cost.local_seconds)} µs)" + (
            "" if s.cost.dtensor_supported else "; DTensor's redistribute rejects a step")
    out = [head]
    per_input = []
    try:

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
    q = from_torch_placement(p, strided=True)  # _StridedShard as the grammar writes it, _S(d, sf)
    return str(p) if q is NotImplemented else format_placement(q)


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:.2f}"


DTYPE_NAMES = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64", torch.complex128: "c128",
}


def dtype_name(dt: torch.dtype) -> str:
    return DTYPE_NAMES.get(dt, str(dt).replace("torch.", ""))


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
        return dtype_name(a)
    if isinstance(a, float):
        return f"{a:g}"
    if isinstance(a, torch.memory_format):
        return str(a).replace("torch.", "")
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_arg(x) for x in a)
        return f"[{inner}]"
    return repr(a)


def _wrap(text: str, hang: int, width: int | None = None) -> list[str]:
    """Wrap a long line at `width` (the rendering width less 10), continuation lines
    indented by `hang`."""
    return textwrap.wrap(
        text, width=width or _WIDTH.get() - 10, subsequent_indent=" " * hang, break_long_words=False,
        break_on_hyphens=False,
    ) or [text]


def _indent(text: str | list[str], n: int = 2) -> list[str]:
    lines = text.splitlines() if isinstance(text, str) else text
    return [" " * n + line for line in lines]

