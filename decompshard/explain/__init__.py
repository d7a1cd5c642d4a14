"""explain: why an op gets (or refuses) a sharding, as a readable propagation trace.

    analysis  decides: follows one candidate through the recorded decomposition (the
              solver and the local-shape check derive_rules uses), finds where it dies,
              the nearest rules there and the cheapest redistribution that passes
    render    draws: the printable `Explanation` (text, HTML) and `explain()`
    command   `decompshard explain` and its REPL

Imports flow one way: command -> render -> analysis.
"""

from .analysis import Analysis, MeshReport, Suggestion, parse_candidate
from .render import Explanation, explain

__all__ = ["Analysis", "Explanation", "MeshReport", "Suggestion", "explain", "parse_candidate"]
