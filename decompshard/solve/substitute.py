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
- full reductions to a scalar (`mean(x)`): `()`; reductions over listed dims;
- ops whose output has their first input's shape (casts, copies, `full_like`, `flip`);
- dim shuffles with their arguments unchanged (permute, transpose, unsqueeze, squeeze,
  expand, view with -1 inferred): computed from the input shape the way torch defines
  them; split and unbind when the local run makes as many pieces as the global one;
  `x[idx]` with one integer index tensor.

Anything else (another primitive, an in-place op, a read of a size that differs)
returns None, and the caller re-traces as before. Every shape function is checked
against the global trace before it is trusted with local shapes. An empty shard is
substituted only on request: kernels take short-cuts on empty inputs, so the caller
(localcheck) compares only the outputs there and runs the op's real kernel as well; the
decomposition itself cannot short-cut on emptiness without reading a size that differs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from decompshard.dispatch_modes.graph import PrimGraph, leaves, map_leaves
from decompshard.dispatch_modes.tracing import READ_LAYOUT, is_mutating

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


# output shape = the first input's shape
_SAME_SHAPE = {
    aten.alias.default, aten.detach.default, aten.clone.default, aten.lift_fresh.default,
    aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.fill.Scalar, aten.fill.Tensor, aten.flip.default, aten.contiguous.default,
}
# reductions over the `dim` argument (all dims when it is None or empty), keepdim-aware
_DIM_REDUCTIONS = {
    aten.sum.dim_IntList, aten.mean.dim, aten.amax.default, aten.amin.default,
    aten.linalg_vector_norm.default, aten.any.dims, aten.all.dims, aten.prod.dim_int,
    aten.any.dim, aten.all.dim,
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
               shapes: Sequence[tuple[int, ...]], empty_ok: bool = False) -> SubstitutedGraph | None:
    """The graph a trace at these input shapes (`localcheck.local_args`) would record,
    or None where that is not provably so.

    An empty shard only with `empty_ok`: then the result is the graph's output shapes
    as the decomposition's code computes them (it read no size that differs, so it
    cannot short-cut on emptiness), not a proof that every primitive's meta kernel
    accepts empty inputs. The caller runs the op's real kernel on the empty shard too."""
    if not empty_ok and any(0 in shp for shp in shapes):
        return None
    plan = _plan(graph)
    if plan is None:  # some node has no shape function: no input shapes can help
        return None
    local: dict[int, tuple[int, ...]] = {}
    for v, shp in zip(graph.inputs, shapes):
        local[v] = tuple(shp)
    for v in plan.read_inputs:  # a read input that differs: refuse before any work
        if local[v] != plan.global_shapes[v]:
            return None
    for ins, outs, want, local_fn in plan.steps:
        in_shapes = [local.get(v, plan.global_shapes[v]) for v in ins]
        if all(a == plan.global_shapes[v] for a, v in zip(in_shapes, ins)):
            got = want  # the inputs as in the global trace: so are the outputs
        else:
            got = local_fn(in_shapes)
            if got is None:
                return None
        for v, shp in zip(outs, got):
            local[v] = shp
    for v, bits in graph.reads.items():
        if local.get(v, plan.global_shapes[v]) != plan.global_shapes[v]:
            return None
        if bits & READ_LAYOUT and not _same_layout(graph, args, kwargs, shapes, v):
            return None
    return SubstitutedGraph(graph, _Complete(graph, local))


@dataclass
class _Plan:
    """Per graph, what substitute needs for any input shapes: each node's local shape
    function, already checked against the global trace (so a call only computes)."""

    global_shapes: dict[int, tuple[int, ...]]
    read_inputs: tuple[int, ...]
    steps: list[tuple[tuple[int, ...], tuple[int, ...], list, Any]]


_NO_PLAN = "no plan"


