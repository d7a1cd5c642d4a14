"""torch's own decomposition fallback, reproduced over the whole placement alphabet.

Every expectation below was checked against torch 2.13's real behaviour
(`DecompShardingStrategy` in torch/distributed/tensor/_decompositions.py).
"""

from __future__ import annotations

import itertools
import re

import pytest
import torch
import torch.distributed as dist

from decompshard.coverage.opinfo_samples import capture_aten_samples, decomp_only_ops
from decompshard.coverage.torch_fallback import (
    default_candidates,
    from_torch_placement,
    to_torch_placement,
    torch_fallback_first_call,
    torch_fallback_first_call_details,
    torch_fallback_rules,
)
from decompshard.placements import P, R, S, SingleDimRule, parse_rule

aten = torch.ops.aten


def rules_of(op, *args, **kwargs):
    res = torch_fallback_rules(op, args, kwargs)
    return res, set(res.rule_strings())


# ----------------------------------------------------------------------------- placements


def test_placement_round_trip():
    from torch.distributed.tensor.placement_types import (
        Partial,
        Replicate,
        Shard,
        _StridedShard,
    )

    for p in (R, S(0), S(3), P("sum"), P("avg"), P("max"), P("min"), None):
        assert from_torch_placement(to_torch_placement(p)) == p
    assert to_torch_placement(S(1)) == Shard(1)
    assert to_torch_placement(R) == Replicate()
    assert to_torch_placement(P("avg")) == Partial("avg")
    assert from_torch_placement(_StridedShard(1, split_factor=2)) == S(1)


def test_norm_partial_is_not_p_sum():
    from torch.distributed.tensor._ops._math_ops import _NormPartial
    from decompshard.coverage.torch_fallback import UnrepresentablePlacement

    with pytest.raises(UnrepresentablePlacement):
        from_torch_placement(_NormPartial(2))
    assert from_torch_placement(_NormPartial(1)) == P("sum")


def test_default_candidates_alphabet():
    x = torch.randn(2, 3)
    i = torch.tensor([0, 1])
    cands = list(default_candidates((x, i), {}))
    # float 2-D: R, S(0), S(1), 4 partials; int 1-D: R, S(0)
    assert len(cands) == 7 * 2
    assert cands[0] == (R, R)
    assert (P("max"), S(0)) in cands
    assert not any(isinstance(c[1], type(P("sum"))) for c in cands)


# ----------------------------------------------------------------------------- rules


def test_addmv():
    res, rules = rules_of(aten.addmv.default, torch.randn(5), torch.randn(5, 10), torch.randn(10))
    assert res.supported, res.unsupported_reason
    assert res.n_candidates == 6 * 7 * 6
    assert rules == {
        "S(0), S(0), R -> S(0)",
        "P(sum), R, P(sum) -> P(sum)",
        "P(sum), S(1), S(0) -> P(sum)",  # mv re-decomposed inside addmv
        "P(sum), P(sum), R -> P(sum)",
        "P(avg), R, R -> P(avg)",
    }
    # Sharding only the matrix rows needs `input` sharded too: add(R, S(0)) would
    # redistribute, so torch rejects it.
    assert "R, S(0), R -> S(0)" not in rules
    assert any("redistribution" in k for k in res.rejected)
    for r in res.rules:
        assert r.source == "torch-fallback"
        assert not r.even_only
        assert parse_rule(str(r)) == r


def test_mv_is_decomposed_again():
    res, rules = rules_of(aten.mv.default, torch.randn(4, 6), torch.randn(6))
    assert res.supported
    assert {"S(0), R -> S(0)", "S(1), S(0) -> P(sum)", "P(sum), R -> P(sum)", "R, P(sum) -> P(sum)"} <= rules


