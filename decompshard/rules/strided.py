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
- `view_rules` gives a view primitive its rules from plain S(d) inputs; the trace's
  `annotate` (dispatch_modes/strided_kinds.py) records on every node which strided kinds
  may reach it, and `kind_rules`
  adds, for those, the view rules from them and the placeholder rules filled with them
  (the registry appends them to the node's table, so the solver and explain see one
  table per node as always). A placeholder S(d) means "any sharding kind,
  the same for every sharded argument" (torch's single-dim design: a bmm on
  _StridedShard inputs gives a _StridedShard output). The fill is only made when every
  sharded argument's dim has the same size, so the layout (which elements each rank
  holds) is the same partition for all of them; views get the algebra instead.
"""

from __future__ import annotations

from typing import Sequence

import torch

from decompshard.dispatch_modes.graph import PrimNode
from decompshard.dispatch_modes.strided_kinds import VIEW_OPS, strided_on, view_placement  # noqa: F401  (view_placement: public here too)
from decompshard.placements import ShardPlaceholder, SingleDimRule, StridedShard, is_strided

aten = torch.ops.aten
SOURCE = "decompshard strided view"
FILL_SOURCE = "placeholder filled with a strided shard"

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
        for p in strided_on(in_metas[0].shape, kinds):
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
