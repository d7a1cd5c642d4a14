"""Every private torch API decompshard touches, and only version shims: each function here
reaches a private name or papers over a difference between the supported releases
(torch 2.13, 2.14, 2.15), and does nothing else. Features built on them live in the stage
they belong to. `from decompshard._compat import X` reaches every shim; the modules:

    release     the running torch: TORCH_VERSION, SUPPORTED, TORCH_RELEASE
    ops         torch's private utilities outside DTensor: op overloads, pytree, dispatch
                modes, fake tensors, the dispatcher's schema table, decompositions, custom
                ops, the autograd engine; heavy names loaded on first use (op_db, ...)
    dtensor     DTensor's private types (checked at import), its strategy tables, its
                dispatcher, and the private state of a DTensor object (local tensor, spec)
    dispatch    DTensor's dispatch steps for one call, the slots where it prices, chooses
                and moves, the op it is moving now, its collective cost model
    simulation  simulated ranks: the fake process group, LocalTensorMode and LocalTensor,
                the places DTensor splits with torch.chunk
    compile     torch.compile's caches: the tag its cache keys carry, dynamo's code cache
    symbolic    symbolic sizes (dynamic shapes): a SymInt's hint and its value at other sizes, no guard
"""

from __future__ import annotations

from typing import Any

from decompshard._compat.release import (
    SUPPORTED, TORCH_RELEASE, TORCH_VERSION,
)
from decompshard._compat.ops import (
    FakeTensorMode, OpOverload, TorchDispatchMode, aten_ops_tagged, clip_grad_slots, current_autograd_node,
    custom_op_implementation, custom_op_overload, custom_op_registry, disable_current_modes,
    in_backward, is_dispatchable, is_fake, keystr, lazy_attribute, linear_node_operands, on_backward_end, torch_decomposition,
    torch_decomposition_table, tree_flatten, tree_flatten_with_path, tree_leaves, tree_map,
    tree_unflatten,
)
from decompshard._compat.dtensor import (
    DTensor, DTensorSpec, DecompShardingStrategy, OpSchema, OpSpec, OpStrategy, OutputSharding,
    TensorMeta, TorchPartial, TorchReplicate, TorchShard, TorchShardingPlaceholder, TorchStridedShard,
    TupleStrategy, block_spec, clear_dtensor_caches, contiguous_spec, cpp_sharding_cache_clearable,
    custom_op_handlers, decomp_strategy_parameters, dtensor_spec, fake_one_rank_mesh,
    full_mesh_filter_keyword, generate_redistribute_costs, has_native_strategy, inferred_schema_info,
    local_tensor, op_dispatcher, op_strategy_func, placed_dtensor, propagation_cache_type,
    rebind_dtensor, redistribute_cost, redistribute_local_tensor, schema_info_slot, set_dtensor_layout,
    sharding_propagator, single_dim_strategy_info, slab_index, spec_dtensor, strategy_reused_from, unsharded_dtensor,
    view_family_ops, view_shape_arg_index, widened_schema_info,
)
from decompshard._compat.dispatch import (
    collective_cost_model, dispatch_args_in_flight, dispatch_redistribute_slot,
    dtensor_default_dispatch, dtensor_local_results, dtensor_output_sharding, dtensor_output_spec,
    dtensor_planned_moves, implicitly_replicated, local_call_sharding, planned_input_specs, return_and_correct_aliasing, strategy_cost_slots,
    strategy_selection_slot, wrap_local_results,
)
from decompshard._compat.compile import (aot_eager_seeing, binary_sym_exprs, compile_cache_tag, first_symbol_proxy_kept,
                                        forget_compiled_code, set_compile_cache_tag, sym_expr_builder_slot,
                                        sym_max_min_entries, symbol_proxy_slot)
from decompshard._compat.symbolic import (
    guard_divisible, has_hint, hint_of, is_symbolic, same_sizes, same_symbolic, symbol_hints, symbols_of, value_at,
)
from decompshard._compat.simulation import (
    SIMULATED_SCRIPT_IMPORTS, chunk_split_points, fake_store, local_tensor_api, local_tensor_mode,
    make_local_tensor, outside_simulation, rank_tensors, simulating_ranks,
)

__all__ = [
    "DTensor", "DTensorSpec", "DecompShardingStrategy", "FakeTensorMode", "OpOverload", "OpSchema", "OpSpec",
    "OpStrategy", "OutputSharding", "SIMULATED_SCRIPT_IMPORTS", "SUPPORTED", "TORCH_RELEASE", "TORCH_VERSION",
    "TensorMeta", "TorchDispatchMode", "TorchPartial", "TorchReplicate", "TorchShard", "TorchShardingPlaceholder",
    "TorchStridedShard", "TupleStrategy", "aot_eager_seeing", "aten_ops_tagged", "binary_sym_exprs", "block_spec", "chunk_split_points", "clip_grad_slots",
    "clear_dtensor_caches", "collective_cost_model", "compile_cache_tag", "contiguous_spec", "cpp_sharding_cache_clearable",
    "current_autograd_node", "custom_op_handlers", "custom_op_implementation", "custom_op_overload",
    "custom_op_registry", "decomp_strategy_parameters", "disable_current_modes", "dispatch_args_in_flight",
    "dispatch_redistribute_slot", "dtensor_default_dispatch", "dtensor_local_results", "dtensor_output_sharding",
    "dtensor_output_spec", "dtensor_planned_moves", "dtensor_spec", "fake_one_rank_mesh", "fake_store",
    "first_symbol_proxy_kept", "forget_compiled_code",
    "full_mesh_filter_keyword", "generate_redistribute_costs", "guard_divisible", "has_hint", "has_native_strategy", "hint_of", "implicitly_replicated", "in_backward",
    "inferred_schema_info", "is_dispatchable", "is_fake", "is_symbolic", "keystr", "linear_node_operands", "local_call_sharding", "local_tensor",
    "local_tensor_api", "local_tensor_mode", "make_local_tensor", "on_backward_end", "op_dispatcher",
    "op_strategy_func", "outside_simulation", "placed_dtensor", "planned_input_specs", "propagation_cache_type", "rank_tensors",
    "rebind_dtensor", "redistribute_cost", "redistribute_local_tensor", "return_and_correct_aliasing",
    "same_sizes", "same_symbolic", "schema_info_slot", "set_compile_cache_tag", "set_dtensor_layout", "sharding_propagator",
    "simulating_ranks", "single_dim_strategy_info", "slab_index", "spec_dtensor", "strategy_cost_slots",
    "strategy_reused_from", "strategy_selection_slot", "sym_expr_builder_slot", "sym_max_min_entries", "symbol_hints", "symbol_proxy_slot", "symbols_of", "torch_decomposition",
    "torch_decomposition_table", "tree_flatten", "tree_flatten_with_path", "tree_leaves", "tree_map", "tree_unflatten",
    "unsharded_dtensor", "value_at", "view_family_ops",
    "view_shape_arg_index", "widened_schema_info", "wrap_local_results",
]


def __getattr__(name: str) -> Any:
    """The heavy names (`op_db`, `c10d_collective_ops`, `expand_to_full_mesh_op_strategy`),
    imported on first use; left out of `__all__` for that reason."""
    value = lazy_attribute(name)
    globals()[name] = value
    return value
