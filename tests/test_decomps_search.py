"""decomps/search.py: searchsorted, _trilinear, _pdist_forward/_pdist_backward and
_conj_physical had neither a DTensor strategy nor a decomposition. Each decomposition is
checked against the real kernel (OpInfo samples and edge cases), then the rules derived
from it against the numerics, then real DTensors under enable() against one device."""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_map

from decompshard import derive_rules
from decompshard.dispatch_modes.decomps.search import SEARCH_DECOMPOSITIONS, _conj_physical, _hash_tensor, _pdist_backward, _pdist_forward, _searchsorted, _searchsorted_scalar, _trilinear
from decompshard.verify.rule_check import check_rules
from decompshard.verify.dtensor_case import device_mesh, parse_placements, rank_locals, run_case
from decompshard.runtime.enable import switched

aten = torch.ops.aten
NAN = float("nan")


def _same(got: torch.Tensor, want: torch.Tensor, exact: bool = True) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    if got.dtype == torch.uint64:  # torch.equal has no uint64 kernel
        got, want = got.view(torch.int64), want.view(torch.int64)
    if got.is_complex():
        got, want = torch.view_as_real(got.to(torch.complex128)), torch.view_as_real(want.to(torch.complex128))
    if exact:
        return torch.equal(got, want) or bool(((got == want) | (got.isnan() & want.isnan())).all())
    return torch.allclose(got, want, rtol=1e-9, atol=1e-12, equal_nan=True)


@pytest.fixture(scope="module")
def opinfo_samples():
    from decompshard.coverage.opinfo_samples import capture_aten_samples

    names = {"searchsorted", "nn.functional.bilinear", "nn.functional.pdist", "conj_physical", "hash_tensor"}
    return capture_aten_samples(lambda o: o.name in names, None, max_samples_per_op=None)


def test_every_decomposition_matches_the_kernel_on_opinfo_samples(opinfo_samples):
    ran = {}
    for op, fn in SEARCH_DECOMPOSITIONS.items():
        exact = op.__name__.startswith("searchsorted")  # integer results; the rest in float64
        for s in opinfo_samples.get(op, []):
            args, kwargs = tree_map(lambda t: t if exact or not isinstance(t, torch.Tensor) or not t.is_floating_point()
                                    else t.double(), s.cloned_args())
            want = op(*args, **kwargs)
            got = fn(*args, **kwargs)
            assert _same(got, want, exact=exact), (s, got, want)
            ran[op] = ran.get(op, 0) + 1
    # OpInfo reaches all but the backward (autograd calls it; tested below)
    assert set(ran) >= {aten.searchsorted.Tensor, aten.searchsorted.Scalar, aten._trilinear.default,
                        aten._pdist_forward.default, aten.hash_tensor.default}
    assert ran[aten.searchsorted.Tensor] >= 50 and ran[aten.searchsorted.Scalar] >= 20


def _sequences(n: int, batch: tuple, dtype: torch.dtype, g: torch.Generator) -> list[torch.Tensor]:
    """Sorted with ties, unsorted, and (floating) with NaN in it: the kernel's binary
    search is defined on all of them, the decomposition must follow it on every one."""
    raw = torch.randint(-3, 4, batch + (n,), generator=g).to(dtype)
    out = [raw.sort(-1).values, raw]
    if dtype.is_floating_point and n > 1:
        nan_last = raw.sort(-1).values.clone()
        nan_last[..., -1] = NAN
        nan_mid = raw.clone()
        nan_mid[..., n // 2] = NAN
        out += [nan_last, nan_mid]
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int32, torch.uint8, torch.bfloat16])
def test_searchsorted_follows_the_kernel_on_every_input(dtype):
    g = torch.Generator().manual_seed(0)
    sides = [{}, {"side": "right"}, {"right": True, "out_int32": True}]
    checked = 0
    for n, vshape, nd in itertools.product([0, 1, 5, 8], [(), (6,), (3, 6)], [False, True]):
        if nd and not vshape:
            continue
        for seq in _sequences(n, vshape[:-1] if nd else (), dtype, g):
            values = torch.randint(-4, 5, vshape, generator=g).to(dtype)
            if dtype.is_floating_point and values.numel() > 1:
                values.view(-1)[0] = NAN
            for kw, use_sorter in itertools.product(sides, [False, True]):
                k = dict(kw, sorter=torch.argsort(seq, dim=-1, stable=True)) if use_sorter else kw
                want = aten.searchsorted.Tensor(seq, values, **k)
                assert _same(_searchsorted(seq, values, **k), want), (seq, values, k)
                checked += 1
                if not nd:
                    for scalar in (2, 2.5) + ((0.1, NAN) if dtype.is_floating_point else (-1,)):
                        want = aten.searchsorted.Scalar(seq, scalar, **k)
                        assert _same(_searchsorted_scalar(seq, scalar, **k), want), (seq, scalar, k)
    assert checked > 150


