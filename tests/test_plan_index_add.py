"""index_add into a tensor sharded along the indexed dim (runtime/plans/index_add.py):
each rank adds the source rows whose global index falls in its own slab, nothing moved.

Real DTensors on simulated meshes (1-D of 4 and 3 ranks with uneven slabs, 2x2 with the
columns sharded too, 2x2x2, and a Partial source as a row-parallel matmul hands it on), float64,
out of place and in place (`index_add_`, Mixtral's expert loop), forward and backward:
every output and gradient on every rank against one device. Without `enable()` (and with
it without this plan) the sharded `self` is all-gathered.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import decompshard
from decompshard.verify.dtensor_case import device_mesh
from test_collective_plans import MOVES_ACTIVATIONS, _step, _x

WORLD_SIZE = 8
R = Replicate()
pytestmark = pytest.mark.usefixtures("world")

INDEX = torch.tensor([0, 9, 3, 3, 5, 8, 1])  # repeats, first and last rows, every slab of 10 on 3 or 4 ranks


def _out_of_place(x, index, source):
    return x.index_add(0, index, source, alpha=2.0)


def _in_place(x, index, source):
    y = x * 1.0
    y.index_add_(0, index, source)
    return y


def _from_row_parallel(x, index, a, w):
    """The source a Partial(sum) on the second mesh dim, as a row-parallel layer leaves it."""
    y = x * 1.0
    y.index_add_(0, index, a.mm(w))
    return y


# (mesh, placements of x, of the source)
LAYOUTS = [
    ((4,), [Shard(0)], [R]),
    ((3,), [Shard(0)], [R]),
    ((2, 2), [Shard(0), R], [R, R]),
    ((2, 2), [Shard(0), Shard(1)], [R, Shard(1)]),
    ((2, 2, 2), [Shard(1), Shard(0), R], [Shard(1), R, R]),
]


@pytest.fixture()
def enabled():
    decompshard.enable()
    yield
    decompshard.disable()


@pytest.mark.parametrize("fn", [_out_of_place, _in_place], ids=["index_add", "index_add_"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: f"{v[0]}-{v[1]}")
def test_rows_added_where_they_live(enabled, layout, fn):
    mesh_shape, pl_x, pl_s = layout
    mesh = device_mesh(mesh_shape)
    inputs = [_x(10, 6), INDEX, _x(7, 6, seed=2)]
    placements = [pl_x, [R] * mesh.ndim, pl_s]
    out_ok, grads_ok, _, out_placements = _step(fn, inputs, placements, mesh)
    assert out_ok and grads_ok
    assert out_placements == tuple(pl_x)
    # with only self's gradient wanted, nothing moves forward or backward
    out_ok, grads_ok, comms, _ = _step(fn, inputs, placements, mesh, n_grad=1)
    assert out_ok and grads_ok and not comms, comms


def test_partial_source_reduced_not_gathered(enabled):
    """Mixtral 2-D: the expert's rows Partial over tp, the buffer batch-sharded over dp."""
    mesh = device_mesh((2, 2))
    inputs = [_x(10, 6), INDEX, _x(7, 4, seed=3), _x(4, 6, seed=4)]
    placements = [[Shard(0), R], [R, R], [R, Shard(1)], [R, Shard(0)]]
    out_ok, grads_ok, comms, _ = _step(_from_row_parallel, inputs, placements, mesh)
    assert out_ok and grads_ok
    out_ok, grads_ok, comms, _ = _step(_from_row_parallel, inputs, placements, mesh, n_grad=1)
    assert out_ok and grads_ok
    assert comms == {"all_reduce": 1}, comms  # the rows' Partial, as Megatron reduces it


def test_gathered_without_the_plan(enabled):
    """enable()'s derived strategy alone keeps the indexed dim whole: self is gathered."""
    decompshard.enable(plans=False)
    mesh = device_mesh((4,))
    # (in place: out of place, self's gradient would be the test's own replicated
    # output gradient, whose local tensor is not the simulation's)
    out_ok, grads_ok, comms, _ = _step(_in_place, [_x(10, 6), INDEX, _x(7, 6, seed=2)], [[Shard(0)], [R], [R]],
                                       mesh, n_grad=1)
    assert out_ok and grads_ok
    assert any(k in comms for k in MOVES_ACTIVATIONS), comms


def test_declines_when_a_rank_holds_no_rows(enabled):
    """3 rows on 4 ranks: the last slab is empty (no row to point the other slabs' zero
    rows at), so DTensor's strategy runs, and is right."""
    mesh = device_mesh((4,))
    out_ok, grads_ok, comms, _ = _step(_in_place, [_x(3, 6), torch.tensor([2, 0, 2]), _x(3, 6, seed=2)],
                                       [[Shard(0)], [R], [R]], mesh, n_grad=1)
    assert out_ok and grads_ok
    assert any(k in comms for k in MOVES_ACTIVATIONS), comms


def test_compiled_matches_eager_and_one_device(enabled):
    """Under torch.compile (fullgraph, aot_eager) the plan traces and gives eager's
    shard, which is rank 0's rows of one device's result (fake process group: rank 0's
    numbers are real where nothing moves)."""
    from torch.distributed.tensor import DTensor

    mesh = device_mesh((4,))
    x, src = _x(10, 6), _x(7, 6, seed=2)
    dx = DTensor.from_local(x.tensor_split(4, 0)[0].contiguous(), mesh, [Shard(0)], run_check=False,
                            shape=x.shape, stride=x.stride())
    di = DTensor.from_local(INDEX, mesh, [R], run_check=False)
    ds = DTensor.from_local(src, mesh, [R], run_check=False)
    torch._dynamo.reset()
    compiled = torch.compile(_out_of_place, backend="aot_eager", fullgraph=True)(dx, di, ds)
    eager = _out_of_place(dx, di, ds)
    assert compiled.placements == eager.placements == (Shard(0),)
    assert torch.equal(compiled.to_local(), eager.to_local())
    assert torch.allclose(eager.to_local(), x.index_add(0, INDEX, src, alpha=2.0)[:3], rtol=1e-12, atol=1e-12)
