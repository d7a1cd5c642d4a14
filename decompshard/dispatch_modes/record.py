"""Recorders: dispatch modes that watch the aten calls a program makes, as DTensor would.

A dispatch mode sees calls after CompositeImplicitAutograd decomposition, and is
disabled while its own handler runs, so calls made inside a kernel are not seen: what
it records is the outermost level, exactly what a tensor subclass like DTensor (itself a
`__torch_dispatch__` subclass) is asked to shard. Two commands need that view:

- `RecordOutermostAtenCalls`: each call's op and a private copy of its arguments
  (`exact_clone`), taken before the call runs: the OpInfo capture
  (coverage/opinfo_samples.py) and the audit's argument variants
  (coverage/native_variants.py) replay them later.
- `RecordCallOutputs`: each call's op, phase and tensor outputs, for
  `decompshard check --model` (check/model.py), which walks a one-device run and a
  DTensor run side by side.

They live here, beside the tracing mode, because every dispatch mode of the project
belongs to the trace stage; nothing here imports the commands that use them.
"""

from __future__ import annotations

from typing import Any

import torch

from decompshard._compat import OpOverload
from decompshard._compat import TorchDispatchMode
from decompshard._compat import tree_leaves, tree_map

from decompshard._compat import custom_op_implementation

__all__ = ["RecordCallOutputs", "RecordOutermostAtenCalls", "exact_clone"]


def exact_clone(x: Any) -> Any:
    """Clone a tensor keeping its storage, offset and strides (as_strided-style ops
    address the storage directly, so a plain `.clone()` would change their meaning).
    Anything else is returned as it is."""
    if not isinstance(x, torch.Tensor):
        return x
    with torch.no_grad():
        if (
            x.layout is torch.strided
            and type(x) is torch.Tensor
            and not x.is_conj()
            and not x.is_neg()
            and not x.is_quantized
        ):
            try:
                storage = x.untyped_storage()
                out = torch.empty(0, dtype=x.dtype, device=x.device)
                out.set_(storage.clone(), x.storage_offset(), x.size(), x.stride())
                return out
            except Exception:  # pragma: no cover - exotic tensors fall through
                pass
        return x.detach().clone()


class RecordOutermostAtenCalls(TorchDispatchMode):
    """Records (op, cloned args, cloned kwargs) of each successful aten call.

    The copies are taken before the call, so an in-place op (or a later one in the same
    program) does not alter what was recorded; a call whose arguments cannot be copied
    is run but not recorded, and a call that raises is not recorded.
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[OpOverload, tuple, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "namespace", None) != "aten":
            return func(*args, **kwargs)
        try:
            snap = tree_map(exact_clone, (tuple(args), dict(kwargs)))
        except Exception:
            snap = None
        out = func(*args, **kwargs)
        if snap is not None:
            self.calls.append((func, snap[0], snap[1]))
        return out


class RecordCallOutputs(TorchDispatchMode):
    """(op, phase, tensor outputs) of each outermost aten call (and custom op call).

    `phase` is whatever the caller set before the calls ("forward", then "backward");
    `current` is the op in flight, so when a call raises the caller can name it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, list[torch.Tensor]]] = []
        self.phase = "forward"
        self.current = ""  # the op in flight: the one that raised, if a call raises

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.current = str(func)
        out = func(*args, **(kwargs or {}))
        if _recorded(func):
            self.calls.append((str(func), self.phase, [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]))
        return out


def _recorded(func: Any) -> bool:
    """aten calls, and custom ops (torch.library.custom_op: one call on both sides, its
    implementation runs below the recorder), so a custom op's wrong output is named, not
    the op after it. Not detach, nor the calls that only read metadata: DTensor and a
    LocalTensor ask for sizes where one device does not."""
    if func.namespace != "aten":
        return custom_op_implementation(func) is not None
    return func is not torch.ops.aten.detach.default and func not in _METADATA_OPS


_METADATA_OPS = frozenset(getattr(torch.ops.aten, n).default for n in (
    "dim", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_contiguous"))
