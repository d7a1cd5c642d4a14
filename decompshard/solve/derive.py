"""derive_rules: the one entry point from an op and its arguments to verified-by-construction
single-dim rules.

    trace (once per op + metadata)  ->  propagate over the alphabet  ->  local-shape check

Both the trace and the result are cached per (op, input metadata, non-tensor args), so
DTensor's dispatch, the coverage sweep and `explain` all pay the derivation once.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from decompshard import caches
from decompshard.solve import localcheck
from decompshard.op_names import resolve_op
from decompshard._compat import has_native_strategy, op_strategy_func, single_dim_strategy_info
from decompshard.dispatch_modes import trace
from decompshard.dispatch_modes.clean import clean_dispatch_state
from decompshard.dispatch_modes.graph import PrimGraph, freeze, leaves, map_leaves
from decompshard.dispatch_modes.tracing import tensor_meta
from decompshard.errors import UnsupportedOp
from decompshard.solve.localcheck import check_local
from decompshard.placements import MaybePlacement, P, R, SingleDimRule, format_placement, format_rule, is_partial
from decompshard.solve.propagate import Propagation, Survivor, propagate
from decompshard.rules import has_rule, project_rules, rules_for, torch_op_strategy, torch_single_dim
from decompshard.rules.project_rules import value_checked_inputs

OpOverload = torch._ops.OpOverload


@dataclass(frozen=True)
class RejectedCandidate:
    """A candidate that needed redistribution somewhere, and where."""

    inputs: tuple[MaybePlacement, ...]  # None: not decided when it died
    reason: str
    node: int | None = None

    def __str__(self) -> str:
        ins = ", ".join("*" if p is None else format_placement(p) for p in self.inputs)
        return f"{ins}: {self.reason}"


@dataclass
class DerivedRules:
    """The op's rules. Propagation runs at once; the local-shape check (the expensive
    part: it re-traces at local shapes) runs for all candidates the first time `.rules`
    or `.rejected` is read, or for one candidate at a time through `validated()` — which
    is what DTensor's first call uses, so it only checks the rules it is about to use."""

    op: OpOverload
    unsupported_reason: str | None = None
    seconds: float = 0.0
    # Where DTensor's own strategy for this op comes from, if it has one. DTensor then
    # never asks decompshard (enable() only serves ops without one); the rules here are
    # what the decomposition yields, for comparison (`native_rules` gives DTensor's own).
    native: str | None = None
    graph: PrimGraph | None = field(default=None, repr=False)
    _rejected: list[RejectedCandidate] = field(default_factory=list, repr=False)
    _survivors: dict[tuple, list[Survivor]] = field(default_factory=dict, repr=False)
    _verdicts: dict[tuple, SingleDimRule | None] = field(default_factory=dict, repr=False)
    _rules: list[SingleDimRule] | None = field(default=None, repr=False)
    _context: tuple | None = field(default=None, repr=False)
    # a local check timed out (localcheck.timeouts): a verdict that says nothing about the
    # op, so the next derive_rules call derives again instead of reusing this result
    indeterminate: bool = field(default=False, repr=False)

    @property
    def rules(self) -> list[SingleDimRule]:
        if self._rules is None:
            start = time.perf_counter()
            found = [r for key in self._survivors if (r := self._validate(key)) is not None]
            self._rules = sorted(_drop_implied(found), key=_rule_order)
            self.seconds += time.perf_counter() - start
        return self._rules

    @property
    def rejected(self) -> list[RejectedCandidate]:
        self.rules  # noqa: B018 - local-check refusals join the list once validated
        return self._rejected

    def tentative(self) -> list[SingleDimRule]:
        """Rules as propagation found them, before the local-shape check (which may refuse
        one, or turn P(sum) into P(avg) [even]). Validate with `validated()`."""
        return [
            SingleDimRule(c.inputs, c.outputs, c.even_only, "tentative")
            for cands in self._survivors.values() for c in cands[:1]
        ]

    def validated(self, rule: SingleDimRule) -> SingleDimRule | None:
        """The checked version of a tentative rule, or None if the local check refuses it."""
        key = (rule.inputs, rule.outputs)
        if key not in self._survivors:
            return rule if rule.is_trivial() else None
        return self._validate(key)

    def surely_even(self, rule: SingleDimRule) -> bool:
        """Whether `validated(rule)` is certain to be [even] or refused, without running
        the local-shape check: every path propagation found for it is [even] already
        (the check only ever adds the condition). The lift uses it to drop strategies
        that put such a rule on a dim that cannot split evenly before checking them."""
        key = (rule.inputs, rule.outputs)
        if key in self._verdicts:
            verdict = self._verdicts[key]
            return verdict is None or verdict.even_only
        survivors = self._survivors.get(key)
        return bool(survivors) and all(c.even_only for c in survivors)

    def _validate(self, key: tuple) -> SingleDimRule | None:
        if key in self._verdicts:
            return self._verdicts[key]
        meta_args, meta_kwargs, value_checked = self._context
        timeouts = localcheck.timeouts()
        trace_at = lambda a, k: traced_for_check(self.op, a, k)  # noqa: E731
        best = None
        for cand in self._survivors[key]:  # same rule reached through different paths
            # traces and kernels run only for a sharded candidate: keep a caller's modes out
            with clean_dispatch_state() if cand.sharded else contextlib.nullcontext():
                verdict = check_local(self.graph, cand, meta_args, meta_kwargs, trace_at)
            if not verdict.ok:
                self._rejected.append(RejectedCandidate(cand.inputs, verdict.reason))
                continue
            if any(is_partial(p) for i, p in enumerate(cand.inputs) if i in value_checked):
                self._rejected.append(RejectedCandidate(
                    cand.inputs, "the kernel validates this input's values; a Partial part may fail it"))
                continue
            rule = SingleDimRule(cand.inputs, verdict.outputs, verdict.even_only, verdict.reason or "derived")
            if best is None or (best.even_only and not rule.even_only):
                best = rule
        self.indeterminate |= localcheck.timeouts() != timeouts
        self._verdicts[key] = best
        return best

    def as_strings(self) -> list[str]:
        return [format_rule(r) for r in self.rules]

    def __len__(self) -> int:
        return len(self.rules)

    def __iter__(self):
        return iter(self.rules)

    def __str__(self) -> str:
        from tabulate import tabulate

        head = f"{self.op}: "
        if self.native:  # two short lines: explain --all indents this table
            head = (f"note: DTensor uses its own strategy for {self.op} ({self.native});\n"
                    f"these rules are derived from its decomposition, for comparison.\n{head}")
        if self.unsupported_reason:
            return head + f"unsupported: {self.unsupported_reason}"
        if not self.rules:
            return head + "replicate-only (no non-trivial rule survives)"
        rows = [(format_rule(r).split(" -> ")[0], format_rule(r).split(" -> ")[1], r.source) for r in self.rules]
        table = tabulate(rows, headers=["inputs", "outputs", "note"], tablefmt="simple")
        return head + f"{len(self.rules)} rules (all-Replicate implied)\n{table}"

    __repr__ = __str__


