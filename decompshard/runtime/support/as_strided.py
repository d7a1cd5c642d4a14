"""`as_strided_` on DTensors, where it is a restride that moves no element.

timm's ConvNeXt (and every network ending in a channels-last-strided feature map) stops
at `aten.as_strided_` with a data-parallel batch, with or without decompshard: the
classifier's `adaptive_avg_pool2d(x, 1)` is, in ATen (AdaptiveAveragePooling.cpp),
`out = x.mean((-1, -2), keepdim=True)` followed, when `x` suggests channels-last, by
`out.as_strided_((n, c, 1, 1), (c, 1, c, c))`. DTensor has no strategy for
`as_strided_` and no decomposition can give one: it addresses raw storage, which a
shard does not share with the global tensor, and it mutates `self`'s metadata, so
`self` cannot be redistributed first.

That call changes only the strides of size-1 dims: every element stays where it is. Such
a restride is right on any placement: each rank restrides its local tensor the same
way (the strides of its size-1 dims; a shard's other strides are its own) and the
DTensor's metadata takes the requested strides. A replicated DTensor whose local tensor
has exactly the global layout can take any `as_strided_` (every rank holds the global
storage). Anything else would move elements across shards and raises a clear error
instead of running on the wrong storage. Installed by `enable()`, removed by
`disable()`.

`as_strided_copy` and `as_strided_scatter` (functional forms, what `torch.compile` and
decompositions emit) address storage too, and DTensor does not keep a rank's storage
laid out as the global tensor's: their handlers rebuild the global storage on each rank
(`_global_storage`) rather than trusting any sharding rule.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from decompshard._compat import custom_op_handlers, local_tensor, return_and_correct_aliasing, set_dtensor_layout
from decompshard.runtime.table_patches import Entry, WarnOnce

__all__ = ["COPY", "LIMITS", "OP", "OUT_OF_PLACE", "SCATTER", "entries"]

OP = torch.ops.aten.as_strided_.default
OUT_OF_PLACE = torch.ops.aten.as_strided.default
COPY = torch.ops.aten.as_strided_copy.default
SCATTER = torch.ops.aten.as_strided_scatter.default
LIMITS = ("enable() runs it only where it moves no element (a restride of size-1 dims: any placement) or on a "
          "Replicate input within its own elements (as_strided.py); anything else on a sharded or Partial input "
          "raises: it addresses the global storage, which no shard holds, and its result must alias the input, "
          "so a view of an all-gathered copy would lose writes. Redistribute to Replicate() first")


def entries(warn_once: WarnOnce) -> Iterator[Entry]:
    """DTensor's `as_strided_` handler, and its `as_strided` handler (which takes only an
    unchanged layout) made to take a restride too: the backward of `as_strided_` is an
    `as_strided` of the gradient (`enable()` installs them)."""
    handlers = custom_op_handlers()
    yield handlers, OP, as_strided__handler
    yield handlers, OUT_OF_PLACE, _restriding(handlers.get(OUT_OF_PLACE))
    yield handlers, COPY, as_strided_copy_handler
    yield handlers, SCATTER, as_strided_scatter_handler


def _bind(args: tuple, kwargs: dict) -> tuple[Any, tuple, tuple, int]:
    bound = dict(zip(("self", "size", "stride", "storage_offset"), args))
    bound.update(kwargs)
    target = bound["self"]
    offset = bound.get("storage_offset")
    return (target, tuple(int(s) for s in bound["size"]), tuple(int(s) for s in bound["stride"]),
            target.storage_offset() if offset is None else int(offset))


def _restriding(original: Any) -> Any:
    """DTensor's `as_strided` handler, which first takes a restride that moves no element
    as an alias restrided in place."""

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        target, size, stride, offset = _bind(args, kwargs)
        here = (tuple(target.shape), tuple(target.stride()), target.storage_offset())
        if (_moves_no_element(*here, size, stride, offset)
                or _replicated_in_own_elements(target, size, stride, offset)):
            return OP(torch.ops.aten.alias.default(target), size, stride, offset)
        if original is None:
            raise RuntimeError("as_strided not supported with DTensor")
        return original(op_call, args, kwargs)

    handler.__wrapped__ = original  # type: ignore[attr-defined]
    return handler


def _moves_no_element(shape: tuple, stride: tuple, offset: int, size: tuple, new_stride: tuple,
                      new_offset: int) -> bool:
    """Same sizes and offset, and the same stride wherever a dim has more than one index."""
    return (size == shape and new_offset == offset
            and all(n <= 1 or a == b for n, a, b in zip(size, stride, new_stride)))


def _contiguous_strides(shape: tuple) -> tuple:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(out))


def _replicated_in_own_elements(target: Any, size: tuple, stride: tuple, offset: int) -> bool:
    """A replicated DTensor whose local tensor and global metadata are both contiguous
    from offset 0, restrided onto positions among its own elements only: the local
    storage holds, at those positions, what one device's storage holds (the elements
    in row-major order), whatever lies beyond them."""
    local = local_tensor(target)
    shape = tuple(target.shape)
    if not all(p.is_replicate() for p in target.placements) or tuple(local.shape) != shape:
        return False
    contiguous = _contiguous_strides(shape)
    if any(n > 1 and (a != c or b != c) for n, a, b, c in zip(shape, target.stride(), local.stride(), contiguous)):
        return False
    if target.storage_offset() != 0 or local.storage_offset() != 0:
        return False
    return _positions_inside(size, stride, offset, target.numel())


def as_strided__handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    target, size, new_stride, new_offset = _bind(args, kwargs)
    offset = target.storage_offset()
    local = local_tensor(target)
    if _moves_no_element(tuple(target.shape), tuple(target.stride()), offset, size, new_stride, new_offset):
        local_stride = tuple(n if g == 1 else own for g, n, own in zip(size, new_stride, local.stride()))
        local.as_strided_(local.shape, local_stride, local.storage_offset())
    elif _replicated_in_own_elements(target, size, new_stride, new_offset):
        local.as_strided_(size, new_stride, new_offset)
    else:
        raise RuntimeError(
            f"decompshard: as_strided_ of a DTensor {tuple(target.shape)} {tuple(target.placements)} to size "
            f"{size}, stride {new_stride}, offset {new_offset} would move elements (it addresses the global "
            "storage, which no shard holds); only a restride of size-1 dims runs on a sharded DTensor. "
            "Redistribute to Replicate() first, or use a view op")
    set_dtensor_layout(target, size, new_stride)
    return return_and_correct_aliasing(op_call, args, kwargs, target)


def _dense_from_zero(shape: tuple, stride: tuple, offset: int) -> bool:
    """A layout whose elements fill storage positions 0..numel-1 exactly (some
    permutation of row-major): the only global layout whose storage DTensor can rebuild
    from a rank's full-size tensor."""
    if offset != 0:
        return False
    expected = 1
    for n, st in sorted(((n, st) for n, st in zip(shape, stride) if n > 1), key=lambda d: d[1]):
        if st != expected:
            return False
        expected *= n
    return True


