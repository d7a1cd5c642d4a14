"""Value signs known from the structure of a decomposition, whatever the input values.

Why: scaling a P(max) value by a replicated factor keeps it P(max) when the factor is
>= 0 and turns it into P(min) when the factor is <= 0. A single-dim rule for `mul` cannot
know the factor's sign, but the trace often can: `relu(x)`, `abs(x)`, `exp(x)` are never
negative, `clamp_max(x, 0)` never positive. The tracer records such facts per value (as
it records "this constant is all zeros"); `rules/project_rules.py` turns them into rules.

A sign is a bit set: NONNEG (every element >= 0 or NaN), NONPOS (<= 0 or NaN); both bits
(ZERO) mean every element is 0 or NaN; neither means unknown. NaN elements are harmless
to the rules built on this: a NaN factor makes every rank's product NaN, as it makes the
single-device one, and NaN parts of a P(sum) constant sum to NaN.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

aten = torch.ops.aten

UNKNOWN, NONNEG, NONPOS = 0, 1, 2
ZERO = NONNEG | NONPOS

_ALWAYS_NONNEG = {
    aten.relu.default, aten.abs.default, aten.exp.default, aten.exp2.default,
    aten.sqrt.default, aten.sigmoid.default, aten.ones.default, aten.ones_like.default,
    aten.new_ones.default,
}
_ALWAYS_ZERO = {aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default}
# value-preserving: the output holds (some of) the input's elements, unchanged
_SAME_AS_FIRST = {
    aten.detach.default, aten.clone.default, aten.alias.default, aten.view.default,
    aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.contiguous.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.default,
    aten.permute.default, aten.t.default, aten.transpose.int, aten.slice.Tensor,
    aten.select.int, aten.lift_fresh.default, aten._to_copy.default,
}
# factories filled with a scalar argument at this position
_FILL_ARG = {
    aten.full.default: 1, aten.full_like.default: 1, aten.new_full.default: 2,
    aten.fill.Scalar: 1, aten.fill_.Scalar: 1, aten.scalar_tensor.default: 0,
}


def of_number(c: Any) -> int:
    """The sign bits of a Python real number (UNKNOWN for anything else)."""
    if isinstance(c, bool) or not isinstance(c, (int, float)) or (isinstance(c, float) and math.isnan(c)):
        return UNKNOWN
    return ZERO if c == 0 else NONNEG if c > 0 else NONPOS


def _negate(s: int) -> int:
    return ((s & NONNEG) and NONPOS) | ((s & NONPOS) and NONNEG)


def _product(a: int, b: int) -> int:
    if a == ZERO or b == ZERO:
        return ZERO
    if not a or not b:
        return UNKNOWN
    out = UNKNOWN
    if (a & NONNEG and b & NONNEG) or (a & NONPOS and b & NONPOS):
        out |= NONNEG
    if (a & NONNEG and b & NONPOS) or (a & NONPOS and b & NONNEG):
        out |= NONPOS
    return out


def _clamped(func, args: Sequence[Any], kwargs: dict, first: int) -> int:
    """clamp(x, lo, hi) = min(max(x, lo), hi): a bound >= 0 below makes it >= 0, a bound
    <= 0 above makes it <= 0, and otherwise clamping keeps x's own sign (max(x, lo < 0)
    of x <= 0 stays <= 0, and so on)."""
    if func is aten.clamp_min.default:
        lo, hi = _arg(args, kwargs, 1, "min"), None
    elif func is aten.clamp_max.default:
        lo, hi = None, _arg(args, kwargs, 1, "max")
    else:
        lo, hi = _arg(args, kwargs, 1, "min"), _arg(args, kwargs, 2, "max")
    bounds = [b for b in (lo, hi) if b is not None]
    if any(of_number(b) == UNKNOWN for b in bounds):
        return UNKNOWN  # a tensor or NaN bound
    if lo is not None and hi is not None and lo > hi:
        return of_number(hi)  # torch clamps everything to max
    out = (NONNEG if lo is not None and lo >= 0 else 0) | (NONPOS if hi is not None and hi <= 0 else 0)
    return out or first


def _arg(args: Sequence[Any], kwargs: dict, pos: int, name: str, default: Any = None) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def sign_of(func, args: Sequence[Any], kwargs: dict, in_ids: Sequence[int], in_signs: Sequence[int],
            out_dtype: torch.dtype) -> int:
    """The sign bits of `func`'s (single) tensor output, from its inputs' signs and its
    scalar arguments. Conservative: UNKNOWN whenever a case is not spelled out here.

    Only floating outputs carry a sign: the rules built on signs are for floating values,
    and a cast through bool or an unsigned or narrow int does not keep one (x <= 0 cast
    to bool is 1 where x < 0; -1 cast to uint8 is 255). So x <= 0 cast to bool and back
    to float is UNKNOWN, because the bool in the middle is."""
    if not out_dtype.is_floating_point or any(isinstance(a, torch.Tensor) and a.is_complex() for a in args):
        return UNKNOWN
    first = in_signs[0] if in_signs else UNKNOWN
    if func in _ALWAYS_ZERO:
        return ZERO
    if func in _ALWAYS_NONNEG:
        return NONNEG
    if func in _FILL_ARG:
        return of_number(_arg(args, kwargs, _FILL_ARG[func], "fill_value", kwargs.get("value")))
    if func in _SAME_AS_FIRST:
        return first
    if func is aten.neg.default:
        return _negate(first)
    if func in (aten.clamp_min.default, aten.clamp_max.default, aten.clamp.default):
        return _clamped(func, args, kwargs, first)
    if func is aten.pow.Tensor_Scalar:
        e = args[1]
        return NONNEG if isinstance(e, int) and not isinstance(e, bool) and e % 2 == 0 else UNKNOWN
    if func in (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
        if len(in_ids) == 2:
            if in_ids[0] == in_ids[1] and func is aten.mul.Tensor:
                return NONNEG  # x * x
            other = in_signs[1]
        elif len(in_ids) == 1 and len(args) > 1:
            other = of_number(args[1])
        else:
            return UNKNOWN
        if func in (aten.div.Tensor, aten.div.Scalar) and (
            len(in_ids) == 2 or other in (UNKNOWN, ZERO) or kwargs.get("rounding_mode")
        ):
            return UNKNOWN  # only by a nonzero number: a ">= 0" tensor may hold -0.0
        return _product(first, other)
    if func is aten.add.Tensor and len(in_ids) == 2 and of_number(kwargs.get("alpha", 1)) == NONNEG:
        return in_signs[0] & in_signs[1]  # >= 0 plus >= 0, <= 0 plus <= 0
    if func is aten.where.self and len(in_signs) == 3:
        return in_signs[1] & in_signs[2]
    if func in _KEEPS_SIGN_REDUCTIONS:
        return first  # a sum, max or min of values >= 0 (<= 0) is >= 0 (<= 0)
    if func in (aten.prod.default, aten.prod.dim_int):
        return first & NONNEG  # a product of values >= 0 is >= 0 (an empty one is 1, so not ZERO)
    return UNKNOWN


_KEEPS_SIGN_REDUCTIONS = {aten.sum.default, aten.sum.dim_IntList, aten.amax.default, aten.amin.default}
