"""Packed projections kept sharded: `split` of a `_StridedShard` into its blocks, `cat`
of equal shards back into one, decided where DTensor decides (its sharding propagation).

A packed projection (GPT-2's `c_attn` holding q, k and v; Mixtral's experts' `gate_up`)
sharded Megatron-style is `_StridedShard(d, k)`: dim d is k blocks and every rank holds
its chunk of each block, one after the other. Its output is split into the blocks right
away (`q, k, v = qkv.split(n, d)`, `gate, up = h.chunk(2, d)`), and in the backward the
blocks' gradients are concatenated again. Each rank already holds its chunk of every
block, so both are local:

* `split(x, B, d)` of `_StridedShard(d, k)` into j = size/B pieces (j dividing k) gives
  each piece `_StridedShard(d, k/j)`, `Shard(d)` where j = k, when each rank's local
  tensor is split by B/n (n ranks on that mesh dim);
* `cat` of k tensors of one shape and placements, each `Shard(d)`, along d gives
  `_StridedShard(d, k)`, the local tensors concatenated as they are.

DTensor's own strategies for split and cat have neither (on 2.13's full-mesh strategy
functions nor on the single-dim rules of 2.14+): they all-gather the projection's output
forward and the blocks' gradients backward, and the next matmul gathers the packed
weight (Mixtral tensor parallel: 160.8 KiB where Megatron moves 64.5).

Each override takes DTensor's own answer and replaces it only when the layout is
exactly the one above, evenly: every block's size divisible by n, d sharded on that one
mesh dim alone. An uneven block, a split across blocks, a second mesh dim on d keep
DTensor's answer. The replacement moves nothing and carries the local split size the
way DTensor carries a view's local shape (`_compat.local_call_sharding`), so the op
stays on DTensor's cached dispatch path: the override runs once per op schema.
`disable()` removes the overrides.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch

from decompshard._compat import DTensorSpec, TorchShard, TorchStridedShard, block_spec, local_call_sharding, sharding_overrides
from decompshard.runtime.table_patches import Entry, WarnOnce

__all__ = ["entries"]

aten = torch.ops.aten


def entries(warn: WarnOnce) -> Iterator[Entry]:
    """What `enable()` puts where: an override of DTensor's answer for split and cat."""
    table = sharding_overrides()
    yield table, aten.split.Tensor, _split_override
    yield table, aten.split_with_sizes.default, _split_override
    yield table, aten.cat.default, _cat_override


def _dim_arg(op_schema: Any, index: int) -> Any:
    args = op_schema.args_schema
    return args[index] if len(args) > index else op_schema.kwargs_schema.get("dim", 0)


def _only_mesh_dim_on(placements: Sequence[Any], d: int) -> int | None:
    """The one mesh dim whose placement shards tensor dim d; None for none or several."""
    found = [m for m, p in enumerate(placements) if isinstance(p, (TorchShard, TorchStridedShard)) and p.dim == d]
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
    src = args[0] if args else None
    if len(args) < 2 or not isinstance(src, DTensorSpec) or src.tensor_meta is None:
        return sharding
    shape = src.tensor_meta.shape
    dim = _dim_arg(op_schema, 2)
    if not shape or type(dim) is not int:
        return sharding
    d = dim % len(shape)
    m = _only_mesh_dim_on(src.placements, d)
    p = src.placements[m] if m is not None else None
    if type(p) is not TorchStridedShard or type(shape[d]) is not int:
        return sharding
    n, k, size = src.mesh.size(m), p.split_factor, shape[d]
    pieces = _pieces(op_schema, size)
    outs = sharding.output_spec
    if (pieces is None or size % k or (size // k) % n or len(set(pieces)) != 1 or k % len(pieces)
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