def _plan(graph: PrimGraph) -> _Plan | None:
    cached = graph.__dict__.get("_substitution_plan")
    if cached is None:
        cached = graph.__dict__["_substitution_plan"] = _build_plan(graph) or _NO_PLAN
    return None if cached is _NO_PLAN else cached


def _build_plan(graph: PrimGraph) -> _Plan | None:
    shapes = {v.id: tuple(v.meta.shape) for v in graph.values}
    steps = []
    for n in graph.nodes:
        fn = _local_shape_fn(graph, n)
        if fn is None:
            return None
        steps.append((n.inputs, n.outputs, [shapes[v] for v in n.outputs], fn))
    return _Plan(shapes, tuple(v for v in graph.reads if v in graph.inputs), steps)


class _Complete(dict):
    """Local shapes; a value made outside any recorded call (a Python-made constant)
    keeps its global shape."""

    def __init__(self, graph: PrimGraph, local: dict):
        super().__init__(local)
        self._graph = graph

    def __missing__(self, v: int) -> tuple[int, ...]:
        return tuple(self._graph.meta(v).shape)


def _local_shape_fn(graph: PrimGraph, n) -> Any:
    """Node `n`'s local output shapes as a function of its inputs' local shapes (which
    returns None where it cannot tell), or None if the node has none. The function is
    checked here to reproduce the global trace's shapes."""
    if is_mutating(n.op) or not n.outputs or any(v is None for v in n.outputs):
        return None
    multi = _MULTI_SHAPE_FNS.get(n.op)
    if multi is not None:
        return _multi_shape_fn(graph, n, multi)
    if len(n.outputs) != 1:
        return None
    want = tuple(graph.meta(n.outputs[0]).shape)
    if n.op in _SIZED_BY_ARGS:
        return lambda in_shapes: [want]
    if n.op in _FULL_REDUCTIONS:
        return (lambda in_shapes: [()]) if want == () else None
    global_in = [tuple(m.shape) for m in n.input_metas()]
    fn = _SHAPE_FNS.get(n.op)
    if fn is not None:
        if not n.inputs:
            return None
        a = _bound_args(n)
        try:
            if fn(global_in, a) != want:
                return None  # the shape function does not reproduce the global trace
        except (IndexError, KeyError, TypeError, ValueError):
            return None

        def local(in_shapes):
            try:
                out = fn(in_shapes, a)
            except (IndexError, KeyError, TypeError, ValueError):
                return None
            return None if out is None else [out]

        return local
    if torch.Tag.pointwise in n.op.tags and n.inputs:
        try:
            if _broadcast(global_in) != want:
                return None  # not the plain broadcast this shape function assumes
        except ValueError:
            return None

        def local_broadcast(in_shapes):
            try:
                return [_broadcast(in_shapes)]
            except ValueError:  # shapes that do not broadcast: let the real trace say so
                return None

        return local_broadcast
    return None


def _multi_shape_fn(graph: PrimGraph, n, fn) -> Any:
    """Ops with several outputs (split, unbind): the local run makes as many outputs as
    the global one or it is a different graph (re-trace)."""
    if len(n.inputs) != 1:
        return None
    a = _bound_args(n)
    want = [tuple(graph.meta(v).shape) for v in n.outputs]
    try:
        if fn(tuple(n.input_metas()[0].shape), a) != want:
            return None
    except (IndexError, KeyError, TypeError, ValueError):
        return None

    def local(in_shapes):
        try:
            out = fn(in_shapes[0], a)
        except (IndexError, KeyError, TypeError, ValueError):
            return None
        return out if out is not None and len(out) == len(want) else None

    return local


def _broadcast(shapes: list) -> tuple[int, ...]:
    """numpy/torch broadcasting of int shapes (torch.broadcast_shapes, without the
    symbolic-shape machinery that makes it ~70 us a call)."""
    out: list[int] = []
    for shp in shapes:
        if len(shp) > len(out):
            out = [1] * (len(shp) - len(out)) + out
        for i, s in enumerate(shp, len(out) - len(shp)):
            if s != out[i]:
                if out[i] == 1:
                    out[i] = s
                elif s != 1:
                    raise ValueError(f"shapes {shapes} do not broadcast")
    return tuple(out)


