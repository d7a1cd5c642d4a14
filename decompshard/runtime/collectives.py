"""What the collective plans share: per-row statistics reduced across the ranks that share
a row, moves by DTensor's own collectives, and the price of both in the cost model's unit.

An op that reduces along a dim (softmax's max and exp-sum, a norm's mean and variance,
a loss's picked logit) cannot run on a shard of that dim alone, so DTensor's single-op
strategies move the whole activation there first. Reducing only the per-row statistics
(one number per row, keepdim) across the mesh dims that shard the dim gives the same
result while the activation stays where it is, as Megatron's and torchtitan's
hand-written plans do. The statistic is a `Partial(op)` on those mesh dims, moved to
`Replicate` by DTensor's own redistribution, so LocalTensorMode runs it and
CommDebugMode counts it.

Decision rule (`Priced.taken`, `cheaper_than_dtensor`): from global shapes, placements
and the mesh only, so every rank decides alike, the plan is priced with `mesh/cost.py`
against DTensor's chosen strategy's input moves, and taken where it moves fewer bytes (a
tie goes to DTensor) or where its own rule says so (`Priced.verdict`).

A plan runs on DTensor's Python handler path, where DTensor's own strategy runs through
its cached dispatch, so per-call work is kept to what the call needs: the decision is
remembered per (op, argument specs and values), as DTensor caches its own
(`forget_decisions` when `enable()`'s tables change), and a statistic is reduced with
DTensor's local redistribution directly, with no DTensor or autograd node around it.
Per-call timings: docs/results.md, bench/handler_dispatch.py.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch

from decompshard._compat import (DTensor, TorchPartial, TorchReplicate, TorchShard, contiguous_spec, dtensor_planned_moves,
                                 dtensor_spec, implicitly_replicated, local_tensor, redistribute_local_tensor,
                                 slab_index, unsharded_dtensor)
from decompshard.dispatch_modes.graph import freeze, map_leaves
from decompshard.mesh.cost import Cost, bytes_key, redistribute_cost

__all__ = ["ROWS_SHARDED", "Priced", "Stat", "Step", "cheaper_than_dtensor", "dtensor_cost", "every_rank_holds_slab", "fewer_bytes",
           "kept_on_first", "local_at", "forget_decisions", "moved_local", "moves_cost",
           "reduce_scalars", "replicated_args",
           "row_placements", "scalars_cost", "sharding_dims"]


# what the per-row plans (softmax, layer norm) take, as `explain` prints it
ROWS_SHARDED = "a Shard of the reduced dim on some mesh dim, the other mesh dims Shard of other dims or Replicate"

def sharding_dims(placements: Sequence[Any], dims: Iterable[int]) -> tuple[int, ...] | None:
    """The mesh dims that shard any of the tensor `dims` (plain `Shard` only); None when
    some placement is neither Shard nor Replicate (a Partial input, a strided shard):
    those go to DTensor unchanged."""
    dims = set(dims)
    found = []
    for i, p in enumerate(placements):
        if type(p) is TorchShard:
            if p.dim in dims:
                found.append(i)
        elif not isinstance(p, TorchReplicate):
            return None
    return tuple(found)


def every_rank_holds_slab(size: int, n: int) -> bool:
    """torch.chunk gives every one of n ranks a non-empty slab of `size` elements (a plan
    that indexes into its slab needs one: an empty slab has no row to point at)."""
    if size < n:
        return False
    chunk = -(-size // n)
    return -(-size // chunk) == n


def local_at(t: Any, mesh: Any, placements: tuple) -> torch.Tensor:
    """This rank's local tensor of DTensor `t` moved to `placements` (as it is where it is
    there already): how a plan lays out an argument it reads whole or sharded its way."""
    if tuple(t.placements) != tuple(placements):
        t = t.redistribute(mesh, placements)
    return local_tensor(t)


def kept_on_first(local: torch.Tensor, mesh: Any, mesh_dims: Sequence[int]) -> torch.Tensor:
    """`local` on the ranks whose coordinate is 0 on every one of `mesh_dims`, zeros on the
    others: a Replicate tensor's part of a `Partial(sum)` on those mesh dims, exactly (the
    parts add up to it; inf and NaN stay whole on the first rank, where DTensor's own
    Replicate -> Partial divides by the group's size). Each rank reads its coordinate
    as LocalTensorMode simulates it (`slab_index` of index 0 into slabs of one)."""
    if not mesh_dims:
        return local
    zero = torch.zeros(1, dtype=torch.long, device=local.device)
    away = None
    for m in mesh_dims:
        _, outside = slab_index(zero, mesh.size(m), mesh, m)
        away = outside if away is None else away | outside
    return torch.where(away.reshape(()), torch.zeros((), dtype=local.dtype, device=local.device), local)


def replicated_args(values: Sequence[Any], mesh: Any) -> tuple:
    """`values` with each plain tensor that DTensor takes as Replicate beside DTensors
    (`implicitly_replicated`: a one-element tensor, or any under `implicit_replication()`)
    made a Replicate DTensor on `mesh`, the others as they are. A plan's handler gets a
    call's arguments raw, so a plain target (transformers' labels under
    `implicit_replication()`) reaches it plain where DTensor's own path would see
    `Replicate`: the plan reads it as DTensor does."""
    rep = (TorchReplicate(),) * mesh.ndim
    return tuple(unsharded_dtensor(v, mesh, rep)
                 if isinstance(v, torch.Tensor) and not isinstance(v, DTensor) and implicitly_replicated(v) else v
                 for v in values)


def row_placements(placements: Sequence[Any], reduced: Iterable[int]) -> tuple[Any, ...]:
    """The placements of a statistic over the `reduced` dims (kept as size 1): the mesh
    dims sharding them become Replicate, the others stay."""
    reduced = set(reduced)
    return tuple(TorchReplicate() if type(p) is TorchShard and p.dim in reduced else p for p in placements)


class Stat:
    """Where the per-row statistics of one tensor live: its mesh, the mesh dims sharding
    the reduced dims, the statistic's global shape and placements (after reduction)."""

    def __init__(self, mesh: Any, placements: Sequence[Any], shape: Sequence[int], reduced: Iterable[int]):
        reduced = tuple(reduced)
        self.mesh = mesh
        self.mesh_dims = sharding_dims(placements, reduced) or ()
        self.shape = tuple(1 if d in reduced else int(s) for d, s in enumerate(shape))
        self.placements = row_placements(placements, reduced)

    def partial(self, op: str) -> tuple[Any, ...]:
        return tuple(TorchPartial(op) if i in self.mesh_dims else p for i, p in enumerate(self.placements))

    def cost(self, ops: Sequence[str], itemsize: int, width: int = 1) -> Cost:
        """The all-reduces of `ops` (one per op; `width` statistics stacked in each)."""
        shape = self.shape if width == 1 else (*self.shape, width)
        total = Cost()
        for op in ops:
            total = total + redistribute_cost(shape, itemsize, self.partial(op), self.placements,
                                              tuple(self.mesh.shape))
        return total

    def reduce(self, local: torch.Tensor, op: str) -> torch.Tensor:
        """This rank's part of a statistic (`local`, keepdim over the reduced dims, possibly
        a trailing stack dim), reduced with `op` over the ranks that share its rows: the
        local result of an all-reduce DTensor runs."""
        shape = self.shape if local.dim() == len(self.shape) else (*self.shape, local.shape[-1])
        return moved_local(local, self.mesh, self.partial(op), self.placements, shape)


