"""The native guard's output-mask fix: single-dim strategies that place an output the
op does not return.

torch 2.14's and 2.15's `convolution_backward_single_dim_strategy` names a placement for all three
outputs (grad_input, grad_weight, grad_bias) whatever `output_mask` says, while the
implied all-Replicate rule, built from the output metas, has None where the mask leaves
an output out. On a 2-D mesh the expansion pairs the two across mesh dims and torch
raises "strategy position 0 mixes None with placements across mesh dims: (None,
Shard(dim=0))": the backward of every network's first convolution (its input needs no
gradient) fails on a 2-D mesh, with or without decompshard. The guard hands the
expansion the rules with None where the mask is False, which is what the op returns.
No warning: no number changes, only a placement for a tensor that does not exist.
"""

from __future__ import annotations

from typing import Any, Callable
from decompshard.runtime.records import Fix

__all__ = ["FIX", "masking_single_dim"]


def masking_single_dim(func: Callable, mask_index: int) -> Callable:
    """A single-dim strategy function whose rules say None for every output the
    `output_mask` argument (at `mask_index`) leaves out. Rules list outputs first, one
    per mask entry."""

    def masked(op_: Any, args_schema: Any, kwargs_schema: Any) -> Any:
        rules = func(op_, args_schema, kwargs_schema)
        mask = args_schema[mask_index] if len(args_schema) > mask_index else kwargs_schema.get("output_mask")
        if not mask or all(mask):
            return rules
        off = [i for i, keep in enumerate(mask) if not keep]
        return [[None if i in off else p for i, p in enumerate(rule)] for rule in rules]

    masked.__wrapped__ = func  # type: ignore[attr-defined]
    return masked


FIX = Fix("outputs the mask leaves out get no placement",
          single=lambda op, fence, warn, func: masking_single_dim(func, fence.args))
