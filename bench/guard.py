"""What the native guard (on by default with `enable()`) costs a training step.

Each model runs one training step (forward, loss, backward) on 4 simulated ranks
(LocalTensorMode, fake process group, float64) under `enable()` with the guard on and
with it off (`enable(guard_native=False)`), in the same process, interleaved (the order
alternates per repeat), after a warm-up round that is not counted:

- first: the first step after clearing every cache (decompshard's derivations and
  verdicts, DTensor's sharding caches): what a new process pays on its first step;
- warm: the median of the next --warm steps (caches hit).

Times are this process's CPU time (one intra-op thread; --wall for wall-clock time,
noisier where other jobs share the cores). Reported per model: the median of each over
--repeat repeats, and the ratio guard on / guard off of the medians (1.00: free). A model that cannot run with the guard off
(ResNet with a data-parallel batch stops at DTensor's conv handler) is timed with the
guard only.

Models: a tiny torchvision ResNet (BasicBlock, one block per stage, 16x16 images, batch
8) with the batch replicated (both run) and on Shard(0) (guard only); a tiny
transformers Llama (2 layers, hidden 32, vocab 128, sequence 8, batch 8) with the
batch on Shard(0).
With --ops: the warm per-call cost of each guarded op (convolution and its backward,
batch norm in training, on a sharded and a replicated batch, nll_loss), guard on vs off.

Measured here (2 shared cores, CPU time): per call, convolution +30 us (+8%), its
backward +50 us (+5%), batch norm and nll_loss within 2%; training steps, first and
warm, equal within the noise (ratios 0.87-1.14 over three runs of 7 repeats).
Usage: python bench/guard.py [--repeat 5] [--warm 3] [--models resnet-R,resnet-DP,llama-DP] [--raw] [--wall]
       python bench/guard.py --ops [--repeat 5] [--calls 200]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore")
W = 4
CLOCK = time.process_time  # --wall: time.perf_counter


def _resnet() -> tuple[torch.nn.Module, Callable[[torch.nn.Module, list], torch.Tensor], list[torch.Tensor]]:
    from decompshard.check.ecosystem import import_torchvision

    tv = import_torchvision()
    torch.manual_seed(0)
    model = tv.models.resnet.ResNet(tv.models.resnet.BasicBlock, [1, 1, 1, 1], num_classes=5)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 3, 16, 16, dtype=torch.float64, generator=g)
    y = torch.randint(0, 5, (8,), generator=g)
    return model, lambda m, a: F.cross_entropy(m(a[0]), a[1]), [x, y]


def _llama() -> tuple[torch.nn.Module, Callable[[torch.nn.Module, list], torch.Tensor], list[torch.Tensor]]:
    from decompshard.check.ecosystem import import_torchvision

    import_torchvision()  # transformers imports it
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (8, 8), generator=g)
    pos = torch.arange(8).expand(8, 8).contiguous()
    return model, lambda m, a: m(input_ids=a[0], position_ids=a[1], labels=a[0], use_cache=False).loss, [ids, pos]


MODELS: dict[str, tuple[Callable, bool]] = {  # name -> (builder, batch sharded)
    "resnet-R": (_resnet, False),
    "resnet-DP": (_resnet, True),
    "llama-DP": (_llama, True),
}


def _distribute(model: torch.nn.Module, mesh: Any) -> torch.nn.Module:
    """Every parameter and buffer replicated, each simulated rank with its own buffers."""
    from torch.distributed._local_tensor import LocalTensor
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    m = copy.deepcopy(model).to(torch.float64)
    for name, p in list(m.named_parameters()):
        *path, leaf = name.split(".")
        mod = m.get_submodule(".".join(path))
        setattr(mod, leaf, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
    for name, b in list(m.named_buffers()):
        *path, leaf = name.split(".")
        mod = m.get_submodule(".".join(path))
        d = distribute_tensor(b.detach(), mesh, [Replicate()])
        local = LocalTensor({r: d._local_tensor.clone() for r in range(W)})
        mod._buffers[leaf] = DTensor.from_local(local, mesh, [Replicate()], run_check=False)
    return m


def _clear_all() -> None:
    import decompshard
    from decompshard._compat import clear_dtensor_caches

    decompshard.clear_caches()
    clear_dtensor_caches()


def measure(name: str, guard: bool, warm: int, mesh: Any) -> tuple[float, float] | str:
    """(first step seconds, median warm step seconds), or the error with this setting."""
    from decompshard.errors import one_line

    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import decompshard

    builder, sharded = MODELS[name]
    model, loss_fn, inputs = builder()
    decompshard.disable()  # a fresh guard: no verdict kept from the other setting
    decompshard.enable(guard_native=guard)
    _clear_all()
    with LocalTensorMode(W):
        m = _distribute(model, mesh)
        args = [distribute_tensor(a, mesh, [Shard(0) if sharded else Replicate()]) for a in inputs]
        times = []
        try:
            for _ in range(1 + warm):
                for p in m.parameters():
                    p.grad = None
                t = CLOCK()
                loss_fn(m, args).backward()
                times.append(CLOCK() - t)
        except Exception as e:
            return one_line(e, 80)
        finally:
            decompshard.disable()
    return times[0], statistics.median(times[1:])


def op_cases() -> dict[str, Callable[[Any], Callable[[], Any]]]:
    """Per-call cost of the guarded ops, small enough that dispatch dominates: name ->
    (mesh -> a call). Layouts both settings run: convolution on a batch-sharded input
    (the guard passes it through), batch norm in training (the guard writes the moved
    statistics back), nll_loss (its table entry is wrapped; a warm call hits DTensor's
    cache)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    aten = torch.ops.aten
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, dtype=torch.float64, generator=g)  # noqa: E731
    x, w, b = r(8, 4, 6, 6), r(4, 4, 3, 3), r(4)
    go = r(8, 4, 6, 6)
    bx = r(8, 64, 2, 2)  # 64 channels: DTensor shards them, so the statistics move and come back
    logp, tgt = r(8, 5).log_softmax(1), torch.randint(0, 5, (8,), generator=g)

    def conv(mesh):
        d = [distribute_tensor(t, mesh, [p]) for t, p in ((x, Shard(0)), (w, Replicate()), (b, Replicate()))]
        return lambda: aten.convolution.default(*d, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)

    def conv_backward(mesh):
        d = [distribute_tensor(t, mesh, [p]) for t, p in ((go, Shard(0)), (x, Shard(0)), (w, Replicate()))]
        return lambda: aten.convolution_backward.default(*d, [4], [1, 1], [1, 1], [1, 1], False, [0, 0], 1,
                                                         [True, True, True])

    def batch_norm(mesh):
        d = [distribute_tensor(t, mesh, [Shard(0) if i == 0 else Replicate()])
             for i, t in enumerate((bx, r(64), r(64), r(64), r(64).abs() + 0.5))]
        return lambda: aten.native_batch_norm.default(*d, True, 0.1, 1e-5)

    def batch_norm_replicated(mesh):  # nothing moves: DTensor's C++ path against the guard's handler
        d = [distribute_tensor(t, mesh, [Replicate()]) for t in (bx, r(64), r(64), r(64), r(64).abs() + 0.5)]
        return lambda: aten.native_batch_norm.default(*d, True, 0.1, 1e-5)

    def nll(mesh):
        d = [distribute_tensor(t, mesh, [Shard(0)]) for t in (logp, tgt)]
        return lambda: aten.nll_loss_forward.default(*d, None, 1, -100)

    return {"convolution": conv, "convolution_backward": conv_backward, "native_batch_norm": batch_norm,
            "native_batch_norm R": batch_norm_replicated, "nll_loss_forward": nll}


