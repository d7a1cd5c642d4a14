"""The convolution cases DTensor (torch 2.13) gets wrong, run forward and backward on a
1-D mesh of 4: shared by tests/test_native_guard.py under LocalTensorMode and on 4 gloo
processes.

- conv1d / conv2d with the weight (and bias) on Shard(0), the out-channels, and a
  replicated input: the custom handler skips the all-gather its strategy asks for, so
  each rank convolves with a quarter of the filters and the result says Replicate().
- conv2d with a Shard(1) (channel) input: the handler hands the local kernel a quarter
  of the channels, and the kernel raises.
- the same layouts where the weight outweighs the activations, which the guard runs
  channel-parallel (output Shard(1); rowwise: the partial sums all-reduced).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

W = 4


@dataclass
class Case:
    name: str
    fn: Callable
    shapes: list[tuple[int, ...]]
    placements: list[str]  # "R" or "S<d>" per input


CASES = [
    Case("conv1d out-channels", F.conv1d, [(2, 3, 10), (8, 3, 3), (8,)], ["R", "S0", "S0"]),
    Case("conv2d out-channels", F.conv2d, [(2, 3, 6, 6), (8, 3, 3, 3), (8,)], ["R", "S0", "S0"]),
    Case("conv2d channel-sharded input", F.conv2d, [(2, 8, 6, 6), (4, 8, 3, 3)], ["S1", "R"]),
    # weights larger than the activations: run channel-parallel on the shards
    # (runtime/plans/conv_channels.py), no weight all-gather; here on real collectives too
    Case("conv2d colwise, large weight", F.conv2d, [(2, 8, 3, 3), (32, 8, 3, 3), (32,)], ["R", "S0", "S0"]),
    Case("conv2d rowwise with bias, large weight", F.conv2d, [(2, 32, 3, 3), (8, 32, 3, 3), (8,)], ["S1", "S1", "R"]),
]


# Wrong rules in DTensor's tables (guard_table.WRONG_RULES): (name, op, args, input
# placements on a mesh of W). Each is wrong without the guard and right with it.
def rule_cases():
    aten = torch.ops.aten
    g = torch.Generator().manual_seed(5)
    logp = torch.randn(8, 3, dtype=torch.float64, generator=g).log_softmax(1)
    return [
        ("any of a P(sum) that sums to zero", aten.any.default, (torch.zeros(3, 5, dtype=torch.float64),), ["P"]),
        ("threshold with value > threshold on P(max)", aten.threshold.default,
         (torch.randn(5, 5, dtype=torch.float64, generator=g), 0.5, 2.0), ["Pmax"]),
        ("class-weighted nll_loss mean on a sharded batch", aten.nll_loss_forward.default,
         (logp, torch.tensor([0, 1, 2, 1, 0, 0, 2, 1]), torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64), 1, -100),
         ["S0", "S0", "R"]),
    ]


def run_rule_case(op, args, placements: list[str], mesh) -> bool:
    """On real processes (gloo): whether DTensor's result equals one device's. (Under
    LocalTensorMode use decompshard.verify.native_rules.run_on_dtensor: rank-dependent parts
    cannot be written with an `if rank == 0` there.)"""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    ref = op(*args)
    ref = ref if isinstance(ref, tuple) else (ref,)
    dargs, it = [], iter(placements)
    for a in args:
        if not isinstance(a, torch.Tensor):
            dargs.append(a)
            continue
        p = next(it)
        if p.startswith("P"):  # P(sum): [2x + 1, -x - 1, 0, ...]; P(max): x on rank 0, less elsewhere
            op_name = "sum" if p == "P" else p[1:]
            d = distribute_tensor(a, mesh, [Replicate()])
            local = d.to_local()
            rank = mesh.get_local_rank()
            if op_name == "sum":
                local = local * 2 + 1 if rank == 0 else (-local - 1 if rank == 1 else torch.zeros_like(local))
            else:  # max: every rank but 0 holds something smaller
                local = local if rank == 0 else local - 1.0 - rank
            dargs.append(DTensor.from_local(local, mesh, [Partial(op_name)], run_check=False))
        else:
            dargs.append(distribute_tensor(a, mesh, [Replicate() if p == "R" else Shard(int(p[1:]))]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = op(*dargs)
    out = out if isinstance(out, tuple) else (out,)
    ok = True
    for o, r in zip(out, ref):
        full = o.full_tensor()
        lt = getattr(full, "_local_tensors", None)
        for f in (lt.values() if lt is not None else [full]):
            ok &= f.shape == r.shape and bool(torch.allclose(f, r))
    return ok


def batch_norm_stats_right(mesh) -> bool:
    """Batch norm in training, batch Shard(0), 64 channels (DTensor shards them and moves
    the replicated running statistics to Shard(0)): whether this process's running
    statistics after the step equal one device's (guard_batchnorm.py)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, 4, 4, dtype=torch.float64, generator=g)
    stats = [torch.zeros(64, dtype=torch.float64), torch.ones(64, dtype=torch.float64)]
    ref = [t.clone() for t in stats]
    torch.ops.aten.native_batch_norm.default(x, None, None, *ref, True, 0.1, 1e-5)
    d = [distribute_tensor(t, mesh, [Replicate()]) for t in stats]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.ops.aten.native_batch_norm.default(distribute_tensor(x, mesh, [Shard(0)]), None, None, *d, True, 0.1, 1e-5)
    return all(bool(torch.allclose(a.to_local(), b)) for a, b in zip(d, ref))


