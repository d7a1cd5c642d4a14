"""The one judge (verify/judge.py): what makes a DTensor run disagree with one device,
on DTensors built by hand on simulated ranks to carry each kind of lie."""

from __future__ import annotations

import pytest
import torch

from decompshard._compat import TorchReplicate, TorchShard, make_local_tensor
from decompshard.verify.dtensor_case import device_mesh, simulation
from decompshard.verify.judge import METADATA, MISSING, PLAIN, REFUSED, SHAPE, VALUES, judge, judge_raised

pytestmark = pytest.mark.usefixtures("world")


def _dtensor(per_rank, placements, shape, stride=None):
    from torch.distributed.tensor import DTensor

    mesh = device_mesh((len(per_rank),))
    lt = make_local_tensor(dict(enumerate(per_rank)))
    return DTensor.from_local(lt, mesh, placements, run_check=False, shape=torch.Size(shape),
                              stride=stride or torch.empty(shape).stride())


def test_a_right_sharded_result_passes_with_its_error_measured():
    x = torch.randn(4, 3, dtype=torch.float64)
    with simulation(2):
        v = judge([_dtensor(list(x.chunk(2)), [TorchShard(0)], (4, 3))], [x])
    assert v.ok and v.max_error == 0.0 and not v.wrong


def test_a_rank_holding_another_shape_than_its_placements_say_is_wrong():
    """The model check had no such check of its own for intermediate ops; the zoo had
    one of its own: both now get the judge's."""
    x = torch.randn(4, 3, dtype=torch.float64)
    with simulation(2):
        lying = _dtensor([x[:3], x[3:]], [TorchShard(0)], (4, 3))  # 3 + 1 rows claimed as 2 + 2
        v = judge([lying], [x], names=["grad w"])
    assert v.kind == SHAPE and v.detail.startswith("grad w (S(0)): rank 0 holds shape [3, 3]"), v


def test_strides_the_local_tensor_does_not_have_are_wrong():
    x = torch.randn(4, 6, dtype=torch.float64)
    with simulation(2):
        local = x.t().contiguous().t()  # column-major locally, claimed row-major
        v = judge([_dtensor([local, local], [TorchReplicate()], (4, 6))], [x])
    assert v.kind == METADATA and "strides" in v.detail, v


def test_values_are_judged_at_the_tolerance_of_the_dtype_asked():
    x = torch.randn(8, dtype=torch.float64)
    off = x * (1 + 1e-4)  # float16 rounding, not float64's
    with simulation(2):
        d = _dtensor([off, off], [TorchReplicate()], (8,))
        tight, loose = judge([d], [x]), judge([d], [x], dtype=torch.float16)
    assert tight.kind == VALUES and "differs from one device" in tight.detail and tight.max_error > 0
    assert loose.ok and loose.max_error == tight.max_error


def test_a_missing_gradient_passes_only_where_one_device_has_zeros():
    assert judge([None], [torch.zeros(3)], missing_ok=True).ok
    v = judge([None], [torch.ones(3)], names=["grad b"], missing_ok=True)
    assert v.kind == MISSING and v.detail == "grad b is missing, one device gives a nonzero one"
    assert judge([torch.ones(3)], [None]).kind == SHAPE  # present where one device has none


def test_a_plain_tensor_where_a_dtensor_is_due():
    x = torch.randn(4, dtype=torch.float64)
    with simulation(2):
        anchor = _dtensor([x, x], [TorchReplicate()], (4,))
        right = judge([anchor, x.clone()], [x, x])
        wrong = judge([anchor, x + 1], [x, x])
        skipped = judge([anchor, x + 1], [x, x], plain="skip")
        per_rank = judge([anchor, make_local_tensor({0: x.clone(), 1: x + 1})], [x, x], plain="per-rank")
    assert right.kind == PLAIN and wrong.kind == VALUES and skipped.ok
    assert per_rank.kind == VALUES and "(plain): rank 1" in per_rank.detail, per_rank


def test_a_clean_refusal_is_not_wrong():
    try:
        raise RuntimeError("Sharding propagation failed\nmore lines")
    except RuntimeError as e:
        v = judge_raised(e)
    assert v.kind == REFUSED and not v.wrong and v.detail == "RuntimeError: Sharding propagation failed"


def test_a_sum_of_large_float32_parts_is_judged_at_the_parts_rounding():
    """linspace's P(sum) rule on a float32 output of parts up to 1000x the value read as
    WRONG at 40 ulps of the value (2.15 sweep): rounding at the parts' size, as the rule
    proof allows. A real difference of the value's size stays WRONG, and Replicate gets
    no such allowance."""
    from torch.distributed.tensor import Partial

    g = torch.Generator().manual_seed(0)
    value = torch.rand(7, generator=g) + 0.5
    big = 1000.0 + torch.rand(7, generator=g)
    parts = [value + big, -big]  # each rounded to float32 at 1000's ulp
    assert not torch.equal(parts[0] + parts[1], value)
    with simulation(2):
        v = judge([_dtensor(parts, [Partial()], (7,))], [value])
        off = judge([_dtensor([value + big, -big + 0.25], [Partial()], (7,))], [value])
        rounded = judge([_dtensor([parts[0] + parts[1]] * 2, [TorchReplicate()], (7,))], [value])
    assert v.ok, v
    assert off.kind == VALUES
    assert rounded.kind == VALUES  # the same error on a replicated result: no parts to excuse it
