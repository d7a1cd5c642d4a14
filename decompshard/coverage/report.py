"""Coverage reports: the stable JSON document, tables for people, and diffs of two runs.

The JSON document (`build_report`) is the contract; tables and diffs are rendered from it,
so `--diff` and `--from` work on files written by any earlier run::

    {"version": decompshard version, "schema_version": 1, "torch_version": ...,
     "run" | "model": {how it was made},
     "ops": [{"op", "status", "reason", "registry" (native: single-dim | op-strategy | rule),
              "derived_rules" [rule strings], "n_derived", "n_confirmed", "n_incorrect",
              "n_untestable", "n_truth", "n_missed", "missed" [rules], "incorrect" [text],
              "verified" (the numerical check ran),
              "torch_fallback": {"status", "reason", "n_rules", "n_confirmed", "n_incorrect",
                                 "n_missed", "n_truth", "rules", "incorrect"},
              "seconds", "samples" [per-sample detail, same counts; "dropped_samples": the
                          checker's derived data samples it left out, with why (the op raised,
                          or its kernel's result depends on memory layout); "untestable": why
                          nothing could be judged], "calls" (--model only),
              "backward" (a backward op: `*_backward*`, or reached only by autograd's backward
                          of the OpInfo samples; absent in reports made before it existed)}],
     "summary": {"ops", "status" {status: count}, "verified_ops",
                 "decompshard" | "torch_fallback": {"ops_with_rules", "rules", "confirmed",
                     "incorrect", "missed", "truth", "precision", "precision_mean",
                     "recall", "recall_mean"},
                 "backward": {the same summary over the backward ops alone}}}

The summary's top-level counts are over every op, forward and backward; tables show the
backward ops in a section of their own, after the forward ones.

`ops` is sorted by op name. Counts are summed over an op's samples (at most 2, best
first: `sweep.pick_samples`); rule lists are the distinct union over them. `n_truth`
counts the rules the numerical checker found valid (the same truth for both sides), so recall is
(n_truth - n_missed) / n_truth and precision n_confirmed / (n_confirmed + n_incorrect).
`status` is one of `sweep.STATUSES`; `torch_fallback.status` is supported |
replicate-only | unsupported | n/a (not run: native op, or nothing to run it on).
A run stopped by Ctrl-C has `"run": {"interrupted": true, "ops_selected": N, ...}` and
the records of the ops that finished.

Tables: an op name is never cut (it must stay copyable and greppable); at a given width
only the reason column wraps. Plain text has one cell format per table for the rule
counts, and its legend appears only when the table has counts to explain. Markdown is
GitHub's: headings, blank lines around every table. CSV is one table that Python's `csv`
reads back.
"""

from __future__ import annotations

import csv
import io
import json
import textwrap
from importlib import metadata
from typing import Any, Iterable, Sequence

import torch
from tabulate import tabulate

from decompshard.coverage.progress import Progress  # noqa: F401 - re-exported: model_audit imports it from here
from decompshard.coverage.sweep import STATUS_MEANINGS, STATUSES

SCHEMA_VERSION = 1
SIDES = (("decompshard", ""), ("torch_fallback", "torch_fallback"))


def package_version() -> str:
    try:
        return metadata.version("decompshard")
    except metadata.PackageNotFoundError:  # pragma: no cover - running from a bare checkout
        return "0+unknown"


def _side(rec: dict[str, Any], side: str) -> dict[str, Any]:
    """Counts of one side in a common shape (ours live at the top level of the record)."""
    if side == "decompshard":
        return {"n_rules": rec.get("n_derived", 0), **{k: rec.get(k, 0) for k in
                ("n_confirmed", "n_incorrect", "n_missed", "n_truth")}}
    tf = rec.get("torch_fallback") or {}
    return {k: tf.get(k, 0) for k in ("n_rules", "n_confirmed", "n_incorrect", "n_missed")} | {
        "n_truth": tf.get("n_truth", rec.get("n_truth", 0))}


