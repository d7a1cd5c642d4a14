"""The one place that decides where a primitive's rules come from.

Lookup order: torch's single-dim strategies, then torch's op strategies on a fake 1-rank
mesh, then decompshard's own rules. The first source that knows the op wins; the
all-Replicate rule is always added (every op can run fully replicated), and so are
decompshard's extra rules for ops torch under-serves (Partial through pure data movement), and
last the rules for strided shards that may reach the node (rules/strided.py). Results are
cached per (op, input metadata, non-tensor args, input signs, strided kinds): a training
loop pays once.
"""

from __future__ import annotations

import torch

from decompshard import caches
from decompshard.dispatch_modes.graph import PrimNode, freeze
from decompshard.placements import P, Partial, R, ShardPlaceholder, SingleDimRule, StridedShard, is_strided
from decompshard.rules import project_rules, strided, torch_op_strategy, torch_single_dim, torch_tables

SOURCES = (torch_single_dim, torch_op_strategy, project_rules)
_TORCH_SOURCES = (torch_single_dim, torch_op_strategy)  # answered by shape class (torch_tables)
_UNCONDITIONAL_SOURCES = (project_rules.SOURCE, project_rules.UNEVEN_SOURCE)


def has_rule(op: torch._ops.OpOverload) -> bool:
    """A primitive for the tracer: some source has rules for it (else decompose it)."""
    return any(src.has_rules(op) for src in SOURCES)


def source_of(op: torch._ops.OpOverload) -> str | None:
    for src in SOURCES:
        if src.has_rules(op):
            return src.SOURCE
    return None


_CACHE = caches.RULE_TABLES  # a bounded LRU (decompshard/caches.py)


def rules_for(node: PrimNode) -> tuple[SingleDimRule, ...]:
    """The node's rule table, all-Replicate first, duplicates removed."""
    try:
        key = (node.op, freeze((node.args, node.kwargs)), len(node.inputs), len(node.outputs), node.in_signs,
               node.strided_in)
        hash(key)
    except TypeError:  # an unhashable non-tensor arg: compute without caching
        return _compute_rules(node)
    hit = _CACHE.get(key)
    if hit is None:
        hit = _CACHE.put(key, _compute_rules(node))
    return hit


def _compute_rules(node: PrimNode) -> tuple[SingleDimRule, ...]:
    n_in, n_out = len(node.inputs), len(node.outputs)
    trivial = SingleDimRule((R,) * n_in, tuple(R if v is not None else None for v in node.outputs), source="implied")
    found: list[SingleDimRule] = []
    for src in SOURCES:
        if not src.has_rules(node.op):
            continue
        got = torch_tables.torch_rules(src, node) if src in _TORCH_SOURCES else src.rules(node)
        if got is not None:
            found = got
            break
    in_metas = node.input_metas()
    found = [_even_if_averaging_shards(r) for r in found]
    found += [a for r in found if (a := _avg_twin(r, in_metas)) is not None]
    found += project_rules.extra_rules(node)
    # A view's exact rules (rules/strided.py) go before torch's where they differ: torch's
    # view strategy keeps a flattened shard plain S(d), which is right for even shards
    # only, and the solver keeps the first of two paths that meet again.
    exact = strided.view_rules(node)
    if exact:
        found = [r for r in exact if any(is_strided(p) for p in r.outputs)] + found + exact
    fits = _Fit(in_metas, node)
    seen = {trivial.key(): 0}  # rule identity -> index in table
    table = [trivial]
    for rule in found:
        if len(rule.inputs) != n_in or len(rule.outputs) != n_out or not fits(rule):
            continue
        key = (rule.inputs, rule.outputs)
        at = seen.get(key)
        if at is None:
            seen[key] = len(table)
            table.append(rule)
        elif table[at].even_only and not rule.even_only and rule.source in _UNCONDITIONAL_SOURCES:
            # decompshard's own rule holds for uneven shards where torch's table did not
            # say so (it reads as [even]): the same rule, at the same index, unconditional
            table[at] = rule
    for rule in strided.kind_rules(node, table):  # last: the plain rules keep their indices
        if rule.key() not in seen:
            seen[rule.key()] = len(table)
            table.append(rule)
    return tuple(table)