# ------------------------------------------------------------------------ caches

# Both bounded LRUs (caches.py): a job that meets an op at many shapes keeps the latest.
_TRACES = caches.TRACES
_DERIVED = caches.DERIVED


def _key(op: OpOverload, args: tuple, kwargs: dict) -> Any:
    """The cache key; raises UnsupportedOp for a tensor decompshard cannot trace (one walk
    over the arguments serves both: this runs on every call, cache hits included)."""
    return (op, freeze(map_leaves(_key_leaf, (args, kwargs))))


def _key_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        odd = _unsupported_tensor(x)
        if odd is not None:
            raise UnsupportedOp(odd)
        return tensor_meta(x)
    return _hashable(x)


def _hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return repr(x)


def traced(op: OpOverload, args: tuple, kwargs: dict) -> PrimGraph:
    """The op's PrimGraph at these shapes (cached; raises UnsupportedOp)."""
    key = _key(op, args, kwargs)
    return _cached_trace(key, op, args, kwargs, shapes_only=False)


def traced_for_check(op: OpOverload, args: tuple, kwargs: dict) -> PrimGraph:
    """The op's graph at these (local) shapes for the local-shape check: the full trace
    if one is cached, else a shapes-only one (tracing.trace(shapes_only=True), about
    half the cost), cached under its own key so it never serves as a global graph."""
    key = _key(op, args, kwargs)
    full = _TRACES.get(key)
    if full is not None:
        return _or_raise(full)
    return _cached_trace(("shapes only", key), op, args, kwargs, shapes_only=True)


