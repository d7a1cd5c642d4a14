"""What the native guard (`guard.py`) guards, and on which torch releases: findings of
`decompshard coverage --verify-native` on each tested release
(docs/native_audit/torch-<release>.json), each confirmed by a direct DTensor run in
tests/test_native_audit.py, and of vision models (tests/test_vision_guard.py). Op names
are aten overloads; rules are in decompshard's rule format (`placements.py`), as torch's
strategy table states them.

Upstream fixes some of what the guard fences (torch 2.14: mean `nll_loss`, `cumsum` with
a negative dim, `any` of a Partial(sum)), so every fence says on which tested releases
DTensor alone was measured wrong (`WRONG_ON`); the guard installs it there and on any
release nobody has measured (a fence on a right op costs communication, a missing one
costs a wrong number), and steps aside where the measurement found torch right.
"""

from __future__ import annotations

from decompshard import _compat

# Custom DTensor handlers that run the local kernel without the redistribution their
# strategy asked for (torch/distributed/tensor/_tp_conv.py): any layout that needs one
# gives a result labelled with placements the local tensors do not have.
HANDLERS_SKIPPING_REDISTRIBUTION: tuple[str, ...] = (
    "aten.convolution.default",
    "aten.convolution_backward.default",
)

# Rules in DTensor's strategy tables that the numerical checker refutes and a DTensor
# run at their input placements confirms. The guard re-checks each at the shapes at
# hand, so a rule wrong only for some arguments (threshold's P(max) holds when
# value <= threshold) or some shapes (an empty shard) is skipped only there.
WRONG_RULES: dict[str, tuple[str, ...]] = {
    # silently wrong values
    "aten.any.default": ("P(sum) -> P(sum)",),
    "aten.any.dim": ("P(sum) -> P(sum)",),
    "aten.any.dims": ("P(sum) -> P(sum)",),
    "aten.fill_.Scalar": ("P(sum) -> P(sum)",),
    "aten.threshold.default": ("P(max) -> P(max)", "P(min) -> P(min)"),
    # a replicated batched A with a batch-sharded B: each rank solves every batch of A
    # against its shard of B's (broadcast), a result of the global batch labelled Shard(0)
    "aten.linalg_solve_triangular.default": ("R, S(0) -> S(0)",),
}

# Mean losses whose native strategy returns Partial(avg) of per-rank means for a
# batch-sharded target: wrong whenever ranks hold different total weights (ignored
# targets, class weights; NaN on a rank with no counted target), refused on uneven
# batches. The guard gives them a handler that all-reduces the sum and the total weight
# (guard_losses.py). Found by the audit's argument variants (coverage/native_variants.py).
MEAN_OF_MEANS_LOSSES: tuple[str, ...] = (
    "aten.nll_loss_forward.default",
    "aten.nll_loss2d_forward.default",
)

# Ops DTensor runs on each rank's local part without consulting any strategy (the
# sharding propagator special-cases `_local_scalar_dense`, whose registered strategy
# says Replicate only): `.item()` of a Partial tensor (a P(sum) loss logged every step)
# returns each rank's own part, of a sharded one its shard (or fails on an empty one).
# The guard redistributes the input to Replicate first.
READS_OF_ONE_RANKS_PART: tuple[str, ...] = (
    "aten._local_scalar_dense.default",
)

# Ops that update statistics in place (`running_mean`, `running_var`) which DTensor's
# strategy moves to another placement first, so the update lands on the moved copy:
# guard_batchnorm.py writes it back. op -> (indices of the updated arguments, index of
# the `training` flag, or None where the op always trains). CPU's native_batch_norm
# updates them although its schema does not mark them written.
STATS_WRITTEN: dict[str, tuple[tuple[int, ...], int | None]] = {
    "aten.native_batch_norm.default": ((3, 4), 5),
    "aten._native_batch_norm_legit.default": ((3, 4), 5),
    "aten._batch_norm_with_update.default": ((3, 4), None),
}

