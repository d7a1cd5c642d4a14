"""`decompshard check --model`: one training step of a user's model, sharded as given,
against one device; names the first aten op (or custom op) whose output or gradient diverges.

Both runs (float64, same weights, same inputs, same random cotangent) record every aten
call at the level DTensor dispatches (a TorchDispatchMode above DTensor): the op, and
its tensor outputs. The DTensor run uses real DTensors on a simulated mesh with
`enable()`. The two call sequences are walked side by side; the first op whose output
differs on any rank (or whose call differs: the programs took different paths) is the
answer. This is what a user runs before spending GPU hours.

Placements: per model input, ';'-separated, one per mesh dim (as everywhere in check),
plus `name=...` entries for parameters (default Replicate), e.g. "S(0),R;lin.weight=R,S(0)".

`run_training_step` is the model zoo's runner (`decompshard check --model NAME --sharding
...`, `bench/zoo.py`): one training step (forward, the model's own loss, backward,
gradients redistributed to the parameters' placements) sharded the usual ways (SHARDINGS),
with `enable()` or torch alone, judged on the loss and every parameter gradient and
buffer on every rank, with collectives, bytes and the cold and warm step times.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from decompshard._compat import tree_leaves

from decompshard.dispatch_modes.comm_bytes import CommBytes
from decompshard.dispatch_modes.record import RecordCallOutputs
from decompshard.errors import one_line
from decompshard.runtime.fallbacks import INTERNAL_ERROR, recording_fallbacks
from decompshard.verify.judge import judge


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
    fallbacks: list[dict] = field(default_factory=list)  # ops run replicated under enable() (fallbacks.Fallback)


def _split_placements(text: str | None, n_inputs: int, ndim: int, params: dict[str, torch.Tensor],
                      inputs: Sequence[torch.Tensor]) -> tuple[list, dict]:
    from decompshard.verify.dtensor_case import parse_placements

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
    from decompshard.verify.dtensor_case import device_mesh, simulation
    from decompshard.runtime.enable import switched

    ref_model = copy.deepcopy(module).to(torch.float64)
    inputs = [x.detach().to(torch.float64) if x.dtype.is_floating_point else x for x in inputs]
    params = dict(ref_model.named_parameters())
    in_pl, param_pl = _split_placements(placements, len(inputs), len(mesh_shape), params, inputs)

    # one device
    reference, cots = _one_device(ref_model, inputs, seed)

    # DTensor
    mesh = device_mesh(mesh_shape)
    n = math.prod(mesh_shape)
    dmodel = copy.deepcopy(module).to(torch.float64)
    with recording_fallbacks() as log, switched(True), warnings.catch_warnings(), simulation(n):
        warnings.simplefilter("ignore")
        res = _dtensor_calls(dmodel, param_pl, in_pl, inputs, cots, mesh, reference, seed)
    res.fallbacks = log.as_json()
    return res


def _one_device(ref_model: torch.nn.Module, inputs: list, seed: int) -> tuple[list, list]:
    """The step on one device: its recorded calls, and the cotangents drawn for the outputs.
    A model that fails here is a usage error (its inputs do not fit it), in one line."""
    from decompshard.coverage.model_audit import model_failed
    from decompshard.errors import UsageError

    ref_in = [x.clone().requires_grad_(x.dtype.is_floating_point) for x in inputs]
    rec = RecordCallOutputs()
    try:
        with rec:
            out = ref_model(*ref_in)
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        g = torch.Generator().manual_seed(seed)
        cots = [torch.randn(o.shape, dtype=o.dtype, generator=g) for o in outs]
        rec.phase = "backward"
        with rec:
            torch.autograd.backward(outs, cots)
    except Exception as e:  # noqa: BLE001 - the user's model, before any sharding
        raise UsageError(model_failed(ref_model, inputs, e)) from None
    return rec.calls, cots


def _dtensor_calls(dmodel: torch.nn.Module, param_pl: dict, in_pl: list, inputs: list, cots: list, mesh: Any,
                   reference: list, seed: int) -> ModelCheck:
    """The step on DTensors (inside the simulation), walked beside one device's calls."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from decompshard.verify.dtensor_case import make_dtensor

    drec = RecordCallOutputs()
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
        earlier = _first_divergence(reference, drec.calls, mesh, prefix=True)
        if earlier.divergence is not None:
            return earlier
        where = drec.calls[-1][0] if drec.calls else "the first op"
        return ModelCheck(len(drec.calls), Divergence(len(drec.calls), where, drec.phase,
                                                      f"raised after {where}: {one_line(e, 200)}"))
    return _first_divergence(reference, drec.calls, mesh)


