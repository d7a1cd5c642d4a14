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
global value (`every_rank_full`) and the comparison (`rank_sim.close`, `max_error`).
`run_case` builds on it for `check/`; the native audit's `run_on_dtensor`
(verify/native_rules.py) builds its own layouts and verdict words on the same pieces.

Placement text, per tensor input ';'-separated, per mesh dim ','-separated, in the one
placement grammar (placements.py): `R`, `S(d)`, `P(sum|avg|max|min)`, and `_S(d,k)` for
`_StridedShard(d, split_factor=k)` (`SS(d,k)` is read too), e.g. "S(0),P(sum);S(0),S(0)"
for two inputs on a 2-D mesh.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from decompshard._compat import tree_flatten, tree_unflatten
from decompshard._compat import (
    TorchPartial, TorchReplicate, TorchShard, TorchStridedShard, fake_store, from_torch_placement, local_tensor_mode, make_local_tensor,
    rank_tensors, simulating_ranks, simulator_chunks,
    to_torch_placement,
)
from decompshard.errors import one_line
from decompshard.verify.rank_sim import close, make_parts, promote
from decompshard.placements import REDUCE_OPS, Partial, check_placement_rows, format_placement_rows, parse_mesh_shape, parse_placement_rows
from decompshard.mesh.lift import local_shape_nd

TorchPlacement = Any
MESHES: dict[str, tuple[int, ...]] = {"1d": (6,), "2d": (2, 3), "3d": (2, 2, 2)}
STATUSES = ("ok", "WRONG", "error", "n/a")


# ------------------------------------------------------------------ placement text


def format_placements(rows: Sequence[Sequence[TorchPlacement]]) -> str:
    """Per tensor input, torch placements in the placement grammar: "S(0),P(sum);_S(1,3),R"."""
    return format_placement_rows([_grammar(p) for p in row] for row in rows)


def parse_placements(text: str, shapes: Sequence[Sequence[int]], ndim: int) -> tuple[tuple[TorchPlacement, ...], ...]:
    """'S(0),P(sum);R,S(1)' -> per tensor input, one torch placement per mesh dim (the
    grammar and its checks are placements.py's; this only converts to torch's types)."""
    rows = parse_placement_rows(text)
    check_placement_rows(rows, shapes, ndim)
    return tuple(tuple(to_torch_placement(p) for p in row) for row in rows)


