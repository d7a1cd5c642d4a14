"""The training-loop zoo, one rank's side: several steps of a real model's training loop
on real gloo processes, checked against one device in float64 after every step.

Why: the zoo (check/zoo.py, check/model.py) proves one forward and backward. A user runs
more: an optimizer, gradient clipping, FSDP2 with tensor parallel, many steps. Here each
step is forward, the model's own loss, backward, `clip_grad_norm_` (foreach or the
for-loop), AdamW (foreach, for-loop or fused) on the zoo's Llama with two decoder layers
(`zoo.LOOP_ENTRY`), and after every step the loss, the total gradient norm
`clip_grad_norm_` returns and every parameter are compared with the same loop on one
device (every rank computes that itself from the same seed).

Parallelisms (`PARALLELISMS`), as users write them:
- ``dp``: DTensor data parallel: every parameter `Replicate` (`distribute_module`), the
  batch `Shard(0)`, the gradients redistributed to their parameters' placements after
  backward, the step under `implicit_replication` (the model makes plain tensors).
- ``tp``: tensor parallel, Megatron's plan through `parallelize_module` (the zoo's Llama
  plan: q/k/v and gate/up `ColwiseParallel`, o/down `RowwiseParallel`, local outputs), the
  other parameters plain tensors; clipping and the optimizer step under
  `implicit_replication` (torch alone's foreach norm refuses plain and DTensor mixed).
- ``fsdp``: FSDP2 alone, `fully_shard` per decoder layer, then the root; each rank its
  quarter of the batch.
- ``fsdp-tp``: FSDP2 + tensor parallel on a 2x2 mesh in torchtitan's order: Megatron's
  plan on 'tp', then `fully_shard` per layer and the root on 'dp'; each 'dp' rank its half
  of the batch. The norms' and embeddings' parameters live on 'dp', the TP ones on the
  whole mesh: `clip_grad_norm_` spans two meshes.

`fully_shard` does not run under LocalTensorMode, so every case runs on real processes
(check/loop_run.py spawns them). Each rank writes one JSON row per run as it finishes.
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator

import torch

from decompshard.errors import one_line

__all__ = ["COMPILE_MODES", "LR", "MAX_NORM", "PARALLELISMS", "STEPS", "VARIANTS", "LoopRun", "Variant", "rank_main",
           "graph_collectives", "run_loop", "split_mode"]

STEPS = 3
LR = 1e-2
MAX_NORM = 0.5  # below the tiny Llama's gradient norm (about 2-3): every step clips
BATCH = 8


@dataclass(frozen=True)
class Variant:
    """The optimizer's implementation (AdamW `foreach`, `for-loop` or `fused`) and
    whether `clip_grad_norm_` runs foreach."""

    optimizer: str
    clip_foreach: bool

    @property
    def name(self) -> str:
        return f"{self.optimizer}/{'foreach' if self.clip_foreach else 'for-loop'}"

    def optimizer_flags(self) -> dict[str, bool]:
        return {"foreach": {"foreach": True, "fused": False}, "for-loop": {"foreach": False, "fused": False},
                "fused": {"foreach": False, "fused": True}}[self.optimizer]


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant(o, c) for o in ("foreach", "for-loop", "fused") for c in (True, False))}

# a parallelism's name may end in one of these: the forward and loss run under
# torch.compile (aot_eager), the backward, clipping and optimizer step eager. The three
# symbolic modes are the three ways users meet symbolic sizes (issue 37)
COMPILE_MODES: dict[str, str] = {
    "+compile": "static shapes (dynamic=False)",
    "+dynamic": "dynamic=True: every size symbolic from the first step",
    "+mark_dynamic": "torch._dynamo.mark_dynamic on every input's sequence dim",
    "+seqlen": "torch's default: the sequence shorter at each step (SEQ_LENGTHS), so the second "
               "step recompiles with a symbolic length and the third reuses that graph",
    "+inductor": "dynamic=True under inductor (its graphs' collectives are not listed)",
}
SEQ_LENGTHS = (8, 6, 4)  # the zoo's sequence (zoo.SEQ), then shorter


def split_mode(name: str) -> tuple[str, str]:
    """(parallelism, compile mode suffix or ''), e.g. 'dp+seqlen' -> ('dp', '+seqlen')."""
    for suffix in COMPILE_MODES:
        if name.endswith(suffix):
            return name.removesuffix(suffix), suffix
    return name, ""


def _lengths(mode: str, steps: int) -> list[int | None]:
    """Each step's sequence length (None: the built inputs as they are)."""
    return [SEQ_LENGTHS[i % len(SEQ_LENGTHS)] if mode == "+seqlen" else None for i in range(steps)]


