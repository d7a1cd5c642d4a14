"""A derived strategy the real kernel rejects is refused before DTensor runs it.

CPU flash attention's backward derives `S(3), R, R, S(3), S(3), R, R -> P(sum), P(sum),
S(3)`: grad_out, v and out sharded on the head dim, q and k not. That is valid for the
decomposition (grad_v = P^T grad_out, and grad_q, grad_k are linear in the partial sums),
its meta kernel accepts the local shapes, and its real kernel raises "Q/K/V should have
the same head size". The issue met it in T5 under tensor parallelism. decompshard now
runs the real CPU kernel, on zeros, at the local shapes of a candidate for the ops whose
meta kernel checks less than the kernel (localcheck.REAL_KERNEL_SHAPE_CHECKED).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import decompshard
from decompshard.mesh import lift
from decompshard.solve import localcheck
from decompshard.verify.dtensor_case import device_mesh, per_rank_values

aten = torch.ops.aten
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
B, H, S, D = 2, 4, 8, 8
# grad_out, q, k, v, out, logsumexp, then the keyword mask
HEAD_DIM_OF_V = [(Shard(3),), (Replicate(),), (Replicate(),), (Shard(3),), (Shard(3),), (Replicate(),), (Replicate(),)]


def _backward_inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(B, H, S, D, dtype=torch.float64, generator=g) for _ in range(4))
    mask = torch.randn(1, H, S, S, dtype=torch.float64, generator=g)
    out, lse = FORWARD(q, k, v, 0.0, False, attn_mask=mask)
    return (grad_out, q, k, v, out, lse), mask


# T5 with fewer heads than TP ranks: the row-wise out projection's gradient, viewed back
# to [B, H, S, D], arrives sharded on D while q, k, v and out are replicated; slicing v
# and out is free, so the rejected rule was the cheapest
GRAD_ON_HEAD_DIM = [(Shard(3),)] + [(Replicate(),)] * 6


@pytest.mark.parametrize("placements", [HEAD_DIM_OF_V, GRAD_ON_HEAD_DIM], ids=["rule-in-place", "t5-few-heads"])
def test_backward_with_head_dim_sharded_v_matches_one_device(world, placements):
    """Called with placements that make the rejected rule the cheapest, the op used to
    raise "Q/K/V should have the same head size" on every rank; now DTensor runs a
    strategy the kernel accepts and every rank holds one device's grads."""
    tensors, mask = _backward_inputs()
    want = BACKWARD(*tensors, 0.0, False, attn_mask=mask)
    mesh = device_mesh((4,))
    with LocalTensorMode(4), decompshard.enabled():
        dts = [distribute_tensor(t, mesh, p) for t, p in zip(tensors, placements)]
        dmask = distribute_tensor(mask, mesh, [Replicate()])
        got = BACKWARD(*dts, 0.0, False, attn_mask=dmask)
        for g, w in zip(got, want):
            assert isinstance(g, DTensor)
            for rank, value in per_rank_values(g.full_tensor(), 4).items():
                assert torch.allclose(value, w, rtol=0, atol=1e-12), (rank, (value - w).abs().max())


def _meta(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, device="meta")


def _candidates():
    tensors, mask = _backward_inputs()
    args = (*[_meta(t) for t in tensors], 0.0, False)
    kwargs = {"attn_mask": _meta(mask)}
    return lift.ranked(BACKWARD, args, kwargs, (4,), HEAD_DIM_OF_V)


def _head_dim_candidate():
    return next(s for s in _candidates() if tuple(s.input_placements) == tuple(map(tuple, HEAD_DIM_OF_V)))


