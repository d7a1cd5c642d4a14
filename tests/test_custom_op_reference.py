"""Opaque custom ops with a registered plain-torch reference (decompshard.register_reference).

An RMSNorm custom op whose kernel goes through numpy cannot be traced on meta tensors.
With a reference registered, its rules derive from the reference while DTensor still runs
the numpy kernel on local shards; a wrong reference is refused (the real kernel and the
reference are compared on one device first); without one it runs replicated with a
warning naming register_reference. Simulated ranks (LocalTensorMode) on a fake process
group of 4, float64, every rank's full_tensor() compared with one device.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import decompshard
from decompshard.verify.dtensor_case import device_mesh, rank_locals

R, S0 = Replicate(), Shard(0)
EPS = 1e-6


@torch.library.custom_op("decompshard_ref_test::np_rmsnorm", mutates_args=(), device_types="cpu")
def np_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """An opaque fused RMSNorm: the kernel is numpy (stands for C++/Triton)."""
    xn, wn = x.numpy(), w.numpy()
    r = 1.0 / np.sqrt((xn * xn).mean(axis=-1, keepdims=True) + eps)
    return torch.from_numpy(np.ascontiguousarray(xn * r * wn))


@np_rmsnorm.register_fake
def _(x, w, eps):
    return torch.empty_like(x)


OP = torch.ops.decompshard_ref_test.np_rmsnorm.default


def rmsnorm_reference(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_without_weight(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def reference_without_eps(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) * w


# ------------------------------------------------------------------ fixtures and helpers


pytestmark = pytest.mark.usefixtures("world")  # 4 simulated ranks, from conftest.py


@pytest.fixture(autouse=True)
def _clean_after():
    yield
    decompshard.disable()
    decompshard.unregister_reference(OP)


@pytest.fixture
def mesh4():
    return device_mesh((4,))


def _ranks(mesh):
    return LocalTensorMode(frozenset(range(mesh.size())))


def _assert_every_rank(dt, expected, mesh):
    per_rank = rank_locals(dt.full_tensor(), mesh)
    assert len(per_rank) == mesh.size()
    for r, t in per_rank.items():
        torch.testing.assert_close(t, expected, msg=lambda m, r=r: f"rank {r}: {m}")


def _inputs(rows, seed=0):
    x = torch.randn(rows, 6, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    w = torch.randn(16, dtype=torch.float64, generator=torch.Generator().manual_seed(seed + 1))
    return x, w


# ------------------------------------------------------------------ registered reference


@pytest.mark.parametrize("rows", [8, 7], ids=["even", "uneven"])
def test_opaque_op_with_reference_runs_sharded(mesh4, rows):
    x, w = _inputs(rows)
    expected = np_rmsnorm(x, w, EPS)
    torch.testing.assert_close(expected, rmsnorm_reference(x, w, EPS))
    decompshard.register_reference(OP, rmsnorm_reference)
    decompshard.enable()
    with _ranks(mesh4), warnings.catch_warnings():
        warnings.simplefilter("error")  # no "running replicated" warning
        dx, dw = distribute_tensor(x, mesh4, [S0]), distribute_tensor(w, mesh4, [R])
        with CommDebugMode() as comm:
            out = np_rmsnorm(dx, dw, EPS)
        assert comm.get_total_counts() == 0, comm.get_comm_counts()
        assert isinstance(out, DTensor) and tuple(out.placements) == (S0,)
        _assert_every_rank(out, expected, mesh4)


def test_decorator_form_and_reference_runs_real_kernel(mesh4, monkeypatch):
    """The decorator registers it; DTensor runs the real (numpy) kernel on local shards,
    never the reference: the reference is called only for the check (on one device)."""
    x, w = _inputs(8, seed=3)
    expected = np_rmsnorm(x, w, EPS)
    calls = []

    @decompshard.reference(np_rmsnorm)  # the custom_op object works as well as the OpOverload
    def ref(x, w, eps):
        if x.device.type != "meta":
            calls.append(tuple(x.shape))
        return rmsnorm_reference(x, w, eps)

    decompshard.enable()
    with _ranks(mesh4):
        dx, dw = distribute_tensor(x, mesh4, [S0]), distribute_tensor(w, mesh4, [R])
        out = np_rmsnorm(dx, dw, EPS)
        assert tuple(out.placements) == (S0,)
        _assert_every_rank(out, expected, mesh4)
    assert calls == [(8, 6, 16)], calls  # the one-device check, on the full shape, once


def test_registered_reference_context_manager_restores(mesh4):
    with decompshard.registered_reference(OP, rmsnorm_reference):
        from decompshard.dispatch_modes.reference import reference_of
        assert reference_of(OP) is rmsnorm_reference
    assert reference_of(OP) is None


# ------------------------------------------------------------------ no reference


def test_opaque_op_without_reference_runs_replicated_and_names_register_reference(mesh4):
    x, w = _inputs(7, seed=5)
    expected = np_rmsnorm(x, w, EPS)
    decompshard.enable()
    with _ranks(mesh4), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dx, dw = distribute_tensor(x, mesh4, [S0]), distribute_tensor(w, mesh4, [R])
        out = np_rmsnorm(dx, dw, EPS)
        assert tuple(out.placements) == (R,)
        _assert_every_rank(out, expected, mesh4)
    messages = [str(m.message) for m in caught if str(OP) in str(m.message)]
    assert any("running replicated" in m and "decompshard.register_reference(op, fn)" in m for m in messages), \
        [str(m.message) for m in caught]


# ------------------------------------------------------------------ wrong references


@pytest.mark.parametrize("wrong", [reference_without_weight, reference_without_eps], ids=["no-weight", "no-eps"])
def test_wrong_reference_is_refused(mesh4, wrong):
    x, w = _inputs(8, seed=7)
    decompshard.register_reference(OP, wrong)
    decompshard.enable()
    with _ranks(mesh4):
        dx, dw = distribute_tensor(x, mesh4, [S0]), distribute_tensor(w, mesh4, [R])
        # DTensor's dispatcher wraps it in a RuntimeError whose message starts with ours
        with pytest.raises(RuntimeError, match=r"decompshard_ref_test\.np_rmsnorm\.default") as e:
            np_rmsnorm(dx, dw, EPS)
    assert isinstance(e.value.__cause__, decompshard.ReferenceMismatch), repr(e.value)
    message = str(e.value)
    assert message.startswith("decompshard: custom op decompshard_ref_test.np_rmsnorm.default"), message
    assert "does not match the real kernel" in message and wrong.__name__ in message
    # and it stays refused (never cached as a pass, never a silent fallback)
    with _ranks(mesh4), pytest.raises(RuntimeError, match="does not match the real kernel"):
        np_rmsnorm(distribute_tensor(x, mesh4, [S0]), distribute_tensor(w, mesh4, [R]), EPS)


@pytest.mark.parametrize("bad, match", [
    ("decompshard_ref_test.no_such_op", "unknown op"),
    ("not an op name!", "malformed op name"),
    (42, "expected a custom op"),
    (torch.ops.aten.mul.Tensor, "is a torch op, not a custom op"),
], ids=["unknown", "malformed", "int", "aten"])
def test_register_reference_rejects_invalid_op(bad, match):
    with pytest.raises(ValueError, match=match):
        decompshard.register_reference(bad, rmsnorm_reference)
    with pytest.raises(ValueError, match=match):
        decompshard.reference(bad)


def test_register_reference_rejects_non_callable():
    with pytest.raises(TypeError, match="must be a callable"):
        decompshard.register_reference(OP, "not a function")
