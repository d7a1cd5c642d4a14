"""index_put with accumulate=True into a Partial(sum) (runtime/plans/index_put.py): each
rank adds the values of its own tokens; the result is reduced once where it is read.

The expert's pattern is the backward of `weight[idx]` (transformers' Mixtral with
`experts_implementation="batched_mm"`): `new_zeros` then `index_put(accumulate=True)`
with the index and the values sharded on the tokens. Real DTensors on simulated meshes
(1-D of 4, 1-D of 3 with uneven token shards, 2x2 with the weight sharded on a trailing
dim too), float64, forward and backward, every rank against one device; random
placements (Partial included) through the check's own runner; in place only where
`self` keeps its placements.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import decompshard
from decompshard.runtime.enable import switched
from decompshard.verify.ranks import per_rank_values
from decompshard.verify.dtensor_case import device_mesh, random_placements, run_case, simulation
from test_collective_plans import MOVES_ACTIVATIONS, _x

WORLD_SIZE = 8
R = Replicate()
aten = torch.ops.aten
pytestmark = pytest.mark.usefixtures("world")

IDX = torch.tensor([0, 3, 1, 1, 2, 0, 3, 3, 2, 1, 0])  # 11 tokens: repeats, uneven on 3 and 4 ranks


@pytest.fixture()
def enabled():
    decompshard.enable()
    yield
    decompshard.disable()


def _experts(w, idx, h):
    """Each token's expert weight picked by index, then a batched matmul (batched_mm)."""
    return torch.bmm(w[idx], h.unsqueeze(-1)).squeeze(-1)


def _comms(mode: CommDebugMode) -> dict[str, int]:
    return {getattr(k, "__name__", str(k)): v for k, v in mode.get_comm_counts().items() if v}


def _train(fn, inputs, placements, mesh, seed=0):
    """fn forward and backward (a random cotangent, as a Replicate DTensor multiplied in)
    on one device and on DTensors: (output ok, gradients ok, backward collectives,
    the gradients' placements)."""
    g = torch.Generator().manual_seed(seed)
    ref = [x.clone().requires_grad_(x.is_floating_point()) for x in inputs]
    want = fn(*ref)
    cot = torch.randn(want.shape, dtype=want.dtype, generator=g)
    (want * cot).sum().backward()
    with simulation(mesh.size()):
        d = [distribute_tensor(x, mesh, pl).requires_grad_(x.is_floating_point()) for x, pl in zip(inputs, placements)]
        out = fn(*d)
        loss = (out * distribute_tensor(cot, mesh, [R] * mesh.ndim)).sum()
        with CommDebugMode() as back:
            loss.backward()
        out_ok = all(torch.allclose(v, want.detach(), rtol=1e-10, atol=1e-12)
                     for v in out.full_tensor()._local_tensors.values())
        grads_ok = all(all(torch.allclose(v, r.grad, rtol=1e-10, atol=1e-12)
                           for v in x.grad.full_tensor()._local_tensors.values())
                       for x, r in zip(d, ref) if r.grad is not None)
        return out_ok, grads_ok, _comms(back), tuple(d[0].grad.placements)


# (mesh, weight placements, index and token placements)
EXPERT_LAYOUTS = [
    ((4,), [R], [Shard(0)]),
    ((3,), [R], [Shard(0)]),  # 11 tokens on 3 ranks: 4, 4, 3
    ((2, 2), [R, Shard(1)], [Shard(0), R]),  # dp x tp, the expert's output dim sharded
    ((2, 2), [R, Shard(2)], [Shard(0), R]),  # its input dim sharded: the tokens' hidden too
]


