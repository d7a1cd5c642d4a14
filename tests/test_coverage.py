"""`decompshard coverage`: the JSON schema, statuses of known ops, diffs, bad arguments, the
worker pool's timeout/crash handling and a --model audit (tests/_tiny_model.py).

Every sweep here uses `--opinfo-samples 1` (the first sample input of each OpInfo): the
capture is cached in-process, so the whole module pays it once (~7 s).
"""

from __future__ import annotations

import csv
import io
import json
import os
import pickle
import time

import pytest
import torch

from decompshard import derive_rules, resolve_op
from decompshard.cli import main
from decompshard.coverage import report as rep
from decompshard.coverage.opinfo_samples import capture_aten_samples
from decompshard.coverage.report import Progress
from decompshard.coverage.sweep import (STATUSES, make_job, new_record, pick_samples, run_jobs,
                                        shapes_text)

SMALL = ",".join([
    "aten.mul.Tensor",  # native
    "aten.addmv.default",  # derived
    "aten.block_diag.default",  # derived; torch's fallback trips on a factory op
    "aten.complex.default",  # derived via stack (it used to write through a view)
    "aten.dist.default",  # replicate-only: its p-norm blocks every Partial
    "aten.normal.Tensor_Tensor",  # random: unsupported
    "aten.nonzero.default",  # no decomposition; data-dependent: replicate-only under enable()
    "aten.soft_margin_loss_backward.default",  # decomposable, never reached by OpInfo (nor its backward)
    "aten.pixel_*",  # a glob
])
FAST = ["--opinfo-samples", "1", "-j", "1", "-q"]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("cov") / "small.json"
    assert main(["coverage", "--ops", SMALL, "--format", "json", "-o", str(out), *FAST]) == 0
    return json.loads(out.read_text())


def _op(doc: dict, name: str) -> dict:
    return next(r for r in doc["ops"] if r["op"] == name)


# ------------------------------------------------------------------ schema


def test_json_schema(small):
    assert isinstance(small["version"], str) and small["torch_version"] == torch.__version__
    names = [r["op"] for r in small["ops"]]
    assert names == sorted(names)
    assert {"aten.pixel_shuffle.default", "aten.pixel_unshuffle.default"} <= set(names)
    ints = ("n_derived", "n_confirmed", "n_incorrect", "n_missed", "n_truth")
    for r in small["ops"]:
        assert r["status"] in STATUSES and isinstance(r["reason"], str)
        assert all(isinstance(r[k], int) and r[k] >= 0 for k in ints)
        assert isinstance(r["derived_rules"], list) and all(isinstance(x, str) for x in r["derived_rules"])
        assert isinstance(r["missed"], list) and isinstance(r["seconds"], float)
        assert isinstance(r["samples"], list)
        tf = r["torch_fallback"]
        assert tf["status"] in ("supported", "replicate-only", "unsupported", "n/a")
        assert all(isinstance(tf[k], int) for k in ("n_rules", "n_confirmed", "n_incorrect", "n_missed"))
        assert isinstance(tf["rules"], list)
        for s in r["samples"]:
            assert isinstance(s["shapes"], str) and isinstance(s["n_derived"], int)
    summary = small["summary"]
    assert summary["ops"] == len(small["ops"]) == sum(summary["status"].values())
    for side in ("decompshard", "torch_fallback"):
        for key in ("precision", "precision_mean", "recall", "recall_mean"):
            assert summary[side][key] is None or 0.0 <= summary[side][key] <= 1.0
    json.dumps(small)  # round-trips


# ------------------------------------------------------------------ statuses


def test_native_op_is_not_derived(small):
    r = _op(small, "aten.mul.Tensor")
    assert r["status"] == "native" and r["registry"] == "single-dim"
    assert r["samples"] == [] and r["n_derived"] == 0


