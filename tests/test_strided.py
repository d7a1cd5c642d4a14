"""Strided shards inside traced graphs: the view algebra against real tensors, the
placeholder fill, and the rules it makes derivable (attention heads, sequence-sharded
matmuls), each judged by the numerical checker."""

from __future__ import annotations

import math
import os
import signal
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from decompshard import derive_rules
from decompshard.solve.localcheck import isolated
from decompshard.placements import (
    ShardPlaceholder,
    StridedShard,
    format_placement,
    local_shape,
    parse_placement,
    parse_rule,
)
from decompshard.rules.strided import view_placement
from decompshard.verify.rule_check import check_rules

aten = torch.ops.aten
warnings.filterwarnings("ignore")
SDPA = aten._scaled_dot_product_flash_attention_for_cpu.default


def shard(x: torch.Tensor, p, W: int, r: int) -> torch.Tensor:
    """Rank r's local tensor under p, from the definition (StridedShard's docstring)."""
    if isinstance(p, ShardPlaceholder):
        parts = torch.chunk(x, W, dim=p.dim)
        return parts[r] if r < len(parts) else x.narrow(p.dim, 0, 0)
    n = x.shape[p.dim]
    a = n // (p.sf * p.inner)
    blocks = x.unflatten(p.dim, (p.sf, a, p.inner))
    parts = torch.chunk(blocks, W, dim=p.dim + 1)
    mine = parts[r] if r < len(parts) else blocks.narrow(p.dim + 1, 0, 0)
    return mine.flatten(p.dim, p.dim + 2)


def test_strided_shard_is_dtensors_strided_shard():
    """inner = 1 is torch's _StridedShard(dim, split_factor=sf), uneven shards included."""
    from torch.distributed.tensor.placement_types import _StridedShard

    x = torch.arange(4 * 5 * 3).reshape(4 * 5, 3)
    for W in (2, 3, 4):
        theirs, _ = _StridedShard(0, split_factor=4)._split_tensor(x, W, with_padding=False)
        for r in range(W):
            assert torch.equal(shard(x, StridedShard(0, 4), W, r), theirs[r])
            assert tuple(theirs[r].shape) == local_shape(x.shape, (StridedShard(0, 4),), (W,), (r,))


def test_strided_placements_print_and_parse():
    for p in (StridedShard(0, 4), StridedShard(2, 3, 5)):
        assert parse_placement(format_placement(p), strided=True) == p
    assert str(parse_rule("_S(0, 4), R -> _S(0, 4)", strided=True)) == "_S(0, 4), R -> _S(0, 4)"
    with pytest.raises(ValueError, match="split factors"):
        parse_placement("_S(0, 0)", strided=True)
    # an op's own placements are never strided: explain --placements says so
    with pytest.raises(ValueError, match="only inside a traced decomposition"):
        parse_placement("_S(0, 4)")


# Shapes as groupings of the same row of factors: any two groupings are views of each other.
atoms = st.lists(st.integers(1, 4), min_size=2, max_size=5)


def _grouping(draw, factors):
    cuts = sorted(draw(st.sets(st.integers(1, len(factors) - 1), max_size=len(factors) - 1)))
    bounds = [0, *cuts, len(factors)]
    return tuple(math.prod(factors[a:b]) for a, b in zip(bounds, bounds[1:]))


@st.composite
def view_chain(draw):
    factors = draw(atoms)
    shapes = [_grouping(draw, factors) for _ in range(3)]
    return shapes, draw(st.integers(0, len(shapes[0]) - 1))


@settings(max_examples=150, deadline=None)
@given(view_chain())
def test_view_algebra_matches_real_views(chain):
    """Whenever view_placement names a placement, every rank's view of its own shard is
    exactly its shard of the global view, at even and uneven world sizes; chained
    through a second view (strided in, strided or plain out)."""
    shapes, k = chain
    x = torch.arange(math.prod(shapes[0])).reshape(shapes[0])
    p = ShardPlaceholder(k)
    for shape in shapes[1:]:
        q = view_placement(x.shape, shape, p)
        if q is None:
            return
        y = x.reshape(shape)
        for W in (2, 3, 4):
            for r in range(W):
                want = shard(y, q, W, r)
                assert tuple(want.shape) == local_shape(y.shape, (q,), (W,), (r,))
                assert torch.equal(shard(x, p, W, r).reshape(want.shape), want)
        x, p = y, q


