"""The guard's fences per torch release (guard_table.WRONG_ON): the measurement itself.

For every fence, one call known to hit it. On the running release, where the table says
DTensor alone is wrong, it is wrong (or raises) and the guard makes it right; where the
table says torch is right (upstream fixed it), torch alone is right and the guard either
leaves the op's tables untouched or, for a fence kept as the cheaper plan
(`KEPT_WHERE_RIGHT`), gives the same right answer. So a new release that fixes or breaks
one of these fails here and names the entry to move. Parametrized by the table, not by
version checks: the running release is looked up in it (`_compat.TORCH_RELEASE`).
"""

from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import decompshard
from decompshard import _compat
from decompshard.placements import P, R, S
from decompshard.runtime.fences.table import KEPT_WHERE_RIGHT, TESTED_RELEASES, WRONG_ON, fenced, mask_key, wrong_here
from decompshard.verify.dtensor_case import device_mesh, rank_locals
from decompshard.verify.native_rules import run_on_dtensor

pytestmark = pytest.mark.usefixtures("world")
aten = torch.ops.aten


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _native(op, args, placements, w, kwargs: dict | None = None) -> Callable[[], bool | None]:
    """True: right; False: wrong (the judge's verdict, a kernel error on accepted
    placements included); None: refused loudly."""

    def measure() -> bool | None:
        run = run_on_dtensor(op, args, kwargs or {}, placements, w, exact=False)
        return True if run.ok else (False if run.wrong else None)

    return measure


def _after(op, first: tuple, args: tuple, placements, w, kwargs: dict | None = None,
           first_kwargs: dict | None = None) -> Callable[[], bool | None]:
    """The call `op(*args, **kwargs)` right after `op(*first, **first_kwargs)` at the same
    placements, DTensor's cached decisions forgotten before the first: the second is
    judged (a cache key that leaves out an argument the two differ in reuses the first's)."""

    def measure() -> bool | None:
        _compat.clear_dtensor_caches()
        run_on_dtensor(op, first, first_kwargs or {}, placements, w, exact=False)
        run = run_on_dtensor(op, args, kwargs or {}, placements, w, exact=False)
        return True if run.ok else (False if run.wrong else None)

    return measure


def _log_probs(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, generator=_gen()).log_softmax(1)


def _stats_kept(op, extra: tuple) -> Callable[[], bool | None]:
    """Batch norm in training on a channel-sharded input with replicated running
    statistics: are every rank's updated statistics one device's?"""

    def measure() -> bool | None:
        x = torch.randn(4, 8, 3, dtype=torch.float64, generator=_gen())
        w, b = torch.rand(8, dtype=torch.float64) + 0.5, torch.randn(8, dtype=torch.float64)
        stats = (torch.zeros(8, dtype=torch.float64), torch.ones(8, dtype=torch.float64))
        want = [s.clone() for s in stats]
        op(x, w, b, *want, *extra)
        mesh = device_mesh((4,))
        with LocalTensorMode(frozenset(range(4))), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            d = [distribute_tensor(t, mesh, [pl]) for t, pl in
                 ((x, Shard(1)), (w, Replicate()), (b, Replicate()), *((s, Replicate()) for s in stats))]
            op(*d, *extra)
            got = [rank_locals(s.full_tensor(), mesh) for s in d[3:]]
        return all(torch.allclose(g, t) for per_rank, t in zip(got, want) for g in per_rank.values())

    return measure


def _first_conv_grad() -> bool | None:
    """A 2-D mesh's first convolution (its input needs no gradient): the weight's
    gradient, or None where DTensor refuses."""
    x = torch.randn(4, 3, 6, 6, dtype=torch.float64, generator=_gen())
    w = torch.randn(5, 3, 3, 3, dtype=torch.float64, generator=_gen(1))
    wr = w.clone().requires_grad_()
    torch.nn.functional.conv2d(x, wr).sum().backward()
    mesh = device_mesh((2, 2))
    with LocalTensorMode(frozenset(range(4))), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dx = distribute_tensor(x, mesh, [Shard(0), Replicate()])
        dw = distribute_tensor(w, mesh, [Replicate(), Replicate()]).requires_grad_()
        try:
            torch.nn.functional.conv2d(dx, dw).sum().backward()
        except Exception:  # noqa: BLE001 - DTensor's refusal is the measurement
            return None
        got = rank_locals(dw.grad.full_tensor(), mesh)
    return all(torch.allclose(g, wr.grad) for g in got.values())


_X35 = torch.randn(5, 5, generator=_gen())
_CONV1D = (torch.randn(2, 3, 10, generator=_gen()), torch.randn(8, 3, 3, generator=_gen(1)),
           torch.randn(8, generator=_gen(2)), [1], [0], [1], False, [0], 1)
_GRAD_OUT = torch.randn(2, 8, 8, generator=_gen(3))
_X431 = torch.randn(4, 3, 1, generator=_gen())  # squeeze_ drops its last dim
_HIST_IN = torch.rand(5, 5, generator=_gen()) * 10
_NCHW = torch.randn(4, 3, 5, 5, generator=_gen())
# an index of 3 rows into an input of 6, both sharded on the rows (gathering along dim 1)
_GATHER = (torch.randn(6, 4, dtype=torch.float64, generator=_gen()), 1, torch.randint(0, 4, (3, 2), generator=_gen()))

# a batch of 2 upper-triangular, well-conditioned A; B of the same batch
_TRIANGULAR = (torch.randn(2, 3, 3, dtype=torch.float64, generator=_gen()).triu() + 3 * torch.eye(3, dtype=torch.float64),
               torch.randn(2, 3, 4, dtype=torch.float64, generator=_gen(1)))

