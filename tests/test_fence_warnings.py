"""A fence warns only where it changed something (decompshard/runtime/fences/changed.py).

On torch 2.13 a training loop with even batches, where DTensor alone is right, warned
once per rank about three fences (the training-loop zoo, data parallel Llama): `.item()`
of a Partial(product) (transformers' `all()` of a mask, every part True), `cumsum(-1)`
of a batch-sharded tensor (the scanned dim not sharded), the mean-of-means loss with the
same number of counted targets on every rank. Each fence still runs its plan there (the
numbers are checked here), silently; where DTensor alone would give other numbers it
warns, as before. Four simulated ranks.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Shard, distribute_tensor

import decompshard
from decompshard.runtime.fences.table import fenced, wrong_here
from decompshard.verify.dtensor_case import device_mesh

pytestmark = pytest.mark.usefixtures("world")
W = 4


def _guard_warnings(fn) -> tuple[object, list[str]]:
    """fn()'s result under enable() on 4 simulated ranks, and the guard's warnings."""
    mesh = device_mesh((W,))
    decompshard.enable(guard_native=True)
    try:
        with warnings.catch_warnings(record=True) as caught, LocalTensorMode(W):
            warnings.simplefilter("always")
            out = fn(mesh)
    finally:
        decompshard.disable()
    return out, [str(w.message) for w in caught if "decompshard guard" in str(w.message)]


def _item_of_all(mask: torch.Tensor):
    return lambda mesh: bool(distribute_tensor(mask, mesh, [Shard(0)]).all().item())


def test_item_of_a_partial_warns_only_where_a_rank_reads_another_value():
    key = "aten._local_scalar_dense.default"
    # torch 2.13: `all()` of a batch-sharded mask is a Partial(product) (later releases
    # reduce it first); every part True, so each rank's own part is the global value
    got, texts = _guard_warnings(_item_of_all(torch.ones(8, dtype=torch.bool)))
    assert got is True and not [t for t in texts if key in t], texts
    mask = torch.ones(8, dtype=torch.bool)
    mask[5] = False  # one rank's part False: the global value is False on every rank
    got, texts = _guard_warnings(_item_of_all(mask))
    assert got is False
    # a Partial(sum) on every release: each rank's part is not the sum
    got, texts = _guard_warnings(
        lambda mesh: float(distribute_tensor(torch.arange(8, dtype=torch.float64), mesh, [Shard(0)]).sum().item()))
    assert got == 28.0
    assert [t for t in texts if key in t] or not fenced(key), texts


def _cumsum(x: torch.Tensor, placements):
    return lambda mesh: distribute_tensor(x, mesh, placements).cumsum(-1).full_tensor()


def test_negative_dim_scan_warns_only_where_the_scanned_dim_is_sharded():
    key = "aten.cumsum.default"
    x = torch.arange(32, dtype=torch.float64).reshape(8, 4)
    got, texts = _guard_warnings(_cumsum(x, [Shard(0)]))  # the batch dim sharded, the scan on dim 1
    assert torch.equal(_plain(got), x.cumsum(-1)) and not [t for t in texts if key in t], texts
    got, texts = _guard_warnings(_cumsum(x.T.contiguous(), [Shard(1)]))  # the scanned dim sharded
    assert torch.equal(_plain(got), x.T.cumsum(-1))
    assert bool([t for t in texts if key in t]) == (fenced(key) and wrong_here(key)), texts


def _plain(t) -> torch.Tensor:
    from decompshard._compat import rank_tensors

    parts = rank_tensors(t)
    return parts[0] if parts is not None else t


def _mean_loss(logits: torch.Tensor, target: torch.Tensor):
    return lambda mesh: F.cross_entropy(distribute_tensor(logits, mesh, [Shard(0)]),
                                        distribute_tensor(target, mesh, [Shard(0)])).full_tensor()


def test_mean_loss_warns_only_where_ranks_count_different_targets():
    key = "aten.nll_loss_forward.default"
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(8, 5, dtype=torch.float64, generator=g), torch.randint(0, 5, (8,), generator=g)
    got, texts = _guard_warnings(_mean_loss(logits, target))  # 2 counted targets on every rank
    assert torch.allclose(_plain(got), F.cross_entropy(logits, target)) and not [t for t in texts if key in t], texts
    target = target.clone()
    target[0] = -100  # rank 0 counts one target, the others two: a mean of means is wrong
    got, texts = _guard_warnings(_mean_loss(logits, target))
    assert torch.allclose(_plain(got), F.cross_entropy(logits, target))
    assert bool([t for t in texts if key in t]) == (fenced(key) and wrong_here(key)), texts
