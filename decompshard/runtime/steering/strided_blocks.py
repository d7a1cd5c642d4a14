"""Packed projections kept sharded in their blocks: `split` of a `_StridedShard` into its
blocks, `cat` of equal shards back into one, decided where DTensor decides (its sharding
propagation).

A packed projection (GPT-2's `c_attn` holding q, k and v; Mixtral's experts' `gate_up`)
sharded Megatron-style is `_StridedShard(d, k)`: dim d is k blocks and every rank holds
its chunk of each block. Its output is split into the blocks at once, and in backward the
blocks' gradients are concatenated again. DTensor's strategies for split and cat (2.13's
full-mesh strategy functions and the single-dim rules of 2.14+ alike) have no such
layout: they all-gather the output forward and the gradients backward, and the next
matmul gathers the packed weight. Each rank already holds its chunk of every block, so
all of it is local (n ranks on the mesh dim):

* `split(x, B, d)` into j = size/B pieces (j dividing k): each `_StridedShard(d, k/j)`,
  `Shard(d)` where j = k, each rank's local tensor split by B/n;
* `cat` along d of k tensors of one shape, each `Shard(d)`: `_StridedShard(d, k)`;
* `slice(x, d, start, end)` of j whole blocks (cat's backward): `_StridedShard(d, j)`
  (`Shard(d)` for one), each rank slicing start/n to end/n;
* `mm(a, w)`, `w` `_StridedShard(0, k)`, `a` replicated on that mesh dim: `a` sliced the
  same strided way times each rank's rows of `w` is `Partial(sum)`. DTensor gathers `w`
  there (it prices moving a strided view at nothing), so this replaces its answer only
  where the Partial's later all-reduce is priced below the weight's gather (the cost
  model's bytes): a column-parallel projection's input gradient, as Megatron computes it.

Each override replaces DTensor's answer only for exactly these layouts, evenly: every
block's size divisible by n, d sharded on that one mesh dim alone. An uneven block, a
split across blocks or a second mesh dim on d keep DTensor's answer. The replacement
moves nothing and carries the local split size as DTensor carries a view's local shape
(`_compat.local_call_sharding`), so the op stays on DTensor's cached dispatch path.
`disable()` removes the overrides. Tests: tests/test_strided_blocks.py.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from decompshard._compat import (DTensorSpec, TorchPartial, TorchReplicate, TorchShard, TorchStridedShard, block_spec,
                                 local_call_sharding)
from decompshard.mesh.cost import Cost, redistribute_cost
from decompshard.runtime.collectives import fewer_bytes
from decompshard.runtime.support.kwarg_routing import sharding_overrides
from decompshard.runtime.table_patches import Entry, WarnOnce

__all__ = ["entries"]

aten = torch.ops.aten


def entries(warn: WarnOnce) -> Iterator[Entry]:
    """What `enable()` puts where: an override of DTensor's answer for split, cat, slice
    and mm (`disable()` takes them out with the rest)."""
    table = sharding_overrides()
    yield table, aten.split.Tensor, _split_override
    yield table, aten.split_with_sizes.default, _split_override
    yield table, aten.cat.default, _cat_override
    yield table, aten.slice.Tensor, _slice_override
    yield table, aten.mm.default, _mm_override


def _dim_arg(op_schema: Any, index: int) -> Any:
    args = op_schema.args_schema
    return args[index] if len(args) > index else op_schema.kwargs_schema.get("dim", 0)


def _only_mesh_dim_on(placements: Sequence[Any], d: int) -> int | None:
    """The one mesh dim whose placement shards tensor dim d; None for none or several."""
    found = [m for m, p in enumerate(placements) if _shards(p, d)]
    return found[0] if len(found) == 1 else None


def _pieces(op_schema: Any, size: int) -> list[int] | None:
    """The split's piece sizes (all ints), or None."""
    arg = op_schema.args_schema[1]
    if op_schema.op is aten.split.Tensor:
        if type(arg) is not int or arg <= 0 or size % arg:
            return None
        return [arg] * (size // arg)
    if not isinstance(arg, (list, tuple)) or not all(type(s) is int for s in arg):
        return None
    return list(arg)


def _split_override(op_schema: Any, sharding: Any) -> Any:
    """DTensor's answer, or each piece a local split of the strided blocks (module doc)."""
    args = op_schema.args_schema
    found = _strided_on(args[0], _dim_arg(op_schema, 2)) if len(args) >= 2 else None
    if found is None:
        return sharding
    src = args[0]
    d, m, n, block = found
    k = src.placements[m].split_factor
    pieces = _pieces(op_schema, src.tensor_meta.shape[d])
    outs = sharding.output_spec
    if (pieces is None or len(set(pieces)) != 1 or k % len(pieces)
            or not isinstance(outs, (list, tuple)) or len(outs) != len(pieces)):
        return sharding
    per = k // len(pieces)
    placements = list(src.placements)
    placements[m] = TorchShard(d) if per == 1 else TorchStridedShard(d, split_factor=per)
    specs = tuple(block_spec(src.mesh, placements, o.tensor_meta) for o in outs)
    local = pieces[0] // n if op_schema.op is aten.split.Tensor else [s // n for s in pieces]
    return local_call_sharding(op_schema, specs, (src, local, *args[2:]))


def _cat_override(op_schema: Any, sharding: Any) -> Any:
    """DTensor's answer, or the cat of k equal `Shard(d)` blocks as `_StridedShard(d, k)`."""
    tensors = op_schema.args_schema[0] if op_schema.args_schema else None
    dim = _dim_arg(op_schema, 1)
    if not isinstance(tensors, (list, tuple)) or len(tensors) < 2 or type(dim) is not int:
        return sharding
    first = tensors[0]
    if not all(isinstance(t, DTensorSpec) and t.tensor_meta is not None for t in tensors):
        return sharding
    shape = first.tensor_meta.shape
    same = all(t.mesh == first.mesh and t.placements == first.placements and t.tensor_meta.shape == shape
               and t.tensor_meta.dtype == first.tensor_meta.dtype for t in tensors)
    if not same or not shape or not isinstance(sharding.output_spec, DTensorSpec):
        return sharding
    d = dim % len(shape)
    m = _only_mesh_dim_on(first.placements, d)
    if m is None or type(first.placements[m]) is not TorchShard:
        return sharding
    if type(shape[d]) is not int or shape[d] == 0 or shape[d] % first.mesh.size(m):
        return sharding
    placements = list(first.placements)
    placements[m] = TorchStridedShard(d, split_factor=len(tensors))
    return local_call_sharding(op_schema, block_spec(first.mesh, placements, sharding.output_spec.tensor_meta))


def _strided_on(src: Any, dim: Any) -> tuple[int, int, int, int] | None:
    """(tensor dim d, mesh dim, ranks n on it, block size) where `src` is
    `_StridedShard(d, k)` on one mesh dim alone, d sharded nowhere else, every block
    divisible by n; else None."""
    if not isinstance(src, DTensorSpec) or src.tensor_meta is None or type(dim) is not int:
        return None
    shape = src.tensor_meta.shape
    if not shape:
        return None
    d = dim % len(shape)
    m = _only_mesh_dim_on(src.placements, d)
    p = src.placements[m] if m is not None else None
    if type(p) is not TorchStridedShard or type(shape[d]) is not int or shape[d] % p.split_factor:
        return None
    n, block = src.mesh.size(m), shape[d] // p.split_factor
    return (d, m, n, block) if block and block % n == 0 else None


def _slice_override(op_schema: Any, sharding: Any) -> Any:
    """DTensor's answer, or a slice of whole blocks taken on each rank's own chunks."""
    args = list(op_schema.args_schema) + [None] * 4
    if op_schema.kwargs_schema or len(op_schema.args_schema) > 5:
        return sharding
    src, dim, start, end, step = args[0], args[1] if len(op_schema.args_schema) > 1 else 0, args[2], args[3], args[4]
    found = _strided_on(src, dim)
    if found is None or step not in (None, 1) or not isinstance(sharding.output_spec, DTensorSpec):
        return sharding
    d, m, n, block = found
    size = src.tensor_meta.shape[d]
    if not all(v is None or type(v) is int for v in (start, end)):
        return sharding
    lo = 0 if start is None else min(max(start + size if start < 0 else start, 0), size)
    hi = size if end is None else min(max(end + size if end < 0 else end, 0), size)
    if hi <= lo or lo % block or hi % block:
        return sharding
    blocks = (hi - lo) // block
    placements = list(src.placements)
    placements[m] = TorchShard(d) if blocks == 1 else TorchStridedShard(d, split_factor=blocks)
    spec = block_spec(src.mesh, placements, sharding.output_spec.tensor_meta)
    local = (src, dim, lo // n, hi // n, 1)
    return local_call_sharding(op_schema, spec, local[:max(len(op_schema.args_schema), 4)])


def _mm_override(op_schema: Any, sharding: Any) -> Any:
    """DTensor's answer, or a replicated `a` sliced to the strided rows of `w` (module doc)."""
    a, w = (op_schema.args_schema + (None, None))[:2]
    rs = sharding.redistribute_schema
    if not sharding.needs_redistribute or rs is None or not isinstance(sharding.output_spec, DTensorSpec):
        return sharding
    found = _strided_on(w, 0)
    if found is None or not isinstance(a, DTensorSpec) or len(a.tensor_meta.shape) != 2:
        return sharding
    _, m, n, _ = found
    to_a, to_w = rs.args_schema[:2]
    if type(a.placements[m]) is not TorchReplicate or to_w.placements[m] == w.placements[m]:
        return sharding
    others = [j for j in range(len(w.placements)) if j != m]
    if any(_shards(to_a.placements[j], 1) or _shards(to_w.placements[j], 0) for j in others):
        return sharding  # the contracted dim sharded on another mesh dim too: keep DTensor's
    out = sharding.output_spec
    if not fewer_bytes(_on_mesh_dim(out, m, TorchPartial("sum"), TorchReplicate()),
                       _on_mesh_dim(to_w, m, w.placements[m], TorchReplicate())):
        return sharding  # the Partial's all-reduce would cost more than the gather
    k = w.placements[m].split_factor
    new_a = list(to_a.placements)
    new_a[m] = TorchStridedShard(1, split_factor=k)
    new_w = list(to_w.placements)
    new_w[m] = w.placements[m]
    new_out = list(out.placements)
    new_out[m] = TorchPartial("sum")
    args = (block_spec(a.mesh, new_a, a.tensor_meta),
            w if tuple(new_w) == tuple(w.placements) else block_spec(w.mesh, new_w, w.tensor_meta))
    return local_call_sharding(op_schema, block_spec(out.mesh, new_out, out.tensor_meta), args)


def _shards(p: Any, d: int) -> bool:
    return isinstance(p, (TorchShard, TorchStridedShard)) and p.dim == d


def _on_mesh_dim(spec: Any, m: int, src: Any, dst: Any) -> Cost:
    """The cost model's price of moving `spec`'s tensor from `src` to `dst` on mesh dim
    `m`, its other mesh dims as `spec` places them."""
    placements = list(spec.placements)
    meta = spec.tensor_meta
    before, after = placements.copy(), placements.copy()
    before[m], after[m] = src, dst
    return redistribute_cost(tuple(meta.shape), meta.dtype.itemsize, tuple(before), tuple(after),
                             tuple(spec.mesh.shape))