"""Gradient clipping across meshes (decompshard/runtime/support/clip_norms.py).

Four simulated ranks, a 2x2 mesh ('dp', 'tp'), float64 data. Parameters on the 2-D mesh,
on its 'tp' submesh and plain (a plain tensor on every rank: a LocalTensor with the same
value per rank): `get_total_norm` and `clip_grad_norm_` (foreach on and off; norms 2, 1,
inf) under `enable()` against one device's total norm and clipped gradients, on every
rank; torch alone raises on the same inputs. The all-reduces counted: one per mesh group
(the same with one parameter per mesh as with many); all parameters on one mesh: torch's
own numbers and collectives, unchanged. `disable()` puts torch's functions back.

The "torchtitan" case is FSDP2 + tensor parallel in torchtitan's order at the DTensor
level: the placements `fully_shard` on 'dp' gives a tensor-parallel block (printed from a
real one). `fully_shard` itself does not run under LocalTensorMode (its `free_storage`
stops with "Attempted to call resize_() on an invalid python storage"), so the module is
not built here.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.utils.clip_grad as clip_grad
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import decompshard
from decompshard._compat import TorchStridedShard, make_local_tensor, rank_tensors
from decompshard.verify.dtensor_case import simulation

pytestmark = pytest.mark.usefixtures("world")
RANKS = range(4)
R = Replicate()
INF = float("inf")
ORIGINALS = {
    (torch.nn.utils, "get_total_norm"): torch.nn.utils.get_total_norm,
    (torch.nn.utils, "clip_grads_with_norm_"): torch.nn.utils.clip_grads_with_norm_,
    (clip_grad, "_get_total_norm"): clip_grad._get_total_norm,
    (clip_grad, "_clip_grads_with_norm_"): clip_grad._clip_grads_with_norm_,
}

# case -> (shape, where: "2d" / "tp" / None for plain, placements) per parameter
CASES = {
    "meshes": [((6, 4), "2d", [Shard(0), Shard(1)]), ((8,), "tp", [Shard(0)]), ((5, 3), "2d", [R, Shard(0)]),
               ((4, 4), "tp", [R]), ((3, 3), None, None)],
    "tp_plain": [((8, 6), "tp", [Shard(0)]), ((6, 8), "tp", [Shard(1)]), ((6,), None, None), ((8,), None, None)],
    # FSDP2 + tensor parallel in torchtitan's order, as `fully_shard` lays a block out: the
    # norm's weights on 'dp', the column- then row-parallel weights on the 2-D mesh
    "torchtitan": [((8,), "dp", [Shard(0)]), ((8,), "dp", [Shard(0)]),
                   ((16, 8), "2d", [TorchStridedShard(0, split_factor=2), Shard(0)]),
                   ((16,), "2d", [TorchStridedShard(0, split_factor=2), Shard(0)]),
                   ((8, 16), "2d", [Shard(0), Shard(1)]), ((8,), "2d", [Shard(0), R])],
    "dp_tp_plain": [((8, 6), "tp", [Shard(0)]), ((6,), "dp", [Shard(0)]), ((4,), "dp", [R]), ((5,), None, None)],
}
ONE_MESH = {
    "2d": [((6, 4), "2d", [Shard(0), Shard(1)]), ((5, 3), "2d", [R, Shard(0)]), ((8,), "2d", [Shard(0), R])],
    "tp": [((8, 6), "tp", [Shard(0)]), ((6, 8), "tp", [Shard(1)]), ((6,), "tp", [R])],
}


@pytest.fixture(scope="module")
def meshes():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return {"2d": mesh, "tp": mesh["tp"], "dp": mesh["dp"]}


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    decompshard.disable()


def _grads(case, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [3 * torch.randn(shape, dtype=torch.float64, generator=g) for shape, _, _ in case]


def _placed(x, where, placements, meshes):
    """`x` on its mesh, or plain on every rank (a LocalTensor, the same value per rank; a
    DTensor is made from one too, so a Replicate one holds a tensor per rank)."""
    per_rank = make_local_tensor({r: x.clone() for r in RANKS})
    return per_rank if where is None else distribute_tensor(per_rank, meshes[where], placements)


def _params(case, grads, meshes):
    params = []
    for (_, where, placements), g in zip(case, grads):
        p = torch.nn.Parameter(_placed(torch.zeros_like(g), where, placements, meshes))
        p.grad = _placed(g, where, placements, meshes)
        params.append(p)
    return params


def _one_device(grads, norm_type, max_norm=1.0):
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, norm_type) for g in grads]), norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return total, [g * coef for g in grads]


def _per_rank(t):
    """Every rank's value of the whole tensor (a DTensor gathered, a LocalTensor read)."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return rank_tensors(t)


def _assert_on_every_rank(t, expected):
    values = _per_rank(t)
    assert values is not None and sorted(values) == list(RANKS)
    for r, v in values.items():
        torch.testing.assert_close(v, expected, rtol=1e-12, atol=1e-12, msg=f"rank {r}")


