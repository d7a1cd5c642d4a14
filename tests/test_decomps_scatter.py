"""decompshard/dispatch_modes/decomps/scatter.py: decompositions of the reducing scatters torch never
decomposes (scatter_reduce.two, scatter.reduce / value_reduce, put, masked_scatter,
segment_reduce), so their rules are derived like any other op's.

Three layers: each decomposition against the real op (OpInfo samples and edge cases:
every reduce, include_self, duplicate and empty index, negative dims, integer and bool
dtypes); the derived rules against the numerical checker (0 incorrect, and the rules that
make them worth having: dims the scatter leaves alone stay sharded, a sum-scatter of a
sharded source is a partial sum); and real DTensors under enable() on simulated meshes,
forward and backward, against one device (the MoE combine among them).
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode

import decompshard
from decompshard import derive_rules
from decompshard.dispatch_modes.decomps.scatter import DECOMPOSITIONS, masked_scatter, put, scatter_reduce_legacy, scatter_reduce_two, scatter_value_reduce, segment_reduce
from decompshard.dispatch_modes.tracing import find_decomposition
from decompshard.verify.rule_check import check_rules
from decompshard.verify.dtensor_case import device_mesh, rank_locals, run_case
from decompshard.runtime.enable import switched

aten = torch.ops.aten
R, S0, S1 = Replicate(), Shard(0), Shard(1)
REDUCES = ("sum", "prod", "mean", "amax", "amin")


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Same shape and dtype; equal values (integers and bool exactly, floats up to the
    summation order, NaN where the op has NaN)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if not want.dtype.is_floating_point:
        return torch.equal(got, want)
    tol = 1e-2 if want.dtype in (torch.float16, torch.bfloat16) else 1e-6
    return torch.allclose(got.double(), want.double(), rtol=tol, atol=tol, equal_nan=True)


def _values(shape, dtype, gen) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=dtype)
    low = 0 if dtype == torch.uint8 else -9
    return torch.randint(low, 9, shape, generator=gen, dtype=dtype)


@pytest.fixture(scope="module")
def opinfo_samples():
    from decompshard.coverage.opinfo_samples import capture_aten_samples

    names = {"scatter_reduce", "scatter", "put", "masked_scatter", "_segment_reduce"}
    return capture_aten_samples(lambda o: o.name in names, max_samples_per_opinfo=None, max_samples_per_op=None)


def _largest(samples, n):
    return sorted(samples, key=lambda s: (min([t.dim() for t in s.tensors()] or [0]) > 0,
                                          sum(t.numel() for t in s.tensors())), reverse=True)[:n]


# ------------------------------------------------------------------ values: decomposition == op


def test_registered_where_the_tracer_looks():
    for op, fn in DECOMPOSITIONS.items():
        assert find_decomposition(op) is fn, op


def test_matches_the_op_on_every_opinfo_sample(opinfo_samples):
    warnings.filterwarnings("ignore")
    checked = {}
    for op, fn in DECOMPOSITIONS.items():
        for s in opinfo_samples.get(op, []):
            args, kwargs = s.cloned_args()
            assert _same(fn(*args, **kwargs), op(*args, **kwargs)), (op, s)
            checked[op] = checked.get(op, 0) + 1
    assert set(checked) == set(DECOMPOSITIONS), set(DECOMPOSITIONS) - set(checked)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.int8, torch.uint8, torch.bool])
def test_scatter_reduce_every_mode_and_layout(dtype):
    """Duplicate indices (5 sources into 3 slots), negative dims, an index narrower than
    self in the other dim, src larger than the index; int8 products wrap like the kernel's."""
    gen = torch.Generator().manual_seed(0)
    layouts = [  # self shape, dim, index shape, src shape
        ((3, 4), 0, (5, 4), (5, 4)),
        ((3, 4), -1, (3, 6), (3, 6)),
        ((4, 3, 2), 1, (2, 5, 2), (3, 6, 2)),  # narrower index in dim 0, larger src
        ((4, 3, 5), -3, (6, 2, 3), (6, 2, 4)),
    ]
    for (shape, dim, ishape, sshape), reduce, include_self in itertools.product(layouts, REDUCES, (True, False)):
        if dtype == torch.bool and reduce == "mean":
            continue  # the kernel has no bool mean
        self, src = _values(shape, dtype, gen), _values(sshape, dtype, gen)
        index = torch.randint(0, shape[dim], ishape, generator=gen)
        want = aten.scatter_reduce.two(self, dim, index, src, reduce, include_self=include_self)
        got = scatter_reduce_two(self, dim, index, src, reduce, include_self=include_self)
        assert _same(got, want), (dtype, shape, dim, reduce, include_self, got, want)


