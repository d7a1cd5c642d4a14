"""The `decompshard` command as a user meets it: real processes (`python -m decompshard`),
exit codes, stdout against stderr, the report formats read back by their own parsers,
and Ctrl-C sent as a terminal sends it (SIGINT to the whole process group).

Sweeps here use `--opinfo-samples 1` and read the capture from a cache folder filled once
by this test session (conftest.opinfo_cache): no process captures OpInfo samples again.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from _cli import ROOT, cli_env, run_cli, spawn_cli

FAST = ["--opinfo-samples", "1", "-j", "1"]
DERIVED_OPS = ["aten.addmv.default", "aten.block_diag.default", "aten.trace.default", "aten.mv.default",
               "aten.channel_shuffle.default"]


# ------------------------------------------------------------------ conventions


def test_help_imports_no_torch(tmp_path):
    """--help (top level and per command) builds its parsers without importing torch, and
    importing a command module does not hide the public decompshard.explain function."""
    script = (
        "import sys\n"
        "from decompshard.cli import main\n"
        "for argv in (['--help'], ['coverage', '--help'], ['explain', '--help']):\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (argv, e.code)\n"
        "import decompshard, decompshard.explain.command, decompshard.coverage.command\n"
        "assert not isinstance(vars(decompshard).get('explain'), type(sys)), 'the module hides the function'\n"
        "print('TORCH', 'torch' in sys.modules)\n"
    )
    got = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=cli_env(tmp_path), cwd=ROOT, timeout=60)
    assert got.returncode == 0, got.stderr
    assert got.stdout.strip().endswith("TORCH False")
    assert "usage: decompshard coverage" in got.stdout and "usage: decompshard explain" in got.stdout


def test_every_command_documents_its_options(tmp_path):
    got = run_cli("coverage", "--help", cache_dir=tmp_path)
    assert got.returncode == 0 and got.stderr == ""
    text = " ".join(got.stdout.split())
    for option in ("--verbose", "--quiet", "--show-rules", "--no-cache"):
        assert option in text
    # --format says what each format is
    assert "csv (one row per op)" in text and "markdown (GitHub tables)" in text
    assert "130 interrupted" in text
    got = run_cli("explain", "--help", cache_dir=tmp_path)
    text = " ".join(got.stdout.split())
    assert got.returncode == 0 and "--verbose" in text and "--quiet" in text
    assert "3 they are rejected or refused" in text  # the documented exit code


@pytest.mark.parametrize("argv, usage, hint", [
    (["coverage", "--foramt", "json"], "usage: decompshard coverage", "did you mean --format?"),
    (["explain", "aten.mv.default", "--shapez", "4,5;5"], "usage: decompshard explain", "did you mean --shapes?"),
])
def test_a_misspelled_option_shows_that_commands_usage(tmp_path, argv, usage, hint):
    got = run_cli(*argv, cache_dir=tmp_path)
    assert got.returncode == 2 and got.stdout == ""
    assert got.stderr.startswith(usage) and hint in got.stderr
    assert f"decompshard {argv[0]}: error: unrecognized arguments" in got.stderr


# ------------------------------------------------------------------ coverage --ops


@pytest.mark.parametrize("ops, message", [
    ("", "names no op"),
    (",", "names no op"),
    ("aten.addmvv*", "matches no aten op"),
])
def test_bad_ops_fail_before_any_capture(tmp_path, ops, message):
    """Checked before the OpInfo capture starts: nothing is captured (only the list of aten
    op names a glob is checked against may be kept, so the next check needs no torch)."""
    for _ in range(2):  # the second run reads the kept list of names
        got = run_cli("coverage", "--ops", ops, cache_dir=tmp_path)
        assert got.returncode == 2 and got.stdout == ""
        assert got.stderr.startswith("decompshard coverage: error:") and message in got.stderr
        assert len(got.stderr.splitlines()) == 1  # no "capturing..." line before it
        assert not [p for p in tmp_path.iterdir() if not p.name.startswith("aten-overloads-")]


def test_a_sweep_writes_the_report_on_stdout_and_counts_agree(opinfo_cache):
    """stdout is the report alone (CSV here, read back by csv); stderr has the progress and
    a last line whose per-status counts are the report's, in the same words. (No numerical
    check: it would not change a status, only the time.)"""
    ops = ["aten.mul.Tensor", "aten.addmv.default", "aten.dist.default", "aten.resize_.default"]
    got = run_cli("coverage", "--ops", ",".join(ops), "--format", "csv", "--no-verify", *FAST,
                  cache_dir=opinfo_cache)
    assert got.returncode == 0, got.stderr
    rows = list(csv.DictReader(io.StringIO(got.stdout)))
    assert [r["op"] for r in rows] == sorted(ops)
    status = {r["op"]: r["status"] for r in rows}
    assert status == {"aten.mul.Tensor": "native", "aten.addmv.default": "derived",
                      "aten.dist.default": "replicate-only", "aten.resize_.default": "unsupported"}
    assert int(next(r for r in rows if r["op"] == "aten.addmv.default")["n_derived"]) > 0
    err = got.stderr.splitlines()
    assert "capturing" not in got.stderr  # read from the cache folder
    assert err[-1].startswith("coverage: 4 ops in ")
    assert err[-1].endswith("1 native, 1 derived, 1 replicate-only, 1 unsupported")


def _wait_for(proc: subprocess.Popen, prefix: str, seen: list[str], limit: float = 240) -> None:
    t0 = time.monotonic()
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(prefix):
            return
        assert time.monotonic() - t0 < limit
    raise AssertionError(f"no line starting with {prefix!r}: {''.join(seen)}")


# ops after the first two: enough work that Ctrl-C lands mid-sweep on any machine
# (six ops once finished in 0.2 s after "[2/6]", before the signal arrived)
_MORE_OPS = [f"aten.{n}" for n in (
    "hardswish.default", "log_sigmoid_forward.default", "mse_loss.default", "huber_loss.default",
    "smooth_l1_loss.default", "soft_margin_loss.default", "binary_cross_entropy.default",
    "binary_cross_entropy_with_logits.default", "floor_divide.default", "glu.default", "polar.default",
    "complex.default", "rot90.default", "take.default", "vdot.default", "isin.Tensor_Tensor",
    "index_add.default", "index_copy.default", "masked_fill.Tensor", "norm.ScalarOpt_dim",
    "std_mean.correction", "aminmax.default", "addr.default", "pixel_shuffle.default",
    "pixel_unshuffle.default", "narrow_copy.default", "permute_copy.default", "t_copy.default",
)]


def test_ctrl_c_during_the_sweep_writes_what_finished(opinfo_cache, tmp_path):
    """SIGINT to the whole process group (parent, worker server, workers) mid-sweep: one
    line on stderr, exit 130, no traceback from any process, and --output holds the ops
    finished so far (at least the two seen before the signal), marked interrupted."""
    out = tmp_path / "partial.json"
    ops = ["aten.mul.Tensor", *DERIVED_OPS, *_MORE_OPS]
    n = len(ops)
    proc = spawn_cli("coverage", "-v", "--ops", ",".join(ops), "--format", "json", "-o", str(out), "--no-verify",
                     *FAST, cache_dir=opinfo_cache)
    seen: list[str] = []
    try:
        _wait_for(proc, f"coverage: [2/{n}]", seen)  # mul (native) and one derived op are done
        os.killpg(proc.pid, signal.SIGINT)
        stdout, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = "".join(seen) + rest
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    last = re.fullmatch(rf"decompshard coverage: interrupted \((\d+) of {n} ops written to (.+)\)", err.splitlines()[-1])
    assert last and last.group(2) == str(out), err
    written = int(last.group(1))
    assert 2 <= written < n
    assert stdout == ""
    doc = json.loads(out.read_text())
    assert doc["run"]["interrupted"] is True and doc["run"]["ops_selected"] == n
    assert len(doc["ops"]) == written and "aten.mul.Tensor" in {r["op"] for r in doc["ops"]}
    assert doc["summary"]["ops"] == written


def test_ctrl_c_during_the_capture(tmp_path):
    """While OpInfo samples are being captured (an empty cache): one line, exit 130, and
    no capture file (complete or partial) left behind."""
    proc = spawn_cli("coverage", "--ops", "aten.addmv.default", "--opinfo-samples", "1", cache_dir=tmp_path)
    seen: list[str] = []
    try:
        _wait_for(proc, "coverage: capturing", seen)
        time.sleep(0.5)
        os.killpg(proc.pid, signal.SIGINT)
        stdout, rest = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = "".join(seen) + rest
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert err.splitlines()[-1] == "decompshard coverage: interrupted"
    # only the command's own lines: a CUDA build of torch on a CPU machine logs "No CUDA
    # runtime is found" while OpInfo's database imports (torch_notices drops it)
    assert all(line.startswith(("coverage: ", "decompshard coverage: ")) for line in err.splitlines()), err
    assert stdout == "" and not list(tmp_path.glob("opinfo-samples-*"))


def test_only_the_no_cuda_runtime_notice_is_dropped():
    """The CLI drops torch's "No CUDA runtime is found" notice by its text: the same
    logger's other warnings still reach the user, and outside the block nothing is
    dropped."""
    from decompshard.torch_notices import no_cuda_runtime_notice

    log = logging.getLogger("torch.utils.cpp_extension")
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    log.addHandler(handler)
    try:
        with no_cuda_runtime_notice(), no_cuda_runtime_notice():
            log.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
            log.warning("Error checking compiler version for %s", "c++")
        log.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/opt/cuda")
    finally:
        log.removeHandler(handler)
    assert seen == ["Error checking compiler version for c++", "No CUDA runtime is found, using CUDA_HOME='/opt/cuda'"]


# ------------------------------------------------------------------ report formats


def _rec(op: str, status: str, rules: list[str], torch_rules: int = 0) -> dict:
    from decompshard.coverage.sweep import new_record

    r = new_record(op)
    r.update(status=status, derived_rules=rules, n_derived=len(rules), n_confirmed=len(rules),
             n_truth=len(rules), verified=bool(rules), samples=[{"shapes": "[4]"}] if rules else [])
    r["torch_fallback"].update(status="supported" if torch_rules else "unsupported", n_rules=torch_rules)
    return r


def _reports(tmp_path) -> tuple[str, str]:
    from decompshard.coverage import report as rep

    stay_old = _rec("aten.a.default", "derived", ["S(0) -> S(0)", "R -> P(sum)"], 1)
    stay_new = _rec("aten.a.default", "derived", ["S(0) -> S(0)", "S(1) -> S(1)"], 2)
    gone = _rec("aten.gone.default", "derived", ["S(0) -> S(0)", "S(1) -> S(1)"], 3)
    new = _rec("aten.new.default", "derived", ["S(0) -> S(0)", "S(1) -> S(1)", "P(sum) -> P(sum)"], 1)
    old_p, new_p = tmp_path / "old.json", tmp_path / "new.json"
    old_p.write_text(json.dumps(rep.build_report([stay_old, gone])))
    new_p.write_text(json.dumps(rep.build_report([stay_new, new])))
    return str(old_p), str(new_p)


def test_diff_as_csv_is_csv_with_real_counts(tmp_path):
    old, new = _reports(tmp_path)
    got = run_cli("coverage", "--diff", old, new, "--format", "csv", cache_dir=tmp_path)
    assert got.returncode == 0 and got.stderr == ""
    assert "None" not in got.stdout and "\t" not in got.stdout
    rows = {r["op"]: r for r in csv.DictReader(io.StringIO(got.stdout))}
    assert set(rows) == {"aten.a.default", "aten.gone.default", "aten.new.default"}
    appeared, gone, kept = rows["aten.new.default"], rows["aten.gone.default"], rows["aten.a.default"]
    assert (appeared["old_status"], appeared["new_status"]) == ("(absent)", "derived")
    assert (appeared["rules_gained"], appeared["rules_lost"]) == ("3", "0")  # not +0/-0
    assert appeared["old_torch_rules"] == "" and appeared["new_torch_rules"] == "1"
    assert appeared["gained"].split("; ") == ["S(0) -> S(0)", "S(1) -> S(1)", "P(sum) -> P(sum)"]
    assert (gone["rules_gained"], gone["rules_lost"], gone["new_torch_rules"]) == ("0", "2", "")
    assert (kept["gained"], kept["lost"]) == ("S(1) -> S(1)", "R -> P(sum)")


def _table_blocks_are_separated(text: str) -> None:
    """Every markdown table (a run of '|' lines) has a blank line (or the start/end of
    the text) right before and right after it."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not line.startswith("|"):
            continue
        if i == 0 or not lines[i - 1].startswith("|"):
            assert i == 0 or lines[i - 1] == "", f"no blank line before the table at line {i}: {lines[i - 1]!r}"
        if i + 1 < len(lines) and not lines[i + 1].startswith("|"):
            assert lines[i + 1] == "", f"no blank line after the table at line {i}: {lines[i + 1]!r}"


