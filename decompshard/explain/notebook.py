"""explain as HTML, for notebooks (`Explanation._repr_html_`), in the spirit of torch's
`visualize_sharding`: the verdict as a coloured headline, the op's inputs and the
decomposition as real tables with each placement coloured by kind (R, S(d), P), the node
where the candidate dies highlighted and the nodes it never reached greyed, then what
arrived there, the nearest rules and the redistributions that pass. The full text trace
sits folded at the end (it also carries the --all and mesh sections).

The markup is well-formed XML (every tag closed, every text escaped, inline styles only:
notebook front ends strip <style> blocks), so tests parse it with ElementTree.
"""

from __future__ import annotations

from html import escape
from typing import Any, Iterable, Sequence

from decompshard.placements import format_rule
from decompshard.explain.analysis import Analysis
from decompshard.explain.render import INPUT_HEAD, NODE_HEAD, came_from, decomposition_heading, display_env, dtype_name, input_rows, node_rows, render_lines, verdict_line

__all__ = ["render_html"]

VERDICT_COLORS = {  # background, text
    "accepted": ("#e6f4ea", "#137333"),
    "refused": ("#fef7e0", "#b06000"),
    "rejected": ("#fce8e6", "#c5221f"),
    "unsupported": ("#fce8e6", "#c5221f"),
    "none": ("#f1f3f4", "#3c4043"),
}
PLACEMENT_COLORS = {"R": "#e8eaed", "S": "#d2e3fc", "P": "#fde7c8"}
ROW_STYLES = {
    "blocked": "background:#fce8e6;color:#c5221f;font-weight:bold",
    "not reached": "color:#9aa0a6",
    "constant": "color:#5f6368;font-style:italic",
}
_CELL = "padding:2px 8px;border:1px solid #dadce0;text-align:left"
_MONO = "font-family:monospace"


def render_html(ex: Analysis) -> str:
    """The explanation as one HTML fragment (a <div>)."""
    out = ['<div class="decompshard-explain" style="font-family:sans-serif;font-size:13px">']
    sig = ", ".join(f"{n}: {dtype_name(m.dtype)}[{','.join(map(str, m.shape))}]"
                    for n, m in zip(ex.input_names, ex.input_metas))
    out.append(_tag("div", f"explain {ex.op}({sig})", style=f"{_MONO};font-weight:bold;margin-bottom:4px"))
    if ex.native:
        out.append(_tag("div", f"DTensor has its own strategy for this op ({ex.native}) and uses it; "
                        "what follows is decompshard's derivation, for comparison only.",
                        cls="native", style="color:#5f6368;margin-bottom:4px"))
    verdict = ex.verdict
    bg, fg = VERDICT_COLORS[verdict]
    if verdict == "unsupported":
        headline = f"UNSUPPORTED: {ex.unsupported_reason}"
    elif verdict == "none" and ex.native_decides:
        headline = f"no candidate given: DTensor's own strategy has {len(ex.native_rules)} rules for this call"
    elif verdict == "none":
        headline = f"no candidate given: {len(ex.derived.rules)} derived rules (all-Replicate implied)"
    else:
        headline = verdict_line(ex)
    if ex.placements is not None:
        out.append(_tag("div", "candidate: " + ", ".join(map(str, ex.placements)), style=_MONO))
    out.append(_tag("div", headline, cls=f"verdict verdict-{verdict}",
                    style=f"background:{bg};color:{fg};font-weight:bold;padding:4px 8px;margin:4px 0;"
                    "border-radius:4px"))
    if verdict == "unsupported" or ex.graph is None:  # nothing derived to draw (DTensor's own strategy decides)
        out.append("</div>")
        return "".join(out)

    if ex.placements is not None:
        env = display_env(ex)
        out.append(_heading("op inputs"))
        out.append(_table(INPUT_HEAD, input_rows(ex, env), cls="inputs", placement_cols={5}))
        rows, notes, state = node_rows(ex, env)
        out.append(_heading(decomposition_heading(ex.op, ex.graph)))
        out.append(_table(NODE_HEAD, rows, cls="decomposition",
                          row_class=[state[r[0]].replace(" ", "-") for r in rows],
                          row_style=[ROW_STYLES.get(state[r[0]], "") for r in rows], mono_cols={1, 2}))
        out += [_tag("div", n, style="color:#5f6368") for n in notes]
        out += _blocked(ex)
        out += _suggestions(ex)
        if ex.rules:
            out.append(_heading("derived rule" + ("s" if len(ex.rules) > 1 else "")))
            out.append(_list(format_rule(r) for r in ex.rules))
    else:
        out.append(_heading("derived rules (all-Replicate implied)"))
        out.append(_table(["#", "rule", "from"], [(k + 1, format_rule(r), r.source)
                                                  for k, r in enumerate(ex.derived.rules)],
                          cls="rules", mono_cols={1}))
    text = "\n".join(render_lines(ex)).rstrip()
    out.append('<details style="margin-top:6px"><summary>text trace</summary>'
               + _tag("pre", text, style=f"{_MONO};white-space:pre;line-height:1.3") + "</details>")
    out.append("</div>")
    return "".join(out)