def test_scatter_reduce_edge_cases():
    x = torch.tensor([1.0, 2.0, 3.0])
    i = torch.tensor([0, 0, 2])
    nan = torch.tensor([float("nan"), 5.0, -1.0])
    for reduce, include_self in itertools.product(REDUCES, (True, False)):
        # NaN in src: amax/amin propagate it as the kernel does
        assert _same(scatter_reduce_two(x, 0, i, nan, reduce, include_self=include_self),
                     x.scatter_reduce(0, i, nan, reduce, include_self=include_self))
        # empty index (self unchanged), also next to a non-empty src
        ones, src2 = torch.ones(3, 4), torch.ones(2, 4)
        for a, j, b in [(x, torch.zeros(0, dtype=torch.long), torch.ones(0)),
                        (ones, torch.zeros(0, 4, dtype=torch.long), src2),
                        (ones, torch.zeros(2, 0, dtype=torch.long), src2)]:
            assert _same(scatter_reduce_two(a, 0, j, b, reduce, include_self=include_self),
                         aten.scatter_reduce.two(a, 0, j, b, reduce, include_self=include_self))
        # 0-d tensors, alone or next to 1-d ones (the kernel reads them as 1-element 1-d)
        zero_d = [(torch.tensor(5.0), torch.tensor(0), torch.tensor(3.0)),
                  (x, torch.tensor(1), torch.tensor(5.0)),
                  (torch.tensor(2.0), torch.tensor([0, 0]), torch.tensor([3.0, 4.0])),
                  (x, torch.tensor([1]), torch.tensor(5.0))]
        for a, j, b in zero_d:
            assert _same(scatter_reduce_two(a, 0, j, b, reduce, include_self=include_self),
                         aten.scatter_reduce.two(a, 0, j, b, reduce, include_self=include_self))
    # integer mean floor-divides (-7 + 0 + 1) / 3 = -2 and (-7 + 1) / 2 -> -3 (not -2)
    v = torch.tensor([-7, 1, 1])
    for include_self in (True, False):
        got = scatter_reduce_two(v, 0, torch.tensor([0, 0]), torch.tensor([0, 1]), "mean", include_self=include_self)
        assert torch.equal(got, v.scatter_reduce(0, torch.tensor([0, 0]), torch.tensor([0, 1]), "mean",
                                                 include_self=include_self))
    got = scatter_reduce_two(v, 0, torch.tensor([0]), torch.tensor([0]), "mean", include_self=True)
    assert got.tolist() == [-4, 1, 1]
    # the count wraps in self's dtype as the kernel's does: 200 hits in int8 count -56,
    # 1 + 255 in uint8 counts 0 (taken as 1)
    for dtype, hits in ((torch.int8, 200), (torch.uint8, 255)):
        self = torch.tensor([100, 7], dtype=dtype)
        index, src = torch.zeros(hits, dtype=torch.long), torch.full((hits,), 3, dtype=dtype)
        for include_self in (True, False):
            assert torch.equal(scatter_reduce_two(self, 0, index, src, "mean", include_self=include_self),
                               self.scatter_reduce(0, index, src, "mean", include_self=include_self))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int64, torch.int8, torch.bool])
