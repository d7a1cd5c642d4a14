"""The model zoo: real models from the ecosystem, tiny configs, random weights.

Why: op-level proofs do not show that a user's model trains. These are models nobody
here wrote (transformers, torchvision, timm), built from tiny configs (nothing is
downloaded), seeded, each with the model's own loss and a tensor-parallel plan, so
`decompshard check --model NAME` and `bench/zoo.py` can run one training step of each
under every common sharding (see `model.run_training_step`).

A plan maps module or parameter names (fnmatch globs over `named_modules()` /
`named_parameters()` names) to a style:
- ``colwise``: the output features are sharded (Linear/Conv weight `Shard(0)`, bias
  `Shard(0)`; transformers' `Conv1D` stores the weight transposed: `Shard(1)`; a raw
  `[experts, out, in]` parameter: `Shard(-2)`);
- ``rowwise``: the input features are sharded (weight `Shard(1)` / `Conv1D` `Shard(0)` /
  raw `Shard(-1)`, bias replicated);
- ``packed_colwise`` / ``qkv_colwise``: a fused projection of 2 (gate, up) or 3 (q, k, v)
  parts, sharded as `_StridedShard(out_dim, split_factor=2|3)` so each part is sharded on
  its own (rank r holds heads r of q, of k and of v, as separate projections would).
transformers' own `base_model_tp_plan` (prefixed with the base model's name) is the plan
where the config has one; its other styles (`moe_tp_experts`) are ignored.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Built", "LOOP_ENTRY", "ZooEntry", "ZOO", "get_entry", "build", "resolve_model"]

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], torch.Tensor]


@dataclass
class Built:
    """One model ready for a step: float64, train mode, inputs keyed by forward argument
    (every tensor has the batch on dim 0), `loss(model, inputs)` returns the scalar loss."""

    model: nn.Module
    inputs: dict[str, torch.Tensor]
    loss: LossFn
    plan: dict[str, str] = field(default_factory=dict)
    # the lowest precision the model computes in whatever its parameters' dtype (T5's
    # layer norm takes its variance in float32): results are compared at that dtype's
    # tolerance, since a sharded reduction rounds differently there
    compute_dtype: torch.dtype = torch.float64
    # why the model cannot run Megatron's local-output TP (sharding tp-local) as built,
    # '' when it can: e.g. attention that views q/k/v with the global head count
    no_local_tp: str = ""
    # parallelize_module entries (module name or glob -> ParallelStyle) added under
    # Megatron's local outputs (tp-local): PrepareModuleInput on a block, so the layers
    # that read its input share one input-gradient all-reduce (torchtitan's plan) where
    # ColwiseParallel alone makes one per layer. Empty: the plan's Linear styles alone
    megatron_inputs: dict[str, Any] = field(default_factory=dict)
    # the parameters' and inputs' floating dtype: float64 but where a kernel refuses it
    # (torch's CPU grouped_mm takes float32, bfloat16 and float16 only)
    dtype: torch.dtype = torch.float64


@dataclass(frozen=True)
class ZooEntry:
    name: str
    family: str  # transformers | torchvision | timm | user
    builder: Callable[[int, int], Built]  # (batch, seed) -> Built
    note: str = ""


SEQ = 8
VOCAB = 64


def build(entry: ZooEntry, batch: int, seed: int = 0) -> Built:
    """The entry's model and inputs for `batch` rows, seeded, float64 (`Built.dtype`),
    train mode."""
    torch.manual_seed(seed)
    built = entry.builder(batch, seed)
    built.model.to(built.dtype).train()
    built.inputs = {k: v.to(built.dtype) if v.dtype.is_floating_point else v for k, v in built.inputs.items()}
    return built


# ------------------------------------------------------------------ transformers


def _transformers() -> Any:
    """`import transformers` (ecosystem.import_transformers: torchvision first when it is
    installed, which loads PyPI's CUDA-built wheel on CPU torch)."""
    from decompshard.check import ecosystem

    return ecosystem.import_transformers()


def _hf_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(**inputs).loss


def _hf_plan(model: nn.Module, extra: dict[str, str] | None = None) -> dict[str, str]:
    """transformers' own `base_model_tp_plan` (names relative to the base model)."""
    base = getattr(model.config, "base_model_tp_plan", None) or {}
    prefix = getattr(model, "base_model_prefix", "")
    plan = {(f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k): v for k, v in base.items()}
    plan.update(extra or {})
    return plan


def _tokens(batch: int, seed: int, vocab: int = VOCAB, low: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randint(low, vocab, (batch, SEQ), generator=g)


def _causal_lm(config_cls: str, **kw: Any) -> Callable[[int, int], Built]:
    def builder(batch: int, seed: int) -> Built:
        T = _transformers()

        sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                     tie_word_embeddings=False, attention_dropout=0.0, use_cache=False)
        config = getattr(T, config_cls)(**{**sizes, **kw})
        model = T.AutoModelForCausalLM.from_config(config)
        ids = _tokens(batch, seed)
        # Llama-family models build position ids from a cache position (a plain tensor):
        # passing them keeps every tensor a DTensor
        pos = torch.arange(SEQ).expand(batch, SEQ).contiguous()
        # transformers' own plan: the lm_head replicated. At the zoo's vocabulary (64) a
        # vocab-parallel lm_head (torchtitan's plan, style `vocab_colwise`) moves more
        # than it saves (Llama tp: 81.5 KiB against 64.5 KiB); the `llama-vocab` case runs it
        # to show the loss computed without gathering the logits
        return Built(model, {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}, _hf_loss,
                     _hf_plan(model))
    return builder


def _vocab_parallel(builder: Callable[[int, int], Built]) -> Callable[[int, int], Built]:
    """The model with its lm_head column-parallel on the vocabulary, the logits left
    `Shard(-1)` into the model's own `labels=` loss (torchtitan's plan): the loss runs
    vocab-parallel (runtime/plans/vocab_loss.py) without gathering the logits."""
    def vocab_builder(batch: int, seed: int) -> Built:
        built = builder(batch, seed)
        built.plan["lm_head"] = "vocab_colwise"
        return built
    return vocab_builder


def _float32(builder: Callable[[int, int], Built]) -> Callable[[int, int], Built]:
    """The model in float32, compared at float32's tolerance (a kernel that refuses
    float64: torch's CPU grouped_mm)."""
    def float32_builder(batch: int, seed: int) -> Built:
        built = builder(batch, seed)
        built.dtype = built.compute_dtype = torch.bfloat16
        return built
    return float32_builder


def _gpt2(batch: int, seed: int) -> Built:
    T = _transformers()

    config = T.GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=1, n_head=4,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    model = T.GPT2LMHeadModel(config)
    ids = _tokens(batch, seed)
    pos = torch.arange(SEQ).expand(batch, SEQ).contiguous()
    plan = {"transformer.h.*.attn.c_attn": "qkv_colwise", "transformer.h.*.attn.c_proj": "rowwise",
            "transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}
    return Built(model, {"input_ids": ids, "position_ids": pos, "labels": ids.clone()}, _hf_loss, plan)


def _bert_mlm(batch: int, seed: int) -> Built:
    """Masked LM: labels are -100 (ignored) on every token that is not masked, so ranks
    hold different numbers of counted targets (the loss is a mean over the masked ones)."""
    T = _transformers()

    config = T.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                          attention_probs_dropout_prob=0.0)
    model = T.BertForMaskedLM(config)
    ids = _tokens(batch, seed, low=5)
    g = torch.Generator().manual_seed(seed + 2)
    masked = torch.rand(ids.shape, generator=g) < 0.25
    masked[0, 0] = True  # at least one counted target
    labels = torch.where(masked, ids, torch.full_like(ids, -100))
    ids = torch.where(masked, torch.full_like(ids, 4), ids)  # 4 plays [MASK]
    pos = torch.arange(SEQ).expand(batch, SEQ).contiguous()
    layer = "bert.encoder.layer.*"
    plan = {f"{layer}.attention.self.query": "colwise", f"{layer}.attention.self.key": "colwise",
            f"{layer}.attention.self.value": "colwise", f"{layer}.attention.output.dense": "rowwise",
            f"{layer}.intermediate.dense": "colwise", f"{layer}.output.dense": "rowwise"}
    inputs = {"input_ids": ids, "position_ids": pos, "token_type_ids": torch.zeros_like(ids), "labels": labels}
    return Built(model, inputs, _hf_loss, plan)


def _t5(batch: int, seed: int) -> Built:
    T = _transformers()

    config = T.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
                        num_heads=4, dropout_rate=0.0, relative_attention_num_buckets=8,
                        decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=False,
                        use_cache=False)
    model = T.T5ForConditionalGeneration(config)
    ids = _tokens(batch, seed, low=1)
    labels = _tokens(batch, seed + 7, low=1)
    plan = {}
    for attn in ("SelfAttention", "EncDecAttention"):
        for p in "qkv":
            plan[f"*.block.*.layer.*.{attn}.{p}"] = "colwise"
        plan[f"*.block.*.layer.*.{attn}.o"] = "rowwise"
    plan["*.block.*.layer.*.DenseReluDense.wi"] = "colwise"
    plan["*.block.*.layer.*.DenseReluDense.wo"] = "rowwise"
    # T5LayerNorm computes the variance in float32 (checked: with it in float64 the 2d
    # step matches one device to 1e-14; as shipped, to ~5e-8)
    # tp-local: T5Attention views q/k/v as (batch, -1, n_heads, d_kv) with the global
    # n_heads, so a local [.., 8] projection becomes a wrong sequence length; running it
    # needs n_heads, inner_dim and the relative-bias embedding made per rank
    return Built(model, {"input_ids": ids, "labels": labels}, _hf_loss, plan, compute_dtype=torch.float32,
                 no_local_tp="T5Attention views q/k/v with the global n_heads (local heads need n_heads, "
                             "inner_dim and the relative bias made per rank)")


