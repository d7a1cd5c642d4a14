"""Uneven shards through DTensor's view strategies (decompshard/runtime/support/uneven_views.py).

Without decompshard, `F.linear` on a [10, 8, 16] activation sharded S(0) over 4 ranks
raises "Cannot flatten unevenly sharded tensor"; under `enable()` the input is
redistributed and every rank gets one device's numbers, forward and backward. Each case
is also run with decompshard off, where it must fail (so the tests can fail).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import decompshard
from decompshard._compat import sharding_propagator, view_family_ops
from decompshard.verify.dtensor_case import device_mesh, rank_locals

DT = torch.float64


pytestmark = pytest.mark.usefixtures("world")  # 4 simulated ranks, from conftest.py


def _linear_step(shape, mesh_shape, placements):
    """Worst error of y, dx, dw over every rank, y = linear(x, w), loss = sum(y**2)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, dtype=DT, generator=g, requires_grad=True)
    w = torch.randn(12, shape[-1], dtype=DT, generator=g, requires_grad=True)
    y = F.linear(x, w)
    y.pow(2).sum().backward()
    mesh = device_mesh(mesh_shape)
    with LocalTensorMode(4), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dx = distribute_tensor(x.detach(), mesh, placements).requires_grad_()
        dw = distribute_tensor(w.detach(), mesh, [Replicate()] * mesh.ndim).requires_grad_()
        dy = F.linear(dx, dw)
        dy.pow(2).sum().backward()
        pairs = [(dy, y), (dx.grad, x.grad), (dw.grad, w.grad)]
        return max((v - want.detach()).abs().max().item()
                   for got, want in pairs for v in rank_locals(got.full_tensor(), mesh).values())


CASES = [
    ((10, 8, 16), (4,), [Shard(0)]),                      # 10 rows on 4 ranks
    ((5, 8, 16), (2, 2), [Shard(0), Replicate()]),        # 5 rows on the DP dim of 2x2
    ((5, 8, 16), (2, 2), [Shard(0), Shard(2)]),           # DP x a contraction-dim shard
    ((6, 3, 16), (2, 2), [Shard(0), Shard(0)]),           # both mesh dims on the batch
]


@pytest.mark.parametrize("shape,mesh_shape,placements", CASES, ids=lambda v: str(v))
def test_linear_on_uneven_batch_matches_one_device(shape, mesh_shape, placements):
    decompshard.enable()
    assert _linear_step(shape, mesh_shape, placements) < 1e-10
    decompshard.disable()
    with pytest.raises(RuntimeError):
        _linear_step(shape, mesh_shape, placements)


def _view(shape, mesh_shape, placements, new_shape):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, dtype=DT, generator=g)
    mesh = device_mesh(mesh_shape)
    with LocalTensorMode(4), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = distribute_tensor(x, mesh, placements).view(*new_shape)
        return max((v - x.view(*new_shape)).abs().max().item()
                   for v in rank_locals(y.full_tensor(), mesh).values())


def test_a_forced_move_is_priced_there_and_back():
    """A residual block on ViT's tokens, [10, 17, 32] with 10 images on 4 ranks:
    `F.linear`'s flatten cannot stay local. By DTensor's cost model an all-to-all to
    tokens and the one back cost more than an all-gather whose way back is a local
    slice, so the activation is gathered, never token-sharded (before the way back was
    priced, every collective of this step was an all-to-all), and the step matches one
    device."""
    from decompshard.dispatch_modes.comm_bytes import CommBytes

    g = torch.Generator().manual_seed(2)
    x = torch.randn(10, 17, 32, dtype=DT, generator=g, requires_grad=True)
    w = torch.randn(32, 32, dtype=DT, generator=g, requires_grad=True)
    y = F.layer_norm(x + F.linear(x, w), (32,))
    y.pow(2).sum().backward()
    mesh = device_mesh((4,))
    decompshard.enable()
    try:
        with LocalTensorMode(4), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dx = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
            dw = distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_()
            with CommBytes() as comm:
                dy = F.layer_norm(dx + F.linear(dx, dw), (32,))
                dy.pow(2).sum().backward()
            worst = max((v - want.detach()).abs().max().item()
                        for got, want in [(dy, y), (dx.grad, x.grad), (dw.grad, w.grad)]
                        for v in rank_locals(got.full_tensor(), mesh).values())
    finally:
        decompshard.disable()
    assert {c.collective for c in comm.listing} == {"all_gather_into_tensor"}, comm.listing
    assert worst < 1e-10


def test_native_answer_whose_local_shapes_do_not_fit_is_replaced():
    # DTensor accepts [6, 8, 16] on (S(0), S(0)) -> [48, 16] as (S(0), S(0)): local rows
    # 12 each where the local views give 16 and 8 (the local view then fails)
    decompshard.enable()
    assert _view((6, 8, 16), (2, 2), [Shard(0), Shard(0)], (48, 16)) == 0
    decompshard.disable()
    with pytest.raises(RuntimeError):
        _view((6, 8, 16), (2, 2), [Shard(0), Shard(0)], (48, 16))


