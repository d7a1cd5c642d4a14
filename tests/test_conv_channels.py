"""Channel-parallel convolution (decompshard/runtime/plans/conv_channels.py): real DTensors on
simulated meshes against one device (float64), forward and backward, with the
collectives counted: a colwise or rowwise conv whose weight outweighs its activations
moves activations (Megatron's all-reduces) and never all-gathers its weight; one whose
activations outweigh its weight keeps the weight all-gather (the cheaper one).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import decompshard
from decompshard.dispatch_modes.comm_bytes import CommBytes
from decompshard.verify.dtensor_case import device_mesh, simulation

pytestmark = pytest.mark.usefixtures("world")
WORLD_SIZE = 4


def _pl(code: str) -> list:
    return [{"R": Replicate(), "0": Shard(0), "1": Shard(1)}[c] for c in code]


# name, mesh, (x shape, w shape, bias?), groups, placements of x, w, b (one char per mesh
# dim: R, 0 = Shard(0), 1 = Shard(1)), the output's placements, whether the weight is
# all-gathered (the cheaper plan there)
CASES = [
    ("colwise", (4,), ((2, 16, 3, 3), (32, 16, 3, 3), True), 1, ("R", "0", "0"), "1", False),
    ("colwise uneven", (4,), ((2, 16, 3, 3), (30, 16, 3, 3), True), 1, ("R", "0", "0"), "1", False),
    ("rowwise", (4,), ((2, 32, 3, 3), (16, 32, 3, 3), False), 1, ("1", "1", None), "R", False),
    ("rowwise with bias, uneven", (3,), ((2, 31, 3, 3), (16, 31, 3, 3), True), 1, ("1", "1", "R"), "R", False),
    ("rowwise, input cut locally", (4,), ((2, 32, 3, 3), (16, 32, 3, 3), False), 1, ("R", "1", None), "R", False),
    ("depthwise", (4,), ((2, 16, 5, 5), (16, 1, 3, 3), True), 16, ("1", "0", "0"), "1", False),
    ("depthwise, weight cut locally", (4,), ((2, 16, 5, 5), (16, 1, 3, 3), True), 16, ("1", "R", "R"), "1", False),
    ("2-D: batch x colwise", (2, 2), ((4, 16, 3, 3), (32, 16, 3, 3), True), 1, ("0R", "R0", "R0"), "01", False),
    ("2-D: batch x rowwise", (2, 2), ((5, 32, 3, 3), (16, 32, 3, 3), False), 1, ("01", "R1", None), "0R", False),
    ("activations outweigh the weight", (4,), ((8, 4, 12, 12), (8, 4, 1, 1), False), 1, ("R", "0", None), "R", True),
]


def _data(shapes, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    xs, ws, bias = shapes
    x = torch.randn(xs, dtype=torch.float64, generator=g)
    w = torch.randn(ws, dtype=torch.float64, generator=g)
    b = torch.randn(ws[0], dtype=torch.float64, generator=g) if bias else None
    return x, w, b


def _one_device(x, w, b, groups, cot_seed=1):
    ts = [t.clone().requires_grad_() if t is not None else None for t in (x, w, b)]
    out = F.conv2d(ts[0], ts[1], ts[2], padding=1, groups=groups)
    cot = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(cot_seed))
    out.backward(cot)
    return out.detach(), cot, [t.grad if t is not None else None for t in ts]


def _sharded(x, w, b, groups, mesh_shape, codes, cot):
    mesh = device_mesh(mesh_shape)
    with simulation(mesh.size()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = [distribute_tensor(t, mesh, _pl(c)).requires_grad_() if t is not None else None
              for t, c in zip((x, w, b), codes)]
        dcot = distribute_tensor(cot, mesh, [Replicate()] * mesh.ndim)
        with CommDebugMode() as debug, CommBytes() as comm:
            out = F.conv2d(ds[0], ds[1], ds[2], padding=1, groups=groups)
            out.backward(dcot)
        got = [out.full_tensor()] + [d.grad.full_tensor() if d is not None else None for d in ds]
        got = [dict(t._local_tensors) if t is not None else None for t in got]
        placements = tuple(out.placements)
    counts = {str(k).split(".")[-1]: v for k, v in debug.get_comm_counts().items()}
    return got, placements, counts, comm


@pytest.mark.parametrize("name,mesh_shape,shapes,groups,codes,out_code,gathers", CASES, ids=[c[0] for c in CASES])
def test_channel_parallel_conv_matches_one_device(name, mesh_shape, shapes, groups, codes, out_code, gathers):
    """Output and every gradient equal one device's on every rank; the output on the
    rule's placements (the rowwise Partial already reduced); no weight all-gather where
    the channel-parallel form pays."""
    x, w, b = _data(shapes)
    want_out, cot, want_grads = _one_device(x, w, b, groups)
    decompshard.enable()
    try:
        got, placements, counts, comm = _sharded(x, w, b, groups, mesh_shape, codes, cot)
    finally:
        decompshard.disable()
    for label, want, per_rank in zip(("out", "grad_x", "grad_w", "grad_b"), [want_out, *want_grads], got):
        if want is None:
            continue
        for rank, v in per_rank.items():
            assert v.shape == want.shape and torch.allclose(v, want, rtol=1e-10, atol=1e-10), (name, label, rank)
    assert placements == tuple(_pl(out_code)), (name, placements)
    w_gathered = counts.get("all_gather_into_tensor", 0) > 0
    assert w_gathered == gathers, (name, counts, comm.bytes_by_kind)


def test_colwise_then_rowwise_moves_one_all_reduce_each_way():
    """Megatron's pair on a 1-D mesh of 4, (x R) -> colwise -> relu -> rowwise: forward
    one all-reduce of the rowwise output, backward one of the colwise input's gradient,
    nothing else (the weights stay sharded, their gradients too)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 16, 3, 3, dtype=torch.float64, generator=g)
    w1 = torch.randn(64, 16, 3, 3, dtype=torch.float64, generator=g)
    w2 = torch.randn(16, 64, 3, 3, dtype=torch.float64, generator=g)

    def net(x, w1, w2):
        return F.conv2d(F.relu(F.conv2d(x, w1, padding=1)), w2, padding=1)

    ts = [t.clone().requires_grad_() for t in (x, w1, w2)]
    net(*ts).square().sum().backward()
    mesh = device_mesh((4,))
    decompshard.enable()
    try:
        with simulation(4), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ds = [distribute_tensor(t, mesh, p).requires_grad_()
                  for t, p in zip((x, w1, w2), ([Replicate()], [Shard(0)], [Shard(1)]))]
            with CommDebugMode() as debug, CommBytes() as comm:
                out = net(*ds)
                out.square().sum().backward()
            grads = [d.grad for d in ds]
            got = [dict(d.full_tensor()._local_tensors) for d in grads]
    finally:
        decompshard.disable()
    for t, per_rank in zip(ts, got):
        assert all(torch.allclose(v, t.grad, rtol=1e-10, atol=1e-10) for v in per_rank.values())
    assert [tuple(d.placements) for d in grads] == [(Replicate(),), (Shard(0),), (Shard(1),)]
    counts = {str(k).split(".")[-1]: v for k, v in debug.get_comm_counts().items()}
    # the two activation all-reduces (2 x 16 x 3 x 3 doubles each: the output and the
    # input have one shape); the loss is computed on the reduced, replicated output
    assert counts == {"all_reduce": 2}, counts
    assert comm.bytes == 2 * x.numel() * 8, comm.bytes_by_kind


