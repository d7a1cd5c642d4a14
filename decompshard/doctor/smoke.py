"""The doctor's smoke run: what a user relies on, run for real, about a minute in all.

Each step runs in a freshly forked process (`isolate.isolated`) under its own deadline, so
a hang, a crash or a changed DTensor (enable() patches it) stays there: the caller's
process is never patched, and a step that goes wrong is one FAILED line.

    derive    derive_rules of a decomposition-only op (aten.addmv: derived, not native,
              on torch 2.13, 2.14 and 2.15)
    op        that op on DTensors with enable(), 2 simulated ranks, forward and backward
              against one device (verify/dtensor_case.run_case)
    dp, tp    one training step of a model (the zoo's llama; a minimal torch.nn MLP when
              transformers is missing) on the zoo's data-parallel and tensor-parallel
              shardings with enable(), loss and every gradient against one device
              (check/model.run_training_step)
"""

from __future__ import annotations

import math
import time
import warnings
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from decompshard.check.ecosystem import install_hint, missing_package
from decompshard.check.zoo import Built, ZooEntry, build, get_entry
from decompshard.doctor.findings import FAILED, OK, Finding
from decompshard.errors import one_line

SMOKE = "smoke run"
OP = "aten.addmv.default"
OP_MESH = (2,)
# bias replicated, the matrix split by columns and the vector by rows: the contraction
# is split across ranks, so enable() must choose how to bring the bias and the partial
# sums together
OP_PLACEMENTS = "R;S(1);S(0)"
DEFAULT_MODEL = "llama"


def _addmv_inputs() -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, generator=g), torch.randn(4, 12, generator=g), torch.randn(12, generator=g)


def derive_step() -> str:
    from decompshard.op_names import resolve_op
    from decompshard.solve.derive import derive_rules

    rules = derive_rules(resolve_op(OP), *_addmv_inputs()).as_strings()
    if not rules:
        raise RuntimeError(f"{OP}: no rule derived (only all-Replicate)")
    example = next((r for r in rules if "S(" in r), rules[0])
    return f"{len(rules)} single-dim rules, e.g. '{example}'"


def op_step() -> str:
    from decompshard.runtime.enable import switched
    from decompshard.op_names import resolve_op
    from decompshard.verify.dtensor_case import parse_placements, run_case, simulated_world

    args = _addmv_inputs()
    placements = parse_placements(OP_PLACEMENTS, [tuple(a.shape) for a in args], len(OP_MESH))
    with simulated_world(math.prod(OP_MESH)):
        outcome = run_case(resolve_op(OP), args, {}, OP_MESH, placements, runtime=switched(True))
    if outcome.status != "ok":
        raise RuntimeError(f"{outcome.status} ({outcome.stage}): {outcome.detail}")
    return f"placements {OP_PLACEMENTS} on {OP_MESH[0]} simulated ranks: forward and backward match one device"


def training_step(entry: ZooEntry, sharding: str) -> str:
    from decompshard.check.model import SHARDINGS, run_training_step
    from decompshard.verify.dtensor_case import simulated_world

    sh = SHARDINGS[sharding]
    built = build(entry, sh.batch)
    with simulated_world(math.prod(sh.mesh)):
        run = run_training_step(built, sharding, True, measure=False)
    if run.verdict != "OK":
        where = f" at {run.op}" if run.op else ""
        raise RuntimeError(f"{run.verdict}{where}: {run.detail}")
    return (f"{entry.name}, batch {sh.batch} on {math.prod(sh.mesh)} simulated ranks: the loss and every "
            "gradient match one device")


# ------------------------------------------------------------------ the model


class _MLP(nn.Module):
    """A Megatron MLP block (column- then row-parallel Linear), a layer norm, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.norm, self.head = nn.LayerNorm(16), nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x + self.fc2(F.gelu(self.fc1(x)))))


def _mlp(batch: int, seed: int) -> Built:
    g = torch.Generator().manual_seed(seed + 1)
    inputs = {"x": torch.randn(batch, 16, generator=g), "target": torch.randint(0, 10, (batch,), generator=g)}
    return Built(_MLP(), inputs, lambda m, i: F.cross_entropy(m(i["x"]), i["target"]),
                 {"fc1": "colwise", "fc2": "rowwise"})


MLP = ZooEntry("mlp", "torch", _mlp, "a minimal torch.nn MLP block")


def pick_model(name: str) -> tuple[ZooEntry, Finding]:
    """The model the training steps use, and a line saying which and why. The zoo's
    model is built once here, so its library is imported once, before the forks."""
    if name == MLP.name:
        return MLP, Finding(SMOKE, "model", OK, f"{MLP.name}: {MLP.note} (asked for)")
    entry = get_entry(name)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build(entry, 2)
    except ImportError as e:  # the package missing, named: transformers' own, or one it imports
        package = missing_package(e)
        why = (f"{package} is not installed ({install_hint(package)})" if package and isinstance(e, ModuleNotFoundError)
               else f"{entry.family} does not import ({one_line(e, 120)})")
        return MLP, Finding(SMOKE, "model", OK, f"{why}: the steps use {MLP.note} instead of the zoo's {entry.name}")
    except Exception as e:
        return MLP, Finding(SMOKE, "model", FAILED, f"the zoo's {entry.name} does not build here "
                            f"({one_line(e, 200)}); the steps use {MLP.note}")
    return entry, Finding(SMOKE, "model", OK, f"the zoo's {entry.name} ({entry.note}, from {entry.family})")


# ------------------------------------------------------------------ running the steps


def steps(entry: ZooEntry) -> list[tuple[str, Callable[[], str]]]:
    return [
        (f"derive_rules({OP})", derive_step),
        (f"DTensor {OP} with enable()", op_step),
        ("data-parallel training step (dp)", lambda: training_step(entry, "dp")),
        ("tensor-parallel training step (tp)", lambda: training_step(entry, "tp")),
    ]


def run_steps(entry: ZooEntry, timeout: float) -> Iterator[Finding]:
    """Each step in its own forked process with `timeout` seconds; one finding each."""
    from decompshard.isolate import isolated

    for name, step in steps(entry):
        t0 = time.perf_counter()
        status, value = isolated(_quietly(step), timeout, describe=lambda e: one_line(e, 300))
        took = round(time.perf_counter() - t0, 1)
        if status == "ok":
            yield Finding(SMOKE, name, OK, value, took)
        elif status == "crash":
            yield Finding(SMOKE, name, FAILED, f"the step's process died ({value})", took)
        else:  # error | timeout | unresolved: already one line
            yield Finding(SMOKE, name, FAILED, str(value), took)


def _quietly(step: Callable[[], str]) -> Callable[[], str]:
    def run() -> str:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return step()
    return run
