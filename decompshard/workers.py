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
import time
import warnings
from multiprocessing.connection import wait
from typing import Any, Callable, Iterator, Sequence

from decompshard.errors import one_line
from decompshard.isolate import serve, named_line

Job = tuple[str, Callable[..., Any], tuple]  # (name, module-level function, its arguments)

_START_TIMEOUT = 300.0


def _worker_main(conn: Any) -> None:
    """Say "ready", then serve (fn, args) requests with the one protocol of
    decompshard.isolate until the parent closes the pipe."""
    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C for all
    if hasattr(signal, "pthread_sigmask"):  # a spawned worker inherits _Worker's mask
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
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


def _context() -> Any:
    """forkserver with torch preloaded (a recycled worker starts in ~25 ms instead of ~5 s
    for a spawned one); spawn where forkserver does not exist."""
    if "forkserver" in mp.get_all_start_methods():
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["decompshard.workers", "torch"])
        with quiet_children():
            forkserver.ensure_running()
        return ctx
    return mp.get_context("spawn")


class _Worker:
    def __init__(self, ctx: Any):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), daemon=True)
        # A fork request to the forkserver is a connect then a send of fds; a Ctrl-C between
        # the two closes the socket and the server dies printing an EOFError traceback
        # (multiprocessing catches only OSError there). SIGINT waits until the request is sent.
        blocked = hasattr(signal, "pthread_sigmask")
        if blocked:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            self.proc.start()
        finally:
            if blocked:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
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
    ctx = _context()
    from decompshard.user_modules import call_with_user_modules, imported

    modules = imported()  # the user's --import/--model modules: their custom ops, in every worker
    if modules:
        jobs = [(name, call_with_user_modules, (modules, fn, args)) for name, fn, args in jobs]
    pending = collections.deque((name, pickle.dumps((fn, args))) for name, fn, args in jobs)
    pool = [_Worker(ctx) for _ in range(min(workers, len(pending)))]
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
                    pool[pool.index(w)] = _Worker(ctx)
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
                    pool[i] = _Worker(ctx)
                elif not w.ready and now - w.started > _START_TIMEOUT:
                    raise RuntimeError(f"a worker process did not start within {_START_TIMEOUT:g} s")
    finally:
        for w in pool:  # an idle worker leaves on its own when its pipe closes
            w.stop(kill=bool(w.job))
