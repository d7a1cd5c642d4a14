"""Every op `enable()` runs replicated instead of derived is recorded (runtime/fallbacks.py),
and the checks read the record: an internal error of decompshard's, which `enable()`
catches so the user's program goes on (right numbers, replicated), turns `check`,
`check --model` and the zoo red naming the op; other reasons are reported with counts.

The broken derivation is a test double: derived.py's `_first_runnable` raising, so every
op that reaches decompshard's hook fails inside it, as a bug of ours would.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from decompshard.check.sweep import counts_against_us
from decompshard.cli import main
from decompshard.runtime import derived
from decompshard.runtime import fallbacks

ROOT = Path(__file__).resolve().parents[1]
PAD = "aten.reflection_pad1d.default"  # no DTensor strategy: enable() derives one
PAD_CHECK = ["check", "--ops", PAD, "--shapes", "4,6;", "--args", "[2, 1]", "--mesh", "2", "--combos", "2",
             "--jobs", "0", "--no-backward"]


@pytest.fixture
def broken(monkeypatch):
    def first_runnable(op, *args, **kwargs):
        raise RuntimeError(f"deliberately broken derivation of {op}")

    monkeypatch.setattr(derived, "_first_runnable", first_runnable)


def test_only_a_recording_sees_fallbacks_and_each_op_once_per_kind():
    fallbacks.record("aten.x.default", fallbacks.UNSUPPORTED, "outside: nobody listens")
    with fallbacks.recording_fallbacks() as log:
        for _ in range(3):
            fallbacks.record("aten.x.default", fallbacks.UNSUPPORTED, "random")
        fallbacks.record("aten.y.default", fallbacks.INTERNAL_ERROR, "boom")
    fallbacks.record("aten.z.default", fallbacks.UNSUPPORTED, "after: nobody listens")
    assert [(f.op, f.kind, f.count) for f in log.events] == [
        ("aten.x.default", "unsupported", 3), ("aten.y.default", "internal error", 1)]
    assert [f.op for f in log.internal_errors()] == ["aten.y.default"]
    with pytest.raises(ValueError, match="unknown fall-back kind"):
        fallbacks.record("aten.x.default", "tired", "")


def test_check_is_red_on_an_internal_error_naming_the_op(broken, tmp_path, capsys):
    out = tmp_path / "check.json"
    assert main([*PAD_CHECK, "--format", "json", "-o", str(out)]) == 3
    doc = json.loads(out.read_text())
    assert doc["summary"]["failures"] and all(r["ours"]["status"] == "ok" for r in doc["cases"])  # right numbers...
    assert list(doc["summary"]["fallbacks"]["internal error"]) == [PAD]  # ...from a replicated op
    assert main(PAD_CHECK) == 3
    text = capsys.readouterr().out
    assert f"internal error of decompshard at {PAD}" in text and "deliberately broken" in text


def test_check_is_green_without_the_broken_derivation(tmp_path):
    out = tmp_path / "check.json"
    assert main([*PAD_CHECK, "--format", "json", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["summary"]["fallbacks"] == {} and not doc["summary"]["failures"]


def test_data_dependent_ops_are_counted_not_failed(capsys):
    argv = ["check", "--ops", "aten.nonzero.default", "--shapes", "8", "--mesh", "2", "--combos", "1", "--jobs", "0",
            "--no-backward", "--dtype", "float64"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "data-dependent: 1 ops: aten.nonzero.default (1 case)" in text, text


def test_check_model_is_red_on_an_internal_error_naming_the_op(broken, capsys):
    argv = ["check", "--model", "_fallback_models:module", "--mesh", "2", "--placements", "S(0)"]
    assert main(argv) == 3
    text = capsys.readouterr().out
    assert "forward and backward match one device" in text  # right numbers, replicated
    assert f"internal error of decompshard at {PAD}" in text


def test_check_model_is_green_without_the_broken_derivation(capsys):
    assert main(["check", "--model", "_fallback_models:module", "--mesh", "2", "--placements", "S(0)"]) == 0
    assert "ran replicated" not in capsys.readouterr().out


def test_the_zoo_is_red_on_an_internal_error_naming_the_op(broken, tmp_path):
    out = tmp_path / "zoo.json"
    argv = ["check", "--model", "_fallback_models:padnet", "--sharding", "dp", "--jobs", "0", "--no-torch",
            "--format", "json", "-o", str(out)]
    assert main(argv) == 3
    (row,) = json.loads(out.read_text())
    assert row["enable"]["verdict"] == "ERROR" and row["enable"]["op"] == PAD, row["enable"]
    assert "internal error" in row["enable"]["detail"]


def _bench_zoo():
    spec = importlib.util.spec_from_file_location("bench_zoo", ROOT / "bench" / "zoo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_zoo_bench_exits_non_zero_and_shows_the_replicated_column(broken, capsys):
    assert _bench_zoo().main(["--models", "_fallback_models:padnet", "--shardings", "dp", "--jobs", "0"]) == 3
    text = capsys.readouterr().out
    assert "ops run replicated, enable()" in text and f"internal error: {PAD}" in text, text


def test_a_failing_case_counts_against_us_without_torch(monkeypatch):
    """--no-torch leaves nothing to excuse an error: it counts, and the check exits 3."""
    from decompshard.check import sweep
    from decompshard.verify.dtensor_case import Outcome

    assert counts_against_us({"ours": {"status": "error"}, "torch": None})
    assert not counts_against_us({"ours": {"status": "error"}, "torch": {"status": "error"}})
    assert counts_against_us({"ours": {"status": "error"}, "torch": {"status": "ok"}})
    monkeypatch.setattr(sweep, "run_case", lambda *a, **k: Outcome("error", "forward", "RuntimeError: broken"))
    assert main([*PAD_CHECK, "--no-torch"]) == 3
    assert main([*PAD_CHECK, "--no-torch", "--placements", "S(0)", "--sample", "0", "--combos", "1"]) == 3


def test_replicated_counts_reach_the_zoo_table():
    from decompshard.check.zoo_run import render

    e = {"verdict": "OK", "collectives": 1, "bytes": 8, "first_s": 0.1, "warm_s": 0.1, "detail": "", "op": "",
         "stage": "", "fallbacks": [{"op": "aten.nonzero.default", "kind": "data-dependent", "message": "",
                                     "count": 2}]}
    text = render([{"model": "m", "sharding": "dp", "enable": e, "torch": None}])
    assert "ops run replicated, enable()" in text.splitlines()[0]
    assert "- data-dependent: aten.nonzero.default (m dp)" in text
