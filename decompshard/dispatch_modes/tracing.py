"""Trace once: run an op's decomposition on meta tensors and record its primitive calls.

Why a dispatch mode and not torch's own fallback: torch re-runs the decomposition once
per candidate placement and asks the full sharding propagator at every inner op. We run
it once per (op, input metadata, non-tensor args), record a small placement-free graph,
and let the solver try every candidate against that graph with table look-ups.

What counts as a primitive is decided by the caller (`is_primitive`: "has a rule of its
own"); everything else is decomposed again, recursively, inside the same mode.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .._compat import TensorMeta, torch_decomposition
from ..errors import DataDependent, UnsupportedOp
from . import signs
from .graph import CONST, INPUT, NODE, PrimGraph, PrimNode, ValueInfo, leaves, map_leaves

aten = torch.ops.aten
OpOverload = torch._ops.OpOverload

# Ops whose result depends on tensor *values* in a way that shapes cannot express.
_DATA_DEPENDENT_OPS = {aten._local_scalar_dense.default, aten.item.default}


def tensor_meta(t: torch.Tensor) -> TensorMeta:
    if type(t) is _Watched:
        t = t.inner
    return TensorMeta(tuple(t.shape), tuple(t.stride()), t.dtype)


# Metadata queries a decomposition can make. With the "sizes" policy every one of them,
# from Python (`x.shape`, `x.numel()`) or from a C++ composite (`chunk`, `flatten`),
# reaches the tracing mode, which notes which value's sizes or layout were read.
_SIZE_QUERIES = {
    aten.sym_size.default, aten.sym_size.int, aten.size.default, aten.size.int,
    aten.sym_numel.default, aten.numel.default, aten.is_same_size.default,
}
_LAYOUT_QUERIES = {
    aten.sym_stride.default, aten.sym_stride.int, aten.stride.default, aten.stride.int,
    aten.is_contiguous.default, aten.is_contiguous.memory_format, aten.sym_is_contiguous.default,
    aten.sym_storage_offset.default, aten.storage_offset.default,
    aten.is_strides_like_format.default, aten.is_non_overlapping_and_dense.default,
}
READ_SIZE, READ_LAYOUT = 1, 2  # PrimGraph.reads bits
_QUERY_BIT = {**{f: READ_SIZE for f in _SIZE_QUERIES}, **{f: READ_LAYOUT for f in _LAYOUT_QUERIES}}


def _answer_query(func, args: tuple, kwargs: dict, rec: "_Recorder | None") -> Any:
    """Note the read on every watched argument, answer on the inner tensors (a query's
    arguments are flat: tensors, ints, a memory format)."""
    bit = _QUERY_BIT[func]
    plain = []
    for t in args:
        if type(t) is _Watched:
            if rec is not None:
                rec.note_read(t, bit)
            t = t.inner
        plain.append(t)
    return func(*plain, **kwargs)


class _Watched(torch.Tensor):
    """A meta tensor seen through a wrapper whose size and stride queries dispatch.

    Why: the local-shape check may skip re-running the decomposition at a rank's local
    shapes only if the decomposition's own code never looked at a size that differs
    there (channel_shuffle's `c // g`, a mean loss's `numel`). Queries made inside a
    primitive's kernel run on the plain inner tensor and are not counted: the primitive's
    output shape is checked on its own."""

    inner: torch.Tensor
    rec: "_Recorder | None" = None

    @staticmethod
    def __new__(cls, inner: torch.Tensor):
        r = torch.Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=inner.device, dispatch_sizes_strides_policy="sizes",
        )
        r.inner = inner
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # reached only with the tracing mode off (decompshard's own bookkeeping reads the
        # inner tensor instead, so this is code that switched modes off): a query still
        # counts as a read, to stay on the safe side
        if func in _QUERY_BIT:
            rec = next((t.rec for t in args if type(t) is _Watched), None)
            return _answer_query(func, args, kwargs or {}, rec)
        return func(*_unwrap(args), **_unwrap(kwargs or {}))

    def __repr__(self) -> str:
        return f"_Watched({self.inner!r})"


def _unwrap_leaf(x: Any) -> Any:
    return x.inner if type(x) is _Watched else x


def _unwrap(tree: Any) -> Any:
    return map_leaves(_unwrap_leaf, tree)


def to_meta(x: Any) -> Any:
    """A meta tensor with the same shape, strides and dtype; other values unchanged."""
    if isinstance(x, torch.Tensor):
        if any(not isinstance(s, int) for s in x.shape):
            raise UnsupportedOp("dynamic (symbolic) shapes are not supported")
        return torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype, device="meta")
    return x


def find_decomposition(op: OpOverload) -> Callable | None:
    """Lookup order: torch's decomposition table, CompositeImplicitAutograd, then ours —
    except for the few ops whose torch decomposition hides what makes a rule valid
    (as_strided, aliasing writes, prelu's masked sign), where decompshard's override
    comes first (decomps.PROJECT_OVERRIDES)."""
    from ..decomps import PROJECT_DECOMPOSITIONS, PROJECT_OVERRIDES

    if op in PROJECT_OVERRIDES:
        return PROJECT_OVERRIDES[op]
    return torch_decomposition(op) or PROJECT_DECOMPOSITIONS.get(op)


def has_decomposition(op: OpOverload) -> bool:
    return find_decomposition(op) is not None


@functools.lru_cache(maxsize=None)
def _is_mutating(op: OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


@functools.lru_cache(maxsize=None)
def _tag_facts(op: OpOverload) -> tuple[bool, bool, bool]:
    """(data-dependent, random, dynamic output shape): schema facts, read once per op."""
    tags = op.tags
    return (
        op in _DATA_DEPENDENT_OPS or torch.Tag.data_dependent_output in tags,
        torch.Tag.nondeterministic_seeded in tags,
        torch.Tag.dynamic_output_shape in tags,
    )


class _Recorder:
    """Maps live meta tensors to value ids and appends nodes (SSA: a mutated tensor gets
    a fresh id)."""

    def __init__(self, op: OpOverload):
        self.graph = PrimGraph(op=op, inputs=(), outputs=())
        self._vid: dict[int, int] = {}
        self._keep: list[torch.Tensor] = []  # keeps ids stable while the trace runs
        self.viewed: set[int] = set()  # ids of tensors some recorded view aliases
        self._outer: dict[int, torch.Tensor] = {}  # id(inner meta tensor) -> its wrapper

    def wrap(self, inner: torch.Tensor) -> torch.Tensor:
        """The wrapper of a plain meta tensor (one wrapper per tensor: identity matters
        for in-place results and for aliasing)."""
        w = self._outer.get(id(inner))
        if w is None:
            w = _Watched(inner)
            w.rec = self
            self._outer[id(inner)] = w
            self._keep.append(inner)
        return w

    def outer_of(self, inner: torch.Tensor) -> torch.Tensor | None:
        return self._outer.get(id(inner))

    def note_read(self, t: torch.Tensor, bit: int) -> None:
        vid = self._vid.get(id(t))
        if vid is None:
            vid = self.value_of(t)
        reads = self.graph.reads
        reads[vid] = reads.get(vid, 0) | bit

    def new_value(self, t: torch.Tensor, kind: str, sign: int = signs.UNKNOWN) -> int:
        vid = len(self.graph.values)
        self.graph.values.append(ValueInfo(vid, kind, tensor_meta(t), sign))
        self._vid[id(t)] = vid
        self._keep.append(t)
        return vid

    def value_of(self, t: torch.Tensor) -> int:
        vid = self._vid.get(id(t))
        if vid is None:  # made outside the mode (e.g. torch.tensor(...) in Python)
            vid = self.new_value(t, CONST)
        return vid


class TracingMode(TorchDispatchMode):
    def __init__(self, recorder: _Recorder, is_primitive: Callable[[OpOverload], bool]):
        super().__init__()
        self.rec = recorder
        self.is_primitive = is_primitive

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _QUERY_BIT:
            return _answer_query(func, args, kwargs, self.rec)
        if func is aten.dim.default:
            return _unwrap_leaf(args[0]).dim()
        data_dependent, random, _ = _tag_facts(func)
        if data_dependent:
            raise DataDependent(f"data-dependent: the decomposition calls {func}")
        if not self.is_primitive(func):
            decomp = find_decomposition(func)
            if decomp is not None:  # (dropout with p=0 decomposes to no random op at all)
                with self:
                    out = decomp(*args, **kwargs)
                if out is not NotImplemented:
                    return out
        if random:
            raise UnsupportedOp(f"random: {func} draws random numbers")
        return self._record(func, args, kwargs)

    def _refuse_writes_through_aliases(self, func, args, kwargs) -> None:
        """The graph is SSA: a mutated tensor gets a new value id. A write into a view
        (or into a tensor that has views) would change other values behind our back, so
        it is refused rather than traced wrongly."""
        if not _is_mutating(func):
            return
        schema_args = func._schema.arguments
        for i, a in enumerate(schema_args):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            t = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(t, torch.Tensor) and (t._is_view() or id(t) in self.rec.viewed):
                raise UnsupportedOp(f"in-place {func} writes through a view; aliasing is not traced")

    def _record(self, func, args, kwargs):
        flat_in = leaves((args, kwargs))
        self._refuse_writes_through_aliases(func, args, kwargs)
        in_ids = tuple(self.rec.value_of(x) for x in flat_in if isinstance(x, torch.Tensor))
        if any(isinstance(x, torch.device) for x in flat_in):
            args, kwargs = _on_meta((args, kwargs))  # a factory naming a real device: stay on meta
        args, kwargs = _unwrap((args, kwargs))
        try:
            out = func(*args, **kwargs)
        except (DataDependent, UnsupportedOp):
            raise
        except Exception as e:  # no meta kernel, or the op rejects these shapes
            if _tag_facts(func)[2]:
                raise DataDependent(f"data-dependent: {func}'s output shape depends on values") from e
            raise UnsupportedOp(f"{func} failed on meta tensors: {_one_line(e)}") from e
        constant = all(self.rec.graph.values[v].kind == CONST for v in in_ids)
        kind = CONST if constant else NODE
        flat_out = leaves(out)
        # results as the decomposition sees them: an in-place op hands back its (wrapped)
        # argument, any new tensor gets a wrapper
        outer = [self.rec.wrap(t) if isinstance(t, torch.Tensor) else t for t in flat_out]
        for t, w in zip(flat_out, outer):
            if isinstance(t, torch.Tensor) and t._is_view() and t._base is not None:
                base = self.rec.outer_of(t._base)
                self.rec.viewed.add(id(base if base is not None else t._base))
                self.rec.viewed.add(id(w))
        in_signs = tuple(self.rec.graph.values[v].sign for v in in_ids)
        sign = (
            signs.sign_of(func, args, kwargs, in_ids, in_signs, flat_out[0].dtype)
            if len(flat_out) == 1 and isinstance(flat_out[0], torch.Tensor) else signs.UNKNOWN
        )
        out_ids = tuple(
            self.rec.new_value(w, kind, sign) if isinstance(w, torch.Tensor) else None
            for w in outer
        )
        meta_args, meta_kwargs = map_leaves(
            lambda x: tensor_meta(x) if isinstance(x, torch.Tensor) else x, (args, kwargs)
        )
        g = self.rec.graph
        g.nodes.append(
            PrimNode(
                len(g.nodes), func, meta_args, meta_kwargs, in_ids, out_ids, constant,
                tuple(tensor_meta(t) if isinstance(t, torch.Tensor) else None for t in flat_out),
                in_signs,
            )
        )
        return _rebuild(out, iter(outer))


def _rebuild(out: Any, it) -> Any:
    """`out` with its leaves replaced, in order, by `it`'s (a result tuple stays a tuple)."""
    t = type(out)
    if t is list or t is tuple:
        return t([_rebuild(x, it) for x in out])
    if isinstance(out, tuple) and not isinstance(out, torch.Size):  # torch.return_types
        return t([_rebuild(x, it) for x in out])
    return next(it)


_META = torch.device("meta")


def _watched(rec: _Recorder, x: Any) -> Any:
    return rec.wrap(x) if isinstance(x, torch.Tensor) else x


def _device_on_meta(x: Any) -> Any:
    return _META if isinstance(x, torch.device) else x


def _on_meta(tree):
    return map_leaves(_device_on_meta, tree)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else type(e).__name__)[:200]


