"""What torch's strategy functions can see of a primitive call, with the sizes abstracted.

Torch's rule for `add(x[5, 7], y[7])` is the rule for `add(x[3, 9], y[9])`: its strategy
functions read ranks, which dims are size 1 (broadcasting), dims and dtypes, not the
sizes themselves. The *shape class* keeps everything they can read and replaces each
size > 1 by its rank among the call's distinct sizes, so equal sizes stay equal and
order is kept (a strategy comparing two sizes still sees the same comparison). Two calls
in one class get the same rules from torch; `scripts/gen_rule_tables.py` checks that
for every class it ships (and `tests/test_shipped_tables.py` again, live), because a key
that forgets something torch reads is a wrong rule.

What the class does not abstract, it refuses (returns None, and the caller asks torch
at the exact shapes): an int argument that is not a dim (a size, a length, an offset:
its relation to the sizes would be lost), a size-0 dim, a symbolic size, an overlapping
or gappy layout.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import torch

from decompshard._compat import TensorMeta
from decompshard.dispatch_modes.graph import PrimNode

# int arguments whose value is a dim or an enum, never a size: kept as they are. Any
# other int argument (size, length, offset, chunks, upscale factor...) refuses a class.
DIM_LIKE_INTS = frozenset({
    "dim", "dims", "dim0", "dim1", "dim2", "start_dim", "end_dim", "source", "destination",
    "reduction", "ignore_index",
})


@functools.lru_cache(maxsize=None)
def _int_args(op: torch._ops.OpOverload) -> tuple[tuple[str, bool], ...]:
    """(name, is a size-like int) per schema argument."""
    out = []
    for a in op._schema.arguments:
        t = str(a.real_type)
        is_int = t in ("int", "List[int]", "Optional[int]", "Optional[List[int]]")
        out.append((a.name, is_int and a.name not in DIM_LIKE_INTS))
    return tuple(out)


def _layout(meta: TensorMeta) -> Any:
    """'C' for contiguous (strides of size-1 dims ignored, as torch does), the memory
    order of a dense permuted layout, or None (expanded, overlapping or gappy)."""
    dims = [d for d in range(len(meta.shape)) if meta.shape[d] != 1]
    order = sorted(dims, key=lambda d: (-meta.stride[d], d))  # outermost in memory first
    expected = 1
    for d in reversed(order):
        if meta.stride[d] != expected:
            return None
        expected *= meta.shape[d]
    return "C" if order == dims else tuple(order)


class _NoClass(Exception):
    pass


def class_key(node: PrimNode) -> str | None:
    """The call's shape class as a string (a stable dictionary key), or None when the
    call has something a class cannot stand for."""
    try:
        sizes = sorted({s for m in node.input_metas() for s in m.shape})
    except TypeError:
        return None
    if any(not isinstance(s, int) or s == 0 for s in sizes):
        return None
    label = {s: -(i + 1) for i, s in enumerate(s for s in sizes if s > 1)}
    label[1] = 1
    try:
        # positional count too: a strategy may read args and kwargs differently
        parts = [str(node.op), len(node.inputs), len(node.outputs), len(node.args)]
        for (name, size_like), value in _schema_values(node):
            parts.append((name, _classify(value, size_like, label)))
        return repr(tuple(parts))
    except _NoClass:
        return None


_ABSENT = object()


def _schema_values(node: PrimNode):
    names = _int_args(node.op)
    for i, entry in enumerate(names):
        value = node.args[i] if i < len(node.args) else node.kwargs.get(entry[0], _ABSENT)
        if value is not _ABSENT:
            yield entry, value
    if set(node.kwargs) - {n for n, _ in names}:
        raise _NoClass  # a kwarg the schema does not name: nothing known about it


def _classify(value: Any, size_like: bool, label: dict[int, int]) -> Any:
    if isinstance(value, TensorMeta):
        layout = _layout(value)
        if layout is None:
            raise _NoClass
        return ("T", tuple(label[s] for s in value.shape), layout, str(value.dtype))
    if isinstance(value, (list, tuple)) and not isinstance(value, torch.Size):
        return tuple(_classify(v, size_like, label) for v in value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if size_like:
            raise _NoClass
        return value
    if isinstance(value, float):
        return ("f",) + _float_class(value)
    if isinstance(value, (complex, str)):
        return repr(value)
    if isinstance(value, (torch.dtype, torch.layout, torch.memory_format, torch.device)):
        return str(value)
    raise _NoClass  # anything else: not known to be size-free


def _float_class(x: float) -> tuple:
    """A float scalar's class: its sign (or nan/inf) and whether it is a whole number.
    Torch's strategies read whether a scalar is zero (adding 0 keeps a Partial), not its
    magnitude; decompositions make such scalars from sizes (a mean's 1/N), so keying
    them exactly would make every shape a class of its own."""
    if math.isnan(x) or math.isinf(x):
        return (repr(x),)
    return ((x > 0) - (x < 0), x.is_integer(), math.copysign(1.0, x) < 0)


# ------------------------------------------------------------------ class members


def member(node: PrimNode, relabel: Callable[[int], int], scale: float) -> PrimNode:
    """The same call with every size s > 1 replaced by relabel(s) (strides rebuilt in the
    same memory order) and every float scalar x by x * scale when that keeps its class:
    another member of the node's class when `relabel` keeps order and distinctness. The
    generator and the tests ask torch at such members."""

    def fix(x: Any) -> Any:
        if isinstance(x, TensorMeta):
            shape = tuple(s if s <= 1 else relabel(s) for s in x.shape)
            return TensorMeta(shape, _strides_like(x, shape), x.dtype)
        if type(x) in (list, tuple):
            return type(x)(fix(v) for v in x)
        if type(x) is float and _float_class(x * scale) == _float_class(x):
            return x * scale
        return x

    args = tuple(fix(a) for a in node.args)
    kwargs = {k: fix(v) for k, v in node.kwargs.items()}
    return dataclasses.replace(node, args=args, kwargs=kwargs)


def _strides_like(meta: TensorMeta, shape: tuple[int, ...]) -> tuple[int, ...]:
    layout = _layout(meta)  # never None here: class_key refused such tensors
    order = list(range(len(shape))) if layout == "C" else (
        list(layout) + [d for d in range(len(shape)) if meta.shape[d] == 1]  # size-1 dims: innermost
    )
    stride = [0] * len(shape)
    expected = 1
    for d in reversed(order):
        stride[d] = expected
        expected *= shape[d]
    return tuple(stride)


def members(node: PrimNode) -> list[PrimNode]:
    """Two other members of the node's class: the smallest sizes that keep their order,
    and large ones (a strategy with a size threshold would show a difference), with
    float scalars scaled down and up."""
    sizes = sorted({s for m in node.input_metas() for s in m.shape if s > 1})
    small = {s: i + 2 for i, s in enumerate(sizes)}
    large = {s: 1000 + 37 * i + s for i, s in enumerate(sizes)}
    return [member(node, small.__getitem__, 0.37), member(node, large.__getitem__, 3.0)]
