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
              "seconds", "samples" [per-sample detail, same counts], "calls" (--model only)}],
     "summary": {"ops", "status" {status: count}, "verified_ops",
                 "decompshard" | "torch_fallback": {"ops_with_rules", "rules", "confirmed",
                     "incorrect", "missed", "truth", "precision", "precision_mean",
                     "recall", "recall_mean"}}}

`ops` is sorted by op name. Counts are summed over an op's samples (at most 2, largest
first); rule lists are the distinct union over them. `n_truth` counts the rules the
numerical checker found valid (the same truth for both sides), so recall is
(n_truth - n_missed) / n_truth and precision n_confirmed / (n_confirmed + n_incorrect).
`status` is one of `sweep.STATUSES`; `torch_fallback.status` is supported |
replicate-only | unsupported | n/a (not run: native op, or nothing to run it on).
"""

from __future__ import annotations

import csv
import io
import json
import sys
import time
from importlib import metadata
from typing import Any, Iterable, Sequence, TextIO

import torch
from tabulate import tabulate

from .sweep import STATUSES

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
    average of per-op ratios, so a few ops with many rules do not dominate)."""
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


def _cut(text: str, width: int) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: max(1, width - 3)] + "..."


def _counts(rec: dict[str, Any], side: str) -> str:
    """'rules/ok/bad/missed', or a word when the side did not run."""
    if side == "torch_fallback":
        st = (rec.get("torch_fallback") or {}).get("status", "n/a")
        if st in ("n/a", "unsupported"):
            return "-" if st == "n/a" else "unsup."
    elif rec["status"] == "native" or not rec.get("samples"):
        return "-"
    c = _side(rec, side)
    if not rec.get("verified", True):
        return str(c["n_rules"])
    return f"{c['n_rules']}/{c['n_confirmed']}/{c['n_incorrect']}/{c['n_missed']}"


LEGEND = "derived, torch: rules / confirmed / incorrect / valid-but-missed, summed over the op's samples"


def _squeeze(name: str, width: int) -> str:
    """Cut the middle of an over-long op name, keeping its start and overload visible."""
    if len(name) <= width:
        return name
    tail = min(len(name.rsplit(".", 1)[-1]) + 6, width // 2)
    return name[: width - tail - 3] + "..." + name[-tail:]


def render_table(records: Sequence[dict[str, Any]], fmt: str = "text", width: int = 120) -> str:
    """One row per op. text: fits `width` columns by cutting long reasons (and, if the
    reason would get under 40 columns, the middle of very long op names); JSON and
    markdown/csv keep the full text."""
    calls = any("calls" in r for r in records)
    head = ["op", *(["calls"] if calls else []), "status", "derived", "torch", "reason"]
    rows = [[r["op"], *([str(r.get("calls", ""))] if calls else []), r["status"],
             _counts(r, "decompshard"), _counts(r, "torch_fallback"), r.get("reason") or ""]
            for r in records]
    if fmt == "csv":
        return _csv(records, calls)
    if fmt == "markdown":
        rows = [[*row[:-1], str(row[-1]).replace("|", "\\|")] for row in rows]
        return tabulate(rows, head, tablefmt="github", disable_numparse=True)
    def base_width(rs: list[list[str]]) -> int:  # the table's width minus its reason column
        blank = tabulate([[*r[:-1], ""] for r in rs], head, tablefmt="simple", disable_numparse=True)
        return max(len(line) for line in blank.splitlines()) - len(head[-1]) - 2

    fixed = base_width(rows)
    if width - fixed < 40:  # very long op names: cut their middle rather than every reason
        op_w = max(len(str(r[0])) for r in rows)
        cap = max(32, op_w - (40 - (width - fixed)))
        rows = [[_squeeze(row[0], cap), *row[1:]] for row in rows]
        fixed = base_width(rows)
    room = width - fixed - 2
    if room < 24:  # a narrow terminal: each reason on its own indented line under its row
        lines = tabulate([r[:-1] for r in rows], head[:-1], tablefmt="simple", disable_numparse=True).splitlines()
        out = lines[:2]
        for line, row in zip(lines[2:], rows):
            out += [line, "    " + _cut(row[-1], width - 4)] if row[-1] else [line]
        return "\n".join(out) + "\n" + _cut(LEGEND, width)
    rows = [[*row[:-1], _cut(row[-1], room)] for row in rows]
    return tabulate(rows, head, tablefmt="simple", disable_numparse=True) + "\n" + _cut(LEGEND, width)


def _csv(records: Sequence[dict[str, Any]], calls: bool) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["op", *(["calls"] if calls else []), "status", "registry", "n_derived", "n_confirmed",
                "n_incorrect", "n_missed", "n_truth", "torch_status", "torch_n_rules", "torch_n_confirmed",
                "torch_n_incorrect", "torch_n_missed", "seconds", "reason"])
    for r in records:
        tf = r.get("torch_fallback") or {}
        w.writerow([r["op"], *([r.get("calls", "")] if calls else []), r["status"], r.get("registry") or "",
                    r.get("n_derived", 0), r.get("n_confirmed", 0), r.get("n_incorrect", 0), r.get("n_missed", 0),
                    r.get("n_truth", 0), tf.get("status", ""), tf.get("n_rules", 0), tf.get("n_confirmed", 0),
                    tf.get("n_incorrect", 0), tf.get("n_missed", 0), r.get("seconds", 0), r.get("reason") or ""])
    return buf.getvalue().rstrip("\n")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def render_summary(summary: dict[str, Any], fmt: str = "text") -> str:
    """The totals block: status counts, then both sides' precision and recall."""
    tf = "github" if fmt == "markdown" else "simple"
    st = summary["status"]
    status_rows = [[s, st.get(s, 0)] for s in STATUSES] + [["total", summary["ops"]]]
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
    return "\n".join([
        "Summary",
        tabulate(status_rows, ["status", "ops"], tablefmt=tf, disable_numparse=True),
        "",
        tabulate(side_rows, ["", "decompshard", "torch fallback"], tablefmt=tf,
                 colalign=("left", "right", "right"), disable_numparse=True),
        note,
    ])


