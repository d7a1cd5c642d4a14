"""Gradient clipping over tensors that live on different meshes, or on meshes and as
plain tensors, under `enable()`.

`torch.nn.utils.clip_grad_norm_` computes one norm per gradient and stacks them; on its
own, torch stops where the gradients do not share one mesh: FSDP2 with tensor parallel
in torchtitan's order (the tensor-parallel weights on the 2-D mesh, the norms' weights on
'dp') stops with "All operands in aten.stack.default must have the same mesh", tensor
parallel with the other parameters left plain with "aten._foreach_norm.Scalar got mixed
torch.Tensor and DTensor". Both programs are valid: the total norm is the p-norm of every
gradient's norm, however they are placed.

Under `enable()` torch's total-norm step groups the tensors by where they live (each
DTensor mesh; plain tensors together, which torch already handles across devices), runs
torch's own function on each group, reduces each group's norm once (per mesh dim of a
multi-dim mesh, as DTensor does, unless the user flattened it), and combines the group norms as one device does: torch's own function on
the group norms (the p-norm of p-norms is the p-norm of the whole, inf the max; its
`error_if_nonfinite` check and message), a sum for p = 0 (the count of non-zero
gradients). The total comes back a plain tensor on the first tensor's device, the same
on every rank (torchtitan's clipping returns its full tensor too). The clip step scales
each group's gradients by that norm with torch's own function per group (its foreach
choice per group). A call torch handles (one group) goes to torch unchanged.

Where: `clip_grad_norm_` finds both steps as module globals of `torch.nn.utils.clip_grad`,
looked up at each call; `torch.nn.utils` re-exports them as `get_total_norm` and
`clip_grads_with_norm_`. `enable()` wraps all four slots, so `clip_grad_norm_` through
any name is covered; `disable()` puts torch's functions back. A name imported from
`torch.nn.utils` before `enable()` keeps torch's own. Tests: tests/test_clip_norms.py.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable, Iterator

import torch

from decompshard._compat import DTensor, clip_grad_slots
from decompshard.runtime.table_patches import Entry, WarnOnce

__all__ = ["across_total_norm", "clip_across", "entries", "grouped"]


def entries(warn_once: WarnOnce) -> Iterator[Entry]:
    """torch's total-norm and clip-with-norm functions, each slot wrapped (what `enable()`
    installs): the private module globals `clip_grad_norm_` calls, and their public names."""
    module, total_name, clip_name = clip_grad_slots()
    utils = torch.nn.utils
    for table, name, wrap in ((module, total_name, across_total_norm), (module, clip_name, clip_across),
                              (utils, "get_total_norm", across_total_norm),
                              (utils, "clip_grads_with_norm_", clip_across)):
        yield table, name, wrap(getattr(table, name))


def _where(t: torch.Tensor) -> Any:
    """Where a tensor lives for the norm: its DTensor mesh, or None for a plain tensor."""
    return t.device_mesh if isinstance(t, DTensor) else None


def grouped(items: Iterable[Any], tensor_of: Callable[[Any], torch.Tensor] = lambda t: t) -> dict[Any, list]:
    """The items by where their tensor lives, in the order each place first appears."""
    groups: dict[Any, list] = {}
    for item in items:
        groups.setdefault(_where(tensor_of(item)), []).append(item)
    return groups


def _reduced(norm: torch.Tensor) -> torch.Tensor:
    """A group's norm as a plain tensor (DTensor's `full_tensor()`: nothing moves for
    Replicate; a Partial on each dim of a multi-dim mesh is reduced once per mesh dim, or
    in one collective where the user flattened the mesh: decompshard never flattens a
    user's mesh, which would outlive `disable()` and change DTensor's later reductions)."""
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _group_norm(total_norm: Callable, where: Any, group: list, norm_type: float, foreach: bool | None) -> torch.Tensor:
    """One group's norm by torch's function, reduced once."""
    return _reduced(total_norm(group, norm_type, False, foreach))


def _combined(total_norm: Callable, norms: list[torch.Tensor], norm_type: float, error_if_nonfinite: bool,
              device: torch.device) -> torch.Tensor:
    """The total of the group norms, as one device computes it over every tensor."""
    norms = [n.to(device) for n in norms]
    if norm_type == 0:  # each group's value counts its non-zero tensors
        return torch.stack(norms).sum()
    return total_norm(norms, norm_type, error_if_nonfinite, None)


def across_total_norm(total_norm: Callable) -> Callable:
    """torch's `_get_total_norm` (`get_total_norm`), for tensors on several meshes or
    mixed with plain tensors: one norm per group by torch, reduced once, combined."""

    @functools.wraps(total_norm)
    def get_total_norm(tensors: Any, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                       foreach: bool | None = None) -> torch.Tensor:
        tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        groups = grouped(tensors)
        if len(groups) <= 1:
            return total_norm(tensors, norm_type, error_if_nonfinite, foreach)
        with torch.no_grad():
            norms = [_group_norm(total_norm, where, group, norm_type, foreach) for where, group in groups.items()]
            return _combined(total_norm, norms, float(norm_type), error_if_nonfinite, tensors[0].device)

    return get_total_norm


def _fits(where: Any, total: torch.Tensor) -> bool:
    """Whether a group's clip can use the total norm as given: plain (a 0-dim tensor,
    which DTensor replicates) or on the group's own mesh."""
    return not isinstance(total, DTensor) or total.device_mesh == where


def clip_across(clip: Callable) -> Callable:
    """torch's `_clip_grads_with_norm_` (`clip_grads_with_norm_`), for gradients on
    several meshes or mixed with plain ones: torch's own clip on each group."""

    @functools.wraps(clip)
    def clip_grads_with_norm_(parameters: Any, max_norm: float, total_norm: torch.Tensor,
                              foreach: bool | None = None) -> None:
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        groups = grouped((p for p in parameters if p.grad is not None), lambda p: p.grad)
        if len(groups) <= 1 and all(_fits(where, total_norm) for where in groups):
            return clip(parameters, max_norm, total_norm, foreach)
        with torch.no_grad():
            plain = None if all(_fits(where, total_norm) for where in groups) else _reduced(total_norm)
            for where, group in groups.items():
                clip(group, max_norm, total_norm if _fits(where, total_norm) else plain, foreach)
        return None

    return clip_grads_with_norm_
