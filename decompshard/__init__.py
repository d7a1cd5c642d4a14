"""decompshard: DTensor sharding strategies derived from aten decompositions.

This file is the whole public surface; everything else is private. Follow one op from
`enable()` (runtime/enable.py: `_first_runnable`) through `lift.ranked` (mesh/lift.py) to `derive_rules`
(solve/derive.py), which traces (dispatch_modes/tracing.py), looks up primitive rules
(rules/registry.py), propagates (solve/propagate.py) and checks local shapes
(solve/localcheck.py). The stages, bottom to top: base modules, dispatch_modes/, rules/,
solve/, mesh/, verify/, runtime/, and the commands (coverage/, check/, explain/, cli.py);
tests/test_layering.py keeps every import pointing down.

Names are imported on first use (PEP 562), so `import decompshard` (and the
`decompshard` command's `--help`) does not pay for importing torch.
"""

from __future__ import annotations

import importlib as _importlib
import os as _os
import sys as _sys
import types as _types
from typing import TYPE_CHECKING, Any

# public name -> the private module that defines it
_HOME = {
    "cache_info": "caches",
    "DerivedRules": "solve.derive", "clear_caches": "solve.derive", "derive_rules": "solve.derive",
    "resolve_op": "op_names",
    "disable": "runtime.enable", "enable": "runtime.enable", "enabled": "runtime.enable",
    "is_enabled": "runtime.enable",
    "explain": "explain",
    "P": "placements", "R": "placements", "S": "placements", "SingleDimRule": "placements",
    "parse_rule": "placements",
    "ReferenceMismatch": "dispatch_modes.reference", "reference": "dispatch_modes.reference",
    "register_reference": "dispatch_modes.reference", "registered_reference": "dispatch_modes.reference",
    "unregister_reference": "dispatch_modes.reference",
}

__all__ = [
    "DerivedRules", "P", "R", "S", "SingleDimRule", "cache_info", "clear_caches", "derive_rules",
    "disable", "enable", "enabled", "explain", "is_enabled", "parse_rule", "resolve_op",
    "ReferenceMismatch", "reference", "register_reference", "registered_reference", "unregister_reference",
]

if TYPE_CHECKING:
    from decompshard.caches import cache_info
    from decompshard.op_names import resolve_op
    from decompshard.solve.derive import DerivedRules, clear_caches, derive_rules
    from decompshard.runtime.enable import disable, enable, enabled, is_enabled
    from decompshard.explain import explain
    from decompshard.placements import P, R, S, SingleDimRule, parse_rule
    from decompshard.dispatch_modes.reference import ReferenceMismatch, reference, register_reference, registered_reference, unregister_reference


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'decompshard' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


class _Package(_types.ModuleType):
    """`enable` and `explain` are both a public function and the private module that
    defines it. Importing such a module (`import decompshard.explain.command`) binds the
    module to this package's attribute of the same name; that binding is skipped, so
    `decompshard.explain` stays the function (imported by `__getattr__` when first used)
    whatever was imported first. Submodules are reached with `from decompshard.explain
    import render`, which goes through sys.modules, not this attribute."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, _types.ModuleType) and name in _HOME:
            return
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package

if _os.environ.get("DECOMPSHARD_ENABLE", "") not in ("", "0"):
    __getattr__("enable")()
