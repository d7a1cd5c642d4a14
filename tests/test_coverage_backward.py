"""`decompshard coverage`'s backward section: the OpInfo capture runs each differentiable
sample's backward, the ops autograd dispatches there are swept like forward ops (status,
rules, the numerical check) and shown in a section of their own; `decompshard check`
runs the derived ones on real DTensors.

Everything here uses the session's `--opinfo-samples 1` capture (conftest.opinfo_cache)
or a capture filtered to one OpInfo, and `--ops` subsets.
"""

from __future__ import annotations

import csv
import io
import json

import pytest
import torch
import torch.nn.functional as F

from decompshard.cli import main
from decompshard.coverage import report as rep
from decompshard.coverage.opinfo_samples import capture_aten_samples, is_backward_op

aten = torch.ops.aten
FAST = ["--opinfo-samples", "1", "-j", "1", "-q"]
# native_layer_norm_backward: native; mse_loss_backward, leaky_relu_backward: derived
# (decomposable, no DTensor strategy); mul.Tensor: a forward op
OPS = ("aten.native_layer_norm_backward.default,aten.mse_loss_backward.default,"
       "aten.leaky_relu_backward.default,aten.mul.Tensor")


@pytest.fixture(scope="module")
def captured(opinfo_cache) -> dict:
    return capture_aten_samples(max_samples_per_opinfo=1, backward=True, cache_dir=str(opinfo_cache))