class _Fit:
    """Whether a rule fits the node's tensors, with the node's ranks and the Partials its
    output dtypes refuse worked out once per table, not per rule:

    - S(d) must name a dim the tensor has (a strategy written for another overload or
      output rank can say otherwise); such a rule is dropped, not trusted.
    - A bool can't hold a sum (True+True is not True), an integer can't hold an exact
      average, and complex numbers have no max/min: such Partial outputs are refused."""

    def __init__(self, in_metas: list, node: PrimNode) -> None:
        self.in_ranks = [len(m.shape) for m in in_metas]
        self.out_ranks = [None if m is None else len(m.shape) for m in node.out_metas]
        self.refused = [_refused_partials(m) for m in node.out_metas]

    def __call__(self, rule: SingleDimRule) -> bool:
        for p, nd in zip(rule.inputs, self.in_ranks):
            if isinstance(p, _SHARDS) and p.dim >= nd:
                return False
        for p, nd, refused in zip(rule.outputs, self.out_ranks, self.refused):
            if isinstance(p, _SHARDS):
                if nd is None or p.dim >= nd:
                    return False
            elif refused and isinstance(p, Partial) and p.reduce_op in refused:
                return False
        return True


_SHARDS = (ShardPlaceholder, StridedShard)


def _refused_partials(meta) -> frozenset[str]:
    """The Partial reduce ops an output of this dtype cannot hold (see _Fit)."""
    if meta is None:
        return frozenset()
    dt = meta.dtype
    out = set()
    if dt == torch.bool:
        out |= {"sum", "avg"}
    if not (dt.is_floating_point or dt.is_complex):
        out.add("avg")
    if dt.is_complex:
        out |= {"max", "min"}
    return frozenset(out)


def _even_if_averaging_shards(rule: SingleDimRule) -> SingleDimRule:
    """A rule that turns a Shard input into a P(avg) output (a mean over a sharded dim)
    averages per-rank means: exact only when every rank holds the same number of
    elements. Torch's strategies state it unconditionally; we attach the condition."""
    if rule.even_only:
        return rule
    sharded = False
    for p in rule.inputs:
        if isinstance(p, Partial):
            return rule
        if isinstance(p, _SHARDS):
            sharded = True
    if sharded and _AVG in rule.outputs:
        return SingleDimRule(rule.inputs, rule.outputs, even_only=True, source=rule.source)
    return rule


def _avg_twin(rule: SingleDimRule, metas: list) -> SingleDimRule | None:
    """P(sum) in -> P(sum) out claims additivity, and an additive map commutes with the
    1/W of an average, so the same rule holds with every P(sum) read as P(avg). Torch
    lists this for some ops (mul) and omits it for others (sum, mv).

    Only when no input is sharded: in `P(sum), S(1), S(0) -> P(sum)` (addmm) the sharded
    contraction itself makes a sum over ranks, which no reading turns into an average."""
    has_sum = False
    for p in rule.inputs:
        if isinstance(p, Partial):
            if p.reduce_op != "sum":
                return None
            has_sum = True
        elif isinstance(p, _SHARDS):
            return None
    if not has_sum or not rule.outputs:
        return None
    for p in rule.outputs:
        if p is not None and not (isinstance(p, Partial) and p.reduce_op == "sum"):
            return None
    if len(metas) != len(rule.inputs) or any(
        not (m.dtype.is_floating_point or m.dtype.is_complex)
        for m, p in zip(metas, rule.inputs) if p == _SUM
    ):
        return None
    swap = lambda ps: tuple(_AVG if p == _SUM else p for p in ps)  # noqa: E731
    return SingleDimRule(swap(rule.inputs), swap(rule.outputs), rule.even_only, rule.source + " (avg twin)")


_SUM, _AVG = P("sum"), P("avg")


def clear_cache() -> None:
    _CACHE.clear()
    torch_tables.clear_cache()