def _replicate():
    from decompshard._compat import TorchReplicate

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


def _first_divergence(reference, calls, mesh, prefix: bool = False) -> ModelCheck:
    """The first call whose op or outputs differ (the one judge on its DTensor outputs);
    `prefix`: `calls` stopped early (an exception), so a shorter sequence is not itself
    a divergence."""
    from torch.distributed.tensor import DTensor

    reference = [c for c in reference if c[0] not in LAYOUT_OPS]
    calls = [c for c in calls if c[0] not in LAYOUT_OPS]
    for i, ((rop, _rphase, routs), (dop, dphase, douts)) in enumerate(zip(reference, calls)):
        if rop != dop:
            return ModelCheck(len(calls), Divergence(i, dop, dphase, f"the call sequence differs: one device ran {rop}"))
        pairs = [(j, d, r.detach()) for j, (r, d) in enumerate(zip(routs, douts)) if isinstance(d, DTensor)]
        v = judge([d for _, d, _ in pairs], [r for _, _, r in pairs], names=[f"output {j}" for j, _, _ in pairs],
                  mesh=mesh)
        if not v.ok:
            return ModelCheck(len(calls), Divergence(i, dop, dphase, v.detail))
    if len(reference) != len(calls) and not prefix:
        return ModelCheck(len(calls), Divergence(min(len(reference), len(calls)), "-", "-",
                                                 f"{len(calls)} calls, one device made {len(reference)}"))
    return ModelCheck(len(calls), None)


def check_model(spec: str, input_shapes: str | None, meshes: list, placements: str | None,
                args: argparse.Namespace) -> int:
    """The CLI entry: build, check on the one mesh given, print the verdict."""
    from decompshard.errors import UsageError
    from decompshard.coverage.model_audit import build_model
    from decompshard.verify.dtensor_case import simulated_world

    if len(meshes) != 1:
        raise UsageError("--model takes one --mesh, e.g. --mesh 2x2")
    module, inputs = build_model(spec, input_shapes)
    with simulated_world(math.prod(meshes[0])):
        res = run_model_check(module, inputs, meshes[0], placements, args.seed)
    mesh = "x".join(map(str, meshes[0]))
    bugs = [f for f in res.fallbacks if f["kind"] == INTERNAL_ERROR]
    if res.divergence is None:
        print(f"{spec} on mesh {mesh}: {res.calls} op calls, forward and backward match one device")
    else:
        d = res.divergence
        print(f"{spec} on mesh {mesh}: first divergence at call #{d.index} ({d.phase}) {d.op}: {d.detail}")
    for f in res.fallbacks:  # what ran replicated instead of derived: right numbers, but say so
        print(f"  ran replicated ({f['kind']}): {f['op']}: {f['message']}")
    if bugs:
        print(f"{spec}: internal error of decompshard at {', '.join(f['op'] for f in bugs)} (ran replicated)")
    return 3 if res.divergence is not None or bugs else 0


# ------------------------------------------------------------------ the zoo's training step


@dataclass(frozen=True)
class Sharding:
    """A mesh and what each dim does: `dp` shards the batch (dim 0 of every input),
    `tp` applies the model's plan; the other parameters and buffers are replicated."""

    mesh: tuple[int, ...]
    batch: int
    dp: int | None = None  # mesh dim of data parallelism
    tp: int | None = None  # mesh dim of tensor parallelism
    # Megatron as users write it: parallelize_module with its default use_local_output=True
    # on the plan's Linear layers, everything else plain tensors (each rank its own copy);
    # activations between the layers are local tensors, so attention runs without DTensor
    # (torch alone can run it). Plans with other layers (Conv1D, convs, fused or raw
    # parameters) do not apply (n/a).
    local_output: bool = False


SHARDINGS: dict[str, Sharding] = {
    "dp": Sharding((4,), 8, dp=0),
    "dp-uneven": Sharding((4,), 10, dp=0),
    "tp": Sharding((4,), 8, tp=0),
    "tp-local": Sharding((4,), 8, tp=0, local_output=True),
    "2d": Sharding((2, 2), 8, dp=0, tp=1),
    "2d-uneven": Sharding((2, 2), 5, dp=0, tp=1),
}


