"""The kernel sandbox: a reused process where crashes and hangs stay, with its answers
('ok' / 'error' / 'crash', signal name / 'timeout'), fresh children after each death,
the fallbacks for what a forked snapshot cannot resolve, and no leftovers (zombies,
fds, orphans)."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import decompshard
from decompshard.solve import kernel_sandbox as ks
from decompshard.solve import localcheck

aten = torch.ops.aten
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="the sandbox forks")
linux = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads /proc")


def _fpe() -> None:
    os.kill(os.getpid(), signal.SIGFPE)


def _hang(seconds: float) -> str:
    time.sleep(seconds)
    return "woke"


def _tensor_kind() -> str:
    return type(torch.zeros(1)).__name__


def _my_fds() -> list[int]:
    return sorted(int(n) for n in os.listdir("/proc/self/fd"))


def _gone(pid: int) -> bool:
    """The process no longer exists, not even as a zombie. The sandbox reaps a child
    before it reports its death or forgets it, so this holds the moment it answers."""
    return not os.path.exists(f"/proc/{pid}") if os.path.isdir("/proc") else True


@pytest.fixture(autouse=True)
def _fresh_sandbox():
    ks.shutdown()
    yield
    ks.shutdown()


@needs_fork
def test_requests_reuse_one_process_and_answer_like_a_fork():
    assert ks.run(divmod, 7, 2) == ("ok", (3, 1))
    pid = ks.sandbox_pid()
    assert pid is not None and pid != os.getpid()
    status, why = ks.run(divmod, 1, 0)
    assert status == "error" and "division" in why
    assert ks.output_shapes_on_zeros(aten.pixel_unshuffle.default, (torch.empty(0, 1, 6, 6, device="meta"), 2), {}) \
        == ("ok", [(0, 1, 6, 6)])  # the real CPU kernel's answer, not the meta kernel's [0, 4, 3, 3]
    assert ks.sandbox_pid() == pid


@needs_fork
@pytest.mark.parametrize("fn, name", [(_fpe, "SIGFPE"), (os.abort, "SIGABRT")])
def test_a_crash_kills_only_the_sandbox_and_the_next_request_gets_a_fresh_one(fn, name):
    ks.run(divmod, 1, 1)
    before = ks.sandbox_pid()
    assert ks.run(fn) == ("crash", name)
    assert ks.sandbox_pid() is None and _gone(before)
    assert ks.run(divmod, 9, 4) == ("ok", (2, 1))
    assert ks.sandbox_pid() not in (None, before)


@needs_fork
def test_a_hung_run_is_killed_at_the_timeout_and_reported_as_a_timeout():
    ks.run(divmod, 1, 1)
    before = ks.sandbox_pid()
    status, why = ks.run(_hang, 600, timeout=0.5)
    assert status == "timeout" and "no answer within 0.5 s" in why
    assert _gone(before) and ks.sandbox_pid() is None
    assert ks.run(_hang, 0, timeout=60) == ("ok", "woke")  # the next request still runs
    assert ks.sandbox_pid() not in (None, before)


@needs_fork
def test_what_does_not_pickle_runs_in_a_one_shot_fork():
    ks.run(divmod, 1, 1)
    pid = ks.sandbox_pid()
    assert ks.run(lambda: os.getpid() != pid) == ("ok", True)  # a lambda pickles by reference: no
    assert ks.run(lambda: os.abort()) == ("crash", "SIGABRT")
    assert ks.sandbox_pid() == pid  # untouched


class _OnlyHere:
    """Unpickles in the process that pickled it and nowhere else (a forked snapshot
    missing something)."""

    def __init__(self, value: int):
        self.value = value

    def __reduce__(self):
        return _unpickle_only_in, (os.getpid(), self.value)


def _unpickle_only_in(pid: int, value: int) -> _OnlyHere:
    if os.getpid() != pid:
        raise LookupError("not here")
    return _OnlyHere(value)


def _value(x: _OnlyHere) -> int:
    return x.value


@needs_fork
def test_what_a_fresh_sandbox_cannot_unpickle_runs_in_a_one_shot_fork():
    assert ks.run(_value, _OnlyHere(5)) == ("ok", 5)


@needs_fork
def test_an_op_registered_after_the_fork_restarts_the_sandbox():
    ks.run(divmod, 1, 1)
    before = ks.sandbox_pid()
    lib = torch.library.Library("sbxtest", "DEF")
    lib.define("grow(Tensor x) -> Tensor")
    lib.impl("grow", lambda x: x.new_zeros(x.shape[0] + 1), "CPU")
    try:
        got = ks.output_shapes_on_zeros(torch.ops.sbxtest.grow.default, (torch.empty(0, device="meta"),), {})
        assert got == ("ok", [(1,)])
        assert ks.sandbox_pid() not in (None, before)
        # a kernel added after this fork changes the op's dispatch table: restart again
        mid = ks.sandbox_pid()
        lib.impl("grow", lambda x: x.new_empty(x.shape[0] + 1), "Meta")
        assert ks.output_shapes_on_zeros(torch.ops.sbxtest.grow.default, (torch.empty(2),), {}) == ("ok", [(3,)])
        assert ks.sandbox_pid() not in (None, mid)
    finally:
        lib._destroy()


@needs_fork
def test_the_sandbox_leaves_after_idling_is_reaped_and_comes_back(monkeypatch):
    monkeypatch.setattr(ks._SANDBOX, "idle_exit_s", 0.3)  # read by the child, forked after this
    ks.run(divmod, 1, 1)
    pid, reaper = ks.sandbox_pid(), ks._SANDBOX.reaper
    reaper.join()  # returns once the child left on its own and was waited for
    assert _gone(pid)  # exited and reaped by its waiter thread: no zombie
    assert ks.sandbox_pid() is None
    assert ks.run(divmod, 5, 3) == ("ok", (1, 2))  # a request racing the exit is retried


@needs_fork
@linux
def test_the_sandbox_holds_no_inherited_file_descriptor():
    r, w = os.pipe()  # a pipe end a long-lived copy would keep open
    try:
        ks.run(divmod, 1, 1)
        fds = ks.run(_my_fds)[1]
    finally:
        os.close(r)
        os.close(w)
    assert len(fds) <= 6  # stdin/out/err on /dev/null, two pipe ends, listdir's own fd
    assert ks.run(os.readlink, "/proc/self/fd/2") == ("ok", os.devnull)


@needs_fork
@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="waits on a pidfd")
def test_the_sandbox_dies_with_its_parent():
    code = textwrap.dedent("""
        import os, sys
        from decompshard.solve import kernel_sandbox as ks
        ks.run(divmod, 1, 1)
        print(ks.sandbox_pid(), flush=True)
        os._exit(0)  # no atexit: the child must notice EOF on its own
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    pid = int(out.stdout.strip())
    try:
        exited = os.pidfd_open(pid)  # readable once the process is gone (Linux 5.3+)
    except ProcessLookupError:
        return  # already gone
    try:
        assert select.select([exited], [], [], 120)[0], f"sandbox {pid} outlived its parent"
    finally:
        os.close(exited)