@pytest.mark.parametrize("layout", EXPERT_LAYOUTS, ids=lambda v: f"{v[0]}-{v[1]}")
def test_expert_gradient_partial_not_gathered(enabled, layout):
    """The weight's gradient is each rank's tokens summed into a Partial(sum) (reduced
    once, as DDP reduces it): nothing gathered or all-to-all'd in the backward."""
    mesh_shape, pw, ptok = layout
    mesh = device_mesh(mesh_shape)
    ph = [ptok[0], Shard(1)] if pw[-1] == Shard(2) else ptok
    out_ok, grads_ok, comms, grad_pl = _train(_experts, [_x(4, 8, 6), IDX, _x(11, 6, seed=2)],
                                              [pw, ptok, ph], mesh)
    assert out_ok and grads_ok
    assert not any(k in comms for k in MOVES_ACTIVATIONS), comms
    assert grad_pl[0] == Partial("sum"), grad_pl


def test_expert_gradient_gathered_without_the_plan():
    """enable(plans=False): DTensor's strategy needs the index whole and moves the values."""
    decompshard.enable(plans=False)
    try:
        out_ok, grads_ok, comms, _ = _train(_experts, [_x(4, 8, 6), IDX, _x(11, 6, seed=2)],
                                            [[R], [Shard(0)], [Shard(0)]], device_mesh((4,)))
    finally:
        decompshard.disable()
    assert out_ok and grads_ok
    assert any(k in comms for k in MOVES_ACTIVATIONS), comms


# 23 tokens (uneven on 2, 3 and 4 ranks), more than self's rows: the plan's Partial
# (an all-reduce of self's size owed) moves less than DTensor's moves of the values
TOKENS = torch.tensor([0, 3, 1, 1, 2, 0, 3, 3, 2, 1, 0, 2, 2, 3, 0, 1, 3, 0, 0, 2, 1, 3, 1])

# what the plan reads: per mesh dim, self / index / values drawn from these
_PLAN_ALPHABET = ([R, Partial("sum"), Shard(1), Shard(2)], [R, Shard(0)],
                  [R, Shard(0), Shard(1), Shard(2), Partial("sum")])


def _random_cases(n, seed, mesh_shape):
    """`n` random placement draws for index_put(self [4, 6, 5], [idx [T]], values
    [T, 6, 5], accumulate=True) (T = len(TOKENS)): half from the check's own draw (any
    Shard, Partial of any op, strided shards), half from the placements the plan reads."""
    rng = random.Random(seed)
    shapes, floating = [(4, 6, 5), (len(TOKENS),), (len(TOKENS), 6, 5)], [True, False, True]
    for i in range(n):
        if i % 2:
            yield random_placements(shapes, floating, mesh_shape, rng)
        else:
            yield tuple(tuple(rng.choice(choices) for _ in mesh_shape) for choices in _PLAN_ALPHABET)


@pytest.mark.parametrize("mesh_shape", [(4,), (3,), (2, 3)], ids=str)
@pytest.mark.parametrize("op", [aten.index_put.default, aten._index_put_impl_.default, aten.index_put_.default],
                         ids=str)
def test_random_placements_match_one_device(op, mesh_shape):
    """The check's runner: every output, written input and gradient on every rank against
    one device, for random placements; no WRONG (a loud error is DTensor's own refusal:
    an in-place op cannot move its self)."""
    seed = 7 + len(mesh_shape)
    results = []
    for placements in _random_cases(16, seed, mesh_shape):
        if op._schema.is_mutable and all(p == R for p in placements[0]):
            # the simulator's artifact, torch alone too: a Replicate DTensor's local is one
            # plain tensor for every simulated rank, and a rank's in-place write lands in a
            # per-rank copy of it (on real ranks each holds its own)
            continue
        args = (_x(4, 6, 5), [TOKENS], _x(len(TOKENS), 6, 5, seed=3), True)
        out = run_case(op, args, {}, mesh_shape, placements, seed=seed, runtime=switched(True))
        results.append((placements, out))
    wrong = [(p, o) for p, o in results if o.status == "WRONG"]
    assert not wrong, wrong
    assert sum(o.status == "ok" for _, o in results) >= (3 if op._schema.is_mutable else 8), results