@dataclass
class StepRun:
    """One (model, sharding, path) run. verdict: OK (loss, every gradient and buffer
    match one device on every rank), WRONG (`detail`: the one judge's, the first wrong
    metadata or the worst wrong number), ERROR (`detail` is the exception's first line,
    `op` the aten op in flight; or an internal error of decompshard's that `enable()`
    caught and ran `op` replicated for), n/a (the sharding does not apply: TP without a
    plan). `fallbacks`: every op that ran replicated instead of derived, and why."""

    verdict: str
    detail: str = ""
    op: str = ""
    stage: str = ""  # setup | step | compare
    collectives: int | None = None
    bytes: int | None = None
    first_s: float | None = None
    warm_s: float | None = None
    fallbacks: list[dict] = field(default_factory=list)  # ops run replicated under enable() (fallbacks.Fallback)
    comm_top: list[dict] = field(default_factory=list)  # CommBytes.top(): what moved the most, by op


def run_training_step(built: Any, sharding: str, enable: bool, measure: bool = True) -> StepRun:
    """One training step of `built` (a zoo.Built, float64) on one device and as DTensors
    on a simulated mesh (`enable()` on or off), compared on every rank. Needs a
    simulated world of at least the mesh's size (`verify/dtensor_case.simulated_world`).
    `measure`: also time a warm step (the faster of two) and count one step's
    collectives (three more steps)."""
    from decompshard.verify.dtensor_case import device_mesh, simulation
    from decompshard.runtime.enable import switched

    sh = SHARDINGS[sharding]
    if sh.tp is not None and not built.plan:
        return StepRun("n/a", "no tensor-parallel plan for this model")
    if sh.local_output:
        from decompshard.check.zoo import plan_targets

        if getattr(built, "no_local_tp", ""):
            return StepRun("n/a", built.no_local_tp)
        other = sorted({f"{style} {type(mod).__name__ if mod is not None else 'raw parameter'}"
                        for style, mod in plan_targets(built.model, built.plan).values()
                        if style not in ("colwise", "rowwise", "vocab_colwise") or type(mod) is not torch.nn.Linear})
        if other:
            return StepRun("n/a", f"the plan has layers Megatron's Linear styles do not take: {', '.join(other)}")
    dmodel = copy.deepcopy(built.model)  # before the reference step moves BatchNorm's stats
    ref = _reference_step(built)
    mesh = device_mesh(sh.mesh)
    with recording_fallbacks() as log, switched(enable), warnings.catch_warnings(), simulation(math.prod(sh.mesh)):
        warnings.simplefilter("ignore")
        run = _sharded_step(built, dmodel, ref, mesh, sh, measure)
    run.fallbacks = log.as_json()
    bug = log.internal_errors()
    if bug and run.verdict == "OK":  # right numbers from a replicated op that should have been derived
        run.verdict, run.op, run.stage = "ERROR", bug[0].op, "strategy"
        run.detail = f"internal error of decompshard, the op ran replicated: {bug[0].message}"
    return run


def _sharded_step(built: Any, dmodel: torch.nn.Module, ref: _RefStep, mesh: Any, sh: Sharding,
                  measure: bool) -> StepRun:
    """The DTensor step, its verdict against `ref`, and with `measure` its times and
    collectives (inside the simulation and the caller's `switched`)."""
    try:
        _distribute_model(dmodel, built.plan, mesh, sh, getattr(built, "megatron_inputs", None))
        din = _distribute_inputs(built.inputs, mesh, sh)
    except Exception as e:
        return StepRun("ERROR", one_line(e, 300), stage="setup")
    _clear_all_caches()
    t0 = time.perf_counter()
    try:
        loss = _dtensor_step(dmodel, built.loss, din, not sh.local_output)
    except Exception as e:
        return StepRun("ERROR", one_line(e, 300), _failing_op(dmodel, built.loss, din, not sh.local_output), "step")
    run = StepRun("OK", first_s=time.perf_counter() - t0)
    try:
        bad = _compare_step(loss, dmodel, ref, getattr(built, "compute_dtype", torch.float64), mesh,
                            plain_ok=sh.local_output)
    except Exception as e:
        return StepRun("ERROR", f"reading the results: {one_line(e, 300)}", stage="compare")
    if bad:
        run.verdict, run.detail = "WRONG", bad
    if measure:
        try:
            # warm: the faster of two steps (a shared machine swings one run's time).
            # The first step is timed once: a second step after clearing the caches
            # is not as cold (llama tp, enable(): 1.9 s, then 0.85 s), and that cost is
            # what a user pays
            implicit = not sh.local_output
            run.warm_s = min(_timed_step(dmodel, built.loss, din, implicit) for _ in range(2))
            _zero_grads(dmodel)
            with CommBytes() as comm:
                _dtensor_step(dmodel, built.loss, din, not sh.local_output, comm)
            run.collectives, run.bytes, run.comm_top = comm.get_total_counts(), comm.bytes, comm.top()
        except Exception as e:  # the first step's verdict stands; say why there are no numbers
            run.detail = (run.detail + "; " if run.detail else "") + f"a later step raised: {one_line(e, 300)}"
    return run


