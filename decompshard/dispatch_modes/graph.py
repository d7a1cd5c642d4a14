"""PrimGraph: what one run of a decomposition did, recorded once and reused everywhere.

The graph is placement-free: the same recording serves every candidate placement, the
explain trace and the local-shape check. Values are numbered in creation order; every
value is a graph input, a constant (made without reading any input), or a node output.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from decompshard._compat import TensorMeta
from decompshard.dispatch_modes.signs import ZERO

INPUT, CONST, NODE = "input", "const", "node"


# Argument trees of aten calls are lists, tuples and dicts of leaves. These walk them
# about 5x faster than torch's pytree, which matters: the tracer and the local check
# walk every primitive's arguments. torch.Size and TensorMeta are leaves; result tuples
# (torch.return_types) are walked; dicts in insertion order, as torch's pytree does.
def is_container(x: Any) -> bool:
    return isinstance(x, (list, dict)) or (
        isinstance(x, tuple) and not isinstance(x, (torch.Size, TensorMeta))
    )


def leaves(obj: Any, out: list | None = None) -> list:
    """The leaves of an argument tree, in order."""
    out = [] if out is None else out
    t = type(obj)
    if t is list or t is tuple:
        for x in obj:
            leaves(x, out)
    elif t is dict:
        for x in obj.values():
            leaves(x, out)
    elif is_container(obj):  # a tuple subclass: torch.return_types
        for x in obj:
            leaves(x, out)
    else:
        out.append(obj)
    return out


def map_leaves(fn: Callable[[Any], Any], obj: Any) -> Any:
    """`fn` applied to every leaf, containers rebuilt as plain lists, tuples and dicts."""
    t = type(obj)
    if t is list:
        return [map_leaves(fn, x) for x in obj]
    if t is tuple:
        return tuple([map_leaves(fn, x) for x in obj])
    if t is dict:
        return {k: map_leaves(fn, v) for k, v in obj.items()}
    if is_container(obj):  # a tuple subclass: torch.return_types
        return [map_leaves(fn, x) for x in obj]
    return fn(obj)


def freeze(obj: Any) -> Any:
    """A hashable form of an argument tree (lists become tuples, dicts sorted pairs)."""
    if isinstance(obj, dict):
        return tuple(sorted(((k, freeze(v)) for k, v in obj.items()), key=lambda kv: kv[0]))
    if is_container(obj):
        return tuple(freeze(v) for v in obj)
    return obj


@dataclass(frozen=True)
class ValueInfo:
    id: int
    kind: str  # INPUT | CONST | NODE
    meta: TensorMeta
    sign: int = 0  # signs.NONNEG / NONPOS / ZERO bits known from the trace (signs.py)

    @property
    def zero(self) -> bool:
        """All zeros (full(0), zeros_like, ...): a constant that is also a valid P(sum)."""
        return self.sign == ZERO


@dataclass(frozen=True)
class PrimNode:
    """One primitive call.

    `args`/`kwargs` are the call's arguments with every tensor replaced by its
    TensorMeta (the form torch's strategy functions take); `inputs` are the value ids of
    those tensors in flattened schema order; `outputs` has one entry per leaf of the
    flattened result: a value id, or None for a non-tensor leaf.
    """

    index: int
    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    inputs: tuple[int, ...]
    outputs: tuple[int | None, ...]
    constant: bool  # every tensor input is a constant: the outputs are constants too
    out_metas: tuple[TensorMeta | None, ...] = ()  # one per output leaf
    in_signs: tuple[int, ...] = ()  # signs.py bits of each tensor input, as `inputs`
    # (sf, inner) kinds of strided shard that may reach the inputs (rules/strided.py)
    strided_in: frozenset = frozenset()

    @functools.cached_property
    def _leaves(self) -> tuple[Any, ...]:
        return tuple(leaves((self.args, self.kwargs)))

    def non_tensor_leaves(self) -> list[Any]:
        return [x for x in self._leaves if not isinstance(x, TensorMeta)]

    def input_metas(self) -> list[TensorMeta]:
        """TensorMeta of each tensor input, in the order of `inputs`."""
        return [x for x in self._leaves if isinstance(x, TensorMeta)]


@dataclass
class PrimGraph:
    op: torch._ops.OpOverload
    inputs: tuple[int, ...]  # value id per tensor input of the op, schema order
    outputs: tuple[int | None, ...]  # value id per output leaf; None: not a tensor
    values: list[ValueInfo] = field(default_factory=list)
    nodes: list[PrimNode] = field(default_factory=list)
    # value id -> tracing.READ_SIZE | READ_LAYOUT: the decomposition's own code (not a
    # primitive's kernel) read that value's sizes / strides. Empty: it read none.
    reads: dict[int, int] = field(default_factory=dict)
    # recorded for the local-shape check only (tracing.trace(shapes_only=True)): nodes,
    # arguments and value shapes as a full trace has them, but no reads, signs or
    # strided kinds. Never solved on.
    shapes_only: bool = False

    def meta(self, vid: int) -> TensorMeta:
        return self.values[vid].meta

    def is_const(self, vid: int) -> bool:
        return self.values[vid].kind == CONST

    def producer(self) -> dict[int, int]:
        """value id -> index of the node that produced it."""
        return {v: n.index for n in self.nodes for v in n.outputs if v is not None}

    def last_use(self) -> dict[int, int]:
        """value id -> index of the last node reading it (graph outputs live forever)."""
        last: dict[int, int] = {}
        for n in self.nodes:
            for v in n.inputs:
                last[v] = n.index
        for v in self.outputs:
            if v is not None:
                last[v] = len(self.nodes)
        return last

    def signature(self) -> list[tuple]:
        """Op sequence and non-tensor args: two traces with equal signatures took the
        same path through the decomposition."""
        return [(n.op, len(n.inputs), len(n.outputs)) for n in self.nodes]

    def format(self) -> str:
        lines = []
        for n in self.nodes:
            ins = ", ".join(f"%{v}" for v in n.inputs)
            outs = ", ".join("_" if v is None else f"%{v}" for v in n.outputs)
            extra = [repr(x) for x in n.non_tensor_leaves()]
            lines.append(
                f"{n.index:3d}: {outs} = {n.op}({ins}{'; ' + ', '.join(extra) if extra else ''})"
                + ("  [const]" if n.constant else "")
            )
        return "\n".join(lines)
