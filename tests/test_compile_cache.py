"""Compiled graphs never outlive a change of `enable()` (issue 37, item 4).

torch's AOT autograd and FX graph caches (on disk, on by default) key a graph on the
dynamo graph and its inputs, not on what DTensor dispatches to. On torch 2.13 a mean
cross-entropy with ignored targets on a `Shard(0)` batch compiled by torch alone is
`Partial(avg)` of per-rank means (wrong); `enable()`'s fence makes it `Replicate` of the
global sum over the global count. Without the compile cache key tag, the graph torch
alone wrote was served to a later run with `enable()` (an AOT autograd cache hit, loss
`Partial(avg)`), and the reverse. A later run is modelled in-process by dropping dynamo's
code (`torch._dynamo.reset()`), so the compile goes back to the caches on disk, which
each test gets fresh. On the simulated (fake) group rank 0's numbers are its own, so
the compiled loss is checked against the eager one under the same settings: placement
and rank 0's value; and the cache counters say whether a graph was served.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate, Shard

import decompshard
from decompshard._compat import compile_cache_tag
from decompshard.runtime.compile_keys import TAG
from decompshard.runtime.fences import guard
from decompshard.verify.dtensor_case import device_mesh

pytestmark = pytest.mark.usefixtures("world")


@pytest.fixture
def fresh_caches(tmp_path, monkeypatch):
    """An empty inductor cache dir (FX graphs, AOT autograd entries, kernels), both caches
    on whatever the environment says, no compiled code left in dynamo."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=True, force_disable_caches=False), \
            torch._functorch.config.patch(enable_autograd_cache=True), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch._dynamo.reset()


def _loss(x, t):
    return F.cross_entropy(x, t, ignore_index=-100)


def _batch():
    """Rank 0's part of a (16, 5) batch, Shard(0) over 4 ranks; 3 of its 4 targets ignored
    (other ranks hold all theirs: a mean of means is wrong)."""
    mesh = device_mesh((4,))
    gen = torch.Generator().manual_seed(0)
    x, t = torch.randn(16, 5, generator=gen), torch.randint(0, 5, (16,), generator=gen)
    t[:3] = -100
    return tuple(DTensor.from_local(a.tensor_split(4)[0].clone(), mesh, [Shard(0)], run_check=False,
                                    shape=a.shape, stride=a.stride()) for a in (x, t))


def _run_compiled(args, fn=None):
    """A compile as a later run makes it (nothing in memory: only the caches on disk),
    its loss, the eager loss under the same settings, and the AOT autograd cache counts."""
    from torch._dynamo.utils import counters

    if fn is None:
        torch._dynamo.reset()
        fn = torch.compile(_loss, backend="inductor")
    counters.clear()
    out = fn(*args)
    return out, _loss(*args), dict(counters["aot_autograd"])


def _same(out, eager):
    assert tuple(out.placements) == tuple(eager.placements)
    torch.testing.assert_close(out.to_local(), eager.to_local())


def test_cache_written_by_torch_alone_is_not_served_to_enable(fresh_caches):
    args = _batch()
    decompshard.disable()
    out, eager, first = _run_compiled(args)
    _same(out, eager)
    assert first.get("autograd_cache_saved") == 1
    decompshard.enable()
    out, eager, second = _run_compiled(args)
    assert tuple(eager.placements) == (Replicate(),)  # the fence: the global mean
    _same(out, eager)
    assert not second.get("autograd_cache_hit") and second.get("autograd_cache_miss") == 1
    decompshard.disable()  # and torch alone's own graph is still there for it
    assert _run_compiled(args)[2].get("autograd_cache_hit") == 1


def test_cache_written_with_enable_is_not_served_after_disable(fresh_caches):
    args = _batch()
    decompshard.enable()
    out, eager, first = _run_compiled(args)
    _same(out, eager)
    assert first.get("autograd_cache_saved") == 1
    decompshard.disable()
    out, eager, second = _run_compiled(args)
    _same(out, eager)
    assert not second.get("autograd_cache_hit") and second.get("autograd_cache_miss") == 1


def test_cache_not_shared_across_switches(fresh_caches):
    """enable() with the guard off is another program: the guard's graph is not served."""
    args = _batch()
    decompshard.enable()
    _run_compiled(args)
    decompshard.enable(guard_native=False)
    out, eager, counts = _run_compiled(args)
    _same(out, eager)
    assert not counts.get("autograd_cache_hit") and counts.get("autograd_cache_miss") == 1


def test_compiled_function_recompiles_after_enable(fresh_caches):
    """The same compiled function object, in one process: dynamo's in-memory code is
    not served across enable()/disable() either."""
    args = _batch()
    decompshard.disable()
    fn = torch.compile(_loss, backend="inductor")
    _same(*_run_compiled(args, fn)[:2])
    decompshard.enable()
    out, eager, _ = _run_compiled(args, fn)
    assert tuple(eager.placements) == (Replicate(),)
    _same(out, eager)
    decompshard.disable()
    _same(*_run_compiled(args, fn)[:2])


def _raw_tag():
    """The override the tag holds (torch's unset marker where none): what must come back."""
    return torch.compiler.config._config[TAG.name.rpartition(".")[2]].user_override.get()


def test_tag_follows_switches_and_is_restored_exactly():
    decompshard.disable()
    before, raw = compile_cache_tag(), _raw_tag()
    tags = {}
    for guard_native in (True, False):
        for plans in (True, False):
            decompshard.enable(guard_native=guard_native, plans=plans)
            tags[guard_native, plans] = compile_cache_tag()
            assert "decompshard:" in tags[guard_native, plans]
    assert len(set(tags.values())) == 4 and before not in tags.values()
    decompshard.enable(guard_native=False)
    assert compile_cache_tag() == tags[False, True]  # the same settings, the same tag
    decompshard.disable()
    assert compile_cache_tag() == before and _raw_tag() is raw
    guard.install()  # the guard alone changes DTensor too
    alone = compile_cache_tag()
    assert alone.startswith("decompshard-guard:") and alone not in tags.values()
    guard.uninstall()
    assert _raw_tag() is raw


def test_tag_keeps_a_users_tag_and_gives_it_back():
    decompshard.disable()
    with torch.compiler.config.patch(cache_key_tag="mine"):
        decompshard.enable()
        assert compile_cache_tag().startswith("mine+decompshard-guard:")
        decompshard.disable()
        assert compile_cache_tag() == "mine"


def test_tag_reaches_both_cache_keys():
    """What torch hashes for an FX graph key carries the tag, and the AOT autograd key's
    details are FX graph details (torch/_functorch/_aot_autograd/autograd_cache.py)."""
    from torch._functorch._aot_autograd.autograd_cache import AOTAutogradCacheDetails
    from torch._inductor.codecache import FxGraphHashDetails

    assert issubclass(AOTAutogradCacheDetails, FxGraphHashDetails)
    with decompshard.enabled():
        details = FxGraphHashDetails(None, [], {}, [])
        assert details.cache_key_tag == compile_cache_tag() and "decompshard:" in details.cache_key_tag
    assert FxGraphHashDetails(None, [], {}, []).cache_key_tag == compile_cache_tag()