def _partials_torch_clone_keeps(x: torch.Tensor) -> set[str]:
    """`P -> P` for each Partial the running torch's own clone strategy carries through.
    The _copy ops decompose to a view then clone, and views keep every Partial, so these
    are the Partial rules torch's fallback can find for them (torch 2.13's clone lists
    none; 2.14's lists all four)."""
    from torch.distributed.tensor.placement_types import Partial

    from decompshard._compat import TensorMeta, single_dim_strategy_info

    clone = aten.clone.default
    meta = TensorMeta(x.shape, x.stride(), x.dtype)
    kept = set()
    for out, inp in single_dim_strategy_info(clone).func(clone, (meta,), {}):
        if isinstance(inp, Partial) and out == inp:
            p = from_torch_placement(inp)
            kept.add(f"{p} -> {p}")
    return kept


def test_permute_copy_and_t_copy_keep_the_partials_torchs_clone_keeps():
    x = torch.randn(2, 3, 4)
    res, rules = rules_of(aten.permute_copy.default, x, [2, 0, 1])
    kept = _partials_torch_clone_keeps(x)
    assert rules == {"S(0) -> S(1)", "S(1) -> S(2)", "S(2) -> S(0)"} | kept
    refused = 4 - len(kept)  # each refused Partial is one rejected candidate
    assert sum(res.rejected.values()) == refused
    assert all("requires redistribution for aten.clone.default" in k for k in res.rejected)
    x = torch.randn(2, 3)
    res, rules = rules_of(aten.t_copy.default, x)
    assert rules == {"S(0) -> S(1)", "S(1) -> S(0)"} | _partials_torch_clone_keeps(x)


def test_block_diag_aborts_on_factory_op():
    res, rules = rules_of(aten.block_diag.default, [torch.randn(2, 3), torch.randn(1, 2)])
    assert not res.supported
    assert "aten.zeros" in res.unsupported_reason
    assert "NotImplementedError" in res.unsupported_reason
    assert "\n" not in res.unsupported_reason
    assert rules == set() and res.n_candidates == 1  # aborted at the first candidate


def test_other_aborts():
    res, _ = rules_of(aten.replication_pad2d.default, torch.randn(2, 3, 4, 4), [1, 1, 1, 1])
    assert "aten.arange" in res.unsupported_reason
    res, _ = rules_of(aten.as_strided_copy.default, torch.randn(4, 4), [2, 2], [1, 2])
    assert "aten.as_strided.default does not have a sharding strategy" in res.unsupported_reason


def test_trace_only_replicate():
    res, rules = rules_of(aten.trace.default, torch.randn(5, 5))
    assert res.supported and rules == set() and res.n_accepted == 1


def test_mse_loss_mean_gives_p_avg():
    res, rules = rules_of(aten.mse_loss.default, torch.randn(4, 6), torch.randn(4, 6))
    assert rules == {"S(0), S(0) -> P(avg)", "S(1), S(1) -> P(avg)"}
    # reduction='none' (0) keeps the sharding
    res, rules = rules_of(aten.mse_loss.default, torch.randn(4, 6), torch.randn(4, 6), 0)
    assert rules == {"S(0), S(0) -> S(0)", "S(1), S(1) -> S(1)"}


def test_channel_shuffle_strided_shard_maps_to_s():
    x = torch.randn(2, 4, 3, 3)
    res, rules = rules_of(aten.channel_shuffle.default, x, 2)
    # torch returns _StridedShard(1, split_factor=2) for S(1); ours is S(1)
    shards = {"S(0) -> S(0)", "S(1) -> S(1)", "S(2) -> S(2)", "S(3) -> S(3)"}
    assert rules == shards | _partials_torch_clone_keeps(x)  # views, then a clone


def test_dist_norm_partial_is_reported_unrepresentable():
    res, rules = rules_of(aten.dist.default, torch.randn(4, 3), torch.randn(4, 3))
    assert res.supported
    assert rules == set()
    assert res.unrepresentable == ["S(0), S(0) -> _NormP(2)", "S(1), S(1) -> _NormP(2)"]


