"""Op sets and samples captured from torch's OpInfo database (real op_db, torch 2.13)."""

from __future__ import annotations

import time

import pytest
import torch

from decompshard.coverage.opinfo_samples import (
    AtenSample,
    capture_aten_samples,
    decomp_only_ops,
    status_of,
)

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


def test_samples_are_private_copies(samples):
    # In-place ops: running the sample must not change the stored args.
    assert aten.add_.Tensor in samples
    mutable = [op for op in samples if op._schema.is_mutable]
    assert len(mutable) > 10
    for op in mutable:
        for s in samples[op]:
            before = [t.clone() for t in s.tensors()]
            s.run()
            for a, b in zip(before, s.tensors()):
                assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()), op


def test_as_strided_sample_keeps_storage(samples):
    # Tensors are cloned with their storage/offset/strides, so as_strided-style ops
    # replay exactly.
    for op in (aten.as_strided.default, aten.as_strided_copy.default):
        for s in samples.get(op, []):
            s.run()


def test_capture_is_cached_and_filterable(samples):
    t0 = time.perf_counter()
    again = capture_aten_samples()
    assert time.perf_counter() - t0 < 0.5
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
