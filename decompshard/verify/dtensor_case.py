"""Runtime truth: the one DTensor runner, for the check and for the native audit.

rule_check.py proves single-dim *rules* on plain per-rank tensors. Users do not run rules:
they run DTensor with `enable()`, where list arguments, redistribution, output metadata,
N-D meshes and autograd all sit between the rule and the numbers. This module checks
that whole path on one case: real DTensors on a simulated mesh (LocalTensorMode over a
fake process group), built from the caller's tensors with the placements asked for
(chunks for Shard, random parts for Partial, a view of an unflattened shard for
_StridedShard), the op run through DTensor's dispatch, and every rank's `full_tensor()`
of every output, every written input and every input gradient compared with one device.

A case's verdict is `ok`, `WRONG` (a number or a DTensor's metadata disagrees with one
device: the bug class that corrupts training runs) or `error` (the op raised). The same
case can be run with decompshard enabled or with torch's own fallback, side by side.

One engine serves both callers: the simulated world and meshes (`simulated_world`,
`device_mesh`, `simulation`), the one-device result (`reference`), every rank's copy of a
global value (`ranks.every_rank_full`) and the one judge (`judge.judge`).
`run_case` builds on it for `check/`; the native audit's `run_on_dtensor`
(verify/native_rules.py) builds its own layouts and verdict words on the same pieces.

Placement text, per tensor input ';'-separated, per mesh dim ','-separated, in the one
placement grammar (placements.py): `R`, `S(d)`, `P(sum|avg|max|min)`, and `_S(d,k)` for
`_StridedShard(d, split_factor=k)` (`SS(d,k)` is read too), e.g. "S(0),P(sum);S(0),S(0)"
for two inputs on a 2-D mesh.
"""

from __future__ import annotations

import contextlib
import math
import random
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from decompshard._compat import tree_flatten, tree_unflatten
from decompshard._compat import (
    TorchPartial, TorchReplicate, TorchShard, TorchStridedShard, fake_store, local_tensor_mode, make_local_tensor,
    simulating_ranks,
)
from decompshard.torch_placements import to_torch_placement
from decompshard.verify.per_rank import simulator_chunks
from decompshard.errors import one_line
from decompshard.verify.judge import PLAIN, Verdict, judge
from decompshard.verify.placement_text import format_placements
from decompshard.verify.rank_sim import make_parts, on_exact_grid, promote
from decompshard.verify.ranks import every_rank_full, mesh_coords, per_rank_values, rank_locals
from decompshard.placements import REDUCE_OPS, Partial, check_placement_rows, parse_mesh_shape, parse_placement_rows

__all__ = ["MESHES", "Outcome", "Reference", "device_mesh", "differentiable_inputs", "every_rank_full", "flatten_call",
           "format_placements", "make_dtensor", "mesh_coords", "parse_mesh", "parse_placements", "per_rank_values",
           "random_placements", "rank_locals", "reference", "run_case", "simulated_world", "simulation"]

TorchPlacement = Any
MESHES: dict[str, tuple[int, ...]] = {"1d": (6,), "2d": (2, 3), "3d": (2, 2, 2)}
STATUSES = ("ok", "WRONG", "error", "n/a")


# ------------------------------------------------------------------ placement text


def parse_placements(text: str, shapes: Sequence[Sequence[int]], ndim: int) -> tuple[tuple[TorchPlacement, ...], ...]:
    """'S(0),P(sum);R,S(1)' -> per tensor input, one torch placement per mesh dim (the
    grammar and its checks are placements.py's; this only converts to torch's types)."""
    rows = parse_placement_rows(text)
    check_placement_rows(rows, shapes, ndim)
    return tuple(tuple(to_torch_placement(p) for p in row) for row in rows)


def parse_mesh(text: str | Sequence[int]) -> tuple[int, ...]:
    """'2x3', a name in MESHES ('1d', '2d', '3d'), or a sequence -> mesh shape."""
    if isinstance(text, str) and text in MESHES:
        return MESHES[text]
    return parse_mesh_shape(text)


# ------------------------------------------------------------------ simulated world


_MESHES: dict[tuple[int, ...], Any] = {}


