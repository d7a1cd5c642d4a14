"""A Partial gradient reduced once per backward node, not once per op that reads it.

DTensor moves each op's inputs on their own, so a Partial tensor read by two ops that
need it whole is all-reduced twice. A backward node's formula often reads one gradient
twice: a matmul's node computes the input gradient from `grad` and the weight gradient
from `grad.t()` (`mm_mat2_backward`, when the weight is a transposed view, as
`nn.Linear`'s is). Where that gradient arrives Partial (T5's encoder output, kept Partial
through the final norm's backward), each mm all-reduces it at every row-parallel layer;
Megatron reduces it once. Here the first reduction is reused, where that is exact:

* only a pure reduction: Partial -> Replicate on some mesh dims, every other dim as it
  was. It is elementwise across ranks, so it commutes with any view of the local tensor;
* only the same data: a view at the same storage offset whose sizes and strides are a
  permutation of the reduced local tensor's (on every simulated rank alike), from the
  same autograd base, with the base's version and the local tensor's unchanged since.
  DTensor's in-place ops bump the DTensor's version (shared by its views), writes through
  `to_local()` the local tensor's (checked on 2.13). The reduced tensor is held, so its
  storage cannot be reused meanwhile;
* only in backward, within one autograd node of torch's own (a custom Function's backward
  is user code), never while tracing: entries are forgotten when another node starts and
  when the backward ends.

The DTensor a moved local tensor belongs to is read from DTensor's slow-path frame
(`_compat.dispatch_args_in_flight`): the C++ dispatch keeps the slow-path method it
fetched first, so a wrapper there would be skipped after an early DTensor op and would
outlive `disable()`. Every rank takes the same branch (shapes, versions and identities
are alike on every rank of an SPMD program). Not covered: a second DTensor made by
`from_local` over the same local tensor and written in place inside the same node.
Tests: tests/test_reduce_once.py.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import Any, Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

from decompshard._compat import (current_autograd_node, dispatch_args_in_flight, dispatch_redistribute_slot, in_backward,
                                 is_fake, local_tensor, on_backward_end, rank_tensors, tree_leaves)
from decompshard.runtime.table_patches import Entry, WarnOnce

__all__ = ["entries", "reduced_dims"]


@dataclasses.dataclass(frozen=True)
class _Reduced:
    """One reduction made in the current node, and what must still hold to reuse it."""

    key: tuple  # (mesh object id, the reduced dims with their Partials)
    base: Any  # the DTensor's autograd base (itself, if not a view): shares its version counter
    version: int  # the base's version when reduced
    local: torch.Tensor  # the local tensor reduced (held: its storage stays its own)
    local_versions: tuple[int, ...]  # per simulated rank
    result: torch.Tensor


_STATE = threading.local()  # box: this node's reductions


def reduced_dims(current: Any, target: Any) -> tuple | None:
    """The mesh dims (with their Partial) that a move from spec `current` to `target`
    reduces, where that is all it does (every other mesh dim unchanged); None otherwise."""
    if current.mesh != target.mesh:
        return None
    dims = []
    for dim, (c, t) in enumerate(zip(current.placements, target.placements)):
        if c.is_partial() and t.is_replicate():
            dims.append((dim, c))
        elif c != t:
            return None
    return tuple(dims) or None


def _parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors behind a local tensor: one per simulated rank, or itself."""
    ranks = rank_tensors(t)
    return [ranks[r] for r in sorted(ranks)] if ranks is not None else [t]


def _rank_permutation(held: torch.Tensor, view: torch.Tensor) -> list[int] | None:
    """The dims of `held` that `view` (same storage) lays out in its order; None if it is
    not `held` permuted."""
    if (held.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()
            or held.storage_offset() != view.storage_offset() or held.dim() != view.dim()):
        return None
    layout = list(zip(held.shape, held.stride()))
    perm: list[int] = []
    for pair in zip(view.shape, view.stride()):
        found = [i for i, p in enumerate(layout) if p == pair and i not in perm]
        if not found:
            return None
        perm.append(found[0])
    return perm


def _permutation(held: _Reduced, local: torch.Tensor) -> list[int] | None:
    """How `local` permutes `held.local`, the same on every simulated rank; None if not."""
    held_parts, parts = _parts(held.local), _parts(local)
    if len(held_parts) != len(parts) or tuple(p._version for p in held_parts) != held.local_versions:
        return None
    perms = {tuple(p) if p is not None else None for p in map(_rank_permutation, held_parts, parts)}
    return list(perms.pop()) if len(perms) == 1 and None not in perms else None


def _node_box() -> dict | None:
    """This node's reductions (a fresh list when another node runs); None where reuse is
    off: outside a node, in a custom Function's backward, while tracing."""
    node = current_autograd_node()
    if node is None or isinstance(node, torch.autograd.function.BackwardCFunction):
        return None
    box = getattr(_STATE, "box", None)
    if box is None or box.get("node") is not node:
        box = _STATE.box = {"node": node, "held": []}
        on_backward_end(box.clear)  # neither the node nor its reductions outlive the backward
    return box


def _reusing(original: Callable) -> Callable:
    """`redistribute_local_tensor` reusing a reduction made earlier in the same node."""

    @functools.wraps(original)
    def redistribute(local: torch.Tensor, current: Any, target: Any, **kwargs: Any) -> torch.Tensor:
        dims = reduced_dims(current, target) if not kwargs.get("async_op") and in_backward() else None
        dtensor = _owner(local) if dims else None
        off = dtensor is None or torch.compiler.is_compiling() or is_fake(local)  # no DTensor, or tracing
        box = None if off else _node_box()
        if box is None:
            return original(local, current, target, **kwargs)
        key, base = (id(current.mesh), dims), dtensor._base if dtensor._base is not None else dtensor
        for held in box["held"]:
            if held.key == key and held.base is base and held.version == base._version:
                perm = _permutation(held, local)
                if perm is not None:
                    return held.result if perm == sorted(perm) else held.result.permute(perm)
        result = original(local, current, target, **kwargs)
        box["held"].append(_Reduced(key, base, base._version, local, tuple(p._version for p in _parts(local)),
                                    result))
        return result

    return redistribute


def _owner(local: torch.Tensor) -> Any:
    """The DTensor argument of the op in flight whose local tensor `local` is; None if none."""
    args = dispatch_args_in_flight()
    if args is None:
        return None
    return next((a for a in tree_leaves(args) if isinstance(a, DTensor) and local_tensor(a) is local), None)


def entries(warn: WarnOnce) -> Iterator[Entry]:
    """What `enable()` puts where: the dispatcher's redistribution slot wrapped
    (`disable()` puts it back); nothing on a torch without it."""
    slot = dispatch_redistribute_slot()
    if slot is None:
        return
    module, attribute = slot
    yield module, attribute, _reusing(vars(module)[attribute])