def moved_local(local: torch.Tensor, mesh: Any, src: Sequence[Any], dst: Sequence[Any],
                shape: Sequence[int]) -> torch.Tensor:
    """This rank's `local` part of a contiguous tensor of global `shape`, moved from
    placements `src` to `dst` with DTensor's own collectives (no DTensor or autograd node
    around it). The specs are made once per layout (a spec costs more to build than a
    small statistic's all-reduce takes to issue), per mesh object, not per equal mesh: a
    spec carries its mesh's process groups, and an equal mesh made after a process group
    was destroyed has other groups."""
    specs = _move_specs(id(mesh), mesh, tuple(src), tuple(dst), tuple(shape), local.dtype)
    return redistribute_local_tensor(local, *specs)


@functools.lru_cache(maxsize=1024)
def _move_specs(mesh_id: int, mesh: Any, src: tuple, dst: tuple, shape: tuple, dtype: torch.dtype
                ) -> tuple[Any, Any]:
    return (contiguous_spec(mesh, src, shape, dtype), contiguous_spec(mesh, dst, shape, dtype))


def reduce_scalars(local: torch.Tensor, mesh: Any, mesh_dims: Sequence[int], op: str = "sum") -> torch.Tensor:
    """A small tensor (a loss, its total weight) every rank holds a part of along
    `mesh_dims`, reduced with `op` there, one mesh dim at a time (DTensor warns about
    reducing several unflattened mesh dims at once, and runs them one at a time anyway)."""
    rep = (TorchReplicate(),) * mesh.ndim
    for d in mesh_dims:
        parts = tuple(TorchPartial(op) if i == d else TorchReplicate() for i in range(mesh.ndim))
        local = moved_local(local, mesh, parts, rep, local.shape)
    return local


