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
from decompshard import lift, localcheck
from decompshard.verify_dtensor import device_mesh, per_rank_values, simulated_world

aten = torch.ops.aten
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
B, H, S, D = 2, 4, 8, 8
# grad_out, q, k, v, out, logsumexp, then the keyword mask
HEAD_DIM_OF_V = [(Shard(3),), (Replicate(),), (Replicate(),), (Shard(3),), (Shard(3),), (Replicate(),), (Replicate(),)]


@pytest.fixture(scope="module")
def world():
    with simulated_world(4):
        yield
    decompshard.disable()


def _backward_inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v, grad_out = (torch.randn(B, H, S, D, dtype=torch.float64, generator=g) for _ in range(4))
    mask = torch.randn(1, H, S, S, dtype=torch.float64, generator=g)
    out, lse = FORWARD(q, k, v, 0.0, False, attn_mask=mask)
    return (grad_out, q, k, v, out, lse), mask


def test_backward_with_head_dim_sharded_v_matches_one_device(world):
    """Called with the placements that make the rejected rule free (nothing to move),
    the op used to raise "Q/K/V should have the same head size" on every rank; now
    DTensor runs a strategy the kernel accepts and every rank holds one device's grads."""
    tensors, mask = _backward_inputs()
    want = BACKWARD(*tensors, 0.0, False, attn_mask=mask)
    mesh = device_mesh((4,))
    with LocalTensorMode(4), decompshard.enabled():
        dts = [distribute_tensor(t, mesh, p) for t, p in zip(tensors, HEAD_DIM_OF_V)]
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
    """Beyond the size a zero-filled run may allocate, the kernel runs on shapes with the
    same size equalities, which still refuse the rule."""
    localcheck.clear_empty_shard_runs()
    monkeypatch.setattr(localcheck, "EMPTY_SHARD_REAL_RUN_LIMIT", 16)
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
