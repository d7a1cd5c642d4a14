"""In-place ops without a native strategy are computed out of place and written back
into `self` (decompshard/runtime/support/inplace.py). Before, a derived strategy could move `self`:
DTensor ran the op on a redistributed copy and relabelled the untouched shard."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import decompshard
from decompshard._compat import DTensor, custom_op_handlers
from decompshard.runtime.support.inplace import written_back_ops
from decompshard.verify.dtensor_case import device_mesh, rank_locals

aten = torch.ops.aten


pytestmark = pytest.mark.usefixtures("world")  # 4 simulated ranks, from conftest.py


def _index_add(self_pl, src_pl):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, 6, dtype=torch.float64, generator=g)
    idx = torch.randint(0, 12, (7,), generator=g)
    src = torch.randn(7, 6, dtype=torch.float64, generator=g)
    want = x.clone().index_add_(0, idx, src)
    mesh = device_mesh((4,))
    with LocalTensorMode(4), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # through a shard: a replicated plain tensor is one tensor all simulated ranks
        # share, which an in-place op on per-rank arguments would update once per rank
        dx = distribute_tensor(x.clone(), mesh, [Shard(0)]).redistribute(mesh, self_pl)
        alias = dx.view(-1)  # a view of self sees the update
        out = dx.index_add_(0, distribute_tensor(idx, mesh, [Replicate()]), distribute_tensor(src, mesh, src_pl))
        assert out is dx and dx.placements == tuple(self_pl)
        full, via_alias = dx.full_tensor(), alias.full_tensor().view(12, 6)
        return max(max((v - want).abs().max().item() for v in rank_locals(t, device_mesh((4,))).values())
                   for t in (full, via_alias))


@pytest.mark.parametrize("self_pl,src_pl", [([Shard(0)], [Replicate()]),   # Mixtral's expert loop
                                            ([Shard(0)], [Shard(1)]),
                                            ([Replicate()], [Shard(1)])], ids=str)
def test_index_add_into_any_self_layout_matches_one_device(self_pl, src_pl):
    decompshard.enable()
    assert _index_add(self_pl, src_pl) < 1e-12
    decompshard.disable()  # torch's own fallback moves self: an error, or wrong values for R self
    with pytest.raises(Exception):
        assert _index_add(self_pl, src_pl) < 1e-12


def test_which_ops_and_disable_removes_them():
    ops = dict(written_back_ops())
    assert ops[aten.index_add_.default] is aten.index_add.default
    assert aten.as_strided_.default not in ops and aten.t_.default not in ops  # metadata, not values
    assert aten.add_.Tensor not in ops  # native strategy
    handlers = DTensor._op_dispatcher._custom_op_handlers
    before = dict(handlers)
    decompshard.enable()
    assert set(ops) <= set(handlers)
    decompshard.disable()
    assert handlers == before


@pytest.mark.parametrize("batch", [5, 8], ids=["uneven", "even"])
def test_mixtral_dp_step_matches_one_device(batch):
    # MoE routing: nonzero (data-dependent, replicated) and index_add_ into the
    # batch-sharded output at global token indices (written back)
    from _dp_step import dp_step, import_transformers

    t = import_transformers()
    torch.manual_seed(0)
    cfg = t.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16,
                          use_cache=False, num_local_experts=4, num_experts_per_tok=2,
                          experts_implementation="eager")  # grouped_mm takes no float64
    model = t.MixtralForCausalLM(cfg)
    ids = torch.randint(0, 64, (batch, 6))
    inputs = {"input_ids": ids, "labels": ids, "position_ids": torch.arange(6).expand(batch, 6).contiguous()}
    decompshard.enable()
    try:
        res = dp_step(model, inputs, lambda out: out.loss, (4,))
    finally:
        decompshard.disable()
    assert not res["missing"]
    assert max(res["errors"].values()) < 1e-12, res["errors"]


def test_derived_strategy_of_an_in_place_op_keeps_self():
    # without the write-back handler (in-place ops with no functional twin), the
    # derived strategy may not move self: a strategy that keeps it, or a clear error
    decompshard.enable()
    try:
        # taken out by hand: the handler is one of the entries enable() installs together
        # (disable() empties the slot again either way: it was empty before enable())
        custom_op_handlers().pop(aten.index_add_.default)
        assert _index_add([Replicate()], [Shard(1)]) < 1e-12  # was: self relabelled S(1) over the full tensor
        with pytest.raises(Exception) as raised:  # DTensor reports it as "no sharding strategy", from ours
            _index_add([Shard(0)], [Replicate()])
        chain, e = [], raised.value
        while e is not None:
            chain.append(str(e))
            e = e.__cause__
        assert any("in place on self" in m for m in chain), chain
    finally:
        decompshard.disable()


@pytest.mark.parametrize("rows,reduced", [(7, "src"), (30, "self")])
def test_partial_source_is_reduced_where_that_moves_less(rows, reduced):
    # Mixtral tp: each expert's Partial rows added into the replicated token buffer
    # all-reduced the whole buffer per expert (4 x 16 KiB); reducing the rows first
    # moves only them. Numbers equal one device either way.
    from torch.distributed.tensor import Partial

    from decompshard.dispatch_modes.comm_bytes import CommBytes
    from decompshard.verify.dtensor_case import make_dtensor

    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, 6, dtype=torch.float64, generator=g)
    idx = torch.randint(0, 12, (rows,), generator=g)
    src = torch.randn(rows, 6, dtype=torch.float64, generator=g)
    want = x.clone().index_add_(0, idx, src)
    mesh = device_mesh((4,))
    decompshard.enable()
    try:
        with LocalTensorMode(4), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dx = distribute_tensor(x.clone(), mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
            dsrc = make_dtensor(src, mesh, [Partial()], seed=0, salt=0)  # random per-rank parts
            di = distribute_tensor(idx, mesh, [Replicate()])
            with CommBytes() as comm:
                dx.index_add_(0, di, dsrc)
            err = max((v - want).abs().max().item() for v in rank_locals(dx.full_tensor(), mesh).values())
    finally:
        decompshard.disable()
    assert err < 1e-12 and dx.placements == (Replicate(),)
    assert comm.bytes == {"src": src, "self": x}[reduced].numel() * 8
