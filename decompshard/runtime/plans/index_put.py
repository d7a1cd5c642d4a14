"""index_put with accumulate=True where the indices and values are sharded alike: each
rank adds its own values into a `Partial(sum)` result, reduced once where it is read.

The backward of `weight[idx]` (transformers' Mixtral with `experts_implementation=
"batched_mm"` picks each token's expert weights so; embedding-like gathers, routers)
is `grad.new_zeros(weight.shape).index_put([idx], grad, accumulate=True)`: a Replicate
buffer of zeros, and an index and values sharded on the tokens in data parallel.
DTensor's strategy needs the index whole, so it all-to-alls each token's weight gradient
onto a trailing dim and all-gathers the indices, and the weight gradient is then
all-gathered too; DDP all-reduces the expert gradient once. Accumulating is a sum, so
each rank can add its own tokens' values at their (global) indices: the parts add up to
the result, a `Partial(sum)`, with nothing moved. A Replicate `self` is kept whole on the
first rank of each such mesh dim and zero on the others (exactly its value, summed;
DTensor's own Replicate -> Partial divides it instead). A Partial(sum) `self` or values
are parts already.

Per mesh dim, with `k` indexed (leading) dims of `self`, index tensors of one shape `B`
and values of shape `B + self.shape[k:]` (no broadcasting):

    indices Shard(j) | values Shard(j) (j < len(B))   self R or P(sum)      -> P(sum)
    indices R        | values P(sum)                  self R or P(sum)      -> P(sum)
    indices R        | values R                       self P(sum)           -> P(sum)
    indices R        | values Shard/strided of a trailing dim, self alike   -> self's placement
    indices R        | values R                       self R                -> R
    (values R beside indices Shard(j) are chunked alike, free; an input elsewhere is
    first moved to the row's placement, priced)

`scatter_add(self, dim, index, src)` (the backward of `gather`) is the same sum: src's
dim `dim` is the tokens, its other dims are self's, and the index is laid out as src.

Out of place (`index_put`, `scatter_add`) the result is a new tensor and may become
Partial. In place (`index_put_`, `_index_put_impl_`) a write keeps its tensor's
placement: only where `self` already holds the result's placements (a buffer DTensor
itself made Partial), never a Replicate `self` relabelled (`scatter_add_` is written
back through `scatter_add` by support/inplace.py). The price is the moves plus the all-reduce each new
Partial owes where it is read (DDP's reduction of the gradient, once); taken where that
is fewer bytes than DTensor's strategy (`Priced.taken`). The backward (`index` or
`gather` of the gradient for the values) is DTensor's own.
"""

from __future__ import annotations

from typing import Any

import torch

from decompshard._compat import (DTensor, TorchPartial, TorchReplicate, TorchShard, TorchStridedShard, block_spec,
                                 contiguous_spec, local_tensor, spec_dtensor)
from decompshard.runtime.collectives import Priced, Step, kept_on_first, local_at, moves_cost, replicated_args
from decompshard.runtime.records import Plan
from decompshard.mesh.cost import Cost, redistribute_cost

__all__ = ["PLANS"]

_SUM = TorchPartial("sum")
_REP = TorchReplicate()
_INDEX_DTYPES = (torch.int64, torch.int32)


def _is_sum(p: Any) -> bool:
    return isinstance(p, TorchPartial) and p.reduce_op == "sum"


def _shard_dim(p: Any) -> int | None:
    """The tensor dim of a plain Shard or a _StridedShard, None for anything else."""
    return p.dim if type(p) is TorchShard or isinstance(p, TorchStridedShard) else None


def _moved_dim(p: Any, dim: int) -> Any:
    """The same kind of shard (plain or strided, same split factor) on another dim."""
    if isinstance(p, TorchStridedShard):
        return TorchStridedShard(dim, split_factor=p.split_factor)
    return TorchShard(dim)


class _Shapes:
    """index_put's shape facts: `k` indexed (leading) dims of self, index tensors of one
    shape of rank `b` (values dim j < b is token j, values dim v >= b is self's dim
    v - b + k); `ok` False where the plan does not take the call (broadcasting, None or
    mask indices)."""

    def __init__(self, x: Any, indices: Any, values: Any):
        self.ok = False
        if not isinstance(indices, (list, tuple)) or not indices or any(i is None for i in indices):
            return
        shape = tuple(indices[0].shape)
        if any(tuple(i.shape) != shape or i.dtype not in _INDEX_DTYPES for i in indices):
            return
        self.k, self.b = len(indices), len(shape)
        if self.k > x.dim() or tuple(values.shape) != shape + tuple(x.shape[self.k:]):
            return
        self.ok = True

    def indexed(self, self_dim: int) -> bool:
        return self_dim < self.k

    def token(self, value_dim: int) -> bool:
        return value_dim < self.b

    def value_dim(self, self_dim: int) -> int:
        return self_dim - self.k + self.b

    def self_dim(self, value_dim: int) -> int:
        return value_dim - self.b + self.k

    def index_beside(self, values_placement: Any) -> Any:
        """The index's placement beside values sharded on a trailing dim: whole."""
        return _REP