@pytest.mark.parametrize("mesh_shape", [(4,), (3,), (2, 3)], ids=str)
def test_plan_forced_on_every_layout_it_takes(monkeypatch, mesh_shape):
    """Every layout of the plan's alphabet with the plan run wherever it applies (priced
    or not): out of place and in place, forward and backward, against one device."""
    import itertools

    from decompshard.runtime import collectives

    monkeypatch.setattr(collectives, "cheaper_than_dtensor", lambda *a: True)
    rng = random.Random(len(mesh_shape))
    rows = list(itertools.product(*_PLAN_ALPHABET))
    ran = 0
    for op in (aten.index_put.default, aten.index_put_.default):
        for _ in range(12):
            placements = tuple(zip(*(rng.choice(rows) for _ in mesh_shape)))
            if op._schema.is_mutable and all(p == R for p in placements[0]):
                continue  # the simulator's artifact (test_random_placements_match_one_device)
            args = (_x(4, 6, 5), [TOKENS], _x(len(TOKENS), 6, 5, seed=3), True)
            out = run_case(op, args, {}, mesh_shape, placements, runtime=switched(True))
            assert out.status != "WRONG", (op, placements, out)
            ran += out.status == "ok"
    assert ran >= 12


@pytest.mark.parametrize("self_pl,values_pl,idx_pl", [
    ([Partial("sum")], [Shard(0)], [Shard(0)]),  # a Partial buffer, tokens sharded alike
    ([Partial("sum")], [R], [R]),  # values replicated: added on the first rank only
    ([R], [Shard(0)], [Shard(0)]),  # the expert's case, out of place: Partial
    ([R], [Partial("sum")], [R]),
    ([Shard(2)], [Shard(2)], [R]),  # a trailing dim sharded alike: stays sharded
], ids=str)
def test_rows_of_the_table(enabled, self_pl, values_pl, idx_pl):
    """Each row of the plan's table, out of place, forward and backward, nothing moved
    (a Partial(sum) input made by the check's runner from random parts)."""
    args = (_x(4, 6, 5), [torch.tensor([0, 3, 1, 1, 2, 0, 3, 3, 2])], _x(9, 6, 5, seed=3), True)
    out = run_case(aten.index_put.default, args, {}, (3,), [self_pl, idx_pl, values_pl], runtime=switched(True))
    assert out.status == "ok", out


def test_replicate_self_not_relabelled_in_place(enabled):
    """In place on a Replicate `self` with sharded tokens: a write keeps `self` Replicate
    (never relabelled Partial under its aliases); the values are right on every rank."""
    mesh = device_mesh((4,))
    x, v = _x(4, 6), _x(11, 6, seed=3)
    want = x.clone().index_put_([IDX], v, accumulate=True)
    with simulation(4):
        # Replicate with a local per rank (distribute_tensor's own is one plain tensor for
        # every simulated rank, which an in-place op cannot write per rank)
        dx = distribute_tensor(x, mesh, [Shard(1)]).redistribute(mesh, [R])
        alias = dx.view(24)
        dx.index_put_([distribute_tensor(IDX, mesh, [Shard(0)])], distribute_tensor(v, mesh, [Shard(0)]),
                      accumulate=True)
        assert dx.placements == (R,)
        assert all(torch.allclose(t, want) for t in per_rank_values(dx.full_tensor(), 4).values())
        assert all(torch.allclose(t, want.view(24)) for t in per_rank_values(alias.full_tensor(), 4).values())


