"""DTensor's dispatch, reached from outside: its own steps for one call (propagate,
redistribute, run locally, wrap), stopped where a handler needs them; the module slots
where it prices candidate strategies, chooses one and moves inputs (found by feature
detection); the arguments of the op it is moving now; its collective cost model."""

from __future__ import annotations

import functools
import sys
from typing import Any, Sequence

from decompshard._compat.dtensor import DTensor, DTensorSpec, OpSchema, OutputSharding, sharding_propagator

__all__ = [
    "collective_cost_model", "dispatch_args_in_flight", "dispatch_redistribute_slot", "dtensor_default_dispatch",
    "dtensor_local_results", "dtensor_output_sharding", "dtensor_output_spec", "dtensor_planned_moves",
    "implicitly_replicated", "local_call_sharding", "planned_input_specs", "return_and_correct_aliasing", "strategy_cost_slots", "strategy_selection_slot",
    "wrap_local_results",
]


def dtensor_local_results(op_call: Any, args: tuple, kwargs: dict) -> tuple[Any, Any]:
    """DTensor's own path for one call, stopped before wrapping: propagate the sharding,
    redistribute the inputs as the chosen strategy asks, run the local kernel. Returns
    (local results, output spec). For a custom handler that post-processes the local
    results (the guard's mean-loss handler)."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    local = dispatcher._dispatch_get_local_results_slow_path(op_call, args, op_info)
    return local, op_info.output_sharding.output_spec


def dtensor_output_spec(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """The output spec DTensor's sharding propagation chooses for this call (no run)."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    return op_info.output_sharding.output_spec


def dtensor_output_sharding(op_call: Any, args: tuple, kwargs: dict) -> tuple[Any, bool, Any, tuple, dict]:
    """DTensor's sharding propagation for this call, not run: (output spec with its
    tensor meta, whether the chosen strategy moves an input first, and the local call
    DTensor would make: op, the arguments after `self`, kwargs). The local call differs
    from this one where DTensor rewrites it without moving anything (`squeeze.default`
    on a shard becomes `squeeze.dims` of the global size-1 dims: a shard's own size-1
    dims are not the tensor's)."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    rs = sharding.redistribute_schema
    if not sharding.needs_redistribute or rs is None:
        return sharding.output_spec, False, op_call, tuple(args[1:]), dict(kwargs)
    moves = any(isinstance(a, DTensorSpec) and (not isinstance(b, DTensorSpec) or a.placements != b.placements)
                for a, b in zip(op_info.schema.args_schema, rs.args_schema))
    return sharding.output_spec, moves, rs.op, tuple(rs.args_schema[1:]), dict(rs.kwargs_schema)


def dtensor_default_dispatch(op_call: Any, args: tuple, kwargs: dict) -> Any:
    """What DTensor does for an op without a custom handler, for a handler that only
    takes some calls: the local results wrapped in DTensors with the chosen specs."""
    local, spec = dtensor_local_results(op_call, args, kwargs)
    return DTensor._op_dispatcher.wrap(local, spec)


def wrap_local_results(local: Any, spec: Any) -> Any:
    """Local results wrapped in DTensors with their specs, as DTensor's dispatcher does
    (a tensor and a spec, or a tuple of each)."""
    return DTensor._op_dispatcher.wrap(local, spec)


def dtensor_planned_moves(op_call: Any, args: tuple, kwargs: dict) -> list[tuple[Any, Any]] | None:
    """DTensor's own plan for one call, not run: (current spec, the spec its chosen strategy
    moves it to) for each positional tensor argument; None where DTensor has no strategy
    (it would raise). For a handler that runs a cheaper plan only when DTensor's moves
    more (runtime/plans/install.py)."""
    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    try:
        dispatcher.sharding_propagator.propagate(op_info)
    except Exception:  # noqa: BLE001 - whatever DTensor raises, its own path would raise it too
        return None
    sharding = op_info.output_sharding
    current = list(op_info.schema.args_spec)
    target = sharding.redistribute_schema.args_spec if sharding.redistribute_schema is not None else current
    return list(zip(current, target))


def planned_input_specs(op: Any, arg_specs: Sequence[Any]) -> list[Any] | None:
    """DTensor's choice for a call not made yet, from its argument specs alone (tensor
    arguments only, each a DTensorSpec with its tensor meta): the spec each argument is
    moved to (its own where it stays); None where DTensor has no strategy (it would
    raise). The answer enters DTensor's propagation cache, where the call itself finds it."""
    sp = sharding_propagator()
    schema = OpSchema(op, tuple(arg_specs), {}, schema_info=sp.op_to_schema_info.get(op))
    try:
        sharding = sp.propagate_op_sharding(schema)
    except Exception:  # noqa: BLE001 - whatever DTensor raises, its own path would raise it too
        return None
    rs = sharding.redistribute_schema
    return list(rs.args_spec) if rs is not None else list(arg_specs)


def implicitly_replicated(t: Any) -> bool:
    """Whether DTensor takes this plain tensor, met beside DTensors in one op, as Replicate
    (`_try_replicate_spec_for_scalar_tensor`: a one-element tensor, or any tensor while
    `implicit_replication()` is on); otherwise DTensor raises on the mix. A custom op
    handler gets the plain tensor as it is, so it reads DTensor's rule here."""
    return t.numel() == 1 or bool(DTensor._op_dispatcher._allow_implicit_replication)


