"""Lift: from single-dim rules to the cheapest valid strategy on the user's N-D mesh.

A strategy picks one derived rule (or all-Replicate) per mesh dim. Its inputs must be
redistributed from their current placements to the rule's, which the cost model prices;
the cheapest *valid* strategy wins. Valid means, on the real mesh and shapes:

- an [even] rule is used only where every dim it shards splits evenly on that mesh dim
  (after the earlier mesh dims' sharding);
- the original op, run on each distinct set of local input shapes (meta kernel, original
  non-tensor arguments: what DTensor will run), succeeds and returns the local output
  shapes the strategy's output placements promise. This is what refuses pixel_shuffle on
  channels when a rank would hold fewer than upscale_factor**2 of them.

Placeholders S(d) become `Shard(d)`, or `_StridedShard(d, sf)` when the inputs already
carry that kind on that mesh dim (the rule holds for any sharding kind).

Candidates are costed first (one cost per input and target placement, memoized) and
checked for validity in cost order only as far as needed: `choose` stops at the first
valid one (`ranked`); `rank_strategies` checks them all, for explanations.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._compat import TorchPartial, TorchReplicate, TorchShard, TorchStridedShard
from .cost import H100, Cost, MeshShape, Topology, redistribute_cost
from .derive import derive_rules
from .dispatch_modes.clean import clean_dispatch_state
from .placements import MaybePlacement, Partial, R, ShardPlaceholder, SingleDimRule

TorchPlacement = Any
MAX_COMBOS = 4096  # strategies costed per call; beyond, rules are pre-filtered per mesh dim


@dataclass(frozen=True)
class MeshStrategy:
    rules: tuple[SingleDimRule, ...]  # one per mesh dim
    input_placements: tuple[tuple[TorchPlacement, ...], ...]  # per tensor input
    output_placements: tuple[tuple[TorchPlacement, ...] | None, ...]  # per output leaf
    cost: Cost
    valid: bool = True
    reason: str = ""

    def describe(self) -> str:
        rules = " | ".join(str(r) for r in self.rules)
        return f"[{rules}] cost {self.cost.total_seconds * 1e6:.2f} µs" + (
            "" if self.valid else f" (invalid: {self.reason})"
        )


def _fill(p: MaybePlacement, strided: dict[int, int]) -> TorchPlacement | None:
    if p is None:
        return None
    if isinstance(p, ShardPlaceholder):
        sf = strided.get(p.dim)
        return TorchStridedShard(p.dim, split_factor=sf) if sf else TorchShard(p.dim)
    if isinstance(p, Partial):
        return TorchPartial(p.reduce_op)
    return TorchReplicate()


def _strided_factors(rule: SingleDimRule, current_dim: Sequence[TorchPlacement]) -> dict[int, int]:
    """Split factors to keep when the inputs on this mesh dim are _StridedShard already.

    Only when every placeholder input of the rule matches a _StridedShard of one split
    factor: then the whole rule runs in that kind (placeholder semantics)."""
    factors = set()
    for p, cur in zip(rule.inputs, current_dim):
        if isinstance(p, ShardPlaceholder):
            if isinstance(cur, TorchStridedShard) and cur.dim == p.dim:
                factors.add(cur.split_factor)
            else:
                return {}
    if len(factors) != 1:
        return {}
    sf = factors.pop()
    dims = {p.dim for p in rule.inputs + rule.outputs if isinstance(p, ShardPlaceholder)}
    return {d: sf for d in dims}


def expand(rules: Sequence[SingleDimRule], current: Sequence[Sequence[TorchPlacement]]) -> tuple[tuple, tuple]:
    """(input placements per tensor input, output placements per output) for one
    rule per mesh dim."""
    n_in, n_out = len(rules[0].inputs), len(rules[0].outputs)
    ins = [[None] * len(rules) for _ in range(n_in)]
    outs: list[list | None] = [[None] * len(rules) for _ in range(n_out)]
    for m, rule in enumerate(rules):
        strided = _strided_factors(rule, [c[m] for c in current])
        for j, p in enumerate(rule.inputs):
            ins[j][m] = _fill(p, strided)
        for k, p in enumerate(rule.outputs):
            outs[k][m] = _fill(p, strided)
    out_t = tuple(None if any(p is None for p in o) else tuple(o) for o in outs)
    return tuple(tuple(i) for i in ins), out_t


def local_shape_nd(shape: Sequence[int], placements: Sequence[TorchPlacement], mesh: Sequence[int], coord: Sequence[int]) -> tuple[int, ...]:
    """The local shape on the rank at `coord`: torch.chunk layout, mesh dims in order."""
    if any(isinstance(p, TorchStridedShard) for p in placements):
        from ._compat import _compute_local_shape_and_global_offset
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # it builds small index tensors
            return tuple(_compute_local_shape_and_global_offset(tuple(shape), tuple(mesh), list(coord), list(placements))[0])
    out = list(shape)
    for p, n, c in zip(placements, mesh, coord):  # the fast path: plain Shard only
        if isinstance(p, TorchShard) and n > 1:
            d = p.dim % len(out)
            chunk = -(-out[d] // n)
            out[d] = max(0, min(chunk, out[d] - c * chunk))
    return tuple(out)


def ranked(
    op, args: tuple, kwargs: dict, mesh_shape: Sequence[int] | MeshShape,
    current: Sequence[Sequence[TorchPlacement]], topology: Topology = H100,
    accept: Callable[[tuple, Cost], bool] | None = None,
) -> Iterator[MeshStrategy]:
    """Candidate strategies cheapest first (those DTensor can redistribute to before those
    it cannot), each checked for validity only when reached. The first valid one is the
    choice: on a 4x4x4 mesh with 14 rules that is one check instead of 2744.
    `accept(input_placements, cost)` skips candidates before they are checked."""
    mesh = mesh_shape if isinstance(mesh_shape, MeshShape) else MeshShape(tuple(mesh_shape))
    derived = derive_rules(op, *args, **kwargs)
    tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    if len(current) != len(tensors) or any(len(c) != mesh.ndim for c in current):
        raise ValueError(
            f"need {mesh.ndim} placements for each of the {len(tensors)} tensor inputs"
        )
    trivial = SingleDimRule((R,) * len(tensors), _trivial_outputs(derived), source="implied")
    # Propagation's rules, not yet local-checked: each is checked only if a strategy
    # using it is reached (a first DTensor call checks a handful, not all).
    tentative = derived.tentative()
    per_dim = [_candidate_rules(tentative, trivial, current, m) for m in range(mesh.ndim)]
    memo: dict[tuple[int, tuple], Cost] = {}  # (tensor, target placements): its cost
    cands = []
    for order, combo in enumerate(itertools.product(*per_dim)):
        ins, outs = expand(combo, current)
        cost = Cost()
        for i, (t, src, dst) in enumerate(zip(tensors, current, ins)):
            c = memo.get((i, dst))
            if c is None:
                c = memo[(i, dst)] = redistribute_cost(tuple(t.shape), t.element_size(), tuple(src), dst, mesh, topology)
            cost = cost + c
        cands.append(((not cost.dtensor_supported, cost.sort_key(), order), combo, ins, outs, cost))
    cands.sort(key=lambda c: c[0])
    for _, combo, ins, outs, cost in cands:
        if accept is not None and not accept(ins, cost):
            continue
        checked = [derived.validated(r) for r in combo]
        if None in checked:
            bad = combo[checked.index(None)]
            yield MeshStrategy(tuple(combo), ins, outs, cost, False, f"rule {bad} fails the local-shape check")
            continue
        ins, outs = expand(checked, current)  # outputs may have become P(avg) [even]
        with clean_dispatch_state():  # meta kernels run on meta tensors, not the caller's
            reason = _invalid_reason(derived.op, args, kwargs, checked, ins, outs, tensors, mesh.sizes)
        yield MeshStrategy(tuple(checked), ins, outs, cost, not reason, reason)


def rank_strategies(
    op, args: tuple, kwargs: dict, mesh_shape: Sequence[int] | MeshShape,
    current: Sequence[Sequence[TorchPlacement]], topology: Topology = H100,
) -> list[MeshStrategy]:
    """Every candidate strategy, cheapest valid first (invalid ones last, with reasons)."""
    out = list(ranked(op, args, kwargs, mesh_shape, current, topology))
    out.sort(key=lambda s: not s.valid)  # stable: cost order within each group
    return out


def choose(op, args, kwargs, mesh_shape, current, topology: Topology = H100) -> MeshStrategy:
    """The cheapest valid strategy (all-Replicate is always valid, so one exists)."""
    return next(s for s in ranked(op, args, kwargs, mesh_shape, current, topology) if s.valid)


def _trivial_outputs(derived) -> tuple:
    if derived.graph is not None:
        return tuple(None if v is None else R for v in derived.graph.outputs)
    if derived.rules:
        return tuple(None if p is None else R for p in derived.rules[0].outputs)
    return (R,)


def _candidate_rules(rules, trivial, current, m: int) -> list[SingleDimRule]:
    """All rules, or when the product would explode, the ones closest to the current
    placements on this mesh dim (plus all-Replicate)."""
    cands = [trivial, *rules]
    n_dims = len(current[0]) if current else 1
    if len(cands) ** n_dims <= MAX_COMBOS:
        return cands
    keep = max(2, int(MAX_COMBOS ** (1 / n_dims)))

    def closeness(rule: SingleDimRule) -> int:
        return sum(_same_kind(p, c[m]) for p, c in zip(rule.inputs, current))

    return [trivial] + sorted(rules, key=closeness, reverse=True)[: keep - 1]


def _same_kind(p: MaybePlacement, cur: TorchPlacement) -> bool:
    if isinstance(p, ShardPlaceholder):
        return isinstance(cur, (TorchShard, TorchStridedShard)) and cur.dim == p.dim
    if isinstance(p, Partial):
        return isinstance(cur, TorchPartial) and cur.reduce_op == p.reduce_op
    return isinstance(cur, TorchReplicate)


def _invalid_reason(op, args, kwargs, combo, ins, outs, tensors, mesh: tuple[int, ...]) -> str:
    mixed = _mixed_partials(ins, outs)
    if mixed:
        return mixed
    if all(all(isinstance(p, TorchReplicate) for p in i) for i in ins):
        return ""  # everything replicated: the op runs as on one device
    for m, rule in enumerate(combo):
        if not rule.even_only:
            continue
        for t, pl in zip(tensors, ins):
            before = local_shape_nd(t.shape, pl[:m] + (TorchReplicate(),) * (len(mesh) - m), mesh, (0,) * len(mesh))
            p = pl[m]
            if isinstance(p, (TorchShard, TorchStridedShard)) and before[p.dim] % mesh[m]:
                return f"rule {rule} on mesh dim {m} needs even shards; dim {p.dim} of size {before[p.dim]} does not split over {mesh[m]}"
    return _meta_check(op, args, kwargs, ins, outs, tensors, mesh)


def _mixed_partials(ins, outs) -> str:
    """DTensor refuses a placement list that mixes Partial reduce ops across mesh dims
    (`[Partial(sum), Partial(max)]`: the order of reductions would change the value), so
    a strategy that needs one, as an input target or an output, cannot run."""
    for kind, rows in (("input", ins), ("output", outs)):
        for j, row in enumerate(rows):
            ops = {p.reduce_op for p in row or () if isinstance(p, TorchPartial)}
            if len(ops) > 1:
                return f"{kind} {j} would mix Partial reduce ops {sorted(ops)} across mesh dims"
    return ""


def _meta_check(op, args, kwargs, ins, outs, tensors, mesh) -> str:
    """Run the original op's meta kernel on every distinct set of local input shapes."""
    flat, spec = tree_flatten((args, kwargs))
    out_global = _global_outputs(op, args, kwargs)
    seen = set()
    for coord in itertools.product(*(range(s) for s in mesh)):
        shapes = tuple(local_shape_nd(t.shape, pl, mesh, coord) for t, pl in zip(tensors, ins))
        try:
            want = tuple(
                None if o is None or g is None else local_shape_nd(g, o, mesh, coord)
                for g, o in zip(out_global, outs)
            )
        except (IndexError, ValueError, RuntimeError, AssertionError) as e:
            # the decomposition's output is not the op's (e.g. torch's sdpa-for-cpu
            # decomposition returns the attention weights where the op returns logsumexp)
            return f"the output placements {outs} do not fit the op's real outputs {out_global}: {e}"
        if (shapes, want) in seen:
            continue
        seen.add((shapes, want))
        it = iter(shapes)
        local_flat = [
            torch.empty(next(it), dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x
            for x in flat
        ]
        la, lk = tree_unflatten(local_flat, spec)
        try:
            result = op(*la, **lk)
        except Exception as e:
            line = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
            return f"the op fails on rank {list(coord)}'s local shapes {[list(s) for s in shapes]}: {line}"
        got = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in tree_flatten(result)[0]]
        for g, w in zip(got, want):
            if w is not None and g != w:
                return f"on rank {list(coord)} the op returns local shape {list(g)}, the strategy needs {list(w)}"
    return ""


def _global_outputs(op, args, kwargs) -> list:
    flat, spec = tree_flatten((args, kwargs))
    meta = [
        torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x
        for x in flat
    ]
    a, k = tree_unflatten(meta, spec)
    res = op(*a, **k)
    return [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in tree_flatten(res)[0]]
