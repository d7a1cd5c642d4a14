"""Fused-kernel custom ops (tests/_custom_ops_lib.py) run sharded under enable().

RMSNorm, rotary embedding and SwiGLU custom ops (plain torch inside, register_autograd
backwards, one of which calls another custom op), and an opaque numpy rotary with
registered references for its forward and its backward custom op. Each runs forward and
backward on simulated ranks (LocalTensorMode) on meshes of 2, 3 (uneven shards) and 2x2,
float64, and every rank's full_tensor() of the outputs and of every gradient is compared
with one device. The collectives are counted with CommDebugMode: where the math needs
none (batch, sequence or head sharding of rotary with replicated cos/sin, batch sharding
of the norm and the MLP, column-parallel SwiGLU forward) there must be none.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import decompshard
from decompshard.verify.dtensor_case import device_mesh, rank_locals

import _custom_ops_lib as lib

R = Replicate()
EPS = 1e-6
MESHES = {"w2": (2,), "w3": (3,), "2x2": (2, 2)}


pytestmark = pytest.mark.usefixtures("world")  # 4 simulated ranks, from conftest.py


@pytest.fixture(autouse=True)
def _disabled_after():
    yield
    decompshard.disable()


def _randn(*shape, seed):
    return torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


def _pl(p, mesh_shape):
    """One placement for every mesh dim, or the tuple given (2-D meshes)."""
    return tuple(p) if isinstance(p, tuple) else (p,) * len(mesh_shape)


def _assert_every_rank(dt, expected, mesh, what):
    assert isinstance(dt, DTensor), f"{what}: {type(dt).__name__}"
    per_rank = rank_locals(dt.full_tensor(), mesh)
    assert len(per_rank) == mesh.size()
    for r, t in per_rank.items():
        torch.testing.assert_close(t, expected, msg=lambda m, r=r: f"{what}, rank {r}: {m}")


def run_sharded(fn, tensors, placements, extra, mesh_shape, grads_placements, strict=True):
    """fn(*tensors, *extra) with the tensors sharded as `placements`, forward then
    backward with random output grads placed as `grads_placements`; checks forward
    outputs and input grads against one device and returns (forward comm counts,
    backward comm counts, output placements). `strict`: any warning (decompshard's
    "running replicated" or "redistributing") fails."""
    needs_grad = [t.dtype.is_floating_point for t in tensors]
    ref_in = [t.clone().requires_grad_(g) for t, g in zip(tensors, needs_grad)]
    ref_out = fn(*ref_in, *extra)
    ref_out = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    out_grads = [_randn(*o.shape, seed=100 + i) for i, o in enumerate(ref_out)]
    torch.autograd.backward(ref_out, out_grads)
    mesh = device_mesh(mesh_shape)
    decompshard.enable()
    with LocalTensorMode(frozenset(range(mesh.size()))), warnings.catch_warnings():
        warnings.simplefilter("error" if strict else "ignore")
        d_in = [distribute_tensor(t, mesh, _pl(p, mesh_shape)).requires_grad_(g)
                for t, p, g in zip(tensors, placements, needs_grad)]
        with CommDebugMode() as fwd:
            out = fn(*d_in, *extra)
        out = out if isinstance(out, tuple) else (out,)
        d_grads = [distribute_tensor(g, mesh, _pl(p, mesh_shape)) for g, p in zip(out_grads, grads_placements)]
        with CommDebugMode() as bwd:
            torch.autograd.backward(out, d_grads)
        for i, (o, e) in enumerate(zip(out, ref_out)):
            _assert_every_rank(o, e.detach(), mesh, f"output {i}")
        for i, (d, r) in enumerate(zip(d_in, ref_in)):
            if r.grad is None:  # a backward that returns None for it (cos/sin)
                assert d.grad is None, f"input {i}"
            else:
                _assert_every_rank(d.grad, r.grad, mesh, f"grad of input {i}")
        placements_out = [tuple(o.placements) for o in out]
    return fwd.get_comm_counts(), bwd.get_comm_counts(), placements_out


def _total(counts):
    return sum(counts.values())


def _gathers(counts):
    return {str(k): v for k, v in counts.items() if "gather" in str(k) and v}


# ------------------------------------------------------------------ rotary

# (layout, q/k shape, unsqueeze_dim, which q/k dim is batch / seq / heads)
LAYOUTS = {"bshd": ((4, 5, 6, 8), 2, {"batch": 0, "seq": 1, "heads": 2}),
           "bhsd": ((4, 6, 5, 8), 1, {"batch": 0, "heads": 1, "seq": 2})}


def _rotary_inputs(layout, seed=0):
    shape, unsq, _ = LAYOUTS[layout]
    b, s, d = shape[0], shape[1 if layout == "bshd" else 2], shape[3]
    q, k = _randn(*shape, seed=seed), _randn(*shape, seed=seed + 1)
    cos, sin = _randn(b, s, d, seed=seed + 2), _randn(b, s, d, seed=seed + 3)
    return (q, k, cos, sin), unsq


@pytest.mark.parametrize("op", ["rotary", "np_rotary"])
@pytest.mark.parametrize("layout, dim, mesh", [
    ("bshd", "batch", "w3"), ("bshd", "seq", "w2"), ("bshd", "heads", "w3"),
    ("bhsd", "heads", "w2"), ("bhsd", "seq", "w3"), ("bshd", "batch+heads", "2x2"),
])
def test_rotary_sharded_with_replicated_tables_moves_nothing(op, layout, dim, mesh):
    """q/k sharded on batch, sequence or heads with cos/sin replicated: forward and
    backward match one device and no collective runs (cos/sin are sliced locally where
    q is sharded on batch or sequence). np_rotary is opaque (numpy) with registered
    references for its forward and its backward custom op: the same, with the numpy
    kernels running on the local shards."""
    fn = getattr(lib, op)
    tensors, unsq = _rotary_inputs(layout)
    dims = LAYOUTS[layout][2]
    if mesh == "2x2":
        p = (Shard(dims["batch"]), Shard(dims["heads"]))
    else:
        p = Shard(dims[dim])
    fwd, bwd, outs = run_sharded(fn, tensors, [p, p, R, R], (unsq,), MESHES[mesh], [p, p])
    assert _total(fwd) == 0 and _total(bwd) == 0, (fwd, bwd)
    assert outs == [_pl(p, MESHES[mesh])] * 2


def test_rotary_head_dim_sharded_is_right_and_communicates():
    """Sharding head_dim splits each rotate_half pair: the math needs the other half,
    so it must communicate (DTensor moves q/k to another dim: all-to-all), and the
    numbers must still be one device's."""
    tensors, unsq = _rotary_inputs("bshd", seed=7)
    fwd, _, _ = run_sharded(lib.rotary, tensors, [Shard(3), Shard(3), R, R], (unsq,), MESHES["w2"],
                            [Shard(3), Shard(3)])
    assert _total(fwd) > 0