def _at_length(inputs: dict[str, Any], length: int | None, mark_dynamic: bool = False) -> dict[str, Any]:
    """The inputs cut to `length` tokens (every input is [batch, sequence]); with
    `mark_dynamic`, their sequence dim marked dynamic for torch.compile."""
    out = {k: v[:, :length].contiguous() if length is not None else v for k, v in inputs.items()}
    if mark_dynamic:
        for v in out.values():
            torch._dynamo.mark_dynamic(v, 1)
    return out

# name -> (mesh shape, mesh dim names)
PARALLELISMS: dict[str, tuple[tuple[int, ...], tuple[str, ...]]] = {
    "dp": ((4,), ("dp",)),
    "tp": ((4,), ("tp",)),
    "fsdp": ((4,), ("dp",)),
    "fsdp-tp": ((2, 2), ("dp", "tp")),
}


@dataclass
class LoopRun:
    """One (parallelism, variant, path) run on one rank. verdict: OK (every step's loss,
    grad norm and parameters match one device), WRONG (`detail`: the first that does
    not, `step`: its step), ERROR (`detail`: the exception's first line, `stage`:
    setup or the step it raised in). `first_s`: the first step's time (decompshard's and
    DTensor's sharding caches cleared before it); `later_s`: the fastest later step;
    `*_cpu_s` the same in this process's CPU time.
    `worst`: the largest relative error seen; `clipped`: every step's norm above
    MAX_NORM (clipping scaled the gradients); `warnings`: decompshard's warnings;
    `replicated`: the ops enable() ran replicated instead of derived, and why (symbolic
    shapes among the reasons); `graphs`: under a compile mode, the collectives in each
    graph AOT autograd made, in compile order (the same list for every mode means
    symbolic sizes moved what static ones do)."""

    parallelism: str
    variant: str
    path: str  # enable | torch
    verdict: str = "OK"
    detail: str = ""
    stage: str = ""
    step: int | None = None
    first_s: float | None = None
    later_s: float | None = None
    first_cpu_s: float | None = None  # this process's CPU time (a shared machine's other load left out)
    later_cpu_s: float | None = None
    worst: float = 0.0
    clipped: bool = True
    warnings: list[str] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)  # "op (why)": ops enable() ran replicated (fallbacks.py)
    graphs: list[str] = field(default_factory=list)  # each compiled graph's collectives (`graph_collectives`)


# ------------------------------------------------------------------ one device


@dataclass
class _Ref:
    loss: float
    norm: float
    params: dict[str, torch.Tensor]


def _make_optimizer(params: Any, variant: Variant, lr: float = LR) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, **variant.optimizer_flags())


def _reference(built: Any, variant: Variant, lengths: list[int | None], loss_fn: Any = None) -> list[_Ref]:
    """The loop on one device: per step the loss, the total norm, every parameter.
    `loss_fn`: the loss compiled as the distributed run compiles it (inductor's kernels
    round otherwise than eager: one device under inductor differs from eager by 5e-5 in
    lm_head's weight after one AdamW step, whose update amplifies near-zero gradients)."""
    model = copy.deepcopy(built.model)
    opt = _make_optimizer(model.parameters(), variant)
    loss_fn = loss_fn or built.loss
    out = []
    for length in lengths:
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model, _at_length(built.inputs, length))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, foreach=variant.clip_foreach)
        opt.step()
        out.append(_Ref(float(loss.detach()), float(norm), {n: p.detach().clone() for n, p in model.named_parameters()}))
    return out


# ------------------------------------------------------------------ the parallelisms


@dataclass
class _Placed:
    model: torch.nn.Module
    inputs: dict[str, Any]
    forward_ctx: Callable[[], Any] = contextlib.nullcontext
    update_ctx: Callable[[], Any] = contextlib.nullcontext
    redistribute_grads: bool = False
    mean_over_ranks: bool = False  # the loss is this rank's batch part's mean
    loss: Callable[..., Any] | None = None  # the model's loss, or it compiled


def _megatron(model: torch.nn.Module, plan: dict[str, str]) -> dict[str, Any]:
    """The zoo plan's Linear layers as Megatron's styles (local outputs)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from decompshard.check.zoo import plan_targets

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {name.rsplit(".", 1)[0]: styles[style]() for name, (style, mod) in plan_targets(model, plan).items()
            if style in styles and type(mod) is torch.nn.Linear}


def _fully_shard(model: torch.nn.Module, mesh: Any) -> None:
    """FSDP2 as torchtitan applies it: each decoder layer, then the root."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def _batch_part(inputs: dict[str, torch.Tensor], index: int, parts: int) -> dict[str, torch.Tensor]:
    return {k: v.chunk(parts)[index].clone() for k, v in inputs.items()}


