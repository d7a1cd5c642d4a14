"""The one judge: does a DTensor run match one device?

Every caller that asks it, asks it here: the runtime check's runner (`dtensor_case.run_case`),
the native audit (`native_rules.run_on_dtensor`), the model check and the zoo
(`check/model.py`) and the audit's standalone reproducer scripts (`native_repro.py`).
Four copies of this question once disagreed on the details (one had no stride check,
one a fixed tolerance, one counted any exception as a bug), so a verdict depended on
which tool gave it.

`judge(got, want)` takes the results of a DTensor run (DTensors, plain values, None for a
missing gradient) and one device's results, and checks, for each pair:

- a plain value (not a tensor) equals one device's (NaN equal to NaN);
- a missing result (a None gradient) only where one device's is all zeros (`missing_ok`),
  and none present where one device has none;
- a DTensor's global shape and dtype; every rank's local shape against what its
  placements say (`local_shape_nd`); the order of its claimed strides against the
  local tensor's (a later view plans on the claimed layout); then every rank's
  `full_tensor()` against one device, at the tolerance of its dtype (`rank_sim.close`:
  exact for integers and bools, a few ulps for floating types; `dtype` names the lowest
  precision the program computes in);
- a plain tensor where a DTensor is due (`plain`): WRONG, unless every rank holds the
  one-device value, which is reported as its own kind (PLAIN: the numbers are right, the
  first DTensor op that mixes it in raises); skipped; or judged rank by rank (tensors
  each rank holds as its own: Megatron's local outputs).

Every DTensor is gathered before any is judged: in a real process group each rank
judges its own shard, and all must run the same collectives whatever they find. A run
that raised is judged by `judge_raised`: a clean refusal (sharding propagation or
redistribution said no) is not a wrong result; a local kernel that failed on shards
DTensor accepted, or ranks that returned different values, are.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from decompshard._compat import outside_simulation
from decompshard.errors import one_line
from decompshard.mesh.lift import local_shape_nd
from decompshard.verify.placement_text import format_placements
from decompshard.verify.rank_sim import close
from decompshard.verify.ranks import every_rank_full, mesh_coords, rank_locals

__all__ = ["LOCAL_KERNEL", "METADATA", "MISSING", "PLAIN", "RANKS_DISAGREE", "REFUSED", "SHAPE", "VALUES", "Verdict",
           "error_kind", "judge", "judge_raised", "max_error"]

# what disagreed, for a run that returned
VALUES, SHAPE, METADATA, MISSING, PLAIN = "values", "shape", "metadata", "missing", "plain tensor"
# how a run that raised ended: DTensor refused the placements (a clean error from
# sharding propagation or redistribution), it accepted them and the op's kernel then
# failed on the local shards it was handed, or the ranks returned different Python values
# where one value was due (LocalTensorMode raises; real processes would each carry on
# with their own). The last two are bugs.
REFUSED, LOCAL_KERNEL, RANKS_DISAGREE = "refused", "local-kernel-error", "ranks-disagree"
_DISAGREE = "rank results must be equal for all ranks"


@dataclass(frozen=True)
class Verdict:
    """ok, or what disagreed (`kind`) and where (`detail`, one line: the first wrong
    metadata, else the worst wrong number, else a plain tensor with right values).
    `max_error`: the largest error over every number compared (inf where shapes or
    metadata differ; None when no number was compared)."""

    ok: bool
    detail: str = ""
    max_error: float | None = None
    kind: str = ""

    @property
    def wrong(self) -> bool:
        """A bug: wrong numbers or metadata, or a kernel fed shards it cannot take; a
        clean refusal is not."""
        return not self.ok and self.kind != REFUSED


def judge(got: Sequence[Any], want: Sequence[Any], *, names: Sequence[str] | None = None, what: str = "output",
          dtype: torch.dtype | None = None, plain: str = "wrong", missing_ok: bool = False, values: bool = True,
          mesh: Any = None) -> Verdict:
    """Each of `got` (a DTensor run's results) against `want` (one device's), as the
    module docstring says. `names` (default "{what} {j}") name them in the detail;
    `plain`: "wrong", "skip" or "per-rank" for a plain tensor where a DTensor is due;
    `values=False` compares shapes, dtypes and layouts only (uninitialized memory);
    `mesh` is the one a plain tensor's ranks live on (default: the first DTensor's)."""
    from torch.distributed.tensor import DTensor

    names = list(names) if names is not None else [f"{what} {j}" for j in range(len(got))]
    if len(got) != len(want):
        return Verdict(False, f"{len(got)} {what}s, one device gives {len(want)}", math.inf, SHAPE)
    if mesh is None:
        mesh = next((g.device_mesh for g in got if isinstance(g, DTensor)), None)
    # every rank's values, gathered (under the simulation) before any is judged
    seen = [_gather(g, mesh) for g in got]
    found: list[tuple[str, str, float]] = []
    worst: float | None = None
    with outside_simulation():  # the arithmetic below is on one rank's plain tensors
        for name, g, w, (locals_, full) in zip(names, got, want, seen):
            for kind, why, err in _judge_one(g, w, locals_, full, dtype, plain, missing_ok, values):
                if kind:
                    found.append((kind, f"{name} {why}", err))
                if err is not None:
                    worst = max(worst or 0.0, err)
    if not found:
        return Verdict(True, "", worst, "")
    first = next((f for f in found if f[0] not in (VALUES, PLAIN)), None) or max(
        (f for f in found if f[0] == VALUES), key=lambda f: f[2], default=None) or found[0]
    return Verdict(False, first[1], worst, first[0])


def _gather(g: Any, mesh: Any) -> tuple[dict[int, Any] | None, Any]:
    """(every rank's local tensor, every rank's full value) of one result: a DTensor's
    local shards and `full_tensor()` (or the exception gathering raised), a plain
    tensor's per-rank values (as both)."""
    from torch.distributed.tensor import DTensor

    if isinstance(g, DTensor):
        try:
            full: Any = every_rank_full(g, g.device_mesh)
        except Exception as e:  # a DTensor whose metadata lies may not gather: judged on its metadata first
            full = e
        return rank_locals(g.to_local(), g.device_mesh), full
    if isinstance(g, torch.Tensor):
        ranks = rank_locals(g, mesh) if mesh is not None else {0: g}
        return ranks, ranks
    return None, None


