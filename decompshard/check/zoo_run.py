"""Run the zoo: each (model, sharding, path) case in a worker process with a deadline
(`_workers.run_jobs`), so one case that hangs or crashes leaves the table standing.
Shared by `decompshard check --model NAME|all --sharding ...` and `bench/zoo.py`.

Times: the first step runs with decompshard's and DTensor's sharding caches cleared
(cold), in a worker that has already imported everything and run one tiny DTensor op on
both paths (so neither path pays the process's one-time imports); the warm step is the
next step at the same shapes.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable, Sequence

__all__ = ["PATHS", "against_us", "expand_names", "failures", "render", "replicated_lines", "run_zoo", "versus_torch",
           "zoo_case"]

PATHS = ("enable", "torch")  # decompshard.enable(), torch alone
_WARMED = False


def expand_names(text: str) -> list[str]:
    """'all' or a comma-separated list of zoo names, transformers class names or
    MODULE:CALLABLE specs."""
    from decompshard.check.zoo import ZOO

    if text.strip() == "all":
        return list(ZOO)
    return [t.strip() for t in text.split(",") if t.strip()]


def zoo_case(name: str, sharding: str, enable: bool, seed: int = 0) -> dict[str, Any]:
    """One case, as a plain dict (it crosses a process boundary)."""
    from decompshard.verify.dtensor_case import simulated_world
    from decompshard.check.model import SHARDINGS, run_training_step
    from decompshard.check.zoo import build, get_entry
    from decompshard.check.expert_bytes import expert_bytes

    entry = get_entry(name)
    sh = SHARDINGS[sharding]
    _warm_process()
    built = build(entry, sh.batch, seed)
    expert = expert_bytes(built, sharding)  # before the step: one plain forward, timings untouched
    with simulated_world(4):
        out = asdict(run_training_step(built, sharding, enable))
    out["expert_bytes"], out["expert_note"] = expert.bytes, expert.note
    return out


def _warm_process() -> None:
    """Imports and first-use costs of DTensor and decompshard, paid once per process
    before any timed step (one small matmul per path on a 2-rank mesh)."""
    global _WARMED
    if _WARMED:
        return
    import torch
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from decompshard.verify.dtensor_case import device_mesh, simulated_world, simulation
    from decompshard.runtime.enable import switched

    with simulated_world(4):
        mesh = device_mesh((2,))
        for on in (True, False):
            with switched(on), simulation(2, mend_chunks=False):
                a = distribute_tensor(torch.randn(4, 4, dtype=torch.float64, requires_grad=True), mesh, [Shard(0)])
                b = distribute_tensor(torch.randn(4, 4, dtype=torch.float64), mesh, [Replicate()])
                (a @ b).sum().backward()
    _WARMED = True


def run_zoo(names: Sequence[str], shardings: Sequence[str], *, jobs: int = 1, timeout: float = 300.0,
            seed: int = 0, with_torch: bool = True,
            on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """One row per (model, sharding): {"model", "sharding", "enable": StepRun dict,
    "torch": StepRun dict or None}. A case that raises, crashes or overruns `timeout`
    seconds is an ERROR row naming why."""
    from decompshard.workers import run_jobs
    from decompshard.check.model import SHARDINGS

    for s in shardings:
        if s not in SHARDINGS:
            raise ValueError(f"unknown sharding {s!r}: expected some of {', '.join(SHARDINGS)}")
    paths = PATHS if with_torch else PATHS[:1]
    rows = {(n, s): {"model": n, "sharding": s, "enable": None, "torch": None} for n in names for s in shardings}
    job_list = [(f"{n}|{s}|{p}", zoo_case, (n, s, p == "enable", seed))
                for n in names for s in shardings for p in paths]

    def record(key: str, value: dict[str, Any]) -> None:
        n, s, p = key.split("|")
        row = rows[(n, s)]
        row[p] = value
        if on_row and row["enable"] is not None and (row["torch"] is not None or not with_torch):
            on_row(row)

    def failed(key: str, reason: str, seconds: float) -> None:
        record(key, {"verdict": "ERROR", "detail": f"worker: {reason}", "op": "", "stage": "worker",
                     "collectives": None, "bytes": None, "first_s": None, "warm_s": None, "fallbacks": []})

    run_jobs(job_list, jobs, timeout, record, failed)
    return list(rows.values())


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _ratios(e: dict[str, Any] | None, t: dict[str, Any] | None) -> list[str]:
    """First and warm step ratios, enable() / torch alone, where both match one device
    (a torch alone that skipped a collective and got the wrong numbers, ResNet tp's, is
    no time to compare with)."""
    if not (e and t and e["verdict"] == "OK" and t["verdict"] == "OK"):
        return ["-", "-"]
    return [_ratio(e.get("first_s"), t.get("first_s")), _ratio(e.get("warm_s"), t.get("warm_s"))]


def _verdict(r: dict[str, Any] | None) -> str:
    if r is None:
        return "-"
    return r["verdict"]


def _comm(r: dict[str, Any] | None) -> str:
    if not r or r.get("collectives") is None:
        return "-"
    return f"{r['collectives']} / {_kib(r['bytes'])}"


def _versus_expert(e: dict[str, Any] | None) -> list[str]:
    """The expert's plan's bytes (check/expert_bytes.py) and enable()'s bytes over them."""
    want = e.get("expert_bytes") if e else None
    if want is None:
        return ["-", "-"]
    note = f" ({e['expert_note']})" if e.get("expert_note") else ""
    got = e.get("bytes") if e["verdict"] == "OK" else None
    return [_kib(want) + note, f"{got / want:.2f}x" if got is not None and want else "-"]


