"""One way to run code where a crash or a hang cannot take the caller down.

Why: decompshard runs real CPU kernels on odd local shapes (some trust sizes blindly and
corrupt the heap, CPU flash attention divides by the head count: SIGFPE with 0 heads) and
real DTensor code (which can hang). Such a run happens in a child process; the caller
gets an answer, never the crash:

    ('ok', the result) | ('error', the exception in one line) | ('crash', the signal's
    name) | ('timeout', "no answer within N s") | ('unresolved', one line)

'timeout' is kept apart because it is the one answer that says nothing about what ran:
a loaded machine or a fork that inherited a held lock gives it. 'unresolved' says the
child could not unpickle the request (a snapshot older than what it names).

Every child speaks one protocol (`serve`): pickled (module-level function, arguments)
requests in, pickled answers out, over multiprocessing Connections (length-framed), each
request with a deadline; an overrun or a crash kills that child only. Three ways to hold
one, for three costs:

- `isolated(fn)`: a fresh fork per call, for any closure (~23 ms with torch loaded).
- `ForkedServer`: one forked child reused for many requests (the kernel sandbox); it
  dies with its parent (EOF of its request pipe) and after `idle_exit_s` without work, as
  a forked child pins the parent's memory of the moment of the fork (copy on write).
- the process pool of `decompshard.workers` (forkserver children running `serve`), for
  many jobs on several cores.

A forked child is quieted (`quiet_child`): /dev/null for stdin, stdout and stderr, no
other inherited file descriptor (a copy of a parent's pipe end would keep it open), one
intra-op thread (an OpenMP pool does not survive a fork), no dispatch mode of the
forking thread, Ctrl-C ignored (the parent's business). Where the platform has no fork,
functions run in-process (nothing to isolate with).
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import pickle
import signal
import threading
import time
from multiprocessing.connection import Connection
from typing import Any, Callable

import torch

from decompshard.errors import one_line

__all__ = ["Answer", "Timeout", "first_line", "named_line", "call", "dump_answer", "serve", "receive",
           "send_request", "quiet_child", "death", "timed_out", "isolated", "ForkedServer"]

Answer = tuple[str, Any]  # ('ok', result) | ('error', one line) | ('crash', signal name) | ('timeout', one line)

IDLE_EXIT_CODE = 75  # a server child that left idle with no request read: one that raced it is retried


class Timeout(Exception):
    """No answer by the deadline."""


# ------------------------------------------------------------------------ answers


def first_line(e: BaseException) -> str:
    """The exception's first line (its type name when it has no text), at most 120 chars."""
    return one_line(e, 120, with_type=False)


def named_line(e: BaseException) -> str:
    """'Type: first line' (at most 200 chars of text): the process pool's wording."""
    return one_line(e, 200)


def call(fn: Callable[..., Any], args: tuple, describe: Callable[[BaseException], str] = first_line) -> Answer:
    """('ok', fn(*args)) or ('error', describe(the exception))."""
    try:
        return "ok", fn(*args)
    except Exception as e:
        return "error", describe(e)


def dump_answer(answer: Answer) -> bytes:
    """The answer pickled; a result that does not pickle becomes an error answer."""
    try:
        return pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        return pickle.dumps(("error", f"the result does not pickle: {first_line(e)}"))


def death(status: int | None) -> Answer:
    """The answer for a child that exited without answering (its waitpid status)."""
    if status is not None and os.WIFSIGNALED(status):
        return "crash", signal.Signals(os.WTERMSIG(status)).name
    if status is not None and os.WIFEXITED(status):
        return "crash", f"exit status {os.WEXITSTATUS(status)}"
    return "crash", "exited, status unknown"


def timed_out(timeout: float) -> Answer:
    return "timeout", f"no answer within {timeout:g} s (the run was killed)"


# ------------------------------------------------------------------------ the wire


def serve(requests: Connection, answers: Connection, idle_exit_s: float | None = None,
          describe: Callable[[BaseException], str] = first_line) -> None:
    """A child's loop: one pickled (fn, args) request, one answer, until EOF (the parent
    is gone or done) or, with `idle_exit_s`, that long without a request (then the
    process exits with IDLE_EXIT_CODE)."""
    while True:
        try:
            if idle_exit_s is not None and not requests.poll(idle_exit_s):
                os._exit(IDLE_EXIT_CODE)
            data = requests.recv_bytes()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        try:
            fn, args = pickle.loads(data)
        except Exception as e:
            answer: Answer = ("unresolved", describe(e))
        else:
            answer = call(fn, args, describe)
        try:
            answers.send_bytes(dump_answer(answer))
        except OSError:  # the parent is gone or stopped waiting for us
            return


