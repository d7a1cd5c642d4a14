"""A clean dispatch state for tracing: no ambient modes, no grad, a plain thread's keys."""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator

import torch
from decompshard._compat import disable_current_modes as _disable_current_modes


def _fresh_thread_dispatch_keys() -> tuple[Any, Any]:
    """The dispatch-key TLS of a new thread: no mode, nothing excluded but autocast."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(
        (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())))
    t.start()
    t.join()
    return box[0]


# DTensor asks for a strategy from inside its __torch_dispatch__, where autograd and every
# key above Python are excluded; there a CompositeImplicitAutograd op reaches the tracing
# mode undecomposed (sdpa's math path, tagged random, then looks random). A caller's
# FakeTensorMode or LocalTensorMode would turn our meta tensors into theirs. Deriving
# under a plain thread's key state with no mode makes every (cached) result the same,
# whatever the caller has active.
@functools.lru_cache(maxsize=None)
def _plain_keys() -> tuple[Any, Any]:
    return _fresh_thread_dispatch_keys()  # read once, on first use (not at import)


@contextlib.contextmanager
def clean_dispatch_state() -> Iterator[None]:

    include, exclude = _plain_keys()
    with _disable_current_modes(), torch.no_grad(), torch._C._ForceDispatchKeyGuard(include, exclude):
        yield
