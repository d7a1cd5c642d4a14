"""The DTensor-level checker (verify/dtensor_case.py) and the runtime bugs it found.

Each regression runs the real DTensor path with `enable()` on a simulated mesh and
compares every rank's full_tensor(), forward and backward, with one device.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import decompshard
from decompshard._compat import TorchStridedShard
from decompshard.runtime.enable import switched
from decompshard.verify.dtensor_case import Outcome, device_mesh, format_placements, make_dtensor, parse_mesh, parse_placements, per_rank_values, random_placements, run_case

aten = torch.ops.aten


WORLD_SIZE = 8  # simulated ranks for conftest's `world`
pytestmark = pytest.mark.usefixtures("world")


def _case(op, args, text, mesh="2x3", *, seed=0, on=True, kwargs=None, backward=True) -> Outcome:
    shape = parse_mesh(mesh)
    shapes = [tuple(t.shape) for t in torch.utils._pytree.tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
    return run_case(op, args, kwargs or {}, shape, parse_placements(text, shapes, len(shape)),
                    seed=seed, runtime=switched(on), backward=backward)


# ------------------------------------------------------------------ the checker itself


def test_placement_text_round_trips_and_rejects_bad_input():
    rows = parse_placements("S(0),P(sum);_S(1,3),R", [(4,), (2, 6)], 2)
    assert format_placements(rows) == "S(0),P(sum);_S(1,3),R"
    assert rows[1][0] == TorchStridedShard(1, split_factor=3)
    # the spelling check took before reads the same (old command lines keep working)
    assert parse_placements("S(0), P(sum); SS(1,3), R", [(4,), (2, 6)], 2) == rows
    for bad, why in [("S(0),R", "2 tensor inputs"), ("S(0),R;R", "one per mesh dim"),
                     ("S(3),R;R,R", "out of range"), ("P(mean),R;R,R", "malformed"),
                     ("P(sum),P(max);R,R", "one Partial reduce op"), ("SS(0,1),R;R,R", "split factor")]:
        with pytest.raises(ValueError, match=why):
            parse_placements(bad, [(4,), (2, 6)], 2)
    assert parse_mesh("2x3") == (2, 3) and parse_mesh("3d") == (2, 2, 2)
    with pytest.raises(ValueError, match="malformed mesh"):
        parse_mesh("2y3")


@pytest.mark.parametrize("text", ["S(0),P(sum)", "P(avg),S(1)", "P(max),P(max)", "S(1),P(min)", "_S(0,2),R"])
def test_made_dtensors_hold_the_value_asked_for(text):
    # Random Partial parts and strided shards must combine back to the value exactly.
    from torch.distributed._local_tensor import LocalTensorMode

    x = torch.randn(4, 6, dtype=torch.float64)
    with LocalTensorMode(frozenset(range(6))):
        d = make_dtensor(x, device_mesh((2, 3)), parse_placements(text, [(4, 6)], 2)[0], seed=3, salt=1)
        assert format_placements([d.placements]) == text
        full = per_rank_values(d.full_tensor(), 6)
        parts = per_rank_values(d.to_local(), 6)
    for r in range(6):
        torch.testing.assert_close(full[r], x)
    if "P(" in text:  # parts really differ between ranks (random, not x / n)
        assert not torch.equal(parts[0], parts[1]) or not torch.equal(parts[0], parts[3])


def test_the_checker_catches_a_wrong_strategy(monkeypatch):
    # A strategy that claims Replicate for a sharded result must be reported WRONG,
    # not ok: swap decompshard's choice for a deliberately wrong one.
    import importlib

    en = importlib.import_module("decompshard.runtime.derived")

    def wrong(op, args, kwargs, mesh_shape, current, *rest):
        from decompshard.mesh.lift import MeshStrategy
        from decompshard.mesh.cost import Cost
        from decompshard._compat import TorchReplicate, TorchShard

        return MeshStrategy((), ((TorchShard(0),),), ((TorchReplicate(),),), Cost())

    monkeypatch.setattr(en, "_first_runnable", wrong)
    decompshard.disable()  # enabling again clears DTensor's sharding cache
    out = _case(aten.trace.default, (torch.randn(6, 4),), "S(0)", "6", backward=False)
    assert out.status == "WRONG" and "differs from one device" in out.detail, out
    decompshard.disable()


def test_random_placements_cover_the_alphabet():
    rng = random.Random(0)
    seen = set()
    for _ in range(200):
        for row in random_placements([(6, 4), (5,)], [True, False], (2, 3), rng):
            seen.update(format_placements([row]).replace(";", ",").split(","))
    assert {"R", "S(0)", "S(1)", "P(sum)", "P(avg)", "P(max)", "P(min)"} <= seen
    assert any(s.startswith("_S(") for s in seen)


# ------------------------------------------------------------------ regressions


def test_tensor_list_inputs_are_redistributed():
    # block_diag(a: S(0), b: R) returned a DTensor claiming [11, 9] that held [5, 9].
    a, b = torch.randn(8, 4), torch.randn(3, 5)
    assert _case(aten.block_diag.default, ([a, b],), "S(0);R", "4").status == "ok"
    c = torch.randn(5, 2)
    assert _case(aten.block_diag.default, ([a, b, c],), "S(0),S(1);R,S(1);S(1),R").status == "ok"
    assert _case(aten.block_diag.default, ([a, b, c],), "S(0),P(sum);R,S(1);S(1),P(avg)", backward=False).status == "ok"


def test_optional_tensor_list_inputs_are_redistributed():
    x = torch.randn(5, 5)
    mask = torch.rand(5, 5) > 0.3
    i0, i1 = torch.randint(0, 5, (5, 1)), torch.randint(0, 5, (1, 5))
    out = _case(aten._unsafe_masked_index.default, (x, mask, [i0, i1], 0.0), "S(1),R;S(0),S(1);S(0),R;R,S(1)",
                backward=False)
    assert out.status == "ok", out


def test_strategies_never_mix_partial_reduce_ops():
    # rsub/addr picked outputs like [P(sum), P(max)]: DTensor refuses those placements.
    x, y = torch.randn(5, 10), torch.randn(5, 10)
    assert _case(aten.rsub.Tensor, (x, y), "P(sum),R;P(max),R").status == "ok"
    m, v1, v2 = torch.randn(5, 10), torch.randn(5), torch.randn(10)
    assert _case(aten.addr.default, (m, v1, v2), "R,S(0),P(min);P(sum),S(0),P(sum);R,P(max),R", "2x2x2").status == "ok"


def test_partial_to_uneven_shard_runs_in_the_simulator():
    # P(avg) -> S(0) on mesh dim 1 after an uneven S(0) on mesh dim 0: LocalTensorMode's
    # torch.chunk disagreed across ranks ('NoneType' has no attribute 'requires_grad').
    a, b = torch.randn(5, 5), torch.randn(5, 5)
    assert _case(aten.huber_loss.default, (a, b, 1, 0.9), "S(0),P(avg);P(min),P(min)").status == "ok"


def test_ops_without_strategy_or_decomposition_run_replicated_in_backward():
    # replication_pad2d's backward has neither: the user's backward crashed.
    x = torch.randn(2, 3, 4, 5)
    assert _case(aten.replication_pad2d.default, (x, [1, 2, 1, 0]), "S(0),S(1)").status == "ok"
    out = _case(aten.replication_pad2d.default, (x, [1, 2, 1, 0]), "S(0),S(1)", on=False)
    assert out.status == "error" and "sharding strategy" in out.detail  # torch's own


def test_inputs_that_cannot_take_a_gradient_are_left_out():
    # soft_margin_loss refuses a target that requires grad: the case is checked
    # against the input that can, not reported as failing on one device.
    x, y = torch.randn(5), torch.randn(5).sign()
    assert _case(aten.soft_margin_loss.default, (x, y, 1), "R,S(0),P(max);R,S(0),P(min)", "2x2x2").status == "ok"


def test_outputs_describe_the_local_layout_after_a_redistribution():
    # Head-sharded CPU attention ran replicated; the all-gathered q/k/v were contiguous,
    # the output DTensor claimed the transposed layout of the global inputs, and the
    # next `.transpose(1, 2).reshape(B, S, -1)` raised "view size is not compatible".
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.distributed.tensor import Shard, distribute_tensor

    from decompshard.runtime.enable import switched

    B, S, H, hd = 2, 6, 4, 8
    x = torch.randn(B, S, H * hd, dtype=torch.float64)

    def attention(q, k, v):
        q, k, v = (t.view(B, S, H, hd).transpose(1, 2) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, -1)

    ref = attention(x, x, x)
    mesh = device_mesh((4,))
    with switched(True), LocalTensorMode(frozenset(range(4))):
        d = distribute_tensor(x, mesh, [Shard(2)])
        out = attention(d, d, d)
        full = per_rank_values(out.full_tensor(), 4)
    for r in range(4):
        torch.testing.assert_close(full[r], ref)


def test_check_model_finds_the_op_that_diverges(monkeypatch):
    import importlib

    import _check_models as CM
    from decompshard.check.model import run_model_check

    module, inputs = CM.block()
    ok = run_model_check(module, inputs, (2, 2), "S(0),R")
    assert ok.divergence is None and ok.calls > 50
    # a deliberately wrong strategy for the attention op must be named
    en = importlib.import_module("decompshard.runtime.derived")
    real = en._first_runnable

    def wrong(op, args, kwargs, mesh_shape, current, *rest):
        best = real(op, args, kwargs, mesh_shape, current, *rest)
        if "flash_attention" not in str(op) or best is None:
            return best
        from dataclasses import replace

        from decompshard._compat import TorchPartial
        # claim pending sums where each rank holds the whole value: full_tensor() adds them up
        return replace(best, output_placements=tuple(None if o is None else tuple(TorchPartial("sum") for _ in o)
                                                     for o in best.output_placements))

    monkeypatch.setattr(en, "_first_runnable", wrong)
    decompshard.disable()
    bad = run_model_check(module, inputs, (2, 2), "S(0),R")
    decompshard.disable()
    assert bad.divergence is not None and "flash_attention" in bad.divergence.op, bad
    assert bad.divergence.phase == "forward"


def test_check_model_cli_on_a_conv_net():
    import os
    import subprocess
    import sys

    here = os.path.dirname(__file__)
    p = subprocess.run([sys.executable, "-m", "decompshard", "check", "--model", "_check_models:convnet",
                        "--mesh", "4", "--placements", "S(0)"], cwd=here, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "forward and backward match one device" in p.stdout


def test_gathers_with_empty_shards_run_in_the_simulator():
    # permute_copy's output sharded a size-1 dim over 2 ranks (an empty shard) beside
    # other shards; LocalTensorMode's all-gather split the gathered tensor with
    # torch.chunk, whose piece count differed between ranks ("Sizes of tensors must
    # match"). 8 real gloo processes ran the same case fine.
    x = torch.arange(24.0).reshape(1, 2, 3, 4)
    assert _case(aten.permute_copy.default, (x, [0, 2, 3, 1]), "S(2),S(0),S(1)", "2x2x2", seed=2).status == "ok"


# ------------------------------------------------------------------ plain-tensor gradients


def test_plain_tensor_gradient_with_right_values_is_an_error_naming_the_cause():
    """reflection_pad1d_backward's autograd formula for `self` is zeros_like(self), built
    from saved sizes: a plain tensor, not a DTensor, even with every input Replicate.
    Its values are right (zeros); what the user meets is the first DTensor op that
    mixes it in, which raises. So: an error that says so, not WRONG (wrong numbers)."""
    op = aten.reflection_pad1d_backward.default
    args = (torch.randn(1, 6, dtype=torch.float64), torch.randn(1, 3, dtype=torch.float64), [2, 1])
    for text in ("R;R", "S(1);P(sum)"):
        out = _case(op, args, text, "6")
        assert out.status == "error" and out.stage == "backward", out
        assert "gradient 1 is a plain torch.Tensor, not a DTensor" in out.detail
        assert "reflection_pad1d_backward" in out.detail and "builds it from sizes" in out.detail


class _PlainGrad(torch.autograd.Function):
    """x + y whose backward, given DTensors, hands back gradient 0 as a plain tensor
    (its full value times `scale_x`) and gradient 1 as a DTensor times `scale_y`; on
    plain tensors (the one-device reference) it is the true gradient (cot, cot)."""

    @staticmethod
    def forward(ctx, x, y, scale_x, scale_y):
        ctx.scales = (scale_x, scale_y)
        return x + y

    @staticmethod
    def backward(ctx, cot):
        from torch.distributed.tensor import DTensor

        if not isinstance(cot, DTensor):
            return cot, cot, None, None
        sx, sy = ctx.scales
        return cot.full_tensor() * sx, cot * sy, None, None


@pytest.mark.parametrize("scale_x, scale_y, status, detail", [
    (1.0, 1.0, "error", "gradient 0 is a plain torch.Tensor"),  # right values: loud, not wrong
    (3.0, 1.0, "WRONG", "gradient 0 is a"),  # a plain tensor with wrong values stays WRONG
    (1.0, 2.0, "WRONG", "gradient 1 "),  # a wrong number elsewhere outranks the plain one
])
def test_plain_tensor_gradients_are_judged_by_their_values(scale_x, scale_y, status, detail):
    def op(x, y):
        return _PlainGrad.apply(x, y, scale_x, scale_y)

    args = (torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64))
    out = _case(op, args, "S(0);R", "6")
    assert out.status == status and out.stage == "backward" and detail in out.detail, out


@pytest.mark.parametrize("text", ["P(avg),P(avg)", "R,P(sum)", "P(avg),S(0)"])
def test_partial_inputs_reduce_to_the_reference_bit_for_bit(text):
    # hash_tensor's output depends on every bit of its (reduced) input: the check's
    # Partial parts must reduce to exactly what one device is given, in the order
    # DTensor reduces them, or a right rule reads as WRONG (it did, 5 cases).
    g = torch.Generator().manual_seed(5)
    x = torch.randn(6, 5, dtype=torch.float64, generator=g) * torch.logspace(-8, 3, 5, dtype=torch.float64)
    x[0, 0] = -0.0  # a reduction of parts gives +0.0: the reference must be given +0.0 too
    out = _case(aten.hash_tensor.default, (x,), text, backward=False)
    assert out.status == "ok", out
    assert _case(aten.hash_tensor.default, (x,), text, backward=False, kwargs={"dim": [1]}).status == "ok"


@pytest.mark.parametrize("text", ["P(sum)", "P(avg)", "P(max)"])
def test_partial_parts_have_their_own_storage_laid_out_like_the_value(text):
    # as_strided_copy reads absolute storage positions: a part that was a view into a
    # shared buffer (offset 9k) read another rank's numbers, 4 WRONG on a right rule.
    x = torch.randn(3, 3, dtype=torch.float64)
    out = _case(aten.as_strided_copy.default, (x, (2, 2), (1, 2)), text, mesh="6", kwargs={"storage_offset": 1})
    assert out.status == "ok", out
    from torch.distributed._local_tensor import LocalTensorMode

    xt = torch.randn(4, 6, dtype=torch.float64).t()
    with LocalTensorMode(frozenset(range(6))):
        d = make_dtensor(xt, device_mesh((6,)), parse_placements(text, [(6, 4)], 1)[0], seed=0, salt=0)
        locals_ = per_rank_values(d.to_local(), 6)
        replicated = per_rank_values(make_dtensor(xt, device_mesh((6,)), parse_placements("R", [(6, 4)], 1)[0],
                                                  seed=0, salt=0).to_local(), 6)
    # laid out as distribute_tensor lays out a replicated rank's tensor, each in its own storage
    assert all(t.storage_offset() == 0 and t.stride() == replicated[r].stride() for r, t in locals_.items())
    assert len({t.untyped_storage().data_ptr() for t in locals_.values()}) == 6
