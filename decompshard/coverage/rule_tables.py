"""Build the shipped table of torch's rules by shape class (rules/torch_tables/torch-<release>.json).

Derives every OpInfo sample of the default op set (the decomp-only ops `decompshard
coverage` reports), records each primitive call the solver asks torch about, and asks
torch again at two other members of the call's shape class (smallest sizes, large
sizes; order and equality of sizes kept; float scalars scaled within their class). An op is *verified* when every class it met
gave the same rules, in the same order, at every member; only verified ops ship, and
only they are looked up by class at run time. An op with one disagreement anywhere is
left to exact-shape queries (`not_verified` says why).

`scripts/gen_rule_tables.py` writes the result; `tests/test_shipped_tables.py` builds it
again and compares, so a torch upgrade or a key that forgets something fails there.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from typing import Any

from decompshard.errors import one_line
from decompshard.rules import torch_tables
from decompshard.rules.shape_class import class_key, members


def build_table(verbose: bool = False) -> dict[str, Any]:
    import decompshard
    from decompshard.coverage.opinfo_samples import capture_aten_samples, decomp_only_ops

    asked: list[tuple] = []  # (source module, node) for every torch query the solver makes
    live = torch_tables.torch_rules

    def recording(source, node):
        asked.append((source, node))
        return source.rules(node)

    torch_tables.torch_rules = recording  # the registry calls through the module
    try:
        samples = capture_aten_samples()
        for op in sorted(decomp_only_ops(samples), key=str):
            for s in samples[op]:
                decompshard.clear_caches()
                try:
                    decompshard.derive_rules(op, *s.args, **s.kwargs)
                except Exception as e:  # a sample the derivation refuses asks nothing useful
                    if verbose:
                        print(f"  {op}: {one_line(e, 80)}", file=sys.stderr)
    finally:
        torch_tables.torch_rules = live
        decompshard.clear_caches()

    entries: dict[str, dict[str, list | None]] = defaultdict(dict)
    seen_ops: set[str] = set()
    bad: dict[str, str] = {}
    for source, node in asked:
        op = str(node.op)
        key = class_key(node)
        if key is None or op in bad:
            continue
        seen_ops.add(op)
        try:
            answer = torch_tables.encode(source.rules(node))
            for member in members(node):
                if class_key(member) != key:
                    raise AssertionError("a relabelled call left its class")
                if torch_tables.encode(source.rules(member)) != answer:
                    raise AssertionError(
                        f"torch answers differently at {[tuple(m.shape) for m in member.input_metas()]}")
        except Exception as e:
            bad[op] = one_line(e, 160)
            continue
        if entries[source.SOURCE].setdefault(key, answer) != answer:
            bad[op] = "two calls of one class got different answers"

    verified = sorted(seen_ops - set(bad))
    return {
        "format": torch_tables.FORMAT,
        "torch": torch_tables.torch_release(),
        "generated_by": "scripts/gen_rule_tables.py",
        "verified_ops": verified,
        "not_verified": dict(sorted(bad.items())),
        "entries": {
            src: {k: v for k, v in sorted(by_key.items()) if op_of(k) in verified}
            for src, by_key in sorted(entries.items())
        },
    }


def op_of(key: str) -> str:
    """The op name a class key belongs to."""
    return ast.literal_eval(key)[0]