def test_addmv_is_derived_and_verified(small):
    r = _op(small, "aten.addmv.default")
    assert r["status"] == "derived"
    assert r["n_derived"] > 0 and r["n_incorrect"] == 0 and r["n_confirmed"] == r["n_derived"]
    assert "P(sum), S(1), S(0) -> P(sum)" in r["derived_rules"]  # bias must be partial too
    assert r["torch_fallback"]["status"] == "supported"


def test_block_diag_derived_where_torch_fallback_fails(small):
    r = _op(small, "aten.block_diag.default")
    assert r["status"] == "derived" and r["n_incorrect"] == 0 and r["n_derived"] > 0
    tf = r["torch_fallback"]
    assert tf["status"] == "unsupported" and tf["n_rules"] == 0 and tf["reason"]


def test_statuses_agree_with_derive_rules(small):
    """Re-derive every swept op on the same samples: the record is what derive_rules says."""
    captured = capture_aten_samples(max_samples_per_opinfo=1, backward=True)  # what the sweep captured
    checked = 0
    for r in small["ops"]:
        if r["status"] == "native" or not r["samples"]:
            continue
        results = [derive_rules(r["op"], *s.args, **s.kwargs) for s in pick_samples(captured[resolve_op(r["op"])], 2)]
        assert [x["shapes"] for x in r["samples"]] == [shapes_text(s.args, s.kwargs) for s in
                                                       pick_samples(captured[resolve_op(r["op"])], 2)]
        assert r["n_derived"] == sum(len(d.rules) for d in results), r["op"]
        assert r["derived_rules"] == list(dict.fromkeys(x for d in results for x in d.as_strings()))
        assert (r["status"] == "derived") == any(d.rules for d in results), r["op"]
        reasons = [d.unsupported_reason for d in results if d.unsupported_reason]
        if r["status"] != "derived" and reasons:
            assert r["reason"] == reasons[0]
        checked += 1
    assert checked >= 5


def test_complex_is_derived_now(small):
    # complex.default used to be refused (its decomposition copied into a view); it now
    # decomposes via stack, and every derived rule checks out numerically.
    r = _op(small, "aten.complex.default")
    assert r["status"] == "derived" and r["n_incorrect"] == 0 and r["n_confirmed"] == r["n_derived"] > 0


def test_random_and_replicate_only(small):
    r = _op(small, "aten.normal.Tensor_Tensor")
    assert r["status"] == "unsupported" and r["reason"].startswith("random:")
    assert r["torch_fallback"]["status"] == "unsupported" and r["n_truth"] == 0  # never verified
    r = _op(small, "aten.dist.default")
    assert r["status"] == "replicate-only" and "no non-trivial rule survives" in r["reason"]
    assert "blocked at aten.norm" in r["reason"]  # names the primitive every candidate died at
    assert r["n_derived"] == 0 and r["n_missed"] == r["n_truth"]


def test_no_decomposition_and_no_sample(small):
    r = _op(small, "aten.nonzero.default")  # enable() runs it replicated, and a DTensor run checked it
    assert r["status"] == "replicate-only" and "output size depends on values" in r["reason"]
    r = _op(small, "aten.soft_margin_loss_backward.default")
    assert r["status"] == "unsupported" and "no sample inputs" in r["reason"] and r["backward"]


# ------------------------------------------------------------------ rendering