def test_multi_output_and_fill():
    _, rules = rules_of(aten.aminmax.default, torch.randn(2, 3), dim=1)
    assert rules == {"S(0) -> S(0), S(0)", "S(1) -> P(min), P(max)"}
    _, rules = rules_of(aten.fill.Scalar, torch.randn(4, 3), 2.0)
    assert {"P(sum) -> R", "P(max) -> R", "S(1) -> S(1)"} <= rules


def test_no_candidate_accepted_is_unsupported():
    # complex() on 0-dim inputs: view_as_real's strategy indexes shape[-1] -> IndexError
    # for every candidate, so torch ends with "should have produced at least Replicate()".
    res, _ = rules_of(aten.complex.default, torch.tensor(1.0), torch.tensor(2.0))
    assert not res.supported and res.n_accepted == 0
    assert "IndexError" in res.unsupported_reason
    res, rules = rules_of(aten.complex.default, torch.randn(2, 3), torch.randn(2, 3))
    assert res.supported and "S(1), S(1) -> S(1)" in rules


def test_tensor_list_op_fails_mesh_expansion():
    # _chunk_cat's single-dim tracing works, but torch's expansion step cannot count
    # a tensor-list argument, so the real dispatch fails.
    res, _ = rules_of(aten._chunk_cat.default, [torch.randn(2, 4), torch.randn(2, 4)], 1, 2)
    assert not res.supported
    assert "mesh expansion failed" in res.unsupported_reason


def test_no_decomposition_and_no_tensor_inputs():
    res = torch_fallback_rules(aten.nonzero.default, (torch.randn(3),), {})
    assert not res.supported and "No decomposition" in res.unsupported_reason
    res = torch_fallback_rules(aten.arange.default, (5,), {})
    assert not res.supported and "no tensor inputs" in res.unsupported_reason


def test_explicit_candidates():
    args = (torch.randn(5), torch.randn(5, 10), torch.randn(10))
    res = torch_fallback_rules(
        aten.addmv.default, args, {}, candidates=[(R, R, R), (S(0), S(0), R), (R, S(0), R)]
    )
    assert res.n_candidates == 3 and res.n_accepted == 2
    assert res.rule_strings() == ["S(0), S(0), R -> S(0)"]
    with pytest.raises(ValueError):
        torch_fallback_rules(aten.addmv.default, args, {}, candidates=[(R, R)])


def test_kwarg_tensors_follow_schema_order():
    # index_add(self, dim, index, source, alpha=...): tensor inputs self, index, source
    args = (torch.randn(4, 3), 0, torch.tensor([0, 2]), torch.randn(2, 3))
    res = torch_fallback_rules(aten.index_add.default, args, {})
    assert res.supported
    for r in res.rules:
        assert len(r.inputs) == 3
        assert not isinstance(r.inputs[1], type(P("sum")))  # integer index: no partials


# ----------------------------------------------------------------------------- first call


def _torch_strategy_as_rule(text: str) -> str:
    """'(S(0), S(0), R) -> S(0)' -> 'S(0), S(0), R -> S(0)'; _S(d, f) -> S(d)."""
    text = re.sub(r"_S\((\d+), \d+\)", r"S(\1)", text)
    lhs, rhs = text.split(" -> ")
    return f"{lhs[1:-1]} -> {rhs}"


def test_first_call_matches_rules_on_the_shard_subset():
    """torch's real first call (inputs Shard(0), 2-rank fake-PG mesh, candidates
    {R, S(d)}) finds exactly the rules our reproduction finds among R/S candidates."""
    cases = [
        (aten.addmv.default, (torch.randn(4), torch.randn(4, 6), torch.randn(6))),
        (aten.mse_loss.default, (torch.randn(4, 6), torch.randn(4, 6))),
        (aten.t_copy.default, (torch.randn(4, 6),)),
        (aten.channel_shuffle.default, (torch.randn(2, 4, 4, 4), 2)),
        (aten.take.default, (torch.randn(4, 4), torch.tensor([0, 5, 7, 2]))),
    ]
    for op, args in cases:
        details = torch_fallback_first_call_details(op, args, {})
        assert details.error is None, details
        assert details.world in ("fake-pg(world_size=2)", "existing-pg")
        assert details.seconds > 0
        got = {_torch_strategy_as_rule(t) for t in details.strategies}
        got = {g for g in got if not parse_rule(g).is_trivial()}

        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        shard_only = itertools.product(*[[R, *(S(d) for d in range(t.ndim))] for t in tensors])
        ours = torch_fallback_rules(op, args, {}, candidates=shard_only)
        assert got == set(ours.rule_strings()), op


