"""Rule source 3: rules decompshard writes itself, for primitives torch has none for.

Keep each entry small and obviously right; every one is checked numerically by the
tests (tests/test_project_rules.py) like any derived rule.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..dispatch_modes.graph import PrimNode
from ..placements import PARTIALS, R, SingleDimRule, ShardPlaceholder

SOURCE = "decompshard"
aten = torch.ops.aten


def _same_placement_passthrough(node: PrimNode) -> list[SingleDimRule]:
    """Ops that copy values elementwise without changing the layout (clone-like):
    every placement passes through unchanged."""
    meta = node.args[0]
    out = [SingleDimRule((ShardPlaceholder(d),), (ShardPlaceholder(d),), source=SOURCE) for d in range(len(meta.shape))]
    out += [SingleDimRule((p,), (p,), source=SOURCE) for p in PARTIALS]
    return out


_RULES: dict[torch._ops.OpOverload, Callable[[PrimNode], list[SingleDimRule]]] = {
    aten.lift_fresh.default: _same_placement_passthrough,
    aten.alias.default: _same_placement_passthrough,
}


# Pure data movement: every output element is a copy of one input element (or the op
# only relabels the layout), so reduce(parts) commutes with it for every reduce op.
# Torch's strategies for several of these omit Partial (clone keeps only Shard, say).
_PARTIAL_PASSTHROUGH = {
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
    aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.permute.default, aten.transpose.int, aten.t.default,
    aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.expand.default, aten.select.int, aten.slice.Tensor, aten.narrow.default,
    aten.diagonal.default, aten.diagonal_copy.default, aten.flip.default, aten.roll.default,
    aten.unfold.default, aten.as_strided.default, aten.index_select.default,
    aten.gather.default, aten.repeat.default, aten.rot90.default,
    aten.permute_copy.default, aten.transpose_copy.int, aten.t_copy.default,
    aten.unsqueeze_copy.default, aten.squeeze_copy.default, aten.squeeze_copy.dim,
    aten.alias_copy.default, aten.view_copy.default, aten.expand_copy.default,
    aten.narrow_copy.default, aten.unfold_copy.default, aten.lift_fresh.default,
}


def extra_rules(node: PrimNode) -> list[SingleDimRule]:
    """Rules added on top of whichever source answered (never replacing it).

    Only the first tensor input may be Partial; every other tensor input (an index,
    say) must be Replicate, and every output gets the same Partial.
    """
    if node.op not in _PARTIAL_PASSTHROUGH or not node.inputs or not node.args:
        return []
    meta = node.args[0]
    if not hasattr(meta, "dtype") or not (meta.dtype.is_floating_point or meta.dtype.is_complex):
        return []
    rest = (R,) * (len(node.inputs) - 1)
    n_out = len(node.outputs)
    partials = [p for p in PARTIALS if not (meta.dtype.is_complex and p.reduce_op in ("max", "min"))]
    return [SingleDimRule((p, *rest), (p,) * n_out, source=SOURCE) for p in partials]


def has_rules(op) -> bool:
    return op in _RULES


def rules(node: PrimNode) -> list[SingleDimRule] | None:
    fn = _RULES.get(node.op)
    return None if fn is None else fn(node)