def _timed_step(model: torch.nn.Module, loss_fn: Any, inputs: dict, implicit: bool) -> float:
    _zero_grads(model)
    t0 = time.perf_counter()
    _dtensor_step(model, loss_fn, inputs, implicit)
    return time.perf_counter() - t0


@dataclass
class _RefStep:
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]


def _reference_step(built: Any) -> _RefStep:
    model = copy.deepcopy(built.model)
    loss = built.loss(model, built.inputs)
    loss.backward()
    return _RefStep(loss.detach(), {n: p.grad for n, p in model.named_parameters()},
                    {n: b.detach().clone() for n, b in model.named_buffers()})


def _dtensor_step(model: torch.nn.Module, loss_fn: Any, inputs: dict, implicit: bool = True,
                  comm: CommBytes | None = None) -> Any:
    """Forward, loss, backward; each gradient redistributed to its parameter's placements
    (what an optimizer step needs: DDP's all-reduce of a Partial gradient, for one).
    Plain tensors the model makes on the way (masks and position buckets from `arange`,
    the same on every rank) count as replicated: torch's `implicit_replication`, what a
    user of these models turns on. `implicit` False (tp-local): off, since there a plain
    tensor is a rank's local part, and reading it as replicated would be wrong."""
    import contextlib

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental import implicit_replication

    with implicit_replication() if implicit else contextlib.nullcontext():
        loss = loss_fn(model, inputs)
        loss.backward()
    if comm is not None:
        comm.in_flight = ("gradients redistributed to their parameters' placements", "")
    for p in model.parameters():
        if isinstance(p, DTensor) and p.grad is not None and tuple(p.grad.placements) != tuple(p.placements):
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    return loss


def _failing_op(model: torch.nn.Module, loss_fn: Any, inputs: dict, implicit: bool = True) -> str:
    """Run the step again under a recorder to name the aten op that raises (the timed
    step runs without one, so the recorder does not count in its time)."""
    _zero_grads(model)
    rec = RecordCallOutputs()
    try:
        with rec:
            _dtensor_step(model, loss_fn, inputs, implicit)
    except Exception:
        return rec.current
    return "(did not raise again)"


def _zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        p.grad = None


def _compare_step(loss: Any, model: torch.nn.Module, ref: _RefStep, dtype: torch.dtype = torch.float64,
                  mesh: Any = None, plain_ok: bool = False) -> str:
    """'' if the loss, every gradient and every buffer match one device on every rank
    (the one judge, at `dtype`'s tolerance: the lowest precision the model computes in),
    else what disagrees. `plain_ok` (tp-local): a plain tensor (each rank's own value,
    the tensors outside the TP layers) is judged rank by rank."""
    triples = [("loss", loss, ref.loss)]
    triples += [(f"grad {n}", p.grad, ref.grads[n]) for n, p in model.named_parameters()]
    triples += [(f"buffer {n}", b, ref.buffers[n]) for n, b in model.named_buffers()]
    names, got, want = zip(*triples)
    v = judge(list(got), list(want), names=names, dtype=dtype, plain="per-rank" if plain_ok else "wrong",
              missing_ok=True, mesh=mesh)
    return v.detail


