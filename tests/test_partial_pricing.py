"""DTensor's strategy choice with a Partial priced at the reduction it will cost
(decompshard/runtime/steering/kept_partial.py).

Two Megatron blocks (column-parallel then row-parallel matmul, residual add, RMS norm)
on a 2x2 mesh, batch Shard(0) on the data-parallel dim, float64, simulated ranks: the
loss and every gradient on every rank against one device, and the collectives counted.
With `enable()` the forward all-reduces each row-parallel output once, where it is made,
and nothing else (Megatron's plan); torch alone (the same case with `disable()`) keeps
the residual Partial, reduce-scatters it onto the batch dim and gathers weights, and
moves more. `disable()` puts torch's pricing functions back. `CommBytes.top()` names
the op that issued each collective.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import decompshard
from decompshard._compat import strategy_cost_slots, strategy_selection_slot
from decompshard.dispatch_modes.comm_bytes import CommBytes
from decompshard.verify.dtensor_case import device_mesh, simulation

pytestmark = pytest.mark.usefixtures("world")
R = Replicate()


def _t(*shape, seed):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _blocks(x, w1, w2, g):
    h = x
    for _ in range(2):
        h = h + torch.nn.functional.silu(h @ w1.T) @ w2.T  # column- then row-parallel
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * g
    return h


@contextlib.contextmanager
def _simulated(mesh_shape, on: bool = True):
    """The mesh of `mesh_shape`, its ranks simulated, decompshard on (or off) and
    DTensor's warnings quiet inside; decompshard disabled after."""
    mesh = device_mesh(mesh_shape)
    (decompshard.enable if on else decompshard.disable)()
    try:
        with simulation(mesh.size()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield mesh
    finally:
        decompshard.disable()


def _run(on: bool):
    """(loss ok, grads ok, forward CommBytes, backward CommBytes, output placements)."""
    args = [_t(4, 6, 16, seed=1), _t(32, 16, seed=2), _t(16, 32, seed=3), _t(16, seed=4)]
    ref = [a.clone().requires_grad_(True) for a in args]
    cot = _t(4, 6, 16, seed=5)
    (_blocks(*ref) * cot).sum().backward()
    want = _blocks(*args)
    placements = [[Shard(0), R], [R, Shard(0)], [R, Shard(1)], [R, R]]  # x; w1 colwise; w2 rowwise; g
    with _simulated((2, 2), on) as mesh:
        d = [distribute_tensor(a, mesh, pl).requires_grad_(True) for a, pl in zip(args, placements)]
        dcot = distribute_tensor(cot, mesh, [Shard(0), R])
        with CommBytes() as fwd:
            out = _blocks(*d)
        with CommBytes() as bwd:
            (out * dcot).sum().backward()
        out_ok = all(torch.allclose(v, want, rtol=1e-10, atol=1e-12)
                     for v in out.full_tensor()._local_tensors.values())
        grads_ok = all(torch.allclose(v, r.grad, rtol=1e-10, atol=1e-12)
                       for a, r in zip(d, ref) for v in a.grad.full_tensor()._local_tensors.values())
        return out_ok, grads_ok, fwd, bwd, tuple(out.placements)


def test_two_d_blocks_reduce_each_row_parallel_output_once_where_it_is_made():
    out_ok, grads_ok, fwd, bwd, placements = _run(True)
    assert out_ok and grads_ok
    assert placements == (Shard(0), R)
    # Megatron's forward: one all-reduce of the row-parallel output per block, over tp,
    # at the local batch's size (2 x 6 x 16 float64)
    assert fwd.bytes_by_kind == {"all_reduce": 2 * 2 * 6 * 16 * 8}, fwd.bytes_by_kind
    # ... issued where the Partial is made: the residual add, its Partial input reduced
    assert [(t["op"], t["collective"], t["count"]) for t in fwd.top()] == [
        ("aten.add.Tensor([4, 6, 16]S(0)R [4, 6, 16]S(0)P(sum))", "all_reduce", 2)]
    assert set(bwd.bytes_by_kind) <= {"all_reduce"}, bwd.bytes_by_kind  # nothing gathered or scattered
    _, _, t_fwd, t_bwd, _ = _run(False)
    assert t_fwd.bytes + t_bwd.bytes > fwd.bytes + bwd.bytes  # what torch alone picks moves more


def _pricing_slots():
    return [(m, n) for m, n, _ in strategy_cost_slots()] + [strategy_selection_slot()]


def test_disable_puts_torchs_pricing_back():
    assert strategy_selection_slot() is not None  # every supported torch chooses there
    before = [vars(module)[name] for module, name in _pricing_slots()]
    assert len(before) > 1  # and prices strategies in at least one more slot
    decompshard.enable()
    try:
        during = [vars(module)[name] for module, name in _pricing_slots()]
        assert all(a is not b and b.__wrapped__ is a for a, b in zip(before, during))
    finally:
        decompshard.disable()
    assert all(a is b for a, b in zip(before, [vars(m)[n] for m, n in _pricing_slots()]))


def _pre_norm_blocks(x, w1, w2):
    h = x
    for _ in range(2):  # GPT-2's order: norm first, the residual stream left as it is
        n = torch.nn.functional.layer_norm(h, h.shape[-1:])
        h = h + torch.nn.functional.gelu(n @ w1.T) @ w2.T
    return torch.nn.functional.layer_norm(h, h.shape[-1:])


def test_one_d_forward_reduces_the_residual_where_it_is_made_and_backward_reads_it_whole():
    """Tensor parallel on a 1-D mesh: torch alone keeps the residual stream Partial, each
    norm all-reduces it, and each norm's backward all-reduces its saved Partial input once
    more. Surcharged in forward, the residual add reduces it once (Megatron's bytes)."""
    args = [_t(3, 5, 16, seed=1), _t(32, 16, seed=2), _t(16, 32, seed=3)]
    ref = [a.clone().requires_grad_(True) for a in args]
    cot = _t(3, 5, 16, seed=5)
    (_pre_norm_blocks(*ref) * cot).sum().backward()
    moved = {}
    for on in (True, False):
        with _simulated((2,), on) as mesh:
            d = [distribute_tensor(a, mesh, [pl]).requires_grad_(True)
                 for a, pl in zip(args, (R, Shard(0), Shard(1)))]
            dcot = distribute_tensor(cot, mesh, [R])
            with CommBytes() as comm:
                (_pre_norm_blocks(*d) * dcot).sum().backward()
            for a, r in zip(d, ref):
                assert all(torch.allclose(v, r.grad, rtol=1e-10, atol=1e-12)
                           for v in a.grad.full_tensor()._local_tensors.values())
            moved[on] = comm.bytes_by_kind
    activation = 3 * 5 * 16 * 8
    # Megatron: per block one all-reduce of the row-parallel output (forward) and one of
    # the column-parallel input's gradient (backward)
    assert moved[True] == {"all_reduce": 4 * activation}, moved
    assert sum(moved[False].values()) > 4 * activation, moved  # torch alone re-reduces


def _shared_input_block(x, w1, w2, wk, wv):
    h = x + torch.relu(x @ w1.T) @ w2.T  # column- then row-parallel
    return (h @ wk.T) * (h @ wv.T)  # two column-parallel layers read h: its gradient is two Partials


def test_one_d_backward_reduces_a_partial_gradient_before_a_row_parallel_layer():
    """T5's encoder output feeds the cross-attention's k and v: its gradient arrives as
    the sum of two Partials and stays Partial into the row-parallel layer's backward.
    Keeping it Partial there gathers the layer's weight and its saved input and hands on
    a Partial twice the model dim wide, reduce-scattered at the activation's backward;
    priced at the Partial it hands on, the backward all-reduces the gradient instead."""
    args = [_t(3, 5, 16, seed=1), _t(32, 16, seed=2), _t(16, 32, seed=3), _t(16, 16, seed=6), _t(16, 16, seed=7)]
    ref = [a.clone().requires_grad_(True) for a in args]
    cot = _t(3, 5, 16, seed=5)
    (_shared_input_block(*ref) * cot).sum().backward()
    with _simulated((2,)) as mesh:
        d = [distribute_tensor(a, mesh, [pl]).requires_grad_(True)
             for a, pl in zip(args, (R, Shard(0), Shard(1), Shard(0), Shard(0)))]
        dcot = distribute_tensor(cot, mesh, [Shard(2)])
        with CommBytes() as fwd:
            out = _shared_input_block(*d)
        with CommBytes() as bwd:
            (out * dcot).sum().backward()
        for a, r in zip(d, ref):
            assert all(torch.allclose(v, r.grad, rtol=1e-10, atol=1e-12)
                       for v in a.grad.full_tensor()._local_tensors.values())
    activation = 3 * 5 * 16 * 8
    assert fwd.bytes_by_kind == {"all_reduce": activation}, fwd.bytes_by_kind
    # Megatron's backward: two all-reduces (h's gradient once for k and v, x's for w1's
    # input). Here h's gradient is all-reduced once, by the row-parallel layer's node
    # (its weight and input gradients both read it: reduce_once.py reuses the first
    # reduction; DTensor alone reduces it twice) and x's is left Partial; torch's choice
    # before (f8d5ac7) moved 7808 bytes: the weight and the saved input gathered, a
    # [3, 5, 32] Partial reduce-scattered at relu's backward
    assert bwd.bytes_by_kind == {"all_reduce": activation}, bwd.top()
    assert [t["op"].split("(")[0] for t in bwd.top()] == ["aten.mm.default"]


def _packed_projection(on: bool):
    """(output right on every rank, bytes moved, output placements): a token shard times
    one expert's packed gate/up weight (Mixtral on a 2x2 mesh: the tokens' hidden dim
    sharded on the tp dim, the weight `_StridedShard` blocks as the zoo shards it)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from decompshard.verify.dtensor_case import make_dtensor

    x, w3 = _t(30, 32, seed=1), _t(4, 128, 32, seed=2)
    with _simulated((2, 2), on) as mesh:
        dx = distribute_tensor(x, mesh, [R, Shard(1)])
        dw = make_dtensor(w3, mesh, [R, _StridedShard(1, split_factor=2)], 0, 0)
        with CommBytes() as moved:
            y = torch.nn.functional.linear(dx, dw[1])
        right = all(torch.allclose(v, x @ w3[1].T, rtol=1e-12, atol=1e-12)
                    for v in y.full_tensor()._local_tensors.values())
        return right, moved.bytes_by_kind, tuple(y.placements)


def test_a_packed_weight_is_not_gathered_where_its_input_is_smaller():
    """Torch prices moving the weight's `_StridedShard` blocks to `Shard(0)` at nothing and
    gathers the weight (16 KiB); a `_StridedShard` move costs at least an all-gather, so
    the tokens' hidden shard is gathered instead (3.75 KiB) and the output stays in blocks."""
    from torch.distributed.tensor.placement_types import _StridedShard

    right, moved, placements = _packed_projection(True)
    assert right
    assert moved == {"all_gather_into_tensor": 30 * 16 * 8}, moved
    assert placements == (R, _StridedShard(1, split_factor=2))
    right, moved, _ = _packed_projection(False)
    assert right
    assert moved == {"all_gather_into_tensor": 32 * 64 * 8}, moved  # torch alone: the weight


def _routed_rows(price_chunks: bool, monkeypatch):
    """(loss and gradients right on every rank, bytes moved forward and backward, the
    routed rows' placements): tokens batch-sharded on a 2x2 mesh's first dim, rows picked
    at global indices (an MoE's routing), then a column-parallel matmul."""
    import decompshard.runtime.steering.kept_partial as pricing

    if not price_chunks:
        monkeypatch.setattr(pricing, "chunked_gather_price", lambda current, spec: 0.0)
    x, w, idx = _t(16, 8, seed=1), _t(8, 12, seed=2), torch.tensor([0, 15, 3, 3, 5, 8, 1, 9, 12])
    ref = [x.clone().requires_grad_(True), w.clone().requires_grad_(True)]
    torch.relu(ref[0][idx].mm(ref[1])).sum().backward()
    with _simulated((2, 2)) as mesh:
        dx = distribute_tensor(x, mesh, [Shard(0), R]).requires_grad_(True)
        dw = distribute_tensor(w, mesh, [R, Shard(1)]).requires_grad_(True)
        didx = distribute_tensor(idx, mesh, [R, R])
        with CommBytes() as moved:
            rows = dx[didx]
            torch.relu(rows.mm(dw)).sum().backward()
        right = all(torch.allclose(v, r.grad, rtol=1e-12, atol=1e-12)
                    for d, r in zip((dx, dw), ref) for v in d.grad.full_tensor()._local_tensors.values())
        return right, moved.bytes_by_kind.get("all_gather_into_tensor", 0), tuple(rows.placements)


def test_a_gather_is_not_shrunk_by_chunking_what_the_next_op_needs_whole(monkeypatch):
    """Gathering the tokens over the batch dim, DTensor's cheapest strategy for the
    indexing also chunks the hidden dim on the other mesh dim (half the bytes now); the
    matmul after it needs the rows whole there and gathers them again, forward and
    backward. Priced at that re-gather, the indexing gathers the tokens once."""
    right, gathered, placements = _routed_rows(True, monkeypatch)
    assert right and placements == (R, R)
    assert gathered == 16 * 8 * 8 // 2, gathered  # one all-gather of each rank's 8 tokens
    right, gathered_unpriced, placements = _routed_rows(False, monkeypatch)
    assert right and placements == (R, Shard(1))
    assert gathered_unpriced > gathered, gathered_unpriced


def _vocab_head_block(x, w1, w2, wh):
    h = torch.relu(x @ w1.T) @ w2.T  # column- then row-parallel
    if isinstance(h, DTensor):
        h = h.redistribute(h.device_mesh, [R])  # reduced in forward; its gradient stays as it comes
    return h @ wh.T  # a vocab-parallel head: h's gradient comes back Partial


def _vocab_head_backward(steer_node: bool, monkeypatch):
    """(gradients right on every rank, backward bytes by collective, backward top) of
    the block above on a mesh of 2, the head's weight sharded on the vocabulary, the
    logits' gradient Shard(1)."""
    import decompshard.runtime.steering.kept_partial as pricing

    if not steer_node:
        monkeypatch.setattr(pricing, "shared_move", lambda op_schema: None)
    args = [_t(64, 16, seed=1), _t(32, 16, seed=2), _t(16, 32, seed=3), _t(24, 16, seed=4)]
    ref = [a.clone().requires_grad_(True) for a in args]
    cot = _t(64, 24, seed=5)
    (_vocab_head_block(*ref) * cot).sum().backward()
    with _simulated((2,)) as mesh:
        d = [distribute_tensor(a, mesh, [pl]).requires_grad_(True)
             for a, pl in zip(args, (R, Shard(0), Shard(1), Shard(0)))]
        loss = (_vocab_head_block(*d) * distribute_tensor(cot, mesh, [Shard(1)])).sum()
        with CommBytes() as bwd:
            loss.backward()
        right = all(torch.allclose(v, r.grad, rtol=1e-10, atol=1e-12)
                    for a, r in zip(d, ref) for v in a.grad.full_tensor()._local_tensors.values())
        return right, bwd.bytes_by_kind, bwd.top()


def test_a_row_parallel_weight_gradient_reduces_the_gradient_its_node_reduces_anyway(monkeypatch):
    """Llama behind a vocab-parallel lm_head (the zoo's `llama-vocab` tp): the row-parallel
    layer's gradient arrives Partial. Its node computes the weight gradient first
    (`grad.t() @ a`, a [64, 32] Shard(1)): alone, gathering `a` (4 KiB) and leaving a
    [16, 32] Partial is cheaper than all-reducing the [64, 16] gradient (8 KiB). But the
    input gradient next (`grad @ w2`, w2 Shard(1)) all-reduces that gradient anyway, so
    the gather buys nothing: asked ahead (`node_reads.shared_move`), the weight gradient
    reduces it and the input gradient reuses the reduction (`reduce_once`). One
    all-reduce of the gradient, as Megatron, and no all-gather."""
    grad = 64 * 16 * 8
    right, moved, top = _vocab_head_backward(True, monkeypatch)
    assert right
    assert moved == {"all_reduce": grad}, top
    assert [t["op"] for t in top] == ["aten.mm.default([16, 64]P(sum) [64, 32]S(1))"], top
    right, moved, _ = _vocab_head_backward(False, monkeypatch)
    assert right
    assert moved.get("all_gather_into_tensor") == 64 * 16 * 8 and moved.get("all_reduce") == grad, moved
