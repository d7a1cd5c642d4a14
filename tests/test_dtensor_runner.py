"""The one DTensor runner's engine (verify/dtensor_case.py), shared by the check
(`run_case`) and the native audit (`native_rules.run_on_dtensor`): the one judge's
numbers (verify/judge.py), its simulation context and the chunk mend (verify/per_rank.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch._utils as tutils

from decompshard._compat import TorchShard, make_local_tensor, simulating_ranks
from decompshard.verify.per_rank import per_rank_call, simulator_chunks
from decompshard.placements import S
from decompshard.verify.dtensor_case import device_mesh, every_rank_full, mesh_coords, simulation
from decompshard.verify.judge import max_error
from decompshard.verify.native_rules import run_on_dtensor

aten = torch.ops.aten
INF, NAN = math.inf, math.nan


pytestmark = pytest.mark.usefixtures("world")


def test_max_error_is_the_largest_difference_for_every_dtype():
    """One policy for every tool: the largest |difference| in the values' unit."""
    got, want = torch.tensor([1, 5, 3]), torch.tensor([1, 2, 0])
    assert max_error(got, want) == 3.0  # integers: the largest difference, not a count
    assert max_error(torch.tensor([True, False]), torch.tensor([False, False])) == 1.0


def test_max_error_counts_what_close_calls_equal_as_zero():
    got, want = torch.tensor([INF, 1.5, NAN], dtype=torch.float64), torch.tensor([INF, 1.0, NAN], dtype=torch.float64)
    assert max_error(got, want) == 0.5  # a matching inf and NaN against NaN count 0
    assert max_error(torch.tensor([INF]), torch.tensor([-INF])) == INF
    assert max_error(torch.tensor([NAN]), torch.tensor([1.0])) == INF
    z_got = torch.tensor([complex(NAN, 0), 1 + 2j], dtype=torch.complex128)
    z_want = torch.tensor([complex(NAN, 0), 1 + 1j], dtype=torch.complex128)
    assert max_error(z_got, z_want) == 1.0  # NaN against NaN counts 0, complex too
    assert max_error(torch.zeros(2, 3), torch.zeros(3, 2)) == INF
    assert max_error(torch.zeros(0), torch.zeros(0)) == 0.0


def test_simulation_mends_chunks_only_when_asked():
    original_chunk, original_cat = TorchShard.__dict__["_custom_chunk"], tutils._chunk_or_narrow_cat
    assert not simulating_ranks()
    with simulation(4):
        assert simulating_ranks()
        assert TorchShard.__dict__["_custom_chunk"] is not original_chunk
        assert tutils._chunk_or_narrow_cat is not original_cat
    assert TorchShard.__dict__["_custom_chunk"] is original_chunk and tutils._chunk_or_narrow_cat is original_cat
    with simulation(4, mend_chunks=False):  # the native audit: DTensor as torch ships it
        assert simulating_ranks()
        assert TorchShard.__dict__["_custom_chunk"] is original_chunk
    assert not simulating_ranks()


def test_simulator_chunks_restores_torch_after_an_error():
    original_chunk, original_cat = TorchShard.__dict__["_custom_chunk"], tutils._chunk_or_narrow_cat
    with pytest.raises(ZeroDivisionError), simulator_chunks():
        1 / 0
    assert TorchShard.__dict__["_custom_chunk"] is original_chunk and tutils._chunk_or_narrow_cat is original_cat


def test_per_rank_call_runs_each_rank_on_its_own_tensor():
    lt = make_local_tensor({0: torch.arange(3.0), 1: torch.arange(1.0)})  # ranks of unequal sizes
    doubled = per_rank_call(lambda t: t * 2)(lt)
    assert [doubled._local_tensors[r].tolist() for r in (0, 1)] == [[0.0, 2.0, 4.0], [0.0]]
    pieces = per_rank_call(lambda t, k: [t[:k], t[k:]])(lt, 1)
    assert [p._local_tensors[0].tolist() for p in pieces] == [[0.0], [1.0, 2.0]]
    assert [p._local_tensors[1].tolist() for p in pieces] == [[0.0], []]
    assert per_rank_call(lambda t: t + 1)(torch.ones(2)).tolist() == [2.0, 2.0]  # a plain tensor: one call


def test_every_rank_full_gathers_an_uneven_shard_on_every_rank():
    from torch.distributed.tensor import distribute_tensor

    x = torch.arange(10.0).view(5, 2)
    mesh = device_mesh((4,))
    with simulation(4):
        fulls = every_rank_full(distribute_tensor(x, mesh, [TorchShard(0)]), mesh)
        plain = every_rank_full(3, mesh)
    assert sorted(fulls) == [0, 1, 2, 3] and all(torch.equal(f, x) for f in fulls.values())
    assert plain == {0: 3, 1: 3, 2: 3, 3: 3}
    assert mesh_coords((2, 3))[4] == (1, 1)


def test_the_audit_runs_on_the_runners_mesh_and_reference():
    """argmax over a sharded dim: a rank's local argmax is a local index, so DTensor
    must gather the dim first; the audit's run (one device's reference, the runner's
    1-D mesh, every rank's full value) finds it right, with its placement words."""
    x = torch.tensor([[0.0, 9.0], [5.0, 1.0], [2.0, 3.0], [8.0, 4.0]])
    run = run_on_dtensor(aten.argmax.default, (x, 0), {}, (S(0),), 4)
    assert run.ok and not run.wrong, run.reason
    assert run.max_error == 0.0 and run.output_placements == ["R"]
    off = run_on_dtensor(aten.argmax.default, (x, 0), {}, (S(0),), 4, values=False)
    assert off.ok and off.max_error is None  # shapes only: no numbers
