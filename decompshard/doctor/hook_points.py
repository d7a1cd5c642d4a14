"""The doctor's capability probes: every hook point decompshard patches or reads, and the
shapes of DTensor's strategy registries, asked of the running torch through `_compat`.

`decompshard doctor` asks the running torch for each hook point by feature
detection (an attribute, a signature, an import), never by its version number: on a
release nobody has tested, what is found is what counts. Each probe returns one line
describing what it found, or raises with the reason it is not there in the shape
decompshard uses."""

from __future__ import annotations

import inspect
from typing import Any

from decompshard import _compat
from decompshard._compat import (DecompShardingStrategy, OpOverload, TorchShardingPlaceholder, TorchStridedShard,
                                 chunk_split_points, cpp_sharding_cache_clearable, custom_op_handlers,
                                 custom_op_registry, fake_one_rank_mesh, fake_store, full_mesh_filter_keyword,
                                 has_native_strategy, local_tensor_api, op_dispatcher, propagation_cache_type,
                                 sharding_propagator, torch_decomposition_table)

__all__ = ["Probe", "hook_probes", "registry_probes"]

Probe = tuple[str, bool, str]  # (hook point, found as decompshard uses it, one line: what or why not)


def _require(found: bool, why: str) -> None:
    if not found:
        raise LookupError(why)


def _probe_propagator() -> str:
    sp = sharding_propagator()
    for table in ("op_single_dim_strategy_funcs", "op_strategy_funcs", "op_to_rules", "op_to_schema_info"):
        _require(isinstance(getattr(sp, table, None), dict), f"{type(sp).__name__}.{table} is not a dict")
    return f"{type(sp).__module__}.{type(sp).__name__}"


def _probe_decomp_strategy() -> str:
    fallback = sharding_propagator().decomp_strategy
    for attr in ("propagate_strategy", "ensure_schema_info", "sharding_prop"):
        _require(hasattr(fallback, attr), f"decomp_strategy ({type(fallback).__name__}) has no {attr}")
    return type(fallback).__name__ + (" (decompshard's: enable() is on)" if type(fallback) is not
                                      DecompShardingStrategy else " (torch's own fallback)")


def _probe_has_decomp() -> str:
    fn = inspect.getattr_static(DecompShardingStrategy, "has_decomp")
    _require(isinstance(fn, staticmethod), f"DecompShardingStrategy.has_decomp is a {type(fn).__name__}, "
             "not the staticmethod DTensor's propagator calls on the class")
    return "a staticmethod DTensor's propagator calls on the class"


def _probe_custom_handlers() -> str:
    handlers = custom_op_handlers()
    _require(isinstance(handlers, dict), f"_custom_op_handlers is a {type(handlers).__name__}, not a dict")
    return f"{len(handlers)} ops have a handler"


def _probe_redistribute_local_args() -> str:
    params = list(inspect.signature(op_dispatcher().redistribute_local_args).parameters)
    _require(len(params) == 3, f"redistribute_local_args takes ({', '.join(params)}); decompshard wraps "
             "(op_info, suggested_input_schema, use_val)")
    for attr in ("unwrap_to_op_info", "_dispatch_get_local_results_slow_path", "wrap"):
        _require(hasattr(op_dispatcher(), attr), f"OpDispatcher has no {attr}")
    return f"({', '.join(params)})"


def _probe_propagation_cache() -> str:
    cache = propagation_cache_type()
    sp = sharding_propagator()
    _require(callable(getattr(sp, "propagate_op_sharding_non_cached", None)),
             "the propagator has no propagate_op_sharding_non_cached")
    _require(hasattr(sp.propagate_op_sharding, "cache_clear"), "propagate_op_sharding has no cache_clear")
    cpp = cpp_sharding_cache_clearable()
    return f"{cache.__name__} over propagate_op_sharding_non_cached" + ("; C++ cache clearable" if cpp else "")


def _probe_placeholder() -> str:
    _require(TorchShardingPlaceholder(0).dim == 0, "_ShardingPlaceholder(0).dim is not 0")
    return f"{TorchShardingPlaceholder.__module__}._ShardingPlaceholder"


def _probe_strided_shard() -> str:
    p = TorchStridedShard(1, split_factor=3)
    _require((p.dim, p.split_factor) == (1, 3), "_StridedShard(1, split_factor=3) does not keep its dim and factor")
    return "_StridedShard(dim, split_factor=)"


