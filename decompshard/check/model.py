"""`decompshard check --model`: one training step of a user's model, sharded as given,
against one device; names the first aten op whose output or gradient diverges.

Both runs (float64, same weights, same inputs, same random cotangent) record every aten
call at the level DTensor dispatches (a TorchDispatchMode above DTensor): the op, and
its tensor outputs. The DTensor run uses real DTensors on a simulated mesh with
`enable()`. The two call sequences are walked side by side; the first op whose output
differs on any rank (or whose call differs: the programs took different paths) is the
answer. This is what a user runs before spending GPU hours.

Placements: per model input, ';'-separated, one per mesh dim (as everywhere in check),
plus `name=...` entries for parameters (default Replicate), e.g. "S(0),R;lin.weight=R,S(0)".
"""

from __future__ import annotations

import argparse
import copy
import math
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .._rank_sim import close


@dataclass
class Divergence:
    index: int  # position in the call sequence
    op: str
    phase: str  # forward | backward
    detail: str


@dataclass
class ModelCheck:
    calls: int
    divergence: Divergence | None
    max_output_err: float = 0.0
    notes: list[str] = field(default_factory=list)


class _Record(TorchDispatchMode):
    """(op, phase, tensor outputs) of each outermost aten call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, list[torch.Tensor]]] = []
        self.phase = "forward"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten" and func is not torch.ops.aten.detach.default:
            self.calls.append((str(func), self.phase, [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]))
        return out


def _split_placements(text: str | None, n_inputs: int, ndim: int, params: dict[str, torch.Tensor],
                      inputs: Sequence[torch.Tensor]) -> tuple[list, dict]:
    from ..verify_dtensor import parse_placements

    rep = "R" if ndim == 1 else ",".join(["R"] * ndim)
    entries = [e.strip() for e in (text or "").split(";") if e.strip()]
    named = dict(e.split("=", 1) for e in entries if "=" in e)
    plain = [e for e in entries if "=" not in e] or [rep] * n_inputs
    unknown = set(named) - set(params)
    if unknown:
        raise ValueError(f"--placements names unknown parameters {sorted(unknown)}; the model has {sorted(params)}")
    ins = parse_placements(";".join(plain), [tuple(x.shape) for x in inputs], ndim)
    ps = {n: parse_placements(t, [tuple(params[n].shape)], ndim)[0] for n, t in named.items()}
    return list(ins), ps


def run_model_check(module: torch.nn.Module, inputs: Sequence[torch.Tensor], mesh_shape: Sequence[int],
                    placements: str | None, seed: int = 0) -> ModelCheck:
    """The step on one device and on DTensors; the first divergence, if any."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import DTensor, distribute_tensor

    from ..verify_dtensor import _simulator_chunks, decompshard_on, device_mesh, make_dtensor, rank_locals

    ref_model = copy.deepcopy(module).to(torch.float64)
    inputs = [x.detach().to(torch.float64) if x.dtype.is_floating_point else x for x in inputs]
    params = dict(ref_model.named_parameters())
    in_pl, param_pl = _split_placements(placements, len(inputs), len(mesh_shape), params, inputs)

    # one device
    ref_in = [x.clone().requires_grad_(x.dtype.is_floating_point) for x in inputs]
    rec = _Record()
    with rec:
        out = ref_model(*ref_in)
    outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
    g = torch.Generator().manual_seed(seed)
    cots = [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in outs]
    rec.phase = "backward"
    with rec:
        torch.autograd.backward(outs, cots)
    reference = rec.calls

    # DTensor
    mesh = device_mesh(mesh_shape)
    n = math.prod(mesh_shape)
    dmodel = copy.deepcopy(module).to(torch.float64)
    drec = _Record()
    with decompshard_on(True), warnings.catch_warnings(), _simulator_chunks(), LocalTensorMode(frozenset(range(n))):
        warnings.simplefilter("ignore")
        for name, p in list(dmodel.named_parameters()):
            pl = param_pl.get(name)
            d = make_dtensor(p.detach(), mesh, pl, seed, zlib.crc32(name.encode()) % 997) if pl else \
                distribute_tensor(p.detach(), mesh, [_replicate()] * mesh.ndim)
            _set_param(dmodel, name, torch.nn.Parameter(d))
        din = [make_dtensor(x, mesh, pl, seed, i).detach().requires_grad_(x.dtype.is_floating_point)
               for i, (x, pl) in enumerate(zip(inputs, in_pl))]
        try:
            with drec:
                dout = dmodel(*din)
            douts = [o for o in tree_leaves(dout) if isinstance(o, DTensor) and o.requires_grad]
            dcots = [distribute_tensor(c, mesh, [_replicate()] * mesh.ndim) for c in cots]
            drec.phase = "backward"
            with drec:
                torch.autograd.backward(douts, dcots)
        except Exception as e:
            # a wrong value often surfaces as an error a few ops later: name the first
            # divergence among the calls that did run, if there is one
            earlier = _first_divergence(reference, drec.calls, mesh, rank_locals, prefix=True)
            if earlier.divergence is not None:
                return earlier
            where = drec.calls[-1][0] if drec.calls else "the first op"
            line = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            return ModelCheck(len(drec.calls), Divergence(len(drec.calls), where, drec.phase,
                                                          f"raised after {where}: {type(e).__name__}: {line}"))
        return _first_divergence(reference, drec.calls, mesh, rank_locals)


