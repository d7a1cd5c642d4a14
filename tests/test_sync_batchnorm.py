"""Batch norm on a batch-sharded input (decompshard/runtime/plans/batch_norm.py): real
DTensors on simulated meshes against one device (float64), forward and backward, the
running statistics included, and the collectives counted: per-channel all-reduces only,
never an all-to-all or all-gather of the activations.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import decompshard
from decompshard.check.model import own_copies
from decompshard.dispatch_modes.comm_bytes import CommBytes
from decompshard.verify.dtensor_case import device_mesh, simulation

pytestmark = pytest.mark.usefixtures("world")
WORLD_SIZE = 4

aten = torch.ops.aten
C = 6

# (mesh shape, the input's placements, batch rows): even, uneven, a rank with no row, 2-D
CASES = [
    ((2,), "S", 6),
    ((3,), "S", 7),  # 3, 3, 1
    ((4,), "S", 5),  # 2, 2, 1, 0
    ((2, 2), "SR", 6),
    ((2, 2), "RS", 5),
    ((2, 2), "SS", 7),
    ((2, 2), "SC", 6),  # channels sharded on the other mesh dim (after a column-parallel conv)
    ((2, 2), "CS", 5),
]


def _placements(code: str) -> list:
    return [{"S": Shard(0), "C": Shard(1), "R": Replicate()}[c] for c in code]


def _full(t) -> dict[int, torch.Tensor]:
    t = t.full_tensor() if isinstance(t, DTensor) else t
    return {r: v.detach().clone() for r, v in t._local_tensors.items()}


def _data(n: int, seed: int = 0) -> tuple[torch.nn.BatchNorm2d, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    bn = torch.nn.BatchNorm2d(C).double()
    with torch.no_grad():
        bn.weight.copy_(torch.randn(C, dtype=torch.float64, generator=g))
        bn.bias.copy_(torch.randn(C, dtype=torch.float64, generator=g))
        bn.running_mean.copy_(torch.randn(C, dtype=torch.float64, generator=g))
        bn.running_var.copy_(torch.rand(C, dtype=torch.float64, generator=g) + 0.5)
    x = 3 + 2 * torch.randn(n, C, 4, 3, dtype=torch.float64, generator=g)
    cot = torch.randn(n, C, 4, 3, dtype=torch.float64, generator=g)
    return bn, x, cot


def _one_device(bn, x, cot, train: bool) -> dict[str, torch.Tensor]:
    m = bn.__class__(C).double()
    m.load_state_dict(bn.state_dict())
    m.train(train)
    xi = x.clone().requires_grad_()
    out = m(xi)
    out.backward(cot)
    return {"out": out.detach(), "grad_input": xi.grad, "grad_weight": m.weight.grad, "grad_bias": m.bias.grad,
            "running_mean": m.running_mean, "running_var": m.running_var}


def _sharded(bn, x, cot, mesh_shape, code: str, train: bool):
    """The same step on DTensors: (values per rank by name, collective counts, bytes)."""
    import copy

    mesh = device_mesh(mesh_shape)
    n = mesh.size()
    rep = [Replicate()] * mesh.ndim
    m = copy.deepcopy(bn)
    m.train(train)
    with simulation(n), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in ("weight", "bias"):
            setattr(m, name, torch.nn.Parameter(distribute_tensor(getattr(m, name).detach(), mesh, rep)))
        for name in ("running_mean", "running_var", "num_batches_tracked"):
            m._buffers[name] = own_copies(distribute_tensor(m._buffers[name], mesh, rep), n)
        dx = distribute_tensor(x, mesh, _placements(code)).requires_grad_()
        dcot = distribute_tensor(cot, mesh, _placements(code))
        with CommDebugMode() as debug, CommBytes() as comm:
            out = m(dx)
            out.backward(dcot)
        placements = {"out": tuple(out.placements), "grad_input": tuple(dx.grad.placements)}
        got = {"out": _full(out), "grad_input": _full(dx.grad), "grad_weight": _full(m.weight.grad),
               "grad_bias": _full(m.bias.grad), "running_mean": _full(m.running_mean),
               "running_var": _full(m.running_var)}
    counts = {str(k).split(".")[-1]: v for k, v in debug.get_comm_counts().items()}
    return got, placements, counts, comm.bytes


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("mesh_shape,code,n", CASES, ids=[f"{'x'.join(map(str, s))}-{c}-{n}" for s, c, n in CASES])
def test_batch_norm_on_a_batch_sharded_input(mesh_shape, code, n, train):
    """Output, grad_input, grad_weight, grad_bias and the running statistics equal one
    device's on every rank; the output and grad_input stay on the input's placements; the
    only collectives are all-reduces of per-channel size (training), none at all (eval)."""
    bn, x, cot = _data(n)
    want = _one_device(bn, x, cot, train)
    decompshard.enable()
    try:
        got, placements, counts, nbytes = _sharded(bn, x, cot, mesh_shape, code, train)
    finally:
        decompshard.disable()
    for name, w in want.items():
        for rank, v in got[name].items():
            assert torch.allclose(v, w, rtol=1e-10, atol=1e-10), (name, rank, float((v - w).abs().max()))
    assert placements == {"out": tuple(_placements(code)), "grad_input": tuple(_placements(code))}
    sharded_dims, channel_shards = code.count("S"), 2 ** code.count("C")
    local_c = C // channel_shards
    if train:
        # forward: the sums and the centred squares (C each); backward: both sums (2C); per
        # mesh dim that shards the batch, at this rank's channels; where the channels are
        # sharded, the running statistics' update gathered (2C / shards)
        gathered = 2 * local_c * 8 if channel_shards > 1 else 0
        assert set(counts) == ({"all_reduce", "all_gather_into_tensor"} if gathered else {"all_reduce"}), counts
        assert nbytes == sharded_dims * 4 * local_c * 8 + gathered, (nbytes, counts)
    else:  # the parameter gradients leave as partial sums; the step's own all-reduce is not in this op
        assert counts.get("all_to_all", 0) == counts.get("all_gather_into_tensor", 0) == 0, counts
        assert nbytes <= sharded_dims * 2 * local_c * 8, (nbytes, counts)


def test_the_plan_runs_with_the_guard_off():
    """Plans are performance, the guard correctness, switched apart: with
    `enable(guard_native=False)` the batch-sharded plan still runs (the per-channel
    all-reduces and nothing else), every number one device's, running statistics too."""
    bn, x, cot = _data(6)
    want = _one_device(bn, x, cot, True)
    decompshard.enable(guard_native=False)
    try:
        got, placements, counts, nbytes = _sharded(bn, x, cot, (2,), "S", True)
    finally:
        decompshard.disable()
    assert set(counts) == {"all_reduce"}, counts
    assert nbytes == 4 * C * 8, nbytes
    assert placements == {"out": (Shard(0),), "grad_input": (Shard(0),)}
    for name, w in want.items():
        assert all(torch.allclose(v, w, rtol=1e-10, atol=1e-10) for v in got[name].values()), name


