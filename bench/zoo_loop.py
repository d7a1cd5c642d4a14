"""The training-loop zoo table: several steps of the zoo's Llama (2 decoder layers, float64)
training loop on 4 gloo processes (decompshard/check/loop.py): forward, loss, backward,
`clip_grad_norm_` (foreach or the for-loop), AdamW (foreach, for-loop or fused), on DTensor
data parallel, Megatron tensor parallel, FSDP2 alone and FSDP2 + tensor parallel on a 2x2
mesh in torchtitan's order, with `decompshard.enable()` and with torch alone, each
step's loss, total gradient norm and every parameter against one device.

Per case (parallelism, adamw/clip) and path: the verdict (OK / WRONG / ERROR), the worst
relative error with enable(), the first step's time (decompshard's and DTensor's sharding
caches cleared; each group of processes first runs one untimed step on both paths) and
the ratio enable()/torch alone where both match one device, the later steps' ratio (each
case run --repeat times, the paths' order alternating, the fastest times kept; under a
compile mode once, each path in fresh processes of its own), and
how many distinct warnings of decompshard's fired (a fence warns only where it changed a
number: an even batch should give none). Under the table: every failure and each warning.
Exit 3 when a case with enable() is WRONG or an ERROR; torch alone's errors are the
table's point, not a failure.

Usage: python bench/zoo_loop.py [--parallelisms dp,tp,fsdp,fsdp-tp] [--variants all|foreach/foreach,...]
       [--steps 3] [--repeat 2] [--no-torch] [--timeout 900] [--json rows.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    from decompshard.check.loop import PARALLELISMS, STEPS, VARIANTS
    from decompshard.check.loop_run import against_us, render, run_matrix

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parallelisms", default=",".join(PARALLELISMS), help="comma-separated (default: all); "
                        "NAME+MODE: the forward and loss under torch.compile (aot_eager); MODE is compile (static "
                        "shapes), dynamic (dynamic=True), mark_dynamic (the sequence dim), seqlen (the sequence "
                        "shorter at each step: torch recompiles with a symbolic length) or inductor "
                        "(dynamic=True under inductor)")
    parser.add_argument("--variants", default="all", help="'all' or comma-separated adamw/clip names "
                        f"({', '.join(VARIANTS)})")
    parser.add_argument("--steps", type=int, default=STEPS, help=f"training steps per case (default {STEPS})")
    parser.add_argument("--no-torch", action="store_true", help="only the enable() path")
    parser.add_argument("--repeat", type=int, default=2, help="runs per case and path (1 under a compile mode), the paths' order "
                        "alternating, the fastest times kept (default 2)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per parallelism's group (default 900)")
    parser.add_argument("--json", metavar="FILE", help="also write the rows as JSON")
    args = parser.parse_args(argv)

    parallelisms = [p.strip() for p in args.parallelisms.split(",") if p.strip()]
    variants = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(",") if v.strip()]
    t0 = time.perf_counter()

    def progress(row: dict) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {row['parallelism']} {row['variant']} {row['path']}: "
              f"{row['verdict']}", file=sys.stderr, flush=True)

    rows = run_matrix(parallelisms, variants, steps=args.steps, with_torch=not args.no_torch,
                      repeat=args.repeat, deadline=args.timeout, on_row=progress)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    import torch

    print(f"torch {torch.__version__}, {args.steps} steps, 4 gloo processes\n")
    print(render(rows))
    print(f"\n({len(rows)} runs, {time.perf_counter() - t0:.0f} s)")
    bad = against_us(rows)
    if bad:
        print(f"{len(bad)} runs with enable() WRONG or ERROR: "
              + ", ".join(f"{r['parallelism']} / {r['variant']}" for r in bad), file=sys.stderr)
    return 3 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
