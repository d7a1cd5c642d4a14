"""The local-shape check skips re-tracing only where the decomposition provably read no
size that differs locally (dispatch_modes/substitute.py); everything it skips must give
the verdict a real re-trace gives."""

import pytest
import torch

import decompshard
from decompshard.solve import localcheck
from decompshard.solve.derive import derive_rules
from decompshard.dispatch_modes.clean import clean_dispatch_state
from decompshard.solve.substitute import substitute
from decompshard.dispatch_modes.tracing import READ_LAYOUT, READ_SIZE, trace
from decompshard.rules import has_rule

aten = torch.ops.aten


def _trace(op, *args, decomp=None):
    with clean_dispatch_state():
        return trace(op, args, {}, has_rule, decomp=decomp)


def test_size_reads_of_decomposition_code_are_recorded():
    g = _trace(aten.channel_shuffle.default, torch.randn(2, 6, 4, 4), 3)
    assert g.reads.get(g.inputs[0], 0) & READ_SIZE  # c // g reads the channel count
    g = _trace(aten.hardswish.default, torch.randn(4, 4))
    assert g.reads == {}  # x * clamp(x + 3, 0, 6) / 6 looks at no size


def test_reads_from_python_and_cpp_composites_are_both_seen():
    x = torch.randn(6, 4)
    mean_by_numel = _trace(aten.sum.default, x, decomp=lambda t: t.sum() / t.numel())
    assert mean_by_numel.reads == {mean_by_numel.inputs[0]: READ_SIZE}
    # torch.chunk is a C++ composite: it reads the size in C++, then calls split
    chunked = _trace(aten.sum.default, x, decomp=lambda t: torch.chunk(t, 3)[0].sum())
    assert chunked.reads.get(chunked.inputs[0], 0) & READ_SIZE
    strided = _trace(aten.sum.default, x, decomp=lambda t: t.sum() if t.is_contiguous() else -t.sum())
    assert strided.reads == {strided.inputs[0]: READ_LAYOUT}


def test_a_read_size_that_differs_locally_forces_a_retrace():
    x = torch.randn(6, 4)
    g = _trace(aten.sum.default, x, decomp=lambda t: t.sum() / t.numel())
    assert substitute(g, (x,), {}, [(3, 4)]) is None  # numel differs on a shard
    assert substitute(g, (x,), {}, [(6, 4)]) is not None  # nothing differs


def test_substituted_shapes_match_a_real_trace():
    x = torch.randn(6, 5)
    g = _trace(aten.hardswish.default, x)
    for shape in [(3, 5), (2, 5), (6, 2)]:
        sub = substitute(g, (x,), {}, [shape])
        real = _trace(aten.hardswish.default, torch.randn(shape))
        assert [sub.meta(v).shape for n in g.nodes for v in n.outputs] == [
            real.meta(v).shape for n in real.nodes for v in n.outputs
        ]


def test_no_substitution_on_empty_shards_or_unknown_primitives():
    x = torch.randn(2, 6, 4, 4)
    g = _trace(aten.hardswish.default, x)
    assert substitute(g, (x,), {}, [(0, 6, 4, 4)]) is None
    # a view whose fixed size no longer fits the shard fails in the kernel: re-trace
    g = _trace(aten.sum.default, x, decomp=lambda t: t.view(2, 96).sum())
    assert g.reads == {} and substitute(g, (x,), {}, [(1, 6, 4, 4)]) is None


def test_views_splits_and_unbinds_follow_the_local_shape():
    x = torch.randn(4, 6, 5)
    flat = _trace(aten.sum.default, x, decomp=lambda t: t.view(-1, 5).sum())
    sub = substitute(flat, (x,), {}, [(2, 6, 5)])
    assert sub.meta(flat.nodes[0].outputs[0]).shape == (12, 5)
    pieces = _trace(aten.sum.default, x, decomp=lambda t: sum(p.sum() for p in torch.split(t, 2, 1)))
    assert substitute(pieces, (x,), {}, [(2, 6, 5)]) is not None  # still 3 pieces of dim 1
    assert substitute(pieces, (x,), {}, [(4, 3, 5)]) is None  # 2 pieces: another graph
    rows = _trace(aten.sum.default, x, decomp=lambda t: sum(r.sum() for r in t.unbind(2)))
    assert substitute(rows, (x,), {}, [(2, 6, 5)]) is not None
    assert substitute(rows, (x,), {}, [(4, 6, 2)]) is None