@contextlib.contextmanager
def simulated_world(world_size: int) -> Iterator[None]:
    """A fake process group of at least `world_size` ranks (reused if one is up)."""
    import torch.distributed as dist

    created = False
    _MESHES.clear()  # a mesh belongs to the process group it was made under
    if dist.is_initialized():
        if dist.get_backend() != "fake" or dist.get_world_size() < world_size:
            raise RuntimeError(
                f"a {dist.get_backend()} process group of {dist.get_world_size()} ranks is already "
                f"initialized; the simulated check needs a fake one of >= {world_size}")
    else:
        dist.init_process_group("fake", rank=0, world_size=world_size, store=fake_store())
        created = True
    try:
        yield
    finally:
        if created:
            _MESHES.clear()
            dist.destroy_process_group()


def device_mesh(shape: Sequence[int]) -> Any:
    """A mesh over the first prod(shape) ranks, row-major (cached: one per shape)."""
    from torch.distributed.device_mesh import DeviceMesh

    key = tuple(shape)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh("cpu", torch.arange(math.prod(key)).view(*key))
    return _MESHES[key]


@contextlib.contextmanager
def simulation(n: int, *, mend_chunks: bool = True) -> Iterator[None]:
    """Every one of `n` ranks simulated in this process (LocalTensorMode), with the chunk
    mend (`per_rank.simulator_chunks`) unless `mend_chunks=False` (the native audit runs
    DTensor as torch ships it)."""
    with simulator_chunks() if mend_chunks else contextlib.nullcontext(), local_tensor_mode(frozenset(range(n))):
        yield


# ------------------------------------------------------------------ random placements


def random_placements(shapes: Sequence[Sequence[int]], floating: Sequence[bool], mesh: Sequence[int],
                      rng: random.Random, *, strided: bool = True) -> tuple[tuple[TorchPlacement, ...], ...]:
    """Per tensor and mesh dim: R, S(d) for any dim (uneven and empty shards included),
    P(op) for floating tensors (one reduce op per tensor), and _StridedShard(d, k) where
    a flatten of a [k, n/k] pair of dims makes one."""
    rows = []
    for shape, fl in zip(shapes, floating):
        reduce_op = rng.choice(REDUCE_OPS)
        choices: list[TorchPlacement] = [TorchReplicate()] + [TorchShard(d) for d in range(len(shape))]
        if fl:
            choices.append(TorchPartial(reduce_op))
        row: list[TorchPlacement] = []
        for _ in mesh:
            row.append(rng.choice(choices))
        if strided and shape:
            row = _maybe_strided(row, shape, tuple(mesh), rng)
        rows.append(tuple(row))
    return tuple(rows)


