"""A small model whose forward uses the ops torch 2.13's DTensor cannot shard well.

Shared by tests/test_e2e_model.py (LocalTensorMode on a 2x2 mesh, and 4 gloo processes)
and runnable on its own: `python tests/_e2e_model.py` prints the per-op collective
counts, torch's built-in fallback against decompshard, for the README.

One branch per op. Each branch reads its own inputs and parameters, laid out on the 2x2
mesh as listed, so that an op's collectives can be counted on their own (a chain would
make later ops see placements chosen by earlier ones, different between the two paths).
The model's forward runs every branch; the loss is the sum of every output.

Shapes: dims that a rule shards are multiples of 6 where the derivation needs it. The
derivation checks local shapes on 2 and 3 ranks and today drops a rule that fails on 3
uneven ranks instead of marking it [even] (e.g. sdpa's batch rule needs batch % 3 == 0).
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

DTYPE = torch.float64
MESH_SHAPE = (2, 2)


def _placements(spec: str):
    """'S0,S1' / 'R,P' -> torch placements (one per mesh dim)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    out = []
    for p in spec.split(","):
        p = p.strip()
        out.append(Replicate() if p == "R" else Partial() if p == "P" else Shard(int(p[1:])))
    return tuple(out)


@dataclass
class Arg:
    name: str
    shape: tuple[int, ...]
    placements: str  # e.g. "S0,S1"
    grad: bool = True
    param: bool = False  # a parameter of the branch module (else a forward input)


@dataclass
class Branch:
    name: str  # the op as a README row
    fn: Callable
    args: list[Arg]
    note: str = ""
    # torch behaviour worth stating next to the counts (filled by the README, not here)
    known: str = ""
    kwargs: dict = field(default_factory=dict)


def _trace_of_product(a, b):
    # a @ b with the contraction dim sharded is P(sum) (native mm rule, no collective);
    # torch's trace fallback all-reduces it first, decompshard keeps P(sum).
    return torch.trace(a @ b)


BRANCHES: list[Branch] = [
    Branch("addmv", lambda bias, mat, vec: torch.addmv(bias, mat, vec),
           [Arg("bias", (12,), "R,R", param=True), Arg("mat", (12, 12), "S1,R", param=True),
            Arg("vec", (12,), "S0,R")],
           known="torch all-gathers mat and vec"),
    Branch("trace", _trace_of_product,
           [Arg("a", (12, 12), "S1,R", grad=False), Arg("b", (12, 12), "S0,R", grad=False, param=True)],
           note="no gradient: trace_backward (CompositeImplicitAutograd) makes plain tensors "
                "(zeros/arange) and DTensor refuses mixing them, with torch's fallback too",
           known="torch all-reduces the P(sum) input"),
    Branch("pixel_shuffle", lambda x: F.pixel_shuffle(x, 2),
           [Arg("x", (2, 24, 3, 3), "S1,S1")],
           known="torch runs it on 6 channels per rank: error (needs a multiple of 4)"),
    Branch("addbmm", lambda bias, b1, b2: torch.addbmm(bias, b1, b2),
           [Arg("bias", (6, 8), "R,R", param=True), Arg("batch1", (4, 6, 6), "S0,S2"),
            Arg("batch2", (4, 6, 8), "S0,S1", param=True)],
           known="no strategy, no decomposition"),
    Branch("cdist", lambda x, c: torch.cdist(x, c),
           [Arg("x", (12, 6), "S0,S0"), Arg("centers", (4, 6), "R,R", param=True)],
           known="_cdist_forward: no strategy, no decomposition"),
    Branch("unfold", lambda x: x.unfold(1, 3, 2),
           [Arg("x", (12, 9), "S0,R")],
           known="Tensor.unfold: no strategy"),
    Branch("renorm", lambda w: torch.renorm(w, 2, 0, 1.0),
           [Arg("w", (12, 6), "S0,S1", param=True)],
           known="no strategy"),
    Branch("im2col", lambda x: F.unfold(x, 2),
           [Arg("x", (6, 6, 5, 5), "S0,S1")],
           known="F.unfold: no strategy"),
    Branch("sdpa_causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
           [Arg("q", (12, 4, 6, 8), "S0,S0"), Arg("k", (12, 4, 6, 8), "S0,S0"),
            Arg("v", (12, 4, 6, 8), "S0,S0")],
           known="CPU flash attention: no strategy"),
    Branch("reflection_pad1d", lambda x: F.pad(x, (1, 1), mode="reflect"),
           [Arg("x", (4, 6, 12), "S0,S1")],
           known="no strategy"),
    Branch("col2im", lambda x: F.fold(x, (4, 4), 2),
           [Arg("x", (2, 48, 9), "S0,S1")],
           known="F.fold: no strategy"),
    Branch("hardswish", F.hardswish,
           [Arg("x", (12, 12), "S0,S1")],
           known="backward: hardswish_backward has no strategy"),
    Branch("prelu", lambda x, a: F.prelu(x, a),
           [Arg("x", (4, 6, 12), "S0,S1"), Arg("a", (6,), "R,R", param=True)],
           known="backward: _prelu_kernel_backward has no strategy"),
    Branch("logsigmoid", F.logsigmoid,
           [Arg("x", (12, 12), "S0,S1")],
           known="backward: log_sigmoid_backward has no strategy"),
]