def _ratio(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


def _mean(values: Sequence[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Status totals, and precision/recall of both sides (micro: pooled counts; mean: the
    average of per-op ratios, so a few ops with many rules do not dominate); under
    "backward", the same over the backward ops alone."""
    out = _summarize(records)
    out["backward"] = _summarize([r for r in records if r.get("backward")])
    return out


def _summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    status = {s: 0 for s in STATUSES}
    for r in records:
        status[r["status"]] = status.get(r["status"], 0) + 1
    out: dict[str, Any] = {"ops": len(records), "status": status,
                           "verified_ops": sum(1 for r in records if r.get("n_truth", 0) > 0)}
    for side, _ in SIDES:
        cs = [_side(r, side) for r in records if r["status"] != "native"]
        tested = [c for c in cs if c["n_confirmed"] + c["n_incorrect"]]
        truthful = [c for c in cs if c["n_truth"]]
        conf, inc = sum(c["n_confirmed"] for c in cs), sum(c["n_incorrect"] for c in cs)
        truth, missed = sum(c["n_truth"] for c in cs), sum(c["n_missed"] for c in cs)
        out[side] = {
            "ops_with_rules": sum(1 for c in cs if c["n_rules"]),
            "rules": sum(c["n_rules"] for c in cs), "confirmed": conf, "incorrect": inc,
            "missed": missed, "truth": truth,
            "precision": _ratio(conf, conf + inc),
            "precision_mean": _mean([c["n_confirmed"] / (c["n_confirmed"] + c["n_incorrect"]) for c in tested]),
            "recall": _ratio(truth - missed, truth),
            "recall_mean": _mean([(c["n_truth"] - c["n_missed"]) / c["n_truth"] for c in truthful]),
        }
    return out


def build_report(records: Iterable[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The JSON document: records sorted by op name, plus the summary."""
    ops = sorted(records, key=lambda r: r["op"])
    doc = {"version": package_version(), "schema_version": SCHEMA_VERSION,
           "torch_version": torch.__version__, **extra, "ops": ops, "summary": summarize(ops)}
    return doc


def load_report(path: str) -> dict[str, Any]:
    """Read a JSON report; ValueError (exit 2) when it is missing, unreadable or not one."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read coverage report {path!r}: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("ops"), list) or not all(
        isinstance(r, dict) and "op" in r and "status" in r for r in doc["ops"]
    ):
        raise ValueError(f"{path!r} is not a decompshard coverage JSON report (no 'ops' list)")
    return doc


# ------------------------------------------------------------------ tables


SIDE_HEADS = ("decompshard", "torch")
LEGEND_CHECKED = ("decompshard, torch (torch's own decomposition fallback): rules claimed / confirmed "
                  "valid / incorrect / valid but missed, summed over the op's samples; -: not run "
                  "(native op, no sample, or the numerical check did not run)")
LEGEND_CLAIMED = ("decompshard, torch (torch's own decomposition fallback): rules claimed (no numerical "
                  "check ran)")


def _checked(records: Sequence[dict[str, Any]]) -> bool:
    """Did the numerical check run anywhere in this table? Decides the cell format."""
    return any(r.get("verified") for r in records)


def _counts(rec: dict[str, Any], side: str, checked: bool) -> str:
    """One cell: 'claimed/confirmed/incorrect/missed' in a checked table ('-' for the parts
    not checked on this op), the bare claimed count otherwise; '-' when the side did not run."""
    if side == "torch_fallback":
        if (rec.get("torch_fallback") or {}).get("status", "n/a") == "n/a":
            return "-"
    elif rec["status"] == "native" or not rec.get("samples"):
        return "-"
    c = _side(rec, side)
    if not checked:
        return str(c["n_rules"])
    if not rec.get("verified"):
        return f"{c['n_rules']}/-/-/-"
    return f"{c['n_rules']}/{c['n_confirmed']}/{c['n_incorrect']}/{c['n_missed']}"


def _legend(rows: Sequence[Sequence[str]], checked: bool, at: int) -> str | None:
    if all(row[at] == "-" and row[at + 1] == "-" for row in rows):
        return None  # nothing but native ops (or no samples): no counts to explain
    return LEGEND_CHECKED if checked else LEGEND_CLAIMED


def _wrap(text: str, width: int | None) -> list[str]:
    if width is None:
        return [text]
    return textwrap.wrap(text, max(8, width), break_on_hyphens=False) or [""]


def _collapse_whitespace(text: Any) -> str:
    """A reason on one line with nothing cut: its lines and runs of spaces joined by one
    space (a table cell wraps it; `errors.one_line` is the other job, an exception's
    first line)."""
    return " ".join(str(text).split())


def _text_table(rows: list[list[str]], head: list[str], width: int | None, wrap_col: int) -> str:
    """tabulate's plain table, fitted to `width` without cutting any cell: the `wrap_col`
    column (the last, free text) wraps inside its cell; when less than 24 columns are left
    for it, it goes on indented lines under its row; when even the other columns do not
    fit, each row's first cell (the op) gets a line of its own above the rest."""
    def table(rs: list[list[str]], hd: list[str]) -> list[str]:
        return tabulate(rs, hd, tablefmt="simple", disable_numparse=True).splitlines()

    if width is None:
        return "\n".join(table(rows, head))
    fixed = table([r[:wrap_col] for r in rows], head[:wrap_col])
    room = width - max(len(line) for line in fixed) - 2
    if room >= 24:
        return "\n".join(table([[*r[:wrap_col], "\n".join(_wrap(r[wrap_col], room))] for r in rows], head))

    def under(row: list[str], indent: int) -> list[str]:
        return [" " * indent + w for w in _wrap(row[wrap_col], width - indent)] if row[wrap_col] else []

    if max(len(line) for line in fixed) <= width:
        out = fixed[:2]
        for line, row in zip(fixed[2:], rows):
            out += [line, *under(row, 4)]
        return "\n".join(out)
    rest = table([r[1:wrap_col] for r in rows], head[1:wrap_col])
    out = [head[0]] + ["  " + line for line in rest[:2]]
    for line, row in zip(rest[2:], rows):
        out += [row[0], "  " + line, *under(row, 4)]
    return "\n".join(out)


def render_table(records: Sequence[dict[str, Any]], fmt: str = "text", width: int | None = None,
                 show_rules: bool = False) -> str:
    """One row per op (text, markdown or csv; see `render` for the whole report). text:
    full op names; at `width` the reason wraps (None: one line per row)."""
    calls = any("calls" in r for r in records)
    if fmt == "csv":
        return _csv(records, calls, show_rules)
    checked = _checked(records)
    head = ["op", *(["calls"] if calls else []), "status", *SIDE_HEADS, "reason"]
    at = 3 if calls else 2  # the first count column
    rows = [[r["op"], *([str(r.get("calls", ""))] if calls else []), r["status"],
             _counts(r, "decompshard", checked), _counts(r, "torch_fallback", checked), _collapse_whitespace(r.get("reason") or "")]
            for r in records]
    legend = _legend(rows, checked, at) if rows else None
    if fmt == "markdown":
        md_rows = [[*row[:-1], row[-1].replace("|", "\\|")] for row in rows]
        out = [tabulate(md_rows, head, tablefmt="github", disable_numparse=True)]
        out += ["", legend] if legend else []
        return "\n".join(out)
    out = [_text_table(rows, head, width, len(head) - 1)]
    out += _wrap(legend, width) if legend else []
    return "\n".join(out)


def _csv(records: Sequence[dict[str, Any]], calls: bool, show_rules: bool = False) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["op", *(["calls"] if calls else []), "status", "registry", "n_derived", "n_confirmed",
                "n_incorrect", "n_missed", "n_truth", "verified", "torch_status", "torch_n_rules",
                "torch_n_confirmed", "torch_n_incorrect", "torch_n_missed", "seconds", "backward", "reason",
                *(["derived_rules"] if show_rules else [])])
    for r in records:
        tf = r.get("torch_fallback") or {}
        w.writerow([r["op"], *([r.get("calls", "")] if calls else []), r["status"], r.get("registry") or "",
                    r.get("n_derived", 0), r.get("n_confirmed", 0), r.get("n_incorrect", 0), r.get("n_missed", 0),
                    r.get("n_truth", 0), int(bool(r.get("verified"))), tf.get("status", ""), tf.get("n_rules", 0),
                    tf.get("n_confirmed", 0), tf.get("n_incorrect", 0), tf.get("n_missed", 0), r.get("seconds", 0),
                    int(bool(r.get("backward"))), r.get("reason") or "", *(["; ".join(r.get("derived_rules", []))] if show_rules else [])])
    return buf.getvalue().rstrip("\n")


def render_rules(records: Sequence[dict[str, Any]], fmt: str = "text", width: int | None = None) -> str:
    """Each op's derived rules (--show-rules), one per line, without going to JSON."""
    with_rules = [r for r in records if r.get("derived_rules")]
    if fmt == "markdown":
        out = ["## Derived rules", "", "All-Replicate is implied; `[even]`: only when every sharded dim "
               "splits evenly."]
        for r in with_rules:
            out += ["", f"### {r['op']} ({len(r['derived_rules'])})", ""]
            out += [f"- `{rule}`" for rule in r["derived_rules"]]
        return "\n".join(out if with_rules else out[:1] + ["", "(no op has a derived rule)"])
    out = _wrap("Derived rules (all-Replicate implied; [even]: only when every sharded dim splits evenly)",
                width)
    for r in with_rules:
        out += ["", f"{r['op']} ({len(r['derived_rules'])})"] + [f"  {rule}" for rule in r["derived_rules"]]
    return "\n".join(out if with_rules else out + ["", "(no op has a derived rule)"])


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def render_summary(summary: dict[str, Any], fmt: str = "text", width: int | None = None) -> str:
    """The totals block: status counts, then both sides' precision and recall."""
    tf = "github" if fmt == "markdown" else "simple"
    st = summary["status"]
    bw = summary.get("backward") or {}
    status_head = ["status", "ops", "meaning"]  # meaning last: it wraps (_text_table)
    status_rows = [[s, st.get(s, 0), STATUS_MEANINGS[s]] for s in STATUSES] + [["total", summary["ops"], ""]]
    if bw.get("ops"):  # the backward ops' share of each count
        bst = bw["status"]
        status_head.insert(2, "of them backward")
        for row, s in zip(status_rows, [*STATUSES, None]):
            row.insert(2, bw["ops"] if s is None else bst.get(s, 0))
    a, b = summary["decompshard"], summary["torch_fallback"]
    lines = [
        ("ops with >= 1 rule", "ops_with_rules", str), ("rules claimed", "rules", str),
        ("confirmed valid", "confirmed", str), ("incorrect", "incorrect", str),
        ("valid but missed", "missed", str), ("precision (micro)", "precision", _pct),
        ("precision (mean per op)", "precision_mean", _pct), ("recall (micro)", "recall", _pct),
        ("recall (mean per op)", "recall_mean", _pct),
    ]
    if not summary["verified_ops"]:  # no numerical check ran (--no-verify, model audits)
        lines = lines[:2]
        note = "no numerical check ran: rule counts are claims, unverified"
    else:
        note = (f"precision/recall over the {summary['verified_ops']} non-native ops the numerical "
                f"checker could judge ({summary['decompshard']['truth']} valid rules in all)")
    side_rows = [[label, f(a[key]), f(b[key])] for label, key, f in lines]
    status_rows = [[str(c) for c in row] for row in status_rows]
    status_table = (_text_table(status_rows, status_head, width, len(status_head) - 1) if fmt == "text"
                    else tabulate(status_rows, status_head, tablefmt=tf, disable_numparse=True))
    side_table = tabulate(side_rows, ["", "decompshard", "torch fallback"], tablefmt=tf,
                          colalign=("left", "right", "right"), disable_numparse=True)
    title = ["## Summary", ""] if fmt == "markdown" else ["Summary", "======="]
    out = [*title, status_table, "", side_table, "", *_wrap(note, width)]
    if bw.get("ops") and bw.get("verified_ops"):
        b = bw["decompshard"]
        out += _wrap(f"backward ops alone: {b['ops_with_rules']} with >= 1 rule, {b['rules']} rules claimed, "
                     f"{b['confirmed']} confirmed valid, {b['incorrect']} incorrect, {b['missed']} valid but "
                     f"missed", width)
    return "\n".join(out)


BACKWARD_TITLE = "Backward ops (what autograd's backward of the OpInfo samples adds to their forward)"


def render(doc: dict[str, Any], fmt: str = "text", width: int | None = None,
           statuses: Sequence[str] | None = None, show_rules: bool = False) -> str:
    """The whole report in one format; `statuses` filters table rows (never the summary).
    text/markdown: the forward table, the backward ops' table under a heading of its own
    (when there are any), the derived rules (`show_rules`), the summary; csv: one table
    (one header, one row per op, a `backward` column); json: the document."""
    if fmt == "json":
        return json.dumps(doc, indent=1)
    ops = [r for r in doc["ops"] if not statuses or r["status"] in statuses]
    if fmt == "csv":
        return render_table(ops, fmt, width, show_rules)
    forward = [r for r in ops if not r.get("backward")]
    backward = [r for r in ops if r.get("backward")]
    run = doc.get("run") or {}
    partial = (_wrap(f"partial report: interrupted after {len(doc['ops'])} of {run.get('ops_selected', '?')} "
                     "ops", width) + [""] if run.get("interrupted") else [])
    out = list(partial)
    if forward or not backward:
        table = render_table(forward, fmt, width, show_rules)
        out += ["## Ops", "", table] if fmt == "markdown" else [table]
    if backward:
        table = render_table(backward, fmt, width, show_rules)
        gap = [""] if out else []
        if fmt == "markdown":
            out += [*gap, f"## {BACKWARD_TITLE}", "", table]
        else:
            title = _wrap(BACKWARD_TITLE, width)
            out += [*gap, *title, "=" * min(max(len(t) for t in title), width or 10**6), table]
    if show_rules:
        out += ["", render_rules(ops, fmt, width)]
    out += ["", render_summary(doc["summary"], fmt, width)]
    return "\n".join(out)


# ------------------------------------------------------------------ diff


def diff_reports(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """What changed between two JSON reports: ops added/removed, status changes, derived
    rules gained/lost (an op that appears gains all its rules, one that disappears loses
    them), torch-fallback rule counts (null where the op is absent), summary deltas."""
    a = {r["op"]: r for r in old["ops"]}
    b = {r["op"]: r for r in new["ops"]}
    changes = []
    for op in sorted(a.keys() | b.keys()):
        ra, rb = a.get(op), b.get(op)
        ga = ra.get("derived_rules", []) if ra else []
        gb = rb.get("derived_rules", []) if rb else []
        gained, lost = [x for x in gb if x not in ga], [x for x in ga if x not in gb]
        ta = (ra.get("torch_fallback") or {}).get("n_rules", 0) if ra else None
        tb = (rb.get("torch_fallback") or {}).get("n_rules", 0) if rb else None
        sa, sb = (ra["status"] if ra else "(absent)"), (rb["status"] if rb else "(absent)")
        if sa != sb or gained or lost or ta != tb:
            changes.append({"op": op, "old": sa, "new": sb, "gained": gained, "lost": lost,
                            "torch_rules": [ta, tb]})
    sa = old.get("summary") or summarize(old["ops"])
    sb = new.get("summary") or summarize(new["ops"])
    summary = {}
    for s in STATUSES:
        summary[s] = _delta(sa["status"].get(s, 0), sb["status"].get(s, 0))
    summary["ops"] = _delta(sa.get("ops", 0), sb.get("ops", 0))
    ba, bb = sa.get("backward") or {}, sb.get("backward") or {}
    if ba or bb:  # a report made before the backward section has none: its deltas are "-"
        for s in STATUSES:
            summary[f"backward.{s}"] = _delta((ba.get("status") or {}).get(s), (bb.get("status") or {}).get(s))
        summary["backward.ops"] = _delta(ba.get("ops"), bb.get("ops"))
        for key in ("rules", "incorrect"):
            summary[f"backward.decompshard.{key}"] = _delta((ba.get("decompshard") or {}).get(key),
                                                            (bb.get("decompshard") or {}).get(key))
    for side, _ in SIDES:
        for key in ("ops_with_rules", "rules", "confirmed", "incorrect", "missed", "precision",
                    "precision_mean", "recall", "recall_mean"):
            summary[f"{side}.{key}"] = _delta(sa.get(side, {}).get(key), sb.get(side, {}).get(key))
    return {"old": {"version": old.get("version"), "torch_version": old.get("torch_version")},
            "new": {"version": new.get("version"), "torch_version": new.get("torch_version")},
            "changes": changes, "summary": summary}


def _delta(x: Any, y: Any) -> dict[str, Any]:
    d = None if x is None or y is None else round(y - x, 4)
    return {"old": x, "new": y, "delta": d}


def render_diff(diff: dict[str, Any], fmt: str = "text", width: int | None = None) -> str:
    """text/markdown: the per-op changes and the summary changes; csv: the per-op changes
    alone, one row per op (the summary deltas are in --format json)."""
    if fmt == "json":
        return json.dumps(diff, indent=1)
    if fmt == "csv":
        return _diff_csv(diff)
    rows = []
    for c in diff["changes"]:
        rules = "; ".join([f"+{x}" for x in c["gained"]] + [f"-{x}" for x in c["lost"]])
        ta, tb = c["torch_rules"]
        rows.append([c["op"], c["old"] if c["old"] == c["new"] else f"{c['old']} -> {c['new']}",
                     f"+{len(c['gained'])}/-{len(c['lost'])}", "" if ta == tb else f"{_fmt(ta)} -> {_fmt(tb)}",
                     rules])
    head = ["op", "status", "derived rules", "torch rules", "changed rules"]
    srows = [[k, _fmt(v["old"]), _fmt(v["new"]), _fmt(v["delta"], signed=True)]
             for k, v in diff["summary"].items() if v["old"] != v["new"]]
    shead = ["", "old", "new", "delta"]
    if fmt == "markdown":
        md = [[*r[:-1], r[-1].replace("|", "\\|")] for r in rows]
        out = ["## Changes per op", "",
               tabulate(md, head, tablefmt="github", disable_numparse=True) if rows else "No per-op changes."]
        out += ["", "## Summary changes", "",
                tabulate(srows, shead, tablefmt="github", disable_numparse=True) if srows else "None."]
        return "\n".join(out)
    out = [_text_table(rows, head, width, 4) if rows else "no per-op changes"]
    out += ["", "Summary changes", "===============",
            tabulate(srows, shead, tablefmt="simple", disable_numparse=True) if srows else "none"]
    return "\n".join(out)


def _diff_csv(diff: dict[str, Any]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["op", "old_status", "new_status", "rules_gained", "rules_lost", "old_torch_rules",
                "new_torch_rules", "gained", "lost"])
    for c in diff["changes"]:
        ta, tb = c["torch_rules"]
        w.writerow([c["op"], c["old"], c["new"], len(c["gained"]), len(c["lost"]), "" if ta is None else ta,
                    "" if tb is None else tb, "; ".join(c["gained"]), "; ".join(c["lost"])])
    return buf.getvalue().rstrip("\n")


def _fmt(x: Any, signed: bool = False) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:+.3f}" if signed else f"{x:.3f}"
    return f"{x:+d}" if signed and isinstance(x, int) else str(x)
