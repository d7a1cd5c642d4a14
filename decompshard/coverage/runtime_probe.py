"""Does `enable()` really run an op it derives nothing for? A DTensor run decides.

Some ops reach the coverage sweep with no rule to derive, yet run under `enable()`: ops
whose output size depends on values (data_dependent.py), ops with no decomposition that
`enable()` runs replicated (`enable.reaches_decompshard`), in-place ops written back from
a functional twin (inplace.py), in-place view ops (inplace_views.py). A predicate alone
would claim ops the runtime trips on (a sparse result, a `Tensor[]` result), so coverage
claims such an op only when real DTensor dispatch with `enable()` gives one-device
results on it: each sample's tensors `Shard(0)` on a simulated world of 3 (uneven shards
when a size is not a multiple of 3; 0-d tensors `Replicate`), every rank's result
against one device (`verify/dtensor_case.run_case`, float64).

An op whose one-device result holds uninitialized memory (`_ctc_loss`'s `log_alpha`
beyond each sequence) cannot be compared with anything; the reason says so.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from decompshard._compat import tree_flatten, tree_map
from decompshard._compat import TorchReplicate, TorchShard
from decompshard.verify.dtensor_case import run_case, simulated_world
from decompshard.runtime.enable import switched

__all__ = ["PROBE_MESH", "probe", "probe_placements"]

PROBE_MESH = (3,)


def probe_placements(tensors: Sequence[torch.Tensor]) -> list[tuple[Any, ...]]:
    """Shard(0) for every tensor with a dim, Replicate for 0-d ones."""
    return [(TorchShard(0),) if t.ndim >= 1 else (TorchReplicate(),) for t in tensors]


def _tensors(args: Any, kwargs: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]


def _clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def uninitialized_outputs(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> list[int]:
    """Indices of floating outputs holding uninitialized memory on one device: NaN where
    torch's deterministic mode fills fresh memory with NaN, and not NaN on a plain run."""
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        filled = tree_flatten(op(*tree_map(_clone, args), **tree_map(_clone, kwargs)))[0]
    finally:
        torch.use_deterministic_algorithms(was)
    plain = tree_flatten(op(*tree_map(_clone, args), **tree_map(_clone, kwargs)))[0]
    return [j for j, (a, b) in enumerate(zip(filled, plain))
            if isinstance(a, torch.Tensor) and a.dtype.is_floating_point and bool((a.isnan() & ~b.isnan()).any())]


def _explain(op: torch._ops.OpOverload, args: tuple, kwargs: dict, got: Any) -> str | None:
    """The cause behind a failed probe, where one-device properties of the op show it."""
    try:
        outs = tree_flatten(op(*tree_map(_clone, args), **tree_map(_clone, kwargs)))[0]
        layouts = {o.layout for o in outs if isinstance(o, torch.Tensor)} - {torch.strided}
        if layouts:
            return (f"its result is a {sorted(map(str, layouts))[0]} tensor, and a DTensor's local tensors are "
                    "strided (dense) ones")
        bad = uninitialized_outputs(op, args, kwargs) if got.status == "WRONG" else []
    except Exception:  # the op ran in the probe; failing here only loses the explanation
        return None
    if bad:
        return (f"its output {bad[0]} holds uninitialized memory on one device (torch's deterministic mode "
                "fills it with NaN), so no DTensor run can be checked against one device")
    return None


def probe(op: torch._ops.OpOverload, samples: Sequence[tuple[tuple, dict, str]]) -> tuple[bool, str]:
    """(True, "") when every sample that runs on one device gives one-device results on
    `Shard(0)` DTensors under `enable()`, and at least one does; else (False, why)."""
    ran = 0
    with simulated_world(PROBE_MESH[0]):
        for args, kwargs, _ in samples:
            tensors = _tensors(args, kwargs)
            if not tensors:
                continue
            shapes = ", ".join(str(list(t.shape)) for t in tensors)
            got = run_case(op, args, kwargs, PROBE_MESH, probe_placements(tensors), backward=False,
                           runtime=switched(True))
            if got.status == "n/a":
                continue
            if got.status != "ok":
                return False, _explain(op, args, kwargs, got) or f"on [{shapes}] as S(0) on 3 ranks: {got}"
            ran += 1
    return (True, "") if ran else (False, "no sample runs on one device")