def test_scatter_with_reduce_and_value(dtype):
    gen = torch.Generator().manual_seed(1)
    warnings.filterwarnings("ignore")
    for dim, reduce in itertools.product((0, 1, -1), ("add", "multiply")):
        self = _values((4, 3), dtype, gen)
        index = torch.randint(0, self.shape[dim], (5, 3) if dim == 0 else (4, 5), generator=gen)
        src = _values(index.shape, dtype, gen)
        assert _same(scatter_reduce_legacy(self, dim, index, src, reduce=reduce),
                     aten.scatter.reduce(self, dim, index, src, reduce=reduce))
        for value in ((True,) if dtype == torch.bool else (2.7, -1.5, 3)):  # a float value truncates into ints
            assert _same(scatter_value_reduce(self, dim, index, value, reduce=reduce),
                         aten.scatter.value_reduce(self, dim, index, value, reduce=reduce))


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.uint8, torch.bool])
def test_put(dtype):
    gen = torch.Generator().manual_seed(2)
    for shape, index in [((2, 3), [-1, 0, 0, 5, -6]), ((4,), [[3, 3], [-4, 0]]), ((), [0, -1, 0]), ((3, 2), [])]:
        self = _values(shape, dtype, gen)
        idx = torch.tensor(index, dtype=torch.long)
        src = _values(idx.shape, dtype, gen)
        assert _same(put(self, idx, src, True), torch.put(self, idx, src, accumulate=True)), (shape, index)
        unique = torch.unique(idx.reshape(-1) % max(self.numel(), 1))  # a write: duplicates are the kernel's pick
        usrc = _values(unique.shape, dtype, gen)
        assert _same(put(self, unique, usrc, False), torch.put(self, unique, usrc, accumulate=False))


def test_masked_scatter():
    gen = torch.Generator().manual_seed(3)
    cases = [((3, 4), (3, 4)), ((3, 4), (4,)), ((4,), (3, 4)), ((2, 1, 3), (1, 4, 1))]
    for self_shape, mask_shape in cases:
        self = torch.randn(self_shape, generator=gen, dtype=torch.float64)
        mask = torch.rand(mask_shape, generator=gen) > 0.5
        need = int(torch.broadcast_to(mask, torch.broadcast_shapes(self.shape, mask.shape)).sum())
        source = torch.randn(need + 3, generator=gen, dtype=torch.float64).view(-1, 1)
        assert _same(masked_scatter(self, mask, source), torch.masked_scatter(self, mask, source))
    none = torch.zeros(3, 4, dtype=torch.bool)
    x = torch.randn(3, 4, generator=gen)
    assert _same(masked_scatter(x, none, torch.zeros(0)), torch.masked_scatter(x, none, torch.zeros(0)))
    ints = torch.arange(6).view(2, 3)
    m = torch.tensor([True, False, True])
    assert _same(masked_scatter(ints, m, torch.arange(100, 110)), torch.masked_scatter(ints, m, torch.arange(100, 110)))


def test_segment_reduce():
    gen = torch.Generator().manual_seed(4)
    data = torch.randn(6, 2, generator=gen, dtype=torch.float64)
    data[4, 1] = float("nan")
    lengths = torch.tensor([2, 0, 3, 1])  # an empty segment: initial, else 0 / 1 / +-inf / NaN (mean)
    offsets = torch.tensor([0, 2, 2, 5, 6])
    wide = torch.randn(2, 7, 3, generator=gen, dtype=torch.float64)
    wide_lengths = torch.tensor([[3, 0, 4], [1, 5, 1]])  # axis 1: one row of lengths per leading index
    wide_offsets = torch.cat([torch.zeros(2, 1, dtype=torch.long), wide_lengths.cumsum(1)], 1)
    for reduce, initial in itertools.product(("sum", "mean", "max", "min", "prod"), (None, 0.5, -2.0)):
        for d, axis, kw in [(data, 0, {"lengths": lengths}), (data, -2, {"offsets": offsets}),
                            (wide, 1, {"lengths": wide_lengths}), (wide, -2, {"offsets": wide_offsets})]:
            want = aten.segment_reduce.default(d, reduce, axis=axis, initial=initial, **kw)
            got = segment_reduce(d, reduce, axis=axis, initial=initial, **kw)
            assert _same(got, want), (reduce, initial, axis, kw, got, want)


# ------------------------------------------------------------------ derived rules


def _rules_checked(op, args, kwargs, find_missing=True):
    warnings.filterwarnings("ignore")
    derived = derive_rules(op, *args, **kwargs)
    assert derived.unsupported_reason is None, derived.unsupported_reason
    report = check_rules(op, args, kwargs, derived.rules, world_sizes=(2, 3), find_missing=find_missing)
    assert not report.incorrect, [(str(r), why) for r, why in report.incorrect]
    return {str(r) for r in derived.rules}, report


