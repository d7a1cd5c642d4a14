"""What one zoo case moves, collective by collective: the counted step of
`decompshard check --model NAME --sharding S` (bench/zoo.py's bytes column) with
`CommBytes.listing`, grouped by (DTensor op in flight, its operands, collective,
local shape), largest bytes first. The way to read a bytes-to-expert ratio: which ops
move activations, and from which placements.

Gradient redistributions after backward (DDP's all-reduces) are listed under the last
op DTensor dispatched before them (the op column says which DTensor op was in flight,
not which parameter).

Usage: python bench/comm_listing.py MODEL SHARDING [--torch-alone]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    import decompshard.check.model as model
    from decompshard.check.zoo_run import zoo_case
    from decompshard.dispatch_modes.comm_bytes import CommBytes

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("sharding")
    parser.add_argument("--torch-alone", action="store_true", help="without enable()")
    args = parser.parse_args(argv)

    made: list[CommBytes] = []

    def listing_comm() -> CommBytes:
        made.append(CommBytes())
        return made[-1]

    model.CommBytes = listing_comm  # keep the zoo step's counter (this process only)
    row = zoo_case(args.model, args.sharding, not args.torch_alone)
    print(f"{args.model} {args.sharding}: {row['verdict']}, {row['collectives']} collectives, "
          f"{(row['bytes'] or 0) / 1024:.1f} KiB; expert {(row['expert_bytes'] or 0) / 1024:.1f} KiB "
          f"{row['expert_note']} {row['detail'][:200]}")
    if not made:
        return 1
    groups: dict[tuple, list[int]] = collections.defaultdict(lambda: [0, 0])
    for c in made[-1].listing:
        g = groups[(c.collective, c.op, c.operands, c.local_shape)]
        g[0] += 1
        g[1] += c.bytes
    for (coll, op, operands, shape), (n, b) in sorted(groups.items(), key=lambda kv: -kv[1][1]):
        print(f"{b / 1024:8.1f} KiB {n:3d}x {coll:24s} local {list(shape)!s:16s} {op}  {operands}")
    return 0 if row["verdict"] == "OK" else 3


if __name__ == "__main__":
    sys.exit(main())
