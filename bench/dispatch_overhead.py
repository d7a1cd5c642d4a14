"""Per-call dispatch overhead of DTensor ops that only have a decomposition: decompshard
against torch 2.13's built-in fallback, in the same process and run.

Each op is called on small DTensors (fake process group, rank 0's shards: the local
compute is microseconds, so the call time is DTensor's dispatch and sharding
propagation). Placements are chosen so that both paths keep the inputs where they are
(checked: equal collective counts, zero here), so neither side is charged for moving data.

- cold: the first call after clearing every cache: decompshard.clear_caches(),
  torch._C._clear_DTensor_sharding_propagator_cache() and
  sharding_propagator().propagate_op_sharding.cache_clear(). For decompshard this is
  trace + derive + lift; for torch, its fallback re-running the decomposition per
  candidate placement.
- warm: a later call (DTensor's sharding caches hit; decompshard is not consulted).

Reported per op (median of --repeat cold calls, median of --calls warm calls) and as
ratios decompshard / torch (below 1: decompshard is faster), with their median over ops.
Usage: python bench/dispatch_overhead.py [--repeat 5] [--calls 200] [--mesh 4 | 2x2] [--strided]

--strided: warm per-call time of split / cat / slice of packed projections' blocks
(runtime/steering/strided_blocks.py: DTensor's answer overridden once per op schema, then cached)
against torch alone on the same shapes where its own answer is local too (the sharded dim
not the one split: no data moved on either side), and against torch alone on the
strided input itself (it all-gathers; the fake process group makes that cheap but not
free), each as a ratio in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

warnings.filterwarnings("ignore")
aten = torch.ops.aten


def cases():
    """(op, args builder, placements per tensor input); 1-D placements, extended with
    Replicate on further mesh dims."""
    from torch.distributed.tensor import Replicate, Shard

    R, S0 = Replicate(), Shard(0)
    r = lambda *s: torch.randn(*s)  # noqa: E731
    return [
        (aten.addmv.default, lambda: (r(16), r(16, 12), r(12)), [S0, S0, R]),
        (aten.addr.default, lambda: (r(16, 6), r(16), r(6)), [S0, S0, R]),
        (aten.pixel_shuffle.default, lambda: (r(8, 16, 3, 3), 2), [S0]),
        (aten.pixel_unshuffle.default, lambda: (r(8, 4, 6, 6), 2), [S0]),
        (aten.channel_shuffle.default, lambda: (r(8, 8, 3, 3), 2), [S0]),
        (aten.glu.default, lambda: (r(16, 6), -1), [S0]),
        (aten.mse_loss.default, lambda: (r(16, 6), r(16, 6)), [S0, S0]),
        (aten.l1_loss.default, lambda: (r(16, 6), r(16, 6)), [S0, S0]),
        (aten.soft_margin_loss.default, lambda: (r(16, 6), r(16, 6).sign()), [S0, S0]),
        (aten.binary_cross_entropy_with_logits.default, lambda: (r(16, 6), r(16, 6).sigmoid()), [S0, S0]),
        (aten.hinge_embedding_loss.default, lambda: (r(16, 6), r(16, 6).sign()), [S0, S0]),
        (aten.kl_div.default, lambda: (r(16, 6), r(16, 6)), [S0, S0]),
        (aten._prelu_kernel.default, lambda: (r(16, 6, 4), r(1, 6, 1)), [S0, R]),
        (aten.log_sigmoid_forward.default, lambda: (r(16, 6),), [S0]),
        (aten.hardswish_backward.default, lambda: (r(16, 6), r(16, 6)), [S0, S0]),
        (aten.glu_backward.default, lambda: (r(16, 3), r(16, 6), -1), [S0, S0]),
        (aten.mse_loss_backward.default, lambda: (r(()), r(16, 6), r(16, 6), 1), [R, S0, S0]),
        (aten.rot90.default, lambda: (r(16, 6), 1, [1, 0]), [S0]),
        (aten.smooth_l1_loss.default, lambda: (r(16, 6), r(16, 6), 0), [S0, S0]),
        (aten.huber_loss.default, lambda: (r(16, 6), r(16, 6), 0), [S0, S0]),
        (aten.renorm.default, lambda: (r(16, 6), 2, 0, 1.0), [S0]),  # torch: no strategy
        (aten.addbmm.default, lambda: (r(6, 8), r(16, 6, 5), r(16, 5, 8)), [R, S0, S0]),  # torch: none
    ]


def clear_all() -> None:
    import decompshard
    from decompshard._compat import sharding_propagator

    decompshard.clear_caches()
    torch._C._clear_DTensor_sharding_propagator_cache()
    sharding_propagator().propagate_op_sharding.cache_clear()


def dtensors(build, placements, mesh):
    from torch.distributed.tensor import DTensor, Replicate

    from decompshard.mesh.lift import local_shape_nd

    args, it = [], iter(placements)
    for a in build():
        if not isinstance(a, torch.Tensor):
            args.append(a)
            continue
        p = (next(it),) + (Replicate(),) * (mesh.ndim - 1)
        local = torch.empty(local_shape_nd(a.shape, p, tuple(mesh.shape), (0,) * mesh.ndim)).normal_()
        args.append(DTensor.from_local(local, mesh, p, run_check=False, shape=a.shape, stride=a.stride()))
    return args


def measure(op, args, repeat: int, calls: int) -> tuple[float, float, int] | None:
    """(cold seconds, warm seconds per call, collectives) or None if the call fails."""
    from torch.distributed.tensor.debug import CommDebugMode

    cold = []
    try:
        for _ in range(repeat):
            clear_all()
            t = time.perf_counter()
            op(*args)
            cold.append(time.perf_counter() - t)
        with CommDebugMode() as comm:
            op(*args)
        warm = []
        for _ in range(calls):
            t = time.perf_counter()
            op(*args)
            warm.append(time.perf_counter() - t)
    except Exception:  # torch's fallback has no strategy for some of these
        return None
    return statistics.median(cold), statistics.median(warm), comm.get_total_counts()


def _dt(shape, placement, local_shape, mesh):
    from torch.distributed.tensor import DTensor

    local = torch.randn(*local_shape)
    return DTensor.from_local(local, mesh, (placement,), run_check=False, shape=torch.Size(shape),
                              stride=torch.empty(shape, device="meta").stride())


def _warm(fn, calls: int) -> float:
    fn()
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def strided_cases(mesh):
    """(name, ours: strided call, torch's local twin: same shapes, other dim sharded).
    The last row is torch's own view with its size made local against a replicated view
    (no rewrite): what DTensor's local-argument path costs torch itself."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    n = mesh.size(0)
    packed = _dt((16, 48), _StridedShard(1, split_factor=3), (16, 48 // n), mesh)  # q, k, v blocks of 16
    rows = _dt((16, 48), Shard(0), (16 // n, 48), mesh)
    whole = _dt((16, 48), Replicate(), (16, 48), mesh)
    blocks = [_dt((16, 16), Shard(1), (16, 16 // n), mesh) for _ in range(3)]
    row_blocks = [_dt((16, 16), Shard(0), (16 // n, 16), mesh) for _ in range(3)]
    return [
        ("split.Tensor", lambda: packed.split(16, 1), lambda: rows.split(16, 1)),
        ("cat", lambda: torch.cat(blocks, 1), lambda: torch.cat(row_blocks, 1)),
        ("slice (a block)", lambda: packed[:, 16:32], lambda: rows[:, 16:32]),
        ("split + cat", lambda: torch.cat(packed.split(16, 1), 1), lambda: torch.cat(rows.split(16, 1), 1)),
        # torch's own local-argument rewrite (a view of a shard: its size made local), for scale
        ("(torch's own) view, size made local", lambda: rows.view(16, 3, 16), lambda: whole.view(16, 3, 16)),
    ]


def strided_main(mesh, calls: int) -> None:
    """Rows of warm µs per call: ours, torch's local twin, torch alone on the strided input."""
    from tabulate import tabulate

    import decompshard

    rows, ratios = [], []
    for name, ours, twin in strided_cases(mesh):
        decompshard.disable()
        t_twin, t_gather = _warm(twin, calls), _warm(ours, calls)
        decompshard.enable()
        t_ours, t_twin_on = _warm(ours, calls), _warm(twin, calls)
        decompshard.disable()
        if not name.startswith("("):
            ratios.append(t_ours / t_twin)
        rows.append([name, f"{t_twin * 1e6:.0f}", f"{t_ours * 1e6:.0f}", f"{t_ours / t_twin:.2f}",
                     f"{t_twin_on / t_twin:.2f}", f"{t_gather * 1e6:.0f}", f"{t_ours / t_gather:.2f}"])
    print(f"mesh {tuple(mesh.shape)} (fake process group), median of {calls} warm calls")
    print(tabulate(rows, headers=["op", "torch local twin µs", "ours µs", "ours / twin", "twin on / off",
                                  "torch on strided µs (gathers)", "ours / torch on strided"]))
    print(f"\nmedian ratio ours / torch's local twin: {statistics.median(ratios):.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="cold calls per op and path")
    parser.add_argument("--calls", type=int, default=200, help="warm calls per op and path")
    parser.add_argument("--mesh", default="4", help="mesh shape, e.g. 4 or 2x2")
    parser.add_argument("--strided", action="store_true", help="split / cat of strided blocks (see above)")
    args = parser.parse_args(argv)

    import torch.distributed as dist
    from tabulate import tabulate
    from torch.distributed.device_mesh import DeviceMesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import decompshard
    from decompshard._compat import has_native_strategy
    from decompshard.runtime.derived import DerivedStrategy

    shape = tuple(int(x) for x in args.mesh.split("x"))
    world = 1
    for s in shape:
        world *= s
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    mesh = DeviceMesh("cpu", torch.arange(world).view(*shape))
    torch.manual_seed(0)
    torch.set_num_threads(1)  # tiny kernels: a thread pool on a busy machine only adds noise
    if args.strided:
        strided_main(DeviceMesh("cpu", torch.arange(world)), args.calls)
        dist.destroy_process_group()
        return 0
    rows, cold_ratios, warm_ratios = [], [], []
    seen: set = set()
    real = DerivedStrategy.propagate_strategy
    DerivedStrategy.propagate_strategy = lambda self, schema: seen.add(schema.op) or real(self, schema)
    for op, build, placements in cases():
        if has_native_strategy(op):  # never reaches either fallback: nothing to compare
            continue
        dargs = dtensors(build, placements, mesh)
        decompshard.disable()
        theirs = measure(op, dargs, args.repeat, args.calls)
        decompshard.enable()
        seen.clear()
        ours = measure(op, dargs, args.repeat, args.calls)
        decompshard.disable()
        if op not in seen:  # CompositeImplicit: decomposed before DTensor sees it
            continue
        if ours is None:
            rows.append([str(op), "error", "", "error", "", "", ""])
            continue
        if theirs is None:
            rows.append([str(op), "error", f"{ours[0] * 1e3:.2f}", "", f"{ours[1] * 1e6:.0f}", "", "torch: no strategy"])
            continue
        note = "" if theirs[2] == ours[2] else f"collectives {theirs[2]} vs {ours[2]}: not compared"
        rc, rw = ours[0] / theirs[0], ours[1] / theirs[1]
        if not note:
            cold_ratios.append(rc)
            warm_ratios.append(rw)
        rows.append([str(op), f"{theirs[0] * 1e3:.2f}", f"{ours[0] * 1e3:.2f}", f"{theirs[1] * 1e6:.0f}",
                     f"{ours[1] * 1e6:.0f}", f"{rc:.2f} / {rw:.2f}", note])
    print(f"mesh {args.mesh} (fake process group), median of {args.repeat} cold and {args.calls} warm calls")
    print(tabulate(rows, headers=["op", "torch cold ms", "ours cold ms", "torch warm µs", "ours warm µs",
                                  "ratio cold / warm", "note"]))
    if cold_ratios:
        print(f"\nmedian ratio decompshard / torch over {len(cold_ratios)} ops: "
              f"cold {statistics.median(cold_ratios):.2f}, warm {statistics.median(warm_ratios):.2f} "
              f"(below 1: decompshard faster)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
