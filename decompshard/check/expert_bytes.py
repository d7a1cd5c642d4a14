"""The bytes an expert's hand-written plan moves in one training step of a zoo case,
computed without the propagator: the yardstick the zoo prints beside what `enable()`
moves (issue 28: every case within 1.25x of it, or a note why DTensor cannot express it).

Counted in the zoo's unit (`dispatch_modes/comm_bytes.py`: per collective, the bytes the
rank holding the most puts in, summed over the step; an all-reduce puts in the whole
tensor):

* data parallel (DDP): every gradient all-reduced once over the batch's mesh dim, at the
  size each rank holds (a tensor-parallel parameter's shard on a 2-D mesh); plus, per
  BatchNorm layer in training, SyncBatchNorm's statistics: 2 x C numbers forward and
  2 x C backward;
* tensor parallel (Megatron), following the plan's styles: one all-reduce of each
  `rowwise` layer's output in the forward, one of each column-parallel layer's
  (`colwise`, `packed_colwise`, `qkv_colwise`, `vocab_colwise`) input gradient in the
  backward, at the local batch's size. Layers that read one tensor share its all-reduce
  (Llama's q/k/v and gate/up, T5's cross-attention k/v; GPT-2's fused `c_attn` is one
  layer anyway): the gradients add up before the one all-reduce, as Megatron-LM's fused
  QKV and torchtitan's PrepareModuleInput on the block do. Parameters outside the plan
  are replicated with replicated inputs: no collective (lm_head, embeddings, routers).
  Measured, not assumed: torch alone running Megatron with local outputs and the
  blocks' inputs prepared once moves exactly this (tests/test_expert_bytes.py, Llama
  and ViT).
  Convs count as Linear layers (channel-parallel: a `colwise` conv shards its output
  channels, a `rowwise` conv its input channels); what runs per channel between them
  (BatchNorm, activations, depthwise convs sharded along) moves nothing. Not counted:
  a SqueezeExcite inside such a span (EfficientNet's InvertedResidual) reduces over all
  channels, one all-reduce of [batch, reduced channels] each way (2.5 KiB in all here);
  a `vocab_colwise` lm_head's loss-parallel statistics (a few [tokens] all-reduces:
  the max and the exp-sum of each row and its picked logit; `llama-vocab`).
* raw expert parameters (a plan entry without a module: Mixtral's batched-matmul
  experts, sharded on their hidden dim): each experts module is one Megatron MLP, its
  output all-reduced in the forward and each floating-point input's gradient in the
  backward (the tokens' hidden states, and the routing weights: a sum over the sharded
  hidden dim, [tokens, top_k]);
* 2-D: both, DDP on the dp dim at the TP shards' sizes and Megatron at the dp shard.

What `tp-local` (torch's ColwiseParallel on each projection, the plan transformers
writes) does that an expert would not: each layer turns the plain input into its own
DTensor, so q's, k's and v's input gradients are all-reduced one by one (Llama: 7
all-reduces, 112 KiB, against 4 and 64 KiB). The note says how much of that there is,
unless the case prepares the blocks' inputs itself (zoo.Built.megatron_inputs).

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
    note: str = ""  # what the case's plan moves beyond the count, and why


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
        if not (isinstance(x, torch.Tensor) and x.is_floating_point()):
            return
        if any(x is k for k in keep):  # shared: what ColwiseParallel per layer moves again
            counts["again"] += x.numel() * x.element_size()
            return
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


def _hooked_forward(built: Any, targets: dict) -> dict[str, int]:
    """One forward on one device: the SyncBatchNorm bytes ("bn"), Megatron's at the full
    batch ("tp") and the input gradients layers share ("again")."""
    model = copy.deepcopy(built.model)
    counts = {"bn": 0, "tp": 0, "again": 0}

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
    return counts


def expert_bytes(built: Any, sharding: str) -> Expert:
    """The expert's bytes for `built` (a zoo.Built) under `sharding` (model.SHARDINGS)."""
    from decompshard.check.model import SHARDINGS
    from decompshard.check.zoo import plan_targets

    sh = SHARDINGS[sharding]
    dp, tp = _sizes(sh)
    targets = plan_targets(built.model, built.plan) if sh.tp is not None and built.plan else {}
    counts = _hooked_forward(built, targets)
    total, note = 0, ""
    if sh.dp is not None:
        total += _ddp(built.model, targets, tp) + counts["bn"]
    if sh.tp is not None:
        batch = next(iter(built.inputs.values())).shape[0]
        share = math.ceil(batch / dp) / batch
        total += int(counts["tp"] * share)
        if sh.local_output and counts["again"] and not getattr(built, "megatron_inputs", None):
            note = (f"+{int(counts['again'] * share) / 1024:.0f} KiB: ColwiseParallel all-reduces a shared "
                    "input's gradient per layer")
    return Expert(total, note)