def render(doc: dict[str, Any], fmt: str = "text", width: int = 120,
           statuses: Sequence[str] | None = None) -> str:
    """The whole report in one format; `statuses` filters table rows (never the summary)."""
    if fmt == "json":
        return json.dumps(doc, indent=1)
    ops = [r for r in doc["ops"] if not statuses or r["status"] in statuses]
    table = render_table(ops, fmt, width)
    if fmt == "csv":
        return table
    return f"{table}\n\n{render_summary(doc['summary'], fmt)}"


# ------------------------------------------------------------------ diff


def diff_reports(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """What changed between two JSON reports: ops added/removed, status changes, derived
    rules gained/lost, torch-fallback rule count changes, summary deltas."""
    a = {r["op"]: r for r in old["ops"]}
    b = {r["op"]: r for r in new["ops"]}
    changes = []
    for op in sorted(a.keys() | b.keys()):
        ra, rb = a.get(op), b.get(op)
        if ra is None or rb is None:
            changes.append({"op": op, "old": ra["status"] if ra else "(absent)",
                            "new": rb["status"] if rb else "(absent)", "gained": [], "lost": [],
                            "torch_rules": [ra and ra.get("torch_fallback", {}).get("n_rules", 0),
                                            rb and rb.get("torch_fallback", {}).get("n_rules", 0)]})
            continue
        ga, gb = ra.get("derived_rules", []), rb.get("derived_rules", [])
        gained, lost = [x for x in gb if x not in ga], [x for x in ga if x not in gb]
        ta = ra.get("torch_fallback", {}).get("n_rules", 0)
        tb = rb.get("torch_fallback", {}).get("n_rules", 0)
        if ra["status"] != rb["status"] or gained or lost or ta != tb:
            changes.append({"op": op, "old": ra["status"], "new": rb["status"], "gained": gained,
                            "lost": lost, "torch_rules": [ta, tb]})
    sa = old.get("summary") or summarize(old["ops"])
    sb = new.get("summary") or summarize(new["ops"])
    summary = {}
    for s in STATUSES:
        summary[s] = _delta(sa["status"].get(s, 0), sb["status"].get(s, 0))
    summary["ops"] = _delta(sa.get("ops", 0), sb.get("ops", 0))
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


def render_diff(diff: dict[str, Any], fmt: str = "text", width: int = 120) -> str:
    if fmt == "json":
        return json.dumps(diff, indent=1)
    tf = {"markdown": "github", "csv": "tsv"}.get(fmt, "simple")
    rows = []
    for c in diff["changes"]:
        rules = " ".join([f"+{x}" for x in c["gained"]] + [f"-{x}" for x in c["lost"]])
        ta, tb = c["torch_rules"]
        rows.append([c["op"], c["old"] if c["old"] == c["new"] else f"{c['old']} -> {c['new']}",
                     f"+{len(c['gained'])}/-{len(c['lost'])}", "" if ta == tb else f"{ta} -> {tb}", rules])
    head = ["op", "status", "derived rules", "torch rules", "changed rules"]
    if fmt == "text":
        fixed = sum(max([len(str(r[i])) for r in rows] + [len(head[i])]) + 2 for i in range(4))
        rows = [[*r[:4], _cut(r[4], max(20, width - fixed))] for r in rows]
    out = [tabulate(rows, head, tablefmt=tf, disable_numparse=True) if rows else "no per-op changes"]
    srows = [[k, _fmt(v["old"]), _fmt(v["new"]), _fmt(v["delta"], signed=True)]
             for k, v in diff["summary"].items() if v["old"] != v["new"]]
    out += ["", "Summary changes", tabulate(srows, ["", "old", "new", "delta"], tablefmt=tf,
                                            disable_numparse=True) if srows else "none"]
    return "\n".join(out)


def _fmt(x: Any, signed: bool = False) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:+.3f}" if signed else f"{x:.3f}"
    return f"{x:+d}" if signed and isinstance(x, int) else str(x)


# ------------------------------------------------------------------ progress


class Progress:
    """A one-line `\\r` counter on a TTY, a plain line every `every` ops otherwise; always
    on stderr, so stdout (JSON) stays clean."""

    def __init__(self, total: int, stream: TextIO | None = None, every: int = 50, enabled: bool = True):
        self.total, self.done, self.every, self.enabled = total, 0, every, enabled
        self.stream = stream or sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.monotonic()

    def step(self, name: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.t0
        if self.tty:
            line = f"[{self.done:>{len(str(self.total))}}/{self.total}] {elapsed:5.0f}s {name}"
            self.stream.write("\r" + line[:79].ljust(79))
            self.stream.flush()
        elif self.done % self.every == 0 or self.done == self.total:
            self.stream.write(f"coverage: {self.done}/{self.total} ops ({elapsed:.0f} s)\n")
            self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty and self.done:
            self.stream.write("\r" + " " * 79 + "\r")
            self.stream.flush()
