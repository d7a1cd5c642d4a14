"""The native guard: keep DTensor away from native behaviour proved wrong.

On by default with `decompshard.enable()`: `enable()` makes programs reach DTensor's
native strategies they never reached before (a model that stopped at CPU attention now
runs on to its loss and its convolutions), so a wrong number there is a wrong number
under `enable()`. Found so far, each silent or a crash in a real model: convolution's
handlers skip the redistribution their strategy asks for (ResNet, EfficientNet under
data parallel), batch norm in training loses its running-statistics update (ResNet-18:
errors up to 0.34 in the buffers), class-weighted `nll_loss` means. Opt out with
`enable(guard_native=False)` or `DECOMPSHARD_GUARD_NATIVE=0` (then nothing of
DTensor's native path is touched); `disable()` removes it, and DTensor's tables hold
exactly the objects they held before. Its cost (bench/guard.py, 4 simulated ranks,
warm CPU time per call): convolution +30 us (+8%; one more cached sharding
propagation), its backward +50 us (+5%), batch norm and nll_loss within 2%; a numerical
check per listed rule and shapes, once. Training steps of a tiny ResNet and a tiny
Llama, first and warm, were equal within this shared machine's noise (+-10%).

What it guards is the list `guard_table.py` holds, found by `decompshard coverage
--verify-native` and by training vision models (every entry is confirmed by a direct
DTensor run in the tests). Each entry is installed only where it was measured wrong on
the running torch release, or where that release was never measured
(`guard_table.WRONG_ON`, `fenced`); the mean-loss handler also where torch is right,
as the cheaper plan (`KEPT_WHERE_RIGHT`):

* **Handlers that skip the redistribution their strategy asks for** (convolution and
  its backward: the custom handler runs the local kernel on the inputs as they are and
  labels the result with the strategy's output placements). The guard moves the inputs
  (DTensor's own `redistribute`) to a layout the handler computes right before it runs,
  and leaves a call the handler already computes right alone (guard_conv.py).
* **Batch norm in training** (guard_batchnorm.py): DTensor moves the replicated running
  statistics to its channel strategy's Shard(0) and the kernel's in-place update lands
  on the moved copy; the guard writes it back.
* **Rules in a strategy table that are wrong** (`any(P(sum)) -> P(sum)`, say). The
  guard wraps the op's entry in the propagator's tables and drops a listed rule when
  the numerical checker (`verify.check_rules_at`, on random data of the shapes at hand,
  at the world sizes where DTensor would apply it) refutes it there; DTensor then picks
  the next valid strategy (all-Replicate at worst: always right). At shapes too large
  to check quickly, or that the checker cannot build data for, a listed rule is dropped
  unchecked: skipping a right rule costs communication, using a wrong one costs the
  training run.
* **Mean losses DTensor reduces as a mean of per-rank means** (`nll_loss_forward`,
  `nll_loss2d_forward`: wrong with ignored targets or class weights). The guard gives
  them a custom handler (`guard_losses.py`) that sums on each rank and divides by the
  all-reduced total weight; other reductions go to DTensor unchanged. An op that
  already has a custom handler (torch's `loss_parallel()` context installs its own) is
  left alone.
* **Strategies that compare a negative dim unwrapped** (`cumsum`, `cumprod`,
  `logcumsumexp`: `cumsum(-1)` on a Shard of the last dim scanned each rank's part
  alone). The guard hands their strategy the dims wrapped to >= 0 (guard_dims.py).
* **Rules sharding inputs that do not line up** (`gather`'s S(d), S(d) -> S(d) for an
  index shorter than its input on d): dropped at those shapes (guard_aligned.py).
* **Cache keys without an argument the output depends on** (`histc`'s `bins`,
  `_to_copy`'s `memory_format`): the op's RuntimeSchemaInfo widened (guard_cache_keys.py).
* **Arguments a strategy reads by name only** (`logsumexp`'s `keepdim`, passed by
  position): handed to the strategy by name (guard_kwargs.py).
* **In-place views DTensor leaves at their old shape** (`squeeze_`): enable()'s in-place
  view handler (inplace_views.py).
* **Reads of one rank's part** (`_local_scalar_dense`, i.e. `.item()`, which DTensor
  runs on the local tensor without asking its strategy): a handler redistributes a
  partial or sharded input to Replicate first.

Each guarded op warns once, naming the op and what it did.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable, Iterator

import torch

from decompshard._compat import dtensor_default_dispatch
from decompshard._compat import DTensor, DTensorSpec, OpSpec, OpStrategy, TensorMeta, TorchReplicate, clear_dtensor_caches, custom_op_handlers, generate_redistribute_costs, sharding_propagator
from decompshard.torch_placements import from_torch_placement
from decompshard.dispatch_modes.graph import freeze, leaves
from decompshard.runtime.fences.batch_norm_stats import stats_writing_handler
from decompshard.runtime.fences.negative_dims import wrapping_op_strategy, wrapping_single_dim
from decompshard.runtime.fences.output_mask import masking_single_dim
from decompshard.runtime.fences.mean_loss import mean_loss_handler
from decompshard.runtime.plans.batch_norm import batch_sharded_backward, batch_sharded_forward
from decompshard.runtime.fences.table import BATCH_SHARDED_NORM_BACKWARDS, BATCH_SHARDED_NORMS, CACHE_KEY_MISSES, HANDLERS_SKIPPING_REDISTRIBUTION, IN_PLACE_VIEWS_KEEPING_SHAPE, MEAN_OF_MEANS_LOSSES, NEGATIVE_DIMS_UNWRAPPED, OUTPUT_MASK_IGNORED, READ_BY_NAME_ONLY, READS_OF_ONE_RANKS_PART, SHARDS_MUST_LINE_UP, STATS_WRITTEN, WRONG_RULES, fenced, mask_key, wrong_here
from decompshard.runtime.fences.aligned_shards import aligned_op_strategy, aligned_single_dim
from decompshard.runtime.fences.cache_keys import widened_keys
from decompshard.runtime.fences.kwargs_by_name import naming_op_strategy, naming_single_dim
from decompshard.runtime.support.inplace_views import in_place_view_handler
from decompshard.runtime.plans.install import planned_or
from decompshard.placements import SingleDimRule, format_rule
from decompshard.runtime.table_patches import Entry, TablePatches, where_none
from decompshard.op_names import resolve_op
from decompshard.runtime.fences.conv_handlers import redistributing_handler
from decompshard.dispatch_modes.clean import clean_dispatch_state
from decompshard.verify.native_rules import world_sizes_for
from decompshard.verify.rule_check import check_rules_at
from decompshard.dispatch_modes.graph import map_leaves

__all__ = ["ENV", "install", "is_installed", "uninstall", "wanted"]

ENV = "DECOMPSHARD_GUARD_NATIVE"
CHECK_LIMIT = 1 << 18  # input elements up to which a listed rule is checked at the shapes at hand

_verdicts: dict[tuple, frozenset] = {}


_OFF = ("0", "false", "no", "off")


def wanted(flag: bool | None) -> bool:
    """The guard setting: the argument when given, else the environment variable
    (on unless it says 0, false, no or off)."""
    if flag is not None:
        return bool(flag)
    return os.environ.get(ENV, "").strip().lower() not in _OFF


def _resolve(name: str) -> torch._ops.OpOverload | None:

    try:
        return resolve_op(name)
    except ValueError:  # an overload this torch does not have
        return None


def _handler_entries() -> Iterator[Entry]:
    """Handlers: the listed ones that skip their redistribution, wrapped; new ones where
    DTensor has none (someone else's, such as loss_parallel's, stays)."""
    handlers = custom_op_handlers()
    for name in filter(fenced, HANDLERS_SKIPPING_REDISTRIBUTION):
        op = _resolve(name)
        if op is not None and op in handlers:
            yield handlers, op, _redistributing_handler(op, handlers[op])
    added = [
        # the plans enable() activates (collective_plans.py) go first: this handler holds their slot
        *((name, functools.partial(_mean_loss, wrong=wrong_here(name))) for name in filter(fenced, MEAN_OF_MEANS_LOSSES)),
        *((name, _replicated_read) for name in filter(fenced, READS_OF_ONE_RANKS_PART)),
        *((name, functools.partial(_batch_norm_handler, training=t,
                                   written=STATS_WRITTEN.get(name) if name in STATS_WRITTEN and fenced(name) else None))
          for name, t in BATCH_SHARDED_NORMS.items()),
        *((name, lambda op: batch_sharded_backward(dtensor_default_dispatch)) for name in BATCH_SHARDED_NORM_BACKWARDS),
        *((name, functools.partial(_in_place_view, twin=twin))
          for name, twin in IN_PLACE_VIEWS_KEEPING_SHAPE.items() if fenced(name)),
    ]
    found = [(op, make) for op, make in ((_resolve(name), make) for name, make in added) if op is not None]
    yield from where_none(handlers, found, lambda op, make: make(op))


def _in_place_view(op: torch._ops.OpOverload, twin: str) -> Callable:
    """enable()'s in-place view handler, with a warning: DTensor would keep self's shape."""
    run = in_place_view_handler(op, resolve_op(twin))

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        _warn_once(f"inplace-view:{op}", (
            f"decompshard guard: {op}: DTensor's in-place path would keep self's old shape over the "
            f"changed local tensors; running it as {twin}'s view and setting self's whole spec"))
        return run(op_call, args, kwargs)

    return handler


def _mean_loss(op: torch._ops.OpOverload, wrong: bool) -> Callable:
    """The mean-loss handler behind the plans; it warns only where DTensor alone was
    measured wrong (elsewhere it is kept as the cheaper plan: guard_table.KEPT_WHERE_RIGHT)."""
    return planned_or(mean_loss_handler(_warn_mean_of_means if wrong else lambda op: None))


def _batch_norm_handler(op: torch._ops.OpOverload, training: bool | None, written: tuple | None) -> Callable:
    """The batch-sharded plan (sync_batchnorm.py) where it applies and pays; otherwise
    DTensor's own path, with the running statistics written back where DTensor moves
    them (guard_batchnorm.py)."""
    fallback = dtensor_default_dispatch if written is None else stats_writing_handler(op, *written, _warn_once)
    return batch_sharded_forward(fallback, training)


def _strategy_entries() -> Iterator[Entry]:
    """Strategy-table entries: listed wrong rules filtered, negative dims wrapped."""
    sp = sharding_propagator()
    single, full = sp.op_single_dim_strategy_funcs, sp.op_strategy_funcs
    for name, rules in WRONG_RULES.items():
        op = _resolve(name) if fenced(name) else None
        if op is None:
            continue
        if op in single:
            yield single, op, dataclasses.replace(
                single[op], func=_filtered_single_dim(op, single[op].func, frozenset(rules)))
        elif op in full:
            yield full, op, _filtered_op_strategy(op, full[op], frozenset(rules))
    yield from _in_either_table(single, full, NEGATIVE_DIMS_UNWRAPPED, wrapping_single_dim, wrapping_op_strategy)
    yield from _in_either_table(single, full, SHARDS_MUST_LINE_UP, aligned_single_dim, aligned_op_strategy)
    for name, (index, kw) in READ_BY_NAME_ONLY.items():
        op = _resolve(name) if fenced(name) else None
        if op in single:
            yield single, op, dataclasses.replace(
                single[op], func=naming_single_dim(op, single[op].func, index, kw, _warn_once))
        elif op in full:
            yield full, op, naming_op_strategy(op, full[op], index, kw, _warn_once)
    yield from widened_keys({k: v for k, v in CACHE_KEY_MISSES.items() if fenced(k)}, _resolve)
    for name, mask_index in OUTPUT_MASK_IGNORED.items():
        op = _resolve(name) if fenced(mask_key(name)) else None
        if op in single:
            yield single, op, dataclasses.replace(
                single[op], func=masking_single_dim(single[op].func, mask_index))


def _in_either_table(single: dict, full: dict, names: Any, wrap_single: Callable, wrap_full: Callable
                     ) -> Iterator[Entry]:
    """Each fenced op's strategy wrapped where torch keeps it: the single-dim table
    (2.14+ for most ops) or the full-mesh one."""
    for name in filter(fenced, names):
        op = _resolve(name)
        if op in single:
            yield single, op, dataclasses.replace(single[op], func=wrap_single(op, single[op].func, _warn_once))
        elif op in full:
            yield full, op, wrap_full(op, full[op], _warn_once)


def _declared() -> Iterator[Entry]:
    """What the guard puts where."""
    yield from _handler_entries()
    yield from _strategy_entries()


def _changed(installed: bool) -> None:
    """Verdicts belong to one installation; DTensor's cached decisions are forgotten."""
    if not installed:
        _verdicts.clear()
    clear_dtensor_caches()


