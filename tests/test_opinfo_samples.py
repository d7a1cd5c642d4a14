"""Op sets and samples captured from torch's OpInfo database (real op_db, torch 2.13)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_flatten

from decompshard.coverage.opinfo_samples import (
    AtenSample,
    capture_aten_samples,
    decomp_only_ops,
    status_of,
)
from decompshard.dispatch_modes.record import RecordOutermostAtenCalls

aten = torch.ops.aten


@pytest.fixture(scope="module")
def samples():
    # The first capture imports op_db (a few seconds); later ones hit the cache.
    return capture_aten_samples()


@pytest.fixture(scope="module")
def decomp_set(samples):
    ops = decomp_only_ops(samples)
    print(f"\ndecomp-only OpInfo set ({len(ops)}):")
    for op in ops:
        print(f"  {op}")
    return ops


def test_decomp_only_set_members(decomp_set):
    ops = set(decomp_set)
    for op in (
        aten.addmv.default,
        aten.trace.default,
        aten.channel_shuffle.default,
        aten.mse_loss.default,
        aten.permute_copy.default,
        aten.t_copy.default,
        aten.block_diag.default,
        aten.mv.default,
    ):
        assert op in ops, op
    # native DTensor strategies, factory ops (no tensor input), random ops
    for op in (
        aten.mul.Tensor,
        aten.add.Tensor,
        aten.arange.default,
        aten.zeros.default,
        aten.eye.default,
    ):
        assert op not in ops, op


def test_decomp_only_set_size_and_shape(decomp_set):
    # 67 overloads in torch 2.13 with the first 4 samples of each OpInfo
    # (72 when every sample is run).
    assert 55 <= len(decomp_set) <= 85
    assert decomp_set == sorted(decomp_set, key=str)
    assert len(set(decomp_set)) == len(decomp_set)
    for op in decomp_set:
        assert op.namespace == "aten"
        assert status_of(op) == "decomp"
        assert torch.Tag.nondeterministic_seeded not in op.tags


def test_decomp_only_filters_need_tensor_inputs(samples):
    # Factory ops with a decomposition are reached, but take no tensor input.
    assert aten.arange.default in samples
    assert status_of(aten.arange.default) == "decomp"
    assert not any(s.has_tensor_input() for s in samples[aten.arange.default])


def test_status_of():
    assert status_of(aten.mul.Tensor) == "native"
    assert status_of(aten.addmv.default) == "decomp"
    assert status_of(aten.trace.default) == "decomp"
    assert status_of(aten.nonzero.default) == "none"


def test_samples_are_well_formed(samples):
    assert len(samples) > 300
    for op, op_samples in samples.items():
        assert op.namespace == "aten"
        assert 1 <= len(op_samples) <= 4
        keys = set()
        for s in op_samples:
            assert isinstance(s, AtenSample)
            assert s.op is op
            assert s.opinfo_name
            for t in s.tensors():
                assert 0 not in t.shape, (op, s)
                assert t.layout is torch.strided
            key = (tuple((tuple(t.shape), t.dtype) for t in s.tensors()), repr(s))
            assert key not in keys, f"duplicate sample for {op}: {s}"
            keys.add(key)


def test_every_sample_runs(samples):
    failures = []
    for op, op_samples in samples.items():
        for s in op_samples:
            try:
                s.run()
            except Exception as e:  # pragma: no cover - reported below
                failures.append(f"{op} ({s.opinfo_name}): {e}")
    assert not failures, "\n".join(failures[:20])


def test_samples_record_the_aten_level_args(samples):
    # addmv's OpInfo calls torch.addmv(input, mat, vec): the aten call sees 3 tensors.
    s = samples[aten.addmv.default][0]
    assert len(s.tensors()) == 3
    inp, mat, vec = s.tensors()
    assert mat.dim() == 2 and vec.dim() == 1 and mat.shape[1] == vec.shape[0]
    # CompositeImplicitAutograd ops are seen decomposed, as DTensor sees them:
    # aten.linear is CompositeImplicit, so its OpInfo shows up as addmm/mm/... calls.
    assert aten.linear.default not in samples
    assert aten.addmm.default in samples or aten.mm.default in samples


def _bits(t: torch.Tensor) -> tuple:
    """A tensor as its layout and the raw bytes of its whole storage: equal only if
    bit for bit the same (NaN included), whatever the view."""
    raw = torch.tensor([], dtype=torch.uint8).set_(t.untyped_storage()).clone()
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), raw)


def _same_bits(a: tuple, b: tuple) -> bool:
    return a[:4] == b[:4] and torch.equal(a[4], b[4])


def test_samples_are_private_copies(samples):
    """Running a sample of an in-place op (what every caller does: `run()`) writes into
    fresh copies: the stored tensors, and those the next capture hands out, stay bit for
    bit as recorded. Among those samples many really change their input when run, so a
    `run()` on the stored tensors themselves would show."""
    assert aten.add_.Tensor in samples
    mutable = [s for op in samples if op._schema.is_mutable for s in samples[op]]
    assert len(mutable) > 10
    before = [[_bits(t) for t in s.tensors()] for s in mutable]
    writes = 0
    for s, bits in zip(mutable, before):
        args, kwargs = s.cloned_args()
        try:
            s.op(*args, **kwargs)  # the op on copies of its own: does it write?
        except Exception:
            pass
        copies = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        writes += any(not _same_bits(_bits(c), b) for c, b in zip(copies, bits))
        s.run()
    assert writes > 10, writes
    for s, bits in zip(mutable, before):
        assert all(_same_bits(_bits(t), b) for t, b in zip(s.tensors(), bits)), s
    again = capture_aten_samples()  # the in-process cache hands out the same recording
    for s, bits in zip(mutable, before):
        twin = next(x for x in again[s.op] if repr(x) == repr(s))
        assert all(_same_bits(_bits(t), b) for t, b in zip(twin.tensors(), bits)), s


def test_the_recorder_copies_arguments_before_the_call():
    """The recorder keeps each call's arguments as they were when the call was made: an
    in-place op, a later one, or a write after recording leave them alone."""
    x = torch.arange(4.0)
    with RecordOutermostAtenCalls() as rec:
        x.add_(1)
        x.mul_(2)
    x.zero_()
    calls = {op: args for op, args, _ in rec.calls}
    assert torch.equal(calls[aten.add_.Tensor][0], torch.arange(4.0))
    assert torch.equal(calls[aten.mul_.Tensor][0], torch.arange(4.0) + 1)


def test_as_strided_sample_keeps_storage(samples):
    """Tensors are copied with their storage, offset and strides, so as_strided-style ops
    (which address the storage, not the view) replay exactly: a view into the middle of
    a storage, recorded and run again, reads what the original call read."""
    base = torch.arange(10.0)
    view = base[3:7]  # storage offset 3, storage of 10
    with RecordOutermostAtenCalls() as rec:
        want = view.as_strided((2,), (2,), 1)  # storage elements 1 and 3: outside the view
    op, args, kwargs = next(c for c in rec.calls if c[0] is aten.as_strided.default)
    replay = AtenSample(op, args, kwargs).run()
    assert torch.equal(replay, want) and replay.tolist() == [1.0, 3.0]
    # every captured tensor's copy has the recorded layout and storage, bit for bit
    offset = 0
    for op_samples in samples.values():
        for s in op_samples:
            copies = [x for x in tree_flatten(s.cloned_args())[0] if isinstance(x, torch.Tensor)]
            for c, t in zip(copies, s.tensors()):
                assert _same_bits(_bits(c), _bits(t)), s
                offset += t.storage_offset() != 0
    assert offset > 0  # the capture holds views with an offset: the layout is exercised
    for op in (aten.as_strided.default, aten.as_strided_copy.default):
        assert samples[op]
        for s in samples[op]:
            assert torch.equal(s.run(), s.op(*s.args, **s.kwargs)), s


def test_capture_is_cached_and_filterable(samples, monkeypatch):
    from decompshard.coverage import opinfo_samples as o

    with monkeypatch.context() as m:  # a second capture is served from the cache: nothing runs
        m.setattr(o, "_capture", lambda *a, **k: pytest.fail("captured again instead of using the cache"))
        again = capture_aten_samples()
    assert again.keys() == samples.keys()
    assert again is not samples  # callers get a fresh dict

    only = capture_aten_samples("addmv")
    assert aten.addmv.default in only
    assert aten.mse_loss.default not in only
    assert all(s.opinfo_name == "addmv" for v in only.values() for s in v)
    assert decomp_only_ops(only) == [aten.addmv.default]

    by_pred = capture_aten_samples(lambda oi: oi.name == "nn.functional.channel_shuffle")
    assert decomp_only_ops(by_pred) == [aten.channel_shuffle.default]


def test_capture_leaves_rng_alone(samples):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    capture_aten_samples("nn.functional.dropout", max_samples_per_opinfo=2)  # random op
    assert torch.equal(torch.rand(3), expected)


# ------------------------------------------------------------------ the capture kept on disk


def _same(a, b) -> bool:
    from torch.utils._pytree import tree_flatten

    fa, sa = tree_flatten((a.args, a.kwargs))
    fb, sb = tree_flatten((b.args, b.kwargs))
    if sa != sb or a.opinfo_name != b.opinfo_name or a.op is not b.op:
        return False
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor):
            if (x.dtype, x.shape, x.stride(), x.storage_offset()) != (y.dtype, y.shape, y.stride(), y.storage_offset()):
                return False
            if x.is_conj() != y.is_conj() or x.is_neg() != y.is_neg():
                return False
            xs = torch.tensor([], dtype=x.dtype).set_(x.untyped_storage())
            ys = torch.tensor([], dtype=y.dtype).set_(y.untyped_storage())
            if not torch.equal(xs, ys) and not (xs.is_floating_point() and torch.allclose(xs, ys, equal_nan=True, rtol=0, atol=0)):
                return False
        elif not (x == y or (x != x and y != y)):
            return False
    return True


def test_a_capture_kept_on_disk_reads_back_as_captured(opinfo_cache):
    """`decompshard coverage` keeps the capture on disk; read back in a process that never
    captured, it is the same samples, in the same order, storage and strides included."""
    from decompshard.coverage import opinfo_samples as o

    captured = capture_aten_samples(max_samples_per_opinfo=1)  # this process's own capture
    kept = dict(o._CAPTURE_CACHE)
    o.clear_capture_cache()
    try:
        assert o.capture_is_cached(1, cache_dir=str(opinfo_cache))
        back = capture_aten_samples(max_samples_per_opinfo=1, cache_dir=str(opinfo_cache))
    finally:
        o._CAPTURE_CACHE.clear()
        o._CAPTURE_CACHE.update(kept)
    assert list(back) == list(captured)
    for op in captured:
        assert len(back[op]) == len(captured[op])
        assert all(_same(a, b) for a, b in zip(captured[op], back[op])), op


def test_the_cache_file_is_keyed_by_torch_and_the_capture_code(tmp_path):
    from decompshard.coverage import opinfo_samples as o

    name = o._cache_file_name(1, 4)
    assert torch.__version__ in name and name.endswith("-1-4.pkl")
    assert name != o._cache_file_name(None, 4)
    # an unreadable file is a miss (captured again), never an error
    (tmp_path / name).write_bytes(b"not a pickle")
    assert o._load(str(tmp_path / name)) is None
    assert o._load(str(tmp_path / "missing.pkl")) is None
