"""End to end: a tensor-parallel attention block (tests/_tp_block.py) with heads sharded
across 4 ranks, under LocalTensorMode and on 4 real gloo processes.

ColwiseParallel q/k/v, RowwiseParallel out, the standard view/transpose layout, causal
attention, forward and backward. Checked: outputs and every gradient equal the single
device run, and nothing inside the attention communicates (CommDebugMode's per-module
counts): the only collective is the out projection's all-reduce. torch 2.13's own
DTensor cannot run this block (no strategy for CPU flash attention).
"""

from __future__ import annotations

import json
import warnings

import pytest
from torch.distributed._local_tensor import LocalTensorMode

import _e2e_model as M
import _gloo_cases as G
import _tp_block as T
import decompshard

ALL_REDUCE = "c10d_functional.all_reduce"


@pytest.fixture(scope="module")
def mesh():
    with M.fake_world(4):
        yield M.submesh((4,))
    decompshard.disable()


def _assert_tp_block_result(diffs: dict, counts: dict) -> None:
    assert diffs and max(diffs.values()) < 1e-10, diffs
    attn = counts.get("Block.attn", {"forward": {}, "backward": {}})
    assert attn["forward"] == {} and attn["backward"] == {}, f"collectives inside attention: {attn}"
    assert counts["Global"]["forward"] == {ALL_REDUCE: 1}  # out projection (RowwiseParallel)
    assert counts["Global"]["backward"] == {}


def test_tensor_parallel_attention_matches_one_device(mesh):
    ref = T.reference()
    with LocalTensorMode(4), decompshard.enabled():
        got, counts = T.run(mesh)
    _assert_tp_block_result(T.compare(got, ref), counts)


def test_torch_alone_has_no_strategy_for_it(mesh):
    with LocalTensorMode(4), warnings.catch_warnings(), pytest.raises(NotImplementedError) as err:
        warnings.simplefilter("ignore")
        decompshard.disable()
        T.run(mesh)
    assert "_scaled_dot_product_flash_attention_for_cpu" in str(err.value)


def test_gloo_four_processes(tmp_path):
    G.spawn(T.gloo_worker, (4, M.free_port(), str(tmp_path)), 4)
    for rank in range(4):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert "__error__" not in report, f"rank {rank}: {report.get('__error__')}"
        _assert_tp_block_result(report["diffs"], report["counts"])