def test_rotary_tables_sharded_with_q_moves_nothing():
    """cos/sin sharded on the sequence with q/k: the tables' dim 1 is q's dim 1."""
    tensors, unsq = _rotary_inputs("bshd", seed=11)
    fwd, bwd, _ = run_sharded(lib.rotary, tensors, [Shard(1)] * 4, (unsq,), MESHES["w3"], [Shard(1)] * 2)
    assert _total(fwd) == 0 and _total(bwd) == 0, (fwd, bwd)


# ------------------------------------------------------------------ SwiGLU


@pytest.mark.parametrize("p, mesh", [(Shard(0), "w2"), (Shard(0), "w3"), (Shard(1), "w3"),
                                     ((Shard(0), Shard(1)), "2x2")])
def test_swiglu_batch_or_sequence_sharded(p, mesh):
    """x sharded on batch or sequence, the weights replicated: the forward moves nothing,
    and the backward gathers nothing (the weight grads are partial sums, reduced only
    when read)."""
    x, wg, wu = _randn(6, 6, 8, seed=1), _randn(8, 12, seed=2), _randn(8, 12, seed=3)
    fwd, bwd, outs = run_sharded(lib.swiglu, (x, wg, wu), [p, R, R], (), MESHES[mesh], [p])
    assert _total(fwd) == 0, fwd
    assert not _gathers(bwd), bwd
    assert outs == [_pl(p, MESHES[mesh])]


def test_swiglu_uneven_batch_is_right_and_gathers():
    """The matmul form's implementation flattens [b, s, d] to [b*s, d]; an uneven shard
    of b (5 over 3) is no shard of b*s, so the derived batch rule is [even] and the
    input is gathered first. What matters: the numbers are one device's."""
    x, wg, wu = _randn(5, 7, 8, seed=1), _randn(8, 12, seed=2), _randn(8, 12, seed=3)
    fwd, _, _ = run_sharded(lib.swiglu, (x, wg, wu), [Shard(0), R, R], (), MESHES["w3"], [R], strict=False)
    assert _gathers(fwd), fwd