@pytest.fixture(scope="module")
def doc(opinfo_cache, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("covb") / "b.json"
    with pytest.MonkeyPatch.context() as mp:  # the session's capture, never the user's cache
        mp.setenv("DECOMPSHARD_CACHE_DIR", str(opinfo_cache))
        assert main(["coverage", "--ops", OPS, "--format", "json", "-o", str(out), *FAST]) == 0
    return json.loads(out.read_text())


def _op(doc: dict, name: str) -> dict:
    return next(r for r in doc["ops"] if r["op"] == name)


# ------------------------------------------------------------------ the capture


def test_layer_norm_sample_reaches_its_backward_with_real_arguments(captured):
    """The layer_norm OpInfo sample's backward calls native_layer_norm_backward; the
    recorded call, replayed, gives the gradients autograd gives for that grad_output."""
    samples = captured[aten.native_layer_norm_backward.default]
    assert samples and all(s.backward and "layer_norm" in s.opinfo_name for s in samples)
    assert is_backward_op(aten.native_layer_norm_backward.default, samples)
    s = samples[0]
    grad_out, x, shape, mean, rstd, weight, bias, mask = s.args
    assert grad_out.shape == x.shape and list(shape) == list(x.shape[x.dim() - len(shape):])
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    torch.testing.assert_close(mean, x.mean(dims, keepdim=True))  # the forward's own statistics
    eps = (rstd.double() ** -2 - x.double().var(dims, unbiased=False, keepdim=True)).mean().item()
    leaves = [t.detach().clone().double().requires_grad_(True) for t in (x, weight, bias)]
    out = F.layer_norm(leaves[0], list(shape), leaves[1], leaves[2], eps=eps)
    expected = torch.autograd.grad(out, leaves, grad_out.double())
    got = s.run()
    for g, e, wanted in zip(got, expected, mask):
        assert wanted
        torch.testing.assert_close(g.double(), e, rtol=1e-4, atol=1e-5)


def test_forward_samples_are_the_same_with_or_without_the_backward():
    """A backward capture holds the forward capture unchanged (a forward-only request is
    served from it), and ops reached only by backward are marked so."""
    names = ["nn.functional.layer_norm", "nn.functional.hardtanh", "addmv", "nn.functional.dropout"]
    both = capture_aten_samples(names, max_samples_per_opinfo=2, backward=True)
    fwd = capture_aten_samples(names, max_samples_per_opinfo=2)
    assert set(fwd) < set(both)
    for op, samples in fwd.items():
        kept = [s for s in both[op] if not s.backward]
        assert [s.opinfo_name for s in kept] == [s.opinfo_name for s in samples]
        assert [s.shapes() for s in kept] == [s.shapes() for s in samples], op
        for a, b in zip(kept, samples):
            for x, y in zip(a.tensors(), b.tensors()):
                assert torch.equal(x, y) or (x.is_floating_point() and torch.allclose(x, y, equal_nan=True))
    only_backward = {op for op in both if is_backward_op(op, both[op])}
    assert {aten.native_layer_norm_backward.default, aten.hardtanh_backward.default} <= only_backward
    assert aten.native_layer_norm.default not in only_backward and aten.addmv.default not in only_backward
    assert not (only_backward - {op for op in both if op not in fwd or "_backward" in op._opname})


# ------------------------------------------------------------------ the report


def test_backward_ops_are_swept_with_the_same_columns(doc):
    ln = _op(doc, "aten.native_layer_norm_backward.default")
    assert ln["backward"] and ln["status"] == "native"
    assert _op(doc, "aten.mul.Tensor")["backward"] is False
    for name in ("aten.mse_loss_backward.default", "aten.leaky_relu_backward.default"):
        r = _op(doc, name)
        assert r["backward"] and r["status"] == "derived", (name, r["reason"])
        assert r["verified"] and r["n_derived"] > 0
        assert r["n_incorrect"] == 0 and r["n_confirmed"] == r["n_derived"], r["incorrect"]
        assert all(s["opinfo"] for s in r["samples"])
    b = doc["summary"]["backward"]
    assert b["ops"] == 3 and b["status"]["derived"] == 2 and b["status"]["native"] == 1
    assert b["decompshard"]["incorrect"] == 0 and b["decompshard"]["rules"] > 0
    assert doc["summary"]["ops"] == 4 and doc["run"]["backward"] is True


def test_no_backward_sweeps_the_forward_capture(opinfo_cache, tmp_path, monkeypatch):
    """--no-backward: ops only the backward reaches have no sample (a *_backward* op is
    still listed as one), as before the backward capture existed."""
    monkeypatch.setenv("DECOMPSHARD_CACHE_DIR", str(opinfo_cache))
    out = tmp_path / "f.json"
    assert main(["coverage", "--ops", "aten.mse_loss_backward.default,aten.mul.Tensor", "--no-backward",
                 "--format", "json", "-o", str(out), *FAST]) == 0
    doc = json.loads(out.read_text())
    r = _op(doc, "aten.mse_loss_backward.default")
    assert r["backward"] and r["status"] == "unsupported" and "no sample inputs" in r["reason"]
    assert doc["run"]["backward"] is False and doc["summary"]["backward"]["ops"] == 1


def test_text_markdown_csv_show_the_backward_section(doc):
    text = rep.render(doc, "text")
    head, _, tail = text.partition(rep.BACKWARD_TITLE)
    assert tail, "no backward section"
    assert "aten.mul.Tensor" in head and "aten.native_layer_norm_backward.default" not in head
    section = tail.split("Summary")[0]
    for name in ("aten.native_layer_norm_backward.default", "aten.mse_loss_backward.default"):
        assert name in section
    assert "of them backward" in text and "backward ops alone:" in text
    md = rep.render(doc, "markdown")
    assert f"## {rep.BACKWARD_TITLE}" in md and md.index("| aten.mul.Tensor") < md.index(rep.BACKWARD_TITLE)
    rows = list(csv.DictReader(io.StringIO(rep.render(doc, "csv"))))
    assert {r["op"]: r["backward"] for r in rows} == {r["op"]: str(int(r["backward"])) for r in doc["ops"]}
    # --status filters both sections
    only = rep.render(doc, "text", statuses=["native"])
    assert rep.BACKWARD_TITLE in only and "mse_loss_backward" not in only


def test_diff_reports_backward_changes_and_reads_old_reports(doc):
    old = json.loads(json.dumps(doc))
    for r in old["ops"]:
        r.pop("backward")
    del old["summary"]  # a report from before the section: recomputed, no backward op in it
    d = rep.diff_reports(old, doc)
    assert d["summary"]["backward.derived"] == {"old": 0, "new": 2, "delta": 2}
    assert "backward.derived" in rep.render_diff(d, "text")


# ------------------------------------------------------------------ what the backward sweep found


def test_an_in_place_op_never_claims_a_rule_that_moves_self():
    """index_add_ (reached by stft's backward) used to claim `R, R, P(avg) -> P(avg)`: the
    reduced values are right, but `self`, labelled Replicate, ends up different on each
    rank. An in-place op's rules now keep self's placement, and all check out."""
    from decompshard import derive_rules
    from decompshard.verify.rule_check import check_rules

    torch.manual_seed(0)
    args = (torch.randn(7), 0, torch.tensor([0, 3, 3, 6, 1]), torch.randn(5))
    derived = derive_rules(aten.index_add_.default, *args)
    assert derived.rules, derived.unsupported_reason
    assert all(r.inputs[0] == r.outputs[0] for r in derived.rules), derived.as_strings()
    assert "P(sum), R, P(sum) -> P(sum)" in derived.as_strings()
    report = check_rules(aten.index_add_.default, args, {}, derived.rules, world_sizes=(2, 3))
    assert not report.incorrect and len(report.confirmed) == len(derived.rules)
    assert any("self must keep its placement" in r.reason for r in derived.rejected)


# ------------------------------------------------------------------ decompshard check


def test_check_sweeps_the_derived_backward_ops(captured, monkeypatch):
    """`decompshard check`'s default set holds the derived backward ops, and they give
    one-device numbers on real DTensors (2x3 mesh, random placements incl. Partial),
    forward and backward, with no error where torch's own fallback runs the case."""
    from decompshard.check import command as check_command
    from decompshard.check.sweep import check_ops, reproducer, summarize
    from decompshard.coverage import opinfo_samples

    def session_capture(*args, backward=False, **kwargs):  # the session's capture, as asked
        return captured if backward else opinfo_samples._forward_part(captured)

    monkeypatch.setattr(opinfo_samples, "capture_aten_samples", session_capture)
    per_op = dict(check_command._samples_for(None, 1, False))
    names = {str(op) for op in per_op}
    assert {"aten.mse_loss_backward.default", "aten.leaky_relu_backward.default"} <= names
    wanted = {"aten.leaky_relu_backward.default", "aten.index_add_.default"}
    assert wanted <= names
    # and the ops decompshard writes the decomposition of (decomps/), reached by OpInfo
    assert {"aten.scatter_reduce.two", "aten.put.default", "aten._trilinear.default"} <= names
    chosen = [(op, samples) for op, samples in per_op.items() if str(op) in wanted]
    records = check_ops(chosen, meshes=[(2, 3)], combos=2, seed=0, jobs=0)
    s = summarize(records)
    assert not s["failures"], "\n".join(f"{r['ours']} | torch {r['torch']} | {reproducer(r)}" for r in s["failures"])
    assert s["ours"].get("ok", 0) >= 3 and len(records) == 4 and s["ops"] == 2, [
        (r["op"], r["placements"], r["ours"], r["torch"]) for r in records if r["ours"]["status"] != "ok"]
    assert any("P(" in r["placements"] for r in records)


def test_a_layout_dependent_kernel_sample_is_no_incorrect_rule_and_says_why():
    """hardtanh_backward's CPU kernel gives different values for (grad -inf, self NaN) in
    its vectorised and scalar loops, so on the checker's NaN/inf sample its (valid)
    elementwise rules looked incorrect. The sweep's record now confirms them and lists
    the dropped sample with its reason."""
    from decompshard.coverage.sweep import _analyse_sample

    g = torch.Generator().manual_seed(0)
    args = (torch.randn(5, 5, generator=g), torch.randn(5, 5, generator=g), -1.0, 1.0)
    rec = _analyse_sample(aten.hardtanh_backward.default, (args, {}, "nn.functional.hardtanh"), True)
    assert rec["n_incorrect"] == 0, rec["incorrect"]
    assert {"S(0), S(0) -> S(0)", "S(1), S(1) -> S(1)"} <= set(rec["derived"])
    assert rec["n_confirmed"] == rec["n_derived"] >= 2
    assert any(d.startswith("special: ") and "depends on memory layout" in d for d in rec["dropped_samples"])
