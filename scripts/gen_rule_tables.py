"""Regenerate decompshard/rules/torch_tables/torch-<release>.json for the running torch:
torch's primitive rules by shape class (how: decompshard/coverage/rule_tables.py). Run it
under each tested torch release: a release without its own table computes every answer
live, and tests/test_shipped_tables.py fails until it has one.

Usage: python scripts/gen_rule_tables.py [--out PATH]   (about 15 s)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from decompshard.rules import torch_tables
    from decompshard.coverage.rule_tables import build_table

    start = time.perf_counter()
    table = build_table(verbose=True)
    out = args.out or torch_tables.TABLE_PATH
    out.write_text(json.dumps(table, indent=0) + "\n")
    n = sum(len(v) for v in table["entries"].values())
    print(f"{out}: {n} classes of {len(table['verified_ops'])} verified ops ({time.perf_counter() - start:.0f} s)")
    for op, why in table["not_verified"].items():
        print(f"  not verified: {op}: {why}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