def test_opinfo_samples_derive_with_no_incorrect_rule(opinfo_samples):
    """The acceptance test's check on each op's largest sample (tests/test_decomp_only_set.py
    checks the two largest)."""
    for op in DECOMPOSITIONS:
        for s in _largest(opinfo_samples[op], 1):
            rules, report = _rules_checked(op, s.args, s.kwargs)
            assert rules, (op, s)


def _moe(reduce: str, seed: int = 0):
    """An MoE combine: 10 (token, expert) outputs routed back to 7 tokens of width 4."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.randint(0, 7, (10, 1), generator=gen).expand(10, 4).contiguous()
    self = torch.zeros(7, 4, dtype=torch.float64) if reduce == "sum" else torch.randn(7, 4, generator=gen,
                                                                                     dtype=torch.float64)
    return self, index, torch.randn(10, 4, generator=gen, dtype=torch.float64)


def _moe_args(kind: str, seed: int = 0, reduce: str | None = None) -> tuple:
    self, index, src = _moe(kind, seed)
    return self, 0, index, src, reduce or kind


@pytest.mark.parametrize("reduce, wanted", [
    ("sum", {"P(sum), S(0), S(0) -> P(sum)", "S(1), S(1), S(1) -> S(1)", "P(sum), R, P(sum) -> P(sum)"}),
    ("amax", {"P(max), S(0), S(0) -> P(max)", "R, S(0), S(0) -> P(max)", "S(1), S(1), S(1) -> S(1)"}),
])
def test_moe_combine_rules(reduce, wanted):
    self, index, src = _moe(reduce)
    rules, report = _rules_checked(aten.scatter_reduce.two, (self, 0, index, src, reduce), {})
    assert wanted <= rules, wanted - rules
    assert not report.missed, [str(r) for r in report.missed]


_G = torch.Generator().manual_seed(7)  # the cases below are built at import: their own stream


def _randn(*shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=_G, dtype=torch.float64)


def _randint(high: int, *shape: int) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=_G)


@pytest.mark.parametrize("op, args, kwargs, wanted", [
    (aten.put.default, (torch.zeros(7, 4, dtype=torch.float64), torch.tensor([3, -1, 3, 0, 27, -28, 9, 9]),
                        torch.arange(8.0, dtype=torch.float64), True), {}, {"P(sum), S(0), S(0) -> P(sum)"}),
    (aten.scatter.value_reduce, (_randn(7, 4), 0, _randint(7, 9, 4), 2.5),
     {"reduce": "add"}, {"S(1), S(1) -> S(1)", "P(sum), S(0) -> P(sum)"}),
    (aten.scatter.value_reduce, (_randn(7, 4), 0, _randint(7, 9, 4), 2.5),
     {"reduce": "multiply"}, {"S(1), S(1) -> S(1)", "P(max), R -> P(max)", "P(min), R -> P(min)"}),  # 2.5 ** k >= 0
    (aten.scatter.reduce, (_randn(7, 4), 1, _randint(4, 5, 6),
                           _randn(6, 6)), {"reduce": "multiply"}, {"P(sum), R, R -> P(sum)"}),
    (aten.segment_reduce.default, (_randn(2, 7, 3), "sum"),
     {"lengths": torch.tensor([[3, 0, 4], [1, 5, 1]]), "axis": 1},
     {"S(0), S(0) -> S(0) [even]", "S(2), R -> S(2)", "P(sum), R -> P(sum)"}),
    (aten.masked_scatter.default, (_randn(5, 4), _randint(2, 5, 4).bool(),
                                   _randn(25)), {}, {"P(sum), R, P(sum) -> P(sum)"}),
])
def test_rules_worth_having(op, args, kwargs, wanted):
    # segment_reduce: no search for missed rules. Its CPU kernel does not check that
    # lengths' leading dims match data's, and the search's invalid candidates (data
    # S(0) with lengths R) make it read out of bounds and crash the process.
    search = op is not aten.segment_reduce.default
    rules, report = _rules_checked(op, args, kwargs, find_missing=search)
    assert wanted <= rules, wanted - rules
    assert not report.missed, [str(r) for r in report.missed]


# ------------------------------------------------------------------ real DTensors under enable()


@pytest.mark.parametrize("op, args, mesh, placements", [
    (aten.scatter_reduce.two, _moe_args("sum"), (3,), [(Partial(),), (S0,), (S0,)]),
    (aten.scatter_reduce.two, _moe_args("amax"), (3,), [(R,), (S0,), (S0,)]),
    (aten.scatter_reduce.two, _moe_args("amax", 1), (2, 2), [(Partial("max"), S1), (S0, S1), (S0, S1)]),
    (aten.scatter_reduce.two, _moe_args("sum", 2, "mean"), (2, 2),
     [(S1, Partial("avg")), (S1, R), (S1, Partial("avg"))]),
    (aten.put.default, (torch.zeros(7, 4), torch.tensor([3, -1, 3, 0, 27, -28, 9, 9, 5]), torch.arange(9.0) - 4, True),
     (3,), [(Partial(),), (S0,), (S0,)]),
    (aten.put.default, (torch.zeros(7, 4), torch.tensor([3, -1, 3, 0, 27]), torch.arange(5.0) + 0.5, True),
     (2, 2), [(Partial(), Partial()), (S0, R), (S0, Partial())]),
])
def test_runs_sharded_forward_and_backward(world, op, args, mesh, placements):
    """Every rank's full_tensor() and the gradients against one device (float64); and the
    placements asked for are a derived rule on every mesh dim, so the case runs sharded
    rather than on gathered inputs."""
    rules = derive_rules(op, *args).as_strings()
    for m in range(len(mesh)):
        ins = ", ".join(_short(p[m]) for p in placements)
        assert any(r.startswith(ins + " -> ") for r in rules) or set(ins.split(", ")) == {"R"}, (ins, rules)
    out = run_case(op, args, {}, mesh, placements, seed=0, runtime=switched(True))
    assert out.status == "ok", str(out)


def _short(p) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    return "R"


def test_moe_combine_runs_with_no_collective(world):
    """Token-sharded expert outputs and routing index, a replicated zero buffer: the
    scatter runs locally into a partial sum (R -> P(sum) is free), with no all-gather;
    the caller's reduction is the one collective, and it matches one device."""
    self, index, src = _moe("sum", seed=3)
    want = self.scatter_reduce(0, index, src, "sum")
    cotangent = torch.randn(7, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    mesh = device_mesh((3,))
    with decompshard.enabled(), LocalTensorMode(3):
        d_self = distribute_tensor(self, mesh, [R])
        d_index = distribute_tensor(index, mesh, [S0])
        d_src = distribute_tensor(src, mesh, [S0]).requires_grad_(True)
        with CommDebugMode() as comms:
            out = d_self.scatter_reduce(0, d_index, d_src, "sum")
        assert comms.get_total_counts() == 0, comms.get_comm_counts()
        assert out.placements == (Partial("sum"),)
        full = out.full_tensor()
        out.backward(distribute_tensor(cotangent, mesh, [R]))
        grad = d_src.grad.full_tensor()
    for r, value in rank_locals(full, mesh).items():
        torch.testing.assert_close(value, want, msg=f"rank {r}")
    for r, value in rank_locals(grad, mesh).items():
        torch.testing.assert_close(value, cotangent.gather(0, index), msg=f"rank {r}")


def test_in_place_scatter_reduce_stays_sharded(world):
    """scatter_reduce_ runs its functional twin's derived strategy (decompshard/runtime/support/inplace.py):
    along a dim the scatter leaves alone, every input S(1), no collective, self still S(1)."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(6, 5, generator=gen, dtype=torch.float64)
    index = torch.randint(0, 6, (8, 5), generator=gen)
    src = torch.randn(8, 5, generator=gen, dtype=torch.float64)
    want = x.clone().scatter_reduce_(0, index, src, "amax", include_self=False)
    mesh = device_mesh((3,))
    with decompshard.enabled(), LocalTensorMode(3):
        dx, di, ds = (distribute_tensor(t, mesh, [S1]) for t in (x, index, src))
        with CommDebugMode() as comms:
            dx.scatter_reduce_(0, di, ds, "amax", include_self=False)
        assert comms.get_total_counts() == 0, comms.get_comm_counts()
        assert dx.placements == (S1,)
        full = dx.full_tensor()
    for r, value in rank_locals(full, mesh).items():
        torch.testing.assert_close(value, want, msg=f"rank {r}")