class BranchModule(nn.Module):
    def __init__(self, branch: Branch, gen: torch.Generator):
        super().__init__()
        self.branch = branch
        for a in branch.args:
            if a.param:
                t = torch.randn(a.shape, dtype=DTYPE, generator=gen)
                if a.grad:
                    self.register_parameter(a.name, nn.Parameter(t))
                else:
                    self.register_buffer(a.name, t)

    def forward(self, *inputs):
        it = iter(inputs)
        args = [getattr(self, a.name) if a.param else next(it) for a in self.branch.args]
        return self.branch.fn(*args)


class E2EModel(nn.Module):
    def __init__(self, branches: Sequence[Branch] = BRANCHES, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.names = [b.name for b in branches]
        self.branches = nn.ModuleDict({b.name: BranchModule(b, gen) for b in branches})
        self.input_args = {b.name: [a for a in b.args if not a.param] for b in branches}

    def make_inputs(self, seed: int = 1) -> dict[str, list[torch.Tensor]]:
        gen = torch.Generator().manual_seed(seed)
        return {
            n: [torch.randn(a.shape, dtype=DTYPE, generator=gen).requires_grad_(a.grad) for a in args]
            for n, args in self.input_args.items()
        }

    def forward(self, inputs: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
        return {n: self.branches[n](*inputs[n]) for n in self.names}


def loss_of(outputs) -> torch.Tensor:
    return sum(o.sum() for o in outputs.values())


# ------------------------------------------------------------------- distributing


def distribute(model: E2EModel, inputs, mesh):
    """A copy of `model` with DTensor parameters, and DTensor inputs, per BRANCHES."""
    import copy

    from torch.distributed.tensor import distribute_tensor

    dmodel = copy.deepcopy(model)
    for mod in dmodel.branches.values():
        for a in mod.branch.args:
            if not a.param:
                continue
            t = getattr(mod, a.name)
            d = distribute_tensor(t.detach(), mesh, _placements(a.placements))
            if a.grad:
                setattr(mod, a.name, nn.Parameter(d))
            else:
                mod.register_buffer(a.name, d)
    dinputs = {
        n: [
            _distribute_input(x, a, mesh)
            for x, a in zip(xs, model.input_args[n])
        ]
        for n, xs in inputs.items()
    }
    return dmodel, dinputs


def _distribute_input(x, arg: Arg, mesh):
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(x.detach(), mesh, _placements(arg.placements)).requires_grad_(arg.grad)


def leaves(model: E2EModel, inputs) -> dict[str, torch.Tensor]:
    """Every tensor that should get a gradient, by a stable name."""
    out = {}
    for n, mod in model.branches.items():
        for a in mod.branch.args:
            if a.param and a.grad:
                out[f"{n}.{a.name}"] = getattr(mod, a.name)
    for n, xs in inputs.items():
        for x, a in zip(xs, model.input_args[n]):
            if a.grad:
                out[f"{n}.{a.name}"] = x
    return out


# ------------------------------------------------------------------- running


@dataclass
class OpResult:
    name: str
    forward: int | str  # collective count, or "error"
    backward: int | str | None  # None: no gradient through this op
    output: torch.Tensor | None = None  # full tensor (rank 0's view)
    grads: dict = field(default_factory=dict)  # leaf name -> full gradient
    error: str = ""

    @property
    def total(self) -> int | str:
        if "error" in (self.forward, self.backward):
            return "error"
        return self.forward + (self.backward or 0)


def full(t) -> torch.Tensor:
    """The global value as a plain tensor (rank 0's copy under LocalTensorMode)."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    lt = getattr(t, "_local_tensors", None)
    return lt[0] if lt is not None else t


def run_branch(model: E2EModel, inputs, mesh, name: str) -> OpResult:
    """One branch on `mesh`: forward and backward collective counts, output, grads."""
    from torch.distributed.tensor.debug import CommDebugMode

    dmodel, dinputs = distribute(model, {name: inputs[name]}, mesh)
    mod = dmodel.branches[name]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with CommDebugMode() as fwd:
                out = mod(*dinputs[name])
            n_fwd = fwd.get_total_counts()
            lv = {k: v for k, v in leaves(dmodel, dinputs).items() if k.startswith(name + ".")}
            n_bwd = None
            if lv:
                loss = out.sum()
                with CommDebugMode() as bwd:
                    loss.backward()
                n_bwd = bwd.get_total_counts()
            grads = {k: full(v.grad) for k, v in lv.items()}
            return OpResult(name, n_fwd, n_bwd, full(out), grads)
    except Exception as e:  # torch's fallback raising is a result, not a test error
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
        failed_fwd = "out" not in locals()
        return OpResult(name, "error" if failed_fwd else n_fwd, "error", error=first)


def reference(model: E2EModel, inputs) -> dict[str, OpResult]:
    """Single-device outputs and gradients."""
    outs = model(inputs)
    loss_of(outs).backward()
    res = {}
    for n in model.names:
        grads = {k: v.grad.clone() for k, v in leaves(model, {n: inputs[n]}).items() if k.startswith(n + ".")}
        res[n] = OpResult(n, 0, 0, outs[n].detach(), grads)
    return res


def fresh(model: E2EModel, inputs):
    """Clear gradients left by a previous run (the reference run shares the leaves)."""
    for p in model.parameters():
        p.grad = None
    for xs in inputs.values():
        for x in xs:
            x.grad = None


@contextlib.contextmanager
def torch_fallback():
    import decompshard

    was = decompshard.is_enabled()
    decompshard.disable()
    try:
        yield
    finally:
        if was:
            decompshard.enable()


def compare_counts(model: E2EModel, inputs, mesh) -> tuple[dict[str, OpResult], dict[str, OpResult]]:
    """Per-op results with torch's fallback and with decompshard, on the same mesh."""
    import decompshard

    with torch_fallback():
        theirs = {n: run_branch(model, inputs, mesh, n) for n in model.names}
    with decompshard.enabled():
        ours = {n: run_branch(model, inputs, mesh, n) for n in model.names}
    return theirs, ours


def comparable_totals(theirs: dict[str, OpResult], ours: dict[str, OpResult]) -> tuple[int, int, int]:
    """(torch's total, decompshard's total) over the forward / backward passes torch can
    run, and decompshard's total over everything."""
    t = o = 0
    for n, r in ours.items():
        for which in ("forward", "backward"):
            tv, ov = getattr(theirs[n], which), getattr(r, which)
            if isinstance(tv, int) and isinstance(ov, int):
                t, o = t + tv, o + ov
    every = sum(v for r in ours.values() for v in (r.forward, r.backward) if isinstance(v, int))
    return t, o, every


def count_table(theirs: dict[str, OpResult], ours: dict[str, OpResult]) -> str:
    from tabulate import tabulate

    def cell(v):
        return "-" if v is None else v

    rows = [[n, cell(theirs[n].forward), cell(theirs[n].backward), cell(o.forward), cell(o.backward),
             theirs[n].error[:60]] for n, o in ours.items()]
    t, o, every = comparable_totals(theirs, ours)
    rows.append(["total where torch runs", "", t, "", o, ""])
    rows.append(["total", "", "error", "", every, ""])
    return tabulate(rows, headers=["op", "torch fwd", "torch bwd", "decompshard fwd", "decompshard bwd",
                                   "torch's error"])


# ------------------------------------------------------------------- process groups


def fake_world(world_size: int):
    """A fake process group of `world_size` ranks for the duration (sharding decisions and
    collective counts are real, data moved by collectives is not): the checker's own."""
    from decompshard.verify.dtensor_case import simulated_world

    return simulated_world(world_size)


def submesh(shape: Sequence[int]):
    """A mesh over the first prod(shape) ranks of the world, row-major."""
    import math

    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(math.prod(shape)).view(*shape))


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gloo_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One of 4 real processes: the model on a 2x2 mesh with real (gloo) collectives.
    Writes per-op counts and numerical verdicts to out_dir/rank{rank}.json."""
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import decompshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    report: dict = {}
    try:
        mesh = init_device_mesh("cpu", MESH_SHAPE)
        model = E2EModel()
        inputs = model.make_inputs()
        ref = reference(model, inputs)
        with decompshard.enabled():
            for n in model.names:
                r = run_branch(model, inputs, mesh, n)
                report[n] = {
                    "forward": r.forward, "backward": r.backward, "error": r.error,
                    "output_ok": r.output is not None and bool(torch.allclose(r.output, ref[n].output)),
                    "grads_ok": {k: bool(torch.allclose(g, ref[n].grads[k])) for k, g in r.grads.items()},
                    "grads_expected": sorted(ref[n].grads),
                }
    except Exception as e:  # reported, so the parent's assertion says what broke
        report["__error__"] = f"{type(e).__name__}: {e}"
    finally:
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


def main() -> None:  # pragma: no cover - a report, run by hand
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    with fake_world(4):
        mesh = init_device_mesh("cpu", MESH_SHAPE)
        model = E2EModel()
        inputs = model.make_inputs()
        with LocalTensorMode(4):
            theirs, ours = compare_counts(model, inputs, mesh)
        print(count_table(theirs, ours))


if __name__ == "__main__":
    main()