def test_not_channel_parallel_is_left_to_the_guard():
    """A batch-sharded conv (data parallel) or a layout outside the rules (weight
    Shard(1) with a Shard(0) input) is not the plan's (its price says it does not apply):
    the op's chain goes on to the guard's path."""
    from decompshard.runtime.plans import plan_for

    mesh = device_mesh((4,))
    x, w, _ = _data(((4, 8, 3, 3), (8, 8, 3, 3), False))
    aten = torch.ops.aten
    with simulation(4):
        for xp, wp in (([Shard(0)], [Replicate()]), ([Shard(0)], [Shard(1)]), ([Replicate()], [Replicate()])):
            dx, dw = distribute_tensor(x, mesh, xp), distribute_tensor(w, mesh, wp)
            args = (dx, dw, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
            assert plan_for(aten.convolution.default).price(aten.convolution.default, args, {}) is None, (xp, wp)
    assert isinstance(dx, DTensor)


# ring traffic per rank of one collective over n ranks, from the bytes it was given (a
# gather's shard, a reduction's whole tensor): what the cost model's bytes stand for
_WIRE = {"all_reduce": lambda b, n: 2 * (n - 1) / n * b, "all_gather_into_tensor": lambda b, n: (n - 1) * b,
         "reduce_scatter_tensor": lambda b, n: (n - 1) / n * b, "all_to_all_single": lambda b, n: (n - 1) / n * b}


def _measured_wire(h: int, plans: bool) -> float:
    x, w, _ = _data(((2, 16, h, h), (32, 16, 3, 3), False))
    cot = torch.randn(2, 32, h, h, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    decompshard.enable(plans=plans)
    try:
        _, _, _, comm = _sharded(x, w, None, 1, (4,), ("R", "0", None), cot)
    finally:
        decompshard.disable()
    return sum(_WIRE[c.collective](c.bytes, 4) for c in comm.listing)


def test_the_choice_is_the_one_that_moves_less():
    """One price: the colwise plan (grad_input all-reduced) against DTensor's way (the
    weight all-gathered forward and backward), decided by the cost model's bytes. Measured
    on the collectives each way actually issues (ring traffic per rank), `enable()` takes
    the plan exactly where it moves less: a small activation (8 x 8, 11 x 11) beside the
    32 x 16 x 3 x 3 weight goes channel-parallel, a large one (16 x 16) keeps the gathers.
    At 11 x 11 the bytes each rank puts into collectives (the zoo's count) would keep the
    gathers: an all-reduce's input counts once where the ring sends it twice, a gather's
    shard once where the ring sends it n - 1 times."""
    chose = {}
    for h in (8, 11, 16):
        with_plans, without = _measured_wire(h, True), _measured_wire(h, False)
        assert with_plans <= without, (h, with_plans, without)
        chose[h] = with_plans < without
    assert chose == {8: True, 11: True, 16: False}, chose
