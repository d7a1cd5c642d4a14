"""Keyword tensor arguments are redistributed to the strategy decompshard chose.

SDPA's `attn_mask` is keyword-only in CPU flash attention's schema
(`_scaled_dot_product_flash_attention_for_cpu(q, k, v, ..., *, attn_mask)`). DTensor
moves positional tensors only, so decompshard used to keep the mask where it was and
moved q, k and v instead: on a data-parallel batch with a replicated per-example mask
(Mistral's sliding window) 3 all-to-alls forward and 3 backward, to head sharding; on a
2x2 DP x TP mesh with a replicated [B, H, S, S] bias (T5) 6 all-gathers each way. Slicing
a replicated mask costs nothing, and now that is what runs.

Float64, 4 simulated ranks, outputs and gradients against one device on every rank.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import decompshard
from decompshard._compat import sharding_propagator
from decompshard.dispatch_modes.comm_bytes import CommBytes
from decompshard.verify.dtensor_case import device_mesh, per_rank_values

B, H, S, D = 4, 4, 8, 4


def _attention(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _inputs(mask_shape):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, dtype=torch.float64, generator=g) for _ in range(3))
    mask = torch.randn(*mask_shape, dtype=torch.float64, generator=g)
    return q, k, v, mask


def _one_device(q, k, v, mask):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = _attention(*leaves, mask)
    (out * out).sum().backward()
    return out.detach(), [t.grad for t in leaves]


def _assert_every_rank(got: torch.Tensor, want: torch.Tensor) -> None:
    for rank, value in per_rank_values(got, 4).items():
        assert value.shape == want.shape, (rank, value.shape)
        assert torch.allclose(value, want, rtol=0, atol=1e-12), (rank, (value - want).abs().max())


def _run(mesh, qkv_placements, mask_placements, q, k, v, mask, steps=2):
    """Forward and backward `steps` times (the second through DTensor's caches); the
    collectives of the last step, and the DTensors."""
    dq, dk, dv = (distribute_tensor(t, mesh, qkv_placements).requires_grad_() for t in (q, k, v))
    dm = distribute_tensor(mask, mesh, mask_placements)
    for _ in range(steps):
        for t in (dq, dk, dv):
            t.grad = None
        with CommDebugMode() as fwd:
            out = _attention(dq, dk, dv, dm)
        with CommDebugMode() as bwd:
            (out * out).sum().backward()
    return out, (dq, dk, dv), fwd.get_total_counts(), bwd.get_total_counts()


@pytest.mark.parametrize("shape, qkv, mask_on", [
    ((4,), (Shard(0),), (Replicate(),)),                                # DP, Mistral-like mask
    ((2, 2), (Shard(0), Shard(1)), (Replicate(), Replicate())),         # DP x TP heads, T5-like bias
], ids=["dp4", "dp2xtp2"])
def test_replicated_keyword_mask_is_sliced_not_qkv_moved(world, shape, qkv, mask_on):
    mask_shape = (B, 1, S, S) if len(shape) == 1 else (B, H, S, S)
    q, k, v, mask = _inputs(mask_shape)
    want_out, want_grads = _one_device(q, k, v, mask)
    mesh = device_mesh(shape)
    with LocalTensorMode(4), decompshard.enabled():
        out, leaves, n_fwd, n_bwd = _run(mesh, qkv, mask_on, q, k, v, mask)
        assert tuple(out.placements) == qkv  # the output stays where q was
        _assert_every_rank(out.full_tensor(), want_out)
        for t, g in zip(leaves, want_grads):
            _assert_every_rank(t.grad.full_tensor(), g)
    # old code: 3 + 3 all-to-alls (dp4), 6 + 6 all-gathers (dp2xtp2)
    assert (n_fwd, n_bwd) == (0, 0)


def test_the_op_is_cpu_flash_attention_with_a_keyword_mask(world):
    """What these tests exercise is CPU flash attention and its backward (torch's own
    DTensor has no strategy for either), whose local kernels get each rank's slice of
    the keyword mask."""
    from torch.utils._debug_mode import DebugMode

    q, k, v, mask = _inputs((B, 1, S, S))
    with LocalTensorMode(4), decompshard.enabled(), DebugMode() as log:
        _run(device_mesh((4,)), (Shard(0),), (Replicate(),), q, k, v, mask, steps=1)
    calls = [line.strip() for line in log.debug_string().splitlines() if "flash_attention_for_cpu" in line]
    local = "t: f64[1, 4, 8, 4], t: f64[1, 4, 8, 4], t: f64[1, 4, 8, 4]"  # each rank's example
    sliced = "attn_mask=t: f64[1, 1, 8, 8]"  # each rank's row of the replicated mask
    assert any(c.startswith("aten::_scaled_dot_product_flash_attention_for_cpu(" + local) and sliced in c
               for c in calls), calls
    assert any(c.startswith("aten::_scaled_dot_product_flash_attention_for_cpu_backward(") and sliced in c
               for c in calls), calls


def test_mask_placement_is_part_of_the_cached_decision(world):
    """DTensor caches a decision per (op, specs); the keyword move recorded in it must be
    the one for this call's mask placement: R (sliced) then S(0) (already in place), then
    R again, each matching one device."""
    q, k, v, mask = _inputs((B, 1, S, S))
    want_out, want_grads = _one_device(q, k, v, mask)
    mesh = device_mesh((4,))
    with LocalTensorMode(4), decompshard.enabled():
        for mask_on in ((Replicate(),), (Shard(0),), (Replicate(),)):
            out, leaves, n_fwd, n_bwd = _run(mesh, (Shard(0),), mask_on, q, k, v, mask, steps=1)
            _assert_every_rank(out.full_tensor(), want_out)
            for t, g in zip(leaves, want_grads):
                _assert_every_rank(t.grad.full_tensor(), g)
            assert (n_fwd, n_bwd) == (0, 0), mask_on


def test_disable_restores_dtensor_dispatch(world):
    decompshard.disable()
    sp = sharding_propagator()
    before = sp.propagate_op_sharding
    decompshard.enable()
    assert sp.propagate_op_sharding is not before
    assert "redistribute_local_args" in vars(DTensor._op_dispatcher)
    decompshard.disable()
    assert sp.propagate_op_sharding is before
    assert "propagate_op_sharding_non_cached" not in vars(sp)
    assert "redistribute_local_args" not in vars(DTensor._op_dispatcher)


def _replicate_model(model: torch.nn.Module, mesh) -> None:
    """Every parameter and buffer a replicated DTensor (data parallel)."""
    for name, p in list(model.named_parameters()):
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
    for name, b in list(model.named_buffers()):
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner).register_buffer(leaf, distribute_tensor(b, mesh, [Replicate()]), persistent=False)


def test_mistral_data_parallel_step_runs_attention_without_collectives(world):
    """A tiny MistralForCausalLM (sliding window: the SDPA mask is a [B, 1, S, S] keyword
    tensor transformers builds as a plain tensor, replicated), an even batch on 4 ranks,
    parameters replicated: one forward and backward. Loss and every gradient equal one
    device's on every rank, and the step's only collectives are two, of a few scalars each:
    the loss's all-reduce (its sum and total weight together, the native guard's mean-loss
    handler) and the one that replicates the bool transformers' masking `.item()` reads,
    so every rank takes the same branch (torch 2.13: an all-reduce of a Partial(product)
    the guard replicates; from 2.14 `all` gathers the ranks' bools: one byte each); the old code moved q, k and v to head sharding and back (3 layers: 61 collectives, 21
    all-to-alls, 27 all-gathers, 12 reduce-scatters; this 1-layer one: 21, and its embedding
    gradient was off by 7.7e-9)."""
    pytest.importorskip("transformers")
    from decompshard.check.ecosystem import import_torchvision

    import_torchvision()  # transformers imports torchvision; PyPI's needs this on CPU torch
    from torch.distributed.tensor.experimental import implicit_replication
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, sliding_window=4)
    cfg._attn_implementation = "sdpa"
    model = MistralForCausalLM(cfg).double()
    ids = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(S).expand(B, S).contiguous()

    def loss_of(logits, labels):  # the model's own loss computes in float32
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

    want_loss = loss_of(model(input_ids=ids, position_ids=pos, use_cache=False).logits, ids)
    want_loss.backward()
    want_loss = want_loss.detach()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    mesh = device_mesh((4,))
    with LocalTensorMode(4), decompshard.enabled():
        _replicate_model(model, mesh)
        di, dp = (distribute_tensor(t, mesh, [Shard(0)]) for t in (ids, pos))
        with CommBytes() as comm, implicit_replication():
            loss = loss_of(model(input_ids=di, position_ids=dp, use_cache=False).logits, di)
            loss.backward()
        _assert_every_rank(loss.full_tensor(), want_loss)
        for name, p in model.named_parameters():
            _assert_every_rank(p.grad.full_tensor(), want[name])
    assert comm.count == 2, comm.bytes_by_kind
    assert comm.bytes_by_kind.get("all_reduce", 0) >= 2 * 8, comm.bytes_by_kind  # the loss: two float64s
    assert comm.bytes <= 2 * 8 + 8, comm.bytes_by_kind  # and one scalar


@pytest.mark.parametrize("out_on", [(Replicate(),), (Shard(1),)], ids=["R", "S1"])
def test_out_keyword_is_written_in_place_not_moved(world, out_on):
    """`out=` is a keyword tensor too, but the op must write into the caller's tensor: it
    keeps its placement (moving it, the kernel wrote into a redistributed copy and
    DTensor failed on its size). hardswish.out has no DTensor strategy and reaches
    decompshard."""
    x = torch.randn(8, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = F.hardswish(x)
    mesh = device_mesh((4,))
    with LocalTensorMode(4), decompshard.enabled():
        dx = distribute_tensor(x, mesh, [Shard(0)])
        out = distribute_tensor(torch.zeros(8, 6, dtype=torch.float64), mesh, out_on)
        got = torch.ops.aten.hardswish.out(dx, out=out)
        assert got is out and tuple(out.placements) == out_on
        _assert_every_rank(out.full_tensor(), want)


def test_replicated_fallback_replicates_keyword_tensors_too(world, monkeypatch):
    """When decompshard runs an op replicated (no derivable strategy, no decomposition,
    symbolic shapes, an internal error), keyword tensors are replicated too. They used to
    keep their placement: each rank's kernel got the whole q, k, v beside its one-example
    slice of a Shard(0) mask, broadcast it over the batch and returned a wrong result
    claiming Replicate (max error 1.8 here)."""
    import importlib

    derived = importlib.import_module("decompshard.runtime.derived")
    monkeypatch.setattr(derived, "_first_runnable", lambda *args, **kwargs: None)
    q, k, v, mask = _inputs((B, 1, S, S))
    want_out, want_grads = _one_device(q, k, v, mask)
    mesh = device_mesh((4,))
    decompshard.disable()  # enabling again clears DTensor's cached decisions
    with LocalTensorMode(4), decompshard.enabled():
        out, leaves, _, _ = _run(mesh, (Shard(0),), (Shard(0),), q, k, v, mask, steps=1)
        assert tuple(out.placements) == (Replicate(),)
        _assert_every_rank(out.full_tensor(), want_out)
        for t, g in zip(leaves, want_grads):
            _assert_every_rank(t.grad.full_tensor(), g)


def _gloo_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """One of 4 real processes (gloo): the DP attention with a replicated keyword mask;
    writes the largest error of this rank's full_tensor() values against one device's,
    and the collective counts of the last step."""
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    report: dict = {}
    try:
        q, k, v, mask = _inputs((B, 1, S, S))
        want_out, want_grads = _one_device(q, k, v, mask)
        with decompshard.enabled():
            out, leaves, n_fwd, n_bwd = _run(init_device_mesh("cpu", (world,)), (Shard(0),), (Replicate(),), q, k, v, mask)
        pairs = [(out, want_out)] + [(t.grad, g) for t, g in zip(leaves, want_grads)]
        report = {"err": max(float((got.full_tensor() - want).abs().max()) for got, want in pairs),
                  "counts": [n_fwd, n_bwd]}
    except Exception as e:  # reported, so the parent's assertion says what broke
        report["__error__"] = f"{type(e).__name__}: {e}"
    finally:
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()


def test_gloo_four_processes(tmp_path):
    """The keyword mask is moved by real collectives code too (here: sliced locally)."""
    import json
    import socket

    import _gloo_cases as G

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    G.spawn(_gloo_worker, (4, port, str(tmp_path)), 4)
    for rank in range(4):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "__error__" not in report, f"rank {rank}: {report.get('__error__')}"
        assert report["err"] < 1e-12 and report["counts"] == [0, 0], (rank, report)