def _judge_one(g: Any, w: Any, locals_: dict | None, full: Any, dtype, plain: str, missing_ok: bool,
               values: bool) -> list[tuple[str, str, float | None]]:
    """(kind, why, error) findings for one pair; kind '' with an error: a number that
    passed."""
    from torch.distributed.tensor import DTensor

    if not isinstance(w, torch.Tensor):
        if isinstance(g, torch.Tensor):
            return [(SHAPE, f"is a tensor, one device gives {w!r}", math.inf)]
        if g != w and not (g != g and w != w):  # NaN equals NaN
            return [(VALUES, f"is {g!r}, one device gives {w!r}", math.inf)]
        return []
    if g is None:
        if missing_ok and not bool((w != 0).any()):
            return []
        return [(MISSING, "is missing, one device gives " + ("a nonzero one" if missing_ok else "a tensor"), math.inf)]
    if not isinstance(g, torch.Tensor):
        return [(SHAPE, f"is a {type(g).__name__}, one device gives a tensor", math.inf)]
    if isinstance(g, DTensor):
        where = f"({format_placements([tuple(g.placements)])})"
        bad = _metadata(g, w, locals_)
        if bad:
            return [(bad[0], f"{where}{bad[1]}", math.inf)]
        if isinstance(full, BaseException):
            raise full
        # a sum of parts is rounded at the parts' size (a float32 output of parts up to
        # 1000x the value: linspace's P(sum) rule read as WRONG at 40 ulps); max/min not
        summed = any(p.is_partial() and getattr(p, "reduce_op", "") in ("sum", "avg") for p in g.placements)
        return _numbers(full, w, where, dtype, values, list(locals_.values()) if summed else [])
    if plain == "skip":
        return []
    if plain == "per-rank":
        return _numbers(full, w, "(plain)", dtype, values)
    if all(_same_meta(v, w) and close(v, w, []) for v in full.values()):
        return [(PLAIN, "is a plain torch.Tensor, not a DTensor (it holds the one-device value on every rank)", 0.0)]
    return [(VALUES, f"is a {type(g).__name__}, not a DTensor", math.inf)]


def _same_meta(v: torch.Tensor, w: torch.Tensor) -> bool:
    return v.shape == w.shape and v.dtype == w.dtype


def _metadata(g: Any, w: torch.Tensor, locals_: dict[int, torch.Tensor]) -> tuple[str, str] | None:
    """What the DTensor claims against one device and against what each rank holds."""
    if tuple(g.shape) != tuple(w.shape):
        return SHAPE, f" has global shape {list(g.shape)}, one device gives {list(w.shape)}"
    if g.dtype != w.dtype:
        return METADATA, f" has dtype {g.dtype}, one device gives {w.dtype}"
    placements, mesh_shape = tuple(g.placements), tuple(g.device_mesh.shape)
    coords = mesh_coords(mesh_shape)
    for r, lt in locals_.items():
        expect = local_shape_nd(tuple(g.shape), placements, mesh_shape, coords[r])
        if tuple(lt.shape) != tuple(expect):
            return SHAPE, f": rank {r} holds shape {list(lt.shape)}, the placements say {list(expect)}"
        if _layout_disagrees(g, lt):
            return METADATA, (f": the DTensor's strides {list(g.stride())} disagree with rank {r}'s local "
                              f"strides {list(lt.stride())} (a later view would fail)")
    return None