# fence -> a measurement: True right, False wrong, None refused
CASES: dict[str, Callable[[], bool | None]] = {
    "aten.convolution.default": _native(aten.convolution.default, _CONV1D, (R, S(0), S(0)), 4),
    "aten.convolution_backward.default": _native(
        aten.convolution_backward.default, (_GRAD_OUT, *_CONV1D[:2], [8], *_CONV1D[3:], [True, True, True]),
        (R, S(1), R), 2),
    "aten.any.default": _native(aten.any.default, (torch.zeros(3, 5),), (P("sum"),), 2),
    "aten.any.dim": _native(aten.any.dim, (torch.zeros(3, 5), 1), (P("sum"),), 2),
    "aten.any.dims": _native(aten.any.dims, (torch.zeros(3, 5), [1]), (P("sum"),), 2),
    "aten.fill_.Scalar": _native(aten.fill_.Scalar, (torch.randn(5), 1.0), (P("sum"),), 2),
    "aten.threshold.default": _native(aten.threshold.default, (_X35, 0.5, 2.0), (P("max"),), 2),
    "aten.linalg_solve_triangular.default": _native(aten.linalg_solve_triangular.default, _TRIANGULAR, (R, S(0)), 2,
                                                    {"upper": True}),
    "aten.nll_loss_forward.default": _native(
        aten.nll_loss_forward.default,
        (_log_probs(8, 3), torch.tensor([0, 1, 2, 1, 0, 0, 2, 1]), torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64),
         1, -100), (S(0), S(0), R), 2),
    "aten.nll_loss2d_forward.default": _native(
        aten.nll_loss2d_forward.default,
        (_log_probs(4, 3, 3, 2), torch.randint(0, 3, (4, 3, 2), generator=_gen()),
         torch.tensor([0.2, 1.0, 3.0], dtype=torch.float64), 1, -100), (S(0), S(0), R), 2),
    "aten._local_scalar_dense.default": _native(
        aten._local_scalar_dense.default, (torch.tensor(2.5, dtype=torch.float64),), (P("sum"),), 2),
    "aten.native_batch_norm.default": _stats_kept(aten.native_batch_norm.default, (True, 0.1, 1e-5)),
    "aten._native_batch_norm_legit.default": _stats_kept(aten._native_batch_norm_legit.default, (True, 0.1, 1e-5)),
    "aten._batch_norm_with_update.default": _stats_kept(aten._batch_norm_with_update.default, (0.1, 1e-5)),
    "aten.cumsum.default": _native(aten.cumsum.default, (torch.randn(4, 7, generator=_gen()), -1), (S(1),), 3),
    "aten.cumprod.default": _native(aten.cumprod.default, (torch.randn(4, 7, generator=_gen()), -1), (S(1),), 3),
    "aten.logcumsumexp.default": _native(
        aten.logcumsumexp.default, (torch.randn(4, 7, generator=_gen()), -1), (S(1),), 3),
    mask_key("aten.convolution_backward.default"): _first_conv_grad,
    "aten.histc.default": _after(aten.histc.default, (_HIST_IN, 100, 0, 10), (_HIST_IN, 1, 0, 10), (S(0),), 4),
    "aten._to_copy.default": _after(aten._to_copy.default, (_NCHW,), (_NCHW,), (S(0),), 2,
                                    {"dtype": torch.float64, "memory_format": torch.channels_last},
                                    {"dtype": torch.float64}),
    "aten.gather.default": _native(aten.gather.default, _GATHER, (S(0), S(0)), 2),
    # keepdim by position, as the dispatcher passes it: reduce dim 0 of a Shard(1) input
    "aten.logsumexp.default": _native(aten.logsumexp.default, (torch.randn(8, 4, generator=_gen()), [0], True),
                                      (S(1),), 2),
    "aten.squeeze_.default": _native(aten.squeeze_.default, (_X431.clone(),), (R,), 2),
    "aten.squeeze_.dim": _native(aten.squeeze_.dim, (_X431.clone(), -1), (S(0),), 2),
    "aten.squeeze_.dims": _native(aten.squeeze_.dims, (_X431.clone(), [2]), (P("sum"),), 2),
}


def test_every_fence_has_a_measurement_and_every_release_is_named():
    assert set(CASES) == set(WRONG_ON)
    assert all(set(releases) <= set(TESTED_RELEASES) for releases in WRONG_ON.values())
    assert set(KEPT_WHERE_RIGHT) <= set(WRONG_ON)


def test_an_untested_release_keeps_every_fence():
    assert all(fenced(key, "9.9.9") and wrong_here(key, "9.9.9") for key in WRONG_ON)


@pytest.mark.parametrize("key", sorted(WRONG_ON))
def test_the_fence_is_where_torch_alone_is_wrong(key):
    """The measurement on the running release: what WRONG_ON says about it holds."""
    decompshard.disable()
    alone = CASES[key]()
    decompshard.enable()
    try:
        guarded = CASES[key]()
    finally:
        decompshard.disable()
    release = _compat.TORCH_RELEASE
    if release not in TESTED_RELEASES:
        pytest.skip(f"torch {release} is untested: every fence stays on")
    if wrong_here(key):
        assert alone is not True, f"{key}: torch {release} alone is right here; take it out of WRONG_ON"
        # right, or (an in-place op with only wrong strategies) refused loudly
        assert guarded is True or (guarded is None and key == "aten.fill_.Scalar"), (key, guarded)
    else:
        assert alone is True, f"{key}: torch {release} alone is wrong here ({alone}); WRONG_ON must name it"
        assert guarded is True, (key, guarded)
