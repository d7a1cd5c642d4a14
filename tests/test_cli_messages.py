"""The messages a newcomer meets (issue 36): each one clear line on stderr, the right
exit code, never a traceback from inside torch. In-process (`main(argv)`) where that is
the same as a real run; a real process where the point is what reaches the terminal."""

from __future__ import annotations

from io import StringIO

import pytest

from decompshard.cli import main
from decompshard.explain.command import ExplainShell, build_call
from decompshard.op_names import resolve_op


def cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_error_line(err: str, command: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"decompshard {command}: error: "), err
    assert "Traceback" not in err
    return lines[0]


ADDMV = ("aten.addmv.default", "--shapes", "4;4,12;12")


# ------------------------------------------------------------------ unknown op names


def test_unknown_op_names_the_nearest_overloads(capsys):
    with pytest.raises(ValueError, match=r"unknown op 'aten.addmvv.default'.*did you mean aten\.addmv\.default"):
        resolve_op("aten.addmvv.default")
    with pytest.raises(ValueError, match=r"did you mean aten\.mm\.default"):
        resolve_op("aten.mmm")
    # a namespace torch does not know gets the --import hint, not aten names
    with pytest.raises(ValueError) as e:
        resolve_op("mylib.fused.default")
    assert "did you mean" not in str(e.value) and "--import MODULE" in str(e.value)
    rc, out, err = cli(capsys, "explain", "aten.addmvv.default", "--shapes", "4;4,12;12")
    assert rc == 2 and not out
    assert "did you mean aten.addmv.default" in one_error_line(err, "explain")


# ------------------------------------------------------------------ mesh shapes


def test_a_bad_mesh_lists_the_forms_and_aliases_accepted(capsys):
    rc, out, err = cli(capsys, "check", "--mesh", "4d", "--ops", "aten.addmv.default", "-j", "0")
    line = one_error_line(err, "check")
    assert rc == 2 and not out
    assert "malformed mesh '4d'" in line and "6, 2x3 or 2x2x2" in line
    assert "1d (= 6), 2d (= 2x3), 3d (= 2x2x2)" in line  # check's aliases
    rc, out, err = cli(capsys, "explain", *ADDMV, "--mesh", "4d", "--mesh-placements", "R;R;R")
    line = one_error_line(err, "explain")
    assert rc == 2 and "malformed mesh '4d'" in line and "6, 2x3 or 2x2x2" in line


# ------------------------------------------------------------------ doctor --model


def test_doctor_refuses_an_unknown_model_even_without_the_smoke_run(capsys):
    for extra in (["--no-smoke"], []):
        rc, out, err = cli(capsys, "doctor", "--model", "nosuch", *extra)
        line = one_error_line(err, "doctor")
        assert rc == 2 and not out, extra
        assert "unknown model 'nosuch'; known: mlp, llama" in line


# ------------------------------------------------------------------ a missing model library


def _not_installed(name: str):
    def missing(*args, **kwargs):
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    return missing