def _numbers(per_rank: dict[int, Any], w: torch.Tensor, where: str, dtype, values: bool,
             parts: Sequence[torch.Tensor] = ()) -> list[tuple[str, str, float | None]]:
    """Every rank's full value against one device's: the worst rank's finding."""
    worst: tuple[str, str, float | None] = ("", "", None)
    for r, f in per_rank.items():
        if not isinstance(f, torch.Tensor) or not _same_meta(f, w):
            what = f"{f.dtype} {list(f.shape)}" if isinstance(f, torch.Tensor) else type(f).__name__
            return [(SHAPE, f"{where}: rank {r}'s full value is {what}, one device gives {w.dtype} {list(w.shape)}",
                     math.inf)]
        if not values:
            continue
        err = max_error(f, w)
        ok = close(f, w, parts, dtype=dtype if w.dtype.is_floating_point else None)
        if not ok and (not worst[0] or err > (worst[2] or 0.0)):
            big = float(w.to(torch.complex128 if w.is_complex() else torch.float64).abs().max()) if w.numel() else 0.0
            worst = (VALUES, f"{where}: rank {r}'s full_tensor() differs from one device (max error {err:.3g}; "
                             f"one device's largest |value| {big:.3g})", err)
        elif not worst[0]:
            worst = ("", "", max(worst[2] or 0.0, err))
    return [worst] if worst[0] or worst[2] is not None else []


def _layout_disagrees(g: Any, lt: torch.Tensor) -> bool:
    """The order of dims by stride (the memory layout) differs between what the DTensor
    claims and what the rank holds, on dims larger than 1 on both. Views planned on the
    claimed layout then fail (or worse, succeed on the wrong elements)."""
    dims = [d for d in range(g.ndim) if g.shape[d] > 1 and lt.shape[d] > 1]
    if len(dims) < 2 or lt.numel() == 0:
        return False
    gs, ls = g.stride(), lt.stride()
    order_g = sorted(dims, key=lambda d: (-gs[d], d))
    order_l = sorted(dims, key=lambda d: (-ls[d], d))
    return order_g != order_l and any(gs[a] != gs[b] for a, b in zip(order_g, order_g[1:]))


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """How far `got` is from `want`: the number printed beside a verdict (the verdict
    itself is `close`, at the dtype's tolerance). One policy for every tool, so "max
    error 3" means the same in the check, the zoo, the audit and a reproducer: the
    largest |difference| over the elements, in the values' own unit (compare it with
    the values' magnitude, which the verdict prints beside it), computed in float64 /
    complex128; integers and bools by the same difference (a count of differing
    elements would be another unit). Elements `close` calls equal count 0: NaN against
    NaN, and a matching infinity (inf - inf is NaN, which would report an error where
    the verdict sees none). inf where the shapes differ, 0 for empty tensors."""
    if got.shape != want.shape:
        return math.inf
    if not want.numel():
        return 0.0
    floating = want.dtype.is_floating_point or want.is_complex()
    hi = torch.complex128 if want.is_complex() or got.is_complex() else torch.float64
    a, b = got.to(hi), want.to(hi)
    same = a == b
    if floating:
        same = same | (torch.isnan(a) & torch.isnan(b))
    d = torch.where(same, torch.zeros((), dtype=torch.float64), (a - b).abs().to(torch.float64))
    return float(torch.nan_to_num(d, nan=math.inf, posinf=math.inf).max())


def error_kind(e: BaseException) -> str:
    """RANKS_DISAGREE when LocalTensorMode found ranks with different Python values;
    LOCAL_KERNEL when the exception came out of running the op on the local shards
    (LocalTensorMode's per-rank loop) after DTensor had settled the placements; REFUSED
    when it came from sharding propagation, redistribution or argument checks."""
    if isinstance(e, AssertionError) and _DISAGREE in str(e):
        return RANKS_DISAGREE
    frames = [(f.filename.replace("\\", "/"), f.name) for f in traceback.extract_tb(e.__traceback__)]
    in_prop = any(n.endswith(("_sharding_prop.py", "_redistribute.py")) for n, _ in frames)
    in_local = any(n.endswith("_local_tensor/__init__.py") and fn == "_for_each_rank_run_func" for n, fn in frames)
    return LOCAL_KERNEL if in_local and not in_prop else REFUSED


def judge_raised(e: BaseException) -> Verdict:
    """The verdict on a DTensor run that raised `e` (see `error_kind`)."""
    return Verdict(False, one_line(e, 200), None, error_kind(e))
