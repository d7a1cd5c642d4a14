"""Argument variants OpInfo lacks, for the native audit (`--verify-native`).

OpInfo's samples are made to exercise kernels, not the arguments real training passes:
none ignores a target the way masked-LM and padded causal-LM batches do (`labels=-100`
on most tokens), so the audit never saw DTensor's `nll_loss_forward` average per-rank
means (wrong whenever ranks count different numbers of targets; issue 23). Each variant
here is a few lines of what models run, forward and backward, on float64 tensors; the
aten calls they make (recorded like OpInfo's, outermost calls only) join the audit's
samples for their ops. The values are chosen so a per-rank mistake shows: ignored rows
spread so that on 2 and 4 ranks each rank counts a different number of targets, and one
rank on 4 counts none.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from decompshard._compat import OpOverload

from decompshard.dim_args import dim_arguments
from decompshard.coverage.opinfo_samples import AtenSample, dedupe_key, keepable
from decompshard.dispatch_modes.record import RecordOutermostAtenCalls

__all__ = ["NEGATIVE_DIMS", "VARIANTS", "Variant", "negative_dim_samples", "variant_samples"]

IGNORE = -100
N, C = 8, 5
# 8 rows: on 4 ranks (2 rows each) the ranks count 0, 2, 1, 2 targets; on 2 ranks 2 and 3
IGNORED_ROWS = (0, 1, 5)


@dataclass(frozen=True)
class Variant:
    name: str
    inputs: Callable[[], tuple]  # built outside the recording
    loss: Callable[..., torch.Tensor]  # the use: recorded, forward and backward


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(*extra: int) -> torch.Tensor:
    return torch.randn(N, C, *extra, dtype=torch.float64, generator=_gen(1)).requires_grad_()


def _targets(*extra: int, ignored: tuple[int, ...] = IGNORED_ROWS) -> torch.Tensor:
    t = torch.randint(0, C, (N, *extra), generator=_gen(2))
    t[list(ignored)] = IGNORE
    return t


def _weight() -> torch.Tensor:
    return torch.tensor([0.2, 1.0, 3.0, 0.7, 1.5], dtype=torch.float64)


def _padded(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 6] values and a mask True on padding: rows of lengths 6, 2, 4, 1, 6, 3, 5, 6
    (ranks hold different numbers of real tokens)."""
    lengths = torch.tensor([6, 2, 4, 1, 6, 3, 5, 6])
    pad = torch.arange(6)[None, :] >= lengths[:, None]
    return torch.randn(N, 6, dtype=torch.float64, generator=_gen(seed)).requires_grad_(), pad