def _positions_inside(size: tuple, stride: tuple, offset: int, numel: int) -> bool:
    if any(n == 0 for n in size):
        return offset >= 0
    lo = offset + sum((n - 1) * s for n, s in zip(size, stride) if s < 0)
    hi = offset + sum((n - 1) * s for n, s in zip(size, stride) if s > 0)
    return 0 <= lo and hi < numel


def _global_storage(op: str, target: Any, size: tuple, stride: tuple, offset: int, placements: tuple) -> Any:
    """Each rank's copy of the global storage `target` addresses: redistributed to
    `placements` (no Shard: a rank needs every element), laid out as the global tensor.
    Raises where that storage is not the tensor's own elements."""
    shape = tuple(target.shape)
    if not (_dense_from_zero(shape, tuple(target.stride()), target.storage_offset())
            and _positions_inside(size, stride, offset, target.numel())):
        raise RuntimeError(
            f"decompshard: {op} of a DTensor {shape} with stride {tuple(target.stride())}, offset "
            f"{target.storage_offset()} to size {size}, stride {stride}, offset {offset} addresses storage that no "
            "rank holds (a view into a larger tensor, or positions beyond its elements). Call .contiguous() on "
            "the full tensor first, or use view ops")
    if placements != tuple(target.placements):
        target = target.redistribute(target.device_mesh, placements)
    local = local_tensor(target)
    return torch.empty_strided(shape, tuple(target.stride()), dtype=local.dtype, device=local.device).copy_(local)


def as_strided_copy_handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """`as_strided_copy` reads the input's storage positions. DTensor does not keep a
    rank's storage laid out as the global tensor's (distribute_tensor of a transposed
    tensor holds contiguous locals under a (1, n) global stride), so any sharding rule
    for it, the derived P -> P included, read the wrong elements on a non-row-major
    input (found by the runtime check: max error 3.45 on values of 1.98). Here each
    rank rebuilds the global storage from its full-size tensor (Shard redistributed to
    Replicate first; Partial stays: a selection of elements commutes with sum, avg, max
    and min) and selects from it."""
    from torch.distributed.tensor import DTensor, Replicate

    target, size, stride, offset = _bind(args, kwargs)
    placements = tuple(Replicate() if p.is_shard() else p for p in target.placements)
    storage = _global_storage("as_strided_copy", target, size, stride, offset, placements)
    return DTensor.from_local(COPY(storage, size, stride, offset), target.device_mesh, placements, run_check=False,
                              shape=torch.Size(size), stride=_contiguous_strides(size))


def as_strided_scatter_handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """`as_strided_scatter` writes `src` at storage positions of a copy of `self`: the
    same storage question as `as_strided_copy_handler`. Partial stays only where `self`
    and `src` hold the same Partial (the result is then that reduction of the ranks'
    results); everything else is replicated first."""
    from torch.distributed.tensor import DTensor, Replicate

    bound = dict(zip(("self", "src", "size", "stride", "storage_offset"), args))
    bound.update(kwargs)
    target, src = bound["self"], bound["src"]
    if not (isinstance(target, DTensor) and isinstance(src, DTensor)):
        raise RuntimeError("aten.as_strided_scatter.default got mixed torch.Tensor and DTensor, need to convert "
                           "all torch.Tensor to DTensor before calling distributed operators!")
    _, size, stride, offset = _bind((target, bound["size"], bound["stride"], bound.get("storage_offset")), {})
    placements = tuple(p if p.is_partial() and p == q else Replicate()
                       for p, q in zip(target.placements, src.placements))
    storage = _global_storage("as_strided_scatter", target, size, stride, offset, placements)
    if tuple(src.placements) != placements:
        src = src.redistribute(src.device_mesh, placements)
    out = SCATTER(storage, local_tensor(src), size, stride, offset)
    return DTensor.from_local(out, target.device_mesh, placements, run_check=False, shape=target.shape,
                              stride=tuple(out.stride()))
