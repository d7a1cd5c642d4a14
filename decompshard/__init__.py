"""decompshard: DTensor sharding strategies derived from aten decompositions.

This file is the whole public surface; everything else is private. Follow one op from
`enable()` (enable.py) through `lift.choose` (lift.py) to `derive_rules` (derive.py),
which traces (dispatch_modes/), looks up primitive rules (rules/), propagates
(propagate.py) and checks local shapes (localcheck.py).
"""

import os as _os

from .caches import cache_info
from .derive import DerivedRules, clear_caches, derive_rules, resolve_op
from .enable import disable, enable, enabled, is_enabled
from .explain import explain
from .placements import P, R, S, SingleDimRule, parse_rule

__all__ = [
    "DerivedRules", "P", "R", "S", "SingleDimRule", "cache_info", "clear_caches", "derive_rules",
    "disable", "enable", "enabled", "explain", "is_enabled", "parse_rule", "resolve_op",
]

if _os.environ.get("DECOMPSHARD_ENABLE", "") not in ("", "0"):
    enable()
