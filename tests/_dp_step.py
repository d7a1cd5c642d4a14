"""One data-parallel training step of a model on simulated ranks against one device.

Shared by the uneven-batch, data-dependent-op and ConvNeXt regression tests: float64,
every parameter and buffer a replicated DTensor, the batch sharded on mesh dim 0 (the
other mesh dims replicated), the model's own loss, backward; the loss and every
parameter gradient (`full_tensor()`) compared with one device on every rank.
"""

from __future__ import annotations

import contextlib
import copy
import math
import warnings
from typing import Any, Callable, Sequence

import torch


def import_transformers() -> Any:
    """transformers imports torchvision, whose PyPI wheel needs the ecosystem shim here."""
    from decompshard.check.ecosystem import import_torchvision

    import_torchvision()
    import transformers
    return transformers


def _distribute_module(model: torch.nn.Module, mesh: Any) -> None:
    from torch.distributed.tensor import Replicate, distribute_tensor

    rep = [Replicate()] * mesh.ndim
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, rep),
                                                            requires_grad=p.requires_grad))
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is not None:
                mod._buffers[name] = distribute_tensor(b, mesh, rep)


def dp_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], loss_of: Callable[[Any], torch.Tensor],
            mesh_shape: Sequence[int], comm: bool = False) -> dict[str, Any]:
    """Run the step both ways; return the worst errors (loss, gradients) over every rank,
    relative to the largest magnitude of the one-device value,
    and with `comm` the collectives the DTensor step ran (CommDebugMode counts)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from decompshard.verify.dtensor_case import device_mesh, rank_locals

    model = model.to(torch.float64)
    ref = copy.deepcopy(model)
    ref_loss = loss_of(ref(**batch))
    ref_loss.backward()
    grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}

    mesh = device_mesh(mesh_shape)
    placements = [Shard(0)] + [Replicate()] * (len(mesh_shape) - 1)
    n = math.prod(mesh_shape)
    counter = CommDebugMode() if comm else contextlib.nullcontext()
    with warnings.catch_warnings(), LocalTensorMode(frozenset(range(n))):
        warnings.simplefilter("ignore")
        dmodel = copy.deepcopy(model)
        _distribute_module(dmodel, mesh)
        dbatch = {k: distribute_tensor(v, mesh, placements) for k, v in batch.items()}
        with counter:
            loss = loss_of(dmodel(**dbatch))
            loss.backward()
        errors = {"loss": _rel(rank_locals(loss.full_tensor(), mesh).values(), ref_loss.detach())}
        missing = []
        for name, p in dmodel.named_parameters():
            if name not in grads:
                continue
            if p.grad is None:
                missing.append(name)
                continue
            full = p.grad.full_tensor()
            errors[name] = _rel(rank_locals(full, mesh).values(), grads[name])
    out: dict[str, Any] = {"errors": errors, "missing": missing}
    if comm:
        out["comms"] = {str(k): v for k, v in counter.get_comm_counts().items()}
    return out


def _rel(got: Any, want: torch.Tensor) -> float:
    """Worst error over the ranks' values, relative to the largest magnitude of `want`
    (a shape mismatch is infinite)."""
    scale = max(want.abs().max().item(), 1e-30)
    return max((v - want).abs().max().item() / scale if v.shape == want.shape else float("inf") for v in got)