def _hf_vit(batch: int, seed: int) -> Built:
    T = _transformers()

    config = T.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
                         num_attention_heads=4, intermediate_size=64, num_labels=10, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0)
    model = T.ViTForImageClassification(config)
    x, y = _images(batch, seed, 16)
    layer = "vit.layers.*"  # transformers 5's names (4.x: vit.encoder.layer.*.attention.attention.query, ...)
    plan = {f"{layer}.attention.q_proj": "colwise", f"{layer}.attention.k_proj": "colwise",
            f"{layer}.attention.v_proj": "colwise", f"{layer}.attention.o_proj": "rowwise",
            f"{layer}.mlp.fc1": "colwise", f"{layer}.mlp.fc2": "rowwise"}
    return Built(model, {"pixel_values": x, "labels": y}, _hf_loss, plan)


# ------------------------------------------------------------------ vision


def _images(batch: int, seed: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return torch.randn(batch, 3, size, size, generator=g), torch.randint(0, 10, (batch,), generator=g)


def _classifier_loss(model: nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(model(inputs["x"]), inputs["target"])


def _resnet(batch: int, seed: int) -> Built:
    from decompshard.check.ecosystem import import_torchvision

    tv = import_torchvision()
    from torchvision.models.resnet import BasicBlock, ResNet

    del tv
    model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)  # resnet18's block, one per stage
    x, y = _images(batch, seed, 16)
    plan = {"layer*.*.conv1": "colwise", "layer*.*.conv2": "rowwise"}
    return Built(model, {"x": x, "target": y}, _classifier_loss, plan)


def _timm(name: str, plan: dict[str, str], size: int, **kw: Any) -> Callable[[int, int], Built]:
    def builder(batch: int, seed: int) -> Built:
        from decompshard.check.ecosystem import import_timm

        model = import_timm().create_model(name, num_classes=10, drop_rate=0.0, **kw)
        x, y = _images(batch, seed, size)
        return Built(model, {"x": x, "target": y}, _classifier_loss, plan)
    return builder


_EFFNET_PLAN = {"blocks.*.conv_exp": "colwise", "blocks.*.conv_pw": "colwise", "blocks.*.conv_pwl": "rowwise"}
_CONVNEXT_PLAN = {"stages.*.mlp.fc1": "colwise", "stages.*.mlp.fc2": "rowwise"}
_VIT_PLAN = {"blocks.*.attn.qkv": "qkv_colwise", "blocks.*.attn.proj": "rowwise",
             "blocks.*.mlp.fc1": "colwise", "blocks.*.mlp.fc2": "rowwise"}

ZOO: dict[str, ZooEntry] = {e.name: e for e in [
    ZooEntry("llama", "transformers", _causal_lm("LlamaConfig"), "LlamaForCausalLM"),
    ZooEntry("llama-vocab", "transformers", _vocab_parallel(_causal_lm("LlamaConfig")),
             "LlamaForCausalLM, lm_head vocab-parallel (Shard(-1) logits into its labels= loss)"),
    ZooEntry("qwen2", "transformers", _causal_lm("Qwen2Config"), "Qwen2ForCausalLM"),
    ZooEntry("mistral", "transformers", _causal_lm("MistralConfig", sliding_window=4),
             "MistralForCausalLM, sliding window 4 < seq 8 (attention gets a mask)"),
    ZooEntry("mixtral", "transformers", _causal_lm("MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
                                                   router_jitter_noise=0.0, experts_implementation="eager"),
             "MixtralForCausalLM, 4 experts, top-2 routing"),
    ZooEntry("mixtral-bmm", "transformers", _causal_lm("MixtralConfig", num_local_experts=4, num_experts_per_tok=2,
                                                       router_jitter_noise=0.0, experts_implementation="batched_mm"),
             "MixtralForCausalLM, 4 experts, top-2 routing, batched_mm experts (expert weights gathered per token)"),
    ZooEntry("mixtral-gmm", "transformers", _float32(_causal_lm("MixtralConfig", num_local_experts=4,
                                                                 num_experts_per_tok=2, router_jitter_noise=0.0,
                                                                 experts_implementation="grouped_mm")),
             "MixtralForCausalLM, 4 experts, top-2 routing, grouped_mm experts (float32: the CPU kernel's dtypes)"),
    ZooEntry("gpt2", "transformers", _gpt2, "GPT2LMHeadModel (Conv1D, fused c_attn)"),
    ZooEntry("bert-mlm", "transformers", _bert_mlm, "BertForMaskedLM, labels -100 on unmasked tokens"),
    ZooEntry("t5", "transformers", _t5, "T5ForConditionalGeneration (relative position bias)"),
    ZooEntry("vit-hf", "transformers", _hf_vit, "ViTForImageClassification"),
    ZooEntry("resnet", "torchvision", _resnet, "torchvision ResNet, BasicBlock x [1,1,1,1] (BatchNorm)"),
    ZooEntry("efficientnet", "timm", _timm("test_efficientnet", _EFFNET_PLAN, 32), "timm test_efficientnet"),
    ZooEntry("convnext", "timm", _timm("test_convnext", _CONVNEXT_PLAN, 32), "timm test_convnext"),
    ZooEntry("vit-timm", "timm", _timm("test_vit", _VIT_PLAN, 32, img_size=32, patch_size=8, depth=1,
                                        num_heads=4), "timm test_vit (fused qkv), depth 1"),
]}


# The training-loop zoo's model (check/loop.py): the zoo's Llama with two decoder layers, so
# FSDP2 shards more than one layer (`fully_shard` per layer, then the root)
LOOP_ENTRY = ZooEntry("llama-2layers", "transformers", _causal_lm("LlamaConfig", num_hidden_layers=2),
                      "LlamaForCausalLM, 2 decoder layers")


def get_entry(name: str) -> ZooEntry:
    """A zoo name, a MODULE:CALLABLE whose callable takes (batch, seed) and returns a
    `Built`, or what `resolve_model` makes of a transformers class name."""
    if name in ZOO:
        return ZOO[name]
    if ":" in name:
        from decompshard.coverage.model_audit import load_callable

        return ZooEntry(name, "user", _UserBuilder(load_callable(name), name))
    return resolve_model(name)


@dataclass(frozen=True)
class _UserBuilder:
    fn: Callable[..., Any]
    spec: str

    def __call__(self, batch: int, seed: int) -> Built:
        built = self.fn(batch, seed)
        if not isinstance(built, Built):
            raise ValueError(f"{self.spec}(batch, seed) returned a {type(built).__name__}; with --sharding the "
                             "callable returns decompshard.check.zoo.Built(model, inputs, loss, plan)")
        return built


def resolve_model(name: str) -> ZooEntry:
    """A zoo entry for a transformers config or model class name (`LlamaConfig`,
    `Qwen2ForCausalLM`): a causal LM from the config with the zoo's tiny sizes.
    Raises ValueError for a name that is neither a zoo name nor such a class."""
    for entry in ZOO.values():  # a class the zoo already has: its entry
        if entry.note.split(",")[0].split(" ")[0] in (name, name.replace("Config", "ForCausalLM")):
            return entry
    if not (name.endswith("Config") or name.endswith("ForCausalLM")):
        T = None
    else:  # a transformers class name: transformers must be there to say
        from decompshard.check.ecosystem import import_library

        T = import_library("transformers", f"model {name!r}")
    if T is not None and hasattr(T, name.replace("ForCausalLM", "Config")):
        config = name.replace("ForCausalLM", "Config")
        return ZooEntry(name, "transformers", _causal_lm(config), f"{name} (tiny config, causal LM)")
    raise ValueError(f"unknown model {name!r}: expected one of {', '.join(ZOO)}, a transformers "
                     "config/causal-LM class name (e.g. LlamaConfig) or MODULE:CALLABLE")


# ------------------------------------------------------------------ plans


def plan_targets(model: nn.Module, plan: dict[str, str]) -> dict[str, tuple[str, nn.Module | None]]:
    """Parameter name -> (style, owning module or None for a raw parameter) for every
    parameter the plan shards. A parameter matched by a module pattern gets the module's
    style; a pattern matching a parameter name directly (Mixtral's packed experts) gets its own.
    Raises ValueError for a pattern that matches nothing: a stale plan (a library renamed
    its modules) would otherwise run "tensor parallel" fully replicated and pass."""
    out: dict[str, tuple[str, nn.Module | None]] = {}
    modules = dict(model.named_modules())
    dead = []
    for pattern, style in plan.items():
        if style not in STYLES:
            continue
        found = len(out)
        for mname, mod in modules.items():
            if mname and fnmatch.fnmatchcase(mname, pattern):
                for pname, _ in mod.named_parameters(recurse=False):
                    out[f"{mname}.{pname}"] = (style, mod)
        for pname, _ in model.named_parameters():
            if fnmatch.fnmatchcase(pname, pattern) and pname not in out:
                out[pname] = (style, None)
        if len(out) == found:
            dead.append(pattern)
    if dead:
        raise ValueError(f"the TP plan's patterns {dead} match no parameter of {type(model).__name__}")
    return out


# vocab_colwise: colwise whose output stays sharded into the loss (an lm_head); with
# Megatron's local outputs (tp-local) its output is gathered, as Megatron users write it
STYLES = ("colwise", "rowwise", "packed_colwise", "qkv_colwise", "vocab_colwise")


def tp_placement(style: str, param_name: str, param: torch.Tensor, module: nn.Module | None) -> Any:
    """The placement on the TP mesh dim of one parameter under `style` (see the module doc)."""
    from decompshard._compat import TorchReplicate, TorchShard, TorchStridedShard

    leaf = param_name.rsplit(".", 1)[-1]
    transposed = type(module).__name__ == "Conv1D"  # transformers' GPT-2 layer: weight [in, out]
    if module is None:  # a raw [.., out, in] parameter
        out_dim, in_dim = param.ndim - 2, param.ndim - 1
    elif leaf == "bias":
        out_dim, in_dim = 0, None
    else:
        out_dim, in_dim = (1, 0) if transposed else (0, 1)
    if style == "rowwise":
        return TorchReplicate() if in_dim is None else TorchShard(in_dim)
    if style in ("colwise", "vocab_colwise"):
        return TorchShard(out_dim)
    parts = 2 if style == "packed_colwise" else 3
    return TorchStridedShard(out_dim, split_factor=parts)
