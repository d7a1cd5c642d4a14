"""The local graph without running the decomposition again, where that is provably exact.

The local-shape check (localcheck.py) needs the decomposition's graph at each rank's
local shapes. Re-running it costs as much as the first trace, and in torch 2.13 that is
mostly meta kernels written in Python (a floor division ~5 ms, a clamp ~0.8 ms). Most
decompositions never look at a size: `hardswish(x) = x * clamp(x + 3, 0, 6) / 6`. When
the global trace shows that the decomposition's own code (not a primitive's kernel) read
no size and no stride that differs locally (`PrimGraph.reads`, noted by the tracing
mode), its run at local shapes makes the same calls with the same non-tensor arguments:
Python cannot branch on, or compute an argument from, a number it never saw. Only the
primitives' output shapes change, and for the primitives below they follow from the
input shapes alone:

- pointwise ops (torch's `pointwise` tag): the broadcast of the tensor inputs' shapes;
- factories whose size is an argument (`new_full(x, size, v)`): that argument, unchanged;
- full reductions to a scalar (`mean(x)`): `()`.

Anything else (another primitive, an in-place op, a read of a size that differs, an
empty shard, where decompositions and kernels take short-cuts) returns None, and the
caller re-traces as before. Every shape function is checked against the global trace
before it is trusted with local shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .graph import PrimGraph, leaves
from .tracing import READ_LAYOUT, READ_SIZE, _is_mutating

aten = torch.ops.aten

# output shape = a size argument: unchanged when the arguments are
_SIZED_BY_ARGS = {
    aten.new_full.default, aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
    aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
    aten.scalar_tensor.default, aten.empty_strided.default, aten.new_empty_strided.default,
}
# reductions over every element, whatever the input's shape: a 0-dim result
_FULL_REDUCTIONS = {
    aten.sum.default, aten.mean.default, aten.prod.default, aten.any.default, aten.all.default,
    aten.max.default, aten.min.default,
}


@dataclass(frozen=True)
class _Shape:
    shape: tuple[int, ...]


class SubstitutedGraph:
    """The global graph's nodes (same calls, same arguments) with local value shapes:
    what localcheck compares, duck-typed like a PrimGraph (nodes, outputs, meta)."""

    def __init__(self, graph: PrimGraph, shapes: dict[int, tuple[int, ...]]):
        self.nodes = graph.nodes
        self.outputs = graph.outputs
        self._shapes = shapes

    def meta(self, vid: int) -> _Shape:
        return _Shape(self._shapes[vid])


def substitute(graph: PrimGraph, args: tuple, kwargs: dict,
               shapes: Sequence[tuple[int, ...]]) -> SubstitutedGraph | None:
    """The graph a trace at these input shapes (`localcheck.local_args`) would record,
    or None where that is not provably so."""
    if any(0 in shp for shp in shapes):
        return None
    local: dict[int, tuple[int, ...]] = {}
    for v, shp in zip(graph.inputs, shapes):
        local[v] = tuple(shp)
    for n in graph.nodes:
        outs = _out_shapes(graph, n, [_shape(graph, local, v) for v in n.inputs])
        if outs is None:
            return None
        for v, shp in zip(n.outputs, outs):
            if v is not None:
                local[v] = shp
    for v, bits in graph.reads.items():
        if _shape(graph, local, v) != tuple(graph.meta(v).shape):
            return None
        if bits & READ_LAYOUT and not _same_layout(graph, args, kwargs, shapes, v):
            return None
    return SubstitutedGraph(graph, _Complete(graph, local))


def _shape(graph: PrimGraph, local: dict, v: int) -> tuple[int, ...]:
    shp = local.get(v)
    return tuple(graph.meta(v).shape) if shp is None else shp


class _Complete(dict):
    """Local shapes; a value made outside any recorded call (a Python-made constant)
    keeps its global shape."""

    def __init__(self, graph: PrimGraph, local: dict):
        super().__init__(local)
        self._graph = graph

    def __missing__(self, v: int) -> tuple[int, ...]:
        return tuple(self._graph.meta(v).shape)


def _out_shapes(graph: PrimGraph, n, in_shapes: list) -> list | None:
    """Local output shapes of node `n` from its inputs' local shapes, or None."""
    if _is_mutating(n.op) or len(n.outputs) != 1 or n.outputs[0] is None:
        return None
    want = tuple(graph.meta(n.outputs[0]).shape)
    if n.op in _SIZED_BY_ARGS:
        return [want]
    if n.op in _FULL_REDUCTIONS:
        return [()] if want == () else None
    if torch.Tag.pointwise in n.op.tags and in_shapes:
        global_in = [tuple(m.shape) for m in n.input_metas()]
        try:
            if tuple(torch.broadcast_shapes(*global_in)) != want:
                return None  # not the plain broadcast this shape function assumes
            return [tuple(torch.broadcast_shapes(*in_shapes))]
        except RuntimeError:  # shapes that do not broadcast: let the real trace say so
            return None
    return None


def _same_layout(graph: PrimGraph, args: tuple, kwargs: dict, shapes, v: int) -> bool:
    """A stride read sees the same strides locally only for a graph input laid out as
    the global one (constants made by the decomposition are not proven so: refuse)."""
    if v not in graph.inputs:
        return False
    from ..localcheck import local_args  # localcheck imports this module

    i = graph.inputs.index(v)
    local = [x for x in leaves(local_args(args, kwargs, shapes)) if isinstance(x, torch.Tensor)][i]
    return tuple(local.stride()) == tuple(graph.meta(v).stride) and local.storage_offset() == 0
