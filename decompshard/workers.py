"""A small process pool that survives what it runs: crashes and hangs stay with one job.

The checks run real CPU kernels on odd local shapes (a few trust sizes blindly and
corrupt the heap) and real DTensor code (which can hang), so each job runs in a worker
process with a deadline; an overrun or a crash kills that worker, reports the job as
failed, and a fresh worker takes the next job. Ctrl-C stops every worker without a word
from them and re-raises in the caller.

The pool is the many-jobs, several-cores form of decompshard.isolate (the one process
isolator): its workers run isolate's `serve` loop and answer in its vocabulary. They
start from a forkserver that preloaded torch rather than as forks of the caller, so that
a worker is a clean process whatever state the caller is in (threads, dispatch modes,
a CLI's open files).
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing as mp
import os
import pickle
import signal
import threading
import time
import warnings
from multiprocessing.connection import wait
from typing import Any, Callable, Iterator, Sequence

from decompshard.errors import one_line
from decompshard.isolate import serve, named_line

Job = tuple[str, Callable[..., Any], tuple]  # (name, module-level function, its arguments)

_START_TIMEOUT = 300.0


def _worker_main(conn: Any, modules: Sequence[str] = ()) -> None:
    """Import the jobs' `modules`, say "ready", then serve (fn, args) requests with the
    one protocol of decompshard.isolate until the parent closes the pipe.

    A job's deadline starts when a ready worker receives it, so what every job needs
    loads before "ready": importing the coverage sweep takes seconds on a busy machine,
    and inside the first job's deadline it failed that job (and the next worker's) as
    timed out without running a line of it."""
    import importlib

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C for all
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception:  # each job that needs it unpickles it again and reports the error
            continue
    try:
        conn.send_bytes(b"ready")
    except OSError:  # the parent closed our pipe while we started (a timeout, Ctrl-C): leave quietly
        return
    serve(conn, conn, describe=named_line)


@contextlib.contextmanager
def quiet_children() -> Iterator[None]:
    """Processes started inside inherit TORCH_CPP_LOG_LEVEL=ERROR (unless the user set it):
    the checks run kernels on odd layouts on purpose (the numerical checker's layout
    probe), and torch's C++ warnings about them ("input value tensor is
    non-contiguous") would go straight to the terminal, past the workers' Python warning
    filter. torch reads the variable when it loads, so it must be set before the worker
    server imports torch."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["TORCH_CPP_LOG_LEVEL"] = "ERROR"
    try:
        yield
    finally:
        os.environ.pop("TORCH_CPP_LOG_LEVEL", None)


def start_server(modules: Sequence[str] = ()) -> None:
    """Start the forkserver (torch, this module and `modules` preloaded) unless it runs.

    It starts with SIGINT ignored, which it and every worker it forks inherit (Python
    installs no KeyboardInterrupt handler when it starts with SIGINT ignored): a Ctrl-C
    at the terminal reaches the whole process group, and only the caller must answer it
    (it stops the workers and says "interrupted" once); a server interrupted while it
    imports torch would print a traceback. A Ctrl-C in the few milliseconds of the spawn
    itself is lost, so the ignoring happens once per process, never on the later calls
    (each run_jobs makes one, and a Ctrl-C there must stop the caller)."""
    from multiprocessing import forkserver

    global _SERVER_STARTED_BY
    if _SERVER_STARTED_BY == os.getpid():
        with quiet_children():
            forkserver.ensure_running()  # running: returns at once (restarts one that died)
        return
    mp.get_context("forkserver").set_forkserver_preload(["decompshard.workers", "torch", *modules])
    try:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread: Ctrl-C never raises here
        previous = None
    try:
        with quiet_children():
            forkserver.ensure_running()
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    _SERVER_STARTED_BY = os.getpid()


_SERVER_STARTED_BY: int | None = None  # the process that started the forkserver with Ctrl-C ignored


def _context(modules: Sequence[str] = ()) -> Any:
    """forkserver with torch and the jobs' `modules` preloaded (a recycled worker starts
    in ~25 ms instead of ~5 s for a spawned one; a server already running keeps its own
    preload); spawn where forkserver does not exist."""
    if "forkserver" in mp.get_all_start_methods():
        start_server(modules)
        return mp.get_context("forkserver")
    return mp.get_context("spawn")