def _place(parallelism: str, built: Any, model: torch.nn.Module) -> _Placed:
    """The model and inputs laid out for `parallelism` on this rank (module doc)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import parallelize_module

    shape, names = PARALLELISMS[parallelism]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    if parallelism == "dp":
        distribute_module(model, mesh)
        inputs = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in built.inputs.items()}
        return _Placed(model, inputs, implicit_replication, implicit_replication, redistribute_grads=True)
    if parallelism == "tp":
        parallelize_module(model, mesh, _megatron(model, built.plan))
        return _Placed(model, dict(built.inputs), update_ctx=implicit_replication)
    if parallelism == "fsdp-tp":
        parallelize_module(model, mesh["tp"], _megatron(model, built.plan))
    dp = mesh["dp"] if mesh.ndim > 1 else mesh
    _fully_shard(model, dp)
    return _Placed(model, _batch_part(built.inputs, dp.get_local_rank(), dp.size()), mean_over_ranks=True)


# ------------------------------------------------------------------ the distributed loop


def _plain(t: Any) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _global_loss(loss: Any, placed: _Placed) -> float:
    import torch.distributed as dist

    value = _plain(loss).detach().clone()
    if placed.mean_over_ranks:  # equal token counts per rank: the mean of the means
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)


def _step(placed: _Placed, inputs: dict[str, Any], opt: torch.optim.Optimizer, variant: Variant) -> tuple[Any, Any]:
    """One step: forward, loss, backward, clipping, the optimizer's step."""
    from torch.distributed.tensor import DTensor

    opt.zero_grad(set_to_none=True)
    with placed.forward_ctx():
        loss = placed.loss(placed.model, inputs)
        loss.backward()
    if placed.redistribute_grads:  # DTensor DP: a Partial gradient reduced to its parameter's placements
        for p in placed.model.parameters():
            if isinstance(p, DTensor) and p.grad is not None and tuple(p.grad.placements) != tuple(p.placements):
                p.grad = p.grad.redistribute(p.device_mesh, p.placements)
    with placed.update_ctx():
        norm = torch.nn.utils.clip_grad_norm_(placed.model.parameters(), MAX_NORM, foreach=variant.clip_foreach)
        opt.step()
    return loss, norm


def _relative(got: torch.Tensor | float, want: torch.Tensor | float) -> float:
    got, want = torch.as_tensor(got, dtype=torch.float64), torch.as_tensor(want, dtype=torch.float64)
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max() / max(1.0, float(want.abs().max())))


def _compare(loss: float, norm: float, model: torch.nn.Module, ref: _Ref) -> list[tuple[str, float]]:
    """(what, relative error) for the loss, the norm and every parameter (full tensors)."""
    errs = [("loss", _relative(loss, ref.loss)), ("grad norm", _relative(norm, ref.norm))]
    errs += [(f"param {n}", _relative(_plain(p.detach()), ref.params[n])) for n, p in model.named_parameters()]
    return errs


# the project's float64 tolerance (verify/rank_sim.close: rtol 1e-6). The model is float64
# but Llama's RMSNorm computes its variance in float32 whatever the dtype: a batch split
# over ranks rounds there differently from one device (FSDP2 with torch alone: 1.1e-7)
TOLERANCE = 1e-6


def _loop(run: LoopRun, placed: _Placed, variant: Variant, refs: list[_Ref], lr: float,
          lengths: list[int | None], mark_dynamic: bool) -> None:
    """The steps, each timed and compared; fills `run` in place."""
    from decompshard import clear_caches
    from decompshard._compat import clear_dtensor_caches

    opt = _make_optimizer(placed.model.parameters(), variant, lr)
    clear_caches()
    clear_dtensor_caches()
    times, cpu = [], []
    for i, ref in enumerate(refs):
        run.stage, run.step = f"step {i + 1}", i + 1
        inputs = _at_length(placed.inputs, lengths[i], mark_dynamic)
        t0, c0 = time.perf_counter(), time.process_time()
        loss, norm = _step(placed, inputs, opt, variant)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        got_norm = float(_plain(norm))
        run.clipped = run.clipped and got_norm > MAX_NORM
        errs = _compare(_global_loss(loss, placed), got_norm, placed.model, ref)
        what, worst = max(errs, key=lambda e: e[1])
        run.worst = max(run.worst, worst)
        if worst > TOLERANCE:
            run.verdict, run.detail = "WRONG", f"{what}: relative error {worst:.2e}"
            break
    run.first_s, run.later_s = times[0], min(times[1:], default=None)
    run.first_cpu_s, run.later_cpu_s = cpu[0], min(cpu[1:], default=None)
    if run.verdict == "OK":
        run.stage, run.step = "", None