def scalars_cost(mesh: Any, mesh_dims: Sequence[int], itemsize: int, shape: Sequence[int] = ()) -> Cost:
    """The price of `reduce_scalars` on a tensor of `shape`."""
    return _scalars_cost(mesh, tuple(mesh_dims), itemsize, tuple(shape))


@functools.lru_cache(maxsize=1024)
def _scalars_cost(mesh: Any, mesh_dims: tuple[int, ...], itemsize: int, shape: tuple) -> Cost:
    rep = [TorchReplicate()] * mesh.ndim
    total = Cost()
    for d in mesh_dims:
        parts = [TorchPartial("sum") if i == d else TorchReplicate() for i in range(mesh.ndim)]
        total = total + redistribute_cost(tuple(shape), itemsize, parts, rep, tuple(mesh.shape))
    return total


def moves_cost(moves: Iterable[tuple[Any, Sequence[Any]]]) -> Cost:
    """The price of redistributing DTensors to placements: (DTensor or spec, placements)."""
    total = Cost()
    for x, target in moves:
        spec = dtensor_spec(x) if isinstance(x, DTensor) else x
        if tuple(spec.placements) == tuple(target):
            continue
        meta = spec.tensor_meta
        total = total + redistribute_cost(tuple(meta.shape), meta.dtype.itemsize, tuple(spec.placements),
                                          tuple(target), tuple(spec.mesh.shape))
    return total


def dtensor_cost(op_call: Any, args: tuple, kwargs: dict) -> Cost | None:
    """What DTensor's own strategy for this call moves (its input redistributions, priced
    by the project's cost model); None where DTensor has no strategy at all."""
    planned = dtensor_planned_moves(op_call, args, kwargs)
    if planned is None:
        return None
    return moves_cost((src, tuple(dst.placements)) for src, dst in planned if dst is not None)


def cheaper_than_dtensor(plan: Cost, op_call: Any, args: tuple, kwargs: dict) -> bool:
    """The plan moves fewer bytes than DTensor's own strategy for this call (its input
    moves, priced by the same cost model); True where DTensor has no strategy at all.

    Bytes, not the model's time: at small sizes one all-gather's launch beats two
    all-reduces' in time although it moves the whole row; the bytes are what grows with
    the activation (and what a gathered copy costs in memory), and what the zoo compares
    with the expert's plan (check/expert_bytes.py). A tie goes to DTensor."""
    key = _decision_key(op_call, args, kwargs, plan.bytes_moved)
    if key is not None and key in _DECISIONS:
        return _DECISIONS[key]
    native = dtensor_cost(op_call, args, kwargs)
    cheaper = native is None or fewer_bytes(plan, native)
    if key is not None:
        if len(_DECISIONS) >= _MAX_DECISIONS:
            _DECISIONS.clear()
        _DECISIONS[key] = cheaper
    return cheaper