def test_partial_buffer_in_place_stays_partial(enabled):
    """In place into a buffer that is a Partial(sum) already (a row-parallel product):
    each rank adds its own tokens, nothing moved, `self` still Partial(sum)."""
    mesh = device_mesh((4,))
    a, b, v = _x(4, 8), _x(8, 6, seed=2), _x(11, 6, seed=3)
    want = (a @ b).index_put_([IDX], v, accumulate=True)
    with simulation(4):
        buf = distribute_tensor(a, mesh, [Shard(1)]) @ distribute_tensor(b, mesh, [Shard(0)])
        assert buf.placements == (Partial("sum"),)
        di, dv = distribute_tensor(IDX, mesh, [Shard(0)]), distribute_tensor(v, mesh, [Shard(0)])
        with CommDebugMode() as comm:
            buf.index_put_([di], dv, accumulate=True)
        assert not _comms(comm), _comms(comm)
        assert buf.placements == (Partial("sum"),)
        assert all(torch.allclose(t, want) for t in buf.full_tensor()._local_tensors.values())


def test_replicate_self_kept_exactly(enabled):
    """A Replicate `self` holding inf and NaN: whole on the first rank, zero elsewhere, so
    the reduced result is one device's exactly (DTensor's Replicate -> Partial would
    divide by the group's size)."""
    mesh = device_mesh((3,))
    x, v = _x(4, 6), _x(11, 6, seed=3)
    x[0, 0], x[1, 2], x[3, 5] = float("inf"), float("nan"), 1 / 3
    want = x.index_put([IDX], v, accumulate=True)
    with simulation(3):
        out = distribute_tensor(x, mesh, [R]).index_put(
            [distribute_tensor(IDX, mesh, [Shard(0)])], distribute_tensor(v, mesh, [Shard(0)]), accumulate=True)
        assert out.placements == (Partial("sum"),)
        for t in out.full_tensor()._local_tensors.values():
            assert torch.allclose(t, want, equal_nan=True)
            assert t[3, 5] == want[3, 5] or not (IDX == 3).any()


def test_priced_with_the_reduction_it_owes(enabled):
    """The Partial result owes an all-reduce of `self`'s size: with a large table and few
    tokens (an embedding-like gather), gathering the tokens moves less, and DTensor's
    strategy runs; with the expert's sizes the plan runs."""
    from decompshard.runtime.plans import price

    mesh = device_mesh((4,))
    op = aten.index_put.default
    with simulation(4):
        idx = distribute_tensor(torch.tensor([0, 5, 9, 2]), mesh, [Shard(0)])
        big = distribute_tensor(torch.zeros(512, 16, dtype=torch.float64), mesh, [R])
        few = distribute_tensor(_x(4, 16), mesh, [Shard(0)])
        priced, _, taken = price(op, (big, [idx], few, True), {})
        assert priced is not None and not taken
        small = distribute_tensor(torch.zeros(4, 16, 16, dtype=torch.float64), mesh, [R])
        many = distribute_tensor(_x(64, 16, 16), mesh, [Shard(0)])
        idx64 = distribute_tensor(torch.arange(64) % 4, mesh, [Shard(0)])
        priced, _, taken = price(op, (small, [idx64], many, True), {})
        assert priced is not None and taken


def test_declines_overwrite_and_broadcast(enabled):
    """accumulate=False (which duplicate wins is the kernel's) and broadcast values go to
    DTensor unchanged."""
    from decompshard.runtime.plans import price

    mesh = device_mesh((4,))
    op = aten.index_put.default
    with simulation(4):
        x = distribute_tensor(torch.zeros(4, 6, dtype=torch.float64), mesh, [R])
        idx = distribute_tensor(IDX, mesh, [Shard(0)])
        v = distribute_tensor(_x(11, 6), mesh, [Shard(0)])
        assert price(op, (x, [idx], v, False), {})[0] is None
        row = distribute_tensor(_x(6), mesh, [R])
        assert price(op, (x, [idx], row, True), {})[0] is None


# ------------------------------------------------------------------ scatter_add


def _gather_rows(w, idx, h):
    """Each token's row of a table picked by `gather` (its backward is `scatter_add`
    into a zeros buffer), times the token's activation."""
    return torch.gather(w, 0, idx) * h


