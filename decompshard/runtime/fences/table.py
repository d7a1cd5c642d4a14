"""Every fence of the native guard: what DTensor alone does wrong, on which tested releases
it was measured wrong, and the fix, one record each (`records.Fence`).

Found by `decompshard coverage --verify-native` on each tested release
(docs/native_audit/torch-<release>.json), each confirmed by a direct DTensor run in
tests/test_native_audit.py, and by training vision models (tests/test_vision_guard.py).
Op names are aten overloads; rules are in decompshard's rule format (`placements.py`), as
torch's strategy table states them. Upstream fixes some of what is fenced (torch 2.14: mean
`nll_loss`, `cumsum` with a negative dim, `any` of a Partial(sum)), so each fence says where
DTensor alone was measured wrong, and the guard steps aside where it was measured right.

The named groups below the records (`WRONG_RULES`, `WRONG_ON`, ...) are views of
`FENCES`, for the audit and the tests; the records are the one source.
"""

from __future__ import annotations

from decompshard.runtime.fences import (aligned_shards, batch_norm_stats, cache_keys, conv_handlers, in_place_views,
                                        kwargs_by_name, mean_loss, negative_dims, one_rank_read, output_mask,
                                        wrong_rules)
from decompshard.runtime.records import TESTED_RELEASES, Fence

__all__ = ["FENCES", "TESTED_RELEASES", "fenced", "mask_key", "wrong_here"]

_ALL = TESTED_RELEASES
_OLD = ("2.13.0",)

_CONV = ("its custom handler (torch/distributed/tensor/_tp_conv.py) runs the local kernel without the "
         "redistribution its strategy asked for: any layout that needs one gives a result labelled with "
         "placements the local tensors do not have")
_MEAN = ("returns Partial(avg) of per-rank means for a batch-sharded target: wrong whenever ranks hold different "
         "total weights (ignored targets, class weights; NaN on a rank with no counted target); 2.14's single-dim "
         "rule shards a mean only with the target replicated (pytorch#185167)")
_MEAN_KEPT = "moves two scalars where torch all-gathers the logits (batch x vocabulary)"
_STATS = ("its strategy moves the replicated running statistics to Shard(0) and the kernel's in-place update "
          "lands on the moved copy (CPU's native_batch_norm updates them although its schema does not mark them "
          "written)")
_SCAN = ("its strategy compares a negative dim with the placements' dims before wrapping it: cumsum(-1) on a "
         "Shard of the last dim scans each rank's part alone (2.14's scan strategy wraps the dim)")
_SQUEEZE = "DTensor's in-place path keeps self's old shape when the placements do not change"

