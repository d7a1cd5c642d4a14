"""Solver scaling with the number of tensor inputs: block_diag and cartesian_prod.

Each input of these ops runs through its own chain of primitives and the chains meet only
at the last node (one cat / stack). The solver keeps independent chains apart (factors in
propagate.py) and joins them at that node rule by rule, so its work follows the size of
the rule set instead of the product of every input's placements (5^n combinations for
block_diag, most of them dead at the last node).

The rule set itself grows with n: block_diag of n inputs has 3 * (2^n - 1) + 1 rules
(`P(avg|max|min)` on any non-empty subset of inputs with R elsewhere, and all-P(sum)),
so no derivation of the complete set can be polynomial in n; the target is about the
cost per input and per rule. Measured here: a cold `derive_rules(...).rules` (every
cache cleared, rule tables included), `--repeat` times, the minimum kept (noise on a
shared machine only ever adds time), and its ratio to the 2-input case of the same op
measured in the same run. Target: 8-input block_diag and 5-input cartesian_prod within
10x of their 2-input case.

Usage: python bench/solver_scaling.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

from _clock import RuleTableClock  # bench/ is on sys.path when a bench runs

warnings.filterwarnings("ignore")

TARGET = 10.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    import torch
    from tabulate import tabulate

    import decompshard

    aten = torch.ops.aten
    cases = [
        (aten.block_diag.default, (3, 4), (2, 3, 4, 5, 6, 8)),
        (aten.cartesian_prod.default, (3,), (2, 3, 4, 5)),
    ]
    rows, verdicts = [], []
    with RuleTableClock() as clock:
        for op, shape, counts in cases:
            base = None
            for n in counts:
                inputs = [torch.randn(*shape) for _ in range(n)]
                best = (float("inf"), 0.0, 0.0, 0)
                for _ in range(args.repeat):
                    decompshard.clear_caches()
                    clock.seconds = 0.0
                    t0 = time.perf_counter()
                    derived = decompshard.derive_rules(op, inputs)
                    t1 = time.perf_counter()
                    n_rules = len(derived.rules)  # forces every local-shape check
                    t2 = time.perf_counter()
                    if t2 - t0 < best[0]:
                        best = (t2 - t0, t1 - t0 - clock.seconds, t2 - t1, n_rules, clock.seconds)
                total, solve, check, n_rules, tables = best
                base = base or (total, n_rules)
                rows.append((str(op), n, n_rules, total * 1e3, tables * 1e3, solve * 1e3, check * 1e3,
                             total / base[0], n_rules / base[1]))
                print(f"{op} x{n}: {total * 1e3:.1f} ms, {n_rules} rules", file=sys.stderr)
            verdicts.append((str(op), counts[-1], rows[-1][7]))

    print(tabulate(rows, headers=["op", "inputs", "rules", "total ms", "rule tables ms",
                                  "trace+solve ms", "local check ms", "time / 2 inputs", "rules / 2 inputs"],
                   floatfmt=".1f"))
    print()
    ok = True
    for name, n, ratio in verdicts:
        passed = ratio <= TARGET
        ok &= passed
        print(f"{name} with {n} inputs: {ratio:.1f}x its 2-input time (target <= {TARGET:.0f}x): "
              f"{'met' if passed else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