class _ScatterShapes:
    """scatter_add's (`dim`, an index of src's shape, as wide as self off `dim`): src
    dim `dim` is the tokens, any other src dim is self's same dim, and the index is laid
    out as src."""

    def __init__(self, x: Any, dim: Any, index: Any, src: Any):
        self.ok = False
        if not isinstance(dim, int) or x.dim() == 0 or index.dtype != torch.int64 or x.dim() != src.dim():
            return
        self.dim = dim % x.dim()
        if tuple(index.shape) != tuple(src.shape) or any(
                index.shape[d] != x.shape[d] for d in range(x.dim()) if d != self.dim):
            return
        self.ok = True

    def indexed(self, self_dim: int) -> bool:
        return self_dim == self.dim

    def token(self, value_dim: int) -> bool:
        return value_dim == self.dim

    def value_dim(self, self_dim: int) -> int:
        return self_dim

    self_dim = value_dim

    def index_beside(self, values_placement: Any) -> Any:
        return values_placement


def _row(sh: Any, ps: Any, pi: Any, pv: Any) -> tuple | None:
    """One mesh dim's targets (self, index, values) and result placement, and which of
    self / values are kept on the first rank only; None: the plan declines. The index's
    dims are the values' leading (index_put) or all (scatter_add) dims."""
    if not (isinstance(pi, TorchReplicate) or type(pi) is TorchShard):
        return None
    s_dim, v_dim = _shard_dim(ps), _shard_dim(pv)
    if v_dim is None and type(pi) is TorchShard and isinstance(pv, TorchReplicate):
        v_dim, pv = pi.dim, TorchShard(pi.dim)  # sharded by the index: the values alike (a local chunk)
    if s_dim is not None:  # self sharded: only on a trailing dim, the values alike
        if sh.indexed(s_dim):
            return None
        target = _moved_dim(ps, sh.value_dim(s_dim))
        return ps, sh.index_beside(target), target, ps, ""
    if not (isinstance(ps, TorchReplicate) or _is_sum(ps)):
        return None
    if v_dim is not None and not sh.token(v_dim):  # values sharded on a trailing dim: self alike
        if not isinstance(ps, TorchReplicate):
            return None
        target = _moved_dim(pv, sh.self_dim(v_dim))
        return target, sh.index_beside(pv), pv, target, ""
    first = "self" if isinstance(ps, TorchReplicate) else ""
    if v_dim is not None:  # tokens sharded: the index alike
        if isinstance(pv, TorchStridedShard):
            return None
        return ps, TorchShard(v_dim), pv, _SUM, first
    if _is_sum(pv):
        return ps, _REP, pv, _SUM, first
    if not isinstance(pv, TorchReplicate):
        return None
    if _is_sum(ps):
        return ps, _REP, pv, _SUM, "values"
    return ps, _REP, pv, _REP, ""


def _shards_twice(placements: tuple) -> bool:
    """A _StridedShard on a tensor dim another mesh dim shards too (a shard order, not
    blocks: the plan leaves those to DTensor)."""
    dims = [_shard_dim(p) for p in placements]
    return any(isinstance(p, TorchStridedShard) and dims.count(p.dim) > 1 for p in placements)


