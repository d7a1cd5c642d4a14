"""Op sets and sample inputs taken from torch's OpInfo database.

For every OpInfo in `torch.testing._internal.common_methods_invocations.op_db` we run its
first few CPU float32 sample inputs under a dispatch mode that records the aten calls
made at the *outermost* dispatch level (`dispatch_modes.record.RecordOutermostAtenCalls`).
A dispatch mode sees calls after CompositeImplicitAutograd decomposition, which is exactly the level DTensor (itself a
`__torch_dispatch__` subclass) sees, so the recorded overloads and arguments are the
ones a DTensor would be asked to shard. With `backward=True` each sample of a
differentiable OpInfo also runs its backward (`_record_backward`), recorded the same way:
the `*_backward` overloads and whatever else autograd dispatches, as a training step
would ask DTensor to shard them. Of each overload's distinct calls a few are kept, chosen
for size and variety (`sample_pick.pick_diverse`), not the first ones met: OpInfos list
their degenerate cases (0-d, size-1, default arguments) first.

Public API::

    capture_aten_samples(opinfo_filter=None, max_samples_per_opinfo=4, backward=False,
                         cache_dir=None, on_opinfo=None) -> dict[OpOverload, list[AtenSample]]
    default_cache_dir() -> str    # where `decompshard coverage` keeps the full capture
    decomp_only_ops(samples) -> list[OpOverload]   # the "decomp-only OpInfo set"
    is_backward_op(op, samples) -> bool            # *_backward*, or reached only by backward
    status_of(op) -> 'native' | 'decomp' | 'none'

Importing `op_db` takes a few seconds and a full capture runs every OpInfo's samples
(10 s on a quiet 2-core machine, minutes on a loaded one; three max_pool OpInfos are half
of it); both happen lazily, on the first capture. A full capture can be kept on disk
(`cache_dir`): the file's name holds what makes it valid (torch version and commit,
Python version, the capture's settings and this file's own source), so a new torch or a
changed capture never reads an old file. The OpInfo module sizes its samples through the
globals `S`, `M`, `L`, `XS`; we leave them as they are.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import pickle
import sys
import tempfile
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence, Union

import torch

from decompshard._compat import OpOverload
from decompshard._compat import tree_flatten, tree_map

from decompshard._paths import cache_dir
from decompshard.coverage import sample_pick
from decompshard.coverage.sample_pick import pick_diverse
from decompshard.dispatch_modes import record
from decompshard.dispatch_modes.record import RecordOutermostAtenCalls, exact_clone

__all__ = [
    "AtenSample",
    "capture_aten_samples",
    "capture_is_cached",
    "clear_capture_cache",
    "decomp_only_ops",
    "dedupe_key",
    "default_cache_dir",
    "has_decomposition",
    "has_dtensor_strategy",
    "is_backward_op",
    "keepable",
    "status_of",
]

OpInfoFilter = Union[None, str, Iterable[str], Callable[[Any], bool]]
OnOpInfo = Callable[[int, int, str], None]  # (OpInfos done, OpInfos in all, the last one's name)


# ----------------------------------------------------------------------------- sample


@dataclass(frozen=True, eq=False)
class AtenSample:
    """One aten call recorded while running an OpInfo sample.

    `args`/`kwargs` are exactly what the aten overload was called with (tensors are
    private copies taken before the call, so in-place ops later in the same OpInfo
    sample did not alter them).
    """

    op: OpOverload
    args: tuple
    kwargs: dict = field(default_factory=dict)
    opinfo_name: str = ""
    backward: bool = False  # recorded during autograd's backward of the sample, not its forward

    def flat_args(self) -> list[Any]:
        """All leaves of `(args, kwargs)` in schema order (lists of tensors flattened)."""
        return tree_flatten((self.args, self.kwargs))[0]

    def tensors(self) -> list[torch.Tensor]:
        """Tensor inputs in schema order, as `tree_flatten((args, kwargs))` leaves."""
        return [x for x in self.flat_args() if isinstance(x, torch.Tensor)]

    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(t.shape) for t in self.tensors()]

    def has_tensor_input(self) -> bool:
        return any(isinstance(x, torch.Tensor) for x in self.flat_args())

    def cloned_args(self) -> tuple[tuple, dict]:
        """Fresh copies of args/kwargs (tensors cloned exactly, storage included)."""
        return tree_map(exact_clone, (self.args, self.kwargs))

    def run(self) -> Any:
        """Run the op on fresh copies of the recorded args (the sample stays intact)."""
        args, kwargs = self.cloned_args()
        return self.op(*args, **kwargs)

    def __repr__(self) -> str:
        def show(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return _TensorRepr(tuple(x.shape), x.dtype)
            return x

        args, kwargs = tree_map(show, (self.args, self.kwargs))
        return f"AtenSample({self.op}, args={args!r}, kwargs={kwargs!r}, opinfo={self.opinfo_name!r})"


@dataclass(frozen=True)
class _TensorRepr:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __repr__(self) -> str:
        return f"T{list(self.shape)}:{str(self.dtype).replace('torch.', '')}"


def _opinfo_matches(opinfo: Any, opinfo_filter: OpInfoFilter) -> bool:
    if opinfo_filter is None:
        return True
    if callable(opinfo_filter):
        return bool(opinfo_filter(opinfo))
    names = {opinfo_filter} if isinstance(opinfo_filter, str) else set(opinfo_filter)
    return opinfo.name in names or opinfo.full_name in names


def _filter_key(opinfo_filter: OpInfoFilter) -> Any:
    if opinfo_filter is None or callable(opinfo_filter):
        return opinfo_filter
    if isinstance(opinfo_filter, str):
        return frozenset({opinfo_filter})
    return frozenset(opinfo_filter)


def dedupe_key(op: OpOverload, args: tuple, kwargs: dict) -> tuple:
    """What makes two recorded calls the same sample: the op, its tensors' shapes and dtypes
    and its non-tensor arguments (tensor values do not count)."""

    def norm(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return _TensorRepr(tuple(x.shape), x.dtype)
        return x

    return (op, repr(tree_map(norm, (args, kwargs))))


def keepable(args: tuple, kwargs: dict) -> bool:
    """False for a call with a zero-size tensor dim or a non-strided (sparse, ...) tensor:
    such calls are dropped (nothing to shard, or nothing DTensor shards)."""
    for leaf in tree_flatten((args, kwargs))[0]:
        if isinstance(leaf, torch.Tensor):
            if 0 in leaf.shape or leaf.layout is not torch.strided:
                return False
    return True


_CAPTURE_CACHE: dict[Any, dict[OpOverload, list[AtenSample]]] = {}


def clear_capture_cache() -> None:
    _CAPTURE_CACHE.clear()


def capture_aten_samples(
    opinfo_filter: OpInfoFilter = None,
    max_samples_per_opinfo: int | None = 4,
    *,
    max_samples_per_op: int | None = 4,
    backward: bool = False,
    cache_dir: str | None = None,
    on_opinfo: OnOpInfo | None = None,
) -> dict[OpOverload, list[AtenSample]]:
    """Aten overloads reached by OpInfo samples, with a few distinct samples each.

    opinfo_filter: None (all of op_db), an OpInfo name / full name (``"linspace"``,
        ``"linspace.tensor_overload"``), an iterable of them, or a predicate on OpInfo.
    max_samples_per_opinfo: how many of each OpInfo's CPU float32 sample inputs to run
        (the first ones; None runs them all: ~2x slower, a few more overloads).
    max_samples_per_op: distinct samples kept per aten overload, best first: chosen among
        all the overload's distinct samples for size and variety (`sample_pick`: non-degenerate,
        new tensor ranks, new non-tensor argument values, larger), not the first ones met
        (None keeps all, in capture order).
    backward: also run each sample's backward where the OpInfo is differentiable (see
        `_record_backward`) and keep the aten calls autograd makes, as samples with
        `backward=True`. The forward samples are the same either way: backward samples
        only fill an op's bucket (up to max_samples_per_op) after the whole forward capture, so a
        forward-only request is served from a backward capture by dropping them.
    cache_dir: keep a full capture (no filter) on disk there, and read it back when it
        is valid for this torch and this code (`default_cache_dir()` is the usual
        place); None: in-process only.
    on_opinfo: called after each OpInfo of a capture that really runs (progress).

    Samples are deduplicated by (op, tensor shapes/dtypes, non-tensor args); samples
    with a zero-size tensor dim (or a sparse tensor) are dropped; exceptions raised by
    an OpInfo sample are swallowed (calls recorded before the error are kept). The
    result is cached in-process; callers get a fresh dict of fresh lists.
    """
    fkey = _filter_key(opinfo_filter)
    cached = _CAPTURE_CACHE.get((fkey, max_samples_per_opinfo, max_samples_per_op, backward))
    if cached is None and not backward:  # a backward capture holds the forward one
        cached = _forward_part(_CAPTURE_CACHE.get((fkey, max_samples_per_opinfo, max_samples_per_op, True)))
    path = None
    if cache_dir is not None and opinfo_filter is None:
        path = os.path.join(cache_dir, _cache_file_name(max_samples_per_opinfo, max_samples_per_op, backward))
        if cached is None:
            cached = _load(path)
        if cached is None and not backward:
            cached = _forward_part(_load(os.path.join(
                cache_dir, _cache_file_name(max_samples_per_opinfo, max_samples_per_op, True))))
        if cached is not None and not os.path.exists(path):  # captured in this process before: keep it
            _save(path, cached)
    if cached is None:
        cached = _capture(opinfo_filter, max_samples_per_opinfo, max_samples_per_op, on_opinfo, backward)
        if path is not None:
            _save(path, cached)
    _CAPTURE_CACHE[(fkey, max_samples_per_opinfo, max_samples_per_op, backward)] = cached
    return {op: list(samples) for op, samples in cached.items()}


def _forward_part(captured: dict[OpOverload, list[AtenSample]] | None) -> dict[OpOverload, list[AtenSample]] | None:
    """The forward capture inside a backward one (None stays None)."""
    if captured is None:
        return None
    out = {op: [s for s in samples if not s.backward] for op, samples in captured.items()}
    return {op: samples for op, samples in out.items() if samples}


def capture_is_cached(max_samples_per_opinfo: int | None = 4, *, max_samples_per_op: int | None = 4,
                      backward: bool = False, cache_dir: str | None = None) -> bool:
    """Whether a full capture with these settings is already here (in-process or on disk):
    a caller can say "capturing..." only when it will."""
    modes = (backward,) if backward else (False, True)
    if any((None, max_samples_per_opinfo, max_samples_per_op, b) in _CAPTURE_CACHE for b in modes):
        return True
    return cache_dir is not None and any(os.path.isfile(
        os.path.join(cache_dir, _cache_file_name(max_samples_per_opinfo, max_samples_per_op, b))) for b in modes)


def _capture(
    opinfo_filter: OpInfoFilter,
    max_samples_per_opinfo: int | None,
    max_samples_per_op: int | None,
    on_opinfo: OnOpInfo | None = None,
    backward: bool = False,
) -> dict[OpOverload, list[AtenSample]]:
    from decompshard._compat import op_db  # slow import

    pools: dict[OpOverload, list[AtenSample]] = {}  # every distinct forward candidate, cut back as it grows
    seen: set[tuple] = set()
    bwd: dict[OpOverload, list[AtenSample]] | None = {} if backward else None
    bwd_seen: set[tuple] = set()  # its own: a backward call must never keep a forward one out
    chosen = [o for o in op_db if _opinfo_matches(o, opinfo_filter)]
    threads = torch.get_num_threads()
    # One intra-op thread: the samples are tiny, and extra threads only add overhead (the
    # max_pool OpInfos, half of a capture, run 7x faster with one thread on a busy 2-core
    # machine). Which aten calls are made, and their inputs, do not depend on it.
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings(), torch.random.fork_rng(devices=[]):
            warnings.simplefilter("ignore")
            for done, opinfo in enumerate(chosen, 1):
                _capture_one(opinfo, max_samples_per_opinfo, max_samples_per_op, pools, seen, bwd, bwd_seen)
                if on_opinfo is not None:
                    on_opinfo(done, len(chosen), opinfo.full_name)
    finally:
        torch.set_num_threads(threads)
    result = {op: _choose(pool, max_samples_per_op) for op, pool in pools.items()}
    for op, pool in (bwd or {}).items():  # after the forward: the forward buckets stay as they were
        fresh = [s for s in pool if dedupe_key(op, s.args, s.kwargs) not in seen]
        bucket = result.setdefault(op, [])
        room = None if max_samples_per_op is None else max(0, max_samples_per_op - len(bucket))
        bucket.extend(_choose(fresh, room))
        if not bucket:
            del result[op]
    return result


# Distinct candidates held per overload while capturing. A pool that reaches twice this is
# cut back to its best `_POOL` by the same criterion (`pick_diverse`), so memory stays
# bounded however many samples an OpInfo yields, and late samples (OpInfos list their
# degenerate cases first) still compete.
_POOL = 32


def _choose(pool: list[AtenSample], k: int | None) -> list[AtenSample]:
    """The k samples an overload keeps, best first (`sample_pick`); None keeps all, in
    capture order."""
    return list(pool) if k is None else pick_diverse(pool, k)


def _add(calls: list[tuple[OpOverload, tuple, dict]], opinfo_name: str, max_samples_per_op: int | None,
         pools: dict[OpOverload, list[AtenSample]], seen: set[tuple], backward: bool,
         exclude: set[tuple] | None = None) -> None:
    """Pool the recorded calls that are new (not in `seen` nor `exclude`); a full pool is
    cut back to its best `_POOL`, kept in capture order."""
    for op, args, kwargs in calls:
        if not keepable(args, kwargs):
            continue
        dkey = dedupe_key(op, args, kwargs)
        if dkey in seen or (exclude is not None and dkey in exclude):
            continue
        seen.add(dkey)
        pool = pools.setdefault(op, [])
        pool.append(AtenSample(op, args, kwargs, opinfo_name, backward))
        if max_samples_per_op is not None:
            cap = max(_POOL, max_samples_per_op)
            if len(pool) >= 2 * cap:
                kept = {id(x) for x in pick_diverse(pool, cap)}
                pool[:] = [x for x in pool if id(x) in kept]


def _capture_one(opinfo: Any, max_samples_per_opinfo: int | None, max_samples_per_op: int | None,
                 pools: dict[OpOverload, list[AtenSample]], seen: set[tuple],
                 bwd: dict[OpOverload, list[AtenSample]] | None = None,
                 bwd_seen: set[tuple] | None = None) -> None:
    # Seed per OpInfo: sample values do not depend on the filter. The global RNG state
    # is restored by fork_rng when the capture ends.
    torch.manual_seed(0)
    try:
        if not opinfo.supports_dtype(torch.float32, "cpu"):
            return
        gen = _sample_inputs(opinfo)
        sample_inputs = list(itertools.islice(gen, max_samples_per_opinfo))
    except Exception:
        return
    for index, sample in enumerate(sample_inputs):
        recorder = RecordOutermostAtenCalls()
        try:
            with recorder:
                # The OpInfo calling convention (OpInfo.__call__ / test_ops).
                opinfo.op(sample.input, *sample.args, **sample.kwargs)
        except Exception:
            pass
        _add(recorder.calls, opinfo.full_name, max_samples_per_op, pools, seen, False)
        if bwd is not None and getattr(opinfo, "supports_autograd", False):
            calls = _record_backward(opinfo, sample, index)
            _add(calls, opinfo.full_name, max_samples_per_op, bwd, bwd_seen if bwd_seen is not None else set(), True,
                 exclude=seen)


def _record_backward(opinfo: Any, sample: Any, index: int) -> list[tuple[OpOverload, tuple, dict]]:
    """The aten calls autograd makes for one sample's backward, as DTensor would see them.

    Every floating tensor of the sample is copied into a leaf that requires grad (the
    values do not change), the forward runs unrecorded, and `torch.autograd.grad` of
    every differentiable output against a random grad_output (seeded by the OpInfo and
    sample index, from its own generator) runs under the recorder. The global RNG is
    forked, so a random forward does not shift anything the forward capture draws. A
    sample whose forward or backward raises contributes the calls made before the error.
    """
    leaves: list[torch.Tensor] = []

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dtype.is_floating_point and x.layout is torch.strided:
            y = x.detach().clone().requires_grad_(True)
            leaves.append(y)
            return y
        return x

    recorder = RecordOutermostAtenCalls()
    with torch.random.fork_rng(devices=[]), torch.enable_grad():
        try:
            inp, args, kwargs = tree_map(leaf, (sample.input, tuple(sample.args), dict(sample.kwargs)))
            out = opinfo.op(inp, *args, **kwargs)
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.grad_fn is not None
                    and (t.dtype.is_floating_point or t.dtype.is_complex)]
            if not outs:
                return []
            gen = torch.Generator().manual_seed(zlib.crc32(f"{opinfo.full_name}/{index}".encode()))
            grads = [torch.randn(t.shape, dtype=t.dtype, generator=gen) for t in outs]
            with recorder:
                torch.autograd.grad(outs, leaves, grads, allow_unused=True)
        except Exception:
            pass
    return recorder.calls


# ----------------------------------------------------------------------------- disk cache


def default_cache_dir() -> str:
    """$DECOMPSHARD_CACHE_DIR, else $XDG_CACHE_HOME/decompshard, else ~/.cache/decompshard."""
    return cache_dir()


def _cache_file_name(max_samples_per_opinfo: int | None, max_samples_per_op: int | None,
                     backward: bool = False) -> str:
    """Everything that decides a capture's content is in the name: a file is either valid
    or never looked at (no stale reads, no version field to forget)."""
    digest = hashlib.sha256()
    for source in (__file__, record.__file__, sample_pick.__file__):  # the capture's code, its recorder, how it chooses
        with open(source, "rb") as f:
            digest.update(f.read())
    code = digest.hexdigest()[:12]
    commit = (getattr(torch.version, "git_version", None) or "unknown")[:12]
    per_opinfo = "all" if max_samples_per_opinfo is None else max_samples_per_opinfo
    per_op = "all" if max_samples_per_op is None else max_samples_per_op
    return (f"opinfo-samples-torch{torch.__version__}-{commit}-py{sys.version_info[0]}{sys.version_info[1]}"
            f"-{code}-{per_opinfo}-{per_op}{'-bwd' if backward else ''}.pkl")


def _load(path: str) -> dict[OpOverload, list[AtenSample]] | None:
    """The capture kept at `path`; None when there is none or it cannot be read (a
    truncated or foreign file is not an error: the caller captures afresh)."""
    try:
        with open(path, "rb") as f:
            rows = pickle.load(f)
        out: dict[OpOverload, list[AtenSample]] = {}
        for name, args, kwargs, opinfo_name, backward in rows:
            op = _overload(name)
            out.setdefault(op, []).append(AtenSample(op, args, kwargs, opinfo_name, backward))
        return out
    except Exception:  # noqa: BLE001 - any unreadable cache is a cache miss
        return None


def _save(path: str, captured: dict[OpOverload, list[AtenSample]]) -> None:
    """Write atomically (a temporary file renamed into place), so an interrupted write or
    two concurrent runs never leave a half file; an unwritable folder only costs speed."""
    rows = [(str(op), s.args, s.kwargs, s.opinfo_name, s.backward) for op, samples in captured.items() for s in samples]
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                pickle.dump(rows, f, protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except Exception:  # noqa: BLE001 - a read-only home, a full disk, an unpicklable arg
        return


def _overload(name: str) -> OpOverload:
    """'aten.addmv.default' -> torch.ops.aten.addmv.default."""
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


def _sample_inputs(opinfo: Any) -> Iterable[Any]:
    """CPU float32 sample inputs of an OpInfo, without `OpInfo.sample_inputs`' wrapper.

    `OpInfo.sample_inputs` wraps the generator in a `TrackedInputIter` whose bookkeeping
    calls `inspect.stack()` (reading source context of every frame) once or twice per
    OpInfo: ~10x slower than the samples themselves under pytest. The wrapper only adds
    test-tracking and per-sample reseeding; the samples are the same generator.
    """
    func = getattr(opinfo, "sample_inputs_func", None)
    if func is None:  # pragma: no cover - every OpInfo has one today
        return opinfo.sample_inputs("cpu", torch.float32)
    return func(opinfo, "cpu", torch.float32, False)


# ----------------------------------------------------------------------------- op sets


def has_dtensor_strategy(op: OpOverload) -> bool:
    """DTensor has a registered single-dim strategy, op strategy or legacy rule."""
    from decompshard._compat import has_native_strategy

    return has_native_strategy(op)


def has_decomposition(op: OpOverload) -> bool:
    """Same test as torch's `DecompShardingStrategy.has_decomp`."""
    from decompshard._compat import torch_decomposition_table

    return op in torch_decomposition_table() or op._can_decompose()