@contextlib.contextmanager
def _recording(run: LoopRun) -> Iterator[None]:
    """decompshard's warnings during the run, into `run.warnings` (not printed), and
    the ops it ran replicated into `run.replicated`."""
    from decompshard.runtime.fallbacks import recording_fallbacks

    with warnings.catch_warnings(record=True) as caught, recording_fallbacks() as log:
        warnings.simplefilter("always")
        yield
    run.warnings = sorted({str(w.message) for w in caught if str(w.message).startswith("decompshard")})
    run.replicated = sorted(f"{f.op} ({f.kind})" for f in log.events)


def graph_collectives(kind: str, gm: torch.fx.GraphModule) -> str:
    """'forward: all_gather_into_tensor x2, all_reduce x1': the collectives (torch's
    functional collectives, waits left out) in one graph AOT autograd made."""
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        name = str(node.target)
        if node.op == "call_function" and "_c10d_functional" in name and "wait_tensor" not in name:
            op = name.split(".")[-2] if name.count(".") >= 2 else name
            counts[op] = counts.get(op, 0) + 1
    return f"{kind}: " + (", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) or "none")


def run_loop(parallelism: str, variant_name: str, enable: bool, steps: int = STEPS, sabotage: float = 0.0) -> LoopRun:
    """One run on this rank (in an initialized process group of 4): the loop with
    `enable()` on or off against one device. `sabotage`: the distributed run's learning
    rate is off by that fraction (the check must call it WRONG)."""
    from decompshard.check.zoo import LOOP_ENTRY, build
    from decompshard.runtime.enable import switched

    variant = VARIANTS[variant_name]
    run = LoopRun(parallelism, variant_name, "enable" if enable else "torch")
    base, mode = split_mode(parallelism)
    built = build(LOOP_ENTRY, BATCH, seed=0)
    lengths = _lengths(mode, steps)
    same_kernels = _loss_fn(built, mode, lambda kind, gm: None) if mode == "+inductor" else None
    refs = _reference(built, variant, lengths, same_kernels)
    with _recording(run), switched(enable):
        try:
            run.stage = "setup"
            placed = _place(base, built, copy.deepcopy(built.model))
            placed.loss = _loss_fn(built, mode, lambda kind, gm: run.graphs.append(graph_collectives(kind, gm)))
            _loop(run, placed, variant, refs, LR * (1 + sabotage), lengths, mode == "+mark_dynamic")
        except Exception as e:
            run.verdict, run.detail = "ERROR", _named(e)
    return run


def _loss_fn(built: Any, mode: str, see: Callable[[str, torch.fx.GraphModule], None]) -> Callable[..., Any]:
    """The model's loss (forward and loss), or it under `torch.compile` in `mode`
    (COMPILE_MODES; aot_eager, each graph shown to `see`, or inductor; dynamo's compiled
    code dropped first, so each run compiles afresh)."""
    from decompshard._compat import aot_eager_seeing, forget_compiled_code

    if not mode:
        return built.loss
    forget_compiled_code()
    if mode == "+inductor":
        return torch.compile(built.loss, backend="inductor", dynamic=True)
    dynamic = {"+compile": False, "+dynamic": True}.get(mode)  # None: torch's automatic dynamic
    return torch.compile(built.loss, backend=aot_eager_seeing(see), dynamic=dynamic)


def _named(e: BaseException) -> str:
    """The exception's first line; for one with no message (a bare `assert` in torch),
    also where it was raised."""
    import traceback

    text = one_line(e, 300)
    if str(e).strip():
        return text
    where = traceback.extract_tb(e.__traceback__)[-1]
    return f"{text} at {where.filename.split('site-packages/')[-1]}:{where.lineno} ({where.name}: {where.line})"


def _warm(runs: list[list]) -> None:
    """First-use costs paid before any timed step: one step of the first parallelism
    and variant on both paths (each path's imports and lazy initializations). Not under
    a compile mode: the first step's time is meant to include the compile, and two
    extra compiles of DTensor activations on a loaded machine cost minutes."""
    parallelism, variant = runs[0][0], runs[0][1]
    if split_mode(parallelism)[1]:
        return
    for on in (True, False):
        run_loop(parallelism, variant, on, steps=1)


def rank_main(rank: int, world: int, port: int, runs_path: str, out_dir: str, warm: bool = True) -> None:
    """A gloo rank: every run in `runs_path` (JSON [[parallelism, variant, enable,
    steps, sabotage], ...]) in order, one JSON line per finished run in rank<N>.jsonl."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    try:
        with open(runs_path) as f:
            runs = json.load(f)
        if warm and runs:
            _warm(runs)
        for parallelism, variant, enable, steps, sabotage in runs:
            run = run_loop(parallelism, variant, enable, steps, sabotage)
            with open(f"{out_dir}/rank{rank}.jsonl", "a") as f:
                f.write(json.dumps(asdict(run)) + "\n")
    finally:
        dist.destroy_process_group()