def return_and_correct_aliasing(func: Any, args: Any, kwargs: Any, out: Any) -> Any:
    """torch's own fix-up for a subclass handler's result (an in-place view op updates
    the wrapper's metadata; a mutated input is returned as itself)."""
    from torch.utils._python_dispatch import return_and_correct_aliasing as fix

    return fix(func, args, kwargs, out)


def local_call_sharding(op_schema: Any, output_specs: Any, local_args: Sequence[Any] | None = None) -> Any:
    """An OutputSharding of `output_specs` (each with its tensor meta); where `local_args`
    is given, the local call takes those positional arguments in place of the global
    ones, each tensor argument given as the spec DTensor moves it to first (its own spec:
    no move): the mechanism DTensor uses to make a view's size argument local
    (`redistribute_schema` with `use_val_from_redistribute_schema`), kept on DTensor's
    cached dispatch path."""
    if local_args is None:
        return OutputSharding(output_specs)
    schema = OpSchema(op_schema.op, tuple(local_args), dict(op_schema.kwargs_schema),
                      schema_info=op_schema.schema_info)
    return OutputSharding(output_specs, schema, needs_redistribute=True, use_val_from_redistribute_schema=True)


def strategy_cost_slots() -> list[tuple[Any, str, str]]:
    """Where DTensor prices the candidate strategies of a native op, and only there (not
    where it plans a redistribution it has chosen): `(module, attribute, kind)`.
    kind "spec": `redistribute_cost(current_spec, target_spec) -> cost`, as
    `_ops.utils` holds it for `generate_redistribute_costs` (op-strategy functions and
    their full-mesh expansion); kind "step": `_compute_placement_transition_cost(cur,
    tgt, mesh_topo, mesh_dim, comm_bytes_gb) -> (cost, comm_bytes_gb after)`, as
    `_ops.single_dim_strategy` holds it for its search over input placements. Feature
    detection: a slot this torch lacks is left out."""
    import importlib

    found = []
    for module_name, attribute, kind in (("torch.distributed.tensor._ops.utils", "redistribute_cost", "spec"),
                                         ("torch.distributed.tensor._ops.single_dim_strategy",
                                          "_compute_placement_transition_cost", "step")):
        module = importlib.import_module(module_name)
        if callable(vars(module).get(attribute)):
            found.append((module, attribute, kind))
    return found


def strategy_selection_slot() -> tuple[Any, str] | None:
    """Where DTensor chooses one of an op's candidate strategies by their summed input
    redistribution costs: `(module, attribute)` of `_sharding_prop._select_min_cost_strategy
    (strategy, op_schema=None) -> OpSpec` (every supported torch calls it through the
    module's global), or None where this torch lacks it (feature detection)."""
    import torch.distributed.tensor._sharding_prop as sp

    if callable(vars(sp).get("_select_min_cost_strategy")):
        return sp, "_select_min_cost_strategy"
    return None


def dispatch_redistribute_slot() -> tuple[Any, str] | None:
    """Where DTensor's dispatcher moves an op's inputs (`(owner, attribute)`): the
    `_dispatch` module's `redistribute_local_tensor(local, current_spec, target_spec, *,
    async_op, ...)`, which `OpDispatcher.redistribute_local_args` calls through the module
    global on every call (so a wrapper put there is seen at once and gone after
    `disable()`). Identical on 2.13-2.15; None where missing (feature detection)."""
    import torch.distributed.tensor._dispatch as dispatch

    if callable(vars(dispatch).get("redistribute_local_tensor")):
        return dispatch, "redistribute_local_tensor"
    return None


@functools.lru_cache(maxsize=1)
def _slow_path_code() -> Any:
    import torch.distributed.tensor._dispatch as dispatch

    fn = vars(dispatch.OpDispatcher).get("_dispatch_get_local_results_slow_path")
    return getattr(fn, "__code__", None)


def dispatch_args_in_flight(depth: int = 8) -> tuple | None:
    """The DTensor arguments of the op whose inputs DTensor is moving now on this thread:
    the `args` of `OpDispatcher._dispatch_get_local_results_slow_path`, found among the
    `depth` innermost frames by its code object; None outside it.

    Why a frame and not a wrapper: the C++ dispatch fetches that method once per process
    and keeps the bound method (`DEFINE_CACHING_PYTHON_IMPORT_GETTER` in
    python_variable.cpp, 2.13-2.15), so a wrapper put on the class after the first DTensor
    op is never called, and one put there before it is called for the rest of the process,
    `disable()` or not. Reading the frame changes nothing torch holds."""
    code = _slow_path_code()
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code is code:
            args = frame.f_locals.get("args")
            return args if isinstance(args, tuple) else None
        frame = frame.f_back
    return None


@functools.lru_cache(maxsize=None)
def collective_cost_model() -> Any:
    """DTensor's own pricing of one collective on one mesh dim (`_collective_utils`):
    a namespace with `allreduce_cost(gb, mesh_topo, mesh_dim)`, `reduce_scatter_cost`,
    `MeshTopoInfo.build_from_mesh(mesh)` and `spec_to_bytes(spec)`, so that a surcharge
    on its strategy choice is in its units."""
    import types

    import torch.distributed.tensor._collective_utils as cu

    return types.SimpleNamespace(allreduce_cost=cu.allreduce_cost, reduce_scatter_cost=cu.reduce_scatter_cost,
                                 allgather_cost=cu.allgather_cost,
                                 MeshTopoInfo=cu.MeshTopoInfo, spec_to_bytes=cu.spec_to_bytes)
