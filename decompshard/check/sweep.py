"""The runtime sweep: derived ops x samples x meshes x random placements, both paths.

A case is one op sample on one mesh with one seeded random placement per tensor input
and mesh dim. It runs twice through real DTensor dispatch on a simulated mesh: with
decompshard enabled, and with torch's built-in fallback; each gets ok / WRONG / error
(verify/dtensor_case.run_case). Cases are planned from names and seeds alone (crc32, never
Python's per-process hash), so a reproducer line rebuilds exactly the same case.

What counts against decompshard: any WRONG, any error where torch's fallback runs the
same case or was not run (--no-torch: nothing to excuse it), and any internal error of
decompshard's that `enable()` caught and ran the op replicated for (right numbers, but a
bug: runtime/fallbacks.py records it). An error where torch errors too is listed, not
counted. Every other op that ran replicated (unsupported, symbolic shapes, no
decomposition, data-dependent) is recorded per case and reported with counts.
"""

from __future__ import annotations

import random
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence

import torch

from decompshard._compat import tree_leaves
from decompshard._compat import TorchReplicate
from decompshard.verify.dtensor_case import MESHES, Outcome, format_placements, parse_placements, random_placements, run_case
from decompshard.runtime.enable import switched
from decompshard.runtime.fallbacks import INTERNAL_ERROR, recording_fallbacks, summarize as summarize_fallbacks

DEFAULT_MESHES = ("1d", "2d", "3d")


@dataclass
class CaseRecord:
    """One case and both verdicts (JSON-ready through `asdict`)."""

    op: str
    sample: int  # index among the op's best samples (coverage.sweep.pick_samples order)
    shapes: str
    mesh: str  # "2x3"
    placements: str  # the placement grammar (placements.py)
    seed: int
    ours: dict = field(default_factory=dict)  # Outcome as a dict
    torch: dict | None = None
    fallbacks: list = field(default_factory=list)  # ops the enable() run ran replicated (fallbacks.Fallback dicts)



def mesh_text(shape: Sequence[int]) -> str:
    return "x".join(str(s) for s in shape)


def _seed(*parts: Any) -> int:
    return zlib.crc32(repr(parts).encode())


def plan_cases(op: str, sample_index: int, tensors: Sequence[torch.Tensor], mesh: Sequence[int],
               combos: int, seed: int) -> list[tuple[str, int]]:
    """`combos` distinct (placement text, seed) pairs for one sample on one mesh. Only
    all-Replicate when nothing else is possible (0-d integer inputs): the interesting
    cases shard something."""
    shapes = [tuple(t.shape) for t in tensors]
    floating = [t.dtype.is_floating_point for t in tensors]
    rng = random.Random(_seed(op, sample_index, mesh_text(mesh), seed))
    out: list[tuple[str, int]] = []
    seen: set[str] = set()
    for _ in range(combos * 20):
        if len(out) >= combos:
            break
        text = format_placements(random_placements(shapes, floating, mesh, rng))
        if text in seen or (set(text.replace(";", ",").split(",")) == {"R"} and tensors):
            continue
        seen.add(text)
        out.append((text, seed + len(out)))
    if not out:
        out.append((format_placements([(TorchReplicate(),) * len(mesh)] * len(tensors)), seed))
    return out


Sample = tuple[tuple, dict]  # (args, kwargs) of one aten call: picklable, unlike OpOverloads


def _tensors(sample: Sample) -> list[torch.Tensor]:
    return [x for x in tree_leaves(sample) if isinstance(x, torch.Tensor)]


def run_one(op: Any, sample: Sample, index: int, mesh: Sequence[int], text: str, seed: int, *,
            backward: bool = True, with_torch: bool = True) -> CaseRecord:
    """One planned case on both paths. Needs a simulated world (verify/dtensor_case)."""
    args, kwargs = sample
    tensors = _tensors(sample)
    placements = parse_placements(text, [tuple(t.shape) for t in tensors], len(mesh))
    rec = CaseRecord(str(op), index, ", ".join(str(list(t.shape)) for t in tensors), mesh_text(mesh), text, seed)
    with recording_fallbacks() as log:
        rec.ours = asdict(run_case(op, args, kwargs, mesh, placements, seed=seed, backward=backward,
                                   runtime=switched(True)))
    rec.fallbacks = log.as_json()
    if with_torch:
        rec.torch = asdict(run_case(op, args, kwargs, mesh, placements, seed=seed, backward=backward,
                                    runtime=switched(False)))
    return rec


