"""Plans with small collectives inside an op (decompshard/runtime/plans/):
softmax / log_softmax over a sharded dim, vocab-parallel nll_loss / cross-entropy, layer
norm over a sharded hidden dim.

Real DTensors on simulated meshes (1-D of 4 and 3 ranks with uneven sizes, one with an
empty shard, a 2x2 mesh), float64, forward and backward: every output and every
gradient on every rank against one device, and CommDebugMode's counts: the activation
is never all-gathered nor all-to-all'd (torch 2.13-2.15 alone all-gather it in each of
these cases, shown by the same case without `enable()`). A transformers Llama with a
vocab-sharded lm_head trains one step like one device without gathering its logits.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import decompshard
from decompshard._compat import custom_op_handlers
from decompshard.verify.dtensor_case import device_mesh, simulation

WORLD_SIZE = 4
R = Replicate()
MOVES_ACTIVATIONS = ("all_gather_into_tensor", "all_to_all_single", "all_to_all")
pytestmark = pytest.mark.usefixtures("world")


def _comms(mode: CommDebugMode) -> dict[str, int]:
    return {getattr(k, "__name__", str(k)): v for k, v in mode.get_comm_counts().items() if v}


def _step(fn, inputs: list, placements: list, mesh, seed: int = 0, n_grad: int | None = None):
    """fn on one device and on DTensors (the first `n_grad` floating inputs, all by
    default, get gradients; the output's gradient is random): (outputs ok, gradients ok,
    collectives, output placements)."""
    g = torch.Generator().manual_seed(seed)
    n_grad = len(inputs) if n_grad is None else n_grad
    ref_in = [x.clone().requires_grad_(x.is_floating_point() and i < n_grad) for i, x in enumerate(inputs)]
    want = fn(*ref_in)
    gout = torch.randn(want.shape, dtype=want.dtype, generator=g)
    want.backward(gout)
    with simulation(mesh.size()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d_in = [distribute_tensor(x, mesh, pl) for x, pl in zip(inputs, placements)]
        for d, r in zip(d_in, ref_in):
            d.requires_grad_(r.requires_grad)
        with CommDebugMode() as comm:
            out = fn(*d_in)
        d_gout = distribute_tensor(gout, mesh, [R] * mesh.ndim).redistribute(mesh, out.placements)
        with CommDebugMode() as back:
            out.backward(d_gout)
        got = out.full_tensor()._local_tensors.values()
        out_ok = all(torch.allclose(v, want.detach(), rtol=1e-10, atol=1e-12) for v in got)
        grads_ok = all(
            all(torch.allclose(v, r.grad, rtol=1e-10, atol=1e-12) for v in d.grad.full_tensor()._local_tensors.values())
            for d, r in zip(d_in, ref_in) if r.grad is not None)
        counts = _comms(comm)
        for k, v in _comms(back).items():
            counts[k] = counts.get(k, 0) + v
        return out_ok, grads_ok, counts, tuple(out.placements)


@pytest.fixture()
def enabled():
    decompshard.enable()
    yield
    decompshard.disable()


def _x(*shape, seed=1):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


# (mesh, input shape, input placements): even, uneven, an empty shard (5 on 4), 2-D
SOFTMAX_LAYOUTS = [
    ((4,), (6, 16), [Shard(1)]),
    ((3,), (5, 7), [Shard(1)]),
    ((4,), (6, 5), [Shard(1)]),
    ((4,), (2, 6, 10), [Shard(2)]),
    ((2, 2), (5, 9), [Shard(0), Shard(1)]),
]


@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("layout", SOFTMAX_LAYOUTS, ids=lambda v: f"{v[0]}-{v[1]}")
def test_softmax_over_sharded_dim(enabled, layout, log):
    mesh_shape, shape, pl = layout
    fn = (lambda a: a.log_softmax(-1)) if log else (lambda a: a.softmax(-1))
    out_ok, grads_ok, comms, placements = _step(fn, [_x(*shape)], [pl], device_mesh(mesh_shape))
    assert out_ok and grads_ok
    assert not any(k in comms for k in MOVES_ACTIVATIONS), comms
    assert placements == tuple(pl)  # the output stays sharded on the softmax dim
    # forward: all-reduce(max) and all-reduce(sum) of one number per row; backward: one sum
    assert comms.get("all_reduce") == 3, comms


def test_softmax_gathered_without_enable():
    """The same case under torch alone gathers the input (what the plan avoids)."""
    out_ok, grads_ok, comms, _ = _step(lambda a: a.softmax(-1), [_x(6, 16)], [[Shard(1)]], device_mesh((4,)))
    assert out_ok and grads_ok and comms.get("all_gather_into_tensor"), comms


def test_plan_declines_where_it_moves_more(enabled):
    """Softmax over an outer dim of two on 2 ranks: gathering it (no local copy, the
    dim is outermost) moves fewer bytes than two all-reduces of one number per column,
    so DTensor's strategy runs (and is right)."""
    out_ok, grads_ok, comms, placements = _step(lambda a: a.softmax(0), [_x(2, 64)], [[Shard(0)]],
                                                device_mesh((2,)))
    assert out_ok and grads_ok
    assert comms.get("all_gather_into_tensor"), comms