def _grammar(p: TorchPlacement) -> Any:
    if isinstance(p, TorchPartial):  # subclasses too (_NormPartial, _MaskPartial): shown by their reduction
        return Partial(p.reduce_op)
    q = from_torch_placement(p, strided=True)
    if q is None or q is NotImplemented:
        raise TypeError(f"not a plain DTensor placement: {p!r}")
    return q


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
    mend (`_compat.simulator_chunks`) unless `mend_chunks=False` (the native audit runs
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


def per_rank_values(t: torch.Tensor, n: int) -> dict[int, torch.Tensor]:
    """Each simulated rank's tensor (LocalTensorMode gives a plain tensor where every
    rank holds the same)."""
    lt = rank_tensors(t)
    return dict(lt) if lt is not None else {r: t for r in range(n)}


def rank_locals(t: torch.Tensor, mesh: Any) -> dict[int, torch.Tensor]:
    """The local values this process can see, by rank index within `mesh` (row-major):
    every rank when simulated, this process's own rank in a real process group."""
    if simulating_ranks():
        return per_rank_values(t, mesh.size())
    coord = mesh.get_coordinate()
    return {mesh_coords(tuple(mesh.shape)).index(tuple(coord)): t}


def every_rank_full(value: Any, mesh: Any) -> dict[int, Any]:
    """Every visible rank's copy of the global value of one result (a DTensor's
    `full_tensor()`, gathered by each rank; a plain value as each rank holds it)."""
    from torch.distributed.tensor import DTensor

    return rank_locals(value.full_tensor() if isinstance(value, DTensor) else value, mesh)


def mesh_coords(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Every rank's coordinate on a mesh of this shape, in rank (row-major) order."""
    return list(itertools.product(*(range(s) for s in mesh_shape)))


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
        bad = _compare_all(outs, ref.outputs, "output") or _compare_all(
            [inputs[i] for i in ref.written], list(ref.written.values()), "input after the call", only_dtensor=True)
        verdict = Outcome("WRONG", "forward", *bad) if bad else None
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
        plain = _plain_gradients(list(grads), ref.grads, mesh)
        bad = _compare_all(list(grads), ref.grads, "gradient", allow_none=True, skip=plain)
        verdict = Outcome("WRONG", "backward", *bad) if bad else None
        if verdict is None and plain:  # a wrong number elsewhere is worse, and reported first
            verdict = Outcome("error", "backward", (
                f"gradient {plain[0]} is a plain torch.Tensor, not a DTensor (torch's autograd formula for "
                f"{op} builds it from sizes); its values are right, but using it with a DTensor raises"))
    except Exception as e:
        verdict = Outcome("error", "backward", f"reading the gradients: {one_line(e, 200)}")
    return _agreed(verdict, "backward") or Outcome("ok")


def _plain_gradients(grads: Sequence[Any], want: Sequence[Any], mesh: Any) -> list[int]:
    """Indices of the gradients that are an error, not a wrong number: a plain tensor
    (not a DTensor) that holds the one-device gradient on every rank.

    An op on DTensors returns DTensors, so a plain tensor can only come from autograd
    building it from sizes alone (reflection_pad1d_backward's formula for `self` is
    `zeros_like(self)`, made from its saved sizes). Its numbers are right, and the
    first use with a DTensor (adding another gradient, an optimizer step) raises
    "mixed torch.Tensor and DTensor": a loud failure, reported as one. A plain tensor
    with other values stays WRONG (`_compare_all`)."""
    from torch.distributed.tensor import DTensor

    out = []
    for j, (g, w) in enumerate(zip(grads, want)):
        if not isinstance(g, torch.Tensor) or isinstance(g, DTensor) or not isinstance(w, torch.Tensor):
            continue
        locs = rank_locals(g, mesh)
        if all(v.shape == w.shape and v.dtype == w.dtype and close(v, w, []) for v in locs.values()):
            out.append(j)
    return out


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


def _compare_all(got: Sequence[Any], want: Sequence[Any], what: str, *, allow_none: bool = False,
                 only_dtensor: bool = False, skip: Sequence[int] = ()) -> tuple[str, float] | None:
    from torch.distributed.tensor import DTensor

    if len(got) != len(want):
        return f"{len(got)} {what}s, one device gives {len(want)}", math.inf
    # gather every value before judging any: in a real group each rank judges its own
    # shard, and all must run the same collectives whatever they find
    fulls = [every_rank_full(g, g.device_mesh) if isinstance(g, DTensor) else None for g in got]
    for j, (g, w, full) in enumerate(zip(got, want, fulls)):
        if j in skip:  # judged by the caller
            continue
        if not isinstance(w, torch.Tensor):
            if isinstance(g, torch.Tensor) or (g != w and not (g != g and w != w)):
                return f"{what} {j}: {g!r}, one device gives {w!r}", math.inf
            continue
        if g is None and allow_none:
            if bool((w != 0).any()):
                return f"{what} {j}: missing, one device gives a nonzero gradient", math.inf
            continue
        if not isinstance(g, DTensor):
            if only_dtensor:
                continue
            return f"{what} {j} is a {type(g).__name__}, not a DTensor", math.inf
        bad = _compare_dtensor(g, w, full)
        if bad:
            return f"{what} {j} {bad[0]}", bad[1]
    return None


def _compare_dtensor(g: Any, w: torch.Tensor, fulls: dict[int, torch.Tensor]) -> tuple[str, float] | None:
    """Metadata the DTensor claims against what each rank holds, then the value on every
    rank against one device."""

    placements = tuple(g.placements)
    where = f"({format_placements([placements])})"
    if tuple(g.shape) != tuple(w.shape):
        return f"{where} has global shape {list(g.shape)}, one device gives {list(w.shape)}", math.inf
    if g.dtype != w.dtype:
        return f"{where} has dtype {g.dtype}, one device gives {w.dtype}", math.inf
    mesh_shape = tuple(g.device_mesh.shape)
    per_rank = rank_locals(g.to_local(), g.device_mesh)
    coords = mesh_coords(mesh_shape)
    for r, lt in per_rank.items():
        coord = coords[r]
        expect = local_shape_nd(tuple(g.shape), placements, mesh_shape, coord)
        if tuple(lt.shape) != tuple(expect):
            return f"{where}: rank {r} holds shape {list(lt.shape)}, the placements say {list(expect)}", math.inf
        if _layout_disagrees(g, lt):
            return (f"{where}: the DTensor's strides {list(g.stride())} disagree with rank {r}'s local "
                    f"strides {list(lt.stride())} (a later view would fail)"), math.inf
    for r, f in fulls.items():
        if not close(f, w, []):
            err = max_error(f, w)
            return f"{where}: rank {r}'s full_tensor() differs from one device (max error {err:.3g})", err
    return None


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


def max_error(got: torch.Tensor, want: torch.Tensor, *, count_integers: bool = True,
              equal_infinities: bool = False) -> float:
    """How far `got` is from `want` (the number reported beside a verdict; the verdict
    itself is `rank_sim.close`): inf when the shapes differ; for integer and bool results
    the number of differing elements (`count_integers`, the check's number: a class
    index off by 3 is no worse than off by 1) or the largest difference (the audit's);
    for floating results the largest |difference| in float64 / complex128, NaN against
    NaN counting 0. `equal_infinities` (the audit's number) also counts a matching
    infinity 0 on real dtypes, and masks nothing on complex ones; without it a matching
    infinity gives inf - inf = NaN, reported as inf."""
    if got.shape != want.shape:
        return math.inf
    if not (want.dtype.is_floating_point or want.is_complex()):
        if count_integers:
            return float((got != want).sum())
        return float((got.to(torch.float64) - want.to(torch.float64)).abs().max()) if want.numel() else 0.0
    hi = torch.complex128 if want.is_complex() else torch.float64
    d = (got.to(hi) - want.to(hi)).abs()
    if not equal_infinities:
        same = torch.isnan(got) & torch.isnan(want)
    elif want.is_complex():
        same = torch.zeros_like(d, dtype=torch.bool)
    else:
        same = (got.isnan() & want.isnan()) | ((got == want) & want.isinf())
    d = torch.where(same, torch.zeros_like(d), d)
    return float(torch.nan_to_num(d, nan=math.inf).max()) if d.numel() else 0.0