def _cached_trace(key: Any, op: OpOverload, args: tuple, kwargs: dict, shapes_only: bool) -> PrimGraph:
    hit = _TRACES.get(key)
    if hit is None:
        try:
            hit = trace(op, args, kwargs, has_rule, shapes_only=shapes_only)
        except UnsupportedOp as e:
            hit = e
        _TRACES.put(key, hit)
    return _or_raise(hit)


def _or_raise(hit: PrimGraph | UnsupportedOp) -> PrimGraph:
    if isinstance(hit, UnsupportedOp):
        raise hit
    return hit


def clear_caches() -> None:
    """Forget every trace, derived rule set and primitive rule table (cold timings)."""
    caches.clear_all()


# ------------------------------------------------------------------------ derive


def derive_rules(op: OpOverload | str, *args: Any, **kwargs: Any) -> DerivedRules:
    """The op's derived single-mesh-dim rules for these (real, meta or fake) arguments.

    Raises ValueError for a malformed or unknown op name; an op that cannot be derived
    returns an empty rule set with `unsupported_reason` set. The local-shape check runs
    when `.rules` is first read (see DerivedRules).
    """
    op = resolve_op(op)
    try:
        key = _key(op, args, kwargs)
    except UnsupportedOp as e:  # a tensor with no metadata to key a cache on: say so, each time
        return DerivedRules(op, unsupported_reason=e.reason, native=native_source(op), _rules=[])
    hit = _DERIVED.get(key)
    if hit is not None and not hit.indeterminate:
        return hit
    start = time.perf_counter()
    result = DerivedRules(op, native=native_source(op))
    with clean_dispatch_state():  # a caller's FakeTensorMode/LocalTensorMode stays out
        try:
            result.graph = traced(op, args, kwargs)
        except UnsupportedOp as e:
            result.unsupported_reason = e.reason
            result._rules = []
        else:
            _solve(result, args, kwargs)
    result.seconds = time.perf_counter() - start
    _DERIVED.put(key, result)
    return result


def unsupported_inputs(args: tuple, kwargs: dict) -> str | None:
    """Why these tensors are outside what decompshard derives for, or None. DTensor
    shards dense strided tensors; a nested, quantized or sparse tensor has no strides
    (or no meta form) to trace with, and torch's own error would come from deep inside."""
    return next(
        (odd for x in leaves((args, kwargs)) if isinstance(x, torch.Tensor) and (odd := _unsupported_tensor(x))),
        None,
    )


def _unsupported_tensor(x: torch.Tensor) -> str | None:
    if x.is_nested:
        kind = "nested"
    elif x.is_quantized:
        kind = "quantized"
    elif x.layout != torch.strided:
        kind = str(x.layout)
    else:
        return None
    return f"{kind} tensors: decompshard derives rules for dense strided tensors only"


def native_source(op: OpOverload) -> str | None:
    """The kind of strategy DTensor has registered for `op` itself, or None."""
    if single_dim_strategy_info(op) is not None:
        return "torch single-dim strategy"
    if op_strategy_func(op) is not None:
        return "torch op strategy"
    return "torch legacy sharding rule" if has_native_strategy(op) else None


def native_rules(op: OpOverload | str, *args: Any, **kwargs: Any) -> list[SingleDimRule] | None:
    """DTensor's own single-dim rules for `op` at these arguments, as decompshard reads
    them (the same rule sources the primitives use), all-Replicate first; None if the op
    has no strategy decompshard can read. `explain` shows them next to the derivation,
    so nobody debugs a native op through a decomposition DTensor never runs."""
    op = resolve_op(op)
    if single_dim_strategy_info(op) is None and op_strategy_func(op) is None:
        return None  # no strategy at all, or a legacy rule decompshard cannot read
    with clean_dispatch_state():
        try:  # the op itself as the one "primitive" of its own graph
            graph = trace(op, args, kwargs, lambda _: True, decomp=op)
        except UnsupportedOp:
            return None
    if len(graph.nodes) != 1:
        return None
    # only torch's own rules: not the twins and extras decompshard adds to primitives
    return [r for r in rules_for(graph.nodes[0]) if r.source in _TORCH_SOURCES]