def test_dim_not_sharded_goes_to_dtensor(enabled):
    out_ok, grads_ok, comms, placements = _step(lambda a: a.softmax(0), [_x(6, 16)], [[Shard(1)]],
                                                device_mesh((4,)))
    assert out_ok and grads_ok and comms == {} and placements == (Shard(1),)


# ------------------------------------------------------------------ vocab-parallel loss

WEIGHT = torch.rand(16, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.1
# (mesh, rows, classes, logits placements, target placements)
LOSS_LAYOUTS = [
    ((4,), 6, 16, [Shard(1)], [R]),
    ((3,), 5, 7, [Shard(1)], [R]),  # uneven vocab
    ((2, 2), 8, 9, [Shard(0), Shard(1)], [Shard(0), R]),  # dp x tp
    ((2, 2), 5, 9, [Shard(0), Shard(1)], [Shard(0), R]),  # uneven batch
    ((2, 2), 6, 9, [Shard(1), Shard(0)], [R, Shard(0)]),  # tp first
]


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no-guard"])
@pytest.mark.parametrize("kwargs", [{}, {"weight": WEIGHT}, {"reduction": "sum"}, {"reduction": "none"},
                                    {"reduction": "none", "weight": WEIGHT}],
                         ids=["mean", "weighted-mean", "sum", "none", "weighted-none"])
@pytest.mark.parametrize("layout", LOSS_LAYOUTS, ids=lambda v: f"{v[0]}-{v[1]}x{v[2]}-{v[3]}")
def test_cross_entropy_vocab_sharded(layout, kwargs, guard):
    mesh_shape, n, c, xpl, tpl = layout
    mesh = device_mesh(mesh_shape)
    target = torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(2))
    target[1] = -100  # an ignored row
    kw = dict(kwargs)
    weight = kw.pop("weight", None)
    tensors, placements = [_x(n, c), target], [xpl, tpl]
    if weight is not None:
        tensors.append(weight[:c])
        placements.append([R] * mesh.ndim)

    def fn(x, t, *w):
        return F.cross_entropy(x, t, *w, **kw)

    decompshard.enable(guard_native=guard)
    try:
        out_ok, grads_ok, comms, placements = _step(fn, tensors, placements, mesh, n_grad=1)
    finally:
        decompshard.disable()
    assert out_ok and grads_ok
    assert not any(k in comms for k in MOVES_ACTIVATIONS), comms


def test_nll_loss_after_log_softmax_and_2d_images(enabled):
    """nll_loss on log_softmax's output, and the 2-D (image) loss over a class-sharded dim 1."""
    mesh = device_mesh((4,))
    t = torch.randint(0, 8, (6,), generator=torch.Generator().manual_seed(4))
    ok = _step(lambda x, t: F.nll_loss(x.log_softmax(1), t), [_x(6, 8), t], [[Shard(1)], [R]], mesh)
    assert ok[0] and ok[1] and not any(k in ok[2] for k in MOVES_ACTIVATIONS), ok
    t2 = torch.randint(0, 8, (2, 3, 3), generator=torch.Generator().manual_seed(5))
    ok = _step(lambda x, t: F.cross_entropy(x, t), [_x(2, 8, 3, 3), t2], [[Shard(1)], [R]], mesh)
    assert ok[0] and ok[1] and not any(k in ok[2] for k in MOVES_ACTIVATIONS), ok


def test_guard_switch_keeps_the_plan():
    """enable(guard) after enable(no guard) and back: the nll_loss slot holds a handler
    that tries the plan either way, and disable() leaves DTensor's table as it was."""
    from torch.distributed.tensor import DTensor

    op = torch.ops.aten.nll_loss_forward.default
    before = dict(custom_op_handlers())
    for guard in (False, True, False):
        decompshard.enable(guard_native=guard)
        assert getattr(custom_op_handlers().get(op), "__wrapped__", None) is not None, guard
    decompshard.disable()
    assert custom_op_handlers() == before and DTensor._op_dispatcher._custom_op_handlers is custom_op_handlers()


