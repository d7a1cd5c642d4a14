"""Run one aten call through real DTensor on simulated ranks, and compare with one device.

The numerical checker (`verify.py`) judges single-dim *rules*: what each rank computes
when it runs the op on its shard. DTensor adds more on top of the rule it picks: the
redistribution it performs (or, in a custom handler, forgets to perform), the output
metadata it attaches, the shape arguments it rewrites. Bugs there are invisible to a
rule check, so the native audit also runs each op through DTensor itself:
`LocalTensorMode` over a fake process group (real numbers, every rank in this process),
inputs laid out with the given single-dim placements on a 1-D mesh, and every rank's
`full_tensor()` of every output compared with the single-device result.

Floating inputs are promoted to float64 (as in `verify.py`), so a tight tolerance
separates rounding from real mismatches. Partial inputs get the same random parts the
checker uses (`_rank_sim.make_local`), so a DTensor run reproduces a checker verdict on
the same values.
"""

from __future__ import annotations

import math
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from decompshard.errors import one_line
from decompshard.verify.rank_sim import close, leaves_equal, make_local, promote
from decompshard.placements import MaybePlacement, Partial
from decompshard.verify.dtensor_case import simulated_world  # one fake world for every DTensor check

__all__ = ["DTensorRun", "LOCAL_KERNEL", "RANKS_DISAGREE", "REFUSED", "exact_parts", "run_on_dtensor",
           "simulated_world"]

# How a DTensor run ended when it did not return: DTensor refused the placements (a
# clean error from sharding propagation or redistribution), it accepted them and the
# op's kernel then failed on the local shards it was handed, or the ranks returned
# different Python values where one value was due (LocalTensorMode says so by raising;
# on real processes each rank would silently carry on with its own). Both are bugs.
REFUSED, LOCAL_KERNEL, RANKS_DISAGREE = "refused", "local-kernel-error", "ranks-disagree"
_DISAGREE = "rank results must be equal for all ranks"


@dataclass
class DTensorRun:
    """What DTensor did with one op call at one input layout."""

    world_size: int
    input_placements: tuple[MaybePlacement, ...]
    output_placements: list[str] = field(default_factory=list)  # per output leaf, torch's words
    ok: bool = True  # every rank's full_tensor() of every output equals the single-device result
    max_error: float | None = None  # largest |difference| (inf: shapes differ; None: no numbers)
    reason: str = ""  # why not ok, in one line
    error_kind: str | None = None  # REFUSED / LOCAL_KERNEL / RANKS_DISAGREE when the call raised
    wrong_shape: bool = False  # some rank's full_tensor() has another shape than one device's

    @property
    def wrong(self) -> bool:
        """Silently wrong numbers or metadata, or a kernel fed shards it cannot take."""
        return not self.ok and self.error_kind != REFUSED


def _mesh(world_size: int) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(world_size))


def _to_torch(p: MaybePlacement) -> Any:
    from decompshard._compat import to_torch_placement

    return to_torch_placement(p)


def _one_line(e: BaseException) -> str:
    return one_line(e, 200)


def _error_kind(e: BaseException) -> str:
    """RANKS_DISAGREE as above; LOCAL_KERNEL when the exception came out of running the op on the local shards
    (LocalTensorMode's per-rank loop) after DTensor had settled the placements; REFUSED
    when it came from sharding propagation, redistribution or argument checks."""
    if isinstance(e, AssertionError) and _DISAGREE in str(e):
        return RANKS_DISAGREE
    frames = [(f.filename.replace("\\", "/"), f.name) for f in traceback.extract_tb(e.__traceback__)]
    in_prop = any(n.endswith(("_sharding_prop.py", "_redistribute.py")) for n, _ in frames)
    in_local = any(n.endswith("_local_tensor/__init__.py") and fn == "_for_each_rank_run_func" for n, fn in frames)
    return LOCAL_KERNEL if in_local and not in_prop else REFUSED