def _maybe_strided(row: list, shape: Sequence[int], mesh_sizes: tuple[int, ...], rng: random.Random) -> list:
    """Turn one lone Shard(d) into _StridedShard(d, k) a third of the time, where k splits
    dim d and no other mesh dim shards d (so the flatten that makes it is a plain view)."""
    for m, p in enumerate(row):
        if type(p) is TorchShard and rng.random() < 1 / 3:
            if sum(isinstance(q, (TorchShard, TorchStridedShard)) and q.dim == p.dim for q in row) > 1:
                continue
            # LocalTensorMode cannot gather an uneven _StridedShard (its per-rank index
            # lists differ in length), so only inner sizes that split evenly
            ks = [k for k in (2, 3) if shape[p.dim] % k == 0 and (shape[p.dim] // k) % mesh_sizes[m] == 0]
            if ks:
                row[m] = TorchStridedShard(p.dim, split_factor=rng.choice(ks))
            break
    return row


# ------------------------------------------------------------------ building DTensors


def make_dtensor(x: torch.Tensor, mesh: Any, placements: Sequence[TorchPlacement], seed: int, salt: int) -> Any:
    """A DTensor of global value `x`: chunks for Shard, a view of an unflattened shard for
    _StridedShard, random parts (see `rank_sim.make_parts`) for Partial. Runs under
    LocalTensorMode (every rank at once) or in one real process of a group (its own
    rank's part: the same numbers either way); `x` is a plain tensor."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    placements = tuple(placements)
    strided = [p for p in placements if isinstance(p, TorchStridedShard)]
    if strided:
        return _strided_dtensor(x, mesh, placements, seed, salt)
    base = tuple(TorchReplicate() if isinstance(p, TorchPartial) else p for p in placements)
    dt = distribute_tensor(x, mesh, base)
    partial_dims = [m for m, p in enumerate(placements) if isinstance(p, TorchPartial)]
    if not partial_dims:
        return dt
    reduce_op = placements[partial_dims[0]].reduce_op
    mesh_shape = tuple(mesh.shape)
    per_rank = rank_locals(dt.to_local(), mesh)
    rank_of = {c: r for r, c in enumerate(mesh_coords(mesh_shape))}
    w = math.prod(mesh_shape[m] for m in partial_dims)
    groups: dict[tuple, list[int]] = {}
    for c, r in rank_of.items():
        groups.setdefault(tuple(v for m, v in enumerate(c) if m not in partial_dims), []).append(r)
    for g, (_key, ranks) in enumerate(sorted(groups.items())):
        held = [r for r in ranks if r in per_rank]
        if not held:
            continue
        parts = make_parts(per_rank[held[0]], Partial(reduce_op), w, (seed, False), salt * 101 + g)
        for r, part in zip(ranks, parts):  # ranks are in row-major order of their partial coords
            if r in per_rank:
                per_rank[r] = part.detach()
    local = make_local_tensor(per_rank) if simulating_ranks() else next(iter(per_rank.values()))
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=x.shape, stride=dt.stride())


def _strided_dtensor(x, mesh, placements, seed, salt):
    """_StridedShard(d, k) as DTensor makes it: unflatten dim d into (k, n/k), shard the
    second, view back. Raises ValueError if the view does not give the placements asked."""
    (d,) = {p.dim for p in placements if isinstance(p, TorchStridedShard)}
    (k,) = {p.split_factor for p in placements if isinstance(p, TorchStridedShard)}
    wide = x.unflatten(d, (k, x.shape[d] // k))

    def shift(p):
        if isinstance(p, TorchStridedShard):
            return TorchShard(d + 1)
        if isinstance(p, TorchShard) and p.dim > d:
            return TorchShard(p.dim + 1)
        return p

    dt = make_dtensor(wide, mesh, tuple(shift(p) for p in placements), seed, salt)
    out = dt.view(x.shape)
    if tuple(out.placements) != tuple(placements):
        raise ValueError(f"cannot build {placements} by a view: DTensor gives {tuple(out.placements)}")
    return out


# ------------------------------------------------------------------ one case


@dataclass(frozen=True)
class Outcome:
    """One path's verdict on one case."""

    status: str  # ok | WRONG | error | n/a
    stage: str = ""  # setup | forward | backward
    detail: str = ""
    max_err: float = 0.0

    def __str__(self) -> str:
        if self.status == "ok":
            return "ok"
        where = f" ({self.stage})" if self.stage else ""
        return f"{self.status}{where}: {self.detail}"


@dataclass
class Reference:
    """One device's run of a call: what every DTensor run is compared with."""

    outputs: list[Any]
    written: dict[int, torch.Tensor]  # flat input index -> value after the call
    grads: list[torch.Tensor | None] | None  # per leaf; None: no backward
    cotangents: list[torch.Tensor | None]
    leaves: list[int]  # flat indices of the inputs differentiated against


def _floating(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and (t.dtype.is_floating_point or t.is_complex())


def differentiable_inputs(op, flat: list, spec, tensor_idx: list[int]) -> list[int]:
    """Flat indices of the real floating inputs the op can be differentiated against
    (`soft_margin_loss` refuses a target that requires grad)."""
    cands = [i for i in tensor_idx if _floating(flat[i]) and not flat[i].is_complex()]
    if not cands or _mutates(op):
        return []

    def runs(chosen: list[int]) -> bool:
        trial = [x.detach().requires_grad_(True) if i in chosen else x for i, x in enumerate(flat)]
        args, kwargs = tree_unflatten(trial, spec)
        try:
            with torch.enable_grad():
                op(*args, **kwargs)
        except RuntimeError as e:
            if "differentiable" in str(e) or "requires_grad" in str(e):
                return False
            raise
        return True

    if runs(cands):
        return cands
    return [i for i in cands if runs([i])]


def flatten_call(args: Sequence[Any], kwargs: dict | None) -> tuple[list[Any], Any, list[int]]:
    """(flat leaves, spec, indices of the tensor leaves) of a call, floating tensors
    promoted to float64 / complex128 so a tight tolerance separates rounding from real
    mismatches (both sides of every comparison run on these)."""
    flat, spec = tree_flatten((tuple(args), dict(kwargs or {})))
    flat = [promote(x) if isinstance(x, torch.Tensor) else x for x in flat]
    return flat, spec, [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]


def reference(op: Any, flat: list, spec: Any, tensor_idx: list[int], seed: int, backward: bool) -> Reference:
    """The call on one device (on copies of the inputs): outputs, inputs it wrote, and,
    with `backward`, the gradients of random cotangents (drawn from `seed`)."""
    flat = [x.clone() if isinstance(x, torch.Tensor) else x for x in flat]
    leaves = differentiable_inputs(op, flat, spec, tensor_idx) if backward else []
    grad_on = bool(leaves)
    if grad_on:
        for i in leaves:
            flat[i] = flat[i].detach().requires_grad_(True)
    inputs = list(flat)
    args, kwargs = tree_unflatten(flat, spec)
    with torch.enable_grad() if grad_on else torch.no_grad():
        out = op(*args, **kwargs)
    outs = tree_flatten(out)[0]
    written = {i: inputs[i].detach().clone() for i in tensor_idx} if _mutates(op) else {}
    gen = torch.Generator().manual_seed(seed + 17)
    cots = [
        torch.randn(o.shape, dtype=o.dtype, generator=gen) if isinstance(o, torch.Tensor) and o.requires_grad else None
        for o in outs
    ]
    grads = None
    if grad_on and any(c is not None for c in cots):
        pairs = [(o, c) for o, c in zip(outs, cots) if c is not None]
        try:
            grads = list(torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in leaves],
                                             [c for _, c in pairs], allow_unused=True))
        except RuntimeError:  # not differentiable (an integer path, a non-differentiable op)
            grads = None
    return Reference([o.detach() if isinstance(o, torch.Tensor) else o for o in outs], written, grads, cots, leaves)


def _mutates(op: Any) -> bool:
    schema = getattr(op, "_schema", None)
    return bool(schema is not None and any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments))