# ------------------------------------------------------------------ layer norm

# (mesh, shape, normalized shape, input placements, weight placements)
NORM_LAYOUTS = [
    ((4,), (6, 16), (16,), [Shard(1)], [R]),
    ((4,), (6, 16), (16,), [Shard(1)], [Shard(0)]),
    ((3,), (5, 7), (7,), [Shard(1)], [R]),
    ((4,), (2, 3, 5), (5,), [Shard(2)], [R]),  # an empty shard
    ((4,), (2, 3, 10), (3, 10), [Shard(2)], [R]),  # two normalized dims
    ((2, 2), (5, 9), (9,), [Shard(0), Shard(1)], [R, Shard(0)]),
]


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
@pytest.mark.parametrize("layout", NORM_LAYOUTS, ids=lambda v: f"{v[0]}-{v[1]}-{v[4]}")
def test_layer_norm_over_sharded_hidden(enabled, layout, affine):
    mesh_shape, shape, ns, xpl, wpl = layout
    mesh = device_mesh(mesh_shape)
    if affine:
        fn = lambda x, w, b: F.layer_norm(x, ns, w, b)  # noqa: E731
        tensors, pls = [_x(*shape), _x(*ns, seed=2), _x(*ns, seed=3)], [xpl, wpl, wpl]
    else:
        fn = lambda x: F.layer_norm(x, ns)  # noqa: E731
        tensors, pls = [_x(*shape)], [xpl]
    out_ok, grads_ok, comms, placements = _step(fn, tensors, pls, mesh)
    assert out_ok and grads_ok
    assert not any(k in comms for k in MOVES_ACTIVATIONS), comms
    assert placements == tuple(xpl)
    assert comms.get("all_reduce") == 3, comms  # forward: sum, squared deviations; backward: both sums at once


def test_layer_norm_gathered_without_enable():
    out_ok, grads_ok, comms, _ = _step(lambda x: F.layer_norm(x, (16,)), [_x(6, 16)], [[Shard(1)]],
                                       device_mesh((4,)))
    assert out_ok and grads_ok and comms.get("all_gather_into_tensor"), comms


# ------------------------------------------------------------------ a real model


LOSS_OPS = ("aten._log_softmax.default", "aten._log_softmax_backward_data.default",
            "aten.nll_loss_forward.default", "aten.nll_loss_backward.default")


@pytest.mark.parametrize("sharding", ["tp", "2d"])
def test_llama_vocab_sharded_lm_head_keeps_logits_sharded(sharding, monkeypatch):
    """transformers' Llama, lm_head column-parallel (logits Shard(-1) on the vocab):
    one training step matches one device; the loss ops (log_softmax, nll_loss and their
    backward) issue only all-reduces of at most one number per token, and no all-gather
    (torch alone all-gathers the logits at log_softmax)."""
    pytest.importorskip("transformers")
    from torch.distributed.tensor import DTensor

    from decompshard.check.model import SHARDINGS, run_training_step
    from decompshard.check.zoo import SEQ, ZOO, build
    from decompshard.dispatch_modes import comm_bytes

    built = build(ZOO["llama"], SHARDINGS[sharding].batch, seed=0)
    built.plan["lm_head"] = "vocab_colwise"  # torchtitan's plan; the zoo keeps transformers' own
    seen: list[tuple[str, str, int]] = []  # (collective, the DTensor op issuing it, elements)
    in_flight = ["?"]
    dispatch = comm_bytes.CommBytes.__torch_dispatch__

    def attributed(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            in_flight[0] = str(func)
        elif getattr(func, "_overloadpacket", None) in self.registry:
            seen.append((func._overloadpacket.__name__, in_flight[0], args[0].numel()))
        return dispatch(self, func, types, args, kwargs)

    monkeypatch.setattr(comm_bytes.CommBytes, "__torch_dispatch__", attributed)
    run = run_training_step(built, sharding, enable=True)
    assert run.verdict == "OK", f"{run.op}: {run.detail}"
    loss_comms = [c for c in seen if c[1] in LOSS_OPS]
    assert {c[1] for c in loss_comms} >= {"aten._log_softmax.default", "aten.nll_loss_forward.default"}, seen
    tokens = SHARDINGS[sharding].batch * SEQ
    assert all(kind == "all_reduce" and n <= tokens for kind, _, n in loss_comms), loss_comms
