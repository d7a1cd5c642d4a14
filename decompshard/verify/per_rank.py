"""A function run once per simulated rank, and the simulator's chunk mend built on it."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from decompshard._compat import chunk_split_points, make_local_tensor, outside_simulation, rank_tensors

__all__ = ["per_rank_call", "simulator_chunks"]


def per_rank_call(fn: Any) -> Any:
    """`fn(tensor, ...)` run on each simulated rank's tensor separately (outside the
    mode), its results (a tensor or a list of them) put back together as LocalTensors."""
    def wrapped(tensor: torch.Tensor, *rest: Any, **kwargs: Any) -> Any:
        per_rank = rank_tensors(tensor)
        if per_rank is None:
            return fn(tensor, *rest, **kwargs)
        with outside_simulation():
            results = {r: fn(t, *rest, **kwargs) for r, t in per_rank.items()}
        first = next(iter(results.values()))
        if isinstance(first, torch.Tensor):
            return make_local_tensor(results)
        return [make_local_tensor({r: p[i] for r, p in results.items()}) for i in range(len(first))]

    return wrapped


@contextlib.contextmanager
def simulator_chunks() -> Iterator[None]:
    """Mend one LocalTensorMode gap for the duration: DTensor and its collectives split
    tensors with `torch.chunk`, which returns fewer pieces when a dim is short or empty.
    With ranks of unequal local sizes (an uneven or empty shard on another mesh dim) the
    simulated ranks disagree on the count and the simulator fails ('NoneType' object has
    no attribute 'requires_grad'; "Sizes of tensors must match" in an all-gather). Each
    real process splits its own tensor; we run the two splitting helpers per rank, which
    is what they do there. Process-wide (DTensor's `Shard._custom_chunk` and
    `torch._utils._chunk_or_narrow_cat` are patched) and only for the simulation:
    tests/test_check_gloo.py runs such cases on real gloo processes."""
    (shard, chunk_name), (utils, cat_name) = chunk_split_points()
    original_chunk = vars(shard)[chunk_name]
    original_cat = getattr(utils, cat_name)
    setattr(shard, chunk_name, staticmethod(per_rank_call(original_chunk.__func__)))
    setattr(utils, cat_name, per_rank_call(original_cat))
    try:
        yield
    finally:
        setattr(shard, chunk_name, original_chunk)
        setattr(utils, cat_name, original_cat)
