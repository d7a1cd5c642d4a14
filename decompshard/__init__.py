"""decompshard: DTensor sharding strategies derived from aten decompositions.

The whole public surface is re-exported here; everything else is private.
"""

from .derive import DerivedRules, clear_caches, derive_rules, resolve_op
from .placements import P, R, S, SingleDimRule, parse_rule

__all__ = ["DerivedRules", "P", "R", "S", "SingleDimRule", "clear_caches", "derive_rules", "parse_rule", "resolve_op"]