def _blocked(ex: Analysis) -> list[str]:
    b = ex.blocked
    if b is None:
        return []
    if b.node is None:
        return [_heading("rejected before any node"), _tag("div", b.reason)]
    g = ex.graph
    prod = g.producer()
    out = [_heading(f"blocked at node {b.node.index} ({b.node.op}): what arrived")]
    arriving = []
    for k, (v, p) in enumerate(zip(b.node.inputs, b.arriving)):
        arriving.append((k, f"%{v}", "[" + ",".join(map(str, g.meta(v).shape)) + "]",
                         "?" if p is None else str(p), came_from(ex, v, prod, b.path)))
    out.append(_table(["arg", "value", "shape", "placement", "came from"], arriving, cls="arriving",
                      placement_cols={3}))
    out.append(_heading(f"nearest of its {b.table_size} rules (fewest arguments differ)"))
    near = []
    for nr in b.nearest:
        what = "; ".join(f"arg {k} needs {nr.rule.inputs[k]}, has {b.arriving[k]}" for k in nr.differs)
        near.append((format_rule(nr.rule), nr.rule.source, what or "matches"))
    out.append(_table(["rule", "from", "differs"], near, cls="nearest", mono_cols={0}))
    return out


def _suggestions(ex: Analysis) -> list[str]:
    items = []
    for s in ex.suggestions:
        if not s.changes:
            continue
        moves = "; ".join(str(c) for c in s.changes)
        note = " (all-Replicate, always valid)" if s.rule.is_trivial() else ""
        items.append(f"redistribute {moves} -> rule {format_rule(s.rule)}{note}")
    if not items:
        return []
    return [_heading("redistribution that makes it pass (fewest inputs changed, cheapest first)"),
            "<ol>" + "".join(_tag("li", i) for i in items) + "</ol>"]


# ------------------------------------------------------------------ markup


def _tag(name: str, text: str, cls: str = "", style: str = "") -> str:
    attrs = (f' class="{escape(cls)}"' if cls else "") + (f' style="{escape(style)}"' if style else "")
    return f"<{name}{attrs}>{escape(str(text))}</{name}>"


def _heading(text: str) -> str:
    return _tag("div", text, style="font-weight:bold;margin:8px 0 2px 0")


def _list(items: Iterable[str]) -> str:
    return "<ul>" + "".join(_tag("li", i, style=_MONO) for i in items) + "</ul>"


def _placement_style(text: str) -> str:
    kind = text[:1] if text[:1] in PLACEMENT_COLORS else ""
    return f"background:{PLACEMENT_COLORS[kind]};{_MONO}" if kind else _MONO


def _table(head: Sequence[str], rows: Sequence[Sequence[Any]], cls: str, placement_cols: set[int] = frozenset(),
           mono_cols: set[int] = frozenset(), row_class: Sequence[str] | None = None,
           row_style: Sequence[str] | None = None) -> str:
    out = [f'<table class="{escape(cls)}" style="border-collapse:collapse;margin:2px 0"><thead><tr>']
    out += [_tag("th", h, style=_CELL + ";background:#f1f3f4") for h in head]
    out.append("</tr></thead><tbody>")
    for i, row in enumerate(rows):
        rc = row_class[i] if row_class else ""
        rs = row_style[i] if row_style else ""
        attrs = (f' class="{escape(rc)}"' if rc else "") + (f' style="{escape(rs)}"' if rs else "")
        out.append(f"<tr{attrs}>")
        for j, cell in enumerate(row):
            style = _CELL
            if j in placement_cols:
                style += ";" + _placement_style(str(cell))
            elif j in mono_cols:
                style += ";" + _MONO
            out.append(_tag("td", cell, style=style))
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)