_PATCHES = TablePatches(_declared, on_change=_changed)
_warn_once = functools.partial(_PATCHES.warn_once, stacklevel=4)


def install() -> None:
    """Wrap the listed ops' handlers and strategy-table entries. Idempotent."""
    _PATCHES.install()


def uninstall() -> None:
    """Put back exactly what `install` replaced. Idempotent."""
    _PATCHES.uninstall()


def is_installed() -> bool:
    return _PATCHES.is_installed()


# ------------------------------------------------------------------ handlers


def _redistributing_handler(op: torch._ops.OpOverload, original: Callable) -> Callable:
    """`original`, run on a layout it computes right (guard_conv.py)."""

    return redistributing_handler(op, original, _warn_once)


# ------------------------------------------------------------------ strategy tables


def _symbolic(metas: list[TensorMeta]) -> bool:
    return any(not isinstance(s, int) for m in metas for s in m.shape)


def _materialize(meta: TensorMeta, gen: torch.Generator) -> torch.Tensor | None:
    """Random data of the meta's shape (floating and complex only: integers are indices,
    masks and counts whose valid values a shape does not say)."""
    if meta.dtype.is_floating_point or meta.dtype.is_complex:
        return torch.randn(tuple(meta.shape), dtype=meta.dtype, generator=gen)
    return None


