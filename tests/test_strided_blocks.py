"""Packed projections kept sharded (decompshard/runtime/steering/strided_blocks.py): split of a
`_StridedShard(d, k)` into its blocks and cat of equal `Shard(d)` blocks back, on
simulated ranks against one device, forward and backward, with the output placements
and the collectives counted; every layout the rule does not compute exactly (an uneven
block, a split across blocks, pieces of unequal size) gets DTensor's own answer."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

import decompshard
from decompshard.runtime.support.kwarg_routing import sharding_overrides
from decompshard.dispatch_modes.comm_bytes import CommBytes
from decompshard.verify.dtensor_case import device_mesh, make_dtensor, simulation

WORLD_SIZE = 4
pytestmark = pytest.mark.usefixtures("world")
R = Replicate()


def _t(*shape, seed):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _same(dt, want) -> bool:
    return all(torch.allclose(v, want, rtol=1e-12, atol=1e-12) for v in dt.full_tensor()._local_tensors.values())


@contextlib.contextmanager
def _on_mesh(on: bool, mesh_shape):
    """A simulated mesh with decompshard enabled (or not), disabled again after."""
    (decompshard.enable if on else decompshard.disable)()
    try:
        with simulation(math.prod(mesh_shape)), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield device_mesh(mesh_shape)
    finally:
        decompshard.disable()


def _packed(x, w, split):
    """A packed projection's use: split into pieces, each scaled by its own weight (so
    every piece's gradient is sharded like the piece), then joined again."""
    pieces = split(x)
    return torch.cat([p * w[i] for i, p in enumerate(pieces)], dim=-1), pieces


def _run(on: bool, mesh_shape, placements, shape, split, pieces_count):
    """(output, pieces, input gradient, forward CommBytes, backward CommBytes), checked
    against one device on every rank."""
    x, w, cot = _t(*shape, seed=1), _t(pieces_count, seed=2), _t(*shape, seed=3)
    ref = x.clone().requires_grad_(True)
    want, want_pieces = _packed(ref, w, split)
    want.backward(cot)
    with _on_mesh(on, mesh_shape) as mesh:
        xd = make_dtensor(x, mesh, placements, 0, 0).detach().requires_grad_(True)
        wd = make_dtensor(w, mesh, [R] * len(mesh_shape), 0, 1)
        cd = make_dtensor(cot, mesh, placements, 0, 2)
        with CommBytes() as fwd:
            out, pieces = _packed(xd, wd, split)
        with CommBytes() as bwd:
            out.backward(cd)  # not (out * cd).sum(): torch alone gathers cd for `R * _S` there
        assert _same(out, want.detach())
        assert all(_same(p, q.detach()) for p, q in zip(pieces, want_pieces))
        assert _same(xd.grad, ref.grad)
        return out, pieces, xd.grad, fwd, bwd


@pytest.mark.parametrize("n", [2, 3])
def test_split_into_blocks_and_cat_back_move_nothing(n):
    """_S(1, 3) of [5, 6n] on n ranks: q, k, v pieces Shard(1), their cat _S(1, 3), the
    gradient (cat of the pieces' Shard(1) gradients) _S(1, 3), with no collective."""
    strided = _StridedShard(1, split_factor=3)
    out, pieces, grad, fwd, bwd = _run(True, (n,), [strided], (5, 6 * n), lambda x: x.split(2 * n, 1), 3)
    assert [tuple(p.placements) for p in pieces] == [(Shard(1),)] * 3
    assert tuple(out.placements) == (strided,)
    assert tuple(grad.placements) == (strided,)
    assert fwd.count == 0 and bwd.count == 0, (fwd.listing, bwd.listing)
    *_, t_fwd, t_bwd = _run(False, (n,), [strided], (5, 6 * n), lambda x: x.split(2 * n, 1), 3)
    assert t_fwd.count + t_bwd.count > 0  # torch alone gathers the blocks


def test_chunk_of_strided_shard_on_two_d_mesh_keeps_the_other_mesh_dim():
    """Mixtral's gate_up on (data, tensor) parallel: [4, 8] (S(0), _S(1, 2)) chunked in
    two: each half (S(0), S(1)), no collective either way."""
    placements = [Shard(0), _StridedShard(1, split_factor=2)]
    out, pieces, grad, fwd, bwd = _run(True, (2, 2), placements, (4, 8), lambda x: x.chunk(2, -1), 2)
    assert [tuple(p.placements) for p in pieces] == [(Shard(0), Shard(1))] * 2
    assert tuple(out.placements) == tuple(placements) and tuple(grad.placements) == tuple(placements)
    assert fwd.count == 0 and bwd.count == 0, (fwd.listing, bwd.listing)