def test_searchsorted_promotes_like_the_kernel():
    """The kernel compares in result_type(boundaries, values): a 0-d or Python-float value
    against float32 boundaries is compared in float32, an int sequence against 2.5 in
    float (not truncated)."""
    seq32 = torch.tensor([0.1, 0.2, 0.3])
    for value in (0.1, torch.tensor(0.1, dtype=torch.float64)):
        op = aten.searchsorted.Scalar if isinstance(value, float) else aten.searchsorted.Tensor
        fn = _searchsorted_scalar if isinstance(value, float) else _searchsorted
        assert fn(seq32, value, right=True).item() == op(seq32, value, right=True).item() == 1
    ints = torch.tensor([1, 2, 3])
    assert _searchsorted_scalar(ints, 2.5).item() == aten.searchsorted.Scalar(ints, 2.5).item() == 2
    for a, b in itertools.product([torch.float32, torch.float64, torch.int64, torch.int32], repeat=2):
        seq = (torch.arange(9) * 0.7 - 3).to(a).sort().values
        vals = (torch.linspace(-4, 4, 7)).to(b)
        assert _same(_searchsorted(seq, vals), aten.searchsorted.Tensor(seq, vals)), (a, b)


def test_searchsorted_argument_errors_like_the_kernel():
    seq, v = torch.arange(5.0), torch.tensor([1.0])
    for kw in ({"side": "left", "right": True}, {"side": "middle"}):
        with pytest.raises(RuntimeError):
            aten.searchsorted.Tensor(seq, v, **kw)
        with pytest.raises(RuntimeError, match="side"):
            _searchsorted(seq, v, **kw)
    with pytest.raises(RuntimeError, match="boundaries tensor"):
        _searchsorted(torch.zeros(2, 3), torch.zeros(3, 1))
    with pytest.raises(RuntimeError, match="scalar only"):
        _searchsorted_scalar(torch.zeros(2, 3), 1.0)


@pytest.mark.parametrize("expands", [
    ([1, 3], [0], [1, 2], [2, 3]),  # bilinear's layout
    ([], [], [], []), ([], [], [], [1]), ([], [], [], [0, 1]), ([2], [2], [2], [2]),
])
def test_trilinear_matches_the_kernel(expands):
    g = torch.Generator().manual_seed(1)
    e1, e2, e3, sd = expands
    if e1 == [1, 3]:
        shapes = [(6, 3), (4, 3, 5), (6, 5)]
    else:
        shapes = [(3, 4)] * 3
    for n0 in (shapes[0][0], 0, 1):
        ins = [torch.randn((n0,) + s[1:] if s != shapes[1] else s, dtype=torch.float64, generator=g) for s in shapes]
        want = aten._trilinear.default(*ins, e1, e2, e3, sd)
        assert _same(_trilinear(*ins, e1, e2, e3, sd), want, exact=False)


PS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 10.0, float("inf")]


@pytest.mark.parametrize("shape", [(1, 1), (1, 5), (5, 1), (5, 5), (4, 3), (0, 3), (3, 0), (2, 7)])
def test_pdist_forward_and_backward_match_the_kernel(shape):
    g = torch.Generator().manual_seed(2)
    for p, ties in itertools.product(PS, [False, True]):
        x = torch.randn(shape, dtype=torch.float64, generator=g)
        if ties and shape[0] > 2 and shape[1] > 0:  # a zero distance, and a tied coordinate (p = inf's max)
            x[1] = x[0]
            x[2, 0] = x[0, 0]
        want = aten._pdist_forward.default(x, p)
        assert _same(_pdist_forward(x, p), want, exact=False), (shape, p)
        if shape[0] >= 2 and shape[1] >= 1:
            grad = torch.randn(want.shape, dtype=torch.float64, generator=g)
            got = _pdist_backward(grad, x, p, want)
            assert _same(got, aten._pdist_backward.default(grad, x, p, want), exact=False), (shape, p)