def status_of(op: OpOverload) -> str:
    """'native' if DTensor has a registered strategy, else 'decomp' if the op has a
    decomposition (DTensor's fallback may handle it), else 'none'."""
    if has_dtensor_strategy(op):
        return "native"
    if has_decomposition(op):
        return "decomp"
    return "none"


def is_backward_op(op: OpOverload, samples: Sequence[AtenSample] = ()) -> bool:
    """A backward op: an `*_backward*` overload, or one the capture reached only through
    autograd's backward (no forward sample). What a training step adds to the forward."""
    return "_backward" in op._opname or (bool(samples) and all(s.backward for s in samples))


def _is_random(op: OpOverload) -> bool:
    return torch.Tag.nondeterministic_seeded in op.tags


def decomp_only_ops(samples: dict[OpOverload, list[AtenSample]]) -> list[OpOverload]:
    """The decomp-only OpInfo set: overloads reached by the samples that have a
    decomposition but no DTensor strategy, take at least one tensor input in some
    sample, and are not random. Sorted by name."""
    out = []
    for op, op_samples in samples.items():
        if op.namespace != "aten" or _is_random(op):
            continue
        if status_of(op) != "decomp":
            continue
        if not any(s.has_tensor_input() for s in op_samples):
            continue
        out.append(op)
    return sorted(out, key=str)


if __name__ == "__main__":  # pragma: no cover
    import time

    t0 = time.perf_counter()
    caught = capture_aten_samples()
    t1 = time.perf_counter()
    ops = decomp_only_ops(caught)
    print(f"captured {len(caught)} aten overloads in {t1 - t0:.1f}s")
    print(f"decomp-only OpInfo set: {len(ops)} overloads")
    for o in ops:
        print(f"  {o}  ({caught[o][0].opinfo_name})")