def _replicate():
    from .._compat import TorchReplicate

    return TorchReplicate()


def _set_param(model: torch.nn.Module, name: str, value: torch.nn.Parameter) -> None:
    *path, leaf = name.split(".")
    mod = model
    for p in path:
        mod = getattr(mod, p)
    setattr(mod, leaf, value)


# Ops that only move or re-view values. DTensor may lay a value out differently from one
# device (a redistributed input is contiguous), so `reshape` copies on one side and views
# on the other; such calls are skipped when the two call sequences are walked together.
LAYOUT_OPS = frozenset(f"aten.{n}" for n in (
    "clone.default", "view.default", "_unsafe_view.default", "alias.default", "detach.default",
    "_reshape_alias.default", "contiguous.default", "_to_copy.default"))


def _first_divergence(reference, calls, mesh, rank_locals, prefix: bool = False) -> ModelCheck:
    """The first call whose op or outputs differ; `prefix`: `calls` stopped early (an
    exception), so a shorter sequence is not itself a divergence."""
    from torch.distributed.tensor import DTensor

    reference = [c for c in reference if c[0] not in LAYOUT_OPS]
    calls = [c for c in calls if c[0] not in LAYOUT_OPS]
    worst = 0.0
    for i, ((rop, rphase, routs), (dop, dphase, douts)) in enumerate(zip(reference, calls)):
        if rop != dop:
            return ModelCheck(len(calls), Divergence(i, dop, dphase, f"the call sequence differs: one device ran {rop}"), worst)
        for j, (r, d) in enumerate(zip(routs, douts)):
            if not isinstance(d, DTensor):
                continue
            placements = tuple(d.placements)
            for rank, full in rank_locals(d.full_tensor(), mesh).items():
                if tuple(full.shape) != tuple(r.shape) or not close(full, r.detach(), []):
                    err = float((full - r).abs().max()) if full.shape == r.shape else math.inf
                    return ModelCheck(len(calls), Divergence(
                        i, dop, dphase, f"output {j} ({placements}) differs on rank {rank} (max error {err:.3g})"), worst)
    if len(reference) != len(calls) and not prefix:
        return ModelCheck(len(calls), Divergence(min(len(reference), len(calls)), "-", "-",
                                                 f"{len(calls)} calls, one device made {len(reference)}"), worst)
    return ModelCheck(len(calls), None, worst)


def check_model(spec: str, input_shapes: str | None, meshes: list, placements: str | None,
                args: argparse.Namespace) -> int:
    """The CLI entry: build, check on the one mesh given, print the verdict."""
    from ..cli import UsageError
    from ..coverage.model_audit import build_model
    from ..verify_dtensor import simulated_world

    if len(meshes) != 1:
        raise UsageError("--model takes one --mesh, e.g. --mesh 2x2")
    module, inputs = build_model(spec, input_shapes)
    with simulated_world(math.prod(meshes[0])):
        res = run_model_check(module, inputs, meshes[0], placements, args.seed)
    mesh = "x".join(map(str, meshes[0]))
    if res.divergence is None:
        print(f"{spec} on mesh {mesh}: {res.calls} aten calls, forward and backward match one device")
        return 0
    d = res.divergence
    print(f"{spec} on mesh {mesh}: first divergence at call #{d.index} ({d.phase}) {d.op}: {d.detail}")
    return 3
