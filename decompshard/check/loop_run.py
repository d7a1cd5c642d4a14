"""Run the training-loop zoo (check/loop.py) on real gloo processes and make its table.

One group of 4 gloo processes per parallelism runs that parallelism's runs in order
(each variant with `enable()` and with torch alone), with a deadline: a hung collective
ends the group, its finished runs stand and the rest are ERROR rows naming why. Used by
`bench/zoo_loop.py` and tests/test_zoo_loop.py.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import time
from typing import Any, Callable, Sequence

__all__ = ["WORLD", "against_us", "await_ranks", "fold", "merge_ranks", "render", "run_matrix", "spawn_ranks"]

WORLD = 4
_TIMES = ("first_s", "later_s", "first_cpu_s", "later_cpu_s")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int, deadline: float) -> str:
    """`fn(rank, *args)` in `nprocs` processes (forked from a server that imported torch
    and decompshard once); '' when all exit 0 in time, else why not (the others killed)."""
    import multiprocessing

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "decompshard", "decompshard.check.loop"])
    procs = [ctx.Process(target=fn, args=(rank, *args)) for rank in range(nprocs)]
    for p in procs:
        p.start()
    return await_ranks(procs, deadline)


def await_ranks(procs: Sequence[Any], deadline: float) -> str:
    """Wait for started rank processes: '' when all exit 0 within `deadline` seconds,
    else why not; the others are killed either way (a rank that died leaves the rest
    blocked in a collective)."""
    import multiprocessing.connection

    end = time.monotonic() + deadline
    try:
        while True:
            failed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if failed:
                return f"gloo process(es) {failed} exited abnormally (rank, exit code)"
            running = [p.sentinel for p in procs if p.is_alive()]
            if not running:
                return ""
            if time.monotonic() > end:
                return f"gloo processes still running after {deadline:.0f} s (a hung collective?)"
            multiprocessing.connection.wait(running, timeout=2)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()


def merge_ranks(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row from every rank's LoopRun dict of one run: the worst verdict (its rank's
    detail), the slowest rank's times (wall and CPU), the largest error, each distinct warning with the
    number of ranks that gave it."""
    order = {"OK": 0, "WRONG": 1, "ERROR": 2}
    worst = max(per_rank, key=lambda r: order.get(r["verdict"], 3))
    row = dict(worst)
    for key in _TIMES:
        values = [r[key] for r in per_rank if r.get(key) is not None]
        row[key] = max(values) if values else None
    row["worst"] = max(r["worst"] for r in per_rank)
    row["clipped"] = all(r["clipped"] for r in per_rank)
    counts: dict[str, int] = {}
    for r in per_rank:
        for w in r["warnings"]:
            counts[w] = counts.get(w, 0) + 1
    row["warnings"] = counts
    row["ranks"] = len(per_rank)
    return row


def _read_rows(out_dir: str, n: int) -> list[list[dict[str, Any]]]:
    per_rank = []
    for rank in range(WORLD):
        path = os.path.join(out_dir, f"rank{rank}.jsonl")
        lines = open(path).read().splitlines() if os.path.exists(path) else []
        per_rank.append([json.loads(line) for line in lines[:n]])
    done = min(len(r) for r in per_rank)
    return [[per_rank[rank][i] for rank in range(WORLD)] for i in range(done)]


def run_group(runs: list[list], deadline: float, warm: bool = True) -> list[dict[str, Any]]:
    """The runs ([parallelism, variant, enable, steps, sabotage], ...) in one group of
    gloo processes: one merged row per run, an ERROR row for each run that did not finish."""
    from decompshard.check.loop import rank_main

    with tempfile.TemporaryDirectory(prefix="decompshard-loop-") as d:
        with open(os.path.join(d, "runs.json"), "w") as f:
            json.dump(runs, f)
        why = spawn_ranks(rank_main, (WORLD, _free_port(), os.path.join(d, "runs.json"), d, warm), WORLD, deadline)
        rows = [merge_ranks(r) for r in _read_rows(d, len(runs))]
    for parallelism, variant, enable, _, _ in runs[len(rows):]:
        rows.append({"parallelism": parallelism, "variant": variant, "path": "enable" if enable else "torch",
                     "verdict": "ERROR", "detail": f"worker: {why or 'no result'}", "stage": "worker", "step": None,
                     **dict.fromkeys(_TIMES), "worst": 0.0, "clipped": False, "warnings": {}, "ranks": 0})
    return rows


