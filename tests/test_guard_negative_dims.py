"""The native guard's dim wrapping (decompshard/runtime/fences/negative_dims.py): DTensor's `scan_strategy`
(cumsum, cumprod, logcumsumexp) compares `dim` unwrapped with the placements' dims, so
`cumsum(-1)` on a Shard of the last dim scans each rank's part alone. Every case here
is compared with one device (float64), forward and backward, on an uneven 1-D mesh of 3
and a 2x2 mesh; each is shown wrong without the guard, so the tests can fail. The
negative-dim variants of the native audit (coverage/native_variants.py), which found
these ops, are checked on calls whose meaning is known. torch 2.14 fixed the scan
strategy: where the guard table says torch alone is right (`guard_table.wrong_here`),
these cases show it right, and the guard leaves the strategy alone.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import decompshard
from decompshard.coverage.native_variants import negative_dim_samples
from decompshard.coverage.opinfo_samples import AtenSample
from decompshard.runtime.fences.table import NEGATIVE_DIMS_UNWRAPPED, wrong_here
from decompshard.verify.dtensor_case import device_mesh, rank_locals

aten = torch.ops.aten
OPS = {"cumsum": torch.cumsum, "cumprod": torch.cumprod, "logcumsumexp": torch.logcumsumexp}
# cumprod's backward raises on DTensor at every layout, Replicate included, guard or not
# (torch's cumprod_backward calls `where` with a plain tensor): forward only
BACKWARD = {"cumsum": True, "cumprod": False, "logcumsumexp": True}

# (mesh shape, global shape, placements, dim): the scanned dim sharded, unevenly on 3
CASES = [
    ((3,), (7,), (Shard(0),), -1),
    ((3,), (4, 7), (Shard(1),), -1),
    ((3,), (7, 4), (Shard(0),), -2),
    ((2, 2), (5, 7), (Shard(0), Shard(1)), -1),
    ((2, 2), (5, 7), (Shard(1), Shard(0)), -2),
]


def _data(shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(len(shape) * 10 + shape[-1])
    return (torch.randn(shape, dtype=torch.float64, generator=g),
            torch.randn(shape, dtype=torch.float64, generator=g))


def _run(fn, mesh_shape, shape, placements, dim, backward: bool = True) -> tuple[list, list, Any, Any, dict]:
    """Every rank's full output and input gradient of `(fn(x, dim) * w).sum()`, the
    one-device ones, and the collectives DTensor ran (no gradients: `backward` False)."""
    x, w = _data(shape)
    xr = x.clone().requires_grad_(backward)
    if backward:
        (fn(xr, dim) * w).sum().backward()
    mesh = device_mesh(mesh_shape)
    n = mesh.size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with LocalTensorMode(frozenset(range(n))):
            xd = distribute_tensor(x, mesh, placements).requires_grad_(backward)
            wd = distribute_tensor(w, mesh, [Replicate()] * mesh.ndim)
            with CommDebugMode() as comm:
                y = fn(xd, dim)
                if backward:
                    (y * wd).sum().backward()
            outs = list(rank_locals(y.full_tensor(), mesh).values())
            grads = list(rank_locals(xd.grad.full_tensor(), mesh).values()) if backward else []
    return outs, grads, fn(x, dim), xr.grad, dict(comm.get_comm_counts())


def _right(got) -> bool:
    outs, grads, want, want_grad, _ = got
    return (all(o.shape == want.shape and torch.allclose(o, want) for o in outs)
            and (want_grad is None or len(grads) > 0)
            and all(g.shape == want_grad.shape and torch.allclose(g, want_grad) for g in grads))


def test_every_guarded_op_has_its_cases_here():
    """An op added to the guard's table without its cases here fails."""
    assert set(NEGATIVE_DIMS_UNWRAPPED) == {f"aten.{name}.default" for name in OPS}


@pytest.mark.parametrize("name", OPS)
def test_negative_dims_are_right_with_the_guard_and_wrong_without(world, name):
    wrong = wrong_here(f"aten.{name}.default")  # torch alone, on the running release
    for case in CASES:
        decompshard.disable()
        assert _right(_run(OPS[name], *case, BACKWARD[name])) is not wrong, f"DTensor alone on {case}: not as measured"
        decompshard.enable()
        assert _right(_run(OPS[name], *case, BACKWARD[name])), case
    decompshard.enable(guard_native=False)
    assert _right(_run(OPS[name], *CASES[0], BACKWARD[name])) is not wrong, "the guard opted out still changed DTensor"
    decompshard.enable()


def test_a_negative_dim_takes_the_path_of_the_same_dim_written_positive(world):
    """Guarded, `cumsum(-1)` runs exactly the collectives and placements of `cumsum(ndim - 1)`;
    dims >= 0 take the same path with and without the guard (nothing added)."""
    decompshard.enable()
    for mesh_shape, shape, placements, dim in CASES:
        neg = _run(torch.cumsum, mesh_shape, shape, placements, dim)
        pos = _run(torch.cumsum, mesh_shape, shape, placements, dim + len(shape))
        assert neg[4] == pos[4] and neg[4], (shape, placements, neg[4], pos[4])
    decompshard.disable()
    for mesh_shape, shape, placements, dim in CASES:
        unguarded = _run(torch.cumsum, mesh_shape, shape, placements, dim + len(shape))
        decompshard.enable()
        guarded = _run(torch.cumsum, mesh_shape, shape, placements, dim + len(shape))
        decompshard.disable()
        assert _right(unguarded) and _right(guarded)
        assert unguarded[4] == guarded[4]
    decompshard.enable()


