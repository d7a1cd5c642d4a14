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

from decompshard._compat import TorchDispatchMode
from decompshard._compat import TensorMeta, custom_op_implementation, torch_decomposition
from decompshard.errors import DataDependent, UnsupportedOp, one_line
from decompshard.dispatch_modes import signs
from decompshard.dispatch_modes.strided_kinds import annotate
from decompshard.dispatch_modes.graph import CONST, INPUT, NODE, PrimGraph, PrimNode, ValueInfo, is_container, leaves, map_leaves
from decompshard.dispatch_modes.decomps import PROJECT_DECOMPOSITIONS, PROJECT_OVERRIDES
from decompshard.dispatch_modes.reference import reference_of

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
    """Lookup order: torch's decomposition table, CompositeImplicitAutograd, ours, then a
    `torch.library.custom_op`'s own implementation (custom_op_decomposition) —
    except for the few ops whose torch decomposition hides what makes a rule valid
    (as_strided, aliasing writes, prelu's masked sign), where decompshard's override
    comes first (decomps.PROJECT_OVERRIDES)."""

    if op in PROJECT_OVERRIDES:
        return PROJECT_OVERRIDES[op]

    reference = reference_of(op)
    if reference is not None:  # a registered reference wins over the op's own implementation
        return reference_decomposition(op, reference)
    return torch_decomposition(op) or PROJECT_DECOMPOSITIONS.get(op) or custom_op_decomposition(op)


def reference_decomposition(op: OpOverload, fn: Callable) -> Callable:
    """A registered plain-torch reference (decompshard.register_reference), as `op`'s
    decomposition. Not cached: a cache would keep an unregistered reference alive."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return _as_decomposition(op, fn, f"registered reference {name}")


_REGISTER_HINT = "; register a plain-torch reference with decompshard.register_reference(op, fn)"


@functools.lru_cache(maxsize=None)
def custom_op_decomposition(op: OpOverload) -> Callable | None:
    """A `torch.library.custom_op`'s own implementation, as its decomposition: traced
    like any other (on meta tensors, primitives recorded), so plain-torch custom ops
    (a fused RMSNorm) derive like aten ops. The strategy DTensor runs still calls the
    custom op's real kernel on local shards. An implementation that cannot run on meta
    tensors (numpy, `.item()`, an opaque kernel) fails the trace with a reason that
    names the op and what to register. None for other ops
    (`_compat.custom_op_implementation`)."""
    fn = custom_op_implementation(op)
    return None if fn is None else _as_decomposition(op, fn, "implementation", _REGISTER_HINT)


def _as_decomposition(op: OpOverload, fn: Callable, what: str, hint: str = "") -> Callable:
    """`fn` standing in for a custom op's decomposition: a trace that fails says so,
    naming the op and whose code failed (its implementation, or its reference)."""

    def decomposition(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DataDependent as e:
            raise DataDependent(f"data-dependent: custom op {op}'s {what} reads tensor values "
                                f"({e.reason.removeprefix('data-dependent: ')}){hint}") from e
        except UnsupportedOp:
            raise
        except Exception as e:
            raise UnsupportedOp(f"custom op {op}'s {what} is not traceable torch code "
                                f"(on meta tensors: {one_line(e, 200, with_type=False)}){hint}") from e

    decomposition.__name__ = decomposition.__qualname__ = f"{what.replace(' ', '_')}[{op}]"
    decomposition.origin = f"custom op {op}'s {what}"  # what explain says it traced
    return decomposition


def decomposition_origin(op: OpOverload) -> str:
    """Whose code a custom op's trace is ("custom op mylib.rmsnorm.default's registered
    reference rmsnorm_ref"): a user reading explain must know when the rules come from
    their reference, not their kernel. '' for torch's ops."""
    return getattr(find_decomposition(op), "origin", "")


def has_decomposition(op: OpOverload) -> bool:
    return find_decomposition(op) is not None


@functools.lru_cache(maxsize=None)
def is_mutating(op: OpOverload) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments)