def test_first_call_timing_and_no_leftover_process_group():
    was = dist.is_initialized()
    secs = torch_fallback_first_call(
        aten.addmv.default, (torch.randn(4), torch.randn(4, 6), torch.randn(6)), {}
    )
    assert 0 < secs < 5
    assert dist.is_initialized() == was  # the fake PG is torn down again
    details = torch_fallback_first_call_details(
        aten.addmv.default,
        (torch.randn(4), torch.randn(4, 6), torch.randn(6)),
        {},
        include_sharding_prop=True,
    )
    assert details.strategies == ["(S(0), S(0), R) -> S(0) [redistribute]"]
    details = torch_fallback_first_call_details(
        aten.block_diag.default, ([torch.randn(2, 3), torch.randn(1, 2)],), {}
    )
    assert details.strategies is None  # propagate_strategy returned None (aborted)


# ----------------------------------------------------------------------------- whole set


@pytest.fixture(scope="module")
def decomp_samples():
    samples = capture_aten_samples()
    return {op: samples[op] for op in decomp_only_ops(samples)}


def test_whole_decomp_only_set(decomp_samples):
    supported = unsupported = 0
    for op, op_samples in decomp_samples.items():
        s = next(x for x in op_samples if x.tensors())
        res = torch_fallback_rules(op, s.args, s.kwargs)
        assert res.seconds < 10
        if res.supported:
            supported += 1
            n_in = len(s.tensors())
            for r in res.rules:
                assert isinstance(r, SingleDimRule) and len(r.inputs) == n_in
                assert not r.is_trivial()
        else:
            unsupported += 1
            assert res.unsupported_reason and "\n" not in res.unsupported_reason
            assert res.rules == []
    # torch 2.13: about a third of the set is rejected outright by the fallback.
    assert supported > 30 and unsupported > 10


# ----------------------------------------------------------------------------- rank agreement


def test_torch_fallback_choice_depends_on_the_hash_seed_and_ours_does_not():
    """Every rank of a job must pick the same strategy, or ranks run mismatched
    collectives: gloo aborts ("Received data size doesn't match expected size"), NCCL
    hangs, or shapes line up and the numbers are silently wrong. Each rank is its own
    Python process with its own PYTHONHASHSEED. torch's fallback iterates a set of
    placements (DecompShardingStrategy._get_candidate_placements) and Partial hashes its
    reduce-op string, so among same-cost strategies which one wins depends on the seed.
    Seeds 1 and 8 were found to disagree on huber_loss with CPython 3.11's string hashing
    (SipHash-1-3, also 3.12 and 3.13)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("_hash_seed_choice.py")
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True, env={**os.environ, "PYTHONHASHSEED": seed}) for seed in ("1", "8")]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    picks = [dict(line.split(": ", 1) for line in out.splitlines() if line.startswith(("torch ", "decompshard ")))
             for out in outs]
    assert len(picks[0]) == 6 and picks[0].keys() == picks[1].keys(), outs
    ours = [k for k in picks[0] if k.startswith("decompshard ")]
    assert [picks[0][k] for k in ours] == [picks[1][k] for k in ours], outs
    huber = "torch aten.huber_loss.default"
    if sys.version_info >= (3, 11):  # 3.10 hashes strings with SipHash-2-4: other seeds differ there
        assert picks[0][huber] != picks[1][huber], outs  # torch's bug; if this fails, torch fixed it
