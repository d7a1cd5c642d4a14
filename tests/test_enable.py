"""enable() / disable() / enabled(): decompshard inside DTensor's dispatch.

Simulated ranks (LocalTensorMode) over a fake process group give real numbers; the fake
group alone (8x8, 4x4x4 meshes) gives real sharding decisions and collective counts,
with FakeTensorMode for shapes that would not fit in memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._decompositions import DecompShardingStrategy
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.placement_types import _StridedShard

import _e2e_model as M
import decompshard
import decompshard.solve.derive
from decompshard._compat import sharding_propagator
from decompshard.runtime.derived import DerivedStrategy

aten = torch.ops.aten
R, S0, S1 = Replicate(), Shard(0), Shard(1)


@pytest.fixture(scope="module", autouse=True)
def world():
    with M.fake_world(64):
        yield
    decompshard.disable()


@pytest.fixture(autouse=True)
def _disabled_after():
    yield
    decompshard.disable()


@pytest.fixture(scope="module")
def mesh4():
    return M.submesh((4,))


def _ranks(mesh):
    return LocalTensorMode(frozenset(range(mesh.size())))


def _run(fn, tensors, placements, mesh):
    """fn on DTensors: (global result as a plain tensor, output placements, collectives)."""
    with _ranks(mesh), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ds = [distribute_tensor(t, mesh, p) for t, p in zip(tensors, placements)]
        with CommDebugMode() as comm:
            out = fn(*ds)
        return M.full(out), tuple(out.placements), comm.get_total_counts()


def _run_warnings_kept(fn, tensors, placements, mesh):
    with _ranks(mesh):
        ds = [distribute_tensor(t, mesh, p) for t, p in zip(tensors, placements)]
        with CommDebugMode() as comm:
            out = fn(*ds)
        return M.full(out), tuple(out.placements), comm.get_total_counts()


# ------------------------------------------------------------- enable / disable


def test_enable_disable_restores_dtensor_exactly(mesh4):
    sp = sharding_propagator()
    original = sp.decomp_strategy
    original_has_decomp = DecompShardingStrategy.__dict__["has_decomp"]
    assert not decompshard.is_enabled()

    decompshard.enable()
    swapped = sp.decomp_strategy
    assert isinstance(swapped, DerivedStrategy) and swapped.torch_fallback is original
    assert DecompShardingStrategy.__dict__["has_decomp"] is not original_has_decomp
    assert DecompShardingStrategy.has_decomp(aten.addbmm.default)  # decompshard's own decomposition
    decompshard.enable()  # idempotent: nothing wrapped twice
    assert sp.decomp_strategy is swapped

    decompshard.disable()
    assert sp.decomp_strategy is original
    assert DecompShardingStrategy.__dict__["has_decomp"] is original_has_decomp
    assert not DecompShardingStrategy.has_decomp(aten.addbmm.default)
    decompshard.disable()  # idempotent
    assert sp.decomp_strategy is original and not decompshard.is_enabled()

    # ... and ops behave as torch's again: addbmm has no strategy, addmv all-gathers.
    b = torch.randn(6, 8)
    with _ranks(mesh4), pytest.raises(NotImplementedError, match="sharding strategy registered"):
        torch.addbmm(distribute_tensor(b, mesh4, [R]), distribute_tensor(torch.randn(4, 6, 5), mesh4, [S0]),
                     distribute_tensor(torch.randn(4, 5, 8), mesh4, [S0]))
    addmv_args = [torch.randn(8), torch.randn(8, 12), torch.randn(12)]
    _, _, n = _run(torch.addmv, addmv_args, [[R], [S1], [S0]], mesh4)
    assert n == 2
    with decompshard.enabled():
        _, placements, n = _run(torch.addmv, addmv_args, [[R], [S1], [S0]], mesh4)
        assert (placements, n) == ((Partial("sum"),), 0)
    _, _, n = _run(torch.addmv, addmv_args, [[R], [S1], [S0]], mesh4)
    assert n == 2  # DTensor's sharding cache was cleared on disable: torch's answer again


def test_enabled_context_manager_restores_previous_state():
    with decompshard.enabled():
        assert decompshard.is_enabled()
        with decompshard.enabled():
            assert decompshard.is_enabled()
        assert decompshard.is_enabled()  # the inner block found it enabled: leaves it so
    assert not decompshard.is_enabled()
    decompshard.enable()
    with decompshard.enabled():
        pass
    assert decompshard.is_enabled()
    with pytest.raises(RuntimeError), decompshard.enabled():
        decompshard.disable()
        decompshard.enable()
        raise RuntimeError
    assert decompshard.is_enabled()


def test_enable_disable_from_many_threads():
    sp = sharding_propagator()
    original = sp.decomp_strategy
    original_has_decomp = DecompShardingStrategy.__dict__["has_decomp"]
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def worker(i: int) -> None:
        try:
            start.wait()
            for k in range(300):
                if (i + k) % 3 == 0:
                    decompshard.enable()
                elif (i + k) % 3 == 1:
                    decompshard.disable()
                else:
                    with decompshard.enabled():
                        pass
                # the pair is swapped together, under one lock
                strategy = sp.decomp_strategy
                assert isinstance(strategy, (DerivedStrategy, DecompShardingStrategy))
                if isinstance(strategy, DerivedStrategy):
                    assert strategy.torch_fallback is original  # never a wrapper of a wrapper
        except BaseException as e:  # noqa: BLE001 - re-raised in the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert decompshard.is_enabled() == isinstance(sp.decomp_strategy, DerivedStrategy)
    decompshard.disable()
    assert sp.decomp_strategy is original
    assert DecompShardingStrategy.__dict__["has_decomp"] is original_has_decomp


def test_environment_variable_enables_on_import():
    code = (
        "import decompshard, torch\n"
        "from decompshard._compat import sharding_propagator\n"
        "print(decompshard.is_enabled(), type(sharding_propagator().decomp_strategy).__name__)\n"
    )
    procs = {}
    for value in ("1", "0", None):
        env = {k: v for k, v in os.environ.items() if k != "DECOMPSHARD_ENABLE"}
        if value is not None:
            env["DECOMPSHARD_ENABLE"] = value
        procs[value] = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
    out = {v: p.communicate(timeout=120) for v, p in procs.items()}
    assert out["1"][0].split() == ["True", "DerivedStrategy"], out["1"][1][-2000:]
    assert out["0"][0].split() == ["False", "DecompShardingStrategy"], out["0"][1][-2000:]
    assert out[None][0].split() == ["False", "DecompShardingStrategy"], out[None][1][-2000:]


def test_native_ops_never_reach_decompshard(mesh4, monkeypatch):
    calls = []
    real = DerivedStrategy.propagate_strategy
    monkeypatch.setattr(DerivedStrategy, "propagate_strategy", lambda self, s: calls.append(s.op) or real(self, s))

    def native(a, b):
        return torch.softmax(a @ b, -1).sum(0) * 2

    args = [torch.randn(8, 12), torch.randn(12, 6)]
    want = _run(native, args, [[S1], [S0]], mesh4)
    with decompshard.enabled():
        got = _run(native, args, [[S1], [S0]], mesh4)
    assert calls == []
    torch.testing.assert_close(got[0], want[0])
    assert got[1:] == want[1:]


# ------------------------------------------------------------- the known failures


def _sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


KNOWN = {
    # name: (fn, shapes, placements on a 1-D mesh of 4, torch's failure)
    "addbmm": (torch.addbmm, [(6, 8), (4, 6, 6), (4, 6, 8)], [[R], [S0], [S0]], "error"),
    "cdist": (torch.cdist, [(12, 6), (4, 6)], [[S0], [R]], "error"),
    "unfold": (lambda x: x.unfold(1, 3, 2), [(12, 9)], [[S0]], "error"),
    "renorm": (lambda x: torch.renorm(x, 2, 0, 1.0), [(12, 6)], [[S0]], "error"),
    "im2col": (lambda x: F.unfold(x, 2), [(4, 6, 5, 5)], [[S0]], "error"),
    "sdpa_causal": (_sdpa_causal, [(12, 4, 6, 8)] * 3, [[S0]] * 3, "error"),
    "addmv": (torch.addmv, [(8,), (8, 12), (12,)], [[R], [S1], [S0]], 2),
    # a @ b contracting a sharded dim is P(sum) (mm's own rule); torch's trace all-reduces it
    "trace": (lambda a, b: torch.trace(a @ b), [(12, 12), (12, 12)], [[S1], [S0]], 1),
    # 8 channels over 4 ranks: 2 per rank, fewer than upscale_factor**2
    "pixel_shuffle": (lambda x: F.pixel_shuffle(x, 2), [(2, 8, 3, 3)], [[S1]], "error"),
}


@pytest.mark.parametrize("name", sorted(KNOWN))
def test_known_failures_work_and_match_single_device(name, mesh4):
    fn, shapes, placements, torch_count = KNOWN[name]
    gen = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, dtype=torch.float64, generator=gen) for s in shapes]
    want = fn(*tensors)
    if torch_count == "error":
        with pytest.raises(Exception):
            _run(fn, tensors, placements, mesh4)
    else:
        assert _run(fn, tensors, placements, mesh4)[2] == torch_count
    with decompshard.enabled(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got, _, n = _run_warnings_kept(fn, tensors, placements, mesh4)
    assert not [w for w in caught if "decompshard" in str(w.message)]  # no "running replicated"
    torch.testing.assert_close(got, want)
    if torch_count != "error":
        assert n < torch_count


def test_uneven_shapes_never_use_even_only_rules(mesh4):
    # mse_loss over a batch sharded on dim d is "S(d), S(d) -> P(avg) [even]": with 7 rows
    # on 4 ranks (2, 2, 2, 1) the average of local means is not the mean. (3 columns, so
    # that the S(1) rule cannot be used either.)
    gen = torch.Generator().manual_seed(0)
    for rows, partial in ((7, False), (8, True)):
        a, b = (torch.randn(rows, 3, dtype=torch.float64, generator=gen) for _ in range(2))
        with decompshard.enabled():
            got, placements, _ = _run(lambda x, y: aten.mse_loss.default(x, y), [a, b], [[S0], [S0]], mesh4)
        torch.testing.assert_close(got, F.mse_loss(a, b))
        assert (placements == (Partial("avg"),)) == partial


def test_pixel_shuffle_channels_per_rank_decide_the_strategy():
    # 24 channels: S(1) -> S(1) is derived. On 2 ranks (12 channels each) it is used; on 4
    # ranks (6 each, not a multiple of 4) the op would fail locally: lift refuses it.
    x = torch.randn(2, 24, 3, 3, dtype=torch.float64)
    with decompshard.enabled():
        for n, keeps in ((2, True), (4, False)):
            got, placements, comm = _run(lambda t: F.pixel_shuffle(t, 2), [x], [[S1]], M.submesh((n,)))
            torch.testing.assert_close(got, F.pixel_shuffle(x, 2))
            assert (placements == (S1,) and comm == 0) == keeps, (n, placements, comm)


def test_strided_shard_input_is_kept():
    # Merging dims of a tensor sharded on the inner one makes a _StridedShard:
    # [Shard(1), Shard(0)] on [4, 2, 6] viewed as [8, 6] is [_StridedShard(0, sf=4),
    # Shard(0)]. renorm's "S(0) -> S(0)" holds for any kind of sharding on dim 0.
    mesh = M.submesh((2, 2))
    y = torch.randn(4, 2, 6, dtype=torch.float64)
    want = torch.renorm(y.view(8, 6), 2, 0, 1.0)
    with _ranks(mesh), decompshard.enabled(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        x = distribute_tensor(y, mesh, [S1, S0]).view(8, 6)
        assert x.placements == (_StridedShard(0, split_factor=4), S0)
        with CommDebugMode() as comm:
            out = torch.renorm(x, 2, 0, 1.0)
        assert out.placements == x.placements and comm.get_total_counts() == 0
        torch.testing.assert_close(M.full(out), want)


# ------------------------------------------------------------- caching


def test_derivation_is_paid_once_per_op_and_shapes(mesh4, monkeypatch):
    from decompshard._compat import clear_dtensor_caches as _clear_dtensor_caches

    solved = []
    real = decompshard.solve.derive._solve
    monkeypatch.setattr(decompshard.solve.derive, "_solve", lambda result, *a: solved.append(result.op) or real(result, *a))
    decompshard.clear_caches()
    args = [torch.randn(8), torch.randn(8, 12), torch.randn(12)]
    with decompshard.enabled():
        for _ in range(3):
            _run(torch.addmv, args, [[R], [S1], [S0]], mesh4)
        # DTensor caches by placements: clear it, so decompshard is asked again
        for placements in ([[R], [S1], [S0]], [[S0], [S0], [R]], [[R], [R], [R]]):
            _clear_dtensor_caches()
            _run(torch.addmv, args, placements, mesh4)
        assert solved.count(aten.addmv.default) == 1
        _run(torch.addmv, [torch.randn(16), torch.randn(16, 12), torch.randn(12)], [[R], [S1], [S0]], mesh4)
        assert solved.count(aten.addmv.default) == 2  # new shapes: derived again


# ------------------------------------------------------------- large meshes, fake data


def _fake_dtensor(shape, placements, mesh):
    from decompshard.mesh.lift import local_shape_nd

    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():  # torch's shape helper makes small tensors: not fake ones
        local_shape = local_shape_nd(shape, placements, tuple(mesh.shape), (0,) * mesh.ndim)  # rank 0's
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(torch.empty(local_shape), mesh, placements, run_check=False,
                              shape=torch.Size(shape), stride=stride)


def test_8x8_mesh_huge_shapes_fake_group():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mesh = M.submesh((8, 8))
    n = 1 << 16  # a 64k x 64k float32 matrix: 16 GiB if it were real
    placements = ([S0, R], [S0, S1], [R, S0])
    counts = {}
    for on in (False, True):
        with FakeTensorMode(), decompshard.enabled() if on else M.torch_fallback(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            args = [_fake_dtensor(s, p, mesh) for s, p in zip([(n,), (n, n), (n,)], placements)]
            with CommDebugMode() as comm:
                out = torch.addmv(*args)
            counts[on] = comm.get_total_counts()
            if on:
                assert out.placements == (S0, Partial("sum"))
                assert tuple(out.to_local().shape) == (n // 8,)
    assert counts[True] == 0 < counts[False]


def test_4x4x4_mesh_fake_group():
    from torch._subclasses.fake_tensor import FakeTensorMode

    mesh = M.submesh((4, 4, 4))
    n = 1 << 14
    with FakeTensorMode(), decompshard.enabled(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        b1 = _fake_dtensor((64, n, 256), [S0, Shard(2), R], mesh)
        b2 = _fake_dtensor((64, 256, n), [S0, S1, Shard(2)], mesh)
        bias = _fake_dtensor((n, n), [R, R, S1], mesh)
        with CommDebugMode() as comm:
            out = torch.addbmm(bias, b1, b2)
        assert comm.get_total_counts() == 0
        assert out.placements == (Partial("sum"), Partial("sum"), S1)
        x = _fake_dtensor((n, 4 * n), [S0, S1, S1], mesh)
        with CommDebugMode() as comm:
            y = torch.renorm(x, 2, 0, 1.0)
        # the norm over dim 1 needs dim 1 whole: mesh dims 1 and 2 move it, dim 0 stays
        assert y.placements[0] == S0 and comm.get_total_counts() == 2


# ------------------------------------------------------------- torch.compile


def _compiled_vs_eager(fn, args, dynamic):
    torch._dynamo.reset()
    eager = fn(*args)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(fn, backend="aot_eager", dynamic=dynamic, fullgraph=True)(*args)
    return eager, compiled, [str(w.message) for w in caught if "decompshard" in str(w.message)]


def _model_fn(b, m, v, x):
    return torch.addmv(b, m, v) * 2, torch.renorm(x, 2, 0, 1.0) + 1


def _fake_group_args(mesh, addmv_placements=(R, S1, S0)):
    # Real rank-0 shards: with the fake group, rank 0's numbers are real where no
    # collective runs.
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(s, generator=gen) for s in [(8,), (8, 12), (12,), (8, 6)]]
    out = []
    for t, p in zip(full, (*addmv_placements, S0)):
        local = t if p == R else t.tensor_split(4, p.dim)[0].contiguous()
        out.append(DTensor.from_local(local, mesh, [p], run_check=False, shape=t.shape, stride=t.stride()))
    return out


def test_compile_static_shapes_matches_eager(mesh4):
    with decompshard.enabled():
        eager, compiled, warned = _compiled_vs_eager(_model_fn, _fake_group_args(mesh4), dynamic=False)
    assert warned == []
    for e, c in zip(eager, compiled):
        assert e.placements == c.placements
        torch.testing.assert_close(c.to_local(), e.to_local())
    # decompshard's strategies, compiled in (torch's fallback would all-gather for addmv)
    assert (compiled[0].placements, compiled[1].placements) == ((Partial("sum"),), (S0,))


def test_compile_dynamic_shapes_keep_the_derived_strategies(mesh4):
    # Symbolic shapes derive what static shapes derive (runtime/symbolic_sizes.py): addmv
    # keeps S(0) and renorm S(0), with no warning; they ran replicated before.
    args = _fake_group_args(mesh4, addmv_placements=(S0, S0, R))
    with decompshard.enabled():
        eager, compiled, warned = _compiled_vs_eager(_model_fn, args, dynamic=True)
    assert warned == []
    assert eager[0].placements == compiled[0].placements == (S0,)
    assert compiled[1].placements == eager[1].placements == (S0,)
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c.to_local(), e.to_local())


# ------------------------------------------------------------- every rank decides alike


def test_a_kernel_run_that_times_out_stops_the_program_rather_than_one_rank_choosing_alone(mesh4, monkeypatch):
    """Every rank chooses its strategy alone from the same global shapes; the choice must
    not hang on anything one rank can see differently. A timed-out empty-shard kernel run
    (a loaded machine, a fork that inherited a held lock) is such a thing: outside
    enable() it refuses the candidate, under enable() it raises, and it is never cached."""
    import decompshard.solve.kernel_sandbox as ks
    from decompshard._compat import clear_dtensor_caches
    from decompshard.errors import Indeterminate

    runs = []
    monkeypatch.setattr(ks, "output_shapes_on_zeros",
                        lambda op, *a, **k: runs.append(op) or ("timeout", "no answer within 30 s (the run was killed)"))
    x = torch.randn(2, 5)  # S(0) over 3 ranks leaves rank 2 an empty shard: the kernel must run
    decompshard.clear_caches()
    clear_dtensor_caches()
    # DTensor turns any error of its decomposition fallback into "does not have a sharding
    # strategy registered", raised from ours: the traceback shows both
    with decompshard.enabled(), pytest.raises(NotImplementedError) as stopped:
        _run(lambda t: aten.permute_copy.default(t, [1, 0]), [x], [[S0]], mesh4)
    cause = stopped.value.__cause__
    assert isinstance(cause, Indeterminate), stopped.value
    assert "permute_copy" in str(cause) and "no answer on an empty shard" in str(cause)
    assert "this rank choose a strategy alone" in str(cause)
    assert runs

    decompshard.clear_caches()
    runs.clear()
    derived = decompshard.derive_rules(aten.permute_copy.default, x, [1, 0])
    rule = next(r for r in derived.rules if r.inputs == (decompshard.placements.S(0),))
    assert rule.even_only and "no answer on an empty shard" in rule.source  # held at W=2, refused at W=3
    assert runs and derived.indeterminate

    monkeypatch.undo()  # a real answer now: neither the kernel run nor the rule set was remembered
    again = decompshard.derive_rules(aten.permute_copy.default, x, [1, 0])
    assert again is not derived and "S(0) -> S(1)" in again.as_strings() and not again.indeterminate
    assert decompshard.derive_rules(aten.permute_copy.default, x, [1, 0]) is again  # a real answer is kept
    clear_dtensor_caches()
    with decompshard.enabled():
        out, placements, _ = _run(lambda t: aten.permute_copy.default(t, [1, 0]), [x], [[S0]], mesh4)
    torch.testing.assert_close(out, x.t())
