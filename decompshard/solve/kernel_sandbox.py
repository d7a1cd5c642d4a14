"""Run a kernel where a crash cannot take the caller down.

Why: the local-shape check runs an op's real CPU kernel on zero-filled, possibly empty
inputs (localcheck._real_kernel_on_empty_shard), and some kernels crash instead of
raising: CPU flash attention divides by the head count, SIGFPE with 0 heads. A fresh fork
per run isolates that but costs ~23 ms with torch loaded (fork, page tables, teardown),
more than the whole rest of the derivation for ops like permute_copy or pixel_shuffle.

So one sandbox process is forked on first need and reused. Requests (a module-level
function, pickled by reference, and its arguments) and answers go over two pipes as
pickles. Every answer is ('ok', the result), ('error', the exception's first line),
('crash', the signal's name) or ('timeout', "no answer within N s") for a hung run. A
timeout is kept apart because it is the one answer that says nothing about the op: a
loaded machine or a fork that inherited a held lock gives it, and another rank of the
same job may get a real answer (see localcheck.strict_checks).

- A crash or a hang kills only the child; the next request forks a fresh one.
- The child dies with its parent: it exits on EOF of its request pipe. It also exits
  after IDLE_EXIT_S without a request: a forked child keeps the parent's memory of the
  moment of the fork alive (copy on write), so it must not outlive a burst of derivations.
- A daemon thread waits for each child, so an exited child never lingers as a zombie.
- The child has one intra-op thread (an OpenMP pool does not survive a fork), /dev/null
  for stdin, stdout and stderr, no other inherited file descriptor (a copy of a parent's
  socket or pipe end would keep it open), no dispatch mode active, and ignores Ctrl-C
  (the parent's business). A process forked from the parent later (a DataLoader worker)
  forgets this sandbox and forks its own when it needs one.
- The child is a snapshot of the parent at fork time. A request naming an op the child
  cannot resolve, or whose dispatch table changed since (a kernel registered later),
  restarts the sandbox; what still does not unpickle in a fresh child, and a function or
  argument that does not pickle, runs in a one-shot fork (`isolated`), as before.
- Where the platform has no fork, functions run in-process (nothing to isolate with).

This is infrastructure like a thread pool, not a cache: the child remembers no result,
every request runs its function afresh, so `decompshard.clear_caches()` ("forget every
cached result") has nothing here to forget and leaves the process running.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import os
import pickle
import select
import signal
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from decompshard.dispatch_modes.graph import leaves, map_leaves

__all__ = ["TIMEOUT_S", "IDLE_EXIT_S", "Answer", "run", "isolated", "output_shapes_on_zeros", "shutdown", "sandbox_pid"]

TIMEOUT_S = 30.0  # a run without an answer by then is killed and reported as a timeout
IDLE_EXIT_S = 5.0  # the sandbox exits after this long without a request

Answer = tuple[str, Any]  # ('ok', result) | ('error', one line) | ('crash', signal name) | ('timeout', one line)

_IDLE_EXIT_CODE = 75  # the child left idle with no request read: one that raced it is retried
_HEADER = struct.Struct("<Q")  # a frame: payload length, then the pickle


# ------------------------------------------------------------------------ public API


def run(fn: Callable[..., Any], *args: Any, timeout: float = TIMEOUT_S) -> Answer:
    """`fn(*args)` in the sandbox process. `fn` must be a module-level function (it is
    pickled by reference); anything that does not pickle runs in a one-shot fork."""
    if not hasattr(os, "fork"):
        return _call(fn, args)
    try:
        payload = _dumps((fn, args))
    except Exception:
        return isolated(lambda: fn(*args), timeout)
    answer = _SANDBOX.request(payload, timeout)
    return isolated(lambda: fn(*args), timeout) if answer is None else answer


def isolated(fn: Callable[[], Any], timeout: float = TIMEOUT_S) -> Answer:
    """`fn()` in a freshly forked child (any closure; ~23 ms with torch loaded): ('ok', its
    picklable result), ('error', the exception's first line), ('crash', the signal's
    name) or ('timeout', ...). In-process where the platform has no fork."""
    if not hasattr(os, "fork"):
        return _call(fn, ())
    rd, wr = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller's code
        try:
            os.close(rd)
            _quiet_child(keep=(wr,))
            _write_frame(wr, _dump_answer(_call(fn, ())))
        finally:
            os._exit(0)
    os.close(wr)
    try:
        try:
            data = _read_frame(rd, time.monotonic() + timeout)
        except _Timeout:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return _timed_out(timeout)
        except BaseException:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
    finally:
        os.close(rd)
    _, status = os.waitpid(pid, 0)
    if data is not None:
        return pickle.loads(data)
    return _death(status)


@dataclass(frozen=True)
class _Zeros:
    """A tensor argument sent by description: zeros of this shape and dtype on CPU."""

    shape: tuple[int, ...]
    dtype: torch.dtype


def output_shapes_on_zeros(op: Any, args: Any, kwargs: Any, timeout: float = TIMEOUT_S) -> Answer:
    """Run `op`'s real CPU kernel on zeros shaped and typed like the tensor leaves of
    `args`/`kwargs` (real, meta or fake tensors: only their metadata travels), in the
    sandbox: ('ok', [shape tuple or None for each output leaf]) or an error or crash."""
    spec = map_leaves(lambda x: _Zeros(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x, (args, kwargs))
    return run(_shapes_on_zeros, op, spec, timeout=timeout)


def shutdown() -> None:
    """Stop the sandbox process if one runs (the next request forks a fresh one)."""
    with _SANDBOX.lock:
        _SANDBOX.stop()


def sandbox_pid() -> int | None:
    """The running sandbox's process id (None when none runs): for tests and diagnostics."""
    with _SANDBOX.lock:
        return _SANDBOX.pid if _SANDBOX.alive() else None


