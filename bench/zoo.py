"""The model zoo table: one training step of every zoo model (decompshard/check/zoo.py)
on every sharding (dp, dp-uneven, tp, tp-local, 2d, 2d-uneven), with `decompshard.enable()`
and with torch alone, against one device (float64, simulated ranks, loss and every gradient
and buffer on every rank). tp-local is Megatron with use_local_output=True (attention on
local tensors): where torch alone runs too, the table says whether enable() makes more
collectives or bytes, or a first step over 1.5x torch alone's (`zoo_run.versus_torch`).

Per case and path: the verdict (OK / WRONG / ERROR / n/a), collectives and the bytes each
rank puts into them over one step, the first step's time (decompshard's and DTensor's
sharding caches cleared) and the ratio enable()/torch alone where both run, and the warm
step's ratio (the faster of two warm steps). Each case runs in a worker process with a deadline (--timeout), one at a
time by default so the times do not compete for cores. Markdown (README-ready) on
stdout, failures (op and error) under the table.

Per case, also how many distinct ops enable() ran replicated instead of derived (unsupported,
no decomposition, data-dependent, symbolic shapes), named under the table. Exit 3 when any
case with enable() is WRONG or an ERROR (an internal error of decompshard's that enable()
caught and ran an op replicated for included); torch alone's errors are the table's
point, not a failure.

Usage: python bench/zoo.py [--models all|llama,bert-mlm,...] [--shardings dp,2d]
       [--jobs 1] [--timeout 120] [--json rows.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    from decompshard.check.model import SHARDINGS
    from decompshard.check.zoo_run import against_us, expand_names, render, run_zoo

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="all", help="'all' or comma-separated zoo names (default all)")
    parser.add_argument("--shardings", default=",".join(SHARDINGS), help="comma-separated (default: all)")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1: clean timings)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case and path (default 120)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)

    names = expand_names(args.models)
    shardings = [s.strip() for s in args.shardings.split(",") if s.strip()]
    t0 = time.perf_counter()

    def progress(row: dict) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {row['model']} {row['sharding']}: "
              f"enable() {row['enable']['verdict']}, torch {row['torch']['verdict']}", file=sys.stderr, flush=True)

    rows = run_zoo(names, shardings, jobs=args.jobs, timeout=args.timeout, on_row=progress)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(render(rows))
    print(f"\n({len(rows)} cases, {time.perf_counter() - t0:.0f} s)")
    bad = against_us(rows)
    if bad:
        print(f"{len(bad)} cases with enable() WRONG or ERROR: "
              + ", ".join(f"{r['model']} / {r['sharding']}" for r in bad), file=sys.stderr)
    return 3 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