def test_conj_physical_matches_the_kernel():
    special = torch.tensor([complex(0.0, 0.0), complex(NAN, -0.0), complex(1, float("inf")), complex(-2.5, 3)])
    for x in [special, torch.randn(2, 3, dtype=torch.complex64), torch.randn(0, 2, dtype=torch.complex128),
              torch.randn(3), torch.arange(4), torch.tensor([True, False])]:
        want, got = aten._conj_physical.default(x), _conj_physical(x)
        assert _same(got, want)
        if x.is_complex():
            assert torch.equal(torch.view_as_real(got).signbit(), torch.view_as_real(want).signbit())
        else:
            assert got.data_ptr() != x.data_ptr()  # a copy, as the kernel's


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.int8, torch.uint8,
                                   torch.int32, torch.int64, torch.bool])
def test_hash_tensor_matches_the_kernel(dtype):
    g = torch.Generator().manual_seed(9)
    checked = 0
    for shape in [(), (1,), (5,), (3, 5), (3, 2, 1, 2), (0, 3)]:
        x = (torch.randn(shape, generator=g) * 100).to(dtype)
        if dtype.is_floating_point and x.numel() > 2:
            x.view(-1)[0], x.view(-1)[1] = NAN, -0.0  # bit patterns, not values
        rank = max(len(shape), 1)
        for dims, keep in itertools.product([[], [0], [-1], list(range(rank))] + ([[0, -1]] if rank > 1 else []),
                                            [False, True]):
            try:
                want = aten.hash_tensor.default(x, dims, keepdim=keep)
            except (RuntimeError, IndexError) as e:  # empty reduced dim, or no dim for an empty tensor
                with pytest.raises(type(e), match=str(e)[:30]):
                    _hash_tensor(x, dims, keepdim=keep)
                continue
            assert _same(_hash_tensor(x, dims, keepdim=keep), want), (shape, dims, keep)
            checked += 1
    assert checked >= 40


# ------------------------------------------------------------------ derived rules


def _checked(op, args, kwargs=None):
    kwargs = kwargs or {}
    got = derive_rules(op, *args, **kwargs)
    assert got.unsupported_reason is None, got.unsupported_reason
    report = check_rules(op, args, kwargs, got.rules)
    assert report.incorrect == [] and len(report.confirmed) == len(got.rules)
    return set(got.as_strings())


def test_searchsorted_rules_shard_values_and_batch_never_the_boundaries_last_dim():
    g = torch.Generator().manual_seed(3)
    seq = torch.randn(3, 9, generator=g).sort(-1).values
    values = torch.randn(3, 5, generator=g)
    rules = _checked(aten.searchsorted.Tensor, (seq, values), {"right": True})
    assert {"S(0), S(0) -> S(0)", "R, S(1) -> S(1)"} <= rules
    rules_1d = _checked(aten.searchsorted.Tensor, (seq[0], values), {"out_int32": True})
    assert {"R, S(0) -> S(0)", "R, S(1) -> S(1)"} <= rules_1d
    sorter = torch.argsort(values, dim=-1)
    rules_sorter = _checked(aten.searchsorted.Tensor, (values, seq[:, :5].contiguous()), {"sorter": sorter})
    assert "S(0), S(0), S(0) -> S(0)" in rules_sorter
    every = rules | rules_1d | rules_sorter
    assert not any(r.startswith("S(1), ") for r in rules | rules_sorter) and not any(
        r.startswith("S(0), ") for r in rules_1d), every


def test_summing_shard_counts_would_be_wrong_with_nan_in_the_boundaries():
    """Why the boundaries' last dim stays whole (no S(-1) -> P(sum) rule): with a NaN in
    the sequence (torch.sort puts it last) the kernel's answer depends on its search path,
    so per-shard answers do not add up to the one-device answer."""
    seq, v = torch.tensor([1.0, NAN]), torch.tensor(1.0)
    whole = aten.searchsorted.Tensor(seq, v).item()
    parts = sum(aten.searchsorted.Tensor(seq[i:i + 1], v).item() for i in range(2))
    assert (whole, parts) == (2, 1)
    assert _searchsorted(seq, v).item() == whole


