"""DTensor's process-wide state, described so two processes can be compared, and one
workload that reaches every part of it decompshard touches.

`python tests/_dtensor_state.py plain|decompshard` runs the workload once, without
decompshard or inside `enable()` ... `disable()`, and prints JSON: how the state after
differs from the state before (every table's keys, whether each value is the very object
it was, every schema-info object's fields, the propagator's, dispatcher's and fallback's
instance attributes, the patched classes' attributes), and what the workload gave (run
once more after `disable()` in the decompshard process). tests/test_disable_exact.py
compares the two.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._decompositions import DecompShardingStrategy
from torch.distributed.tensor._dispatch import OpDispatcher
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.distributed.tensor.debug import CommDebugMode

TABLES = ("op_strategy_funcs", "op_single_dim_strategy_funcs", "op_to_rules", "op_to_schema_info",
          "op_to_schema_info_for_single_dim_strategy", "op_to_shape_and_stride_idx")
CLASSES = (DecompShardingStrategy, ShardingPropagator, OpDispatcher, Shard, DTensor)
SCHEMA_INFOS = ("op_to_schema_info", "op_to_schema_info_for_single_dim_strategy")


def capture() -> dict[str, dict]:
    """The objects themselves (kept alive, so identity compares truly)."""
    sp = DTensor._op_dispatcher.sharding_propagator
    state = {name: dict(getattr(sp, name)) for name in TABLES}
    state["custom_op_handlers"] = dict(DTensor._op_dispatcher._custom_op_handlers)
    state["propagator.__dict__"] = dict(vars(sp))
    state["dispatcher.__dict__"] = dict(vars(DTensor._op_dispatcher))
    state["decomp_strategy.__dict__"] = dict(vars(sp.decomp_strategy))
    for cls in CLASSES:
        state[f"{cls.__qualname__} class"] = dict(vars(cls))
    state["torch._utils"] = {"_chunk_or_narrow_cat": torch._utils._chunk_or_narrow_cat}
    return state


def _what(value: Any) -> str:
    """A new object, described by what it is (not where it lives in memory)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return f"{type(value).__qualname__}{dataclasses.asdict(value)}"
    fn = getattr(value, "__func__", value)
    name = getattr(fn, "__qualname__", None)
    if name is not None:
        return f"{getattr(fn, '__module__', '?')}.{name}"
    return type(value).__qualname__


def torch_inferred(after: dict[str, dict]) -> list[str]:
    """The ops whose schema-info entry holds exactly what torch's decomposition fallback
    registers on an op's first call (a lazily filled table: see the test)."""
    from torch.distributed.tensor._decompositions import _infer_schema_info_from_op

    return sorted(str(op) for op, info in after["op_to_schema_info"].items()
                  if dataclasses.asdict(info) == dataclasses.asdict(_infer_schema_info_from_op(op)))


def changes(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict]:
    """Per table: each key added, removed or holding another object; plus the fields of
    every schema-info object (they are mutable: an object kept may have been changed)."""
    out: dict[str, dict] = {}
    for name, now in after.items():
        was = before[name]
        diff = {str(k): "removed" for k in was.keys() - now.keys()}
        diff.update({str(k): f"new {_what(v)}" for k, v in now.items() if k not in was})
        diff.update({str(k): f"replaced by {_what(v)}" for k, v in now.items() if k in was and v is not was[k]})
        out[name] = dict(sorted(diff.items()))
    for name in SCHEMA_INFOS:
        out[f"{name} fields"] = {str(k): repr(dataclasses.asdict(v)) for k, v in sorted(after[name].items(), key=str)}
    return out


def _steps() -> dict[str, Callable]:
    """A few DTensor ops on 4 simulated ranks: a derived op, a `Tensor[]` op, SDPA with a
    keyword mask (forward and backward), ops whose native strategy or handler the guard
    wraps, in-place ops (native, written back, an in-place view), a view on an uneven
    shard."""
    mesh = torch.distributed.device_mesh.DeviceMesh("cpu", torch.arange(4))
    g = torch.Generator().manual_seed(0)
    R, S0, S1 = Replicate(), Shard(0), Shard(1)

    def dt(shape, placement, grad=False):
        t = distribute_tensor(torch.randn(*shape, dtype=torch.float64, generator=g), mesh, [placement])
        return t.requires_grad_() if grad else t

    def sdpa():
        # replicated: torch's own fallback tries every placement its inputs hold on every
        # dim (625 decompositions with one Shard), minutes on its own
        q, k, v = (dt((4, 2, 6, 4), R, grad=True) for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=dt((4, 1, 6, 6), R))
        out.sum().backward()
        return [out, q.grad, k.grad, v.grad]

    def in_place():
        a, b = dt((8, 6), S0), dt((8, 6), S0)
        a.add_(b)
        bias = dt((8,), R)
        bias.addmv_(dt((8, 12), S1), dt((12,), S0))
        c = dt((8, 6), R)
        c.transpose_(0, 1)
        return [a, bias, c]

    def conv():
        x, w = dt((4, 3, 8, 8), S0, grad=True), dt((5, 3, 3, 3), R, grad=True)
        out = F.conv2d(x, w, padding=1)
        out.sum().backward()
        return [out, x.grad, w.grad]

    return {
        "addmv": lambda: [torch.addmv(dt((8,), R), dt((8, 12), S1), dt((12,), S0))],
        "block_diag": lambda: [torch.block_diag(dt((3, 4), S0), dt((5, 2), S1), dt((2, 3), R))],
        "sdpa keyword mask": sdpa,
        "cumsum(-1) (guarded)": lambda: [torch.cumsum(dt((4, 8), S1), -1)],
        "conv2d (guarded)": conv,
        "in place": in_place,
        "uneven view": lambda: [dt((6, 4), S0).view(24)],
        "item": lambda: [torch.tensor(dt((8,), S0).sum().item())],
    }


def _result(value: Any) -> Any:
    if isinstance(value, DTensor):
        full = value.full_tensor()
        value = full._local_tensors[0] if hasattr(full, "_local_tensors") else full
    return [round(float(x), 9) for x in value.detach().flatten().tolist()]


def workload() -> dict[str, Any]:
    """Each step's values (rank 0's global copy) and collective count, or its error."""
    out: dict[str, Any] = {}
    with LocalTensorMode(4), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, step in _steps().items():
            try:
                with CommDebugMode() as comm:
                    values = step()
                out[name] = {"values": [_result(v) for v in values], "collectives": comm.get_total_counts()}
            except Exception as e:  # noqa: BLE001 - torch alone refuses some: recorded, compared
                out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return out


def main(mode: str) -> None:
    from decompshard.verify.dtensor_case import simulated_world

    import decompshard

    with simulated_world(4):
        before = capture()
        if mode == "plain":
            results = workload()
            after = capture()
            during = {}
        else:
            decompshard.enable()
            workload()
            during = {"block_diag needs_pytree": DTensor._op_dispatcher.sharding_propagator.op_to_schema_info[
                torch.ops.aten.block_diag.default].needs_pytree}
            decompshard.disable()
            after = capture()
            results = workload()  # DTensor's own behaviour again, caches included
    json.dump({"changes": changes(before, after), "results": results, "during": during,
               "torch_inferred": torch_inferred(after)}, sys.stdout, indent=1, sort_keys=True)


if __name__ == "__main__":
    main(sys.argv[1])
