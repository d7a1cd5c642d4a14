"""Per-collective breakdown of one zoo case's training step (issue 28): every collective
with its kind, the bytes a rank puts in (comm_bytes.py's unit, as the zoo counts), the
local shape, the aten op in flight and that op's input placements, then the totals per
(kind, op). The zoo's table says how much moves; this says what and why.

A mode above DTensor names the op in flight; CommBytes below it sees the collectives
DTensor turns that op into. Collectives outside any aten op on DTensors (a module hook's
redistribute, the step's gradient redistributions) name the functional collective as
the op, where the mode sees it, or say they are outside one.

Usage: python bench/comm_breakdown.py MODEL SHARDING [--torch-alone] [--totals-only] [--warm 3]
"""

from __future__ import annotations

import argparse
import collections
import copy
import math
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _text(t) -> str:
    short = {"Replicate()": "R", "Partial(sum)": "P"}
    return "".join(short.get(str(p), str(p).replace("Shard", "S")) for p in t.placements) + str(list(t.shape))


def _modes():
    import torch
    from torch.distributed.tensor import DTensor

    from decompshard._compat import TorchDispatchMode, tree_leaves
    from decompshard.dispatch_modes.comm_bytes import CommBytes

    current = {"op": "(outside an aten op: a hook's or the step's redistribute)", "inputs": ""}
    log = []

    class OpInFlight(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            leaves = tree_leaves((args, kwargs or {}))
            before = dict(current)
            current["op"] = str(func)
            current["inputs"] = " ".join(_text(a) for a in leaves if isinstance(a, DTensor))
            try:
                return func(*args, **(kwargs or {}))
            finally:
                current.update(before)

    class Listed(CommBytes):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.count
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.count != before:
                t = next((a for a in tree_leaves(args) if isinstance(a, torch.Tensor)), None)
                nbytes = self.bytes - sum(e[1] for e in log)
                log.append((func._overloadpacket.__name__, nbytes, list(t.shape) if t is not None else None,
                            current["op"], current["inputs"]))
            return out

    return OpInFlight, Listed, log


def breakdown(name: str, sharding: str, enable: bool = True, warm: int = 3) -> list[tuple]:
    """(collective, bytes, local shape, op in flight, its inputs' placements) of one
    training step of zoo case `name` under `sharding`, after `warm` steps from cleared
    caches: the step the zoo counts (check/model.py `_sharded_step`: a first step, two
    timed ones, then the counted one)."""
    from decompshard.check import model as M
    from decompshard.check.zoo import ZOO, build
    from decompshard.runtime.enable import switched
    from decompshard.verify.dtensor_case import device_mesh, simulated_world, simulation

    sh = M.SHARDINGS[sharding]
    built = build(ZOO[name], sh.batch)
    OpInFlight, Listed, log = _modes()
    with simulated_world(math.prod(sh.mesh)):
        dmodel = copy.deepcopy(built.model)
        mesh = device_mesh(sh.mesh)
        with switched(enable), warnings.catch_warnings(), simulation(math.prod(sh.mesh)):
            warnings.simplefilter("ignore")
            M._distribute_model(dmodel, built.plan, mesh, sh)
            inputs = M._distribute_inputs(built.inputs, mesh, sh)
            M._clear_all_caches()
            for _ in range(warm):
                M._zero_grads(dmodel)
                M._dtensor_step(dmodel, built.loss, inputs, not sh.local_output)
            M._zero_grads(dmodel)
            with Listed(), OpInFlight():
                M._dtensor_step(dmodel, built.loss, inputs, not sh.local_output)
    return log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("sharding")
    parser.add_argument("--torch-alone", action="store_true", help="without enable()")
    parser.add_argument("--totals-only", action="store_true")
    parser.add_argument("--warm", type=int, default=3, help="steps before the counted one (default 3, as the zoo)")
    a = parser.parse_args(argv)
    log = breakdown(a.model, a.sharding, enable=not a.torch_alone, warm=a.warm)
    print(f"{a.model} {a.sharding}: {len(log)} collectives, {sum(e[1] for e in log) / 1024:.1f} KiB")
    if not a.totals_only:
        for kind, nbytes, shape, op, inputs in log:
            print(f"  {kind:24s} {nbytes / 1024:9.1f} KiB  {str(shape):18s} {op:42s} {inputs}")
    totals = collections.defaultdict(lambda: [0, 0])
    for kind, nbytes, _, op, _ in log:
        totals[(kind, op)][0] += nbytes
        totals[(kind, op)][1] += 1
    print("totals:")
    for (kind, op), (nbytes, n) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        print(f"  {nbytes / 1024:9.1f} KiB {n:4d}x {kind:24s} {op}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