# ------------------------------------------------------------------------ the job


def _shapes_on_zeros(op: Any, spec: Any) -> list[tuple[int, ...] | None]:
    a, k = map_leaves(lambda x: torch.zeros(x.shape, dtype=x.dtype, device="cpu") if isinstance(x, _Zeros) else x, spec)
    return [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in leaves(op(*a, **k))]


# ------------------------------------------------------------------------ the sandbox


class _Sandbox:
    """The parent's handle on the child: its pid, the two pipe ends, its reaper thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pid: int | None = None
        self.req = self.ans = -1
        self.reaper: threading.Thread | None = None
        self.exit: dict[str, int | None] = {}
        self.last_answer = 0.0

    def alive(self) -> bool:
        if self.pid is None:
            return False
        if self.reaper is not None and not self.reaper.is_alive():  # it left (idle): tidy up
            self._forget()
            return False
        return True

    def _usable(self) -> bool:
        """Alive and not about to leave idle: a request never races the idle exit unless
        the child was descheduled for IDLE_EXIT_S / 2 (then the retry below covers it)."""
        if self.alive() and time.monotonic() - self.last_answer > IDLE_EXIT_S / 2:
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
                if answer[0] == "unresolved":  # a snapshot older than the op or its kernels
                    self.stop()
                    if fresh:
                        return None
                    continue
                return answer
            return None

    def _exchange(self, payload: bytes, timeout: float) -> Answer | None:
        deadline = time.monotonic() + timeout
        try:
            _write_request(self.req, payload)
            data = _read_frame(self.ans, deadline)
        except _Timeout:
            self.stop()
            return _timed_out(timeout)
        except OSError:  # EPIPE: gone before reading
            data = None
        if data is not None:
            self.last_answer = time.monotonic()
            return pickle.loads(data)
        status = self._wait_exit()
        if status is None or (os.WIFEXITED(status) and os.WEXITSTATUS(status) == _IDLE_EXIT_CODE):
            return None
        return _death(status)

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
        req_r, req_w = os.pipe()
        ans_r, ans_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: serves until EOF or idle, never returns into the caller
            try:
                os.close(req_w)
                os.close(ans_r)
                _quiet_child(keep=(req_r, ans_w))
                _serve(req_r, ans_w)
            finally:
                os._exit(0)
        os.close(req_r)
        os.close(ans_w)
        exit_box: dict[str, int | None] = {}
        reaper = threading.Thread(target=_reap, args=(pid, exit_box), name="decompshard-sandbox-reaper", daemon=True)
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
        for fd in (self.req, self.ans):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.pid, self.req, self.ans, self.reaper, self.exit = None, -1, -1, None, {}

    def after_fork_in_child(self) -> None:
        """In any process forked from this one: the sandbox is the parent's, not ours."""
        self.lock = threading.Lock()  # another thread may have held it at the fork
        self._forget()


_SANDBOX = _Sandbox()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SANDBOX.after_fork_in_child)