def _probe_custom_chunk() -> str:
    (shard, chunk_name), (utils, cat_name) = chunk_split_points()
    _require(isinstance(vars(shard).get(chunk_name), staticmethod), "Shard._custom_chunk is not a staticmethod of Shard")
    _require(callable(getattr(utils, cat_name, None)), "torch._utils has no _chunk_or_narrow_cat")
    return "Shard._custom_chunk and torch._utils._chunk_or_narrow_cat (the simulator's chunk mend)"


def _probe_local_tensor() -> str:
    return f"{local_tensor_api()}: LocalTensorMode, LocalTensor"


def _probe_fake_store() -> str:
    store = fake_store()
    return f"{type(store).__module__}.{type(store).__name__}"


def _probe_filter_keyword() -> str:
    return f"{full_mesh_filter_keyword()}="


def _probe_custom_op_registry() -> str:
    return f"{custom_op_registry()}: CustomOpDef, _maybe_get_opdef"


def _probe_one_rank_mesh() -> str:
    mesh = fake_one_rank_mesh()
    return f"DeviceMesh(_init_backend=False): shape {tuple(mesh.shape)}"


def _probe_op_db() -> str:
    db = _compat.op_db
    _require(len(db) > 0, "OpInfo's op_db is empty")
    return f"{len(db)} OpInfo entries"


_HOOK_PROBES = (
    ("DTensor._op_dispatcher.sharding_propagator", _probe_propagator),
    ("sharding_propagator.decomp_strategy", _probe_decomp_strategy),
    ("DecompShardingStrategy.has_decomp", _probe_has_decomp),
    ("custom op handlers (_custom_op_handlers)", _probe_custom_handlers),
    ("OpDispatcher.redistribute_local_args", _probe_redistribute_local_args),
    ("propagate_op_sharding cache", _probe_propagation_cache),
    ("_ShardingPlaceholder", _probe_placeholder),
    ("_StridedShard", _probe_strided_shard),
    ("Shard._custom_chunk", _probe_custom_chunk),
    ("LocalTensorMode", _probe_local_tensor),
    ("FakeStore", _probe_fake_store),
    ("expand_to_full_mesh_op_strategy filter keyword", _probe_filter_keyword),
    ("custom op registry", _probe_custom_op_registry),
    ("one-rank DeviceMesh (no process group)", _probe_one_rank_mesh),
    ("OpInfo database (op_db)", _probe_op_db),
)


def _run_probe(name: str, probe: Any) -> Probe:
    from decompshard.errors import one_line

    try:
        return name, True, probe()
    except Exception as e:  # any way of not being there is an answer, not a crash
        return name, False, one_line(e, 200)


def hook_probes() -> list[Probe]:
    """Every hook point decompshard patches or reads, each found or not (with why)."""
    return [_run_probe(name, probe) for name, probe in _HOOK_PROBES]


def _table_size(table: str) -> Any:
    def probe() -> str:
        entries = getattr(sharding_propagator(), table)
        return f"{len(entries)} ops"
    return probe


def _probe_covered() -> str:
    sp = sharding_propagator()
    return f"{len(set(sp.op_single_dim_strategy_funcs) | set(sp.op_strategy_funcs) | set(sp.op_to_rules))} ops"


def _probe_single_dim_entries() -> str:
    import dataclasses

    table = sharding_propagator().op_single_dim_strategy_funcs
    _require(len(table) > 0, "op_single_dim_strategy_funcs is empty")
    info = next(iter(table.values()))
    _require(dataclasses.is_dataclass(info) and callable(getattr(info, "func", None)),
             f"its entries are {type(info).__name__}, not a dataclass with a func (the guard replaces func)")
    return f"{type(info).__name__} with func"


def _probe_decomposition_table() -> str:
    table = torch_decomposition_table()
    uncovered = sum(1 for op in table if isinstance(op, OpOverload) and not has_native_strategy(op))
    return f"{len(table)} ops, {uncovered} of them without a DTensor strategy (the decomposition fallback's)"


_REGISTRY_PROBES = (
    ("op_single_dim_strategy_funcs", _table_size("op_single_dim_strategy_funcs")),
    ("op_strategy_funcs", _table_size("op_strategy_funcs")),
    ("op_to_rules", _table_size("op_to_rules")),
    ("ops with a DTensor strategy (the three tables)", _probe_covered),
    ("op_to_schema_info", _table_size("op_to_schema_info")),
    ("single-dim strategy entries", _probe_single_dim_entries),
    ("decomposition table", _probe_decomposition_table),
)


def registry_probes() -> list[Probe]:
    """The shapes of DTensor's strategy registries and torch's decomposition table."""
    return [_run_probe(name, probe) for name, probe in _REGISTRY_PROBES]
