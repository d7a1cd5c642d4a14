"""Run verify_dtensor cases on real gloo processes (used by tests/test_check_gloo.py).

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

    from decompshard.verify_dtensor import parse_placements, run_case

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
                         use_decompshard=on, simulate=False)
            out.append([o.status, o.stage, o.detail])
    except Exception as e:  # reported, so the parent's assertion says what broke
        out.append(["crash", "", f"{type(e).__name__}: {e}"])
    finally:
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(out, f)
        dist.destroy_process_group()
