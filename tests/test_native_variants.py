"""The native audit's argument variants (decompshard/coverage/native_variants.py): with
them the audit finds DTensor's mean-of-means nll loss (issue 23), which OpInfo's samples
never showed (none ignores a target); with the guard's fix it finds nothing there. On a
release where torch fixed the mean (2.14: `guard_table.wrong_here` says so), the same
variants find torch alone right: the audit is the measurement the guard's table follows."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from decompshard.runtime.fences import guard
from decompshard.runtime.fences.table import wrong_here
from decompshard.coverage.native_audit import audit_samples
from decompshard.coverage.native_variants import IGNORE, VARIANTS, variant_samples
from decompshard.verify.dtensor_case import simulated_world
from decompshard.verify.native_rules import audit_native_op_detailed

aten = torch.ops.aten


@pytest.fixture(scope="module")
def variants():
    return variant_samples()


def test_variants_reach_the_losses_with_ignored_targets(variants):
    for op in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default, aten.nll_loss_backward.default,
               aten.masked_fill.Scalar, aten.where.self, aten._softmax.default):
        assert op in variants, op
    labels = {s.opinfo_name for s in variants[aten.nll_loss_forward.default]}
    assert "variant: cross_entropy ignore_index" in labels and "variant: cross_entropy class weights" in labels
    ignored = [s for s in variants[aten.nll_loss_forward.default] if (s.args[1] == IGNORE).any()]
    assert ignored and all(s.args[4] == IGNORE and s.args[3] == 1 for s in ignored)  # mean, -100
    assert len(VARIANTS) == len({v.name for v in VARIANTS})


def test_audit_samples_keep_every_variant(variants):
    op = aten.nll_loss_forward.default
    chosen = audit_samples([], variants[op], 2)
    assert chosen == variants[op]


def _without_fix(monkeypatch, module: str) -> None:
    """The guard without the fences whose fix lives in runtime/fences/<module>.py."""
    import importlib

    fix = importlib.import_module(f"decompshard.runtime.fences.{module}").FIX
    monkeypatch.setattr(guard, "FENCES", tuple(f for f in guard.FENCES if f.fix is not fix))


def _wrong(op, samples, with_fix: bool, monkeypatch) -> list:
    if not with_fix:
        _without_fix(monkeypatch, "mean_loss")
    guard.install()
    try:
        return audit_native_op_detailed(op, samples).wrong
    finally:
        guard.uninstall()


@pytest.mark.parametrize("op", [aten.nll_loss_forward.default, aten.nll_loss2d_forward.default], ids=str)
def test_audit_finds_the_mean_of_means_without_the_fix(variants, monkeypatch, op):
    found = _wrong(op, variants[op], with_fix=False, monkeypatch=monkeypatch)
    rules = {w.rule for w in found}
    if not wrong_here(str(op)):
        assert not any("P(avg)" in r for r in rules), rules
        return
    assert any(r.startswith("S(0), S(0)") and "P(avg)" in r for r in rules), rules
    if op == aten.nll_loss_forward.default:  # ignored targets, no class weights: what masked LMs pass
        assert any(w.sample == "variant: cross_entropy ignore_index" for w in found), [w.sample for w in found]


@pytest.mark.parametrize("op", [aten.nll_loss_forward.default, aten.nll_loss2d_forward.default,
                                aten.nll_loss_backward.default, aten.nll_loss2d_backward.default], ids=str)
def test_audit_is_clean_with_the_fix(variants, monkeypatch, op):
    assert _wrong(op, variants[op], with_fix=True, monkeypatch=monkeypatch) == []


def test_the_sweep_audits_the_variants(monkeypatch):
    """`coverage --verify-native` (native_sweep) on DTensor as it is: the variants alone
    (OpInfo's capture stubbed out) report the nll mean of per-rank means."""
    from decompshard.coverage import native_audit, opinfo_samples

    monkeypatch.setattr(opinfo_samples, "capture_aten_samples", lambda **kw: {})
    guard.uninstall()
    doc = native_audit.native_sweep("aten.nll_loss_forward.default", jobs=0, progress=False)
    assert [r["op"] for r in doc["ops"]] == ["aten.nll_loss_forward.default"]
    assert doc["ops"][0]["n_samples"] == 5 and doc["run"]["variants"] == [v.name for v in VARIANTS]
    found = doc["wrong_rules"]
    mine = [w for w in found if w["sample"] == "variant: cross_entropy ignore_index"
            and w["rule"] == "S(0), S(0) -> P(avg), P(sum)"]
    assert bool(mine) is wrong_here("aten.nll_loss_forward.default"), [(w["sample"], w["rule"]) for w in found]
    for w in found:  # each finding's standalone script reproduces it (the targets' -100s included)
        ns: dict = {}
        with simulated_world(4), contextlib.redirect_stdout(io.StringIO()):
            exec(compile(w["script"], "<reproducer>", "exec"), ns)  # noqa: S102 - generated here
        assert ns["reproduced"], (w["rule"], w["sample"])


def test_the_guarded_sweep_finds_nothing_there(monkeypatch):
    """`coverage --verify-native --guard`: DTensor as enable(guard_native=True) leaves it."""
    from decompshard.cli import main
    from decompshard.coverage import native_audit, opinfo_samples

    monkeypatch.setattr(opinfo_samples, "capture_aten_samples", lambda **kw: {})
    guard.uninstall()
    doc = native_audit.native_sweep("aten.nll_loss_forward.default,aten.nll_loss2d_forward.default", jobs=0,
                                    progress=False, guarded=True)
    assert doc["run"]["guard"] is True and len(doc["ops"]) == 2
    assert all(r["status"] == "checked" and r["n_samples"] >= 1 for r in doc["ops"]), doc["ops"]
    assert doc["wrong_rules"] == []
    assert not guard.is_installed()  # the worker's guard state is put back
    assert "native guard on" in native_audit.render_native(doc)
    assert main(["coverage", "--guard"]) == 2  # only with --verify-native


def test_item_audit_is_clean_with_the_guard(monkeypatch):
    """The audit's `_local_scalar_dense` findings (docs/native_audit/torch-<release>.json: `.item()` of
    P(sum) reads each rank's part; of a one-element S(0), an empty shard) are gone with
    the guard and back without its handler."""
    op = aten._local_scalar_dense.default
    samples = [((torch.tensor([1.5], dtype=torch.float64),), {}), ((torch.tensor(2.0, dtype=torch.float64),), {})]
    assert _wrong(op, samples, with_fix=True, monkeypatch=monkeypatch) == []
    _without_fix(monkeypatch, "one_rank_read")
    found = {w.rule for w in _wrong(op, samples, with_fix=True, monkeypatch=monkeypatch)}
    assert "P(sum) -> ranks disagree" in found and "S(0) -> local kernel error" in found, found
