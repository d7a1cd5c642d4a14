"""Ops `enable()` runs on replicated inputs, checked through real DTensor dispatch: each
op's tensors `Shard(0)` on a simulated world of 3 with uneven sizes, every rank's result
against one device (verify/dtensor_case.run_case, float64). These are the ops the coverage
table reports as replicate-only for that reason (tests/test_coverage_status.py); a
claim there is only as good as a run here."""

from __future__ import annotations

import pytest
import torch

from decompshard.coverage.runtime_probe import PROBE_MESH, probe_placements
from decompshard.runtime.support.data_dependent import data_dependent_ops
from decompshard.verify.dtensor_case import run_case
from decompshard.runtime.enable import switched

aten = torch.ops.aten


WORLD_SIZE = 3  # simulated ranks for conftest's `world`
pytestmark = pytest.mark.usefixtures("world")


def _g() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _sparse() -> torch.Tensor:
    x = torch.randn(7, 4, dtype=torch.float64, generator=_g())
    return torch.where(x > 0.3, x.round(), torch.zeros_like(x))  # zeros and repeats


def _values() -> torch.Tensor:
    return torch.rand(7, 2, dtype=torch.float64, generator=_g())


CASES = {  # op: (args, kwargs); every tensor with a dim goes in as Shard(0)
    # output size depends on values (torch.Tag.dynamic_output_shape): data_dependent.py
    "aten.nonzero.default": ((_sparse(),), {}),
    "aten.masked_select.default": ((_sparse(), _sparse() > 0), {}),
    "aten._unique2.default": ((_sparse(), True, True, True), {}),
    "aten.unique_consecutive.default": ((_sparse().flatten().sort().values, True, True), {}),
    "aten.unique_dim.default": ((_sparse().abs().clamp(max=1), 0, True, True, True), {}),
    "aten.repeat_interleave.Tensor": ((torch.tensor([2, 0, 1, 3, 1, 0, 2]),), {}),
    # a Python value from whole tensors (torch.Tag.data_dependent_output): data_dependent.py
    "aten.allclose.default": ((_sparse(), _sparse() + 1e-9), {}),
    # static output size, no decomposition: enable()'s replicated fallback
    "aten.nonzero_static.default": ((_sparse(),), {"size": 9}),
    "aten.histogram.bin_ct": ((_sparse().flatten(),), {"bins": 5}),
    "aten.histogram.bins_tensor": ((_sparse().flatten(), torch.linspace(-2, 2, 6, dtype=torch.float64)), {}),
    "aten._histogramdd_from_bin_cts.default": ((_values(), [3, 4]), {}),
    "aten._histogramdd_bin_edges.default": ((_values(), [3, 4]), {}),  # returns Tensor[]
    "aten._histogramdd_from_bin_tensors.default": (
        (_values(), [torch.linspace(0, 1, 4, dtype=torch.float64), torch.linspace(0, 1, 3, dtype=torch.float64)]), {}),
    # in place, no decomposition: inplace.py runs the functional twin replicated, writes self
    "aten.embedding_renorm_.default": (
        (torch.randn(7, 4, dtype=torch.float64, generator=_g()) * 2, torch.tensor([0, 3, 3, 6, 1]), 1.0, 2.0), {}),
}


def _op(name: str) -> torch._ops.OpOverload:
    _, packet, overload = name.split(".")
    return getattr(getattr(aten, packet), overload)


def _run(name: str):
    op = _op(name)
    args, kwargs = CASES[name]
    tensors = [x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    assert any(t.ndim and t.shape[0] % PROBE_MESH[0] for t in tensors)  # an uneven shard
    return run_case(op, args, kwargs, PROBE_MESH, probe_placements(tensors), backward=False,
                    runtime=switched(True))


@pytest.mark.parametrize("name", sorted(CASES))
def test_runs_replicated_and_matches_one_device(name):
    got = _run(name)
    assert got.status == "ok", str(got)


def test_allclose_gives_the_same_bool_on_every_rank():
    assert _op("aten.allclose.default") in data_dependent_ops()  # found by its tag
    x = _sparse()
    for other, want in ((x + 1e-9, True), (x + 1e-3, False)):
        got = run_case(aten.allclose.default, (x, other), {}, PROBE_MESH, probe_placements([x, other]),
                       backward=False, runtime=switched(True))
        assert got.status == "ok", str(got)
        assert torch.allclose(x, other) is want
