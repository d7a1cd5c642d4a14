"""Per-call cost of the ops `enable()` takes off DTensor's own path: collective plans
(softmax / log_softmax / layer norm over a sharded dim, vocab-parallel nll_loss,
SyncBatchNorm's plan) and handlers (channel-parallel convolution), each against torch
alone on the same DTensors, in the same process and run.

A plan or handler is Python on DTensor's custom-handler path, where torch's own strategy
goes through its cached (C++ where it has one) dispatch: the price of moving less. On a
fake process group the collectives cost nothing, so what is timed is the dispatch and
the local kernels (warm: the median of --calls calls, caches hot); the bytes column is
what each side would move on real ranks (CommBytes). Read the ratio with the bytes: a
plan that costs 2x torch's per-call time and moves 1/50 of its bytes wins wherever a
byte costs more than a few nanoseconds.

Usage: python bench/handler_dispatch.py [--calls 200] [--world 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
warnings.filterwarnings("ignore")


def cases() -> list[tuple[str, callable, list]]:
    """(label, call on DTensors, [(global tensor, placement)]): each one a plan or handler
    takes under enable() (checked by the bytes differing from torch alone's)."""
    from torch.distributed.tensor import Replicate, Shard

    F = torch.nn.functional
    r = lambda *s: torch.randn(*s)  # noqa: E731
    R = Replicate()
    return [
        ("softmax over a sharded dim [64, 512] S(1)", lambda x: torch.softmax(x, -1), [(r(64, 512), Shard(1))]),
        ("log_softmax over a sharded dim", lambda x: torch.log_softmax(x, -1), [(r(64, 512), Shard(1))]),
        ("layer_norm over a sharded hidden [64, 512] S(1)",
         lambda x, w, b: F.layer_norm(x, (512,), w, b), [(r(64, 512), Shard(1)), (r(512), Shard(0)), (r(512), Shard(0))]),
        ("nll_loss, vocab-sharded log-probs [64, 1000] S(1)",
         lambda x, t: F.nll_loss(x, t), [(r(64, 1000).log_softmax(-1), Shard(1)), (torch.randint(0, 1000, (64,)), R)]),
        ("batch_norm (training), batch-sharded [16, 32, 8, 8] S(0)",
         lambda x, w, b: F.batch_norm(x, None, None, w, b, training=True),
         [(r(16, 32, 8, 8), Shard(0)), (r(32), R), (r(32), R)]),
        # torch alone's handler skips the weight's move here: its time is of a wrong result
        ("conv2d, colwise weight [128, 64, 3, 3] S(0) (torch alone: wrong values)",
         lambda x, w: F.conv2d(x, w, padding=1), [(r(2, 64, 8, 8), R), (r(128, 64, 3, 3), Shard(0))]),
    ]


def measure(call, args, calls: int) -> tuple[float, int] | None:
    """(warm seconds per call, bytes moved by one call) or None if the call fails."""
    from decompshard.dispatch_modes.comm_bytes import CommBytes

    try:
        call(*args)
        with CommBytes() as comm:
            call(*args)
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            call(*args)
            times.append(time.perf_counter() - t)
    except Exception as e:  # noqa: BLE001 - reported as a row
        print(f"  failed: {type(e).__name__}: {str(e)[:120]}")
        return None
    return statistics.median(times), comm.bytes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200, help="warm calls per op and path")
    parser.add_argument("--world", type=int, default=4, help="ranks of the 1-D mesh")
    args = parser.parse_args(argv)

    import torch.distributed as dist
    from tabulate import tabulate
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import decompshard

    dist.init_process_group("fake", rank=0, world_size=args.world, store=FakeStore())
    mesh = DeviceMesh("cpu", torch.arange(args.world))
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rows, ratios = [], []
    for label, call, inputs in cases():
        dargs = [distribute_tensor(t, mesh, [p]) for t, p in inputs]
        decompshard.disable()
        theirs = measure(call, dargs, args.calls)
        decompshard.enable()
        ours = measure(call, dargs, args.calls)
        decompshard.disable()
        if theirs is None or ours is None:
            rows.append([label, "error" if theirs is None else "", "error" if ours is None else "", "", "", ""])
            continue
        ratios.append(ours[0] / theirs[0])
        rows.append([label, f"{theirs[0] * 1e6:.0f}", f"{ours[0] * 1e6:.0f}", f"{ratios[-1]:.2f}",
                     f"{theirs[1]:,}", f"{ours[1]:,}"])
    print(f"torch {torch.__version__}, 1-D mesh of {args.world} (fake process group), "
          f"median of {args.calls} warm calls")
    print(tabulate(rows, headers=["op", "torch µs", "enable() µs", "ratio", "torch bytes", "enable() bytes"]))
    if ratios:
        print(f"\nper-call time enable() / torch alone: median {statistics.median(ratios):.2f}, "
              f"range {min(ratios):.2f}-{max(ratios):.2f} over {len(ratios)} ops")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