def _reference(op: Any, leaves: list[Any], spec: Any) -> list[Any]:
    args, kwargs = tree_unflatten([v.clone() if isinstance(v, torch.Tensor) else v for v in leaves], spec)
    with torch.no_grad():
        return tree_flatten(op(*args, **kwargs))[0]


def _per_rank(value: Any, world_size: int) -> tuple[list[Any], str]:
    """Every rank's copy of the global value of one output leaf, and its placement text."""
    from torch.distributed.tensor import DTensor

    where = "not a DTensor"
    if isinstance(value, DTensor):
        where = ", ".join(str(p) for p in value.placements)
        value = value.full_tensor()
    lt = getattr(value, "_local_tensors", None)
    if lt is not None:
        return [lt[r] for r in range(world_size)], where
    if isinstance(value, torch.Tensor):
        return [value] * world_size, where
    return [value] * world_size, "not a tensor"


def _compare(ref: Any, got: list[Any]) -> tuple[bool, float | None, str]:
    if not isinstance(ref, torch.Tensor):
        same = all(g == ref or (isinstance(g, float) and isinstance(ref, float) and math.isnan(g) and math.isnan(ref))
                   for g in got)
        return same, None, "" if same else f"a rank returned {got!r}, one device {ref!r}"
    worst: float | None = 0.0
    for r, g in enumerate(got):
        if not isinstance(g, torch.Tensor):
            return False, None, f"rank {r} holds {type(g).__name__}, one device a tensor"
        if tuple(g.shape) != tuple(ref.shape):
            return False, math.inf, f"rank {r}'s full_tensor() has shape {list(g.shape)}, one device {list(ref.shape)}"
        g = g.detach()
        if g.dtype != ref.dtype:
            return False, None, f"rank {r}'s result has dtype {g.dtype}, one device {ref.dtype}"
        if ref.numel() and (ref.dtype.is_floating_point or ref.is_complex()):
            diff = (g.to(torch.complex128 if ref.is_complex() else torch.float64)
                    - ref.to(torch.complex128 if ref.is_complex() else torch.float64)).abs()
            both_nan = g.isnan() & ref.isnan() if not ref.is_complex() else torch.zeros_like(diff, dtype=torch.bool)
            same_inf = (g == ref) & ref.isinf() if not ref.is_complex() else torch.zeros_like(diff, dtype=torch.bool)
            diff = torch.where(both_nan | same_inf, torch.zeros_like(diff), diff)
            worst = max(worst or 0.0, float(torch.nan_to_num(diff, nan=math.inf).max()))
        elif ref.numel():
            worst = max(worst or 0.0, float((g.to(torch.float64) - ref.to(torch.float64)).abs().max()))
        if not close(g, ref, ()):
            return False, worst, f"rank {r}'s full_tensor() differs from one device"
    return True, worst, ""


def exact_parts(x: torch.Tensor, p: Partial, world_size: int, seed: int, salt: int) -> list[torch.Tensor]:
    """Parts whose reduction is exactly `x`, in any summation order: P(sum) is
    [2x, -x, 0, ...] (inf and NaN whole on rank 0), P(avg) the same times W (W a power
    of two), P(max|min) the
    checker's random parts (a max is exact anyway). Rounding in a reduction DTensor
    performs would otherwise move a value across a kink (sqrt at 0, a cast to int, an
    `eq`) and look like a bug."""
    if p.reduce_op in ("max", "min") or x.dtype == torch.bool:
        return make_local(x, p, world_size, (seed, False), salt)
    scale = world_size if p.reduce_op == "avg" else 1
    if p.reduce_op == "avg" and (world_size & (world_size - 1)):
        return make_local(x, p, world_size, (seed, False), salt)
    zero = torch.zeros_like(x)
    if world_size < 2:
        return [x.clone()]
    finite = torch.isfinite(x)  # inf and NaN stay whole on rank 0 (inf - inf would be NaN)
    parts = [torch.where(finite, 2 * scale * x, x), torch.where(finite, -scale * x, zero)]
    return [q.contiguous() for q in parts + [zero] * (world_size - 2)]


