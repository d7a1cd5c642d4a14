"""`decompshard doctor` as a user meets it: one line per check, exit 0 when everything is
OK and 3 when something is missing or failed, and never a traceback, also when a hook
point is taken away from DTensor inside this process (what a new torch release does).

The smoke run's training steps use the built-in MLP (`--model mlp`) here; the zoo's
llama, the default, is the zoo's own tests' business (tests/test_zoo.py)."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys

import torch

from _cli import ROOT, cli_env

from decompshard import _compat
from decompshard.cli import main

FINDING = re.compile(r"^  (OK|MISSING|FAILED) +[^:]+: \S")
SECTIONS = ("environment", "hook points", "registries", "smoke run")


def _doctor(tmp_path, *argv: str) -> tuple[int, dict]:
    out = tmp_path / "doctor.json"
    code = main(["doctor", "--format", "json", "-o", str(out), *argv])
    return code, json.loads(out.read_text())


def _by_name(doc: dict) -> dict[str, dict]:
    return {c["name"]: c for c in doc["checks"]}


def test_help_needs_no_torch(tmp_path):
    script = ("import sys\nfrom decompshard.cli import main\n"
              "try:\n    main(['doctor', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0\n"
              "print('TORCH', 'torch' in sys.modules)\n")
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=cli_env(tmp_path),
                         cwd=ROOT, timeout=60)
    assert got.returncode == 0, got.stderr
    assert "usage: decompshard doctor" in got.stdout and "--no-smoke" in got.stdout
    assert got.stdout.strip().endswith("TORCH False")


def test_every_check_ok_on_this_torch(tmp_path):
    code, doc = _doctor(tmp_path, "--model", "mlp")
    bad = [c for c in doc["checks"] if c["status"] != "OK"]
    assert (code, bad) == (0, [])
    assert doc["exit_code"] == 0 and doc["torch"] == torch.__version__
    assert {c["section"] for c in doc["checks"]} == set(SECTIONS)
    checks = _by_name(doc)
    # the registries' sizes are the live tables', read here without the doctor
    sp = torch.distributed.tensor.DTensor._op_dispatcher.sharding_propagator
    for table in ("op_single_dim_strategy_funcs", "op_strategy_funcs", "op_to_rules"):
        assert checks[table]["detail"] == f"{len(getattr(sp, table))} ops"
    # the filter keyword named is one the function really takes, and the other is not
    named = checks["expand_to_full_mesh_op_strategy filter keyword"]["detail"].rstrip("=")
    params = inspect.signature(_compat.expand_to_full_mesh_op_strategy).parameters
    assert named in params and ({"is_valid_strategy_cb", "full_mesh_strategy_filter"} - {named}).isdisjoint(params)
    smoke = [c for c in doc["checks"] if c["section"] == "smoke run"]
    assert [c["name"].split(" ")[0] for c in smoke] == ["model", "derive_rules(aten.addmv.default)",
                                                          "DTensor", "data-parallel", "tensor-parallel"]
    assert all("match one device" in c["detail"] for c in smoke[2:])


def test_a_missing_hook_is_one_line_and_exit_3(tmp_path, monkeypatch, capsys):
    """DTensor without its decomposition fallback: the hook is MISSING, every step that
    needs enable() FAILED with the reason, derive_rules (which does not) still OK."""
    monkeypatch.delattr(_compat.sharding_propagator(), "decomp_strategy")
    code = main(["doctor", "--model", "mlp"])
    out, err = capsys.readouterr()
    assert code == 3
    assert "Traceback" not in out + err and err == ""
    lines = {m.group(0).split(":")[0].split(None, 1)[1]: line for line in out.splitlines()
             if (m := re.match(r"^  \S+ +[^:]+", line))}
    assert lines["sharding_propagator.decomp_strategy"].startswith("  MISSING ")
    assert "decomp_strategy" in lines["sharding_propagator.decomp_strategy"]
    assert lines["derive_rules(aten.addmv.default)"].startswith("  OK ")
    for step in ("DTensor aten.addmv.default with enable()", "data-parallel training step (dp)",
                 "tensor-parallel training step (tp)"):
        assert lines[step].startswith("  FAILED ") and "decomp_strategy" in lines[step], lines[step]
    findings = [line for line in out.splitlines() if line.startswith("  ") and not line.startswith("  (")]
    assert findings and all(FINDING.match(line) for line in findings), findings
    assert out.rstrip().splitlines()[-1].startswith("1 MISSING, 3 FAILED of ")


def test_a_torch_layer_that_does_not_import_is_one_line(tmp_path, monkeypatch):
    """A torch without a private API decompshard needs at import: `_compat` raises; the
    doctor says so in one line and checks nothing it cannot."""
    monkeypatch.setitem(sys.modules, "decompshard._compat", None)
    code, doc = _doctor(tmp_path, "--no-smoke")
    assert code == 3
    checks = _by_name(doc)
    layer = checks["decompshard's torch layer (_compat)"]
    assert layer["status"] == "MISSING" and layer["detail"].startswith("ModuleNotFoundError: ")
    assert {c["section"] for c in doc["checks"]} == {"environment"}


def test_each_smoke_step_has_its_own_deadline(tmp_path):
    code, doc = _doctor(tmp_path, "--model", "mlp", "--timeout", "0.01")
    steps = [c for c in doc["checks"] if c["section"] == "smoke run" and c["name"] != "model"]
    assert code == 3 and len(steps) == 4
    assert all(c["status"] == "FAILED" and c["detail"].startswith("no answer within 0.01 s") for c in steps)


def test_a_missing_zoo_library_falls_back_to_the_mlp(monkeypatch):
    from decompshard.doctor.smoke import MLP, pick_model

    monkeypatch.setitem(sys.modules, "transformers", None)
    entry, line = pick_model("llama")
    assert entry is MLP and line.status == "OK"
    assert line.detail.startswith("transformers is not installed") and "llama" in line.detail


def test_an_unknown_model_is_a_usage_error(capsys):
    assert main(["doctor", "--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_the_fallback_parameters_are_what_dtensor_passes(monkeypatch):
    """`decomp_strategy_parameters()` reads a signature; DTensor, running an op without a
    strategy (addmv) through its own fallback, passes exactly that many arguments."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from decompshard.runtime.enable import switched
    from decompshard.verify.dtensor_case import device_mesh, simulated_world, simulation

    fallback = _compat.sharding_propagator().decomp_strategy
    original, calls = fallback.propagate_strategy, []

    def recording(*args, **kwargs):
        calls.append((len(args), set(kwargs)))
        return original(*args, **kwargs)

    monkeypatch.setattr(fallback, "propagate_strategy", recording)
    expected = _compat.decomp_strategy_parameters()
    with simulated_world(2), switched(False):
        _compat.clear_dtensor_caches()
        mesh = device_mesh((2,))
        with simulation(2):
            bias, mat = (distribute_tensor(torch.randn(*s), mesh, [Replicate()]) for s in ((4,), (4, 6)))
            torch.addmv(bias, mat, distribute_tensor(torch.randn(6), mesh, [Shard(0)]))
    assert calls, "DTensor never reached its decomposition fallback"
    n_args, keywords = calls[0]
    assert n_args + len(keywords) == len(expected) and keywords <= set(expected)