@atexit.register
def _at_exit() -> None:
    """Stop the child now rather than when it notices EOF; never wait on a request in
    flight in another thread (its run may be the hung one)."""
    if _SANDBOX.lock.acquire(timeout=1.0):
        try:
            _SANDBOX.stop()
        finally:
            _SANDBOX.lock.release()
    elif _SANDBOX.pid is not None:
        with contextlib.suppress(OSError):
            os.kill(_SANDBOX.pid, signal.SIGKILL)


def _reap(pid: int, box: dict[str, int | None]) -> None:
    try:
        box["status"] = os.waitpid(pid, 0)[1]
    except ChildProcessError:  # someone else reaped it (a waitpid(-1) elsewhere)
        box["status"] = None


def _serve(req: int, ans: int) -> None:
    """The child's loop: one request, one answer, until EOF or IDLE_EXIT_S of silence."""
    while True:
        ready, _, _ = select.select([req], [], [], IDLE_EXIT_S)
        if not ready:
            os._exit(_IDLE_EXIT_CODE)
        payload = _read_frame(req, None)
        if payload is None:  # the parent exited or shut the sandbox down
            os._exit(0)
        try:
            fn, args = pickle.loads(payload)
        except Exception as e:
            answer: Answer = ("unresolved", _first_line(e))
        else:
            answer = _call(fn, args)
        _write_frame(ans, _dump_answer(answer))


# ------------------------------------------------------------------------ helpers


def _call(fn: Callable[..., Any], args: tuple) -> Answer:
    try:
        return "ok", fn(*args)
    except Exception as e:
        return "error", _first_line(e)


def _quiet_child(keep: tuple[int, ...]) -> None:
    """A forked child's setup: a crash here is the expected answer, not news."""
    faulthandler.disable()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    _close_fds_except({0, 1, 2, *keep})
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
    DTensor call); the child runs real kernels on real tensors, under none of them."""
    from torch.utils._python_dispatch import _disable_current_modes

    global _POPPED_MODES
    _POPPED_MODES = _disable_current_modes()  # kept: collecting it would push them back
    _POPPED_MODES.__enter__()
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()


_POPPED_MODES: Any = None


class _OpPickler(pickle.Pickler):
    """Sends an OpOverload by name, with its dispatch table to detect a stale child."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            name = obj.name()
            return _resolve_op, (obj._schema.name, obj._overloadname, torch._C._dispatch_dump_table(name))
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    import io

    buf = io.BytesIO()
    _OpPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _resolve_op(qualname: str, overload: str, table: str) -> Any:
    ns, name = qualname.split("::", 1)
    op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    if torch._C._dispatch_dump_table(op.name()) != table:
        raise LookupError(f"{op.name()}: its kernels changed after the sandbox was forked")
    return op


def _dump_answer(answer: Answer) -> bytes:
    try:
        return pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as e:
        return pickle.dumps(("error", f"the result does not pickle: {_first_line(e)}"))


class _Timeout(Exception):
    pass


def _write_frame(fd: int, data: bytes) -> None:
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _write_request(fd: int, data: bytes) -> None:
    """A write to a child that just died fails with EPIPE, and raises SIGPIPE: ignored by
    Python by default, fatal where the application restored the default action (CLIs
    piped into `head` do). There, the signal is blocked for this write and consumed."""
    if (
        signal.getsignal(signal.SIGPIPE) is not signal.SIG_DFL
        or not hasattr(signal, "sigtimedwait")
        or not hasattr(signal, "pthread_sigmask")
    ):
        _write_frame(fd, data)
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGPIPE})
    try:
        _write_frame(fd, data)
    finally:
        if signal.SIGPIPE in signal.sigpending():
            signal.sigtimedwait({signal.SIGPIPE}, 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _read_frame(fd: int, deadline: float | None) -> bytes | None:
    """One frame's payload; None on EOF (the writer is gone); _Timeout past `deadline`."""
    head = _read_exact(fd, _HEADER.size, deadline)
    if head is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(head)[0], deadline)
    return body


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _Timeout
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _death(status: int | None) -> Answer:
    if status is not None and os.WIFSIGNALED(status):
        return "crash", signal.Signals(os.WTERMSIG(status)).name
    if status is not None and os.WIFEXITED(status):
        return "crash", f"exit status {os.WEXITSTATUS(status)}"
    return "crash", "exited, status unknown"


def _timed_out(timeout: float) -> Answer:
    return "timeout", f"no answer within {timeout:g} s (the run was killed)"


def _first_line(e: BaseException) -> str:
    return (str(e).splitlines() or [type(e).__name__])[0][:120]