def _position_ids(mask: torch.Tensor) -> torch.Tensor:
    """transformers' position ids from a left-padded attention mask."""
    position_ids = mask.long().cumsum(-1) - 1
    return position_ids.masked_fill(mask == 0, 1)


def test_transformers_position_ids_batch_and_sequence_sharded(world):
    lengths = torch.tensor([7, 3, 5, 1, 6])
    mask = (torch.arange(7)[None, :] >= 7 - lengths[:, None]).long()  # [5, 7], left padding
    want = _position_ids(mask)
    mesh = device_mesh((2, 2))
    got = {}
    for guarded in (False, True):
        decompshard.enable(guard_native=guarded)
        with LocalTensorMode(frozenset(range(4))):
            md = distribute_tensor(mask, mesh, [Shard(0), Shard(1)])
            got[guarded] = list(rank_locals(_position_ids(md).full_tensor(), mesh).values())
    decompshard.enable()
    assert all(torch.equal(g, want) for g in got[True])
    assert all(torch.equal(g, want) for g in got[False]) is not wrong_here("aten.cumsum.default")


def test_negative_dim_variants_mean_what_the_sample_means():
    x = torch.randn(3, 4, 5)
    made = negative_dim_samples([
        AtenSample(aten.cumsum.default, (x, 1)),
        AtenSample(aten.unsqueeze.default, (x, 1)),  # dims of the output: 1 - 4, not 1 - 3
        AtenSample(aten.diagonal.default, (x,)),  # defaults dim1=0, dim2=1
        AtenSample(aten.stack.default, ([x, x], 3)),  # the new last dim
        AtenSample(aten.sum.dim_IntList, (x, [0, 2])),
        AtenSample(aten.cumsum.default, (x, -1)),  # already negative: no variant
    ], 10)
    got = {(str(s.op), repr(s.args[1:]), repr(s.kwargs)) for s in made}
    assert got == {
        ("aten.cumsum.default", "(-2,)", "{}"),
        ("aten.unsqueeze.default", "(-3,)", "{}"),
        ("aten.diagonal.default", "()", "{'dim1': -3, 'dim2': -2}"),
        ("aten.stack.default", "(-1,)", "{}"),
        ("aten.sum.dim_IntList", "([-3, -1],)", "{}"),
    }
    for s in made:
        assert "negative dims" in s.opinfo_name


@pytest.mark.parametrize("guarded", [False, True])
def test_the_audit_finds_cumsum_with_negative_dims_and_not_under_the_guard(monkeypatch, guarded):
    """`coverage --verify-native` on an OpInfo-style cumsum sample with dim >= 0 (right
    in DTensor): its negative-dim variant is what the audit reports, and nothing is
    left of it with the guard (`--guard`), nor on a release where torch fixed it."""
    from decompshard.runtime.fences import guard
    from decompshard.coverage import native_audit, opinfo_samples

    x = torch.randn(5, 6, dtype=torch.float64)
    sample = AtenSample(aten.cumsum.default, (x, 1), {}, "cumsum")
    monkeypatch.setattr(opinfo_samples, "capture_aten_samples", lambda **kw: {aten.cumsum.default: [sample]})
    guard.uninstall()
    doc = native_audit.native_sweep("aten.cumsum.default", jobs=0, progress=False, guarded=guarded)
    assert doc["run"]["negative_dims"] and doc["run"]["negative_dims_failed"] == {}
    assert doc["ops"][0]["n_samples"] == 2
    found = {(w["rule"], w["sample"]) for w in doc["wrong_rules"]}
    if guarded or not wrong_here("aten.cumsum.default"):
        assert found == set()
    else:
        assert ("S(1) -> S(1)", "cumsum | negative dims: dim=-1") in found
        assert all("negative dims" in s for _, s in found), found


class _Die:
    def __reduce__(self):
        import os

        return (os._exit, (7,))


def test_a_kernel_crashing_on_negative_dims_costs_its_own_variants_only():
    """Negative-dim variants are made in the crash-isolating pool (`_fft_c2r` with
    negative dims kills the process on one device): the run record says which op got
    none and why, and the next op's variants are made in a fresh worker."""
    from decompshard.coverage.native_audit import negative_dim_variants

    x = torch.randn(4, 5)
    captured = {aten.cumsum.default: [AtenSample(aten.cumsum.default, (x, 1, _Die()))],
                aten.cumprod.default: [AtenSample(aten.cumprod.default, (x, 1), {}, "cumprod")]}
    made, failed = negative_dim_variants(captured, list(captured), 2, 1, 60.0)
    assert list(failed) == ["aten.cumsum.default"] and made[aten.cumsum.default] == []
    assert [(s.args[1], s.opinfo_name) for s in made[aten.cumprod.default]] == [(-1, "cumprod | negative dims: dim=-1")]
