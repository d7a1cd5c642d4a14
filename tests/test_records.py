"""The runtime's declared records (decompshard/runtime/records.py) and the one order an op's
handler chain is built in: the plan where it pays, else the guard's fence, else DTensor's
own path, whichever switches are on. Also that every record is well formed: a plan's ops
resolve and its module exists, a fence names tested releases and one fix.
"""

from __future__ import annotations

import os

import pytest
import torch

import decompshard
from decompshard._compat import custom_op_handlers, dtensor_default_dispatch
from decompshard.runtime import plans
from decompshard.runtime.enable import PLANS_ENV
from decompshard.runtime.fences import guard
from decompshard.runtime.fences.table import FENCES
from decompshard.runtime.records import TESTED_RELEASES

aten = torch.ops.aten
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _clean(monkeypatch):
    monkeypatch.delenv(PLANS_ENV, raising=False)
    monkeypatch.delenv(guard.ENV, raising=False)
    decompshard.disable()
    yield
    decompshard.disable()


def test_every_plan_resolves_and_names_its_module():
    assert len(plans.PLANS) >= 10
    ops = [op for op, _ in plans.plan_ops()]
    assert len(ops) == len(set(ops)), "an op with two plans"
    for plan in plans.PLANS:
        assert plan.what and plan.applies, plan
        assert os.path.isfile(os.path.join(ROOT, "decompshard", plan.module)), plan.module
    for op in (aten._softmax.default, aten.native_layer_norm.default, aten.nll_loss_forward.default,
               aten.index_add.default, aten.index_put.default, aten.native_batch_norm.default,
               aten.convolution.default):
        assert plans.plan_for(op) is not None, op


def test_every_fence_is_one_record_with_one_fix():
    keys = [f.key for f in FENCES]
    assert len(keys) == len(set(keys)), "a fence named twice"
    for f in FENCES:
        assert f.wrong and set(f.wrong_on) <= set(TESTED_RELEASES), f.key
        kinds = [x for x in (f.fix.handler, f.fix.single or f.fix.full, f.fix.entries) if x is not None]
        assert len(kinds) == 1, f.key
        assert decompshard.resolve_op(f.op) is not None
    # the measured release facts are per record: torch 2.14 fixed `any`, so the fence steps aside there
    any_fence = next(f for f in FENCES if f.op == "aten.any.default")
    assert any_fence.installed_here("2.13.0") and not any_fence.installed_here("2.15.0")
    assert any_fence.installed_here("9.9.9")  # an untested release keeps every fence
    loss = next(f for f in FENCES if f.op == "aten.nll_loss_forward.default")
    assert loss.installed_here("2.15.0") and not loss.wrong_here("2.15.0")  # kept as the cheaper plan


def _chain(op) -> list:
    """The handler slot's chain, outermost first: ('plan', 'fence' or the object)."""
    out, h = [], custom_op_handlers().get(op)
    while h is not None:
        if getattr(h, "plan", None) is not None:
            out.append("plan")
        elif getattr(h, "fence", None) is not None:
            out.append("fence")
        else:
            out.append(h)
            break
        h = getattr(h, "__wrapped__", None)
    return out


def test_the_chain_is_plan_then_fence_then_dtensor():
    loss, conv = aten.nll_loss_forward.default, aten.convolution.default
    torch_conv = custom_op_handlers()[conv]  # DTensor's own handler
    assert loss not in custom_op_handlers()
    decompshard.enable()
    assert _chain(loss)[:2] == ["plan", "fence"]
    assert _chain(conv) == ["plan", "fence", torch_conv]
    decompshard.enable(guard_native=False)  # the plans stay: performance is not the guard's
    assert _chain(loss) == ["plan", dtensor_default_dispatch]
    assert _chain(conv) == ["plan", torch_conv]
    decompshard.enable(plans=False)  # the fences stay: correctness is not the plans'
    assert _chain(loss) == ["fence"]
    assert _chain(conv) == ["fence", torch_conv]
    decompshard.enable(guard_native=False, plans=False)
    assert loss not in custom_op_handlers() and custom_op_handlers()[conv] is torch_conv
    decompshard.disable()
    assert loss not in custom_op_handlers() and custom_op_handlers()[conv] is torch_conv


def test_someone_elses_handler_is_left_alone():
    """A handler DTensor's user installed (loss_parallel() does, for nll_loss) is neither
    wrapped by a plan nor by a fence, and is there again after disable()."""
    loss = aten.nll_loss_forward.default

    def theirs(op_call, args, kwargs):  # pragma: no cover - never called here
        raise AssertionError

    custom_op_handlers()[loss] = theirs
    try:
        decompshard.enable()
        assert custom_op_handlers()[loss] is theirs
        decompshard.disable()
        assert custom_op_handlers()[loss] is theirs
    finally:
        custom_op_handlers().pop(loss, None)


def test_the_environment_turns_plans_off_and_the_argument_wins(monkeypatch):
    loss = aten.nll_loss_forward.default
    monkeypatch.setenv(PLANS_ENV, "0")
    decompshard.enable()
    assert _chain(loss) == ["fence"]
    with decompshard.enabled(plans=True):
        assert _chain(loss)[0] == "plan"
    assert _chain(loss) == ["fence"]  # as it was before the block


def test_records_for_an_op_in_chain_order():
    from decompshard.runtime.records import Fence, Plan
    from decompshard.runtime.registry import records_for

    kinds = [type(r) for r in records_for("aten.convolution_backward.default")]
    assert kinds == [Plan, Fence, Fence]  # channel-parallel plan; the handler fence and the output-mask fence
    assert [type(r) for r in records_for(aten.nll_loss_forward.default)] == [Plan, Fence]
    assert records_for(aten.mm.default) == []