def test_pdist_rules_keep_columns_sharded_at_any_split():
    x = torch.randn(5, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    assert "S(1) -> P(sum)" in _checked(aten._pdist_forward.default, (x, 1.0))
    assert "S(1) -> P(sum)" in _checked(aten._pdist_forward.default, (x, 0.0))
    assert "S(1) -> P(max)" in _checked(aten._pdist_forward.default, (x, float("inf")))
    _checked(aten._pdist_forward.default, (x, 2.0))


@pytest.mark.parametrize("p", [2.0, float("inf")])
def test_pdist_backward_rules_are_exact(p):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 5, dtype=torch.float64, generator=g)
    d = aten._pdist_forward.default(x, p)
    rules = _checked(aten._pdist_backward.default, (torch.randn(d.shape, dtype=torch.float64, generator=g), x, p, d))
    assert "R, S(1), R -> S(1)" in rules and "P(sum), R, R -> P(sum)" in rules


def test_trilinear_and_conj_rules_are_exact():
    g = torch.Generator().manual_seed(6)
    i1, w, i2 = (torch.randn(s, dtype=torch.float64, generator=g) for s in [(5, 3), (2, 3, 4), (5, 4)])
    rules = _checked(aten._trilinear.default, (i1, w, i2, [1, 3], [0], [1, 2], [2, 3]))
    assert {"S(0), R, S(0) -> S(0)", "R, S(0), R -> S(1)", "S(1), S(1), R -> P(sum)", "P(sum), R, R -> P(sum)"} <= rules
    assert "S(1) -> S(1)" in _checked(aten._conj_physical.default, (torch.randn(4, 5, dtype=torch.complex128),))


def test_hash_tensor_rules_keep_the_dims_it_does_not_reduce():
    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(10))
    assert {"S(0) -> S(0)", "S(2) -> S(1)"} == _checked(aten.hash_tensor.default, (x, [1]))
    assert {"S(1) -> S(1)"} == _checked(aten.hash_tensor.default, (x, [0, 2]), {"keepdim": True})


def test_partial_max_of_uint64_parts_is_judged_not_crashed():
    """hash_tensor's output is uint64, which has no amax/amin kernel: the checker reduces
    it in int64 with the top bit flipped, so 2**63 stays above 1."""
    from decompshard.verify.rank_sim import _reduce

    parts = torch.tensor([[1, 2**64 - 1, 5], [3, 0, 2**63]], dtype=torch.uint64)
    assert _reduce(parts, "max").tolist() == [3, 2**64 - 1, 2**63]
    assert _reduce(parts, "min").tolist() == [1, 0, 5]
    assert _reduce(torch.tensor([[1, 65535], [3, 0]], dtype=torch.uint16), "max").tolist() == [3, 65535]


# ------------------------------------------------------------------ real DTensors


WORLD_SIZE = 6  # simulated ranks for conftest's `world`


def _runtime_cases():
    g = torch.Generator().manual_seed(7)
    seq = torch.randn(3, 10, generator=g).sort(-1).values
    seq[1, 4:6] = seq[1, 3]  # ties
    v = torch.randn(3, 7, generator=g)
    v[0, 0], v[2, 1] = seq[0, 2], NAN
    x = torch.randn(7, 5, generator=g)
    bil = (torch.randn(7, 3, generator=g), torch.randn(4, 3, 5, generator=g), torch.randn(7, 5, generator=g),
           [1, 3], [0], [1, 2], [2, 3])
    return [
        (aten.searchsorted.Tensor, (seq, v), {}, "S(0);S(0)"),
        (aten.searchsorted.Tensor, (seq, v), {"right": True}, "R;S(1)"),
        (aten.searchsorted.Tensor, (seq[0], v), {"out_int32": True}, "R;S(0)"),
        (aten._pdist_forward.default, (x, 1.0), {}, "S(1)"),
        (aten._pdist_forward.default, (x, float("inf")), {}, "S(1)"),
        (aten._pdist_forward.default, (x, 2.0), {}, "S(1)"),
        (aten._trilinear.default, bil, {}, "S(0);R;S(0)"),
        (aten._trilinear.default, bil, {}, "R;S(0);R"),
        (aten._trilinear.default, bil, {}, "S(1);S(1);R"),
        (aten._conj_physical.default, (torch.randn(7, 4, dtype=torch.complex128, generator=g),), {}, "S(0)"),
        # 7 over 3 ranks is uneven but leaves no rank empty: LocalTensorMode answers
        # hash_tensor on an empty shard with torch.empty(0) whatever the shape (a special
        # case in torch/distributed/_local_tensor), which a real rank's kernel does not
        (aten.hash_tensor.default, (torch.randn(7, 5, 7, generator=g), [1]), {}, "S(2)", "S(0),S(2)"),
        (aten.hash_tensor.default, (torch.randn(7, 5, 7, generator=g), [0, 1]), {"keepdim": True}, "S(2)", "R,S(2)"),
    ]