@pytest.mark.parametrize("mesh_shape,pw,pidx", [((4,), [R], [Shard(0)]), ((3,), [R], [Shard(0)]),
                                                ((2, 2), [R, Shard(1)], [Shard(0), Shard(1)])], ids=str)
def test_gather_gradient_partial_not_gathered(enabled, mesh_shape, pw, pidx):
    """The backward of gather: each rank scatter-adds its own tokens' rows into a
    Partial(sum) table gradient, nothing moved."""
    mesh = device_mesh(mesh_shape)
    idx = IDX.view(-1, 1).expand(11, 6).contiguous() % 4
    out_ok, grads_ok, comms, grad_pl = _train(_gather_rows, [_x(4, 6), idx, _x(11, 6, seed=2)], [pw, pidx, pidx],
                                              mesh)
    assert out_ok and grads_ok
    assert not any(k in comms for k in MOVES_ACTIVATIONS), comms
    assert grad_pl[0] == Partial("sum"), grad_pl


_SCATTER_ALPHABET = ([R, Partial("sum"), Shard(1)], [R, Shard(0), Shard(1)], [R, Shard(0), Shard(1), Partial("sum")])


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 3)], ids=str)
def test_scatter_add_forced_and_random_match_one_device(monkeypatch, mesh_shape):
    """scatter_add(self [4, 5], 0, index [T, 5], src [T, 5]): the plan forced wherever it
    applies, and the check's own random draws, against one device."""
    import itertools

    from decompshard.runtime import collectives

    rng = random.Random(3)
    index = (TOKENS.view(-1, 1) + torch.arange(5)).remainder(4)
    args = (_x(4, 5), 0, index, _x(len(TOKENS), 5, seed=3))
    shapes, floating = [(4, 5), tuple(index.shape), tuple(index.shape)], [True, False, True]
    rows = list(itertools.product(*_SCATTER_ALPHABET))
    draws = [tuple(zip(*(rng.choice(rows) for _ in mesh_shape))) for _ in range(10)]
    draws += [random_placements(shapes, floating, mesh_shape, rng) for _ in range(6)]
    monkeypatch.setattr(collectives, "cheaper_than_dtensor", lambda *a: True)
    results = [(p, run_case(aten.scatter_add.default, args, {}, mesh_shape, p, runtime=switched(True)))
               for p in draws]
    assert not [r for r in results if r[1].status == "WRONG"], results
    assert sum(o.status == "ok" for _, o in results) >= 10, results


def _accumulated(x, idx, v):
    return x.index_put([idx], v, accumulate=True) * 1.0


def test_compiled_matches_eager(enabled):
    """Under torch.compile (fullgraph, aot_eager) the plan traces (each rank's coordinate
    read as DTensor's own _MaskPartial reads it) and gives eager's part: rank 0 holds self
    plus its own tokens (fake process group: rank 0's numbers are real where nothing moves)."""
    from torch.distributed.tensor import DTensor

    mesh = device_mesh((4,))
    x, v = _x(4, 6), _x(12, 6, seed=2)
    idx = torch.cat([IDX, IDX[:1]])  # 12 tokens, 3 a rank
    dx = DTensor.from_local(x, mesh, [R], run_check=False)
    di = DTensor.from_local(idx[:3], mesh, [Shard(0)], run_check=False, shape=idx.shape, stride=idx.stride())
    dv = DTensor.from_local(v[:3], mesh, [Shard(0)], run_check=False, shape=v.shape, stride=v.stride())
    torch._dynamo.reset()
    compiled = torch.compile(_accumulated, backend="aot_eager", fullgraph=True)(dx, di, dv)
    eager = _accumulated(dx, di, dv)
    assert compiled.placements == eager.placements == (Partial("sum"),)
    assert torch.equal(compiled.to_local(), eager.to_local())
    assert torch.allclose(eager.to_local(), x.index_put([idx[:3]], v[:3], accumulate=True), rtol=1e-12, atol=1e-12)