# Batch norm on a batch-sharded input (data parallel): DTensor's strategies shard the
# channels only, so every call moves the activations to Shard(1) and back, forward and
# backward. sync_batchnorm.py all-reduces the per-channel statistics instead where that
# moves less (SyncBatchNorm's plan). Forward overloads -> the training mode of an overload
# whose schema has no `training` flag (None: it has one); the guard's running-statistics
# handler (STATS_WRITTEN) stays their fallback.
BATCH_SHARDED_NORMS: dict[str, bool | None] = {
    "aten.native_batch_norm.default": None,
    "aten._native_batch_norm_legit.default": None,
    "aten._native_batch_norm_legit.no_stats": None,
    "aten._native_batch_norm_legit_no_training.default": False,
    "aten._batch_norm_with_update.default": True,
}
BATCH_SHARDED_NORM_BACKWARDS: tuple[str, ...] = (
    "aten.native_batch_norm_backward.default",
    "aten.batch_norm_backward.default",
)

# Strategies that compare a dim argument with the placements' dims before wrapping it,
# so a negative dim lets a Shard on the dim the op works along through, silently
# wrong (torch/distributed/tensor/_ops/_math_ops.py `scan_strategy`). Found by the
# audit's negative-dim variants (coverage/native_variants.py): of the 59 native ops
# with a dim argument whose OpInfo samples give one, only these; confirmed by DTensor
# runs in tests/test_guard_negative_dims.py. The guard hands the strategy the dims
# wrapped to >= 0 (guard_dims.py).
NEGATIVE_DIMS_UNWRAPPED: tuple[str, ...] = (
    "aten.cumsum.default",
    "aten.cumprod.default",
    "aten.logcumsumexp.default",
)

# Single-dim strategies that name a placement for an output their `output_mask`
# argument leaves out: op -> index of `output_mask`. torch 2.14's and 2.15's
# convolution_backward fails the expansion on any 2-D mesh when the input needs no
# gradient (the first convolution of every network), torch alone too; the guard gives
# those outputs None (guard_masks.py), where the op's strategy is single-dim.
OUTPUT_MASK_IGNORED: dict[str, int] = {
    "aten.convolution_backward.default": 10,
}

# Strategies whose RuntimeSchemaInfo keys DTensor's sharding cache without an argument
# their output's shape or layout depends on, so a call differing from an earlier one
# only there reuses the earlier decision: op -> (the positional index from which, the
# keyword names) the key must cover. `histc` keys from `min` on, not `bins` (a sharded
# histc(bins=1) after bins=100 claims 100 bins, every rank holding 1); `_to_copy` keys on
# `dtype` only (`.to(memory_format=channels_last)` after a plain `.to` claims contiguous
# strides). Found by the audit as runs wrong only after an earlier call (its `after`);
# the guard widens the key (guard_cache_keys.py).
CACHE_KEY_MISSES: dict[str, tuple[int | None, tuple[str, ...]]] = {
    "aten.histc.default": (1, ()),
    "aten._to_copy.default": (None, ("memory_format",)),
}

# Strategies whose rules shard two inputs along one dim whatever their sizes there:
# torch.chunk cuts each at its own size, so the ranks' pieces line up only where the
# sizes agree. `gather` offers S(d), S(d) -> S(d) off the gathered dim although its index
# may be shorter than its input there (silently wrong values; the audit's OpInfo samples
# never shard such a pair, tests/test_guard_releases.py measures it). The guard drops
# those rules at shapes where the sizes differ (guard_aligned.py).
SHARDS_MUST_LINE_UP: tuple[str, ...] = (
    "aten.gather.default",
)


# Strategies that read an argument from the keyword arguments only, while the dispatcher
# passes it by position: op -> (its position, its name). `logsumexp`'s strategy reads
# `keepdim` by name, so `torch.logsumexp(x, 0, keepdim=True)` on a Shard(1) input claims
# Shard(0) (silently wrong shape and values; every tested release). The guard hands the
# strategy the argument by name (guard_kwargs.py).
READ_BY_NAME_ONLY: dict[str, tuple[int, str]] = {
    "aten.logsumexp.default": (2, "keepdim"),
}


# In-place view ops with a strategy of their own, which DTensor applies through its
# in-place path: that path keeps `self`'s old shape when the placements do not change,
# so `x.squeeze_(-1)` of a [4, 3, 1] DTensor (any placement) stays [4, 3, 1] over [4, 3]
# locals (every tested release; `enable()`'s in-place view handler takes only the ops
# without one). op -> its out-of-place twin; the guard gives them that handler
# (inplace_views.py: the twin's view of each rank's local tensor, its whole spec set).
IN_PLACE_VIEWS_KEEPING_SHAPE: dict[str, str] = {
    "aten.squeeze_.default": "aten.squeeze.default",
    "aten.squeeze_.dim": "aten.squeeze.dim",
    "aten.squeeze_.dims": "aten.squeeze.dims",
}