@functools.lru_cache(maxsize=None)
def _aliased_args(op: OpOverload) -> tuple[tuple[int, str], ...]:
    """(position, name) of the arguments some result aliases without writing: the base
    of a view (`t`, `view`, `select`, `split`...). Read from the schema because a kernel's
    result under a dispatch mode is not marked as a view (`_is_view()` is False)."""
    # A list result (`Tensor(a)[]`, split) exposes no alias set of its own: any aliasing
    # result makes every argument annotated as aliased (and not written) a base.
    if not any(r.alias_info is not None and not r.alias_info.is_write for r in op._schema.returns):
        return ()
    return tuple(
        (i, a.name) for i, a in enumerate(op._schema.arguments)
        if a.alias_info is not None and not a.alias_info.is_write
    )


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
    a fresh id).

    `watch`: the decomposition sees `_Watched` wrappers, so its reads of sizes and
    strides are noted (`PrimGraph.reads`), and value signs are recorded. Off, it sees
    plain meta tensors: the graph has the same nodes, arguments and value shapes, and
    nothing else (what the local-shape check compares; see `trace`)."""

    def __init__(self, op: OpOverload, watch: bool = True):
        self.graph = PrimGraph(op=op, inputs=(), outputs=(), shapes_only=not watch)
        self.watch = watch
        self._vid: dict[int, int] = {}
        self._keep: list[torch.Tensor] = []  # keeps ids stable while the trace runs
        self.viewed: set[int] = set()  # ids of tensors some recorded view aliases
        self._outer: dict[int, torch.Tensor] = {}  # id(inner meta tensor) -> its wrapper

    def wrap(self, inner: torch.Tensor) -> torch.Tensor:
        """The wrapper of a plain meta tensor (one wrapper per tensor: identity matters
        for in-place results and for aliasing); the tensor itself when not watching."""
        if not self.watch:
            return inner
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

    def split(self, tree: Any, in_ids: list[int]) -> tuple[Any, Any]:
        """One walk over a call's argument tree: (the tree as the kernel takes it: plain
        tensors, a device argument turned meta so a factory naming a real device stays on
        meta; the tree as the node records it: tensors as their TensorMeta). Appends each
        tensor's value id to `in_ids` in leaf order; containers come back as `map_leaves`
        rebuilds them."""
        t = type(tree)
        if t is tuple or t is list:
            items = tree
        elif t is dict:
            plain, meta = {}, {}
            for k, x in tree.items():
                plain[k], meta[k] = self.split(x, in_ids)
            return plain, meta
        elif is_container(tree):  # a tuple subclass (torch.return_types): a list
            items, t = tree, list
        elif isinstance(tree, torch.Tensor):
            vid = self._vid.get(id(tree))
            if vid is None:
                vid = self.value_of(tree)
            in_ids.append(vid)
            return (tree.inner if type(tree) is _Watched else tree), self.graph.values[vid].meta
        elif type(tree) is torch.device:
            return _META, _META
        else:
            return tree, tree
        values = self.graph.values
        vids = self._vid
        plain, meta = [], []
        for x in items:
            tx = type(x)
            if tx is _Watched or tx is torch.Tensor:  # the common leaves, inline
                vid = vids.get(id(x))
                if vid is None:
                    vid = self.value_of(x)
                in_ids.append(vid)
                plain.append(x.inner if tx is _Watched else x)
                meta.append(values[vid].meta)
            elif tx is int or tx is float or tx is bool or x is None:
                plain.append(x)
                meta.append(x)
            else:
                p, m = self.split(x, in_ids)
                plain.append(p)
                meta.append(m)
        if t is tuple:
            return tuple(plain), tuple(meta)
        return plain, meta


# What the tracing mode does with an op (TracingMode._plan; the same for a whole trace)
_QUERY, _DIM, _DATA_DEPENDENT, _DECOMPOSE, _RECORD = range(5)


class TracingMode(TorchDispatchMode):
    def __init__(self, recorder: _Recorder, is_primitive: Callable[[OpOverload], bool]):
        super().__init__()
        self.rec = recorder
        self.is_primitive = is_primitive
        # id(op) -> (op, what to do, its argument): schema facts and the is_primitive
        # answer, looked up once per op and trace instead of once per call
        self._plans: dict[int, tuple] = {}

    def _plan(self, func) -> tuple:
        plan = self._plans.get(id(func))
        if plan is not None and plan[0] is func:
            return plan
        data_dependent, random, _ = _tag_facts(func)
        if func in _QUERY_BIT:
            plan = (func, _QUERY, None, False)
        elif func is aten.dim.default:
            plan = (func, _DIM, None, False)
        elif data_dependent:
            plan = (func, _DATA_DEPENDENT, None, False)
        else:
            decomp = None if self.is_primitive(func) else find_decomposition(func)
            plan = (func, _RECORD if decomp is None else _DECOMPOSE, decomp, random)
        self._plans[id(func)] = plan
        return plan

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _, what, decomp, random = self._plan(func)
        if what == _DECOMPOSE:  # (dropout with p=0 decomposes to no random op at all)
            with self:
                out = decomp(*args, **kwargs)
            if out is not NotImplemented:
                return out
        elif what == _QUERY:
            return _answer_query(func, args, kwargs, self.rec if self.rec.watch else None)
        elif what == _DIM:
            return _unwrap_leaf(args[0]).dim()
        elif what == _DATA_DEPENDENT:
            raise DataDependent(f"data-dependent: the decomposition calls {func}")
        if random:
            raise UnsupportedOp(f"random: {func} draws random numbers")
        return self._record(func, args, kwargs)

    def _refuse_writes_through_aliases(self, func, args, kwargs) -> None:
        """The graph is SSA: a mutated tensor gets a new value id. A write into a view
        (or into a tensor that has views) would change other values behind our back, so
        it is refused rather than traced wrongly."""
        if not is_mutating(func):
            return
        schema_args = func._schema.arguments
        for i, a in enumerate(schema_args):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            t = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(t, torch.Tensor) and (t._is_view() or id(t) in self.rec.viewed):
                raise UnsupportedOp(f"in-place {func} writes through a view; aliasing is not traced")

    def _record(self, func, args, kwargs):
        rec = self.rec
        self._refuse_writes_through_aliases(func, args, kwargs)
        aliased = _aliased_args(func)
        bases = [t for i, name in aliased
                 if isinstance(t := (args[i] if i < len(args) else kwargs.get(name)), torch.Tensor)]
        in_ids: list[int] = []
        args, meta_args = rec.split(args, in_ids)
        if kwargs:
            kwargs, meta_kwargs = rec.split(kwargs, in_ids)
        else:
            kwargs, meta_kwargs = {}, {}
        in_ids = tuple(in_ids)
        try:
            out = func(*args, **kwargs)
        except (DataDependent, UnsupportedOp):
            raise
        except Exception as e:  # no meta kernel, or the op rejects these shapes
            if _tag_facts(func)[2]:
                raise DataDependent(f"data-dependent: {func}'s output shape depends on values") from e
            raise UnsupportedOp(f"{func} failed on meta tensors: {one_line(e, 200, with_type=False)}") from e
        values = rec.graph.values
        constant = all(values[v].kind == CONST for v in in_ids)
        kind = CONST if constant else NODE
        flat_out = [out] if type(out) is torch.Tensor else leaves(out)
        # results as the decomposition sees them: an in-place op hands back its (wrapped)
        # argument, any new tensor gets a wrapper
        outer = [rec.wrap(t) if isinstance(t, torch.Tensor) else t for t in flat_out]
        if bases:  # a view: a later write into either side would change the other
            rec.viewed.update(id(b) for b in bases)
            rec.viewed.update(id(w) for w in outer if isinstance(w, torch.Tensor))
        if rec.watch:
            in_signs = tuple(values[v].sign for v in in_ids)
            sign = (
                signs.sign_of(func, args, kwargs, in_ids, in_signs, flat_out[0].dtype)
                if len(flat_out) == 1 and isinstance(flat_out[0], torch.Tensor) else signs.UNKNOWN
            )
        else:
            in_signs, sign = (), signs.UNKNOWN
        out_ids = tuple(
            rec.new_value(w, kind, sign) if isinstance(w, torch.Tensor) else None
            for w in outer
        )
        g = rec.graph
        g.nodes.append(
            PrimNode(
                len(g.nodes), func, meta_args, meta_kwargs, in_ids, out_ids, constant,
                tuple(None if v is None else values[v].meta for v in out_ids),
                in_signs,
            )
        )
        if type(out) is torch.Tensor:
            return outer[0]
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


def trace(
    op: OpOverload, args: tuple, kwargs: dict, is_primitive: Callable[[OpOverload], bool],
    decomp: Callable | None = None, *, shapes_only: bool = False,
) -> PrimGraph:
    """Record `op`'s decomposition (or `decomp`, any function of the op's arguments) at
    the given (global) shapes.

    `shapes_only`: record only what the local-shape check compares with the global
    graph (nodes: ops, non-tensor arguments, value ids; values: shapes; outputs), about
    twice as cheaply: the decomposition runs on plain meta tensors, so no size read is
    noted (`reads` stays empty), no value gets a sign and no node its strided kinds.
    Such a graph (`PrimGraph.shapes_only`) is never a global graph.

    Raises UnsupportedOp (no decomposition, random op, data-dependent control flow,
    a primitive with no meta kernel) with a one-line reason.
    """
    decomp = decomp or find_decomposition(op)
    if decomp is None:
        raise UnsupportedOp(f"no decomposition: {op} has neither a decomposition nor a strategy")
    rec = _Recorder(op, watch=not shapes_only)
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
            raise DataDependent(f"data-dependent: {one_line(e, 200, with_type=False)}") from e
        raise UnsupportedOp(f"decomposition failed on meta tensors: {one_line(e, 200, with_type=False)}") from e
    if out is NotImplemented:
        raise UnsupportedOp(f"no decomposition: {op}'s decomposition declined these arguments")
    flat_out = leaves(out)
    rec.graph.outputs = tuple(
        rec.value_of(t) if isinstance(t, torch.Tensor) else None for t in flat_out
    )
    if shapes_only:
        return rec.graph
    return annotate(rec.graph)
