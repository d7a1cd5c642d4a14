"""torch placements as placement-grammar text ("S(0),P(sum);_S(1,3),R"): how every verdict
and reproducer line names a layout."""

from __future__ import annotations

from typing import Any, Sequence

from decompshard._compat import TorchPartial
from decompshard.torch_placements import from_torch_placement
from decompshard.placements import Partial, format_placement_rows

__all__ = ["format_placements"]


def format_placements(rows: Sequence[Sequence[Any]]) -> str:
    """Per tensor input, torch placements in the placement grammar: "S(0),P(sum);_S(1,3),R"."""
    return format_placement_rows([_grammar(p) for p in row] for row in rows)


def _grammar(p: Any) -> Any:
    if isinstance(p, TorchPartial):  # subclasses too (_NormPartial, _MaskPartial): shown by their reduction
        return Partial(p.reduce_op)
    q = from_torch_placement(p, strided=True)
    if q is None or q is NotImplemented:
        raise TypeError(f"not a plain DTensor placement: {p!r}")
    return q
