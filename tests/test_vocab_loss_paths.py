"""The vocab-parallel loss on every path users take to it (issue 38 item 2).

`cross_entropy` on logits sharded on the classes (a column-parallel `lm_head`, `Shard(-1)`)
must never gather the logits or their log-probabilities, however the loss is reached:
a target that is a plain tensor under `implicit_replication()` (transformers' labels) or
a DTensor; logits upcast to float32 (`.float()`, as transformers' loss does); an
`ignore_index` of its own; class weights; `reduction` mean, sum and none; label smoothing
(which torch decomposes into log_softmax, nll_loss and a sum over the classes); the 2-D
(image) loss; with the native guard's mean-loss fence in the same handler slot.

Real DTensors on simulated meshes (1-D of 4, 1-D of 3 with an uneven vocab, 2x2 dp x
tp), forward and backward, every output and gradient on every rank against one device,
and the collectives counted: only all-reduces, none of them of a [rows, classes] tensor.
Then transformers' Llama trained through its own `labels=` loss with the lm_head
`ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)`.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication

import decompshard
from decompshard._compat import rank_tensors
from decompshard.dispatch_modes.comm_bytes import CommBytes
from decompshard.verify.dtensor_case import device_mesh, simulation

WORLD_SIZE = 4
R = Replicate()
pytestmark = pytest.mark.usefixtures("world")

WEIGHT = torch.rand(16, dtype=torch.float64, generator=torch.Generator().manual_seed(3)) + 0.1
# (mesh, rows, classes, logits placements, DTensor target placements)
LAYOUTS = [
    ((4,), 6, 16, [Shard(1)], [R]),
    ((3,), 5, 7, [Shard(1)], [R]),  # uneven vocab
    ((2, 2), 8, 9, [Shard(0), Shard(1)], [Shard(0), R]),  # dp x tp, uneven vocab
]
LOSSES = {
    "mean": {}, "sum": {"reduction": "sum"}, "none": {"reduction": "none"},
    "weighted-mean": {"weight": WEIGHT}, "weighted-none": {"weight": WEIGHT, "reduction": "none"},
    "ignore-3": {"ignore_index": 3},
    "smoothing": {"label_smoothing": 0.1},
    "smoothing-weighted-sum": {"label_smoothing": 0.2, "weight": WEIGHT, "reduction": "sum"},
    "smoothing-weighted-mean": {"label_smoothing": 0.2, "weight": WEIGHT},
    "smoothing-none": {"label_smoothing": 0.1, "reduction": "none"},
}
GATHERS = ("all_gather_into_tensor", "all_to_all_single", "all_to_all", "reduce_scatter_tensor")


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-3, atol=1e-5)
    return all(torch.allclose(v.to(want.dtype), want, **tol) for v in (rank_tensors(got) or {0: got}).values())


def _loss_step(loss_fn, x, target, weight, mesh, xpl, tpl):
    """loss_fn(logits, target, weight) on one device and on DTensors (logits at `xpl`;
    target and weight plain tensors under `implicit_replication()` where `tpl` is None,
    else DTensors at `tpl` and Replicate), forward and backward with a random output
    gradient: (loss ok, logits gradient ok, the collectives, as CommBytes lists them)."""
    ref_x = x.clone().requires_grad_(True)
    want = loss_fn(ref_x, target, weight)
    gout = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(7))
    want.backward(gout)
    with simulation(mesh.size()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dx = distribute_tensor(x, mesh, xpl).requires_grad_(True)
        if tpl is None:
            dt, dw, implicit = target, weight, implicit_replication()
        else:
            dt = distribute_tensor(target, mesh, tpl)
            dw = None if weight is None else distribute_tensor(weight, mesh, [R] * mesh.ndim)
            implicit = contextlib.nullcontext()
        with implicit, CommBytes() as comm:
            out = loss_fn(dx, dt, dw)
            out.backward(distribute_tensor(gout, mesh, [R] * mesh.ndim).redistribute(mesh, out.placements))
        loss_ok = _close(out.full_tensor(), want.detach(), want.dtype)
        grad_ok = _close(dx.grad.full_tensor(), ref_x.grad, x.dtype)
    return loss_ok, grad_ok, comm.listing


def _no_gather(listing, rows: int) -> None:
    """Only all-reduces, each of at most one number per row (or two scalars)."""
    assert not [c for c in listing if c.collective in GATHERS], [(c.op, c.collective) for c in listing]
    big = [c for c in listing if math.prod(c.local_shape) > max(rows, 2)]
    assert not big, [(c.op, c.collective, c.local_shape) for c in big]


def _case(layout, loss, dtype=torch.float64):
    mesh_shape, n, c, xpl, tpl = layout
    x = torch.randn(n, c, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(dtype)
    target = torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(2))
    kw = dict(LOSSES[loss])
    target[1] = kw.get("ignore_index", -100)  # an ignored row
    weight = kw.pop("weight", None)
    return device_mesh(mesh_shape), n, x, target, None if weight is None else weight[:c], kw, xpl, tpl


@pytest.mark.parametrize("plain", [True, False], ids=["plain-target", "dtensor-target"])
@pytest.mark.parametrize("loss", list(LOSSES))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: f"{v[0]}-{v[1]}x{v[2]}")
def test_cross_entropy_never_gathers(layout, loss, plain):
    mesh, n, x, target, weight, kw, xpl, tpl = _case(layout, loss)
    decompshard.enable()
    try:
        loss_ok, grad_ok, listing = _loss_step(lambda a, t, w: F.cross_entropy(a, t, w, **kw), x, target, weight,
                                               mesh, xpl, None if plain else tpl)
    finally:
        decompshard.disable()
    assert loss_ok and grad_ok
    _no_gather(listing, n)
    assert any(c.op.startswith("aten.nll_loss_forward") for c in listing), "the plan did not run"


@pytest.mark.parametrize("loss", ["mean", "none", "smoothing"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda v: f"{v[0]}-{v[1]}x{v[2]}")
def test_float32_upcast_of_half_logits(layout, loss):
    """transformers' `logits.float()` before the loss, on half-precision logits."""
    mesh, n, x, target, weight, kw, xpl, _ = _case(layout, loss, torch.float16)
    decompshard.enable()
    try:
        loss_ok, grad_ok, listing = _loss_step(lambda a, t, w: F.cross_entropy(a.float(), t, w, **kw), x, target,
                                               weight, mesh, xpl, None)
    finally:
        decompshard.disable()
    assert loss_ok and grad_ok
    _no_gather(listing, n)


