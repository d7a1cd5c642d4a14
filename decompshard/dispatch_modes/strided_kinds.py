"""Which strided-shard kinds may reach each node of a trace, and the layout algebra of
row-major views that creates them (rules/strided.py turns both into rules).

Part of the trace stage: `trace()` annotates every graph it records, so that the rule
lookup (rules/) can add the strided rules a node needs without tracing again.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Sequence

import torch

from decompshard.dispatch_modes.graph import PrimGraph
from decompshard.placements import MaybePlacement, ShardPlaceholder, StridedShard, is_shard, is_strided, sharded_on

aten = torch.ops.aten

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


def strided_on(shape: Sequence[int], kinds: Iterable[tuple[int, int]]) -> list[StridedShard]:
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
            sources = [ShardPlaceholder(d) for d in range(len(shape))] + strided_on(shape, arriving)
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