def test_view_algebra_names_the_attention_layouts():
    B, H, L, E = 4, 6, 8, 5
    assert view_placement((B, H, L, E), (B * H, L, E), ShardPlaceholder(1)) == StridedShard(0, B)
    assert view_placement((B * H, L, E), (B, H, L, E), StridedShard(0, B)) == ShardPlaceholder(1)
    assert view_placement((B, H, L, E), (B * H, L, E), ShardPlaceholder(0)) == StridedShard(0, 1, H)
    assert view_placement((B * H, L, E), (B, H, L, E), StridedShard(0, 1, H)) == ShardPlaceholder(0)
    # a sequence-sharded [B, S, D] flattened for mm, and back
    assert view_placement((B, L, E), (B * L, E), ShardPlaceholder(1)) == StridedShard(0, B)
    # splitting the sharded factor itself has no single-dim placement
    assert view_placement((12,), (3, 4), ShardPlaceholder(0)) is None


def _qkv_contiguous(B=4, H=6, L=8, E=4):
    return [torch.randn(B, H, L, E) for _ in range(3)]


def _qkv_transposed(B=4, H=6, L=8, E=4):
    """The usual layout: a projection [B, L, H*E] viewed per head and transposed."""
    return [torch.randn(B, L, H * E).view(B, L, H, E).transpose(1, 2) for _ in range(3)]


@pytest.mark.parametrize("make", [_qkv_contiguous, _qkv_transposed], ids=["contiguous", "view_transpose"])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_for_cpu_heads_and_batch_are_derived_and_hold(make, causal):
    q, k, v = make()
    derived = derive_rules(SDPA, q, k, v, is_causal=causal)
    rules = {str(r).replace(" [even]", ""): r for r in derived.rules}
    assert "S(1), S(1), S(1) -> S(1), S(1)" in rules  # heads: no collective inside attention
    assert "S(0), S(0), S(0) -> S(0), S(0)" in rules  # batch
    # the op is tagged random (its dropout); with dropout_p = 0 it is not, so the checker
    # judges it through a plain function of the three tensors
    def sdpa(q, k, v):
        return SDPA(q, k, v, 0.0, causal)

    report = check_rules(sdpa, (q, k, v), {}, derived.rules, find_missing=False)
    assert not report.incorrect, report.incorrect
    assert len(report.confirmed) == len(derived.rules)


def test_sdpa_batch_is_derived_for_uneven_batches():
    """Flattening [B, H] with B sharded keeps whole heads together (a strided shard with
    inner = H), so 5 batches over 2 or 3 ranks still work; before, the flatten's plain
    S(0) held for even batches only and the rule was lost."""
    q, k, v = (torch.randn(5, 5, 8, 4) for _ in range(3))
    derived = derive_rules(SDPA, q, k, v)
    assert any(str(r).startswith("S(0), S(0), S(0) -> S(0), S(0)") for r in derived.rules)
    assert any(str(r).startswith("S(1), S(1), S(1) -> S(1), S(1)") for r in derived.rules)


def test_sdpa_heads_are_even_only_where_a_rank_would_get_no_head():
    """4 heads over 3 ranks leaves one without a head, and CPU flash attention divides
    by the head count (SIGFPE): the local check runs that kernel isolated and keeps the
    rule for even splits only."""
    q, k, v = _qkv_contiguous(H=4)
    heads = [r for r in derive_rules(SDPA, q, k, v).rules if str(r).startswith("S(1), S(1), S(1)")]
    assert heads and heads[0].even_only
    assert "crashes on an empty shard" in heads[0].source


def test_matmul_on_a_sequence_sharded_3d_input():
    """[B, S, D] @ [D, O] reshapes to [B*S, D] for mm: S sharded stays sharded."""
    x, w = torch.randn(4, 6, 8), torch.randn(8, 6)  # every dim splits evenly at W = 2
    derived = derive_rules(aten.matmul.default, x, w)
    assert "S(1), R -> S(1)" in {str(r).replace(" [even]", "") for r in derived.rules}
    report = check_rules(aten.matmul.default, (x, w), {}, derived.rules, find_missing=False)
    assert not report.incorrect and len(report.confirmed) == len(derived.rules)


def test_isolated_survives_a_crashing_kernel():
    assert isolated(lambda: os.kill(os.getpid(), signal.SIGFPE)) == ("crash", "SIGFPE")
    assert isolated(lambda: (1, 2)) == ("ok", (1, 2))
    status, why = isolated(lambda: torch.ones(2) @ torch.ones(3))
    assert status == "error" and "size" in why