def measure_op(name: str, guard: bool, calls: int, mesh: Any) -> float:
    """Median seconds per call of the op, warm (after 3 calls)."""
    from torch.distributed._local_tensor import LocalTensorMode

    import decompshard

    decompshard.disable()
    decompshard.enable(guard_native=guard)
    try:
        with LocalTensorMode(W):
            call = op_cases()[name](mesh)
            for _ in range(3):
                call()
            times = []
            for _ in range(calls):
                t = CLOCK()
                call()
                times.append(CLOCK() - t)
    finally:
        decompshard.disable()
    return statistics.median(times)


def main_ops(a: argparse.Namespace, mesh: Any) -> None:
    names = list(op_cases())
    got: dict[tuple[str, bool], list[float]] = {(n, g): [] for n in names for g in (True, False)}
    for rep in range(a.repeat):
        for name in names:
            for guard in ((True, False) if rep % 2 == 0 else (False, True)):
                got[(name, guard)].append(measure_op(name, guard, a.calls, mesh))
    clock = "wall" if CLOCK is time.perf_counter else "CPU"
    print(f"per call, {W} simulated ranks, {clock} µs, median of {a.repeat} interleaved repeats of the median of "
          f"{a.calls} warm calls")
    print(f"{'op':<22} {'guard on':>9} {'guard off':>9} {'ratio':>6}")
    for name in names:
        on, off = statistics.median(got[(name, True)]), statistics.median(got[(name, False)])
        print(f"{name:<22} {on * 1e6:>9.0f} {off * 1e6:>9.0f} {on / off:>6.2f}")


