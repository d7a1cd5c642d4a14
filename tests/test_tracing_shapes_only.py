"""The local-shape check re-traces with `trace(shapes_only=True)`: a cheaper recording that
must give exactly what the check compares (ops, non-tensor arguments, value ids and shapes,
outputs) and never stand in for a full graph, whose reads and signs the solver needs."""

import pytest
import torch

from decompshard.solve import derive
from decompshard.dispatch_modes.clean import clean_dispatch_state
from decompshard.dispatch_modes.tracing import READ_SIZE, trace
from decompshard.errors import UnsupportedOp
from decompshard.solve.localcheck import local_args
from decompshard.rules import has_rule

aten = torch.ops.aten


def _both(op, args, kwargs=None, decomp=None):
    with clean_dispatch_state():
        full = trace(op, args, kwargs or {}, has_rule, decomp=decomp)
        lite = trace(op, args, kwargs or {}, has_rule, decomp=decomp, shapes_only=True)
    return full, lite


def _compared(g):
    return (
        g.inputs, g.outputs, [tuple(v.meta.shape) for v in g.values],
        [(n.op, n.inputs, n.outputs, repr(n.non_tensor_leaves()), n.input_metas()) for n in g.nodes],
    )


CASES = [
    (aten.channel_shuffle.default, (torch.randn(2, 6, 4, 4), 3), {}),
    (aten.pixel_shuffle.default, (torch.randn(1, 8, 3, 3), 2), {}),
    (aten.mse_loss.default, (torch.randn(4, 5), torch.randn(4, 5)), {}),
    (aten.addr.default, (torch.randn(3, 4), torch.randn(3), torch.randn(4)), {"alpha": 2}),
    (aten.mv.default, (torch.randn(3, 4), torch.randn(4)), {}),
    (aten.polar.default, (torch.rand(5), torch.randn(5)), {}),
    (aten.unsafe_split.Tensor, (torch.randn(7, 2), 3), {}),
]


@pytest.mark.parametrize("op,args,kwargs", CASES, ids=lambda x: str(x)[:30])
def test_shapes_only_records_what_the_full_trace_records(op, args, kwargs):
    full, lite = _both(op, args, kwargs)
    assert lite.nodes and _compared(lite) == _compared(full)
    assert lite.shapes_only and not full.shapes_only
    assert lite.reads == {}  # nothing is watched: a shapes-only graph says nothing on reads


def test_shapes_only_at_a_transposed_local_layout_takes_the_full_trace_path():
    # local_args lays a shard out like the global tensor (a transposed view): matmul
    # decides between view and clone + _unsafe_view on that layout
    x = torch.randn(6, 4).t()
    args, kwargs = local_args((x, torch.randn(6)), {}, [(4, 3), (3,)])
    full, lite = _both(aten.mv.default, args, kwargs)
    assert _compared(lite) == _compared(full)


def test_size_reads_are_still_seen_by_the_full_trace():
    full, lite = _both(aten.channel_shuffle.default, (torch.randn(2, 6, 4, 4), 3))
    assert full.reads.get(full.inputs[0], 0) & READ_SIZE
    assert lite.reads == {}


@pytest.mark.parametrize("shapes_only", [False, True])
def test_writes_through_views_are_refused_in_both_recordings(shapes_only):
    x = torch.randn(3, 4)
    with clean_dispatch_state():
        with pytest.raises(UnsupportedOp, match="writes through a view"):
            trace(aten.mul.Tensor, (x, 2.0), {}, has_rule, decomp=lambda t, c: t.t().mul_(c),
                  shapes_only=shapes_only)
        g = trace(aten.mul.Tensor, (x, 2.0), {}, has_rule, decomp=lambda t, c: t.clone().mul_(c),
                  shapes_only=shapes_only)
    assert [n.op for n in g.nodes] == [aten.clone.default, aten.mul_.Tensor]


def test_a_shapes_only_trace_never_serves_as_the_global_graph():
    derive.clear_caches()
    args = (torch.randn(2, 6, 4, 4), 3)
    op = aten.channel_shuffle.default
    with clean_dispatch_state():
        lite = derive.traced_for_check(op, args, {})
        full = derive.traced(op, args, {})
        assert lite.shapes_only and not full.shapes_only
        assert full.reads.get(full.inputs[0], 0) & READ_SIZE
        # a cached full graph serves the check as it is
        assert derive.traced_for_check(op, args, {}) is full
    derive.clear_caches()


@pytest.mark.parametrize("shapes_only", [False, True])
def test_a_write_into_a_tensor_that_has_a_view_is_refused(shapes_only):
    """The graph is SSA: after `y.mul_(2)` the view `v = y.t()` would still name the value
    from before the write, and a rule derived from that graph would be wrong. Under a
    dispatch mode a kernel's result is not marked as a view, so aliasing is read from the
    op's schema (t, split...), and a write into the base or into the view is refused."""

    def write_base(t):
        y = t.clone()
        v = y.t()
        y.mul_(2.0)
        return v + 1

    def write_view(t):
        y = t.clone()
        v = y.t()
        v.mul_(2.0)
        return y + 1

    def write_base_of_split(t):
        y = t.clone()
        a, _ = y.split(2)
        y.mul_(2.0)
        return a + 1

    for decomp in (write_base, write_view, write_base_of_split):
        with clean_dispatch_state(), pytest.raises(UnsupportedOp, match="writes through a view"):
            trace(aten.sum.default, (torch.randn(4, 4),), {}, has_rule, decomp=decomp, shapes_only=shapes_only)
    # a write into a fresh tensor that nothing views stays traceable
    with clean_dispatch_state():
        trace(aten.sum.default, (torch.randn(4, 4),), {}, has_rule, shapes_only=shapes_only,
              decomp=lambda t: t.clone().mul_(2.0).sum())