def _same_layout(graph: PrimGraph, args: tuple, kwargs: dict, shapes, v: int) -> bool:
    """A stride read sees the same strides locally only for a graph input laid out as
    the global one (constants made by the decomposition are not proven so: refuse)."""
    if v not in graph.inputs:
        return False

    i = graph.inputs.index(v)
    local = [x for x in leaves(local_args(args, kwargs, shapes)) if isinstance(x, torch.Tensor)][i]
    return tuple(local.stride()) == tuple(graph.meta(v).stride) and local.storage_offset() == 0


def _bound_args(n) -> dict[str, Any]:
    """The node's non-tensor arguments by schema name (defaults filled in)."""
    out: dict[str, Any] = {}
    for i, a in enumerate(n.op._schema.arguments):
        if i < len(n.args):
            out[a.name] = n.args[i]
        elif a.name in n.kwargs:
            out[a.name] = n.kwargs[a.name]
        elif a.has_default_value():
            out[a.name] = a.default_value
    return out


def _wrap(d: int, ndim: int) -> int:
    if not -max(ndim, 1) <= d < max(ndim, 1):
        raise ValueError(f"dim {d} out of range")
    return d % max(ndim, 1)


def _same(ins, a):
    return ins[0]


def _reduce(ins, a):
    x = ins[0]
    dims = a.get("dim")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        dims = range(len(x))
    elif isinstance(dims, int):
        dims = [dims]
    gone = {_wrap(d, len(x)) for d in dims}
    if a.get("keepdim", False):
        return tuple(1 if i in gone else s for i, s in enumerate(x))
    return tuple(s for i, s in enumerate(x) if i not in gone)


def _permute(ins, a):
    x = ins[0]
    dims = [_wrap(d, len(x)) for d in a["dims"]]
    if sorted(dims) != list(range(len(x))):
        raise ValueError("not a permutation")
    return tuple(x[d] for d in dims)


def _transpose(ins, a):
    x = list(ins[0])
    if not x:
        return ()
    i, j = _wrap(a["dim0"], len(x)), _wrap(a["dim1"], len(x))
    x[i], x[j] = x[j], x[i]
    return tuple(x)


def _t(ins, a):
    x = ins[0]
    if len(x) > 2:
        raise ValueError("t of more than 2 dims")
    return tuple(reversed(x))


def _unsqueeze(ins, a):
    x = list(ins[0])
    x.insert(_wrap(a["dim"], len(x) + 1), 1)
    return tuple(x)


def _squeeze_dims(ins, dims):
    x = ins[0]
    drop = {_wrap(d, len(x)) for d in dims} if x else set()
    return tuple(s for i, s in enumerate(x) if not (i in drop and s == 1))


def _expand(ins, a):
    x, size = ins[0], list(a["size"])
    lead = len(size) - len(x)
    if lead < 0:
        raise ValueError("expand to fewer dims")
    out = []
    for i, s in enumerate(size):
        if i < lead:
            if s < 0:
                raise ValueError("-1 in a new leading dim")
            out.append(s)
            continue
        have = x[i - lead]
        target = have if s == -1 else s
        if have != target and have != 1:
            return None  # the local expand would fail: the real trace reports it
        out.append(target)
    return tuple(out)


def _dot(ins, a):
    if len(ins) != 2 or any(len(s) != 1 for s in ins) or ins[0] != ins[1]:
        return None  # mismatched local lengths fail in the kernel: re-trace
    return ()


