"""The printable `Explanation` and `explain()`, the function users call.

    >>> e = explain(aten.addmv.default, bias, mat, vec, placements="R; S(1); S(0)")
    >>> print(e)          # the trace; e.verdict, e.blocked, e.suggestions for code
    >>> e                 # in a notebook: an HTML table, the blocking node highlighted
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from decompshard.explain.analysis import Analysis
from decompshard.explain.notebook import render_html
from decompshard.explain.render import DEFAULT_WIDTH, render_lines

__all__ = ["Explanation", "explain"]


class Explanation(Analysis):
    """What `explain` found; str() / repr() draw the text trace, _repr_html_() a table."""

    def render(self, width: int = DEFAULT_WIDTH) -> str:
        """The text trace, fitted to about `width` columns."""
        return "\n".join(render_lines(self, width)).rstrip() + "\n"

    def __str__(self) -> str:
        return self.render()

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return render_html(self)


def explain(
    op: torch._ops.OpOverload | str,
    *args: Any,
    placements: str | Sequence[Any] | None = None,
    mesh: Sequence[int] | str | None = None,
    mesh_placements: str | Sequence[Sequence[Any]] | None = None,
    show_all: bool = False,
    **kwargs: Any,
) -> Explanation:
    """Explain how `op(*args, **kwargs)` shards for the given input placements.

    `placements`: one single-dim placement per tensor input (schema order, lists
    flattened), as a string ("R; S(1); S(0)" or "R, S(1), S(0)") or a sequence of
    decompshard placements, their strings, or torch placements. Without it the result
    shows the derived rule table (as with `show_all`).

    `mesh` (e.g. (2, 4) or "2x4") with `mesh_placements` (per tensor input, one torch
    placement per mesh dim, or the string form "R,S(0); S(1),S(0); S(0),R") adds the
    N-D strategies ranked by the cost model.

    Raises ValueError for an unknown op, a malformed placement, or the wrong number of
    placements.
    """
    return Explanation.of(op, *args, placements=placements, mesh=mesh, mesh_placements=mesh_placements,
                          show_all=show_all, **kwargs)