def _compare_meta(ref: Any, got: list[Any]) -> tuple[bool, float | None, str]:
    if not isinstance(ref, torch.Tensor):
        return True, None, ""
    for r, g in enumerate(got):
        if not isinstance(g, torch.Tensor) or tuple(g.shape) != tuple(ref.shape) or g.dtype != ref.dtype:
            what = list(g.shape) if isinstance(g, torch.Tensor) else type(g).__name__
            return False, math.inf, f"rank {r}'s full_tensor() is {what}, one device {list(ref.shape)}"
    return True, None, ""


def run_on_dtensor(op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None,
                   placements: Sequence[MaybePlacement], world_size: int, *, seed: int = 0,
                   exact: bool = True, values: bool = True) -> DTensorRun:
    """Lay the call's tensor inputs out as `placements` (one single-dim placement per
    tensor input, in flattened schema order) on a 1-D mesh of `world_size` simulated
    ranks, run `op` through DTensor, and compare every rank's full result with one device.

    `exact`: Partial inputs get `exact_parts` (else the checker's random parts for
    `seed`, to reproduce a checker verdict). `values=False` compares shapes and dtypes
    only (ops that return uninitialized memory). Needs a fake process group of at least
    `world_size` ranks (`simulated_world`).
    """
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.tensor import DTensor

    leaves, spec = tree_flatten((tuple(args), dict(kwargs or {})))
    leaves = [promote(v) if isinstance(v, torch.Tensor) else v for v in leaves]
    pos = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    run = DTensorRun(world_size, tuple(placements))
    if len(pos) != len(placements):
        raise ValueError(f"{len(placements)} placements for {len(pos)} tensor inputs")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = _reference(op, leaves, spec)
            if values and not leaves_equal(ref, _reference(op, leaves, spec)):
                run.ok, run.reason, run.error_kind = False, "one device is not reproducible", REFUSED
                return run
    except Exception as e:
        run.ok, run.reason, run.error_kind = False, f"one device raises: {_one_line(e)}", REFUSED
        return run
    mesh = _mesh(world_size)
    ranks = frozenset(range(world_size))
    # every rank's shard, made before entering the mode (under it, each tensor op
    # on a plain tensor would itself return a per-rank LocalTensor)
    try:
        parts = [[q.clone() for q in (exact_parts(leaves[i], p, world_size, seed, k)
                                      if exact and isinstance(p, Partial)
                                      else make_local(leaves[i], p, world_size, (seed, False), salt=k))]
                 for k, (i, p) in enumerate(zip(pos, placements))]
    except Exception as e:  # no such layout (a Partial bool, a P(max) complex)
        run.ok, run.reason, run.error_kind = False, f"cannot lay out the inputs: {_one_line(e)}", REFUSED
        return run
    try:
        with LocalTensorMode(ranks), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            new = list(leaves)
            for i, p, local in zip(pos, placements, parts):
                x = leaves[i]
                lt = LocalTensor({r: local[r] for r in range(world_size)})
                new[i] = DTensor.from_local(lt, mesh, [_to_torch(p)], run_check=False,
                                            shape=x.shape, stride=x.stride())
            dargs, dkwargs = tree_unflatten(new, spec)
            out = op(*dargs, **dkwargs)
            outs = tree_flatten(out)[0]
            got = [_per_rank(o, world_size) for o in outs]
    except Exception as e:
        run.ok, run.reason, run.error_kind = False, _one_line(e), _error_kind(e)
        return run
    run.output_placements = [w for _, w in got]
    if len(got) != len(ref):
        run.ok, run.reason = False, f"DTensor returned {len(got)} values, one device {len(ref)}"
        return run
    for j, ((vals, _), r) in enumerate(zip(got, ref)):
        ok, err, why = _compare(r, vals) if values else _compare_meta(r, vals)
        if err is not None:
            run.max_error = max(run.max_error or 0.0, err)
        if not ok and run.ok:
            run.ok, run.reason = False, f"output {j}: {why}"
            run.wrong_shape = err == math.inf and "shape" in why
    return run