@pytest.mark.parametrize("mesh", [(3,), (2, 3)])
def test_dtensors_match_one_device_forward_and_backward(world, mesh):
    """run_case: every rank's full_tensor() of the outputs and of the input gradients
    (pdist and _trilinear: their backward runs _pdist_backward / _trilinear on DTensors)
    against one device, the sharded dims uneven (7 and 5 over 3 ranks)."""
    for op, args, kwargs, text, *text_2d in _runtime_cases():
        if len(mesh) == 2:
            text = text_2d[0] if text_2d else ";".join(f"{p},{p}" for p in text.split(";"))
        shapes = [t.shape for t in args if isinstance(t, torch.Tensor)]
        outcome = run_case(op, args, kwargs, mesh, parse_placements(text, shapes, len(mesh)),
                           runtime=switched(True))
        assert outcome.status == "ok", (op, kwargs, text, outcome)


def test_searchsorted_pdist_and_bilinear_keep_their_shards(world):
    """No collective where the math needs none: sharded values give a sharded result,
    pdist of column shards a Partial one whose backward gives column-sharded gradients,
    bilinear of batch shards a batch-sharded result."""
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = device_mesh((3,))
    g = torch.Generator().manual_seed(8)
    seq, v = torch.randn(10, generator=g).sort().values, torch.randn(7, 4, generator=g)
    x = torch.randn(5, 7, dtype=torch.float64, generator=g)
    i1, w, i2 = (torch.randn(s, dtype=torch.float64, generator=g) for s in [(7, 3), (4, 3, 5), (7, 5)])
    with switched(True), LocalTensorMode(3), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dseq, dv = distribute_tensor(seq, mesh, [Replicate()]), distribute_tensor(v, mesh, [Shard(0)])
        dx = distribute_tensor(x, mesh, [Shard(1)]).requires_grad_()
        cot = distribute_tensor(torch.ones(10, dtype=torch.float64), mesh, [Replicate()])
        di1, dw, di2 = (distribute_tensor(t, mesh, [p]) for t, p in ((i1, Shard(0)), (w, Replicate()), (i2, Shard(0))))
        with CommDebugMode() as comms:
            out = torch.searchsorted(dseq, dv)
            d = torch.nn.functional.pdist(dx, p=1)
            d.backward(cot)
            y = torch.nn.functional.bilinear(di1, di2, dw)
        assert comms.get_total_counts() == 0, comms.get_comm_counts()
        assert out.placements == (Shard(0),) and out.dtype == torch.int64
        assert [t.shape[0] for t in rank_locals(out.to_local(), mesh).values()] == [3, 3, 1]
        assert torch.equal(out.full_tensor(), torch.searchsorted(seq, v))
        assert isinstance(d.placements[0], Partial) and dx.grad.placements == (Shard(1),)
        xr = x.clone().requires_grad_()
        torch.nn.functional.pdist(xr, p=1).backward(torch.ones(10, dtype=torch.float64))
        assert torch.allclose(d.full_tensor(), torch.nn.functional.pdist(x, p=1))
        assert torch.allclose(dx.grad.full_tensor(), xr.grad)
        assert y.placements == (Shard(0),)
        assert torch.allclose(y.full_tensor(), torch.nn.functional.bilinear(i1, i2, w))