class _Layout:
    """Where the call's tensors must be for the plan, and the result's placements; `ok`
    False means it declines. `sh`: the op's shape facts (`_Shapes`, `_ScatterShapes`)."""

    def __init__(self, op_call: Any, x: Any, indices: list, values: Any, sh: Any):
        self.ok = False
        mesh = x.device_mesh
        if not sh.ok or values.dtype != x.dtype or len({tuple(i.placements) for i in indices}) != 1:
            return
        rows = [_row(sh, ps, pi, pv) for ps, pi, pv in zip(x.placements, indices[0].placements, values.placements)]
        if any(r is None for r in rows):
            return
        self.x, self.indices, self.values, self.mesh = x, indices, values, mesh
        self.self_pl, self.idx_pl, self.values_pl, self.out = (tuple(r[i] for r in rows) for i in range(4))
        self.first = {w: tuple(m for m, r in enumerate(rows) if r[4] == w) for w in ("self", "values")}
        self.inplace = op_call._schema.is_mutable
        if self.inplace and (self.out != tuple(x.placements) or self.first["self"]):
            return  # a write keeps self's placements: never a Replicate self relabelled
        if any(_shards_twice(p) for p in (self.self_pl, self.idx_pl, self.values_pl, self.out)):
            return
        self.moves = [(x, self.self_pl), *((i, self.idx_pl) for i in indices), (values, self.values_pl)]
        self.ok = True

    def owed(self) -> Cost:
        """The all-reduce each new Partial(sum) owes where the result is read."""
        new = [m for m, (p, q) in enumerate(zip(self.x.placements, self.out)) if _is_sum(q) and not _is_sum(p)]
        if not new:
            return Cost()
        src = tuple(_REP if _is_sum(q) and m not in new else q for m, q in enumerate(self.out))
        dst = tuple(_REP if m in new else q for m, q in enumerate(src))
        return redistribute_cost(tuple(self.x.shape), self.x.dtype.itemsize, src, dst, tuple(self.mesh.shape))

    def locals(self) -> tuple[torch.Tensor, list, torch.Tensor]:
        """This rank's self (its own storage in place), index tensors and values, at the
        plan's placements, a Replicate self or values kept on the first rank only."""
        if self.inplace:
            x = local_tensor(self.x)
        else:
            x = kept_on_first(local_at(self.x, self.mesh, self.self_pl), self.mesh, self.first["self"])
        idx = [local_at(i, self.mesh, self.idx_pl) for i in self.indices]
        values = kept_on_first(local_at(self.values, self.mesh, self.values_pl), self.mesh, self.first["values"])
        return x, idx, values

    def result(self, out: torch.Tensor) -> Any:
        """The out-of-place result, laid out as the plan's `out` placements."""
        out = out.contiguous()
        spec = contiguous_spec(self.mesh, self.out, tuple(self.x.shape), out.dtype)
        if any(isinstance(p, TorchStridedShard) for p in self.out):
            spec = block_spec(self.mesh, self.out, spec.tensor_meta)
        return spec_dtensor(out, spec)


def _dtensors(x: Any, index: list, values: Any) -> list | None:
    """The index tensors as DTensors on self's mesh (a plain one DTensor reads as
    Replicate beside them, as DTensor does), None where some tensor is not there."""
    if not isinstance(x, DTensor) or not isinstance(values, DTensor):
        return None
    index = replicated_args(index, x.device_mesh)
    if not all(isinstance(t, DTensor) and t.device_mesh == x.device_mesh for t in (*index, values)):
        return None
    return list(index)


def _priced(lay: _Layout) -> Priced | None:
    """The inputs' moves to the plan's placements (none where the index and the values
    are sharded alike) and the reduction the Partial result owes."""
    if not lay.ok:
        return None
    size = lay.x.dtype.itemsize
    return Priced((Step("inputs to the plan's placements (index and values sharded alike on the tokens)",
                        moves_cost(lay.moves), size),
                   Step("the Partial(sum) result reduced once where it is read (owed, not run here)",
                        lay.owed(), size)), lay)


def _price_index_put(op_call: Any, args: tuple, kwargs: dict) -> Priced | None:
    x, indices, values = args[:3]
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if accumulate is not True or not isinstance(indices, (list, tuple)):
        return None
    index = _dtensors(x, list(indices), values)
    if index is None:
        return None
    return _priced(_Layout(op_call, x, index, values, _Shapes(x, index, values)))


def _index_put(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
    lay = priced.context
    x, idx, values = lay.locals()
    if lay.inplace:
        x.index_put_(idx, values, accumulate=True)
        return args[0]
    return lay.result(x.index_put(idx, values, accumulate=True))


def _price_scatter_add(op_call: Any, args: tuple, kwargs: dict) -> Priced | None:
    x, dim, index, src = args[:4]
    found = _dtensors(x, [index], src)
    if found is None:
        return None
    return _priced(_Layout(op_call, x, found, src, _ScatterShapes(x, dim, found[0], src)))


def _scatter_add(op_call: Any, args: tuple, kwargs: dict, priced: Priced) -> Any:
    lay = priced.context
    x, idx, src = lay.locals()
    return lay.result(x.scatter_add(args[1], idx[0], src))


PLANS = (
    Plan(("aten.index_put.default", "aten.index_put_.default", "aten._index_put_impl_.default"),
         "index_put with accumulate=True, indices and values sharded alike on the tokens (each rank adds its own "
         "values into a Partial(sum) result, reduced once where it is read)",
         "accumulate=True; index tensors of one shape (no None, no mask) and values of the indexed shape; per mesh "
         "dim indices and values Shard of one token dim (or values Partial(sum)) with self Replicate or Partial(sum), "
         "or self and values sharded alike on a trailing dim; in place only where self keeps its placements",
         _price_index_put, _index_put),
    Plan(("aten.scatter_add.default",),
         "scatter_add with index and src sharded alike along `dim` (each rank adds its own rows into a Partial(sum) "
         "result, reduced once where it is read; the backward of gather)",
         "an index of src's shape, as wide as self off `dim`; per mesh dim index and src Shard(dim) (or src "
         "Partial(sum)) with self Replicate or Partial(sum), or self, index and src sharded alike on another dim",
         _price_scatter_add, _scatter_add),
)
