"""The bytes an expert's hand-written plan moves in one training step of a zoo case,
computed without the propagator: the yardstick the zoo prints beside what `enable()`
moves (issue 28: every case within 1.25x of it, or a note why DTensor cannot express it).

Counted in the zoo's unit (`dispatch_modes/comm_bytes.py`: per collective, the bytes the
rank holding the most puts in, summed over the step):

* data parallel (DDP): every gradient all-reduced once over the batch's mesh dim, at the
  size each rank holds (a tensor-parallel parameter's shard on a 2-D mesh); plus, per
  BatchNorm layer in training, SyncBatchNorm's statistics: 2 x C numbers forward and
  2 x C backward;
* tensor parallel (Megatron): one all-reduce of each row-parallel layer's output in the
  forward, one of each column-parallel layer's input gradient in the backward (layers
  that read the same tensor, q/k/v or gate/up, share it), at the local batch's size.
  Parameters outside the plan are replicated with replicated inputs: no collective.
  Raw expert parameters (a plan entry without a module) have no Megatron count: noted.

Activation sizes come from one forward pass on one device with hooks on the plan's
layers; the batch share of the largest rank is ceil(batch / dp) / batch.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Expert", "expert_bytes"]


@dataclass
class Expert:
    bytes: int
    note: str = ""  # what the count leaves out


def _sizes(sh: Any) -> tuple[int, int]:
    dp = sh.mesh[sh.dp] if sh.dp is not None else 1
    tp = sh.mesh[sh.tp] if sh.tp is not None else 1
    return dp, tp


def _ddp(model: torch.nn.Module, targets: dict, tp: int) -> int:
    """Every gradient once, at the size one rank holds."""
    from decompshard.check.zoo import tp_placement

    from decompshard._compat import TorchReplicate

    total, seen = 0, set()
    for name, p in model.named_parameters():
        if id(p) in seen or not p.requires_grad:
            continue
        seen.add(id(p))
        numel = p.numel()
        if name in targets and tp > 1:
            style, mod = targets[name]
            if not isinstance(tp_placement(style, name, p, mod), TorchReplicate):
                numel = math.ceil(numel / tp)
        total += numel * p.element_size()
    return total


def _megatron_hooks(model: torch.nn.Module, orig: dict, targets: dict, counts: dict) -> list:
    """Forward hooks on the plan's layers of `model` (a copy of the model whose modules
    are `orig`) adding Megatron's bytes at the full batch to counts["tp"]."""
    keep: list[torch.Tensor] = []  # inputs already counted, held so that their ids stay unique

    def count_input(x: Any) -> None:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and not any(x is k for k in keep):
            keep.append(x)
            counts["tp"] += x.numel() * x.element_size()

    def layer_hook(style: str) -> Any:
        def hook(mod: Any, args: Any, out: Any) -> None:
            if style == "rowwise":
                counts["tp"] += out.numel() * out.element_size()
            else:
                count_input(args[0])
        return hook

    def experts_hook(mod: Any, args: Any, out: Any) -> None:
        out = out[0] if isinstance(out, tuple) else out
        counts["tp"] += out.numel() * out.element_size()
        for a in args:
            count_input(a)

    by_module = {id(mod): style for style, mod in targets.values() if mod is not None}
    owners = {name.rsplit(".", 1)[0] for name, (_, mod) in targets.items() if mod is None}
    handles = []
    for name, mod in model.named_modules():
        style = by_module.get(id(orig.get(name)))
        if style is not None:
            handles.append(mod.register_forward_hook(layer_hook(style)))
        elif name in owners:
            handles.append(mod.register_forward_hook(experts_hook))
    return handles


def _hooked_forward(built: Any, targets: dict) -> tuple[int, int]:
    """One forward on one device: (SyncBatchNorm bytes, Megatron bytes at the full batch)."""
    model = copy.deepcopy(built.model)
    counts = {"bn": 0, "tp": 0}

    def bn_hook(mod: Any, args: Any, out: Any) -> None:
        if mod.training:
            counts["bn"] += 4 * mod.num_features * args[0].element_size()

    handles = _megatron_hooks(model, dict(built.model.named_modules()), targets, counts)
    handles += [mod.register_forward_hook(bn_hook) for mod in model.modules()
                if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm)]
    try:
        with torch.no_grad():
            built.loss(model, built.inputs)
    finally:
        for h in handles:
            h.remove()
    return counts["bn"], counts["tp"]


def expert_bytes(built: Any, sharding: str) -> Expert:
    """The expert's bytes for `built` (a zoo.Built) under `sharding` (model.SHARDINGS)."""
    from decompshard.check.model import SHARDINGS
    from decompshard.check.zoo import plan_targets

    sh = SHARDINGS[sharding]
    dp, tp = _sizes(sh)
    targets = plan_targets(built.model, built.plan) if sh.tp is not None and built.plan else {}
    bn, megatron = _hooked_forward(built, targets)
    total = 0
    if sh.dp is not None:
        total += _ddp(built.model, targets, tp) + bn
    if sh.tp is not None:
        batch = next(iter(built.inputs.values())).shape[0]
        share = math.ceil(batch / dp) / batch
        total += int(megatron * share)
    return Expert(total)