def mask_key(op: str) -> str:
    """The `WRONG_ON` key of an `OUTPUT_MASK_IGNORED` fence (its op has another fence)."""
    return f"{op}/output_mask"


# The releases every fence above was measured on: the native audit's findings file of
# each, and the cases of tests/test_guard_releases.py (DTensor alone wrong where listed
# below, right where not).
TESTED_RELEASES: tuple[str, ...] = ("2.13.0", "2.14.1", "2.15.0")
_ALL = TESTED_RELEASES

# Fenced op -> the tested releases on which DTensor alone was measured wrong for it.
WRONG_ON: dict[str, tuple[str, ...]] = {
    # convolution's handlers skip their redistribution on every tested release
    "aten.convolution.default": _ALL,
    "aten.convolution_backward.default": _ALL,
    # P(sum) -> P(sum): 2.14 made `any`'s P(sum) input replicate first
    "aten.any.default": ("2.13.0",),
    "aten.any.dim": ("2.13.0",),
    "aten.any.dims": ("2.13.0",),
    "aten.fill_.Scalar": _ALL,
    "aten.threshold.default": _ALL,
    "aten.linalg_solve_triangular.default": _ALL,
    # 2.14's single-dim rule shards a mean only with the target replicated (pytorch#185167)
    "aten.nll_loss_forward.default": ("2.13.0",),
    "aten.nll_loss2d_forward.default": ("2.13.0",),
    "aten._local_scalar_dense.default": _ALL,
    "aten.native_batch_norm.default": _ALL,
    "aten._native_batch_norm_legit.default": _ALL,
    "aten._batch_norm_with_update.default": _ALL,
    # 2.14's scan strategy wraps the dim
    "aten.cumsum.default": ("2.13.0",),
    "aten.cumprod.default": ("2.13.0",),
    "aten.logcumsumexp.default": ("2.13.0",),
    # a single-dim strategy from 2.14 on; 2.13's op strategy has no such rule
    mask_key("aten.convolution_backward.default"): ("2.14.1", "2.15.0"),
    # cache keys without histc's `bins` and `_to_copy`'s `memory_format`
    "aten.histc.default": _ALL,
    "aten._to_copy.default": _ALL,
    # gather's S(d), S(d) -> S(d) for an index shorter than its input on d
    "aten.gather.default": _ALL,
    # logsumexp's strategy reads keepdim by name only
    "aten.logsumexp.default": _ALL,
    # squeeze_ keeps self's old shape
    "aten.squeeze_.default": _ALL,
    "aten.squeeze_.dim": _ALL,
    "aten.squeeze_.dims": _ALL,
}

# Fences the guard keeps where DTensor alone is right, because the fence is also the
# cheaper plan: op -> why. On a release where torch is right the guard neither warns nor
# claims to correct anything there.
KEPT_WHERE_RIGHT: dict[str, str] = {
    # 2.14 fixed the mean by replicating: a batch-sharded target and its logits are
    # all-gathered (logits are batch x vocabulary, the largest activation of a language
    # model) to compute one scalar; the handler all-reduces two scalars and gives the
    # same numbers (tests/test_guard_losses.py: right, no all-gather, on every release).
    "aten.nll_loss_forward.default": "moves two scalars where torch all-gathers the logits",
    "aten.nll_loss2d_forward.default": "moves two scalars where torch all-gathers the logits",
}


def wrong_here(key: str, release: str | None = None) -> bool:
    """Whether DTensor alone is to be taken as wrong for the fence `key` (a `WRONG_ON`
    key) on `release` (default: the running one): measured wrong there, or never
    measured there (an untested release keeps every fence)."""
    release = _compat.TORCH_RELEASE if release is None else release
    return release not in TESTED_RELEASES or release in WRONG_ON[key]


def fenced(key: str, release: str | None = None) -> bool:
    """Whether the guard installs the fence `key` on `release`: where DTensor alone is
    wrong, and where the fence is the cheaper plan (`KEPT_WHERE_RIGHT`)."""
    return key in KEPT_WHERE_RIGHT or wrong_here(key, release)
