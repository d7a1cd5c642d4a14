"""Custom ops (`torch.library.custom_op`) under enable(): derived from their own implementation.

A custom op whose implementation is plain torch code and which has no DTensor strategy
gets its rules from a trace of that implementation, like an aten op from its
decomposition; DTensor then runs the custom op's real kernel on local shards. One whose
implementation cannot be traced on meta tensors runs replicated, with a warning that
names the op and why. Simulated ranks (LocalTensorMode) on a fake process group of 4,
float64, every rank's full_tensor() compared with one device.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import decompshard
from decompshard.solve.derive import derive_rules
from decompshard.placements import format_rule
from decompshard.verify.dtensor_case import device_mesh, rank_locals

R, S0, S1 = Replicate(), Shard(0), Shard(1)
EPS = 1e-6


# ------------------------------------------------------------------ the custom ops


@torch.library.custom_op("decompshard_test::rmsnorm", mutates_args=(), device_types="cpu")
def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """A fused RMSNorm as users write one: plain torch inside a custom op."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@rmsnorm.register_fake
def _(x, w, eps):
    return torch.empty_like(x)


@torch.library.custom_op("decompshard_test::rmsnorm_ag", mutates_args=())
def rmsnorm_ag(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The same with a plain-torch backward (register_autograd)."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@rmsnorm_ag.register_fake
def _(x, w, eps):
    return torch.empty_like(x)


def _rmsnorm_setup(ctx, inputs, output):
    x, w, eps = inputs
    ctx.save_for_backward(x, w)
    ctx.eps = eps


def _rmsnorm_backward(ctx, g):
    x, w = ctx.saved_tensors
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + ctx.eps)
    gw = g * w
    gx = r * gw - x * r.pow(3) * (gw * x).mean(-1, keepdim=True)
    leading = tuple(range(x.dim() - 1))
    return gx, (g * x * r).sum(leading), None


rmsnorm_ag.register_autograd(_rmsnorm_backward, setup_context=_rmsnorm_setup)


@torch.library.custom_op("decompshard_test::numpy_scale", mutates_args=())
def numpy_scale(x: torch.Tensor) -> torch.Tensor:
    """Not traceable on meta tensors: goes through numpy."""
    return torch.from_numpy(x.numpy() * 2.0)


@numpy_scale.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("decompshard_test::item_normalize", mutates_args=())
def item_normalize(x: torch.Tensor) -> torch.Tensor:
    """Not traceable either: reads a value with .item() (a global max: sharding it is wrong)."""
    return x / x.abs().max().item()


@item_normalize.register_fake
def _(x):
    return torch.empty_like(x)


# ------------------------------------------------------------------ fixtures and helpers


pytestmark = pytest.mark.usefixtures("world")  # 4 simulated ranks, from conftest.py


@pytest.fixture(autouse=True)
def _disabled_after():
    yield
    decompshard.disable()


@pytest.fixture
def mesh4():
    return device_mesh((4,))


def _ranks(mesh):
    return LocalTensorMode(frozenset(range(mesh.size())))


def _assert_every_rank(dt, expected, mesh):
    full = dt.full_tensor()
    per_rank = rank_locals(full, mesh)
    assert len(per_rank) == mesh.size()
    for r, t in per_rank.items():
        torch.testing.assert_close(t, expected, msg=lambda m, r=r: f"rank {r}: {m}")


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------ derived rules


def test_rmsnorm_custom_op_derives_rules_from_its_implementation():
    x = torch.randn(8, 6, 16, dtype=torch.float64)
    w = torch.randn(16, dtype=torch.float64)
    d = derive_rules(torch.ops.decompshard_test.rmsnorm.default, x, w, EPS)
    assert d.unsupported_reason is None
    rules = {format_rule(r) for r in d.rules}
    assert "S(0), R -> S(0)" in rules  # the batch rule
    assert "S(1), R -> S(1)" in rules
    # the normalized dim is reduced over: no rule may shard it (x's dim 2, w's dim 0)
    assert not any("S(2)" in r for r in rules), rules
    assert not any(r.split(" -> ")[0].split(", ")[1] == "S(0)" for r in rules), rules


def test_untraceable_custom_op_is_unsupported_with_a_reason():
    x = torch.randn(4, 3, dtype=torch.float64)
    d = derive_rules(torch.ops.decompshard_test.numpy_scale.default, x)
    assert d.unsupported_reason is not None
    assert "decompshard_test.numpy_scale.default" in d.unsupported_reason
    assert "not traceable" in d.unsupported_reason and "numpy" in d.unsupported_reason
    d = derive_rules(torch.ops.decompshard_test.item_normalize.default, x)
    assert d.unsupported_reason is not None
    assert "decompshard_test.item_normalize.default" in d.unsupported_reason
    assert "data-dependent" in d.unsupported_reason