def test_split_into_groups_of_blocks_keeps_them_strided():
    """_S(1, 4) of [3, 16] split in two halves: each half holds two blocks, _S(1, 2)."""
    out, pieces, _, fwd, _ = _run(True, (2,), [_StridedShard(1, split_factor=4)], (3, 16),
                                  lambda x: x.split(8, 1), 2)
    assert [tuple(p.placements) for p in pieces] == [(_StridedShard(1, split_factor=2),)] * 2
    assert fwd.listing == [] or all(c.op != "aten.split.Tensor" for c in fwd.listing)


def test_equal_split_with_sizes_is_local_too():
    _, pieces, _, fwd, _ = _run(True, (2,), [_StridedShard(1, split_factor=2)], (3, 8),
                                lambda x: x.split([4, 4], 1), 2)
    assert [tuple(p.placements) for p in pieces] == [(Shard(1),)] * 2
    assert all(c.op != "aten.split_with_sizes.default" for c in fwd.listing), fwd.listing


@pytest.mark.parametrize("shape, split, count", [
    ((3, 6), lambda x: x.split(3, 1), 2),        # blocks of 3 on 2 ranks: uneven
    ((3, 8), lambda x: x.split(2, 1), 4),        # 4 pieces of 2 blocks: a split across blocks
    ((3, 8), lambda x: x.split([4, 2, 2], 1), 3),  # pieces of unequal size
])
def test_layouts_the_rule_does_not_compute_get_torchs_answer(shape, split, count):
    """Same numbers, placements and collectives as torch alone."""
    placements = [_StridedShard(1, split_factor=2)]
    mine = _run(True, (2,), placements, shape, split, count)
    theirs = _run(False, (2,), placements, shape, split, count)
    assert [tuple(p.placements) for p in mine[1]] == [tuple(p.placements) for p in theirs[1]]
    assert [(c.op, c.collective) for c in mine[3].listing] == [(c.op, c.collective) for c in theirs[3].listing]


def test_disable_removes_the_overrides():
    aten = torch.ops.aten
    decompshard.enable()
    try:
        assert {aten.split.Tensor, aten.cat.default, aten.slice.Tensor, aten.mm.default} <= set(sharding_overrides())
    finally:
        decompshard.disable()
    assert sharding_overrides() == {}


def test_the_override_runs_once_per_op_schema_then_dtensors_cache_answers():
    """The point of deciding in the propagator, not in an op handler: later calls of the
    same schema take DTensor's cached answer (its C++ fast path), local size included."""
    calls = []
    decompshard.enable()
    try:
        table = sharding_overrides()
        own = table[torch.ops.aten.split.Tensor]
        table[torch.ops.aten.split.Tensor] = lambda schema, sharding: calls.append(1) or own(schema, sharding)
        x = _t(3, 8, seed=6)
        with simulation(2), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            xd = make_dtensor(x, device_mesh((2,)), [_StridedShard(1, split_factor=2)], 0, 0)
            for _ in range(3):
                a, b = xd.split(4, 1)
                assert _same(a, x[:, :4]) and _same(b, x[:, 4:]) and a.placements == (Shard(1),)
    finally:
        decompshard.disable()
    assert len(calls) == 1


def _mm(on: bool, mesh_shape, pa, pw, a_shape, w_shape):
    """(output placements, collectives) of a @ w, its numbers checked on every rank."""
    a, w = _t(*a_shape, seed=4), _t(*w_shape, seed=5)
    with _on_mesh(on, mesh_shape) as mesh:
        ad, wd = make_dtensor(a, mesh, pa, 0, 0), make_dtensor(w, mesh, pw, 0, 1)
        with CommBytes() as comm:
            out = torch.mm(ad, wd)
        assert _same(out, a @ w)
        return tuple(out.placements), [c.collective for c in comm.listing]


@pytest.mark.parametrize("mesh_shape, pa", [((2,), [R]), ((2, 2), [Shard(0), R]), ((2, 2), [R, R])])
def test_mm_slices_a_replicated_input_to_a_strided_weight(mesh_shape, pa):
    """A column-parallel projection's input gradient (grad [6, 16] R @ w [16, 20]
    _S(0, 2)): the input sliced locally, the product Partial(sum), nothing gathered,
    where torch alone gathers w."""
    pw = [R] * (len(mesh_shape) - 1) + [_StridedShard(0, split_factor=2)]
    placements, moved = _mm(True, mesh_shape, pa, pw, (6, 16), (16, 20))
    assert placements[-1] == Partial("sum") and placements[:-1] == tuple(pa[:-1])
    assert moved == []
    assert _mm(False, mesh_shape, pa, pw, (6, 16), (16, 20))[1] == ["all_gather_into_tensor"]


def test_mm_keeps_torchs_gather_where_the_partial_would_cost_more():
    """[40, 8] @ [8, 20]: all-reducing the [40, 20] product later moves more than
    gathering the [8, 20] weight now."""
    args = ((2,), [R], [_StridedShard(0, split_factor=2)], (40, 8), (8, 20))
    assert _mm(True, *args) == _mm(False, *args)