def fewer_bytes(plan: Cost, other: Cost) -> bool:
    """The one comparison every plan decides by: the plan sends fewer bytes over the
    network than the other way (the cost model's `wire_bytes`, to its rounding), or as
    many and copies fewer locally (`local_bytes`); a full tie goes to the other way,
    DTensor's own. Network bytes first: a local copy runs at memory bandwidth, so summing
    it with network bytes 1:1 would let a weight's chunk-and-cat copy outweigh an
    all-reduce four times its size."""
    return (bytes_key(plan.wire_bytes), bytes_key(plan.local_bytes)) < \
        (bytes_key(other.wire_bytes), bytes_key(other.local_bytes))


_DECISIONS: dict[Any, bool] = {}
_MAX_DECISIONS = 4096


def _spec_or_value(x: Any) -> Any:
    if isinstance(x, DTensor):
        return dtensor_spec(x)  # global shape, strides, dtype, placements, mesh: all the decision reads
    if isinstance(x, torch.Tensor):
        if implicitly_replicated(x):  # DTensor reads it as Replicate on the call's mesh
            return ("implicitly replicated", tuple(x.shape), tuple(x.stride()), x.dtype)
        raise TypeError("a plain tensor DTensor refuses has no value key")
    return x


def _decision_key(op_call: Any, args: tuple, kwargs: dict, plan_bytes: Any) -> Any:
    """What `cheaper_than_dtensor` decides from, hashable; None where an argument is not
    (a plain tensor DTensor does not take as Replicate, an unhashable value): that call
    decides afresh."""
    try:
        key = (op_call, freeze(map_leaves(_spec_or_value, (args, kwargs))), plan_bytes)
        hash(key)
    except TypeError:
        return None
    return key


def forget_decisions() -> None:
    """Drop remembered decisions: DTensor's own strategy, the other side of each, changes
    with what `enable()` installs (the guard, the pricing)."""
    _DECISIONS.clear()


@dataclass(frozen=True)
class Step:
    """One thing a plan moves, in words, with its price (`explain` prints these)."""

    what: str
    cost: Cost
    itemsize: int


@dataclass(frozen=True)
class Priced:
    """A plan's price for one call, computed before it runs: the steps that move
    something, and what the plan computed to price them (`context`, reused to run it).
    `verdict`: the plan's own decision where it needs no comparison (evaluation-mode batch
    norm, a depthwise conv: nothing moves); None: it takes the call when it moves fewer
    bytes than DTensor's way, both priced by the cost model. `against`: DTensor's way
    priced by the plan itself, where the input moves DTensor's strategy reports miss part
    of it (a layout moved and moved back around the op, gathers that recur in the
    backward); None: DTensor's strategy's input moves (`cheaper_than_dtensor`). `rule`
    says how it decides, for `explain`."""

    steps: tuple[Step, ...]
    context: Any = None
    verdict: bool | None = None
    rule: str = "fewer bytes than DTensor's strategy (the cost model's bytes; a tie goes to DTensor)"
    against: Cost | None = None

    @property
    def cost(self) -> Cost:
        total = Cost()
        for s in self.steps:
            total = total + s.cost
        return total

    def taken(self, op_call: Any, args: tuple, kwargs: dict) -> bool:
        """Whether the plan runs this call (else DTensor's path, or the guard's, does)."""
        if self.verdict is not None:
            return self.verdict
        if self.against is not None:
            return fewer_bytes(self.cost, self.against)
        return cheaper_than_dtensor(self.cost, op_call, args, kwargs)
