"""Run a kernel where a crash cannot take the caller down.

Why: the local-shape check runs an op's real CPU kernel on zero-filled, possibly empty
inputs (localcheck._real_kernel_on_empty_shard), and some kernels crash instead of
raising: CPU flash attention divides by the head count, SIGFPE with 0 heads. A fresh fork
per run isolates that but costs ~23 ms with torch loaded (fork, page tables, teardown),
more than the whole rest of the derivation for ops like permute_copy or pixel_shuffle.

So one sandbox process is forked on first need and reused: a `decompshard.isolate.ForkedServer`
(the one process isolator: its answers, deadlines, crash and hang handling, idle exit,
death with the parent, quiet child and fallbacks are described there). A timeout is
kept apart from the other answers because it says nothing about the op: another rank of
the same job may get a real answer (see localcheck.strict_checks).

What is specific to kernels stays here: what the sandbox runs (`output_shapes_on_zeros`:
zeros shaped like the arguments, sent by description) and how a request travels (an
OpOverload by name, with its dispatch table, so that a request naming an op the forked
snapshot cannot resolve, or whose kernels changed since the fork, restarts the sandbox;
what still does not unpickle in a fresh child runs in a one-shot fork, `isolated`).

This is infrastructure like a thread pool, not a cache: the child remembers no result,
every request runs its function afresh, so `decompshard.clear_caches()` ("forget every
cached result") has nothing here to forget and leaves the process running.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch

from decompshard import isolate
from decompshard.dispatch_modes.graph import leaves, map_leaves
from decompshard.isolate import Answer

__all__ = ["TIMEOUT_S", "IDLE_EXIT_S", "Answer", "run", "isolated", "output_shapes_on_zeros", "shutdown", "sandbox_pid"]

TIMEOUT_S = 30.0  # a run without an answer by then is killed and reported as a timeout
IDLE_EXIT_S = 5.0  # the sandbox exits after this long without a request


# ------------------------------------------------------------------------ public API


def run(fn: Callable[..., Any], *args: Any, timeout: float = TIMEOUT_S) -> Answer:
    """`fn(*args)` in the sandbox process. `fn` must be a module-level function (it is
    pickled by reference); anything that does not pickle runs in a one-shot fork."""
    return _SANDBOX.run(fn, args, timeout)


def isolated(fn: Callable[[], Any], timeout: float = TIMEOUT_S) -> Answer:
    """`fn()` in a freshly forked child (any closure; ~23 ms with torch loaded): ('ok', its
    picklable result), ('error', the exception's first line), ('crash', the signal's
    name) or ('timeout', ...). In-process where the platform has no fork."""
    return isolate.isolated(fn, timeout)


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


# ------------------------------------------------------------------------ the payload


class _OpPickler(pickle.Pickler):
    """Sends an OpOverload by name, with its dispatch table to detect a stale child."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch._ops.OpOverload):
            name = obj.name()
            return _resolve_op, (obj._schema.name, obj._overloadname, torch._C._dispatch_dump_table(name))
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _OpPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def _resolve_op(qualname: str, overload: str, table: str) -> Any:
    ns, name = qualname.split("::", 1)
    op = getattr(getattr(getattr(torch.ops, ns), name), overload)
    if torch._C._dispatch_dump_table(op.name()) != table:
        raise LookupError(f"{op.name()}: its kernels changed after the sandbox was forked")
    return op


_SANDBOX = isolate.ForkedServer("decompshard-sandbox", IDLE_EXIT_S, dumps=_dumps)