def run_case(op: Any, args: tuple, kwargs: dict | None, mesh_shape: Sequence[int],
             placements: Sequence[Sequence[TorchPlacement]], *, seed: int = 0, backward: bool = True,
             runtime: contextlib.AbstractContextManager, simulate: bool = True) -> Outcome:
    """Run `op` on DTensors laid out as `placements` on a simulated mesh and compare every
    rank's result (outputs, written inputs, input gradients) with one device.

    `runtime` is entered around the DTensor run: `decompshard.runtime.enable.switched(True)`
    for decompshard's strategies, `switched(False)` for torch's own fallback. The caller
    passes it because the runtime sits above this stage (the guard uses the rule check).

    Floating inputs are promoted to float64 on both sides, so a tight tolerance separates
    rounding from real mismatches. Simulated (default): needs a fake process group of
    >= prod(mesh_shape) ranks (`simulated_world`); `simulate=False` runs in every process
    of a real group (gloo) of exactly that size, each judging its own rank."""
    flat, spec, tensor_idx = flatten_call(args, kwargs)
    if len(placements) != len(tensor_idx):
        raise ValueError(f"expected placements for {len(tensor_idx)} tensor inputs, got {len(placements)}")
    for i, pl in zip(tensor_idx, placements):
        if any(isinstance(p, TorchPartial) for p in pl):
            flat[i] = on_exact_grid(flat[i])
    try:
        ref = reference(op, flat, spec, tensor_idx, seed, backward)
    except Exception as e:
        return Outcome("n/a", "setup", f"the op fails on one device: {one_line(e, 200)}")
    mesh = device_mesh(mesh_shape)
    n = math.prod(mesh_shape)
    with runtime, warnings.catch_warnings(), simulation(n) if simulate else contextlib.nullcontext():
        warnings.simplefilter("ignore")
        return _run_dtensor(op, flat, spec, tensor_idx, mesh, placements, ref, seed)