def _distribute_model(model: torch.nn.Module, plan: dict[str, str], mesh: Any, sh: Sharding,
                      extra: dict[str, Any] | None = None) -> None:
    """The plan on the TP dim, everything else replicated: every parameter and buffer a
    DTensor on the whole mesh. On a 1-D TP mesh, plain `nn.Linear` layers go through
    `parallelize_module` (Megatron: ColwiseParallel/RowwiseParallel with their input and
    output redistributions); other layers (convs, Conv1D, fused projections, raw expert
    weights) and every layer on a 2-D mesh get their placements directly, DTensor
    propagating activations from there. `extra`: the model's `megatron_inputs`, applied
    with the Linear styles under local outputs."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from decompshard.check.zoo import plan_targets, tp_placement

    rep = [_replicate()] * mesh.ndim
    n = math.prod(mesh.shape)
    if sh.tp is not None:
        targets = plan_targets(model, plan)
        if mesh.ndim == 1:
            styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel, "vocab_colwise": ColwiseParallel}
            megatron = {name.rsplit(".", 1)[0]: styles[style](use_local_output=sh.local_output, **(
                            {"output_layouts": _replicate()} if style == "vocab_colwise" and sh.local_output else {}))
                        for name, (style, mod) in targets.items()
                        if style in styles and type(mod) is torch.nn.Linear}
            if sh.local_output:
                megatron.update(extra or {})
            if megatron:
                parallelize_module(model, mesh, megatron)
    else:
        targets = {}
    if sh.local_output:
        _plain_rest(model, n)
        return
    # tied weights (BERT's decoder, GPT-2's lm_head) stay tied: one DTensor per tensor
    made: dict[int, Any] = {}
    aliases = list(model.named_parameters(remove_duplicate=False))
    styled = {id(p): (name, *targets[name]) for name, p in aliases if name in targets}
    for name, p in aliases:
        if isinstance(p, DTensor):
            continue
        if id(p) not in made:
            pl = list(rep)
            if id(p) in styled:
                tname, style, mod = styled[id(p)]
                pl[sh.tp] = tp_placement(style, tname, p, mod)
            made[id(p)] = torch.nn.Parameter(_place(p.detach(), mesh, pl), p.requires_grad)
        _set_param(model, name, made[id(p)])
    for name, b in list(model.named_buffers(remove_duplicate=False)):
        if not isinstance(b, DTensor):
            if id(b) not in made:
                # each simulated rank its own copy: kernels write buffers in place
                made[id(b)] = own_copies(distribute_tensor(b, mesh, rep), n)
            *path, leaf = name.split(".")
            model.get_submodule(".".join(path))._buffers[leaf] = made[id(b)]


def _plain_rest(model: torch.nn.Module, n: int) -> None:
    """Every parameter and buffer outside the TP layers a plain tensor with a copy per
    simulated rank (a LocalTensor): what each process holds when only the Linear layers
    are parallelized (tied parameters stay tied)."""
    from torch.distributed.tensor import DTensor

    from decompshard._compat import make_local_tensor

    made: dict[int, Any] = {}
    for name, p in list(model.named_parameters(remove_duplicate=False)):
        if isinstance(p, DTensor):
            continue
        if id(p) not in made:
            made[id(p)] = torch.nn.Parameter(make_local_tensor({r: p.detach().clone() for r in range(n)}), p.requires_grad)
        _set_param(model, name, made[id(p)])
    for name, b in list(model.named_buffers(remove_duplicate=False)):
        if id(b) not in made:
            made[id(b)] = make_local_tensor({r: b.detach().clone() for r in range(n)})
        *path, leaf = name.split(".")
        model.get_submodule(".".join(path))._buffers[leaf] = made[id(b)]


def own_copies(d: Any, n: int) -> Any:
    """`d` with a separate local tensor per simulated rank (`n` ranks).

    Why: a replicated DTensor distributed from a plain tensor under LocalTensorMode holds
    ONE plain tensor that stands for every rank, so a kernel that updates it in place
    (batch norm's running statistics) updates it once per rank: n updates where real
    processes make one each. With a copy per rank the simulation is what gloo does.
    A DTensor whose local is already per rank is returned as it is."""
    from torch.distributed.tensor import DTensor

    from decompshard._compat import local_tensor, make_local_tensor, rank_tensors

    local = local_tensor(d)
    if rank_tensors(local) is not None:
        return d
    per_rank = make_local_tensor({r: local.clone() for r in range(n)})
    return DTensor.from_local(per_rank, d.device_mesh, d.placements, run_check=False, shape=d.shape,
                              stride=d.stride())


def _place(x: torch.Tensor, mesh: Any, placements: list) -> Any:
    from decompshard.verify.dtensor_case import make_dtensor

    return make_dtensor(x, mesh, placements, 0, 0)  # handles _StridedShard (no Partial here)


def _distribute_inputs(inputs: dict[str, torch.Tensor], mesh: Any, sh: Sharding) -> dict[str, Any]:
    from torch.distributed.tensor import distribute_tensor

    from decompshard._compat import TorchShard

    pl = [_replicate()] * mesh.ndim
    if sh.local_output:  # plain: the Megatron styles take plain inputs
        return dict(inputs)
    if sh.dp is not None:
        pl[sh.dp] = TorchShard(0)
    return {k: distribute_tensor(v, mesh, pl) for k, v in inputs.items()}


def _clear_all_caches() -> None:
    """Cold: decompshard's caches and DTensor's sharding caches."""
    from decompshard import clear_caches
    from decompshard._compat import clear_dtensor_caches

    clear_caches()
    clear_dtensor_caches()