def test_markdown_report_and_diff(tmp_path):
    old, new = _reports(tmp_path)
    got = run_cli("coverage", "--from", new, "--format", "markdown", "--show-rules", cache_dir=tmp_path)
    assert got.returncode == 0 and got.stderr == ""
    md = got.stdout
    _table_blocks_are_separated(md)
    assert "## Summary" in md.splitlines() and "## Ops" in md.splitlines()
    assert any(line.startswith("decompshard, torch (torch's own decomposition fallback): rules claimed")
               for line in md.splitlines())  # the legend
    assert "### aten.new.default (3)" in md and "- `P(sum) -> P(sum)`" in md
    assert md.count("| aten.") == 2
    got = run_cli("coverage", "--diff", old, new, "--format", "markdown", cache_dir=tmp_path)
    assert got.returncode == 0
    _table_blocks_are_separated(got.stdout)
    assert "## Changes per op" in got.stdout and "## Summary changes" in got.stdout
    assert "None" not in got.stdout and "| +3/-0 " in got.stdout


# ------------------------------------------------------------------ explain


def test_explain_exit_code_streams_and_width(tmp_path):
    """Rejected placements: exit 3, the trace on stdout fitted to COLUMNS, -v's numbers on
    stderr."""
    got = run_cli("explain", "aten.addmv.default", "--shapes", "4;4,12;12", "--placements", "R;S(1);S(0)",
                  "-v", cache_dir=tmp_path, COLUMNS="100")
    assert got.returncode == 3, got.stderr
    assert got.stdout.startswith("explain aten.addmv.default(")
    # the last call (self + mat @ vec) meets the partial sum of S(1) @ S(0) and the
    # replicated self: the verdict names that node, whatever torch's decomposition counts
    # before it (2.15 casts vec first: one node more)
    calls = int(re.search(r"^decomposition: (\d+) primitive calls$", got.stdout, re.M).group(1))
    assert f"REJECTED at node {calls - 1} (aten.add.Tensor)" in got.stdout
    assert re.search(rf"^ +{calls - 1} +%\d+\[4\] = add\.Tensor\(", got.stdout, re.M), got.stdout
    assert max(len(line) for line in got.stdout.splitlines()) <= 100
    assert got.stderr.startswith("explain: ") and "derived rules" in got.stderr