CASES = [
    (aten.hardswish.default, (torch.randn(5, 6),)),
    (aten.floor_divide.default, (torch.randn(6, 5), torch.randn(5))),
    (aten.binary_cross_entropy.default, (torch.rand(6, 5), torch.rand(6, 5))),
    (aten.mse_loss.default, (torch.randn(6, 4), torch.randn(6, 4))),
    (aten.channel_shuffle.default, (torch.randn(2, 8, 3, 3), 2)),
    (aten.pixel_shuffle.default, (torch.randn(1, 8, 3, 3), 2)),
    (aten.squeeze_copy.dim, (torch.randn(5, 1, 4), 1)),
    (aten.permute_copy.default, (torch.randn(3, 5, 4), [2, 0, 1])),
    (aten.norm.ScalarOpt_dim, (torch.randn(5, 6), 2, [1])),
    (aten.aminmax.default, (torch.randn(5, 7),)),
    (aten.take.default, (torch.randn(6, 5), torch.tensor([[0, 7], [29, 3]]))),
    (aten.unsafe_split.Tensor, (torch.randn(6, 5), 2)),
    (aten.unsafe_split.Tensor, (torch.randn(7, 5), 2, 1)),
    (aten.unbind_copy.int, (torch.randn(4, 5, 3), 1)),
    (aten.pixel_unshuffle.default, (torch.randn(1, 2, 4, 6), 2)),
]


@pytest.mark.parametrize("op,args", CASES, ids=[str(c[0]) for c in CASES])
def test_rules_and_refusals_equal_those_of_real_retraces(op, args, monkeypatch):
    decompshard.clear_caches()
    with_sub = derive_rules(op, *args)
    got = (sorted(map(str, with_sub.rules)), sorted(map(str, with_sub.rejected)))
    monkeypatch.setattr(localcheck, "substitute", lambda *a, **k: None)
    decompshard.clear_caches()
    retraced = derive_rules(op, *args)
    want = (sorted(map(str, retraced.rules)), sorted(map(str, retraced.rejected)))
    decompshard.clear_caches()
    assert got == want and want[0]


def test_substitution_saves_traces():
    from decompshard.solve.derive import _TRACES

    decompshard.clear_caches()
    derive_rules(aten.hardswish.default, torch.randn(10, 10)).rules
    assert len(_TRACES) == 1  # the global trace only (7 before substitution)
    decompshard.clear_caches()
    derive_rules(aten.unsafe_split.Tensor, torch.randn(6, 5), 2).rules
    assert len(_TRACES) == 1  # split's pieces follow the shard (4 traces before)


def test_a_read_with_the_tracing_mode_switched_off_still_counts():
    from torch.utils._python_dispatch import _disable_current_modes

    def sneaky(t):
        with _disable_current_modes():
            n = t.shape[0]
        return t.sum() / n

    g = _trace(aten.sum.default, torch.randn(6, 4), decomp=sneaky)
    assert g.reads.get(g.inputs[0], 0) & READ_SIZE


def test_broadcast_matches_torch():
    """substitute's plain-int broadcast against torch.broadcast_shapes, errors included."""
    import random

    from decompshard.solve.substitute import _broadcast

    rng = random.Random(0)
    for _ in range(3000):
        shapes = [tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 4))) for _ in range(rng.randint(1, 3))]
        try:
            want = tuple(torch.broadcast_shapes(*shapes))
        except RuntimeError:
            want = "error"
        try:
            got = _broadcast(shapes)
        except ValueError:
            got = "error"
        assert got == want, shapes


def test_an_empty_shard_is_substituted_and_the_real_kernel_still_decides(monkeypatch):
    """Empty shards (2 rows over 3 ranks) need no re-trace when the decomposition read
    no size, but the op's real kernel is still run on them, and it can refuse."""
    from decompshard.solve.derive import _TRACES

    x = torch.randn(2, 5)
    g = _trace(aten.hardswish.default, x)
    sub = substitute(g, (x,), {}, [(0, 5)], empty_ok=True)
    assert sub is not None and sub.meta(g.outputs[0]).shape == (0, 5)

    decompshard.clear_caches()
    rules = derive_rules(aten.permute_copy.default, x, [1, 0]).as_strings()
    assert "S(0) -> S(1)" in rules and len(_TRACES) == 1  # 2 before: the empty shard was re-traced
    asked = []

    def refusing(g, cand, args, kwargs, shapes, W, r):
        asked.append(shapes)
        return "refused by the real kernel"

    monkeypatch.setattr(localcheck, "_real_kernel_on_empty_shard", refusing)
    decompshard.clear_caches()
    rules = derive_rules(aten.permute_copy.default, x, [1, 0]).as_strings()
    assert ((0, 5),) in asked and "S(0) -> S(1)" not in rules
    decompshard.clear_caches()