def receive(conn: Connection, deadline: float | None) -> bytes | None:
    """One message; None on EOF (the child is gone); Timeout past `deadline`."""
    if deadline is not None and not conn.poll(max(0.0, deadline - time.monotonic())):
        raise Timeout
    try:
        return conn.recv_bytes()
    except (EOFError, OSError):
        return None


def send_request(conn: Connection, data: bytes) -> None:
    """A write to a child that just died fails with EPIPE, and raises SIGPIPE: ignored by
    Python by default, fatal where the application restored the default action (CLIs
    piped into `head` do). There, the signal is blocked for this write and consumed."""
    if (
        signal.getsignal(signal.SIGPIPE) is not signal.SIG_DFL
        or not hasattr(signal, "sigtimedwait")
        or not hasattr(signal, "pthread_sigmask")
    ):
        conn.send_bytes(data)
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
    try:
        conn.send_bytes(data)
    finally:
        if signal.SIGPIPE in signal.sigpending():
            signal.sigtimedwait({signal.SIGPIPE}, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _pipe() -> tuple[Connection, Connection]:
    """(read end, write end) of a fresh one-way pipe."""
    r, w = os.pipe()
    return Connection(r, writable=False), Connection(w, readable=False)


# ------------------------------------------------------------------------ the child


def quiet_child(keep: tuple[Connection, ...]) -> None:
    """A forked child's setup: a crash here is the expected answer, not news."""
    faulthandler.disable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    _close_fds_except({0, 1, 2, *(c.fileno() for c in keep)})
    torch.set_num_threads(1)  # the parent's OpenMP pool did not survive the fork
    _drop_modes()


def _close_fds_except(keep: set[int]) -> None:
    for fd_dir in ("/proc/self/fd", "/dev/fd"):
        try:
            fds = [int(n) for n in os.listdir(fd_dir)]
            break
        except (OSError, ValueError):
            continue
    else:
        fds = list(range(3, 1024))
    for fd in fds:
        if fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)


def _drop_modes() -> None:
    """The fork copies the forking thread's dispatch modes (a FakeTensorMode around a
    DTensor call); the child runs real code on real tensors, under none of them."""
    from decompshard._compat import disable_current_modes as _disable_current_modes

    global _POPPED_MODES
    _POPPED_MODES = _disable_current_modes()  # kept: collecting it would push them back
    _POPPED_MODES.__enter__()
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()


_POPPED_MODES: Any = None


def _fork(child: Callable[[], None]) -> int:
    """Fork; the child runs `child()` and exits, never returning into the caller's code."""
    pid = os.fork()
    if pid == 0:
        try:
            child()
        finally:
            os._exit(0)
    return pid


# ------------------------------------------------------------------------ one-shot


def isolated(fn: Callable[[], Any], timeout: float, describe: Callable[[BaseException], str] = first_line) -> Answer:
    """`fn()` in a freshly forked child (any closure; ~23 ms with torch loaded): ('ok', its
    picklable result), ('error', describe(the exception)), ('crash', the signal's name)
    or ('timeout', ...). In-process where the platform has no fork."""
    if not hasattr(os, "fork"):
        return call(fn, (), describe)
    rd, wr = _pipe()

    def child() -> None:
        rd.close()
        quiet_child(keep=(wr,))
        wr.send_bytes(dump_answer(call(fn, (), describe)))

    pid = _fork(child)
    wr.close()
    try:
        try:
            data = receive(rd, time.monotonic() + timeout)
        except Timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return timed_out(timeout)
        except BaseException:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
    finally:
        rd.close()
    _, status = os.waitpid(pid, 0)
    if data is not None:
        return pickle.loads(data)
    return death(status)


# ------------------------------------------------------------------------ reused


