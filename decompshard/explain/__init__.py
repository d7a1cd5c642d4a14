"""explain: why an op gets (or refuses) a sharding, as a readable propagation trace.

    analysis  decides: follows one candidate through the recorded decomposition (the
              solver and the local-shape check derive_rules uses), finds where it dies,
              the nearest rules there and the cheapest redistribution that passes
    render    draws it as text (and builds the rows the HTML view shares)
    notebook  draws it as HTML (`_repr_html_`): tables, verdict, the blocking node marked
    plans     an op's collective plan (runtime/plans/__init__.py) priced for the call: its
              collectives, DTensor's strategy's bytes beside them, which one enable() runs
    api       the printable `Explanation` and `explain()`
    command   `decompshard explain` and its REPL

Imports flow one way: command -> api -> notebook -> render -> analysis -> plans. Names
here are imported on first use, so the CLI can build its parser (`decompshard explain
--help`) without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOME = {"Analysis": "analysis", "MeshReport": "analysis", "Suggestion": "analysis",
         "parse_candidate": "analysis", "Explanation": "api", "explain": "api"}

__all__ = ["Analysis", "Explanation", "MeshReport", "Suggestion", "explain", "parse_candidate"]

if TYPE_CHECKING:
    from decompshard.explain.analysis import Analysis, MeshReport, Suggestion, parse_candidate
    from decompshard.explain.api import Explanation, explain


def __getattr__(name: str) -> Any:
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'decompshard.explain' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