def _all_reduces(comm: CommDebugMode) -> int:
    return sum(n for op, n in comm.get_comm_counts().items() if "all_reduce" in str(op))


@pytest.mark.parametrize("norm_type", [2.0, 1.0, INF])
@pytest.mark.parametrize("foreach", [True, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_across_meshes_matches_one_device(meshes, name, foreach, norm_type):
    case = CASES[name]
    grads = _grads(case)
    total, clipped = _one_device(grads, norm_type)
    assert total > 1.0  # the clip scales
    with simulation(4):
        params = _params(case, grads, meshes)
        if foreach or name != "tp_plain":  # else the plain 0-dim norms are replicated onto 'tp'
            with pytest.raises(RuntimeError, match="same mesh|mixed torch.Tensor and DTensor"):
                torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, foreach=foreach)
        with pytest.raises(RuntimeError, match="same mesh|mixed torch.Tensor and DTensor"):
            torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type, foreach=foreach)
        params = _params(case, grads, meshes)  # torch's failed clip may have scaled some
        decompshard.enable()
        _assert_on_every_rank(torch.nn.utils.get_total_norm([p.grad for p in params], norm_type, foreach=foreach),
                              total)
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type, foreach=foreach)
        _assert_on_every_rank(norm, total)
        for p, expected in zip(params, clipped):
            _assert_on_every_rank(p.grad, expected)
            assert type(p.grad) is type(p)  # a DTensor stays on its mesh, a plain tensor plain


def test_nonfinite_raises_as_torch_does(meshes):
    case = CASES["tp_plain"]
    grads = _grads(case)
    grads[2][0] = math.inf
    with simulation(4):
        params = _params(case, grads, meshes)
        decompshard.enable()
        with pytest.raises(RuntimeError, match="non-finite"):
            torch.nn.utils.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
        assert math.isinf(_per_rank(torch.nn.utils.get_total_norm([p.grad for p in params]))[0])


def _count(params, norm_type):
    with CommDebugMode() as total:
        torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
    with CommDebugMode() as clip:
        torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type)
    return _all_reduces(total), _all_reduces(clip)


@pytest.mark.parametrize("norm_type", [2.0, INF])
@pytest.mark.parametrize("name", ["dp_tp_plain", "tp_plain", "meshes", "torchtitan"])
def test_one_reduction_per_mesh(meshes, name, norm_type):
    """One reduction per mesh (per mesh dim of the 2-D one, as DTensor reduces a Partial
    over an unflattened mesh: decompshard does not flatten a user's mesh); plain tensors
    none. The count is the same with one parameter per mesh as with all of them, and
    clipping adds none."""
    case = CASES[name]
    one_each: dict = {}
    for shape, where, placements in case:  # the first parameter on each mesh (sharded)
        one_each.setdefault(where, (shape, where, placements))
    expected = {"dp_tp_plain": 2, "tp_plain": 1, "meshes": 3, "torchtitan": 3}[name]
    decompshard.enable()
    with simulation(4):
        many = _count(_params(case, _grads(case), meshes), norm_type)
        few = _count(_params(list(one_each.values()), _grads(list(one_each.values())), meshes), norm_type)
    assert many == few == (expected, expected)


@pytest.mark.parametrize("foreach", [None, False])
@pytest.mark.parametrize("norm_type", [2.0, INF])
@pytest.mark.parametrize("name", sorted(ONE_MESH))
def test_one_mesh_is_torch_unchanged(meshes, name, norm_type, foreach):
    case = ONE_MESH[name]
    grads = _grads(case)
    results = []
    for on in (False, True):
        (decompshard.enable if on else decompshard.disable)()
        with simulation(4):
            params = _params(case, grads, meshes)
            with CommDebugMode() as comm:
                norm = torch.nn.utils.clip_grad_norm_(params, 1.0, norm_type, foreach=foreach)
            results.append((_all_reduces(comm), type(norm), norm.placements,
                            [_per_rank(x) for x in (norm, *(p.grad for p in params))]))
    (torch_count, torch_type, torch_placements, torch_values), mine = results
    assert mine[:3] == (torch_count, torch_type, torch_placements)
    for theirs, ours in zip(torch_values, mine[3]):
        assert all(torch.equal(theirs[r], ours[r]) for r in RANKS)
    _assert_on_every_rank(norm, _one_device(grads, norm_type)[0])


def test_plain_tensors_alone_go_to_torch():
    grads = [torch.randn(4, 3, dtype=torch.float64), torch.randn(5, dtype=torch.float64)]
    expected = torch.nn.utils.get_total_norm(grads)
    decompshard.enable()
    assert torch.equal(torch.nn.utils.get_total_norm(grads), expected)


def test_disable_puts_torch_functions_back():
    decompshard.enable()
    assert all(getattr(table, name) is not original for (table, name), original in ORIGINALS.items())
    assert torch.nn.utils.clip_grad_norm_ is clip_grad.clip_grad_norm_  # reaches the wrapped globals
    decompshard.disable()
    assert all(getattr(table, name) is original for (table, name), original in ORIGINALS.items())