@needs_fork
def test_a_process_forked_from_the_parent_gets_its_own_sandbox():
    ks.run(divmod, 1, 1)
    mine = ks.sandbox_pid()
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(rd)
            ok = ks.sandbox_pid() is None and ks.run(divmod, 7, 2) == ("ok", (3, 1)) and ks.sandbox_pid() != mine
            os.write(wr, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(wr)
    got = os.read(rd, 1)
    os.close(rd)
    os.waitpid(pid, 0)
    assert got == b"1"
    assert ks.sandbox_pid() == mine and ks.run(divmod, 8, 3) == ("ok", (2, 2))


@needs_fork
def test_requests_from_many_threads_each_get_their_own_answer():
    results: dict[int, object] = {}

    def ask(i: int) -> None:
        results[i] = ks.run(divmod, 100 + i, 7)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: ("ok", divmod(100 + i, 7)) for i in range(8)}


@needs_fork
def test_the_sandbox_runs_real_kernels_under_no_dispatch_mode_of_the_caller():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        assert ks.run(_tensor_kind) == ("ok", "Tensor")


def test_without_fork_functions_run_in_process(monkeypatch):
    monkeypatch.delattr(os, "fork", raising=False)
    assert ks.run(os.getpid) == ("ok", os.getpid())
    assert ks.run(divmod, 1, 0)[0] == "error"
    assert ks.isolated(lambda: 3) == ("ok", 3)


@needs_fork
def test_clear_caches_forgets_every_empty_shard_verdict(monkeypatch):
    """The sandbox keeps no result: after clear_caches the same derivation asks the
    kernel again, and gets the same verdicts."""
    calls = []
    real = ks.output_shapes_on_zeros

    def counting(*a, **k):
        calls.append(a[0])
        return real(*a, **k)

    monkeypatch.setattr(localcheck.kernel_sandbox, "output_shapes_on_zeros", counting)
    x = torch.randn(2, 3, 4)
    decompshard.clear_caches()
    first = [str(r) for r in decompshard.derive_rules(aten.permute_copy.default, x, [2, 0, 1]).rules]
    n = len(calls)
    assert n > 0
    decompshard.clear_caches()
    again = [str(r) for r in decompshard.derive_rules(aten.permute_copy.default, x, [2, 0, 1]).rules]
    assert len(calls) == 2 * n and again == first


_RACE = textwrap.dedent("""
    import signal, sys
    from decompshard.solve import kernel_sandbox as ks
    if sys.argv[1] == "dfl":
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as CLIs piped into `head` do
    ks._SANDBOX.idle_exit_s = 0.3
    ks._SANDBOX._usable = lambda: ks._SANDBOX.pid is not None  # blind to the idle exit
    ks.run(divmod, 1, 1)
    gone = ks.sandbox_pid()
    ks._SANDBOX.reaper.join()  # the child left idle and was reaped; the parent still writes to it
    print(ks.run(divmod, 7, 2), ks.sandbox_pid() != gone, flush=True)
""")


@needs_fork
@pytest.mark.parametrize("sigpipe", ["ign", "dfl"])
def test_a_request_racing_the_idle_exit_is_retried_in_a_fresh_sandbox(sigpipe):
    out = subprocess.run([sys.executable, "-c", _RACE, sigpipe], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "('ok', (3, 1)) True"