def main(argv: list[str] | None = None) -> None:
    from decompshard.verify.dtensor_case import device_mesh, simulated_world

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warm", type=int, default=3)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--raw", action="store_true", help="also every repeat's times")
    ap.add_argument("--wall", action="store_true", help="wall-clock time (default: this process's CPU time, "
                    "steadier on a shared machine; the kernel sandbox's child process is not counted)")
    ap.add_argument("--ops", action="store_true", help="per-call cost of the guarded ops instead of model steps")
    ap.add_argument("--calls", type=int, default=200, help="warm calls per op and repeat (--ops)")
    a = ap.parse_args(argv)
    global CLOCK
    CLOCK = time.perf_counter if a.wall else time.process_time
    if a.ops:
        torch.set_num_threads(1)
        with simulated_world(W):
            main_ops(a, device_mesh((W,)))
        return
    names = a.models.split(",")
    torch.set_num_threads(1)
    with simulated_world(W):
        mesh = device_mesh((W,))
        for name in names:  # warm-up round: imports, lazy modules, the kernel sandbox
            for guard in (True, False):
                measure(name, guard, 1, mesh)
        got: dict[tuple[str, bool], list] = {(n, g): [] for n in names for g in (True, False)}
        for rep in range(a.repeat):
            for name in names:
                for guard in ((True, False) if rep % 2 == 0 else (False, True)):
                    got[(name, guard)].append(measure(name, guard, a.warm, mesh))
    if a.raw:
        for key, runs in got.items():
            print(key, [r if isinstance(r, str) else (round(r[0], 3), round(r[1], 3)) for r in runs])
    print(f"{W} simulated ranks, float64, {'wall' if a.wall else 'CPU'} seconds, medians of {a.repeat} "
          f"interleaved repeats (warm: median of {a.warm} steps each)")
    print(f"{'model':<11} {'first on':>9} {'first off':>9} {'ratio':>6} {'warm on':>9} {'warm off':>9} {'ratio':>6}")
    for name in names:
        row = []
        for guard in (True, False):
            runs = got[(name, guard)]
            errors = [r for r in runs if isinstance(r, str)]
            row.append(errors[0] if errors else (statistics.median(r[0] for r in runs),
                                                 statistics.median(r[1] for r in runs)))
        on, off = row
        if isinstance(on, str):
            print(f"{name:<11} guard on failed: {on}")
            continue
        if isinstance(off, str):
            print(f"{name:<11} {on[0]:>8.3f}s {'-':>9} {'-':>6} {on[1]:>8.3f}s {'-':>9} {'-':>6}   (off: {off})")
            continue
        print(f"{name:<11} {on[0]:>8.3f}s {off[0]:>8.3f}s {on[0] / off[0]:>6.2f} "
              f"{on[1]:>8.3f}s {off[1]:>8.3f}s {on[1] / off[1]:>6.2f}")


if __name__ == "__main__":
    main()