_TORCH_SOURCES = {"implied", torch_single_dim.SOURCE, torch_op_strategy.SOURCE, project_rules.UNEVEN_SOURCE}


def _solve(result: DerivedRules, args: tuple, kwargs: dict) -> None:
    """Propagate now; keep the survivors for (lazy) local-shape checking."""
    graph = result.graph
    prop = propagate(graph, rules_for)
    result._rejected.extend(_rejections(graph, prop))
    meta_args, meta_kwargs = map_leaves(
        lambda x: torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
        if isinstance(x, torch.Tensor) else x,
        (args, kwargs),
    )
    result._context = (meta_args, meta_kwargs, value_checked_inputs(graph.op))
    in_place = writes_self(graph.op)
    for cand in prop.survivors:
        if all(p is None or p == R for p in cand.inputs):
            continue  # all-Replicate inputs: the op just runs replicated
        if in_place and cand.inputs[0] != cand.outputs[0]:
            result._rejected.append(RejectedCandidate(cand.inputs, "an in-place op's self must keep its placement"))
            continue
        result._survivors.setdefault((cand.inputs, cand.outputs), []).append(cand)


def writes_self(op: OpOverload) -> bool:
    """An in-place op (`index_add_`, `tril_`): it writes its first argument and returns it.

    Its result is `self` itself, so a rule must leave `self`'s placement as it came:
    `index_add_(R, R, P(avg)) -> P(avg)` has the right reduced values, but it leaves a
    tensor labelled Replicate holding different values on each rank."""
    schema = op._schema
    first = schema.arguments[0].alias_info if schema.arguments else None
    ret = schema.returns[0].alias_info if len(schema.returns) == 1 else None
    return bool(first is not None and first.is_write and ret is not None and ret.is_write)


_WEAKER_THAN_R = {P("avg"), P("max"), P("min")}


def _drop_implied(rules) -> list[SingleDimRule]:
    """Drop rules that say nothing new: all-Replicate inputs (the op can just run
    replicated), and an output P(avg|max|min) where the same inputs give R (identical
    copies satisfy those trivially; R is strictly more useful)."""
    rules = [r for r in rules if any(p is not None and p != R for p in r.inputs)]
    by_inputs: dict[tuple, list[SingleDimRule]] = {}
    for r in rules:  # only rules with the same inputs compare: linear in the rule count
        by_inputs.setdefault(r.inputs, []).append(r)

    def dominated(b: SingleDimRule, a: SingleDimRule) -> bool:
        return a is not b and a.even_only <= b.even_only and all(
            x == y or (x == R and y in _WEAKER_THAN_R) for x, y in zip(a.outputs, b.outputs)
        )

    return [b for b in rules if not any(dominated(b, a) for a in by_inputs[b.inputs])]


def _rejections(graph: PrimGraph, prop: Propagation) -> list[RejectedCandidate]:
    out = []
    for rej in prop.rejections:
        if rej.node < 0:
            out.append(RejectedCandidate(rej.inputs, "placement not allowed for this input"))
            continue
        node = graph.nodes[rej.node]
        arriving = ", ".join("?" if p is None else format_placement(p) for p in rej.arriving)
        reason = rej.reason or f"no rule of node {rej.node} ({node.op}) accepts ({arriving})"
        out.append(RejectedCandidate(rej.inputs, reason, rej.node))
    return out


def _rule_order(rule: SingleDimRule) -> tuple:
    def rank(p: MaybePlacement) -> tuple:
        s = format_placement(p)
        return ({"R": 0, "S": 1, "P": 2, "N": 3}[s[0]], s)

    return (tuple(rank(p) for p in rule.inputs), tuple(rank(p) for p in rule.outputs), rule.even_only)