def inputs(case: Case) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, dtype=torch.float64, generator=gen) for s in case.shapes]


def reference(case: Case) -> tuple[torch.Tensor, list[torch.Tensor]]:
    xs = [x.requires_grad_() for x in inputs(case)]
    out = case.fn(*xs)
    (out * out).sum().backward()
    return out.detach(), [x.grad for x in xs]


def _placement(p: str):
    from torch.distributed.tensor import Replicate, Shard

    return Replicate() if p == "R" else Shard(int(p[1:]))


def run(case: Case, mesh, xs: list[torch.Tensor]) -> tuple[torch.Tensor | None, list[torch.Tensor], str]:
    """(full output, full input gradients, error) through DTensor on the plain inputs `xs`
    (made outside LocalTensorMode: under it, random draws differ); values are each
    rank's copies (LocalTensorMode: dicts by rank) or this process's (gloo)."""
    from torch.distributed.tensor import distribute_tensor

    def full(t):
        t = t.full_tensor()
        lt = getattr(t, "_local_tensors", None)
        return t if lt is None else dict(lt)

    try:  # warnings pass through: the guard's one-time warning is checked
        xs = [distribute_tensor(x, mesh, [_placement(p)]).requires_grad_() for x, p in zip(xs, case.placements)]
        out = case.fn(*xs)
        (out * out).sum().backward()
        return full(out), [full(x.grad) for x in xs], ""
    except Exception as e:
        return None, [], f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def gloo_worker(rank: int, port: int, out_dir: str, guard: bool) -> None:
    """One of 4 processes: every case with real gloo collectives; writes a verdict per case."""
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import decompshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=W, init_method=f"tcp://127.0.0.1:{port}")
    report = {}
    try:
        mesh = init_device_mesh("cpu", (W,))
        for name, op, args, placements in rule_cases():  # wrong without the guard, right with it
            report[f"unguarded {name}"] = run_rule_case(op, args, placements, mesh)
            decompshard.enable(guard_native=True)
            report[f"guarded {name}"] = run_rule_case(op, args, placements, mesh)
            decompshard.disable()
        report["unguarded batch norm running stats"] = batch_norm_stats_right(mesh)
        decompshard.enable(guard_native=True)
        report["guarded batch norm running stats"] = batch_norm_stats_right(mesh)
        decompshard.disable()
        decompshard.enable(guard_native=guard)
        for case in CASES:
            ref_out, ref_grads = reference(case)
            out, grads, err = run(case, mesh, inputs(case))
            report[case.name] = {
                "error": err,
                "output_ok": out is not None and out.shape == ref_out.shape and bool(torch.allclose(out, ref_out)),
                "grads_ok": [g.shape == r.shape and bool(torch.allclose(g, r)) for g, r in zip(grads, ref_grads)],
            }
    except Exception as e:
        report["__error__"] = f"{type(e).__name__}: {e}"
    finally:
        decompshard.disable()
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()
