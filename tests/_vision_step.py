"""One training step of a vision model on simulated ranks against one device (float64):
shared by the vision tests (tests/test_vision_guard.py) and bench/guard.py.

Every parameter AND buffer becomes a DTensor (plain tensors beside DTensors raise
"mixed torch.Tensor and DTensor"); parameters and buffers are replicated unless `plan`
names other placements. The step: forward, the model's own loss (or cross entropy of
its logits), backward. Compared on every rank: the loss, every parameter's gradient
and every floating buffer after the step (BatchNorm's running statistics).
"""

from __future__ import annotations

import copy
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from decompshard.check.model import own_copies as _own_copies  # one implementation: the zoo runner's


@dataclass
class StepResult:
    error: str = ""
    loss: dict[int, torch.Tensor] = field(default_factory=dict)  # rank -> full loss
    grads: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    buffers: dict[str, dict[int, torch.Tensor]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)  # decompshard's warnings during the step


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The model's own loss when it takes labels (transformers); cross entropy for
    integer labels; mean squared error for floating targets (no nll_loss on the way)."""
    if hasattr(model, "config"):
        return model(pixel_values=x, labels=y).loss
    if y.dtype.is_floating_point:
        return F.mse_loss(model(x), y)
    return F.cross_entropy(model(x), y)


def reference(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> StepResult:
    m = copy.deepcopy(model).to(torch.float64)
    loss = loss_of(m, x, y)
    loss.backward()
    return StepResult(
        loss={0: loss.detach()},
        grads={n: {0: p.grad} for n, p in m.named_parameters() if p.grad is not None},
        buffers={n: {0: b.detach().clone()} for n, b in m.named_buffers() if b.dtype.is_floating_point})


def _set(model: torch.nn.Module, name: str, value: Any, buffer: bool) -> None:
    *path, leaf = name.split(".")
    mod = model
    for p in path:
        mod = getattr(mod, p)
    if buffer:
        mod._buffers[leaf] = value
    else:
        setattr(mod, leaf, value)


def dtensor_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, mesh: Any,
                 batch: Sequence[Any], plan: Callable[[str, torch.Tensor], Sequence[Any] | None] | None = None
                 ) -> StepResult:
    """The step on DTensors under LocalTensorMode (call inside a simulated world).
    `batch`: the input's and labels' placements; `plan(name, tensor)`: placements of a
    parameter or buffer, None for replicated."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    n = mesh.size()
    rep = [Replicate()] * mesh.ndim
    m = copy.deepcopy(model).to(torch.float64)
    out = StepResult()

    def full(t: torch.Tensor) -> dict[int, torch.Tensor]:
        t = t.full_tensor() if isinstance(t, DTensor) else t
        lt = getattr(t, "_local_tensors", None)
        return {r: v.detach().clone() for r, v in lt.items()} if lt is not None else {r: t.detach() for r in range(n)}

    with LocalTensorMode(frozenset(range(n))), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, p in list(m.named_parameters()):
            pl = (plan and plan(name, p)) or rep
            _set(m, name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, list(pl))), buffer=False)
        for name, b in list(m.named_buffers()):
            pl = (plan and plan(name, b)) or rep
            _set(m, name, _own_copies(distribute_tensor(b.detach(), mesh, list(pl)), n), buffer=True)
        dx = distribute_tensor(x, mesh, list(batch))
        dy = distribute_tensor(y, mesh, list(batch))
        try:
            loss = loss_of(m, dx, dy)
            loss.backward()
        except Exception as e:
            out.error = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"
            return out
        finally:
            out.warnings = [str(w.message) for w in caught if str(w.message).startswith("decompshard")]
        out.loss = full(loss)
        out.grads = {name: full(p.grad) for name, p in m.named_parameters() if p.grad is not None}
        out.buffers = {name: full(b) for name, b in m.named_buffers() if b.dtype.is_floating_point}
    return out


def mismatches(got: StepResult, ref: StepResult, rtol: float = 1e-7, atol: float = 1e-9) -> list[str]:
    """What differs from one device, on any rank ([] when the step is right)."""
    if got.error:
        return [got.error]
    bad = []
    for what, g, r in (("loss", {"loss": got.loss}, {"loss": ref.loss}), ("grad", got.grads, ref.grads),
                       ("buffer", got.buffers, ref.buffers)):
        if set(g) != set(r):
            bad.append(f"{what}s differ in names: {sorted(set(g) ^ set(r))}")
        for name in sorted(set(g) & set(r)):
            want = r[name][0]
            if not g[name]:
                bad.append(f"{what} {name}: no value")
            for rank, v in g[name].items():
                if v.shape != want.shape or not torch.allclose(v, want, rtol=rtol, atol=atol):
                    err = float((v - want).abs().max()) if v.shape == want.shape else float("inf")
                    bad.append(f"{what} {name} rank {rank}: max error {err:.3g}")
                    break
    return bad