def _run_dtensor(op, flat, spec, tensor_idx, mesh, placements, ref: Reference, seed: int) -> Outcome:
    from torch.distributed.tensor import DTensor, distribute_tensor

    grad_on = ref.grads is not None
    leaves = ref.leaves if grad_on else []
    try:
        dflat = list(flat)
        for salt, (i, pl) in enumerate(zip(tensor_idx, placements)):
            d = make_dtensor(flat[i].clone(), mesh, pl, seed, salt)
            dflat[i] = d.detach().requires_grad_(True) if i in leaves else d
        inputs = list(dflat)
    except Exception as e:
        return Outcome("n/a", "setup", f"cannot build the input DTensors: {one_line(e, 200)}")
    args, kwargs = tree_unflatten(dflat, spec)
    # Every verdict below is agreed by all ranks before anyone moves on (`_agreed`): in
    # a real group, a rank that stopped early while the others entered the next
    # collective would hang them all.
    try:
        with torch.enable_grad() if grad_on else torch.no_grad():
            out = op(*args, **kwargs)
        failed = None
    except Exception as e:
        failed = Outcome("error", "forward", one_line(e, 200))
    if (failed := _agreed(failed, "forward")) is not None:
        return failed
    outs = tree_flatten(out)[0]
    try:
        v = judge(outs, ref.outputs, what="output", mesh=mesh)
        if v.ok:
            v = judge([inputs[i] for i in ref.written], list(ref.written.values()), what="input after the call",
                      plain="skip", mesh=mesh)
        verdict = None if v.ok else _outcome(v, "forward", op)
    except Exception as e:
        verdict = Outcome("error", "forward", f"reading the result: {one_line(e, 200)}")
    if (verdict := _agreed(verdict, "forward")) is not None or not grad_on:
        return verdict or Outcome("ok")
    pairs = [(o, c) for o, c in zip(outs, ref.cotangents) if c is not None]
    grads: Sequence[Any] = ()
    if any(not isinstance(o, DTensor) or not o.requires_grad for o, _ in pairs):
        verdict = Outcome("WRONG", "backward", "an output that needs a gradient has no autograd graph")
    else:
        try:
            dcots = [distribute_tensor(c, mesh, [TorchReplicate()] * mesh.ndim) for _, c in pairs]
            grads = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in leaves], dcots, allow_unused=True)
        except Exception as e:
            verdict = Outcome("error", "backward", one_line(e, 200))
    if (verdict := _agreed(verdict, "backward")) is not None:
        return verdict
    try:
        v = judge(list(grads), ref.grads, what="gradient", missing_ok=True, mesh=mesh)
        verdict = None if v.ok else _outcome(v, "backward", op)
    except Exception as e:
        verdict = Outcome("error", "backward", f"reading the gradients: {one_line(e, 200)}")
    return _agreed(verdict, "backward") or Outcome("ok")


def _outcome(v: Verdict, stage: str, op: Any) -> Outcome:
    """The judge's verdict in the check's words. A plain tensor holding the right value
    where a DTensor is due is an error, not WRONG: its numbers are right, and the first
    use with a DTensor (adding another gradient, an optimizer step) raises "mixed
    torch.Tensor and DTensor". As a gradient it comes from autograd building it from
    sizes alone (reflection_pad1d_backward's formula for `self` is `zeros_like(self)`)."""
    if v.kind == PLAIN:
        why = f": torch's autograd formula for {op} builds it from sizes" if stage == "backward" else ""
        return Outcome("error", stage, f"{v.detail}{why}; its values are right, but using it with a DTensor raises")
    return Outcome("WRONG", stage, v.detail, v.max_error if v.max_error is not None else 0.0)


def _agreed(mine: Outcome | None, stage: str) -> Outcome | None:
    """This rank's verdict, or another rank's failure, the same on every rank of a real
    group (simulated: one process judges every rank, nothing to agree)."""
    import torch.distributed as dist

    if simulating_ranks() or not dist.is_initialized() or dist.get_world_size() == 1:
        return mine
    code = {None: 0, "error": 1, "WRONG": 2}.get(mine.status if mine else None, 1)
    worst = torch.tensor([code])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    if int(worst) == code:
        return mine
    return Outcome("WRONG" if int(worst) == 2 else "error", stage, "on another rank (see its verdict)")
