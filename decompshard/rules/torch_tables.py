"""Torch's primitive rules by shape class: shipped with the package, then remembered.

Why: building a primitive's rule table from torch's strategy functions costs 1-3 ms (a
fake mesh, an OpSchema per candidate, torch's propagation), the largest share of a cold
derivation after the traces. Torch's answer depends on the call's shape class, not its
sizes (rules/shape_class.py), so the answers for the classes the default op set meets
ship in `torch_tables/torch-<release>.json`, one file per tested torch release (chosen
at import by the running release), made by `scripts/gen_rule_tables.py` under that
release with torch asked at three members of every class. `tests/test_shipped_tables.py` asks torch again, live.

Trust is per op: only ops the generator verified ("verified_ops": every class it met
gave one answer at every member) are looked up by class, in the shipped table and in
the class-keyed cache of answers computed here. Any other op is asked at its exact
shapes. A release with no table of its own (an untested torch) uses none: every answer
is computed live, since torch's strategies change between releases (torch 2.14 moved 139
ops to single-dim strategies).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from decompshard import caches
from decompshard.dispatch_modes.graph import PrimNode
from decompshard.placements import SingleDimRule, format_placement, parse_placement
from decompshard.rules.shape_class import class_key

FORMAT = 1


def torch_release() -> str:
    """The torch release a table belongs to ("2.13.0"; local build tags dropped)."""
    return torch.__version__.split("+")[0]


TABLE_DIR = Path(__file__).with_name("torch_tables")
TABLE_PATH = TABLE_DIR / f"torch-{torch_release()}.json"


# (source, class key) -> rules or None, for verified ops at classes not shipped
_CLASS_CACHE = caches.BoundedCache("torch_rules_by_class", 8192)


class _Shipped:
    def __init__(self) -> None:
        self.loaded = False
        self.verified: frozenset[str] = frozenset()
        self.entries: dict[str, dict[str, Any]] = {}
        self.decoded: dict[tuple[str, str], tuple[SingleDimRule, ...]] = {}  # see _decoded

    def load(self) -> None:
        self.loaded = True
        try:
            data = json.loads(TABLE_PATH.read_text())
        except (OSError, ValueError):
            return  # no table: every answer is computed live
        if data.get("format") != FORMAT or data.get("torch") != torch_release():
            return
        self.verified = frozenset(data["verified_ops"])
        self.entries = data["entries"]


_SHIPPED = _Shipped()


def torch_rules(source: Any, node: PrimNode) -> list[SingleDimRule] | None:
    """`source.rules(node)` (a torch rule source module), answered by class where the
    op is verified."""
    if not _SHIPPED.loaded:
        _SHIPPED.load()
    if str(node.op) not in _SHIPPED.verified:
        return source.rules(node)
    key = class_key(node)
    if key is None:
        return source.rules(node)
    shipped = _decoded(source.SOURCE, key)
    if shipped is not None:
        return list(shipped)
    hit = _CLASS_CACHE.get((source.SOURCE, key), _MISSING)
    if hit is _MISSING:
        hit = _CLASS_CACHE.put((source.SOURCE, key), source.rules(node))
    return None if hit is None else list(hit)


_MISSING = object()


def _decoded(source: str, key: str) -> tuple[SingleDimRule, ...] | None:
    """The shipped rules of a class, decoded (None: not shipped, or torch declined).

    The shipped table is package data that never changes while the process runs (read
    once, for one torch release), and rules are frozen values, so each entry is decoded
    once per loaded table: clear_cache (a cold derivation) need not forget these, as
    they hold nothing computed from a call. Only shipped entries are memoised (a miss is
    one dict look-up), so the memo never outgrows the table however many classes a
    long job meets."""
    memo = _SHIPPED.decoded
    hit = memo.get((source, key))
    if hit is None:
        shipped = _SHIPPED.entries.get(source, {}).get(key)
        if shipped is None:
            return None
        hit = memo[(source, key)] = tuple(decode(shipped, source))
    return hit


def encode(rules: list[SingleDimRule] | None) -> list | None:
    """JSON form: [[inputs...], [outputs...], even] per rule (None: the source declined)."""
    if rules is None:
        return None
    return [[[format_placement(p) for p in r.inputs], [format_placement(p) for p in r.outputs], r.even_only]
            for r in rules]


def decode(data: list | None, source: str) -> list[SingleDimRule] | None:
    if data is None:
        return None
    return [
        SingleDimRule(tuple(_placement(p) for p in ins), tuple(_placement(p) for p in outs), even, source)
        for ins, outs, even in data
    ]


_PARSED: dict[str, Any] = {}


def _placement(text: str) -> Any:
    hit = _PARSED.get(text, _MISSING)
    if hit is _MISSING:
        hit = _PARSED[text] = parse_placement(text)
    return hit


def shipped_table() -> dict[str, Any]:
    """The table as loaded (empty if absent or made with another torch), for tests."""
    if not _SHIPPED.loaded:
        _SHIPPED.load()
    return {"verified_ops": sorted(_SHIPPED.verified), "entries": _SHIPPED.entries}


def clear_cache() -> None:
    _CLASS_CACHE.clear()
