"""The native guard's mean-loss handler (decompshard/runtime/fences/mean_loss.py): nll_loss_forward /
nll_loss2d_forward with reduction='mean' on a batch-sharded target.

DTensor's native strategy returns Partial(avg) of per-rank means: wrong with ignored
targets (labels=-100) or class weights, NaN on a rank with no counted target, refused on
uneven batches. With `enable(guard_native=True)` loss and gradient match one device on
every rank (float64, simulated ranks), on 1-D and 2x2 meshes, even and uneven batches,
with no all-gather. Every case is shown wrong (or refused) without the guard on the
releases where the guard table says torch alone is wrong (`guard_table.wrong_here`:
torch 2.13); from 2.14 torch is right there but all-gathers the logits and the target,
and the handler stays as the cheaper plan (`guard_table.KEPT_WHERE_RIGHT`): the tests
show torch alone right and the handler moving less.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import _loss_cases as L
import decompshard
from decompshard.runtime.fences.table import KEPT_WHERE_RIGHT, wrong_here
from decompshard.verify.dtensor_case import simulated_world

W = 4
C = 5
S0, R = Shard(0), Replicate()
NATIVE_WRONG = wrong_here("aten.nll_loss_forward.default")  # torch alone, on the running release


@pytest.fixture(scope="module")
def meshes():
    from torch.distributed.device_mesh import DeviceMesh

    with simulated_world(W):
        yield {"1d": DeviceMesh("cpu", torch.arange(W)), "2x2": DeviceMesh("cpu", torch.arange(W).view(2, 2))}
    decompshard.disable()


@pytest.fixture()
def guard_on():
    decompshard.enable(guard_native=True)
    yield
    decompshard.disable()


WEIGHT = torch.tensor([0.2, 1.0, 3.0, 0.7, 1.5], dtype=torch.float64)

# (name, loss fn, log_softmax first, batch, ignored rows, kwargs)
CASES = [
    # 8 rows on 4 ranks: rank 0 holds rows 0-1, both ignored (NaN without the guard)
    ("ce ignore_index, a rank with none counted", L.CE, False, 8, [0, 1, 3], {}),
    ("ce class weights", L.CE, False, 8, [], {"weight": WEIGHT}),
    ("ce class weights + ignore_index", L.CE, False, 8, [2, 5], {"weight": WEIGHT}),
    ("ce label_smoothing + ignore_index", L.CE, False, 8, [0, 1, 6], {"label_smoothing": 0.1}),
    ("ce label_smoothing + weights + ignore_index", L.CE, False, 8, [4], {"label_smoothing": 0.2, "weight": WEIGHT}),
    ("nll ignore_index", L.NLL, True, 8, [1, 2, 7], {}),
    ("nll custom ignore_index", L.NLL, True, 8, [], {"ignore_index": 3}),
    ("ce uneven batch (3, 3, 3, 1) + ignore_index", L.CE, False, 10, [9, 0, 1], {}),
    ("ce uneven batch (2, 2, 1, 1) + weights", L.CE, False, 6, [0], {"weight": WEIGHT}),
    ("ce 3 rows on 4 ranks (an empty shard) + ignore_index", L.CE, False, 3, [1], {}),
]


def _case(name, fn, log_softmax, n, ignored, kwargs, mesh, x_pl, t_pl, extra=()):
    x = L.logits(n, C, extra_dims=extra)
    t = L.targets(n, C, ignored, extra_dims=extra)
    if "ignore_index" in kwargs:
        t[t == L.IGNORE] = kwargs["ignore_index"]
    return L.step(fn, x, t, kwargs, mesh, x_pl, t_pl, log_softmax=log_softmax)


LAYOUTS = [("1d", [S0], [S0]), ("2x2", [S0, S0], [S0, S0]), ("2x2", [S0, R], [S0, R])]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["1d-S0", "2x2-S0S0", "2x2-S0R"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_guarded_mean_loss_matches_one_device(meshes, guard_on, case, layout):
    mesh_name, x_pl, t_pl = layout
    got = _case(*case, meshes[mesh_name], x_pl, t_pl)
    assert got.error == "", got.error
    assert got.loss_ok, f"loss {got.loss} != {got.want}"
    assert got.grad_ok
    assert all(getattr(p, "reduce_op", None) != "avg" for p in got.placements), got.placements
    # the logits move no more than for DTensor's own sum of the same terms (none where its
    # strategy keeps the batch sharded; from torch 2.14 it gathers a batch shorter than
    # the mesh): one all-reduce of (sum, total weight) per sharded mesh dim on top
    summed = _case(*case[:5], {**case[5], "reduction": "sum"}, meshes[mesh_name], x_pl, t_pl)
    for kind in ("all_gather_into_tensor", "all_to_all_single"):
        assert got.comms.get(kind, 0) <= summed.comms.get(kind, 0), (got.comms, summed.comms)
    assert "all_gather_into_tensor" not in got.comms or case[3] < W, got.comms  # only a batch shorter than the mesh


def test_without_the_guard_the_same_cases_are_as_measured(meshes):
    """Wrong (or refused) where the table says torch alone is wrong, right elsewhere."""
    decompshard.disable()
    for case in CASES:
        for layout in LAYOUTS:
            got = _case(*case, meshes[layout[0]], layout[1], layout[2])
            assert (got.loss_ok and got.grad_ok) is not NATIVE_WRONG, (case[0], layout, got)
    if not NATIVE_WRONG:
        return
    # and with decompshard's fallback but no guard (what enable() without the guard does)
    decompshard.enable(guard_native=False)
    try:
        got = _case(*CASES[0], meshes["1d"], [S0], [S0])
    finally:
        decompshard.disable()
    assert not got.loss_ok and all(v != v for v in got.loss.values())  # NaN: rank 0 counts nothing


def test_vocab_sharded_logits_on_2x2(meshes, guard_on):
    """Logits S(0) on DP and S(1) (classes) on TP, targets S(0), R: DTensor alone gathers
    the classes over TP and averages per-rank means; under enable() the vocab-parallel
    plan (runtime/plans/vocab_loss.py) runs ahead of the guard's handler: the loss is
    right and the logits are not gathered."""
    x, t = L.logits(8, 4), L.targets(8, 4, [0, 1, 2])
    got = L.step(L.CE, x, t, {}, meshes["2x2"], [S0, Shard(1)], [S0, R])
    decompshard.disable()
    plain = L.step(L.CE, x, t, {}, meshes["2x2"], [S0, Shard(1)], [S0, R])
    assert got.error == "" and got.loss_ok and got.grad_ok, got
    assert plain.loss_ok is not NATIVE_WRONG
    assert plain.comms.get("all_gather_into_tensor") and "all_gather_into_tensor" not in got.comms, (got.comms,
                                                                                                  plain.comms)


def test_nll_loss2d_image_targets(meshes, guard_on):
    """cross_entropy on [N, C, H, W] logits runs nll_loss2d_forward."""
    got = _case("2d", L.CE, False, 4, [0], {"weight": WEIGHT}, meshes["1d"], [S0], [S0], extra=(3, 2))
    assert got.error == "" and got.loss_ok and got.grad_ok, got
    decompshard.disable()
    plain = _case("2d", L.CE, False, 4, [0], {"weight": WEIGHT}, meshes["1d"], [S0], [S0], extra=(3, 2))
    assert plain.loss_ok is not wrong_here("aten.nll_loss2d_forward.default")
    assert sum(got.comms.values()) <= sum(plain.comms.values()), (got.comms, plain.comms)


def test_collectives_no_more_than_without_the_guard(meshes, guard_on):
    """Where DTensor alone runs (even batch, no guard): as many collectives. The total
    weight's all-reduce (DTensor's, in the backward) moves into the forward and carries
    the loss's sum with it; never an all-gather. (Without the guard the Partial(avg)
    loss costs one more all-reduce when the user reads it.) Where torch alone is right
    (2.14 on), it all-gathers the logits and the target: why the handler stays there
    (guard_table.KEPT_WHERE_RIGHT)."""
    x, t = L.logits(8, C), L.targets(8, C, [1])
    guarded = L.step(L.CE, x, t, {}, meshes["1d"], [S0], [S0])
    decompshard.disable()
    plain = L.step(L.CE, x, t, {}, meshes["1d"], [S0], [S0])
    assert plain.error == "" and guarded.error == ""
    assert guarded.loss_ok and guarded.grad_ok and plain.loss_ok is not NATIVE_WRONG
    assert sum(guarded.comms.values()) <= sum(plain.comms.values()), (guarded.comms, plain.comms)
    assert guarded.comms.get("all_reduce", 0) == 1 and "all_gather_into_tensor" not in guarded.comms, guarded.comms
    if not NATIVE_WRONG:
        assert "aten.nll_loss_forward.default" in KEPT_WHERE_RIGHT
        assert plain.comms.get("all_gather_into_tensor"), plain.comms


def test_sum_and_none_reductions_are_left_to_dtensor(meshes, guard_on):
    for red in ("sum", "none"):
        x, t = L.logits(8, C), L.targets(8, C, [0, 1])
        got = L.step(lambda a, b, **k: L.CE(a, b, **k).sum(), x, t, {"reduction": red}, meshes["1d"], [S0], [S0])
        assert got.error == "" and got.loss_ok and got.grad_ok, (red, got)


def _linear_cross_entropy_mismatches(mesh) -> tuple[int, int, list]:
    """PyTorch's own DTensor OpInfo check (test_dtensor_ops: every DTensorConverter layout
    of each sample, full_tensor() against one device) on linear_cross_entropy's mean
    samples with class weights or ignore_index, float32 as there."""
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.common_methods_invocations import op_db
    from torch.testing._internal.distributed._tensor.common_dtensor import DTensorConverter

    op = next(o for o in op_db if o.name == "nn.functional.linear_cross_entropy" and o.variant_test_name == "")
    bad, total = [], 0
    for s in op.sample_inputs("cpu", torch.float32, requires_grad=False):
        args, kwargs = (s.input, *s.args), s.kwargs
        if kwargs.get("reduction", "mean") != "mean" or not ({"weight", "ignore_index"} & set(kwargs)):
            continue
        if args[2].is_floating_point():  # class probabilities: no nll_loss
            continue
        want = op(*args, **kwargs)
        with LocalTensorMode(mesh.size()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for dargs, dkwargs in DTensorConverter(mesh, args, kwargs):
                total += 1
                try:
                    full = op(*dargs, **dkwargs).full_tensor()
                    values = full._local_tensors.values() if hasattr(full, "_local_tensors") else [full]
                    ok = all(torch.allclose(v, want, rtol=1.3e-6, atol=1e-5) for v in values)
                except Exception:  # noqa: BLE001 - counted as a mismatch
                    ok = False
                if not ok:
                    bad.append(([tuple(t.shape) for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)],
                                [tuple(a.placements) for a in (*dargs, *dkwargs.values()) if isinstance(a, DTensor)]))
    return len(bad), total, bad


def test_pytorch_linear_cross_entropy_opinfo_check(meshes):
    """142 layouts; torch alone: 44 wrong. The guard before its mean-loss handler left 24:
    ignore_index without class weights (its table rule had the weight), and every sample
    whose 3-D logits take nll_loss2d_forward (the `[4, 3]` target with class weights)."""
    decompshard.disable()
    n_bad, total, bad = _linear_cross_entropy_mismatches(meshes["1d"])
    assert (n_bad > 0) is NATIVE_WRONG and total > 100, (n_bad, total)  # torch 2.13 alone: wrong mean losses
    decompshard.enable(guard_native=True)
    try:
        n_bad, total, bad = _linear_cross_entropy_mismatches(meshes["1d"])
    finally:
        decompshard.disable()
    assert n_bad == 0, bad[:5]


def test_warns_once_and_leaves_dtensor_as_it_was(meshes):
    from torch.distributed.tensor.parallel import loss_parallel

    from decompshard._compat import DTensor

    aten = torch.ops.aten
    handlers = DTensor._op_dispatcher._custom_op_handlers
    decompshard.disable()
    assert aten.nll_loss_forward.default not in handlers
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import distribute_tensor

    decompshard.enable(guard_native=True)
    try:
        with warnings.catch_warnings(record=True) as caught, LocalTensorMode(W):
            warnings.simplefilter("always")
            for _ in range(2):
                L.CE(distribute_tensor(L.logits(8, C), meshes["1d"], [S0]),
                     distribute_tensor(L.targets(8, C, [0]), meshes["1d"], [S0]))
    finally:
        decompshard.disable()
    texts = [str(w.message) for w in caught if "decompshard guard" in str(w.message)]
    # once where it corrects torch; silent where it is only the cheaper plan (torch right)
    assert sum("nll_loss_forward" in t for t in texts) == int(NATIVE_WRONG), texts
    assert aten.nll_loss_forward.default not in handlers and aten.nll_loss2d_forward.default not in handlers
    with loss_parallel():  # torch's vocab-parallel loss handlers are not replaced
        theirs = handlers[aten.nll_loss_forward.default]
        with decompshard.enabled(guard_native=True):
            assert handlers[aten.nll_loss_forward.default] is theirs
        assert handlers[aten.nll_loss_forward.default] is theirs


def _item(mesh, make) -> float | str:
    """`.item()` of make()'s DTensor on the simulated ranks (LocalTensorMode returns one
    number only when every rank read the same), or the error."""
    from torch.distributed._local_tensor import LocalTensorMode

    with LocalTensorMode(mesh.size()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        d = make()
        try:
            return float(d.item())
        except Exception as e:  # noqa: BLE001 - the verdict names it
            return f"{type(e).__name__}: {e}"


def test_item_of_a_partial_or_sharded_value_reads_the_global_value(meshes):
    """`.item()` (aten._local_scalar_dense) on a P(sum) loss, as label_smoothing gives,
    and on a one-element shard: DTensor reads each rank's own part (ranks disagree: under
    LocalTensorMode an error, on real ranks silently different numbers)."""
    from torch.distributed.tensor import distribute_tensor

    mesh = meshes["1d"]
    x, t = L.logits(8, C), L.targets(8, C, [0, 1, 5])
    cases = {
        "label-smoothed loss (P(sum))": (
            lambda: L.CE(distribute_tensor(x, mesh, [S0]), distribute_tensor(t, mesh, [S0]), label_smoothing=0.1),
            L.CE(x, t, label_smoothing=0.1).item()),
        "sum of a sharded vector (P(sum))": (
            lambda: distribute_tensor(torch.arange(8, dtype=torch.float64), mesh, [S0]).sum(), 28.0),
        "one element on S(0) (empty shards)": (
            lambda: distribute_tensor(torch.tensor([2.5], dtype=torch.float64), mesh, [S0]), 2.5),
    }
    decompshard.disable()
    for name, (make, _want) in cases.items():
        assert isinstance(_item(mesh, make), str), name  # DTensor alone: ranks disagree, or a kernel error
    decompshard.enable(guard_native=True)
    try:
        for name, (make, want) in cases.items():
            got = _item(mesh, make)
            assert isinstance(got, float) and abs(got - want) <= 1e-12 * abs(want), (name, got)
    finally:
        decompshard.disable()


def test_gloo_four_processes(tmp_path):
    """Real collectives: the mean-loss handler's all-reduce and `.item()`'s redistribution
    on 4 gloo processes (without the guard each rank logged its own number, NaN on the
    rank that counts no target)."""
    import json

    import _gloo_cases as G

    from _e2e_model import free_port

    G.spawn(L.gloo_worker, (free_port(), str(tmp_path)), W)
    for rank in range(W):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "__error__" not in report, report.get("__error__")
        for name in ("plain", "label_smoothing"):
            r = report[name]
            assert abs(r["item"] - r["want"]) <= 1e-12 and abs(r["full"] - r["want"]) <= 1e-12, (rank, name, r)
            assert r["grad_ok"], (rank, name)
