"""Rule source 1: torch's registered single-dim strategies (already placeholder rules).

Torch returns `[outputs..., tensor inputs...]` lists with `_ShardingPlaceholder(d)` for
"any sharding kind on dim d". A strategy registered with `allow_uneven_sharding=False`
is only right for even shards, so its sharded rules carry the [even] condition.
"""

from __future__ import annotations

from decompshard._compat import single_dim_strategy_info
from decompshard.torch_placements import from_torch_placement
from decompshard.dispatch_modes.graph import PrimNode
from decompshard.placements import SingleDimRule, is_shard

SOURCE = "torch single-dim"


def has_rules(op) -> bool:
    return single_dim_strategy_info(op) is not None


def rules(node: PrimNode) -> list[SingleDimRule] | None:
    info = single_dim_strategy_info(node.op)
    if info is None:
        return None
    raw = info.func(node.op, node.args, node.kwargs)
    n_in, n_out = len(node.inputs), len(node.outputs)
    out: list[SingleDimRule] = []
    for entry in raw:
        placements = [from_torch_placement(p) for p in entry]
        if NotImplemented in placements:
            continue
        k = len(placements) - n_in
        if k == n_out:
            outs = tuple(placements[:k])
        elif k == 1 and n_out > 1:  # one spec shared by every output (list returns)
            outs = (placements[0],) * n_out
        else:
            continue
        ins = tuple(placements[k:])
        sharded = any(is_shard(p) for p in ins + outs)
        even = sharded and not info.allow_uneven_sharding
        out.append(SingleDimRule(ins, outs, even_only=even, source=SOURCE))
    return out
