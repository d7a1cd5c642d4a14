"""The commands on custom ops (tests/_custom_ops_lib.py), named like aten ops once
`--import MODULE` (or `--model MODULE:CALLABLE`) has imported the module defining them.

The commands run in this process (`--import _custom_ops_lib`: the module the other
custom-op tests import, so its ops are registered once). coverage --model and the check
sweep run their ops in worker processes, which must import the module themselves to
know its ops (they failed with "unknown op" before they did).
"""

from __future__ import annotations

import json

import pytest
import torch

import _custom_ops_lib  # noqa: F401  (registers the dstest_lib ops in this process)
from decompshard.cli import main

LIB = "_custom_ops_lib"
ROTARY = ["--shapes", "4,5,2,8;4,5,2,8;4,5,8;4,5,8;", "--args", "2"]


def cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------ explain


def test_explain_custom_op_derives_from_its_implementation(capsys):
    rc, out, _ = cli(capsys, "explain", "--import", LIB, "dstest_lib.rmsnorm.default",
                     "--shapes", "4,6,16;16;", "--args", "1e-6", "--placements", "S(0);R")
    assert rc == 0, out
    assert "ACCEPTED" in out and "S(0), R -> S(0)" in out
    assert "mean.dim" in out  # the trace of its implementation, which explain names
    assert "(traced: custom op dstest_lib.rmsnorm.default's implementation)" in out
    # the normalized dim is reduced over: sharding it needs redistribution (exit 3)
    rc, out, _ = cli(capsys, "explain", "--import", LIB, "dstest_lib.rmsnorm.default",
                     "--shapes", "4,6,16;16;", "--args", "1e-6", "--placements", "S(2);S(0)", "-q")
    assert rc == 3 and "REJECTED" in out, out


@pytest.mark.parametrize("placements, rc, verdict", [("S(2);S(2);R;R", 0, "ACCEPTED"),
                                                     ("S(3);S(3);R;R", 3, "REJECTED")],
                         ids=["heads", "head_dim"])
def test_explain_opaque_custom_op_uses_its_reference(capsys, placements, rc, verdict):
    """np_rotary's kernel is numpy: explain traces its registered reference, and says so."""
    got, out, _ = cli(capsys, "explain", "--import", LIB, "dstest_lib.np_rotary.default", *ROTARY,
                      "--placements", placements)
    assert got == rc and verdict in out, out
    assert "(traced: custom op dstest_lib.np_rotary.default's registered reference np_rotary_reference)" in out


def test_explain_opaque_custom_op_without_reference_names_register_reference(capsys):
    rc, out, err = cli(capsys, "explain", "--import", LIB, "dstest_lib.loop_scale.default", "--shapes", "4,6")
    assert rc == 1, (out, err)
    line = next(l for l in out.splitlines() if l.startswith("unsupported:"))
    assert "dstest_lib.loop_scale.default" in line and "decompshard.register_reference" in line, line


@pytest.mark.parametrize("argv, message", [
    (["explain", "dstest_nolib.rmsnorm.default", "--shapes", "4,6;6;", "--args", "1e-6"], "--import MODULE"),
    (["explain", "--import", "no_such_module_xyz", "aten.mul.Tensor", "--shapes", "2;2"],
     "--import: cannot import 'no_such_module_xyz'"),
    (["check", "--import", LIB, "--ops", "dstest_lib.rotary.default", "-q"], "give its inputs with --shapes"),
    (["check", "--import", LIB, "--ops", "dstest_lib.rotary.*", *ROTARY], "one exact op"),
])
def test_bad_custom_op_arguments_exit_2_with_one_line(capsys, argv, message):
    rc, _, err = cli(capsys, *argv)
    assert rc == 2
    assert message in err and len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------ check


def test_check_custom_op_sweep_in_a_worker(capsys, tmp_path):
    """The sweep's worker process imports the --import module, runs the op's cases."""
    out = tmp_path / "check.json"
    rc, _, _ = cli(capsys, "check", "--import", LIB, "--ops", "dstest_lib.rotary.default", *ROTARY,
                   "--dtype", "float64", "--mesh", "3,2x2", "--combos", "1", "--jobs", "1", "--no-torch",
                   "--format", "json", "-o", str(out), "-q")
    assert rc == 0
    cases = json.loads(out.read_text())["cases"]
    assert len(cases) == 2 and {c["mesh"] for c in cases} == {"3", "2x2"}, cases
    assert all(c["ours"]["status"] == "ok" for c in cases), cases
    assert all("--shapes" in c["given"] and f"--import {LIB}" in c["given"] for c in cases)