def _refuted_here(op: Any, args: Any, kwargs: Any, watched: list[SingleDimRule]) -> frozenset:
    """Keys of the watched rules to drop for this call: refuted by the checker on random
    data of these shapes, or not checkable here (symbolic, too large, integer inputs)."""

    if not watched:
        return frozenset()
    metas = [x for x in leaves((args, kwargs)) if isinstance(x, TensorMeta)]
    if _symbolic(metas):
        return frozenset(r.key() for r in watched)
    try:
        key = (op, freeze((args, kwargs)), tuple(r.key() for r in watched))
        hash(key)
    except TypeError:
        key = None
    if key is not None and key in _verdicts:
        return _verdicts[key]
    drop = frozenset(r.key() for r in watched)
    if sum(m.shape.numel() for m in metas) <= CHECK_LIMIT:
        with clean_dispatch_state():
            gen = torch.Generator().manual_seed(0)
            real = {id(m): _materialize(m, gen) for m in metas}
            if all(v is not None for v in real.values()):

                r_args, r_kwargs = map_leaves(lambda x: real[id(x)] if isinstance(x, TensorMeta) else x,
                                              (args, kwargs))
                tensors = [real[id(m)] for m in metas]
                plan = [(r, world_sizes_for(r, tensors)) for r in watched]
                verdicts = check_rules_at(op, r_args, r_kwargs, [(r, ws) for r, ws in plan if ws])
                # a rule no W can apply to is never used by DTensor here: keeping it is harmless
                drop = frozenset(v.rule.key() for v in verdicts if v.ok is not True)
    if key is not None:
        _verdicts[key] = drop
    return drop