def test_swiglu_column_parallel():
    """Tensor parallel: w_gate and w_up column-sharded, x replicated: the forward is
    local (out sharded on its last dim), and so is the backward (x's grad is a partial
    sum, reduced only when read)."""
    x, wg, wu = _randn(3, 5, 8, seed=4), _randn(8, 12, seed=5), _randn(8, 12, seed=6)
    fwd, bwd, outs = run_sharded(lib.swiglu, (x, wg, wu), [R, Shard(1), Shard(1)], (), MESHES["w2"], [Shard(2)])
    assert _total(fwd) == 0 and _total(bwd) == 0, (fwd, bwd)
    assert outs == [(Shard(2),)]


@pytest.mark.parametrize("p, mesh", [(Shard(0), "w3"), (Shard(1), "w2"), (Shard(2), "w3"),
                                     ((Shard(0), Shard(2)), "2x2")])
def test_silu_mul_moves_nothing(p, mesh):
    a, b = _randn(5, 4, 7, seed=8), _randn(5, 4, 7, seed=9)
    fwd, bwd, outs = run_sharded(lib.silu_mul, (a, b), [p, p], (), MESHES[mesh], [p])
    assert _total(fwd) == 0 and _total(bwd) == 0, (fwd, bwd)
    assert outs == [_pl(p, MESHES[mesh])]


# ------------------------------------------------------------------ RMSNorm, backward through a custom op


@pytest.mark.parametrize("p, mesh", [(Shard(0), "w3"), (Shard(1), "w2"), ((Shard(0), Shard(1)), "2x2")])
def test_rmsnorm_backward_custom_op_moves_nothing(p, mesh):
    """The register_autograd backward calls rmsnorm_backward, itself a custom op with no
    strategy: it is derived too (grad x keeps x's sharding, grad w is a partial sum), so
    forward and backward move nothing."""
    x, w = _randn(5, 7, 16, seed=12), _randn(16, seed=13)
    fwd, bwd, outs = run_sharded(lib.rmsnorm, (x, w), [p, R], (EPS,), MESHES[mesh], [p])
    assert _total(fwd) == 0 and _total(bwd) == 0, (fwd, bwd)
    assert outs == [_pl(p, MESHES[mesh])]


# ------------------------------------------------------------------ opaque without a reference


def test_opaque_op_without_reference_says_what_to_register():
    """A Python loop over .tolist() cannot be traced: it runs replicated (right numbers)
    with one warning, one line, naming decompshard.register_reference."""
    x = _randn(7, 4, seed=14)
    mesh = device_mesh((3,))
    decompshard.enable()
    with LocalTensorMode(frozenset(range(3))), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = lib.loop_scale(distribute_tensor(x, mesh, [Shard(0)]))
        assert tuple(out.placements) == (R,)
        _assert_every_rank(out, x * 2, mesh, "output")
    name = "dstest_lib.loop_scale.default"
    messages = [str(w.message) for w in caught if name in str(w.message)]
    assert len(messages) == 1, [str(w.message) for w in caught]
    assert "\n" not in messages[0], messages[0]
    assert "register_reference" in messages[0] and "running replicated" in messages[0], messages[0]


# ------------------------------------------------------------------ precision of the derived rules


@pytest.mark.parametrize("name, args", [
    ("np_rotary", lambda: (_randn(4, 5, 6, 8, seed=20), _randn(4, 5, 6, 8, seed=21), _randn(4, 5, 8, seed=22),
                           _randn(4, 5, 8, seed=23), 2)),
    ("rmsnorm_backward", lambda: (_randn(5, 6, 8, seed=28), _randn(5, 6, 8, seed=29), _randn(8, seed=30), EPS)),
    ("swiglu", lambda: (_randn(6, 6, 8, seed=31), _randn(8, 12, seed=32), _randn(8, 12, seed=33))),
    ("silu_mul", lambda: (_randn(5, 4, 7, seed=34), _randn(5, 4, 7, seed=35))),
], ids=lambda v: v if isinstance(v, str) else "")
def test_derived_rules_hold_numerically(name, args):
    """Every rule derived for the custom ops holds when the op itself (for np_rotary the
    numpy kernel, its rules derived from the reference) runs on each rank's shard at
    world sizes 2 and 3 (uneven shards, random Partial parts), float64."""
    from decompshard.solve.derive import derive_rules
    from decompshard.verify.rule_check import check_rules

    op = getattr(torch.ops.dstest_lib, name).default
    a = args()
    derived = derive_rules(op, *a)
    assert derived.unsupported_reason is None and derived.rules, derived.unsupported_reason
    report = check_rules(op, a, {}, derived.rules, find_missing=False)
    assert not report.incorrect, report.incorrect
    assert not report.untestable, report.untestable
    assert len(report.confirmed) == len(derived.rules)