def trace(
    op: OpOverload, args: tuple, kwargs: dict, is_primitive: Callable[[OpOverload], bool],
    decomp: Callable | None = None,
) -> PrimGraph:
    """Record `op`'s decomposition (or `decomp`, any function of the op's arguments) at
    the given (global) shapes.

    Raises UnsupportedOp (no decomposition, random op, data-dependent control flow,
    a primitive with no meta kernel) with a one-line reason.
    """
    decomp = decomp or find_decomposition(op)
    if decomp is None:
        raise UnsupportedOp(f"no decomposition: {op} has neither a decomposition nor a strategy")
    rec = _Recorder(op)
    margs, mkwargs = map_leaves(lambda x: _watched(rec, to_meta(_device_on_meta(x))), (args, kwargs))
    rec.graph.inputs = tuple(
        rec.new_value(x, INPUT) for x in leaves((margs, mkwargs)) if isinstance(x, torch.Tensor)
    )
    mode = TracingMode(rec, is_primitive)
    try:
        with mode:
            out = decomp(*margs, **mkwargs)
    except (DataDependent, UnsupportedOp):
        raise
    except Exception as e:
        if "data-dependent" in str(e) or "meta tensor" in str(e) and "item" in str(e):
            raise DataDependent(f"data-dependent: {_one_line(e)}") from e
        raise UnsupportedOp(f"decomposition failed on meta tensors: {_one_line(e)}") from e
    if out is NotImplemented:
        raise UnsupportedOp(f"no decomposition: {op}'s decomposition declined these arguments")
    flat_out = leaves(out)
    rec.graph.outputs = tuple(
        rec.value_of(t) if isinstance(t, torch.Tensor) else None for t in flat_out
    )
    from ..rules.strided import annotate  # rules import the graph types: import here

    return annotate(rec.graph)
