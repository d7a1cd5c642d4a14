"""Rule source 2: torch's full-mesh op strategies, queried on a fake 1-rank mesh.

About 160 ops (views, reshapes, reductions, cat...) have only an OpStrategy function,
which answers "given these input placements, what can I run?". We ask it once per
single-input candidate (and once with every input on the same candidate) and keep each
returned (input specs -> output specs) pair: on a 1-rank mesh every such pair is a
redistribution-free rule. Pairs involving _StridedShard are dropped: they say "Shard in,
strided shard out", which a placeholder rule cannot express.
"""

from __future__ import annotations

from typing import Any

from decompshard._compat import DTensorSpec, OpSchema, OpSpec, OpStrategy, TensorMeta, TupleStrategy, fake_one_rank_mesh, op_strategy_func
from decompshard.torch_placements import from_torch_placement, to_torch_placement
from decompshard.dispatch_modes.graph import PrimNode
from decompshard.placements import R, SingleDimRule, alphabet

SOURCE = "torch op strategy"


def has_rules(op) -> bool:
    return op_strategy_func(op) is not None


def _schema(node: PrimNode, placements: tuple) -> OpSchema:
    mesh = fake_one_rank_mesh()
    it = iter(placements)

    def conv(x: Any) -> Any:
        if isinstance(x, TensorMeta):
            spec = DTensorSpec(mesh, (to_torch_placement(next(it)),), tensor_meta=x)
            return OpStrategy([OpSpec(spec)])
        if isinstance(x, (list, tuple)) and any(isinstance(y, TensorMeta) for y in x):
            return TupleStrategy([conv(y) for y in x])
        return x

    args = tuple(conv(a) for a in node.args)
    kwargs = {k: conv(v) for k, v in node.kwargs.items()}
    return OpSchema(node.op, args, kwargs)


def _candidates(node: PrimNode, metas: list[TensorMeta]) -> list[tuple]:
    alphabets = [alphabet(len(m.shape), partials=m.dtype.is_floating_point) for m in metas]
    base = tuple(R for _ in metas)
    cands = {base}
    for i, alph in enumerate(alphabets):
        for p in alph:
            cands.add(base[:i] + (p,) + base[i + 1 :])
    if len({len(m.shape) for m in metas}) == 1:
        for p in alphabets[0]:
            cands.add(tuple(p for _ in metas))
    return sorted(cands, key=str)


def rules(node: PrimNode) -> list[SingleDimRule] | None:
    fn = op_strategy_func(node.op)
    if fn is None:
        return None
    metas = node.input_metas()
    n_out = len(node.outputs)
    found: dict[tuple, SingleDimRule] = {}
    for cand in _candidates(node, metas):
        try:
            strategy = fn(_schema(node, cand))
        except Exception:
            continue  # this candidate is not accepted by the strategy at all
        for spec in getattr(strategy, "strategies", ()):
            rule = _to_rule(spec, n_out)
            if rule is not None:
                found.setdefault(rule.key(), rule)
    return list(found.values())


def _to_rule(spec: OpSpec, n_out: int) -> SingleDimRule | None:
    if spec.input_specs is None:
        return None
    ins = tuple(from_torch_placement(s.placements[0]) for s in spec.input_specs)
    outs_spec = spec.output_specs
    if isinstance(outs_spec, (tuple, list)):
        outs = tuple(None if s is None else from_torch_placement(s.placements[0]) for s in outs_spec)
    else:
        outs = (from_torch_placement(outs_spec.placements[0]),) * n_out
    if NotImplemented in ins or NotImplemented in outs or len(outs) != n_out:
        return None
    return SingleDimRule(ins, outs, source=SOURCE)