def _kib(n: int) -> str:
    return f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} B"


def _replicated(r: dict[str, Any] | None) -> str:
    """How many distinct ops the run ran replicated instead of derived (runtime/fallbacks.py)."""
    if not r or r["verdict"] == "n/a":
        return "-"
    return str(len({f["op"] for f in r.get("fallbacks") or []}))


def replicated_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per reason, the ops enable() ran replicated instead of derived, and in which cases."""
    from decompshard.runtime.fallbacks import summarize

    cases: dict[tuple[str, str], list[str]] = {}
    for row in rows:
        for f in (row.get("enable") or {}).get("fallbacks") or []:
            cases.setdefault((f["kind"], f["op"]), []).append(f"{row['model']} {row['sharding']}")
    by_kind = summarize([{"kind": k, "op": op} for (k, op), where in cases.items() for _ in where])
    lines = []
    for kind, ops in sorted(by_kind.items()):
        lines.append(f"{kind}: " + "; ".join(f"{op} ({', '.join(cases[(kind, op)])})" for op in sorted(ops)))
    return lines


def comm_lines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per case with enable(), what moved the most bytes: the DTensor op whose dispatch
    issued each collective (its inputs' placements and shapes), how often, how much."""
    lines = []
    for row in rows:
        top = (row.get("enable") or {}).get("comm_top") or []
        if top:
            lines.append(f"{row['model']} {row['sharding']}, the most bytes first:")
            lines += [f"  {_kib(t['bytes']):>8} {t['count']:3d}x {t['collective']:24s} {t['op']}" for t in top]
    return lines


def _secs(r: dict[str, Any] | None, key: str) -> str:
    v = r.get(key) if r else None
    return f"{v:.2f}" if v is not None else "-"


def render(rows: Sequence[dict[str, Any]], tablefmt: str = "github") -> str:
    """The zoo table (markdown by default) and, under it, the ops enable() ran replicated
    and every case that did not give one-device numbers, with its op and error."""
    from tabulate import tabulate

    table = []
    for row in rows:
        e, t = row["enable"], row["torch"]
        table.append([row["model"], row["sharding"], _verdict(e), _verdict(t), _replicated(e), _comm(e), _comm(t),
                      *_versus_expert(e), _secs(e, "first_s"), _secs(t, "first_s"),
                      *_ratios(e, t)])
    headers = ["model", "sharding", "enable()", "torch alone", "ops run replicated, enable()",
               "collectives / bytes, enable()", "collectives / bytes, torch", "expert's bytes", "enable() / expert",
               "first step s, enable()", "first step s, torch", "first ratio", "warm ratio"]
    out = [tabulate(table, headers=headers, tablefmt=tablefmt)]
    both = [r for r in rows if r.get("torch") and r["enable"] and r["enable"]["verdict"] == "OK"
            and r["torch"]["verdict"] == "OK"]
    if both:
        out += ["", f"Both paths run ({len(both)} cases): enable() vs torch alone:", ""]
        out += [f"- {line}" for line in versus_torch(both)] or ["- the same or fewer collectives and bytes, "
                                                                 "first step within 1.5x, everywhere"]
    replicated = replicated_lines(rows)
    if replicated:
        out += ["", "Ops enable() ran replicated instead of derived (right numbers, no derived strategy):", ""]
        out += [f"- {line}" for line in replicated]
    fails = failures(rows)
    if fails:
        out += ["", "Failures:", ""]
        out += [f"- {f}" for f in fails]
    return "\n".join(out)


def versus_torch(rows: Sequence[dict[str, Any]], slow: float = 1.5) -> list[str]:
    """Where both paths give one-device numbers, what the issue asks of enable(): one line
    per case where it makes more collectives or bytes than torch alone (never expected:
    enable() only adds strategies), or whose first step takes more than `slow` times
    torch alone's."""
    lines = []
    for row in rows:
        e, t = row.get("enable"), row.get("torch")
        if not (e and t and e["verdict"] == "OK" and t["verdict"] == "OK"):
            continue
        where = f"{row['model']} / {row['sharding']}"
        if None not in (e["collectives"], t["collectives"]) and \
                (e["collectives"] > t["collectives"] or e["bytes"] > t["bytes"]):
            lines.append(f"{where}: MORE COMMUNICATION with enable(): {_comm(e)} vs torch alone's {_comm(t)}")
        if e.get("first_s") and t.get("first_s") and e["first_s"] > slow * t["first_s"]:
            lines.append(f"{where}: first step {_ratio(e['first_s'], t['first_s'])} torch alone's "
                         f"({e['first_s']:.2f} s vs {t['first_s']:.2f} s)")
    return lines


def failures(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One line per WRONG or ERROR case (either path): model, sharding, path, op, error."""
    lines = []
    for row in rows:
        for path in PATHS:
            r = row.get(path)
            if r and r["verdict"] in ("WRONG", "ERROR"):
                op = f" at {r['op']}" if r.get("op") else ""
                stage = f" ({r['stage']})" if r.get("stage") else ""
                lines.append(f"{row['model']} / {row['sharding']} / {path}: {r['verdict']}{stage}{op}: {r['detail']}")
    return lines


def against_us(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows where the enable() path is WRONG or ERROR (an internal error of decompshard's
    that enable() caught included: `run_training_step` makes it an ERROR naming the op)."""
    return [r for r in rows if r["enable"] and r["enable"]["verdict"] in ("WRONG", "ERROR")]