def check_op(name: str, samples: Sequence[Sample], meshes: Sequence[Sequence[int]], combos: int, seed: int,
             backward: bool = True, with_torch: bool = True) -> list[dict]:
    """Every planned case of one op (the unit of work a worker process runs)."""
    import math

    from decompshard.op_names import resolve_op
    from decompshard.verify.dtensor_case import simulated_world

    import logging

    # torch warns on every multi-dim redistribution ("2 sequential all_gather ..."):
    # thousands of lines that say nothing about correctness
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    op = resolve_op(name)
    records = []
    world = max(math.prod(m) for m in meshes)
    with simulated_world(world):
        for index, sample in enumerate(samples):
            for mesh in meshes:
                for text, case_seed in plan_cases(name, index, _tensors(sample), mesh, combos, seed):
                    t0 = time.perf_counter()
                    rec = run_one(op, sample, index, mesh, text, case_seed, backward=backward, with_torch=with_torch)
                    d = asdict(rec)
                    d["seconds"] = round(time.perf_counter() - t0, 3)
                    records.append(d)
    return records


def check_ops(samples_by_op: Sequence[tuple[Any, Sequence[Any]]], *, meshes: Sequence[Sequence[int]] | None = None,
              combos: int = 6, seed: int = 0, backward: bool = True, with_torch: bool = True, jobs: int = 2,
              timeout: float = 300.0, on_op: Callable[[str], None] | None = None) -> list[dict]:
    """The sweep: `check_op` for each (op, samples) in worker processes (`jobs` of them; 0
    runs in this process). An op whose worker crashes or overruns `timeout` gets one
    record with status "error" and the reason."""
    from decompshard.workers import run_jobs

    meshes = [tuple(m) for m in (meshes or [MESHES[k] for k in DEFAULT_MESHES])]
    records: list[dict] = []

    def done(name: str, recs: list[dict]) -> None:
        records.extend(recs)
        if on_op:
            on_op(name)

    def failed(name: str, reason: str, seconds: float) -> None:
        records.append({"op": name, "sample": -1, "shapes": "", "mesh": "", "placements": "", "seed": seed,
                        "ours": asdict(Outcome("error", "worker", reason)), "torch": None,
                        "seconds": round(seconds, 3)})
        if on_op:
            on_op(name)

    job_list = [(str(op), check_op, (str(op), [(s.args, s.kwargs) for s in samples], meshes, combos, seed,
                                     backward, with_torch))
                for op, samples in samples_by_op]
    run_jobs(job_list, jobs, timeout, done, failed)
    records.sort(key=lambda r: (r["op"], r["sample"], r["mesh"], r["placements"]))
    return records


def internal_errors(rec: dict) -> list[dict]:
    """The case's internal errors of decompshard (caught, the op run replicated)."""
    return [f for f in rec.get("fallbacks") or [] if f["kind"] == INTERNAL_ERROR]


def counts_against_us(rec: dict) -> bool:
    """WRONG; an error where torch's fallback runs the case, or was not run; an internal
    error of decompshard's, whatever the numbers."""
    ours, theirs = rec["ours"], rec.get("torch")
    excused = theirs is not None and theirs.get("status") != "ok"
    return ours["status"] == "WRONG" or (ours["status"] == "error" and not excused) or bool(internal_errors(rec))


def summarize(records: Sequence[dict]) -> dict[str, Any]:
    """Counts per path and mesh, and the failures that count against decompshard."""
    out: dict[str, Any] = {"cases": len(records), "ops": len({r["op"] for r in records}), "by_mesh": {}}
    for side in ("ours", "torch"):
        c: dict[str, int] = {}
        for r in records:
            o = r.get(side)
            if o:
                c[o["status"]] = c.get(o["status"], 0) + 1
        out[side] = c
    for r in records:
        m = out["by_mesh"].setdefault(r["mesh"] or "-", {"cases": 0, "ok": 0, "WRONG": 0, "error": 0, "n/a": 0,
                                                         "torch_ok": 0, "torch_WRONG": 0, "torch_error": 0})
        m["cases"] += 1
        m[r["ours"]["status"]] = m.get(r["ours"]["status"], 0) + 1
        if r.get("torch"):
            key = "torch_" + r["torch"]["status"]
            m[key] = m.get(key, 0) + 1
    out["failures"] = [r for r in records if counts_against_us(r)]
    out["fallbacks"] = summarize_fallbacks([f for r in records for f in r.get("fallbacks") or []])
    out["errors_where_torch_fails_too"] = [
        r for r in records if r["ours"]["status"] == "error" and not counts_against_us(r)]
    return out


def reproducer(rec: dict) -> str:
    """The copy-paste command that reruns exactly this case."""
    given = f" {rec['given']}" if rec.get("given") else ""  # a custom op's --import/--shapes/...
    return (f"decompshard check --ops {rec['op']}{given} --sample {rec['sample']} --mesh {rec['mesh']} "
            f"--placements '{rec['placements']}' --seed {rec['seed']}")
