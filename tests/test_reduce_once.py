"""A Partial gradient reduced once per backward node (decompshard/runtime/steering/reduce_once.py).

A block whose output feeds two column-parallel layers: its gradient arrives as the sum of
two Partials and reaches the row-parallel layer's backward node Partial, where the input
gradient reads `grad` and the weight gradient `grad.t()`. On simulated meshes (1-D with
uneven shards, 2-D, 3-D), float64, the loss's gradients on every rank against one
device, and the reductions that node issues counted: one with the reuse, two without it
(the same case with the dispatch slot's original put back for the run). A gradient hook
that reads the gradient whole and then scales it in place, inside the same node, must
not be handed the reduction made before the write.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import decompshard
from decompshard._compat import dispatch_redistribute_slot
from decompshard.dispatch_modes.comm_bytes import CommBytes
from decompshard.verify.dtensor_case import device_mesh, simulation

pytestmark = pytest.mark.usefixtures("world")
R = Replicate()


def _t(*shape, seed):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _block(x, w1, w2, wk, wv, hook=None):
    r = torch.relu(x @ w1.T) @ w2.T  # column- then row-parallel (2-D: the mm node reads r's gradient)
    if hook is not None:
        r.register_hook(hook)
    h = x + r
    return (h @ wk.T) * (h @ wv.T)  # two column-parallel layers read h


# mesh shape -> (placements of x, w1, w2, wk, wv, the cotangent; the tp mesh dim)
_MESHES = {
    (4,): ([R], [Shard(0)], [Shard(1)], [Shard(0)], [Shard(0)], [Shard(1)]),
    (2, 2): ([Shard(0), R], [R, Shard(0)], [R, Shard(1)], [R, Shard(0)], [R, Shard(0)], [Shard(0), Shard(1)]),
    (2, 1, 2): ([Shard(0), R, R], [R, R, Shard(0)], [R, R, Shard(1)], [R, R, Shard(0)], [R, R, Shard(0)],
                [Shard(0), R, Shard(1)]),
}


@contextlib.contextmanager
def _without_reuse():
    """The dispatch slot holding what it held before `enable()` wrapped it."""
    module, attribute = dispatch_redistribute_slot()
    wrapped = vars(module)[attribute]
    setattr(module, attribute, wrapped.__wrapped__)
    try:
        yield
    finally:
        setattr(module, attribute, wrapped)


def _run(mesh_shape, reuse: bool, hook=None):
    """(gradients right on every rank, backward all-reduces issued by mm)."""
    # uneven on 4 ranks: 30 hidden rows of w1 (8, 8, 8, 6), 18 of wk / wv (5, 5, 5, 3)
    args = [_t(6, 16, seed=1), _t(30, 16, seed=2), _t(16, 30, seed=3), _t(18, 16, seed=6), _t(18, 16, seed=7)]
    cot = _t(6, 18, seed=5)
    ref = [a.clone().requires_grad_(True) for a in args]
    (_block(*ref, hook=hook) * cot).sum().backward()
    mesh = device_mesh(mesh_shape)
    *placements, cot_placement = _MESHES[mesh_shape]
    decompshard.enable()
    try:
        with simulation(4), warnings.catch_warnings(), (contextlib.nullcontext() if reuse else _without_reuse()):
            warnings.simplefilter("ignore")
            d = [distribute_tensor(a, mesh, pl).requires_grad_(True) for a, pl in zip(args, placements)]
            out = _block(*d, hook=hook)
            with CommBytes() as bwd:
                (out * distribute_tensor(cot, mesh, cot_placement)).sum().backward()
            right = all(torch.allclose(v, r.grad, rtol=1e-10, atol=1e-12)
                        for a, r in zip(d, ref) for v in a.grad.full_tensor()._local_tensors.values())
    finally:
        decompshard.disable()
    by_mm = [c for c in bwd.listing if c.op.startswith("aten.mm") and c.collective == "all_reduce"]
    return right, len(by_mm)


@pytest.mark.parametrize("mesh_shape", list(_MESHES))
def test_the_row_parallel_node_reduces_the_gradient_once(mesh_shape):
    right, reductions = _run(mesh_shape, reuse=True)
    assert right
    assert reductions == 1
    right_without, reductions_without = _run(mesh_shape, reuse=False)
    assert right_without
    assert reductions_without == 2  # DTensor alone: once per mm that reads it


def _read_then_scale(g):
    torch.clamp(g, min=-1e9)  # needs the gradient whole: reduced inside the mm node's hooks
    g.mul_(0.5)  # then written in place (DTensor bumps the DTensor's version, not the local tensor's)


def test_a_gradient_written_in_place_after_a_reduction_is_reduced_again():
    right, reductions = _run((2, 2), reuse=True, hook=_read_then_scale)
    assert right
    assert reductions == 1  # the hook's clamp is not an mm; the node's own reduction is made anew


def test_disable_puts_the_dispatch_slot_back_and_leaves_the_slow_path_alone():
    """The C++ dispatch keeps the slow-path method it fetched first for the whole process:
    `enable()` must not wrap it (a wrapper would outlive `disable()`), only the module
    global the slow path calls on every move."""
    from torch.distributed.tensor._dispatch import OpDispatcher

    module, attribute = dispatch_redistribute_slot()
    before = vars(module)[attribute], vars(OpDispatcher)["_dispatch_get_local_results_slow_path"]
    decompshard.enable()
    try:
        assert vars(module)[attribute] is not before[0]
        assert vars(OpDispatcher)["_dispatch_get_local_results_slow_path"] is before[1]
    finally:
        decompshard.disable()
    assert vars(module)[attribute] is before[0]


_AFTER_A_DTENSOR_OP = """
import sys, warnings
sys.path.insert(0, {tests!r})
import torch
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from decompshard.verify.dtensor_case import device_mesh, simulated_world, simulation
import test_reduce_once as t
with simulated_world(4):
    with simulation(4), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = distribute_tensor(torch.ones(4, 4), device_mesh((2, 2)), [Replicate(), Replicate()])
        y = distribute_tensor(torch.ones(4, 4), device_mesh((2, 2)), [Shard(0), Replicate()])
        (x + y).sum()  # an input moves: DTensor's C++ dispatch fetches its slow path now, before enable()
    print(t._run((2, 2), reuse=True))
"""


def test_the_reuse_holds_when_dtensor_ran_before_enable():
    """In a fresh process whose first DTensor op runs before `enable()` (a wrapper on the
    slow path would never be called there: the reuse was lost, found by test order;
    this case gave two reductions before)."""
    import os
    import subprocess
    import sys

    tests = os.path.dirname(os.path.abspath(__file__))
    out = subprocess.run([sys.executable, "-c", _AFTER_A_DTENSOR_OP.format(tests=tests)], capture_output=True,
                         text=True, timeout=300, cwd=os.path.dirname(tests))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "(True, 1)", out.stdout[-2000:]