def test_check_zoo_without_transformers_says_install_it(capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # as if it were not installed
    rc, out, err = cli(capsys, "check", "--model", "llama", "--sharding", "dp", "-j", "0")
    line = one_error_line(err, "check")
    assert rc == 2 and not out  # no table of ERROR rows, nothing counted against decompshard
    assert "the zoo's llama needs transformers, and transformers is not installed: pip install transformers" in line
    assert "pip install -e '.[test,torch2" in line
    rc, out, err = cli(capsys, "check", "--model", "Qwen2ForCausalLM", "--sharding", "dp", "-j", "0")
    assert rc == 2 and "transformers is not installed" in one_error_line(err, "check")


def test_transformers_does_not_need_torchvision(monkeypatch):
    """The doctor on 2.13 said 'transformers is not installed (No module named
    'torchvision')': transformers was refused for want of a library it does not need."""
    from decompshard.check import ecosystem
    from decompshard.doctor.smoke import pick_model

    monkeypatch.setattr(ecosystem, "import_torchvision", _not_installed("torchvision"))
    assert ecosystem.import_transformers().__name__ == "transformers"
    entry, line = pick_model("llama")
    assert entry.name == "llama" and line.status == "OK" and "not installed" not in line.detail


def test_doctor_names_the_package_that_is_missing(monkeypatch):
    from decompshard.check import ecosystem
    from decompshard.doctor.smoke import MLP, pick_model

    monkeypatch.setattr(ecosystem, "import_torchvision", _not_installed("torchvision"))
    entry, line = pick_model("resnet")
    assert entry is MLP and line.status == "OK"
    assert line.detail.startswith("torchvision is not installed (pip install torchvision, or in a decompshard "
                                  "checkout pip install -e '.[test,torch2")
    assert "instead of the zoo's resnet" in line.detail
    # transformers there, but a package it imports missing: that package is the one named
    monkeypatch.setattr(ecosystem, "import_transformers", _not_installed("tokenizers"))
    entry, line = pick_model("llama")
    assert entry is MLP and line.detail.startswith("tokenizers is not installed (pip install tokenizers")


# ------------------------------------------------------------------ a model that fails on one device

LINEAR_16 = """
import torch


def build():
    return torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
"""


def test_a_model_that_fails_on_one_device_is_one_line(tmp_path):
    """Input shapes that do not fit the model: the model's own error, once, no `[rank0]`
    traceback (check) and no FakeTensor log (coverage)."""
    from tests._cli import run_cli

    (tmp_path / "mymodule.py").write_text(LINEAR_16)
    spec = f"{tmp_path / 'mymodule.py'}:build"
    for argv in (["check", "--model", spec, "--input-shapes", "8,17", "--mesh", "2"],
                 ["coverage", "--model", spec, "--input-shapes", "8,17", "-j", "1", "--opinfo-samples", "1"]):
        got = run_cli(*argv, cache_dir=tmp_path)
        line = one_error_line(got.stderr, argv[0])
        assert got.returncode == 2 and not got.stdout, argv
        # torch's own message, as the release words it (2.15 prefixes "addmm: ")
        assert "Sequential fails on one device, before any sharding, with input shapes 8,17: RuntimeError: " in line
        assert line.endswith("mat1 and mat2 shapes cannot be multiplied (8x17 and 16x8)"), line


# ------------------------------------------------------------------ commas in explain's 1-D placements


def test_explain_refuses_commas_between_single_dim_placements(capsys):
    """In check (and --mesh-placements) ',' separates mesh dims and ';' tensors; explain
    read 'R,S(1),S(0)' as three tensors, silently. Now it says which separator to use."""
    rc, out, err = cli(capsys, "explain", *ADDMV, "-p", "R,S(1),S(0)")
    line = one_error_line(err, "explain")
    assert rc == 2 and not out
    assert "separate the tensor inputs' placements with ';' ('R;S(1);S(0)')" in line
    assert "--mesh-placements" in line
    rc, out, err = cli(capsys, "explain", *ADDMV, "-p", "R;S(1),S(0);R")
    assert rc == 2 and "a ',' separates mesh dims" in one_error_line(err, "explain")
    rc, out, err = cli(capsys, "explain", *ADDMV, "-p", "R;S(1);S(0)", "-q")
    assert rc == 3 and not err and "REJECTED" in out
    shell_out = StringIO()
    shell = ExplainShell(build_call(*ADDMV[:1], ADDMV[2]), stdin=StringIO(), stdout=shell_out)
    shell.onecmd("R,S(1),S(0)")  # the REPL too
    assert shell_out.getvalue().startswith("error: placements 'R,S(1),S(0)': separate")


# ------------------------------------------------------------------ explain: one coherent answer


MM = ("aten.mm.default", "--shapes", "4,6;6,8")


def test_explain_an_op_only_dtensor_s_own_strategy_decides(capsys):
    """aten.mm has a strategy of DTensor's and no decomposition: the answer is that
    strategy's, not 'unsupported' (exit 1) after saying DTensor runs the candidate."""
    rc, out, err = cli(capsys, "explain", *MM, "--placements", "S(0);R")
    assert rc == 0 and not err
    assert "unsupported" not in out and "neither a decomposition" not in out
    text = " ".join(out.split())
    assert "DTensor has its own strategy for this op" in text
    assert "decompshard derives nothing to compare it with (no decomposition)" in text
    assert "verdict: ACCEPTED by DTensor's own strategy, no redistribution needed: S(0), R -> S(0)" in text
    rc, out, err = cli(capsys, "explain", *MM, "--placements", "S(1);S(1)", "-q")
    assert rc == 3 and not err  # as for a rejected candidate: it needs redistribution
    assert "verdict: REDISTRIBUTED first by DTensor: none of its own rules takes (S(1), S(1)) as it is; " \
           "the nearest: S(1), S(0) -> P(sum)" in " ".join(out.split())
    assert "DTensor's own rules" not in out  # -q: the verdict lines only


def test_explain_mesh_quiet_prints_the_verdict_and_exits_as_the_1d_form(capsys):
    mesh = ("--mesh", "2x4", "--mesh-placements")
    rc, out, err = cli(capsys, "explain", *ADDMV, *mesh, "R,S(0);S(1),S(0);S(0),R", "-q")
    assert rc == 3 and not err  # the chosen strategy moves self: needs redistribution, as -p "R;S(1);S(0)"
    assert " ".join(out.split()).endswith(
        "verdict: on mesh 2x4: REDISTRIBUTE first: the cheapest strategy (#1, 0.00 µs modeled) moves "
        "self (R, S(0)) -> (P(sum), S(0))")
    rc, out, err = cli(capsys, "explain", *ADDMV, *mesh, "S(0),S(0);S(0),S(0);R,R", "-q")
    assert rc == 0 and not err
    assert "verdict: on mesh 2x4: ACCEPTED, no redistribution needed" in " ".join(out.split())
    assert len(out.splitlines()) <= 3  # the header and the verdict, no tables