# ------------------------------------------------------------------ under enable()


@pytest.mark.parametrize(
    "shape, placement",
    [((8, 6, 16), S0), ((7, 6, 16), S0), ((3, 6, 16), S0), ((8, 6, 16), S1), ((8, 5, 16), S1)],
    ids=["S0-even", "S0-uneven", "S0-empty-shard", "S1-even", "S1-uneven"],
)
def test_rmsnorm_custom_op_runs_sharded_under_enable(mesh4, shape, placement):
    x = torch.randn(*shape, dtype=torch.float64, generator=_gen(0))
    w = torch.randn(shape[-1], dtype=torch.float64, generator=_gen(1))
    expected = rmsnorm(x, w, EPS)
    decompshard.enable()
    with _ranks(mesh4), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "running replicated" warning
        dx = distribute_tensor(x, mesh4, [placement])
        dw = distribute_tensor(w, mesh4, [R])
        with CommDebugMode() as comm:
            out = rmsnorm(dx, dw, EPS)
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        assert isinstance(out, DTensor) and tuple(out.placements) == (placement,)
        assert out.to_local().shape[-1] == shape[-1]
        _assert_every_rank(out, expected, mesh4)


def test_rmsnorm_custom_op_refused_without_enable(mesh4):
    """What the first test fixes: DTensor alone has no strategy for a custom op."""
    x = torch.randn(8, 16, dtype=torch.float64)
    w = torch.randn(16, dtype=torch.float64)
    with _ranks(mesh4):
        dx, dw = distribute_tensor(x, mesh4, [S0]), distribute_tensor(w, mesh4, [R])
        with pytest.raises(NotImplementedError, match="does not have a sharding strategy"):
            rmsnorm(dx, dw, EPS)


@pytest.mark.parametrize("fn, why", [(numpy_scale, "not traceable"), (item_normalize, "data-dependent")],
                         ids=["numpy", "item"])
def test_untraceable_custom_op_runs_replicated_with_a_warning(mesh4, fn, why):
    x = torch.randn(7, 5, dtype=torch.float64, generator=_gen(2))
    expected = fn(x)
    decompshard.enable()
    with _ranks(mesh4), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dx = distribute_tensor(x, mesh4, [S0])
        out = fn(dx)
        assert tuple(out.placements) == (R,)
        _assert_every_rank(out, expected, mesh4)
    name = str(fn._opoverload)
    messages = [str(w.message) for w in caught if name in str(w.message)]
    assert messages, [str(w.message) for w in caught]
    assert any(why in m and "running replicated" in m for m in messages), messages


# ------------------------------------------------------------------ backward


@pytest.mark.parametrize("shape, placement", [((7, 6, 16), S0), ((8, 5, 16), S1)], ids=["S0-uneven", "S1-uneven"])
def test_rmsnorm_custom_op_backward(mesh4, shape, placement):
    """register_autograd with a plain-torch backward: the backward's ops are ordinary
    DTensor ops; gradients match one device on every rank."""
    x = torch.randn(*shape, dtype=torch.float64, generator=_gen(3))
    w = torch.randn(shape[-1], dtype=torch.float64, generator=_gen(4))
    g = torch.randn(*shape, dtype=torch.float64, generator=_gen(5))
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    rmsnorm_ag(xr, wr, EPS).backward(g)
    # the registered backward is right (against autograd through the plain-torch formula)
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + EPS) * wc).backward(g)
    torch.testing.assert_close(xr.grad, xc.grad)
    torch.testing.assert_close(wr.grad, wc.grad)
    decompshard.enable()
    with _ranks(mesh4), warnings.catch_warnings():
        warnings.simplefilter("error")
        dx = distribute_tensor(x, mesh4, [placement]).requires_grad_()
        dw = distribute_tensor(w, mesh4, [R]).requires_grad_()
        dg = distribute_tensor(g, mesh4, [placement])
        out = rmsnorm_ag(dx, dw, EPS)
        assert tuple(out.placements) == (placement,)
        out.backward(dg)
        _assert_every_rank(out, rmsnorm_ag(x, w, EPS), mesh4)
        assert tuple(dx.grad.placements) == (placement,)
        _assert_every_rank(dx.grad, xr.grad, mesh4)
        _assert_every_rank(dw.grad, wr.grad, mesh4)