class ForkedServer:
    """One forked child that serves requests until EOF or `idle_exit_s` of silence: its
    pid, the two pipe ends, and a reaper thread (an exited child never lingers as a
    zombie). `dumps` encodes a request's (fn, args). A process forked from the parent
    later (a DataLoader worker) forgets the server and forks its own when it needs one.
    The child is a snapshot of the parent at fork time: a request it cannot unpickle
    restarts it once; what still does not unpickle, or does not pickle, runs in a
    one-shot fork (`isolated`)."""

    def __init__(self, name: str, idle_exit_s: float, dumps: Callable[[Any], bytes] = pickle.dumps) -> None:
        self.name, self.idle_exit_s, self.dumps = name, idle_exit_s, dumps
        self.lock = threading.Lock()
        self.pid: int | None = None
        self.req: Connection | None = None
        self.ans: Connection | None = None
        self.reaper: threading.Thread | None = None
        self.exit: dict[str, int | None] = {}
        self.last_answer = 0.0
        if hasattr(os, "register_at_fork"):
            os.register_at_fork(after_in_child=self.after_fork_in_child)
        atexit.register(self.at_exit)

    def run(self, fn: Callable[..., Any], args: tuple, timeout: float) -> Answer:
        """`fn(*args)` in the server's child (`fn` module-level: it is pickled by reference)."""
        if not hasattr(os, "fork"):
            return call(fn, args)
        try:
            payload = self.dumps((fn, args))
        except Exception:
            return isolated(lambda: fn(*args), timeout)
        answer = self.request(payload, timeout)
        return isolated(lambda: fn(*args), timeout) if answer is None else answer

    def alive(self) -> bool:
        if self.pid is None:
            return False
        if self.reaper is not None and not self.reaper.is_alive():  # it left (idle): tidy up
            self._forget()
            return False
        return True

    def _usable(self) -> bool:
        """Alive and not about to leave idle: a request never races the idle exit unless
        the child was descheduled for idle_exit_s / 2 (then the retry below covers it)."""
        if self.alive() and time.monotonic() - self.last_answer > self.idle_exit_s / 2:
            self.stop()
        return self.alive()

    def request(self, payload: bytes, timeout: float) -> Answer | None:
        """The child's answer; None where it cannot run this request (unresolvable)."""
        with self.lock:
            for _ in range(3):
                fresh = not self._usable()
                if fresh:
                    self._start()
                try:
                    answer = self._exchange(payload, timeout)
                except BaseException:  # Ctrl-C mid-request: the pipes are out of step
                    self.stop()
                    raise
                if answer is None:  # it had left idle before reading the request: retry
                    continue
                if answer[0] == "unresolved":  # a snapshot older than what the request names
                    self.stop()
                    if fresh:
                        return None
                    continue
                return answer
            return None

    def _exchange(self, payload: bytes, timeout: float) -> Answer | None:
        assert self.req is not None and self.ans is not None
        deadline = time.monotonic() + timeout
        try:
            send_request(self.req, payload)
            data = receive(self.ans, deadline)
        except Timeout:
            self.stop()
            return timed_out(timeout)
        except OSError:  # EPIPE: gone before reading
            data = None
        if data is not None:
            self.last_answer = time.monotonic()
            return pickle.loads(data)
        status = self._wait_exit()
        if status is None or (os.WIFEXITED(status) and os.WEXITSTATUS(status) == IDLE_EXIT_CODE):
            return None
        return death(status)

    def _wait_exit(self) -> int | None:
        """The exit status of a child that closed its answer pipe (it is exiting)."""
        assert self.reaper is not None and self.pid is not None
        self.reaper.join(5.0)
        if self.reaper.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.reaper.join()
        status = self.exit.get("status")
        self._forget()
        return status

    def _start(self) -> None:
        req_r, req_w = _pipe()
        ans_r, ans_w = _pipe()
        idle = self.idle_exit_s

        def child() -> None:
            req_w.close()
            ans_r.close()
            quiet_child(keep=(req_r, ans_w))
            serve(req_r, ans_w, idle_exit_s=idle)

        pid = _fork(child)
        req_r.close()
        ans_w.close()
        exit_box: dict[str, int | None] = {}
        reaper = threading.Thread(target=_reap, args=(pid, exit_box), name=f"{self.name}-reaper", daemon=True)
        reaper.start()
        self.pid, self.req, self.ans, self.reaper, self.exit = pid, req_w, ans_r, reaper, exit_box

    def stop(self) -> None:
        """Kill the child (it holds no state worth a goodbye) and reap it."""
        if self.pid is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if self.reaper is not None:
            self.reaper.join()
        self._forget()

    def _forget(self) -> None:
        for conn in (self.req, self.ans):
            if conn is not None:
                with contextlib.suppress(OSError):
                    conn.close()
        self.pid, self.req, self.ans, self.reaper, self.exit = None, None, None, None, {}

    def after_fork_in_child(self) -> None:
        """In any process forked from this one: the server is the parent's, not ours."""
        self.lock = threading.Lock()  # another thread may have held it at the fork
        for conn in (self.req, self.ans):
            if conn is not None:  # this process's copies of the parent's pipe ends
                with contextlib.suppress(OSError):
                    conn.close()
        self.pid, self.req, self.ans, self.reaper, self.exit = None, None, None, None, {}

    def at_exit(self) -> None:
        """Stop the child now rather than when it notices EOF; never wait on a request in
        flight in another thread (its run may be the hung one)."""
        if self.lock.acquire(timeout=1.0):
            try:
                self.stop()
            finally:
                self.lock.release()
        elif self.pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)


def _reap(pid: int, box: dict[str, int | None]) -> None:
    try:
        box["status"] = os.waitpid(pid, 0)[1]
    except ChildProcessError:  # someone else reaped it (a waitpid(-1) elsewhere)
        box["status"] = None