def _as_rule(entry: list, n_in: int) -> SingleDimRule | None:
    ps = [from_torch_placement(p) for p in entry]
    if NotImplemented in ps or len(ps) <= n_in:
        return None
    k = len(ps) - n_in
    return SingleDimRule(tuple(ps[k:]), tuple(ps[:k]))


def _filtered_single_dim(op: Any, func: Callable, listed: frozenset) -> Callable:
    def filtered(op_: Any, args_schema: Any, kwargs_schema: Any) -> list:
        raw = func(op_, args_schema, kwargs_schema)
        n_in = sum(1 for x in leaves((args_schema, kwargs_schema)) if isinstance(x, TensorMeta))
        rules = [(entry, _as_rule(entry, n_in)) for entry in raw]
        watched = [r for _, r in rules if r is not None and format_rule(r) in listed]
        drop = _refuted_here(op, args_schema, kwargs_schema, watched)
        if drop:
            _warn_skip(op, [format_rule(r) for r in watched if r.key() in drop])
        return [entry for entry, r in rules if r is None or r.key() not in drop]

    filtered.__wrapped__ = func  # type: ignore[attr-defined]
    return filtered


def _spec_rules(spec: OpSpec) -> list[SingleDimRule] | None:
    """One single-dim rule per mesh dim of a full-mesh OpSpec; None if not expressible."""
    if spec.input_specs is None:
        return None
    outs = spec.output_specs if isinstance(spec.output_specs, (tuple, list)) else (spec.output_specs,)
    ndim = spec.input_specs[0].mesh.ndim if spec.input_specs else 0
    rules = []
    for d in range(ndim):
        ins = tuple(from_torch_placement(s.placements[d]) for s in spec.input_specs)
        os_ = tuple(None if s is None else from_torch_placement(s.placements[d]) for s in outs)
        if NotImplemented in ins or NotImplemented in os_:
            return None
        rules.append(SingleDimRule(ins, os_))
    return rules