@pytest.mark.parametrize("guard", [True, False], ids=["guard", "no-guard"])
def test_plain_target_with_and_without_the_mean_loss_fence(guard):
    """The plan runs in front of the guard's mean-loss fence (batch-sharded mean over
    ignored rows: where the plan declined, the fence would run DTensor's gathering path)."""
    mesh, n, x, target, weight, kw, xpl, _ = _case(LAYOUTS[2], "mean")
    decompshard.enable(guard_native=guard)
    try:
        loss_ok, grad_ok, listing = _loss_step(lambda a, t, w: F.cross_entropy(a, t, w, **kw), x, target, weight,
                                               mesh, xpl, None)
    finally:
        decompshard.disable()
    assert loss_ok and grad_ok
    _no_gather(listing, n)


def test_nll_loss2d_plain_target():
    """The image loss (nll_loss2d) over a class-sharded dim 1, target plain."""
    mesh = device_mesh((4,))
    x = torch.randn(2, 8, 3, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    target = torch.randint(0, 8, (2, 3, 3), generator=torch.Generator().manual_seed(5))
    target[0, 0, 0] = -100
    decompshard.enable()
    try:
        loss_ok, grad_ok, listing = _loss_step(lambda a, t, w: F.cross_entropy(a, t, label_smoothing=0.1), x,
                                               target, None, mesh, [Shard(1)], None)
    finally:
        decompshard.disable()
    assert loss_ok and grad_ok
    assert not [c for c in listing if c.collective in GATHERS], listing


def test_plain_target_priced_and_taken():
    """`explain`'s pricing and the handler's decision read a plain target under
    `implicit_replication()` as DTensor does (Replicate): the plan is priced and taken,
    and the decision is remembered (its key names the plain target)."""
    from decompshard.runtime import collectives
    from decompshard.runtime.plans import plan_for, price

    op = torch.ops.aten.nll_loss_forward.default
    mesh = device_mesh((4,))
    x = torch.randn(6, 16, dtype=torch.float64).log_softmax(1)
    target = torch.randint(0, 16, (6,))
    with simulation(4), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dx = distribute_tensor(x, mesh, [Shard(1)])
        decompshard.enable()
        try:
            with implicit_replication():
                priced, native, taken = price(op, (dx, target, None, 1, -100), {})
                key = collectives._decision_key(op, (dx, target, None, 1, -100), {}, priced.cost.bytes_moved)
            # outside implicit_replication() DTensor refuses the mix; the plan does not apply
            priced_off = plan_for(op).price(op, (dx, target, None, 1, -100), {})
        finally:
            decompshard.disable()
    assert priced is not None and taken and native.bytes_moved and key is not None
    assert priced_off is None


LOSS_OPS = ("aten._log_softmax", "aten._log_softmax_backward_data", "aten.nll_loss_forward",
            "aten.nll_loss_backward", "aten._to_copy")


@pytest.mark.parametrize("sharding", ["tp", "2d"])
def test_llama_through_labels(sharding, monkeypatch):
    """transformers' Llama, lm_head `ColwiseParallel(output_layouts=Shard(-1),
    use_local_output=False)`, trained one step through its own `labels=` loss (the
    logits upcast with `.float()`, the labels padded and shifted, cross_entropy with
    ignore_index=-100) with the labels a plain tensor under `implicit_replication()` on
    the tensor-parallel mesh dim (sharded on the batch's dim, 2d): loss and every
    gradient as one device; no all-gather in the loss, forward or backward."""
    pytest.importorskip("transformers")
    from decompshard.check import model as check_model
    from decompshard.check.model import SHARDINGS, run_training_step
    from decompshard.check.zoo import ZOO, build

    built = build(ZOO["llama"], SHARDINGS[sharding].batch, seed=0)
    built.plan["lm_head"] = "vocab_colwise"
    distribute = check_model._distribute_inputs

    def labels_plain_on_tp(inputs, mesh, sh):
        out = distribute(inputs, mesh, sh)
        if sh.dp is None:
            out["labels"] = inputs["labels"]
        return out

    monkeypatch.setattr(check_model, "_distribute_inputs", labels_plain_on_tp)
    top = CommBytes.top
    monkeypatch.setattr(CommBytes, "top", lambda self, n=1000: top(self, n))  # every op, not the first 12
    run = run_training_step(built, sharding, enable=True)
    assert run.verdict == "OK", f"{run.op}: {run.detail}"
    loss = [r for r in run.comm_top if r["op"].startswith(LOSS_OPS)]
    assert any(r["op"].startswith("aten.nll_loss_forward") for r in loss), run.comm_top
    assert all(r["collective"] == "all_reduce" for r in loss), loss
    # the logits ([batch x seq, vocab]) never move: at most one number per token does
    tokens = SHARDINGS[sharding].batch * 8
    assert all(r["bytes"] <= 2 * tokens * 8 for r in loss), loss
    if sharding == "tp":
        # nor anywhere else: the residual stream's gradient comes back from the head Partial,
        # and o_proj's weight gradient reduces it with its input gradient, not gathering its
        # input beside (steering/node_reads.py; the zoo's llama-vocab tp: 93.5 KiB, now 81.5)
        assert not [r for r in run.comm_top if r["collective"].startswith("all_gather")], run.comm_top