def _masked_mean(x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    return (x.masked_fill(pad, 0.0).sum(1) / (~pad).sum(1)).mean()


def _where_mean(x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    return torch.where(pad, torch.zeros_like(x), x).sum() / (~pad).sum()


def _masked_softmax(x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    return (x.masked_fill(pad, float("-inf")).softmax(-1) * x.detach()).sum()


VARIANTS: tuple[Variant, ...] = (
    Variant("cross_entropy ignore_index", lambda: (_logits(), _targets()), F.cross_entropy),
    Variant("cross_entropy class weights", lambda: (_logits(), _targets(ignored=()), _weight()),
            lambda x, t, w: F.cross_entropy(x, t, weight=w)),
    Variant("cross_entropy weights + ignore_index", lambda: (_logits(), _targets(), _weight()),
            lambda x, t, w: F.cross_entropy(x, t, weight=w)),
    Variant("cross_entropy label_smoothing + ignore_index", lambda: (_logits(), _targets()),
            lambda x, t: F.cross_entropy(x, t, label_smoothing=0.1)),
    Variant("nll_loss ignore_index", lambda: (_logits(), _targets()), lambda x, t: F.nll_loss(x.log_softmax(1), t)),
    Variant("cross_entropy image targets, weights + ignore_index (nll_loss2d)",
            lambda: (_logits(3, 2), _targets(3, 2), _weight()), lambda x, t, w: F.cross_entropy(x, t, weight=w)),
    Variant("padding mask: masked_fill feeding a per-row mean", lambda: _padded(3), _masked_mean),
    Variant("padding mask: where feeding a token mean", lambda: _padded(4), _where_mean),
    Variant("padding mask: masked_fill(-inf) feeding softmax", lambda: _padded(5), _masked_softmax),
)


def variant_samples(max_per_op: int = 6) -> dict[OpOverload, list[AtenSample]]:
    """The aten calls each variant makes (outermost only, as DTensor sees them), as
    AtenSamples labelled `variant: <name>`. Deduplicated within a variant only: two
    variants with the same shapes differ in the values that matter (ignored targets)."""
    out: dict[OpOverload, list[AtenSample]] = {}
    seen: set[tuple] = set()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for v in VARIANTS:
            inputs = v.inputs()
            recorder = RecordOutermostAtenCalls()
            with recorder:
                v.loss(*inputs).backward()
            for op, args, kwargs in recorder.calls:
                key = (v.name, dedupe_key(op, args, kwargs))
                if key in seen or not keepable(args, kwargs):
                    continue
                bucket = out.setdefault(op, [])
                if len(bucket) < max_per_op:
                    seen.add(key)
                    bucket.append(AtenSample(op, args, kwargs, f"variant: {v.name}"))
    return out


# ------------------------------------------------------------------ negative dims

# OpInfo's samples mostly pass dims >= 0, so the audit never saw DTensor's strategies
# with a negative one: `scan_strategy` compares it unwrapped with the placements' dims
# and lets a Shard on the scanned dim through (dim_args.py).
NEGATIVE_DIMS = "negative dims"


def negative_dim_samples(samples: Sequence[AtenSample], k: int) -> list[AtenSample]:
    """The k largest of `samples` that pass a dim argument >= 0 (a default one
    included: `diagonal`'s dim1=0, dim2=1), each with every such dim d replaced by
    d - n: the same call with negative dims. n is the ndim of the first tensor input
    (at least 1), or one more (`unsqueeze`, `diag_embed` and `stack` index their
    output's dims); the one that gives, on one device, exactly the original sample's
    result, so the variant means what the sample means (kernels that never wrap their
    dims, `_fft_*`, give no variant, or crash: run it in a worker)."""
    from decompshard.coverage.sweep import pick_samples

    out: list[AtenSample] = []
    for sample in pick_samples(samples, len(samples)):
        variant = _negated(sample)
        if variant is not None:
            out.append(variant)
            if len(out) == k:
                break
    return out


def _negated(sample: AtenSample) -> AtenSample | None:
    where = dim_arguments(sample.op)
    first = next((t for t in sample.tensors()), None)
    if not where or first is None:
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            want = sample.run()
        except Exception:
            return None
        for n in dict.fromkeys((max(first.ndim, 1), first.ndim + 1)):
            args, kwargs = list(sample.args), dict(sample.kwargs)
            changed = []
            for i, name, default in where:
                if i < len(args):
                    args[i], what = _negate(args[i], n)
                elif name in kwargs or default is not None:
                    kwargs[name], what = _negate(kwargs.get(name, default), n)
                    if not what and name not in sample.kwargs:
                        del kwargs[name]
                else:
                    continue
                if what:
                    changed.append(f"{name}={what}")
            if not changed:
                continue
            variant = AtenSample(sample.op, tuple(args), kwargs, f"{sample.opinfo_name} | {NEGATIVE_DIMS}: "
                                 f"{', '.join(changed)}")
            try:
                if _same(variant.run(), want):
                    return variant
            except Exception:
                continue
    return None


def _negate(value: object, n: int) -> tuple[object, str]:
    """`value` (an int or a list of ints) with each dim in [0, n) made negative, and
    what changed ('' if nothing)."""
    if isinstance(value, bool):
        return value, ""
    if isinstance(value, int):
        return (value - n, str(value - n)) if 0 <= value < n else (value, "")
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        new = [v - n if 0 <= v < n else v for v in value]
        return (type(value)(new), str(new)) if new != list(value) else (value, "")
    return value, ""


def _same(a: object, b: object) -> bool:
    """Exactly the same result (values, shapes, dtypes; NaN equal to NaN)."""
    from decompshard._compat import tree_flatten

    la, sa = tree_flatten(a)
    lb, sb = tree_flatten(b)
    if sa != sb or len(la) != len(lb):
        return False
    for x, y in zip(la, lb):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                return False
            floating = x.is_floating_point() or x.is_complex()
            if not (torch.allclose(x, y, rtol=0, atol=0, equal_nan=True) if floating else torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True