def run_matrix(parallelisms: Sequence[str], variants: Sequence[str], *, steps: int, with_torch: bool = True,
               repeat: int = 2, deadline: float = 900.0, on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Every (parallelism, variant) with enable() and, with `with_torch`, torch alone:
    one gloo group per parallelism, each run `repeat` times (`fold`), once under a
    compile mode."""
    from decompshard.check.loop import PARALLELISMS, VARIANTS, split_mode

    bases = [split_mode(p)[0] for p in parallelisms]
    for name, known in ((bases, PARALLELISMS), (variants, VARIANTS)):
        unknown = [n for n in name if n not in known]
        if unknown:
            raise ValueError(f"unknown {unknown}: expected some of {', '.join(known)}")
    paths = (True, False) if with_torch else (True,)
    rows = []
    for parallelism in parallelisms:
        if split_mode(parallelism)[1]:
            # under torch.compile each run compiles afresh, once per case and path, and each
            # path in processes of its own: a compile fills process-wide caches (sympy's
            # simplifications, dynamo's) that a second compile in the same process reuses
            # (tp+dynamic's first step, 2.15: 2.17x with enable() run first in the same processes,
            # 0.87x in processes of its own)
            group = [row for on in paths for row in run_group([[parallelism, v, on, steps, 0.0] for v in variants],
                                                               deadline)]
        else:
            # each run `repeat` times, the paths' order reversed each time (enable, torch, torch,
            # enable, ...): a shared machine's swings fall on both paths, the faster time kept
            runs = [[parallelism, v, on, steps, 0.0] for i in range(repeat) for v in variants
                    for on in (paths if i % 2 == 0 else paths[::-1])]
            group = fold(run_group(runs, deadline))
        for row in group:
            if on_row:
                on_row(row)
        rows += group
    return rows


def fold(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Repeated runs of one (parallelism, variant, path) as one row: the worst verdict
    (its detail), the fastest first and later steps, every warning."""
    order = {"OK": 0, "WRONG": 1, "ERROR": 2}
    out: dict[tuple[str, str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["parallelism"], row["variant"], row["path"])
        if key not in out:
            out[key] = dict(row, warnings=dict(row["warnings"]))
            continue
        kept = out[key]
        if order.get(row["verdict"], 3) > order.get(kept["verdict"], 3):
            kept.update({k: row[k] for k in ("verdict", "detail", "stage", "step")})
        for k in _TIMES:
            times = [t for t in (kept.get(k), row.get(k)) if t is not None]
            kept[k] = min(times) if times else None
        kept["worst"] = max(kept["worst"], row["worst"])
        kept["clipped"] = kept["clipped"] and row["clipped"]
        for w, n in row["warnings"].items():
            kept["warnings"][w] = max(kept["warnings"].get(w, 0), n)
    return list(out.values())


def _verdict(row: dict[str, Any] | None) -> str:
    return row["verdict"] if row else "-"


def _ratio(e: dict[str, Any] | None, t: dict[str, Any] | None, key: str) -> str:
    if not (e and t and e["verdict"] == "OK" and t["verdict"] == "OK" and e.get(key) and t.get(key)):
        return "-"
    return f"{e[key] / t[key]:.2f}x"


def _secs(row: dict[str, Any] | None, key: str) -> str:
    return f"{row[key]:.2f}" if row and row.get(key) is not None else "-"


def render(rows: Sequence[dict[str, Any]], tablefmt: str = "github") -> str:
    """The table (one line per parallelism and variant, both paths side by side), then
    the failures and decompshard's warnings with the runs that gave them."""
    from tabulate import tabulate

    by_case: dict[tuple[str, str], dict[str, Any]] = {}
    for row in rows:
        by_case.setdefault((row["parallelism"], row["variant"]), {})[row["path"]] = row
    table = []
    for (parallelism, variant), paths in by_case.items():
        e, t = paths.get("enable"), paths.get("torch")
        table.append([parallelism, variant, _verdict(e), _verdict(t), f"{e['worst']:.1e}" if e else "-",
                      _secs(e, "first_s"), _secs(t, "first_s"), _ratio(e, t, "first_s"), _ratio(e, t, "later_s"),
                      _ratio(e, t, "first_cpu_s"), _ratio(e, t, "later_cpu_s"), len(e["warnings"]) if e else "-"])
    headers = ["parallelism", "adamw/clip", "enable()", "torch alone", "worst rel. error, enable()",
               "first step s, enable()", "first step s, torch", "first ratio", "later ratio", "first ratio, CPU",
               "later ratio, CPU", "warnings, enable()"]
    out = [tabulate(table, headers=headers, tablefmt=tablefmt)]
    fails = [f"{r['parallelism']} / {r['variant']} / {r['path']}: {r['verdict']} ({r['stage']}): {r['detail']}"
             for r in rows if r["verdict"] != "OK"]
    if fails:
        out += ["", "Failures:", ""] + [f"- {f}" for f in fails]
    warned: dict[str, list[str]] = {}
    for r in rows:
        for w, n in r["warnings"].items():
            warned.setdefault(w.splitlines()[0][:200], []).append(f"{r['parallelism']} {r['variant']} ({n} ranks)")
    if warned:
        out += ["", "decompshard's warnings:", ""] + [f"- {w}: {', '.join(where)}" for w, where in warned.items()]
    return "\n".join(out + _seen_lines(rows))


def _seen_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per run, the ops enable() ran replicated and, under compile, each compiled
    graph's collectives (one rank's, the merged row's: every rank compiles the same program)."""
    lines = []
    for r in rows:
        if r.get("replicated"):
            lines.append(f"- {r['parallelism']} {r['variant']} {r['path']}: ran replicated: "
                         f"{', '.join(r['replicated'])}")
        if r.get("graphs"):
            lines.append(f"- {r['parallelism']} {r['variant']} {r['path']}: compiled graphs: "
                         f"{'; '.join(r['graphs'])}")
    return ["", "Ops run replicated and compiled graphs' collectives:", ""] + lines if lines else []


def against_us(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with enable() that are WRONG or ERROR."""
    return [r for r in rows if r["path"] == "enable" and r["verdict"] != "OK"]