@contextlib.contextmanager
def _ctrl_c_after() -> Iterator[None]:
    """A Ctrl-C inside is held until the block is done, then raised as it would have been.

    Starting a worker is a request to the forkserver: a connect, then a send of fds. A
    KeyboardInterrupt between the two closes the socket, and the server dies printing an
    EOFError traceback (multiprocessing catches only OSError there). Blocking SIGINT in
    this thread does not hold it: the kernel hands a signal sent to the process group to
    any thread that leaves it unblocked (torch's OpenMP threads), and Python then runs
    the handler in the main thread at its next bytecode. So the handler itself is
    replaced by one that only notes the signal."""
    caught: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    if previous is None or threading.current_thread() is not threading.main_thread():
        yield  # a handler set outside Python (none to put back), or Ctrl-C never raises here
        return
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught and callable(previous):
            previous(signal.SIGINT, None)
        elif caught and previous == signal.SIG_DFL:
            signal.raise_signal(signal.SIGINT)


class _Worker:
    def __init__(self, ctx: Any, modules: Sequence[str] = ()):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, tuple(modules)), daemon=True)
        with _ctrl_c_after():  # the fork request reaches the server whole
            self.proc.start()
        child.close()
        self.ready = False
        self.job: str | None = None
        self.started = time.monotonic()

    def stop(self, kill: bool = False) -> None:
        if kill:
            self.proc.kill()
        self.conn.close()
        self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


def run_jobs(jobs: Sequence[Job], workers: int, timeout: float,
             on_result: Callable[[str, Any], None], on_failure: Callable[[str, str, float], None]) -> None:
    """Run `fn(*args)` for each job on `workers` processes (0: in this process, no
    deadline). `on_result(name, value)` for each finished job, `on_failure(name, reason,
    seconds)` for one that raised, crashed or overran `timeout` seconds (counted from
    when a ready worker received it)."""
    if workers <= 0:
        for name, fn, args in jobs:
            t0 = time.perf_counter()
            try:
                value = fn(*args)
            except Exception as e:
                on_failure(name, f"error: {one_line(e, 200)}", time.perf_counter() - t0)
                continue
            on_result(name, value)
        return
    preload = sorted({fn.__module__ for _, fn, _ in jobs} - {"__main__"})  # a script's main never reruns
    ctx = _context(preload)
    from decompshard.user_modules import call_with_user_modules, imported

    modules = imported()  # the user's --import/--model modules: their custom ops, in every worker
    if modules:
        jobs = [(name, call_with_user_modules, (modules, fn, args)) for name, fn, args in jobs]
    pending = collections.deque((name, pickle.dumps((fn, args))) for name, fn, args in jobs)
    pool = [_Worker(ctx, preload) for _ in range(min(workers, len(pending)))]
    early_deaths = 0
    try:
        while pending or any(w.job for w in pool):
            for w in pool:
                if w.ready and w.job is None and pending:
                    w.job, payload = pending.popleft()
                    w.started = time.monotonic()
                    w.conn.send_bytes(payload)
            now = time.monotonic()
            limits = [w.started + (timeout if w.job else _START_TIMEOUT) - now for w in pool if w.job or not w.ready]
            for conn in wait([w.conn for w in pool], timeout=max(0.0, min(limits)) if limits else None):
                w = next(x for x in pool if x.conn is conn)
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    w.proc.join(1)
                    code = w.proc.exitcode
                    if w.job:
                        on_failure(w.job, f"crashed: worker exited with code {code}", time.monotonic() - w.started)
                    elif (early_deaths := early_deaths + 1) >= 3:
                        raise RuntimeError(f"worker processes fail to start (exit code {code})") from None
                    pool[pool.index(w)] = _Worker(ctx, preload)
                    w.stop(kill=True)
                    continue
                if not w.ready:
                    w.ready = True
                    continue
                name, w.job = w.job, None
                status, value = pickle.loads(data)
                if status == "ok":
                    on_result(name, value)
                else:
                    on_failure(name, f"error: {value}", time.monotonic() - w.started)
            now = time.monotonic()
            for i, w in enumerate(pool):
                if w.job and now - w.started > timeout:
                    on_failure(w.job, f"timed out after {timeout:g} s", now - w.started)
                    w.stop(kill=True)
                    pool[i] = _Worker(ctx, preload)
                elif not w.ready and now - w.started > _START_TIMEOUT:
                    raise RuntimeError(f"a worker process did not start within {_START_TIMEOUT:g} s")
    finally:
        for w in pool:  # an idle worker leaves on its own when its pipe closes
            w.stop(kill=bool(w.job))