def test_without_the_plan_the_activations_move():
    """The comparison the plan exists for: DTensor's own batch norm (plans off, the guard
    writing its running statistics back) moves the activations (all-to-all / all-gather)
    on the same case, and gets the same numbers."""
    bn, x, cot = _data(6)
    want = _one_device(bn, x, cot, True)
    decompshard.enable(plans=False)
    try:
        got, _, counts, nbytes = _sharded(bn, x, cot, (2,), "S", True)
    finally:
        decompshard.disable()
    assert set(counts) - {"all_reduce"}, counts
    assert nbytes > 4 * C * 8
    for name in want:
        assert all(torch.allclose(v, want[name]) for v in got[name].values()), name


def test_tiny_activations_keep_dtensors_plan():
    """Priced from global shapes: a [2, C] input on 2 ranks (C numbers per rank) moves less
    as DTensor moves it than by all-reducing 2C statistics: the call goes to DTensor's
    path (the guard writing the running statistics back where it moves them), still one
    device's numbers."""
    from decompshard.runtime.plans.batch_norm import forward_price, layout_of

    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, dtype=torch.float64, generator=g)
    w, b = torch.randn(16, dtype=torch.float64, generator=g), torch.randn(16, dtype=torch.float64, generator=g)
    rm, rv = torch.zeros(16, dtype=torch.float64), torch.ones(16, dtype=torch.float64)
    want_stats = [rm.clone(), rv.clone()]
    want = aten.native_batch_norm.default(x, w, b, *want_stats, True, 0.1, 1e-5)
    mesh = device_mesh((2,))
    rep = [Replicate()]
    decompshard.enable()
    try:
        with simulation(2), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dx = distribute_tensor(x, mesh, [Shard(0)])
            per = [distribute_tensor(t, mesh, rep) for t in (w, b)]
            stats = [own_copies(distribute_tensor(t, mesh, rep), 2) for t in (rm, rv)]
            layout = layout_of(dx, per + stats)
            assert layout is not None and layout.batch == (0,)
            call = (dx, *per, *stats, True, 0.1, 1e-5)
            priced = forward_price(aten.native_batch_norm.default, call, {})
            assert priced.against.bytes_moved < priced.cost.bytes_moved
            assert not priced.taken(aten.native_batch_norm.default, call, {})
            out = aten.native_batch_norm.default(dx, *per, *stats, True, 0.1, 1e-5)
            assert tuple(out[0].placements) != (Shard(0),)  # DTensor's strategy, not the batch-sharded plan
            fulls = [_full(o) for o in out] + [_full(s) for s in stats]
    finally:
        decompshard.disable()
    for f, w_ in zip(fulls, [*want, *want_stats]):
        assert all(torch.allclose(v, w_) for v in f.values())


def test_layouts_not_taken():
    """Layouts the plan does not cover go to DTensor's own strategy unchanged: no batch
    sharding (tensor parallel's channels), a per-channel tensor sharded where the input's
    channels are not, a partial input."""
    from torch.distributed.tensor import Partial

    from decompshard.runtime.plans.batch_norm import layout_of

    mesh = device_mesh((2,))
    with simulation(2):
        w = distribute_tensor(torch.randn(C), mesh, [Replicate()])
        assert layout_of(distribute_tensor(torch.randn(4, C, 2, 2), mesh, [Shard(1)]), [w]) is None
        xs = distribute_tensor(torch.randn(4, C, 2, 2), mesh, [Shard(0)])
        assert layout_of(xs, [distribute_tensor(torch.randn(C), mesh, [Shard(0)])]) is None
        assert layout_of(xs, [w, None]).batch == (0,)
        xp = DTensor.from_local(torch.randn(4, C, 2, 2), mesh, [Partial()])
        assert layout_of(xp, [w]) is None