FENCES: tuple[Fence, ...] = (
    # handlers
    Fence("aten.convolution.default", _CONV, _ALL, conv_handlers.FIX),
    Fence("aten.convolution_backward.default", _CONV, _ALL, conv_handlers.FIX),
    Fence("aten.nll_loss_forward.default", _MEAN, _OLD, mean_loss.FIX, kept_where_right=_MEAN_KEPT),
    Fence("aten.nll_loss2d_forward.default", _MEAN, _OLD, mean_loss.FIX, kept_where_right=_MEAN_KEPT),
    Fence("aten._local_scalar_dense.default", "DTensor runs `.item()` on each rank's local part without asking "
          "its strategy: a Partial value's own part, a sharded one's shard", _ALL, one_rank_read.FIX),
    # op -> (indices of the updated arguments, index of the `training` flag or None where the op always trains)
    Fence("aten.native_batch_norm.default", _STATS, _ALL, batch_norm_stats.FIX, args=((3, 4), 5)),
    Fence("aten._native_batch_norm_legit.default", _STATS, _ALL, batch_norm_stats.FIX, args=((3, 4), 5)),
    Fence("aten._batch_norm_with_update.default", _STATS, _ALL, batch_norm_stats.FIX, args=((3, 4), None)),
    # in-place view -> its out-of-place twin
    Fence("aten.squeeze_.default", _SQUEEZE, _ALL, in_place_views.FIX, args="aten.squeeze.default"),
    Fence("aten.squeeze_.dim", _SQUEEZE, _ALL, in_place_views.FIX, args="aten.squeeze.dim"),
    Fence("aten.squeeze_.dims", _SQUEEZE, _ALL, in_place_views.FIX, args="aten.squeeze.dims"),
    # strategy tables: rules the numerical checker refutes and a DTensor run confirms
    Fence("aten.any.default", "P(sum) -> P(sum) (2.14 replicates any's P(sum) input first)", _OLD,
          wrong_rules.FIX, args=("P(sum) -> P(sum)",)),
    Fence("aten.any.dim", "P(sum) -> P(sum)", _OLD, wrong_rules.FIX, args=("P(sum) -> P(sum)",)),
    Fence("aten.any.dims", "P(sum) -> P(sum)", _OLD, wrong_rules.FIX, args=("P(sum) -> P(sum)",)),
    Fence("aten.fill_.Scalar", "P(sum) -> P(sum): every part filled with the value", _ALL, wrong_rules.FIX,
          args=("P(sum) -> P(sum)",)),
    Fence("aten.threshold.default", "P(max) and P(min) passed through (right only when value <= threshold)", _ALL,
          wrong_rules.FIX, args=("P(max) -> P(max)", "P(min) -> P(min)")),
    Fence("aten.linalg_solve_triangular.default", "R, S(0) -> S(0): each rank solves every batch of a replicated "
          "batched A against its shard of B's, a result of the global batch labelled Shard(0)", _ALL,
          wrong_rules.FIX, args=("R, S(0) -> S(0)",)),
    Fence("aten.cumsum.default", _SCAN, _OLD, negative_dims.FIX),
    Fence("aten.cumprod.default", _SCAN, _OLD, negative_dims.FIX),
    Fence("aten.logcumsumexp.default", _SCAN, _OLD, negative_dims.FIX),
    Fence("aten.gather.default", "S(d), S(d) -> S(d) off the gathered dim for an index shorter than its input on "
          "d: torch.chunk cuts each at its own size, so the pieces do not line up", _ALL, aligned_shards.FIX),
    # op -> (the argument's position, its name)
    Fence("aten.logsumexp.default", "its strategy reads `keepdim` by name only; passed by position, "
          "logsumexp(x, 0, keepdim=True) on Shard(1) claims Shard(0)", _ALL, kwargs_by_name.FIX, args=(2, "keepdim")),
    # op -> (the positional index from which, the keyword names) DTensor's sharding cache key must cover
    Fence("aten.histc.default", "its RuntimeSchemaInfo keys the sharding cache from `min` on, not `bins`: "
          "histc(bins=1) after bins=100 claims 100 bins", _ALL, cache_keys.FIX, args=(1, ())),
    Fence("aten._to_copy.default", "its RuntimeSchemaInfo keys on `dtype` only: .to(memory_format=channels_last) "
          "after a plain .to claims contiguous strides", _ALL, cache_keys.FIX, args=(None, ("memory_format",))),
    # op -> index of `output_mask`
    Fence("aten.convolution_backward.default", "2.14's and 2.15's single-dim strategy names a placement for "
          "outputs the mask leaves out; the expansion fails on any 2-D mesh when the input needs no gradient "
          "(every network's first convolution), torch alone too", ("2.14.1", "2.15.0"), output_mask.FIX,
          args=10, aspect="output_mask"),
)


def _ops(fix) -> tuple[str, ...]:
    return tuple(f.op for f in FENCES if f.fix is fix)


def _args(fix) -> dict:
    return {f.op: f.args for f in FENCES if f.fix is fix}


_BY_KEY = {f.key: f for f in FENCES}

HANDLERS_SKIPPING_REDISTRIBUTION = _ops(conv_handlers.FIX)
MEAN_OF_MEANS_LOSSES = _ops(mean_loss.FIX)
READS_OF_ONE_RANKS_PART = _ops(one_rank_read.FIX)
STATS_WRITTEN: dict[str, tuple] = _args(batch_norm_stats.FIX)
IN_PLACE_VIEWS_KEEPING_SHAPE: dict[str, str] = _args(in_place_views.FIX)
WRONG_RULES: dict[str, tuple[str, ...]] = _args(wrong_rules.FIX)
NEGATIVE_DIMS_UNWRAPPED = _ops(negative_dims.FIX)
SHARDS_MUST_LINE_UP = _ops(aligned_shards.FIX)
READ_BY_NAME_ONLY: dict[str, tuple[int, str]] = _args(kwargs_by_name.FIX)
CACHE_KEY_MISSES: dict[str, tuple] = _args(cache_keys.FIX)
OUTPUT_MASK_IGNORED: dict[str, int] = _args(output_mask.FIX)
WRONG_ON: dict[str, tuple[str, ...]] = {f.key: f.wrong_on for f in FENCES}
KEPT_WHERE_RIGHT: dict[str, str] = {f.key: f.kept_where_right for f in FENCES if f.kept_where_right}


def mask_key(op: str) -> str:
    """The key of an op's output-mask fence (its op has another fence)."""
    return f"{op}/output_mask"


def wrong_here(key: str, release: str | None = None) -> bool:
    """Whether DTensor alone is to be taken as wrong for the fence `key` on `release`
    (default: the running one): measured wrong there, or never measured there."""
    return _BY_KEY[key].wrong_here(release)


def fenced(key: str, release: str | None = None) -> bool:
    """Whether the guard installs the fence `key` on `release`."""
    return _BY_KEY[key].installed_here(release)