def _filtered_op_strategy(op: Any, fn: Callable, listed: frozenset) -> Callable:
    def filtered(op_schema: Any) -> Any:
        strategy = fn(op_schema)
        if not isinstance(strategy, OpStrategy):
            return strategy
        per_spec = [(s, _spec_rules(s)) for s in strategy.strategies]
        watched = list({r.key(): r for _, rs in per_spec for r in (rs or ()) if format_rule(r) in listed}.values())
        drop = _refuted_here(op, op_schema.args_meta, op_schema.kwargs_meta, watched)
        if not drop:
            return strategy
        skipped = [format_rule(r) for r in watched if r.key() in drop]
        _warn_skip(op, skipped)
        kept = [s for s, rs in per_spec if rs is None or not any(r.key() in drop for r in rs)]
        if op._opname.endswith("_"):  # in place: `self` cannot change placement
            here = op_schema.args_strategy[0].strategies[0].output_spec.placements
            kept = [s for s in kept if s.input_specs and s.input_specs[0].placements == here]
            if not kept:
                raise RuntimeError(
                    f"decompshard guard: {op} in place on {tuple(here)} has only wrong strategies "
                    f"({', '.join(skipped)}); use the out-of-place op or redistribute first")
        if not kept:
            kept = [_replicated(op_schema, strategy)]
        return OpStrategy(kept)

    filtered.__wrapped__ = fn  # type: ignore[attr-defined]
    return filtered


def _replicated_read(op: Any) -> Callable:
    """A handler for an op DTensor runs on each rank's local part without asking any
    strategy (`_local_scalar_dense`: the sharding propagator special-cases it): the
    input is redistributed to Replicate first, so every rank reads the global value."""

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        x = args[0]
        if isinstance(x, DTensor) and not all(isinstance(p, TorchReplicate) for p in x.placements):
            _warn_once(f"read:{op}", (
                f"decompshard guard: {op}: DTensor would read each rank's own part of a "
                f"{tuple(x.placements)} tensor (`.item()` of a partial or sharded value); "
                f"redistributing to Replicate first"))
            x = x.redistribute(x.device_mesh, [TorchReplicate()] * x.device_mesh.ndim)
        local = x.to_local() if isinstance(x, DTensor) else x
        return op_call(local, *args[1:], **kwargs)

    return handler


def _replicated(op_schema: Any, strategy: OpStrategy) -> OpSpec:
    """All inputs and outputs Replicate: right for every op."""
    inputs = op_schema.args_strategy
    mesh = inputs[0].mesh
    rep = tuple(TorchReplicate() for _ in range(mesh.ndim))
    in_specs = [DTensorSpec(mesh, rep, tensor_meta=s.strategies[0].output_spec.tensor_meta) for s in inputs]
    sample = strategy.strategies[0].output_specs
    if isinstance(sample, (tuple, list)):
        out: Any = tuple(None if s is None else DTensorSpec(mesh, rep, tensor_meta=s.tensor_meta) for s in sample)
    else:
        out = DTensorSpec(mesh, rep, tensor_meta=sample.tensor_meta)
    return OpSpec(out, input_specs=in_specs,
                  redistribute_cost=[generate_redistribute_costs(s, sp) for s, sp in zip(inputs, in_specs)])


def _warn_mean_of_means(op: Any) -> None:
    _warn_once(f"mean-loss:{op}", (
        f"decompshard guard: {op}: DTensor's native strategy averages per-rank means (wrong when ranks hold "
        f"different numbers of counted targets or class weights); summing on each rank and dividing by the "
        f"all-reduced total weight instead"))


def _warn_skip(op: Any, rules: list[str]) -> None:
    _warn_once(f"rule:{op}", (
        f"decompshard guard: {op}: skipping DTensor's native rule(s) {', '.join(rules)}, wrong at these "
        f"shapes (numerical check); DTensor uses its next valid strategy"))
