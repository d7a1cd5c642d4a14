"""Print the input placements DTensor's sharding propagation picks for a few calls whose
inputs are Partial and sharded, with torch's fallback and with decompshard (used by
tests/test_torch_fallback.py, which runs this under different PYTHONHASHSEEDs: every
rank of a real job has its own)."""

from __future__ import annotations

import torch
from torch.distributed.tensor._sharding_prop import ShardingPropagator

from decompshard.verify.dtensor_case import device_mesh, make_dtensor, parse_placements, simulated_world
from decompshard.runtime.enable import switched

aten = torch.ops.aten
picked: list[str] = []
_original = ShardingPropagator.propagate_op_sharding_non_cached


def _spy(self, op_schema):
    out = _original(self, op_schema)
    if op_schema.op in {op for op, *_ in CALLS}:
        schema = out.redistribute_schema or op_schema
        picked.append(" ; ".join(str(s.placements) for s in schema.args_spec))
    return out


ShardingPropagator.propagate_op_sharding_non_cached = _spy

# (op, input shapes, placements on a 2x2 mesh, non-tensor args): same-cost strategies
# that differ only in which mesh dim shards which tensor dim
CALLS = [
    (aten.huber_loss.default, [(5, 3), (5, 3)], "P(min),S(1);P(min),S(0)", (1, 0.9)),
    (aten.mse_loss.default, [(4, 4), (4, 4)], "P(max),S(1);P(max),S(0)", (0,)),
    (aten.addmv.default, [(4,), (4, 6), (6,)], "P(min),S(0);R,P(min);P(sum),P(sum)", ()),
]

if __name__ == "__main__":
    g = torch.Generator().manual_seed(0)
    with simulated_world(4):
        mesh = device_mesh((2, 2))
        for op, shapes, text, rest in CALLS:
            tensors = [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]
            placements = parse_placements(text, shapes, 2)
            for label, on in (("torch", False), ("decompshard", True)):
                picked.clear()
                with switched(on):
                    op(*[make_dtensor(t, mesh, p, 0, i) for i, (t, p) in enumerate(zip(tensors, placements))], *rest)
                print(f"{label} {op}: {picked[-1]}")
