"""Strided shards inside a traced graph: the views that make and unmake them, and the
placeholder rules that carry them.

Decompositions reshape to 3-D for bmm/mm: attention flattens [B, H, L, E] to
[B*H, L, E], a linear on [B, S, D] flattens to [B*S, D]. A shard of H (or S) then lies
on a factor of the flattened dim, which no plain S(d) describes; DTensor calls it
`_StridedShard(0, sf=B)`. The batched op keeps that layout, and the view back makes it
S(1) again (placements.StridedShard, with `inner` for a shard of the first dim of a
flattened group, such as B).

- `view_placement` is exact layout algebra for row-major views (view, _unsafe_view,
  reshape): where the sharded factor lands in the new shape, for even and uneven shards;
  None when a view splits the sharded factor itself.
- `view_rules` gives a view primitive its rules from plain S(d) inputs; `annotate`
  records on every node of a trace which strided kinds may reach it, and `kind_rules`
  adds, for those, the view rules from them and the placeholder rules filled with them
  (the registry appends them to the node's table, so the solver and explain see one
  table per node as always). A placeholder S(d) means "any sharding kind,
  the same for every sharded argument" (torch's single-dim design: a bmm on
  _StridedShard inputs gives a _StridedShard output). The fill is only made when every
  sharded argument's dim has the same size, so the layout (which elements each rank
  holds) is the same partition for all of them; views get the algebra instead.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import torch

from ..dispatch_modes.graph import PrimGraph, PrimNode
from ..placements import (
    MaybePlacement,
    ShardPlaceholder,
    SingleDimRule,
    StridedShard,
    is_shard,
    is_strided,
    sharded_on,
)

aten = torch.ops.aten
SOURCE = "decompshard strided view"
FILL_SOURCE = "placeholder filled with a strided shard"

# Row-major reinterpretations of their input: output element i is input element i.
VIEW_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.view_copy.default,
}


def view_placement(in_shape: Sequence[int], out_shape: Sequence[int], p: MaybePlacement) -> MaybePlacement:
    """The placement a row-major view of a value sharded as `p` has, or None when no
    single-dim placement describes it (the view splits the sharded factor).

    In the flat element order, the shard of `p` is a factor of `a` units: every element
    index is o * (a * I) + i * I + t with the rank chosen by i alone (chunked), where O
    blocks precede it and I elements follow it. A view keeps that order, so the output
    dim e that holds the factor whole (the dims before e multiply to a divisor of O, the
    dims after it to a divisor of I) is sharded as StridedShard(e, O / before, I / after).
    """
    if not is_shard(p) or any(n == 0 for n in in_shape) or any(n == 0 for n in out_shape):
        return None
    k = p.dim
    if k >= len(in_shape) or math.prod(in_shape) != math.prod(out_shape):
        return None
    sf, inner = (p.sf, p.inner) if is_strided(p) else (1, 1)
    size = in_shape[k]
    if size % (sf * inner):
        return None
    a = size // (sf * inner)
    if a < 2:
        return None  # nothing is split (a size-1 factor): leave it to the plain rules
    outer = math.prod(in_shape[:k]) * sf
    tail = inner * math.prod(in_shape[k + 1:])
    before = 1
    for e, n in enumerate(out_shape):
        after = math.prod(out_shape[e + 1:])
        if outer % before == 0 and tail % after == 0 and (outer // before) * a * (tail // after) == n:
            return sharded_on(e, outer // before, tail // after)
        before *= n
    return None


def view_rules(node: PrimNode) -> list[SingleDimRule]:
    """A view's rules from plain S(d) inputs, by the layout algebra (exact for uneven
    shards, where torch's view strategy assumes even ones)."""
    if node.op not in VIEW_OPS or len(node.inputs) != 1 or len(node.outputs) != 1:
        return []
    meta, out = node.input_metas()[0], node.out_metas[0]
    if out is None:
        return []
    rules = []
    for d in range(len(meta.shape)):
        q = view_placement(meta.shape, out.shape, ShardPlaceholder(d))
        if q is not None:
            rules.append(SingleDimRule((ShardPlaceholder(d),), (q,), source=SOURCE))
    return rules


def kind_rules(node: PrimNode, table: Sequence[SingleDimRule]) -> list[SingleDimRule]:
    """Rules for the strided shards that may reach the node (`node.strided_in`, from
    `annotate`): a view's from the layout algebra, anything else's by filling its
    placeholder rules."""
    kinds = sorted(node.strided_in)
    if not kinds:
        return []
    in_metas, out_metas = node.input_metas(), node.out_metas
    if node.op in VIEW_OPS:
        if len(node.inputs) != 1 or len(node.outputs) != 1 or out_metas[0] is None:
            return []
        rules = []
        for p in _strided_on(in_metas[0].shape, kinds):
            q = view_placement(in_metas[0].shape, out_metas[0].shape, p)
            if q is not None:
                rules.append(SingleDimRule((p,), (q,), source=SOURCE))
        return rules
    rules = []
    for rule in table:
        if not any(isinstance(p, ShardPlaceholder) for p in rule.inputs) or any(is_strided(p) for p in rule.inputs + rule.outputs):
            continue
        sizes = {
            m.shape[p.dim]
            for p, m in list(zip(rule.inputs, in_metas)) + list(zip(rule.outputs, out_metas))
            if isinstance(p, ShardPlaceholder) and m is not None
        }
        if len(sizes) != 1:
            continue
        size = sizes.pop()
        for sf, inner in kinds:
            if size % (sf * inner) or size // (sf * inner) < 2:
                continue
            fill = lambda ps: tuple(  # noqa: E731
                StridedShard(p.dim, sf, inner) if isinstance(p, ShardPlaceholder) else p for p in ps)
            rules.append(SingleDimRule(fill(rule.inputs), fill(rule.outputs), rule.even_only, FILL_SOURCE))
    return rules


def _strided_on(shape: Sequence[int], kinds: Iterable[tuple[int, int]]) -> list[StridedShard]:
    """Every strided shard of these kinds a tensor of `shape` can hold."""
    return [
        StridedShard(d, sf, inner)
        for sf, inner in kinds for d, n in enumerate(shape)
        if n % (sf * inner) == 0 and n // (sf * inner) >= 2
    ]


def annotate(graph: PrimGraph) -> PrimGraph:
    """Record on every node the strided-shard kinds (sf, inner) that may reach its inputs,
    so its rule table (rules_for) can include the rules for them. A kind is born at a
    view that flattens a sharded dim with its neighbours and flows to everything
    downstream (an over-approximation: the rules themselves decide what is valid)."""
    kinds: dict[int, frozenset] = {}
    nodes = []
    for node in graph.nodes:
        arriving = frozenset().union(*(kinds.get(v, frozenset()) for v in node.inputs))
        born: set[tuple[int, int]] = set()
        if node.op in VIEW_OPS and len(node.inputs) == 1 and node.out_metas and node.out_metas[0] is not None:
            shape, out = node.input_metas()[0].shape, node.out_metas[0].shape
            sources = [ShardPlaceholder(d) for d in range(len(shape))] + _strided_on(shape, arriving)
            for p in sources:
                q = view_placement(shape, out, p)
                if is_strided(q):
                    born.add((q.sf, q.inner))
        out_kinds = arriving | born
        for v in node.outputs:
            if v is not None and out_kinds:
                kinds[v] = out_kinds
        nodes.append(dataclasses.replace(node, strided_in=arriving) if arriving else node)
    graph.nodes = nodes
    return graph
