"""End to end: a model built from ops torch's DTensor cannot shard (tests/_e2e_model.py),
on a 2x2 mesh, under LocalTensorMode and on 4 real gloo processes.

Checked: no op raises, outputs and gradients equal the single-device run, and
decompshard never issues more collectives than torch's built-in fallback (strictly
fewer where the fallback gathers). Run with `-s` to see the per-op table.
"""

from __future__ import annotations

import json
import time
import warnings

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode

import _e2e_model as M
import decompshard

# torch's fallback issues ordinary collectives (all-gather, all-reduce); the point of
# each op in the model, where torch can run it at all.
STRICTLY_FEWER = {"addmv", "trace"}


@pytest.fixture(scope="module")
def world():
    with M.fake_world(4):
        yield M.submesh(M.MESH_SHAPE)
    decompshard.disable()


@pytest.fixture(scope="module")
def model_and_inputs():
    model = M.E2EModel()
    inputs = model.make_inputs()
    return model, inputs, M.reference(model, inputs)


@pytest.fixture(scope="module")
def counts(world, model_and_inputs):
    model, inputs, _ = model_and_inputs
    with LocalTensorMode(4):
        theirs, ours = M.compare_counts(model, inputs, world)
    print("\n" + M.count_table(theirs, ours))
    return theirs, ours


def _assert_matches(name: str, got: M.OpResult, ref: M.OpResult) -> None:
    assert got.error == "", f"{name} raised: {got.error}"
    torch.testing.assert_close(got.output, ref.output, msg=f"{name}: output differs")
    assert set(got.grads) == set(ref.grads), f"{name}: gradients of {set(ref.grads) - set(got.grads)} missing"
    for k, g in got.grads.items():
        torch.testing.assert_close(g, ref.grads[k], msg=f"{name}: gradient of {k} differs")


def test_every_op_runs_and_matches_single_device(counts, model_and_inputs):
    _, ours = counts
    ref = model_and_inputs[2]
    for name, got in ours.items():
        _assert_matches(name, got, ref[name])


def test_torch_fallback_fails_where_the_issue_says(counts):
    theirs, _ = counts
    for name in ("addbmm", "cdist", "unfold", "renorm", "im2col", "sdpa_causal", "pixel_shuffle"):
        assert theirs[name].forward == "error", name
    assert "does not have a sharding strategy" in theirs["addbmm"].error
    assert "divisible by the square of upscale_factor" in theirs["pixel_shuffle"].error
    for name in ("hardswish", "prelu", "logsigmoid"):  # forward fine, backward has no strategy
        assert theirs[name].forward == 0 and theirs[name].backward == "error", name


def test_never_more_collectives_than_torch(counts):
    theirs, ours = counts
    for name, o in ours.items():
        t = theirs[name]
        for which in ("forward", "backward"):
            tv, ov = getattr(t, which), getattr(o, which)
            if isinstance(tv, int):
                assert ov <= tv, f"{name} {which}: decompshard {ov} > torch {tv}"
        if name in STRICTLY_FEWER:
            assert o.forward < t.forward, f"{name}: torch {t.forward}, decompshard {o.forward}"
    torch_total, our_total, _ = M.comparable_totals(theirs, ours)
    assert our_total < torch_total


def test_known_counts(counts):
    """The numbers the README quotes (2x2 mesh, LocalTensorMode); a change is a change in
    behaviour worth a look, in either direction."""
    theirs, ours = counts
    assert (theirs["addmv"].forward, ours["addmv"].forward) == (2, 0)
    assert (theirs["trace"].forward, ours["trace"].forward) == (1, 0)
    zero = ("addbmm", "cdist", "im2col", "sdpa_causal", "hardswish", "prelu", "logsigmoid")
    assert {n: (ours[n].forward, ours[n].backward) for n in zero} == {n: (0, 0) for n in zero}


def test_whole_model_at_once(world, model_and_inputs, counts):
    """The model as one forward and one backward; every output's gradient at once."""
    from torch.distributed.tensor.debug import CommDebugMode

    model, inputs, ref = model_and_inputs
    _, ours = counts
    with LocalTensorMode(4), decompshard.enabled(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dmodel, dinputs = M.distribute(model, inputs, world)
        with CommDebugMode() as fwd:
            outs = dmodel(dinputs)
        with CommDebugMode() as bwd:
            roots = [o.sum() for n, o in outs.items() if o.requires_grad]
            torch.autograd.backward(roots)
        for n, o in outs.items():
            torch.testing.assert_close(M.full(o), ref[n].output)
        for k, leaf in M.leaves(dmodel, dinputs).items():
            torch.testing.assert_close(M.full(leaf.grad), ref[k.split(".")[0]].grads[k], msg=k)
    assert fwd.get_total_counts() == sum(r.forward for r in ours.values())
    assert bwd.get_total_counts() == sum(r.backward or 0 for r in ours.values())


def test_gloo_four_processes(tmp_path, counts):
    """Real collectives: 4 processes, gloo, a 2x2 mesh. Same numbers as single device and
    the same per-op collective counts as the LocalTensorMode run."""
    import _gloo_cases as G

    start = time.perf_counter()
    G.spawn(M.gloo_worker, (4, M.free_port(), str(tmp_path)), 4)
    elapsed = time.perf_counter() - start
    _, ours = counts
    for rank in range(4):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "__error__" not in report, f"rank {rank}: {report.get('__error__')}"
        for name, r in report.items():
            assert r["error"] == "", f"rank {rank} {name}: {r['error']}"
            assert r["output_ok"], f"rank {rank} {name}: output differs from single device"
            assert sorted(r["grads_ok"]) == r["grads_expected"], f"rank {rank} {name}: missing gradients"
            assert all(r["grads_ok"].values()), f"rank {rank} {name}: gradients differ: {r['grads_ok']}"
            assert (r["forward"], r["backward"]) == (ours[name].forward, ours[name].backward), (
                f"rank {rank} {name}: gloo counts {(r['forward'], r['backward'])}, "
                f"LocalTensorMode {(ours[name].forward, ours[name].backward)}")
    print(f"\ngloo, 4 processes: {elapsed:.1f} s")