def test_text_table_fits_width_and_stdout_json_is_clean(capsys):
    assert main(["coverage", "--ops", "aten.addmv.default,aten.nonzero.default", *FAST[:-1]]) == 0
    out, err = capsys.readouterr()
    assert "aten.addmv.default" in out and "Summary" in out and "coverage:" in err
    assert main(["coverage", "--ops", "aten.addmv.default", "--format", "json", *FAST[:-1]]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["ops"][0]["op"] == "aten.addmv.default" and "coverage:" in err


LONGEST = "aten._scaled_dot_product_flash_attention_for_cpu.default"  # the longest name OpInfo reaches


def _long_doc() -> dict:
    long = new_record(LONGEST)
    long.update(status="replicate-only", reason="no non-trivial rule survives; blocked at " + "aten.bmm.default, " * 12,
                samples=[{"shapes": "[4]"}], verified=True, n_truth=4, n_missed=4)
    long["torch_fallback"].update(status="supported", n_rules=10, n_confirmed=10, n_missed=12)
    derived = new_record("aten.addmv.default")
    derived.update(status="derived", derived_rules=["S(0), S(0), R -> S(0)", "P(sum), S(1), S(0) -> P(sum)"],
                   n_derived=2, n_confirmed=2, n_truth=2, verified=True, samples=[{"shapes": "[4]"}])
    return rep.build_report([long, derived, new_record("aten.y.default")])


@pytest.mark.parametrize("width", [None, 160, 100, 80, 64])
def test_text_report_fits_the_width_and_never_cuts_a_name(width):
    """At any width every line fits (the reason wraps, or moves under its row, or the op
    gets a line of its own) and every op name and reason word is there whole; without a
    width (a pipe, a file) each op is one line."""
    doc = _long_doc()
    text = rep.render(doc, "text", width=width, show_rules=True)
    lines = text.splitlines()
    if width is not None:
        assert max(len(line) for line in lines) <= width
    else:
        assert any(line.startswith(LONGEST) and line.endswith("aten.bmm.default,") for line in lines)
    words = " ".join(text.split())
    assert any(line.startswith(LONGEST) for line in lines)
    assert "..." not in text
    assert words.count("aten.bmm.default,") == 12
    assert "  P(sum), S(1), S(0) -> P(sum)" in lines  # --show-rules: one rule a line


def test_one_cell_format_per_table_and_legends_where_they_apply():
    doc = _long_doc()
    random_op = new_record("aten.normal.Tensor_Tensor")  # has samples, never checked (random)
    random_op.update(status="unsupported", samples=[{"shapes": "[4]"}], n_derived=0, reason="random: ...")
    table = rep.render_table([*doc["ops"], random_op], "text")
    cells = {line.split()[0]: line.split()[2:4] for line in table.splitlines()[2:] if line.startswith("aten.")}
    assert cells["aten.addmv.default"] == ["2/2/0/0", "-"]
    assert cells[LONGEST] == ["0/0/0/4", "10/10/0/12"]
    assert cells["aten.normal.Tensor_Tensor"] == ["0/-/-/-", "-"]  # same four parts, '-' where unchecked
    assert cells["aten.y.default"] == ["-", "-"]
    assert rep.LEGEND_CHECKED.split(":")[0] in table
    # nothing checked anywhere (--no-verify, --model): bare counts, and a legend that says so
    unchecked = [dict(r, verified=False) for r in doc["ops"]]
    table = rep.render_table(unchecked, "text")
    assert "rules claimed (no numerical check ran)" in table and "confirmed" not in table
    assert [line.split()[2] for line in table.splitlines()[2:5]] == ["0", "2", "-"]
    # only native ops: no counts, no legend
    native = new_record("aten.mul.Tensor")
    native.update(status="native", reason="registered single-dim strategy")
    assert "decompshard, torch (" not in rep.render_table([native], "text")


def test_markdown_and_csv(small):
    md = rep.render(small, "markdown")
    assert "| aten.addmv.default" in md and "| native" in md
    csv_text = rep.render(small, "csv")
    assert csv_text.splitlines()[0].startswith("op,status,registry,n_derived")
    assert len(csv_text.splitlines()) == len(small["ops"]) + 1
    rows = list(csv.DictReader(io.StringIO(rep.render(small, "csv", show_rules=True))))
    addmv = next(r for r in rows if r["op"] == "aten.addmv.default")
    assert addmv["derived_rules"].split("; ") == _op(small, "aten.addmv.default")["derived_rules"]


def test_progress_eta_tty_and_plain():
    now = [0.0]
    plain = io.StringIO()
    p = Progress(10, stream=plain, interval=5.0, clock=lambda: now[0])
    for i in range(10):
        now[0] += 3.0 if i else 10.0  # the first item pays for warming up
        p.step(f"op{i}")
    lines = plain.getvalue().splitlines()
    # a line every 5 s, and the last; the ETA comes from the items after the first
    assert lines[0] == "coverage: ops 1/10 (10 s)"
    assert lines[1] == "coverage: ops 3/10 (16 s, ETA 21 s)"
    assert lines[-1] == "coverage: ops 10/10 (37 s)"

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    p = Progress(3, stream=tty, label="OpInfos")
    for i in range(3):
        p.update(i + 1, 3, f"opinfo{i}")
    p.close()
    assert tty.getvalue().count("\r") >= 3 and "\n" not in tty.getvalue() and "OpInfos 2/3" in tty.getvalue()

    verbose = io.StringIO()
    p = Progress(2, stream=verbose, verbose=True)
    p.step("aten.addmv.default", {"status": "derived", "seconds": 1.25})
    assert verbose.getvalue() == "coverage: [1/2] aten.addmv.default: derived (1.2 s)\n"


# ------------------------------------------------------------------ diff


def _doc(records: list[dict]) -> dict:
    return rep.build_report(records)


def test_diff_two_reports(tmp_path, capsys):
    a1, a2 = new_record("aten.a.default"), new_record("aten.a.default")  # old, new
    b1, b2 = new_record("aten.b.default"), new_record("aten.b.default")
    a1.update(status="derived", derived_rules=["S(0) -> S(0)", "R -> P(sum)"], n_derived=2, n_confirmed=2, n_truth=2)
    a2.update(status="derived", derived_rules=["S(0) -> S(0)", "S(1) -> S(1)"], n_derived=2, n_confirmed=2, n_truth=2)
    b1.update(status="replicate-only")
    b2.update(status="unsupported", reason="no decomposition")
    c = new_record("aten.c.default")
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    old.write_text(json.dumps(_doc([a1, b1])))
    new.write_text(json.dumps(_doc([a2, b2, c])))
    assert main(["coverage", "--diff", str(old), str(new)]) == 0
    out = capsys.readouterr().out
    assert "replicate-only -> unsupported" in out
    assert "+S(1) -> S(1)" in out and "-R -> P(sum)" in out and "+1/-1" in out
    assert "(absent) -> unsupported" in out
    assert "Summary changes" in out and "replicate-only" in out
    assert main(["coverage", "--diff", str(old), str(new), "--format", "json"]) == 0
    d = json.loads(capsys.readouterr().out)
    by_op = {x["op"]: x for x in d["changes"]}
    assert by_op["aten.a.default"]["gained"] == ["S(1) -> S(1)"]
    assert d["summary"]["unsupported"] == {"old": 0, "new": 2, "delta": 2}
    assert main(["coverage", "--diff", str(old), str(old)]) == 0
    assert "no per-op changes" in capsys.readouterr().out


def test_diff_counts_the_rules_of_ops_that_appear_or_disappear():
    a = new_record("aten.a.default")
    a.update(status="derived", derived_rules=["S(0) -> S(0)", "S(1) -> S(1)"], n_derived=2)
    a["torch_fallback"]["n_rules"] = 4
    old, new = _doc([a]), _doc([new_record("aten.b.default")])
    d = rep.diff_reports(old, new)
    gone = next(c for c in d["changes"] if c["op"] == "aten.a.default")
    assert gone["lost"] == ["S(0) -> S(0)", "S(1) -> S(1)"] and gone["torch_rules"] == [4, None]
    text = rep.render_diff(d, "text")
    row = next(line for line in text.splitlines() if line.startswith("aten.a.default"))
    assert "+0/-2" in row and "4 -> -" in row and "None" not in text
    back = rep.render_diff(rep.diff_reports(new, old), "text")
    assert "+2/-0" in next(line for line in back.splitlines() if line.startswith("aten.a.default"))


def test_the_cli_knows_the_statuses_without_importing_the_sweep(tmp_path):
    """`--status` is checked before anything heavy loads: the CLI's own copy of the status
    names rejects a bad one and lists them all with neither the sweep nor torch imported
    (a fresh process), and that copy is the sweep's list, in its order."""
    import subprocess
    import sys

    from _cli import ROOT, cli_env

    from decompshard.coverage import command

    assert command.STATUSES == STATUSES
    code = ("import sys; from decompshard.cli import main; rc = main(['coverage', '--status', 'bogus']); "
            "print(rc, [m for m in ('decompshard.coverage.sweep', 'torch') if m in sys.modules])")
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(tmp_path),
                         cwd=ROOT, timeout=60)
    assert got.stdout.strip() == "2 []", (got.stdout, got.stderr)
    assert "unknown --status 'bogus'" in got.stderr and ", ".join(STATUSES) in got.stderr


