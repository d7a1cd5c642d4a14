"""Run verify/dtensor_case cases on real gloo processes (used by tests/test_check_gloo.py).

Each process builds its own rank's inputs (the same numbers LocalTensorMode simulates),
runs the case through DTensor with real collectives and judges its own rank; the parent
combines the verdicts and compares them with the simulated run of the same cases.
"""

from __future__ import annotations

import json
import pickle


def worker(rank: int, world: int, port: int, cases_path: str, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from decompshard.runtime.enable import switched
    from decompshard.verify.dtensor_case import parse_placements, run_case

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    out = []
    try:
        with open(cases_path, "rb") as f:
            cases = pickle.load(f)
        for op_name, args, kwargs, mesh, text, seed, on in cases:
            op = eval(op_name, {"aten": torch.ops.aten})
            shapes = [tuple(t.shape) for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            o = run_case(op, args, kwargs, mesh, parse_placements(text, shapes, len(mesh)), seed=seed,
                         runtime=switched(on), simulate=False)
            out.append([o.status, o.stage, o.detail])
    except Exception as e:  # reported, so the parent's assertion says what broke
        out.append(["crash", "", f"{type(e).__name__}: {e}"])
    finally:
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()


def compile_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Mean-loss training steps compiled once with dynamic shapes and run at an even
    batch (12 rows on 3 ranks: the [even] P(avg) rule holds there, behind a guard) and
    then at an uneven one (10 rows: it would be a mean of unequal means): loss and weight
    gradient against one device at each size."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import decompshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    out = {}
    try:
        mesh = init_device_mesh("cpu", (world,))
        for name, loss_fn in [("mse", F.mse_loss), ("smooth_l1", F.smooth_l1_loss), ("huber", F.huber_loss),
                              ("bce_with_logits", lambda a, b: F.binary_cross_entropy_with_logits(a, b.sigmoid()))]:
            def step(xd, wd, yd):
                return loss_fn(xd @ wd, yd)

            with decompshard.enabled():
                torch._dynamo.reset()
                compiled = torch.compile(step, backend="aot_eager", dynamic=True)
                for n in (12, 10):
                    g = torch.Generator().manual_seed(n)
                    x, y, w = (torch.randn(n, 4, generator=g, dtype=torch.float64),
                               torch.randn(n, 3, generator=g, dtype=torch.float64),
                               torch.randn(4, 3, generator=g, dtype=torch.float64))
                    wr = w.clone().requires_grad_()
                    ref = loss_fn(x @ wr, y)
                    ref.backward()
                    wd = distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
                    xd, yd = distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Shard(0)])
                    loss = compiled(xd, wd, yd)
                    loss.backward()
                    out[f"{name}@{n}"] = {"loss_err": float((loss.full_tensor() - ref).abs()),
                                          "grad_err": float((wd.grad.full_tensor() - wr.grad).abs().max())}
    except Exception as e:
        out["crash"] = f"{type(e).__name__}: {e}"
    finally:
        with open(f"{out_dir}/compile{rank}.json", "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()


def hang(rank: int) -> None:
    """A rank stuck for good (a collective whose peer never comes): for the spawner's tests."""
    import threading

    threading.Event().wait()


def exit_with(rank: int, code: int) -> None:
    """Rank 1 dies with `code`; the others hang: for the spawner's tests."""
    import os

    if rank == 1:
        os._exit(code)
    hang(rank)


def spawn(fn, args: tuple, nprocs: int, deadline: float = 420.0, hash_seeds: list[int] | None = None) -> None:
    """Start `fn(rank, *args)` in `nprocs` fresh interpreters and wait, with a deadline: a
    hung collective fails the test instead of hanging CI.

    `hash_seeds` gives each process its own PYTHONHASHSEED (the default: Python picks a
    random one per process, as on a real cluster). Pinning them equal hides a strategy
    choice that depends on set iteration order; making them differ on purpose exposes
    one, because ranks that choose differently run mismatched collectives (gloo aborts
    with "Received data size doesn't match expected size")."""
    import multiprocessing
    import os

    from decompshard.check.loop_run import await_ranks

    # Fresh interpreters (spawn) each import torch, decompshard and the models: most of a
    # gloo test's time on a 2-core machine. Forked from a server that imported torch and
    # decompshard once, a process starts in milliseconds. Distinct hash seeds need fresh
    # interpreters (a forked child keeps its server's seed).
    if hash_seeds is None and "forkserver" in multiprocessing.get_all_start_methods():
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "decompshard", "decompshard.workers"])
    else:
        ctx = multiprocessing.get_context("spawn")
    procs = []
    saved = os.environ.get("PYTHONHASHSEED")
    try:
        for rank in range(nprocs):
            if hash_seeds is not None:
                os.environ["PYTHONHASHSEED"] = str(hash_seeds[rank])
            p = ctx.Process(target=fn, args=(rank, *args))
            p.start()  # the child's environment is copied here, seed included
            procs.append(p)
    finally:
        if saved is None:
            os.environ.pop("PYTHONHASHSEED", None)
        else:
            os.environ["PYTHONHASHSEED"] = saved
    why = await_ranks(procs, deadline)
    if why:
        raise (TimeoutError if "still running" in why else RuntimeError)(why)