def _view(ins, a):
    """view/_unsafe_view with its size argument unchanged: -1 takes what is left; a size
    that does not fit the local element count fails in the kernel (re-trace to say so).
    Viewability does not need a stride check here: a shard keeps every dim's place in
    memory order and only shrinks sizes (never a 1 into more), which cannot turn a dim
    pair that merged globally into one that does not."""
    x, size = ins[0], list(a["size"])
    numel = 1
    for s in x:
        numel *= s
    if size.count(-1) > 1 or any(s < -1 for s in size):
        raise ValueError("bad view size")
    if -1 in size:
        known = 1
        for s in size:
            if s != -1:
                known *= s
        if known == 0 or numel % known:
            return None
        size[size.index(-1)] = numel // known
    else:
        total = 1
        for s in size:
            total *= s
        if total != numel:
            return None
    return tuple(size)


def _split(x, a):
    """split.Tensor(x, split_size, dim): pieces of split_size, the last one shorter."""
    dim, step = _wrap(a["dim"], len(x)), a["split_size"]
    if step <= 0:
        raise ValueError("split_size must be positive")
    n = x[dim]
    starts = range(0, n, step) if n else [0]
    return [x[:dim] + (min(step, n - s),) + x[dim + 1:] for s in starts]


def _unbind(x, a):
    dim = _wrap(a["dim"], len(x))
    return [x[:dim] + x[dim + 1:]] * x[dim]


def _index_first_dim(ins, a):
    """index.Tensor with one index tensor, on dim 0 (`x[idx]`, take's flat gather): the
    index's shape, then x's remaining dims. Other advanced-indexing forms re-trace."""
    indices = a["indices"]
    if len(ins) != 2 or len(indices) != 1 or indices[0] is None or not ins[0]:
        raise ValueError("not a single dim-0 index")
    if indices[0].dtype in (torch.bool, torch.uint8):  # a mask: the shape depends on values
        raise ValueError("a mask index")
    return tuple(ins[1]) + tuple(ins[0][1:])


# several outputs: fn(input shape, bound args) -> list of output shapes
_MULTI_SHAPE_FNS = {
    aten.split.Tensor: _split,
    aten.unbind.int: _unbind,
}

_SHAPE_FNS = {
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.index.Tensor: _index_first_dim,
    **{op: _same for op in _SAME_SHAPE},
    **{op: _reduce for op in _DIM_REDUCTIONS},
    aten.permute.default: _permute,
    aten.transpose.int: _transpose,
    aten.t.default: _t,
    aten.unsqueeze.default: _unsqueeze,
    aten.squeeze.default: lambda ins, a: _squeeze_dims(ins, range(len(ins[0]))),
    aten.squeeze.dim: lambda ins, a: _squeeze_dims(ins, [a["dim"]]),
    aten.squeeze.dims: lambda ins, a: _squeeze_dims(ins, a["dim"]),
    aten.expand.default: _expand,
    aten.dot.default: _dot,
    aten.vdot.default: _dot,
}


def local_args(args: tuple, kwargs: dict, shapes: Sequence[tuple[int, ...]]) -> tuple[tuple, dict]:
    """The op's arguments with tensor i replaced by a meta tensor of `shapes[i]`, laid out
    in memory in the same dim order as the global tensor: a rank's shard of
    `x.view(B, S, H, hd).transpose(1, 2)` is itself a transposed view, and decompositions
    branch on contiguity (matmul copies a non-contiguous operand before its view)."""
    it = iter(shapes)
    return map_leaves(
        lambda x: _like_layout(x, next(it)) if isinstance(x, torch.Tensor) else x,
        (args, kwargs),
    )


def _like_layout(x: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    if x.is_contiguous() or x.dim() < 2:
        return torch.empty(tuple(shape), dtype=x.dtype, device="meta")
    order = sorted(range(x.dim()), key=lambda d: (-x.stride(d), d))  # outermost in memory first
    dense = torch.empty([shape[d] for d in order], dtype=x.dtype, device="meta")
    return dense.permute([order.index(d) for d in range(x.dim())])