# ------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize("argv, message", [
    (["--ops", "aten.no_such_op.default"], "unknown op"),
    (["--ops", "aten.add_.t"], "no dispatcher entry"),
    (["--ops", "aten.zz_no_match*", *FAST], "matches no aten op"),
    (["--model", "no_such_module_xyz:build"], "cannot import 'no_such_module_xyz'"),
    (["--model", "_tiny_model:nope"], "has no attribute"),
    (["--model", "_tiny_model:not_a_model"], "expected an nn.Module"),
    (["--model", "_tiny_model:build"], "--input-shapes"),
    (["--model", "_tiny_model:build", "--input-shapes", "4,x"], "--input-shapes"),
    (["--model", "no_colon"], "MODULE:CALLABLE"),
    (["--diff", "/nonexistent/old.json", "/nonexistent/new.json"], "cannot read coverage report"),
    (["--timeout", "0"], "--timeout"),
    (["--ops", "aten.mul.Tensor", "-o", "/nonexistent/dir/report.txt"], "cannot write --output"),
    (["--status", "bogus"], "unknown --status"),
    (["--ops", "aten.mul.Tensor", "--model", "_tiny_model:build"], "cannot be combined"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    assert main(["coverage", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_diff_rejects_a_non_report(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"not": "a report"}')
    assert main(["coverage", "--diff", str(bad), str(bad)]) == 2
    assert "not a decompshard coverage JSON report" in capsys.readouterr().err


# ------------------------------------------------------------------ workers


class _Hang:
    """A job that writes its worker's pid to `marker`, sleeps a minute, then writes
    'finished': read after the pool returns, the file says whether the worker was killed
    at the deadline or waited for."""

    def __init__(self, marker) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        code = (f"import os, time\nopen({self.marker!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)\n"
                f"open({self.marker!r}, 'a').write(' finished')")
        return (exec, (code,))


class _Die:
    def __reduce__(self):
        return (os._exit, (7,))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_workers_survive_hangs_and_crashes(capfd, tmp_path):
    """A job that hangs is killed at its deadline (the pool returns with its worker gone
    before the job's minute is up), one that kills its process is reported as crashed; a
    fresh worker then runs the next job normally, and the workers replaced or stopped
    along the way leave quietly (no traceback on stderr)."""
    marker = tmp_path / "hang.pid"
    jobs = [("aten.die.default", pickle.dumps(_Die())),
            # a registry lookup: instant in any worker, so the 3 s deadline holds on a busy machine
            make_job("aten.mul.Tensor", [((torch.randn(3), torch.randn(3)), {}, "test")], False),
            # last: the worker started in its place is stopped while it starts
            ("aten.hang.default", pickle.dumps(_Hang(marker)))]
    got: dict[str, dict] = {}
    run_jobs(jobs, 1, 3.0, lambda name, rec: got.__setitem__(name, rec))
    hung = marker.read_text()
    assert "finished" not in hung and not _alive(int(hung)), hung  # killed, not waited for
    assert got["aten.hang.default"]["status"] == "unsupported"
    assert got["aten.hang.default"]["reason"] == "timed out after 3 s"
    assert got["aten.die.default"]["reason"] == "crashed: worker exited with code 7"
    ok = got["aten.mul.Tensor"]
    assert ok["status"] == "native" and ok["registry"] == "single-dim", ok["reason"]
    time.sleep(0.5)  # a stopped worker would print as it exits
    assert "Traceback" not in capfd.readouterr().err


# ------------------------------------------------------------------ model audit


def test_model_audit(tmp_path, capsys):
    out = tmp_path / "model.json"
    argv = ["coverage", "--model", "_tiny_model:build", "--input-shapes", "4,16", "--format", "json",
            "-o", str(out), "-q", "-j", "1"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["model"]["inputs"] == [[4, 16]] and doc["model"]["aten_calls"] > 10
    ops = {r["op"]: r for r in doc["ops"]}
    assert all(isinstance(r["calls"], int) and r["calls"] >= 1 for r in ops.values())
    assert ops["aten.addmm.default"]["status"] == "native"
    for name in ("aten.pixel_shuffle.default", "aten.pixel_unshuffle.default", "aten.addmv.default"):
        assert ops[name]["status"] == "derived" and ops[name]["n_derived"] > 0, name
    # derived at the model's own shapes: pixel_shuffle sees (4, 9, 2, 2)
    assert ops["aten.pixel_shuffle.default"]["samples"][0]["shapes"] == "[4, 9, 2, 2]"
    assert ops["aten.view.default"]["calls"] >= 2

    assert main(["coverage", "--model", "_tiny_model:build_with_inputs", "-q", "-j", "0"]) == 0
    text = capsys.readouterr().out
    assert "calls" in text.splitlines()[0] and "aten.pixel_shuffle.default" in text


def test_progress_eta_leaves_out_the_instant_lookups():
    """A sweep does its registry lookups (instant) before the ops it derives: the ETA
    comes from the derived ones, not from a rate the lookups made look fast."""
    now = [0.0]
    out = io.StringIO()
    p = Progress(12, stream=out, interval=0.0, warmup=8, clock=lambda: now[0])
    for i in range(7):
        now[0] += 0.01
        p.step(f"native{i}")
    for i in range(5):
        now[0] += 4.0
        p.step(f"derived{i}")
    lines = out.getvalue().splitlines()
    assert lines[7].endswith("(4 s)")  # the first derived op: no rate yet
    assert lines[8] == "coverage: ops 9/12 (8 s, ETA 12 s)"  # 3 left at 4 s each


def test_glob_checks_read_the_kept_op_list_without_torch(tmp_path):
    """The list of aten overloads a glob is checked against is the dispatcher's, kept on
    disk for the installed torch; read back, it is the same list."""
    from decompshard.coverage.op_select import all_aten_overloads

    fresh = all_aten_overloads(str(tmp_path))
    kept = list(tmp_path.glob("aten-overloads-*.txt"))
    assert len(kept) == 1 and "aten.addmv.default" in fresh and "aten.add.Tensor" in fresh
    assert sorted(all_aten_overloads(str(tmp_path))) == sorted(fresh) == sorted(all_aten_overloads(None))
    code = ("import sys; from decompshard.coverage.op_select import validate_globs; "
            f"validate_globs('aten.addmv*,aten.pixel_*', {str(tmp_path)!r}); print('torch' in sys.modules)")
    import subprocess
    import sys

    from _cli import ROOT, cli_env

    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(tmp_path),
                         cwd=ROOT, timeout=60)
    assert got.returncode == 0 and got.stdout.strip() == "False", got.stderr