def test_repl_line_editing_history_and_ctrl_c(tmp_path):
    """On a terminal: Up recalls the previous line (readline), Ctrl-C drops the line being
    typed and the REPL goes on, the history is kept for the next session."""
    pty = pytest.importorskip("pty")
    argv = [sys.executable, "-m", "decompshard", "explain", "aten.addmv.default", "--shapes", "4;4,12;12", "-i"]
    env = cli_env(tmp_path, TERM="xterm")
    pid, fd = pty.fork()
    if pid == 0:  # the child: the pty is its controlling terminal
        os.chdir(ROOT)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # a terminal's foreground job (see ctrl_c_reaches_children)
        os.execve(sys.executable, argv, env)
    buf = b""

    def until(marker: bytes | None, count: int = 1, limit: float = 120) -> None:
        """Read until `marker` was seen `count` times (None: until the child exits)."""
        nonlocal buf
        t0 = time.monotonic()
        while marker is None or buf.count(marker) < count:
            left = limit - (time.monotonic() - t0)
            assert left > 0, buf.decode(errors="replace")[-2000:]
            if not select.select([fd], [], [], left)[0]:  # a silent child fails the test, never hangs it
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                return
            if not chunk:
                return
            buf += chunk

    try:
        until(b"explain> ")
        os.write(fd, b"S(0);S(0);R\r")
        until(b"ACCEPTED", 1)
        until(b"explain> ", 2)
        os.write(fd, b"bogus half-typed line")
        time.sleep(0.3)
        os.write(fd, b"\x03")  # Ctrl-C: the terminal sends SIGINT to the REPL
        until(b"explain> ", 3)
        os.write(fd, b"\x1b[A\r")  # Up, Enter: the last line run, not the cancelled one
        until(b"ACCEPTED", 2)
        until(b"explain> ", 4)
        os.write(fd, b"quit\r")
        until(None, limit=30)
    finally:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == 0:  # a failed wait above: the REPL still waits for input; end it, never hang
            time.sleep(1)
            done, status = os.waitpid(pid, os.WNOHANG)
        if done == 0:
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
        os.close(fd)
    text = buf.decode(errors="replace")
    assert os.waitstatus_to_exitcode(status) == 0, text[-2000:]
    assert "^[[A" not in text and "Traceback" not in text
    assert "unknown command 'bogus'" not in text  # the cancelled line never ran
    assert text.count("candidate: S(0), S(0), R") == 2
    history = (tmp_path / "explain_history").read_text().splitlines()
    assert history[-2:] == ["S(0);S(0);R", "quit"] or history[-3:] == ["S(0);S(0);R", "S(0);S(0);R", "quit"]
