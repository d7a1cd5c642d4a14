"""torch's private utilities outside DTensor: op overloads, pytree, dispatch modes and fake
tensors (re-exported as they are); the dispatcher's schema table, torch's decompositions
and custom ops; the autograd engine's state; and the heavy names loaded on first use
(OpInfo's database, the comm-mode tables, `expand_to_full_mesh_op_strategy`), so that
`import decompshard` stays cheap."""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._python_dispatch import _disable_current_modes as disable_current_modes
from torch.utils._pytree import (
    keystr, tree_flatten, tree_flatten_with_path, tree_leaves, tree_map, tree_unflatten,
)

__all__ = [
    "FakeTensorMode", "OpOverload", "TorchDispatchMode", "aten_ops_tagged", "clip_grad_slots", "current_autograd_node",
    "custom_op_implementation", "custom_op_overload", "custom_op_registry", "disable_current_modes",
    "in_backward", "is_dispatchable", "is_fake", "keystr", "lazy_attribute", "linear_node_operands", "on_backward_end",
    "torch_decomposition", "torch_decomposition_table", "tree_flatten", "tree_flatten_with_path", "tree_leaves",
    "tree_map", "tree_unflatten",
]

_LAZY = {
    "op_db": ("torch.testing._internal.common_methods_invocations", "op_db"),
    "c10d_collective_ops": ("torch.distributed.tensor.debug._comm_mode", "c10d_collective_ops"),
    "expand_to_full_mesh_op_strategy": ("torch.distributed.tensor._ops.utils", "expand_to_full_mesh_op_strategy"),
}


def lazy_attribute(name: str) -> Any:
    """One of the heavy names above, imported on first use (the package's `__getattr__`)."""
    if name not in _LAZY:
        raise AttributeError(f"module 'decompshard._compat' has no attribute {name!r}")
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)


def clip_grad_slots() -> tuple[Any, str, str]:
    """Where `torch.nn.utils.clip_grad_norm_` finds its two steps: (the module
    `torch.nn.utils.clip_grad`, the name of the total-norm function in it, the name of the
    clip-by-a-given-norm function). Both names are private module globals, looked up at
    each call (`torch.nn.utils` re-exports them as `get_total_norm` and
    `clip_grads_with_norm_`). The same in 2.13-2.15."""
    from torch.nn.utils import clip_grad

    return clip_grad, "_get_total_norm", "_clip_grads_with_norm_"


def aten_ops_tagged(tag: Any) -> list[torch._ops.OpOverload]:
    """Every aten overload the dispatcher knows that carries `tag`: read from the
    dispatcher's schema table (40 ms for all ~3,000), not by resolving each overload."""
    found = []
    for name in torch._C._dispatch_get_all_op_names():
        if not name.startswith("aten::"):
            continue
        base, _, overload = name.partition(".")
        entry = torch._C._get_operation_overload(base, overload)
        if entry is not None and tag in entry[2]:
            found.append(getattr(getattr(torch.ops.aten, base[len("aten::"):]), overload or "default"))
    return found


@functools.lru_cache(maxsize=None)  # one answer per overload, asked on every derive_rules call
def is_dispatchable(op: torch._ops.OpOverload) -> bool:
    """Whether the dispatcher knows the overload. torch.ops also lists TorchScript-only
    overloads (aten.add_.t, on Python lists); most questions about them (can it
    decompose? its tags?) raise a RuntimeError from deep inside torch."""
    try:
        torch._C._dispatch_find_schema_or_throw(op._schema.name, op._schema.overload_name)
    except RuntimeError:
        return False
    return True


def torch_decomposition_table() -> dict:
    from torch._decomp import decomposition_table

    return decomposition_table


def torch_decomposition(op: Any) -> Any:
    """torch's own decomposition of `op`: its decomposition table, then
    CompositeImplicitAutograd; None if it has neither."""
    table = torch_decomposition_table()
    if op in table:
        return table[op]
    try:
        return op.decompose if op._can_decompose() else None
    except RuntimeError:  # an overload the dispatcher lacks (is_dispatchable)
        return None


def custom_op_implementation(op: Any) -> Any:
    """The Python implementation of a `torch.library.custom_op` (torch's CustomOpDef):
    its CPU kernel, else its default (all-device) kernel, else the function it was
    defined with; None for any other op, and for a custom op that mutates or aliases
    its arguments (its implementation writes into inputs; not traced)."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace in ("aten", "prims"):
        return None
    try:
        from torch._library.custom_ops import _maybe_get_opdef

        opdef = _maybe_get_opdef(op)
    except Exception:  # an op torch's custom-op registry does not know how to look up
        return None
    if opdef is None:
        return None
    schema = op._schema
    if any(a.alias_info is not None for a in schema.arguments) or any(
            r.alias_info is not None for r in schema.returns):
        return None
    backend = getattr(opdef, "_backend_fns", {}) or {}
    return backend.get("cpu") or backend.get(None) or getattr(opdef, "_init_fn", None)


def custom_op_overload(obj: Any) -> Any:
    """The OpOverload behind a `torch.library.custom_op` object (torch's CustomOpDef);
    None for anything else."""
    from torch._library.custom_ops import CustomOpDef

    return obj._opoverload if isinstance(obj, CustomOpDef) else None


def custom_op_registry() -> str:
    """The module of torch's custom-op registry that `custom_op_implementation` and
    `custom_op_overload` read (its CustomOpDef and _maybe_get_opdef); raises ImportError
    where this torch lacks them."""
    from torch._library import custom_ops
    from torch._library.custom_ops import CustomOpDef, _maybe_get_opdef  # noqa: F401

    return custom_ops.__name__


def is_fake(t: Any) -> bool:
    """Whether `t` is a FakeTensor (tracing: no data to reuse)."""
    from torch._subclasses.fake_tensor import is_fake as fake

    return bool(fake(t))


def current_autograd_node() -> Any:
    """The autograd node whose backward (or hooks) this thread runs now; None outside one."""
    return torch._C._current_autograd_node()


def linear_node_operands(node: Any) -> tuple[Any, Any, bool] | None:
    """A matmul node's saved operands (`mm`'s self and mat2, `addmm`'s mat1 and mat2, as
    its forward got them) and whether it computes the first one's gradient too (an edge
    goes out there); None for any other node. Its backward computes mat2's gradient
    first, then mat1's (`mm_mat2_backward`, then `mm_mat1_backward`: checked on
    2.13-2.15), both from the same incoming gradient."""
    first = {"MmBackward0": ("_saved_self", 0), "AddmmBackward0": ("_saved_mat1", 1)}.get(type(node).__name__)
    if first is None:
        return None
    name, edge = first
    try:
        return getattr(node, name), node._saved_mat2, node.next_functions[edge][0] is not None
    except (AttributeError, RuntimeError, IndexError):  # freed saved tensors, or another layout
        return None


def on_backward_end(callback: Any) -> None:
    """Run `callback()` when the backward pass running now ends (the engine's queue)."""
    torch.autograd.Variable._execution_engine.queue_callback(callback)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread now (its
    graph task id is -1 outside one): a pricing that differs between forward and backward
    asks here."""
    return torch._C._current_graph_task_id() != -1
