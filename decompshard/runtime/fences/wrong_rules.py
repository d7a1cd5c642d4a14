"""The fix for rules in DTensor's strategy tables that are wrong (`any(P(sum)) -> P(sum)`, say).

The guard wraps the op's entry in whichever strategy table holds it and drops a listed
rule where the numerical checker (`verify.check_rules_at`, on random data of the shapes
at hand, at the world sizes where DTensor would apply it) refutes it there; DTensor then
picks its next valid strategy (all-Replicate at worst: always right). A rule wrong only
for some arguments (threshold's P(max) holds when value <= threshold) or some shapes (an
empty shard) is skipped only there. At shapes too large to check quickly, or that the
checker cannot build data for, a listed rule is dropped unchecked: skipping a right rule
costs communication, using a wrong one costs the training run.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from decompshard._compat import DTensorSpec, OpSpec, OpStrategy, TensorMeta, TorchReplicate, generate_redistribute_costs
from decompshard.dispatch_modes.clean import clean_dispatch_state
from decompshard.dispatch_modes.graph import freeze, leaves, map_leaves
from decompshard.placements import SingleDimRule, format_rule
from decompshard.runtime.records import Fix
from decompshard.torch_placements import from_torch_placement
from decompshard.runtime.table_patches import WarnOnce
from decompshard.verify.native_rules import world_sizes_for
from decompshard.verify.rule_check import check_rules_at

__all__ = ["CHECK_LIMIT", "FIX", "forget_verdicts"]

CHECK_LIMIT = 1 << 18  # input elements up to which a listed rule is checked at the shapes at hand

_verdicts: dict[tuple, frozenset] = {}


def forget_verdicts() -> None:
    """Verdicts belong to one installation of the guard."""
    _verdicts.clear()


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


def _filtered_single_dim(op: Any, func: Callable, listed: frozenset, warn: WarnOnce) -> Callable:
    def filtered(op_: Any, args_schema: Any, kwargs_schema: Any) -> list:
        raw = func(op_, args_schema, kwargs_schema)
        n_in = sum(1 for x in leaves((args_schema, kwargs_schema)) if isinstance(x, TensorMeta))
        rules = [(entry, _as_rule(entry, n_in)) for entry in raw]
        watched = [r for _, r in rules if r is not None and format_rule(r) in listed]
        drop = _refuted_here(op, args_schema, kwargs_schema, watched)
        if drop:
            _warn_skip(warn, op, [format_rule(r) for r in watched if r.key() in drop])
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


def _filtered_op_strategy(op: Any, fn: Callable, listed: frozenset, warn: WarnOnce) -> Callable:
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
        _warn_skip(warn, op, skipped)
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


def _warn_skip(warn: WarnOnce, op: Any, rules: list[str]) -> None:
    warn(f"rule:{op}", (
        f"decompshard guard: {op}: skipping DTensor's native rule(s) {', '.join(rules)}, wrong at these "
        f"shapes (numerical check); DTensor uses its next valid strategy"))


FIX = Fix("the listed rules dropped where the numerical checker refutes them at the call's shapes",
          single=lambda op, fence, warn, func: _filtered_single_dim(op, func, frozenset(fence.args), warn),
          full=lambda op, fence, warn, fn: _filtered_op_strategy(op, fn, frozenset(fence.args), warn))