def test_the_rule_the_kernel_rejects_is_refused_with_the_kernels_reason():
    """The free candidate (inputs where they are) is the rejected rule, and it is
    refused with the kernel's own message; the meta kernel alone accepts its shapes."""
    first = next(iter(_candidates()))
    assert tuple(first.input_placements) == tuple(map(tuple, HEAD_DIM_OF_V))
    assert not first.valid and "same head size" in first.reason, first.reason
    local = [(B, H, S, D // 4), (B, H, S, D), (B, H, S, D), (B, H, S, D // 4), (B, H, S, D // 4), (B, H, S)]
    BACKWARD(*[torch.empty(s, dtype=torch.float64, device="meta") for s in local], 0.0, False,
             attn_mask=torch.empty(1, H, S, S, dtype=torch.float64, device="meta"))  # no error


def test_large_local_shapes_are_probed_at_small_sizes(monkeypatch):
    """Beyond REAL_KERNEL_PROBE_LIMIT elements the kernel runs on shapes with the same
    size equalities, which still refuse the rule."""
    localcheck.clear_empty_shard_runs()
    monkeypatch.setattr(localcheck, "REAL_KERNEL_PROBE_LIMIT", 16)
    probed = []
    real = localcheck.kernel_sandbox.output_shapes_on_zeros
    monkeypatch.setattr(localcheck.kernel_sandbox, "output_shapes_on_zeros",
                        lambda op, a, k: probed.append([tuple(x.shape) for x in (*a[:6], k["attn_mask"])]) or real(op, a, k))
    cand = _head_dim_candidate()
    assert not cand.valid and "same head size" in cand.reason, cand.reason
    assert probed and all(max(s) <= 4 for s in probed[0]), probed  # sizes 2, 4, 8 renumbered 2, 3, 4
    localcheck.clear_empty_shard_runs()


def test_ops_with_a_faithful_meta_kernel_are_not_run():
    x = torch.empty(4, 4, device="meta")
    assert localcheck.real_kernel_refusal(aten.mm.default, (x, x), {}) == ""


class _Collectives(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts collective ops as they run (CommDebugMode's module tracker fails on T5,
    whose shared embedding has two parents)."""

    NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d", "_dtensor")

    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in self.NAMESPACES and not func.name().endswith(("wait_tensor", "_wrap_tensor_autograd")):
            name = func.name()
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def _float64_t5_layer_norm(self, hidden_states):
    """T5LayerNorm with its variance in the input's dtype: transformers computes it in
    float32, which turns the all-reduce's float64 rounding into float32 differences from
    one device (1e-8 relative in every gradient) that say nothing about the sharding."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def test_t5_tensor_parallel_step_matches_one_device(world, monkeypatch):
    """A tiny T5ForConditionalGeneration (SDPA; self-attention's learned relative bias and
    cross-attention's zero bias reach attention as its keyword mask), Megatron TP on 4
    ranks (q, k, v, wi column-wise, o, wo row-wise, every other parameter replicated),
    one step: loss and every gradient equal one device's on every rank. (With 4 heads on
    4 ranks the rule the kernel rejects is not the cheapest; with fewer heads than ranks
    T5 stops earlier today, at "Cannot unflatten unevenly sharded tensor" after q's
    projection, and the `t5-few-heads` case above is the backward call it would reach.)"""
    pytest.importorskip("transformers")
    from decompshard.check.ecosystem import import_torchvision

    import_torchvision()  # transformers imports torchvision; PyPI's needs this on CPU torch
    from torch.distributed.tensor.experimental import implicit_replication
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.models.t5 import modeling_t5

    monkeypatch.setattr(modeling_t5.T5LayerNorm, "forward", _float64_t5_layer_norm)
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                   relative_attention_num_buckets=8, dropout_rate=0.0, feed_forward_proj="relu",
                   decoder_start_token_id=0, pad_token_id=0)
    cfg._attn_implementation = "sdpa"
    model = T5ForConditionalGeneration(cfg).double()
    g = torch.Generator().manual_seed(1)
    ids, dec, labels = (torch.randint(1, 64, shape, generator=g) for shape in ((2, 8), (2, 6), (2, 6)))

    def loss_of(ids, dec, labels):
        logits = model(input_ids=ids, decoder_input_ids=dec, use_cache=False).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    want_loss = loss_of(ids, dec, labels)
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    mesh = device_mesh((4,))
    with LocalTensorMode(4), decompshard.enabled():
        plan = {}
        for name, _ in model.named_modules():
            leaf = name.rpartition(".")[2]
            if leaf in ("q", "k", "v", "wi"):
                plan[name] = ColwiseParallel(use_local_output=False)
            elif leaf in ("o", "wo"):
                plan[name] = RowwiseParallel(use_local_output=False)
        parallelize_module(model, mesh, plan)
        replicated: dict[int, torch.nn.Parameter] = {}
        for name, p in list(model.named_parameters(remove_duplicate=False)):  # tied: one DTensor
            if isinstance(p, DTensor) and id(p) not in replicated:
                continue
            if id(p) not in replicated:
                replicated[id(p)] = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()]))
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, replicated[id(p)])
        args = [distribute_tensor(t, mesh, [Replicate()]) for t in (ids, dec, labels)]
        with _Collectives() as comm, implicit_replication():
            loss = loss_of(*args)
            loss.backward()
        for rank, value in per_rank_values(loss.full_tensor(), 4).items():
            assert torch.allclose(value, want_loss.detach(), rtol=0, atol=1e-12), (rank, value, want_loss)
        for name, p in model.named_parameters():
            for rank, value in per_rank_values(p.grad.full_tensor(), 4).items():
                assert torch.allclose(value, want[name], rtol=0, atol=1e-12), (name, rank, (value - want[name]).abs().max())
    # the 5 row-wise layers' all-reduces (encoder o, wo; decoder o, cross o, wo), nothing in
    # attention, on every release; before keyword masks were moved, 3 reduce-scatters
    # more. torch 2.14 and 2.15 added 2 reduce-scatters in the backward (a summed gradient
    # kept Partial through a row-parallel layer's backward, handed on at its input's width)
    # until enable() priced the Partial a strategy hands on (runtime/steering/kept_partial.py)
    assert comm.counts == {"_c10d_functional::all_reduce": 5}, comm.counts