def test_unflatten_of_fused_heads_under_tp():
    # timm ViT under TP: qkv [B, N, 3*H*d] sharded on the fused dim, reshaped to
    # [B, N, 3, H, d]: 3 does not split over 4 ranks ("Cannot unflatten ...")
    decompshard.enable()
    assert _view((2, 5, 48), (4,), [Shard(2)], (2, 5, 3, 4, 4)) == 0
    decompshard.disable()
    with pytest.raises(RuntimeError, match="unflatten"):
        _view((2, 5, 48), (4,), [Shard(2)], (2, 5, 3, 4, 4))


def test_even_views_keep_dtensor_answer_and_disable_restores_the_table():
    table = sharding_propagator().op_strategy_funcs
    before = {op: table[op] for op in view_family_ops()}
    decompshard.enable()
    assert all((table[op] is before[op]) == op._schema.is_mutable for op in before)  # squeeze_ untouched
    mesh = device_mesh((4,))
    with LocalTensorMode(4):
        y = distribute_tensor(torch.randn(8, 3, 16, dtype=DT), mesh, [Shard(0)]).view(24, 16)
    assert y.placements == (Shard(0),)  # even: DTensor's own answer, no redistribution
    with LocalTensorMode(4):
        x = torch.randn(10, 8, 16, dtype=DT)
        z = distribute_tensor(x, mesh, [Shard(0)]).view(10, 128)  # uneven, but the sharded dim is kept
        assert z.placements == (Shard(0),)
        assert all(torch.equal(v, x.view(10, 128)) for v in rank_locals(z.full_tensor(), mesh).values())
    decompshard.disable()
    assert all(table[op] is before[op] for op in before)


@pytest.mark.parametrize("mesh_shape,tol", [((4,), 1e-12), ((2, 2), 1e-5)], ids=["4", "2x2"])
def test_llama_uneven_dp_step_matches_one_device(mesh_shape, tol):
    # 5 rows: 2, 1, 1, 1 on 4 ranks; 3, 2 on the DP dim of 2x2. Llama computes RMSNorm,
    # rotary and its loss in float32 even in a float64 model: on 2x2 DTensor shards
    # some of those reductions on mesh dim 1, so they are summed in another order
    # (float32 rounding, ~1e-7 relative); on 4 ranks the numbers are exact.
    from _dp_step import dp_step, import_transformers

    transformers = import_transformers()
    LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                      use_cache=False)
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 64, (5, 6))
    batch = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(6).expand(5, 6).contiguous()}
    decompshard.enable()
    try:
        res = dp_step(model, batch, lambda out: out.loss, mesh_shape)
    finally:
        decompshard.disable()
    assert not res["missing"]
    assert max(res["errors"].values()) < tol, res["errors"]


def test_timm_vit_tp_step_matches_one_device():
    # qkv ColwiseParallel: [B, N, 3*C] sharded on the fused dim, reshaped to
    # [B, N, 3, H, d]: "Cannot unflatten unevenly sharded tensor" without decompshard
    import copy

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from decompshard.check.ecosystem import import_timm

    import_timm()
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    model = VisionTransformer(img_size=8, patch_size=4, in_chans=3, num_classes=5, embed_dim=16, depth=1,
                              num_heads=4, mlp_ratio=2).to(DT)
    x = torch.randn(2, 3, 8, 8, dtype=DT)
    ref = copy.deepcopy(model)
    loss = ref(x).pow(2).mean()
    loss.backward()
    mesh = device_mesh((4,))
    plan = {"blocks.0.attn.qkv": ColwiseParallel(use_local_output=False),
            "blocks.0.attn.proj": RowwiseParallel(use_local_output=False),
            "blocks.0.mlp.fc1": ColwiseParallel(use_local_output=False),
            "blocks.0.mlp.fc2": RowwiseParallel(use_local_output=False)}

    def step():
        with LocalTensorMode(4), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dmodel = parallelize_module(copy.deepcopy(model), mesh, plan)
            for mod in dmodel.modules():
                for name, p in list(mod.named_parameters(recurse=False)):
                    if not isinstance(p, DTensor):
                        rep = distribute_tensor(p.detach(), mesh, [Replicate()])
                        mod.register_parameter(name, torch.nn.Parameter(rep))
            dloss = dmodel(distribute_tensor(x, mesh, [Replicate()])).pow(2).mean()
            dloss.backward()
            pairs = [(dloss, loss.detach())] + [(p.grad, q.grad) for p, q in zip(dmodel.parameters(), ref.parameters())]
            return max((v - want).abs().max().item() for got, want in pairs
                       for v in rank_locals(got.full_tensor(), mesh).values())

    decompshard.enable()
    assert step() < 1e-12
    decompshard.disable()
    with pytest.raises(RuntimeError, match="unflatten"):
        step()


def test_in_place_squeeze_of_an_uneven_shard_is_still_refused():
    # redistributing squeeze_'s self would squeeze a copy and relabel self (claimed R
    # [8] over local [1, 8] and [0, 8] shards): DTensor's refusal stays
    decompshard.enable()
    try:
        with LocalTensorMode(4):
            d = distribute_tensor(torch.randn(1, 8, dtype=DT), device_mesh((4,)), [Shard(0)])
            with pytest.raises(RuntimeError, match="redistribut"):
                d.squeeze_(0)
            assert d.placements == (Shard(0),) and d.shape == (1, 8)
    finally:
        decompshard.disable()