def test_check_opaque_custom_op_one_case(capsys):
    """One case with placements: the numpy kernel on local shards (its references
    registered by the module), forward and backward, against one device; torch alone
    has no strategy for it."""
    rc, out, _ = cli(capsys, "check", "--import", LIB, "--ops", "dstest_lib.np_rotary.default", *ROTARY,
                     "--dtype", "float64", "--mesh", "3", "--sample", "0", "--placements", "S(0);S(0);R;R")
    assert rc == 0, out
    assert "decompshard: ok" in out
    assert "does not have a sharding strategy" in out  # torch's own fallback


# ------------------------------------------------------------------ in worker processes


def test_coverage_model_lists_custom_ops_with_status_and_rules(capsys, tmp_path):
    """A model calling custom ops: the audit derives them in a worker process (which
    imports the model's module), like aten ops: status, call count, rules."""
    out = tmp_path / "model.json"
    rc, _, _ = cli(capsys, "coverage", "--model", f"{LIB}:build_model", "--format", "json", "-o", str(out),
                   "-q", "-j", "1")
    assert rc == 0
    ops = {r["op"]: r for r in json.loads(out.read_text())["ops"]}
    for name in ("dstest_lib.rmsnorm.default", "dstest_lib.rotary.default", "dstest_lib.swiglu.default",
                 "dstest_lib.rmsnorm_backward.default"):  # the last one: called by rmsnorm's backward
        assert ops[name]["status"] == "derived" and ops[name]["calls"] == 1, ops[name]
    rules = {name: set(ops[name]["derived_rules"]) for name in ops if name.startswith("dstest_lib.")}
    assert "S(0), R -> S(0)" in rules["dstest_lib.rmsnorm.default"]
    assert "S(0), S(0), R -> S(0), P(sum)" in rules["dstest_lib.rmsnorm_backward.default"]
    assert "S(2), S(2), R, R -> S(2), S(2)" in rules["dstest_lib.rotary.default"]
    assert not any("S(3)" in r for r in rules["dstest_lib.rotary.default"])  # head_dim: rotate_half pairs


def test_check_model_with_custom_ops_compares_them_too(capsys):
    """check --model: one training step of a model calling rmsnorm, rotary and swiglu
    (and rmsnorm_backward in its backward), sharded on the sequence over 2 ranks: the
    custom ops' own outputs are compared with one device, not only the aten ops after
    them, and the step matches."""
    from decompshard.dispatch_modes.record import RecordCallOutputs

    x = torch.randn(2, 3, 4, dtype=torch.float64)
    with RecordCallOutputs() as rec:
        _custom_ops_lib.silu_mul(x, x)
    assert [c[0] for c in rec.calls] == ["dstest_lib.silu_mul.default"]
    rc, out, _ = cli(capsys, "check", "--model", f"{LIB}:build_model", "--mesh", "2", "--placements", "S(1)")
    assert rc == 0 and "forward and backward match one device" in out, out


def test_import_user_module_file_once(tmp_path):
    """A .py file named twice (--import and --model, or again in a worker) runs once: a
    second run would register its custom ops again, which torch refuses."""
    from decompshard import user_modules
    from decompshard.errors import UsageError

    path = tmp_path / "ops_once.py"
    path.write_text(
        "import torch\n"
        "@torch.library.custom_op('dstest_once::double', mutates_args=())\n"
        "def double(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x * 2\n")
    first = user_modules.import_user_module(str(path))
    assert user_modules.import_user_module(str(path)) is first
    assert user_modules.imported()[-1] == str(path)
    assert torch.ops.dstest_once.double.default(torch.ones(2)).tolist() == [2.0, 2.0]
    with pytest.raises(UsageError, match="--import: cannot import .*no such file"):
        user_modules.import_user_module(str(tmp_path / "missing.py"))
