"""Bounded caches: the least recently used entry goes, nothing else changes."""

from __future__ import annotations

import threading

import pytest
import torch

import decompshard
from decompshard import caches
from decompshard.caches import BoundedCache

aten = torch.ops.aten


def test_lru_evicts_the_least_recently_used_and_counts():
    c = BoundedCache("test-lru", 2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1  # a is now the most recent
    c.put("c", 3)  # evicts b
    assert "b" not in c and c.get("b") is None
    assert c.get("a") == 1 and c.get("c") == 3
    info = c.info()
    assert (info.size, info.maxsize, info.hits, info.misses, info.evictions) == (2, 2, 3, 1, 1)
    c.maxsize = 1  # shrinking trims at once, oldest first
    assert len(c) == 1 and "c" in c
    c.clear()
    assert len(c) == 0 and c.info().hits == 0


def test_maxsize_must_be_positive():
    with pytest.raises(ValueError, match="maxsize"):
        BoundedCache("test-bad", 0)
    c = BoundedCache("test-bad2", 3)
    with pytest.raises(ValueError, match="maxsize"):
        c.maxsize = 0


@pytest.fixture
def small_caches():
    saved = {name: c.maxsize for name, c in (("t", caches.TRACES), ("d", caches.DERIVED))}
    decompshard.clear_caches()
    caches.TRACES.maxsize = 3
    caches.DERIVED.maxsize = 2
    yield
    caches.TRACES.maxsize = saved["t"]
    caches.DERIVED.maxsize = saved["d"]
    decompshard.clear_caches()


def test_derivations_past_the_bound_are_forgotten_and_rederived_alike(small_caches):
    def derive(n):
        return decompshard.derive_rules(aten.mse_loss.default, torch.randn(n, 3), torch.randn(n, 3))

    first = derive(4)
    rules = first.as_strings()  # reads .rules: local traces go through the bounded trace cache
    assert any("[even]" in r for r in rules)  # the mean's P(avg) needs the local traces
    derive(5).rules
    derive(6).rules
    assert len(caches.DERIVED) == 2 and len(caches.TRACES) <= 3
    assert caches.DERIVED.info().evictions >= 1
    again = derive(4)
    assert again is not first  # it was evicted, so this is a fresh derivation...
    assert again.as_strings() == rules  # ...with the same answer
    assert decompshard.derive_rules(aten.mse_loss.default, torch.randn(4, 3), torch.randn(4, 3)) is again


def test_cache_info_names_every_cache():
    info = decompshard.cache_info()
    assert {"traces", "derived", "rule_tables"} <= set(info)
    decompshard.clear_caches()
    x = torch.randn(4, 6)
    decompshard.derive_rules(aten.addr.default, x, torch.randn(4), torch.randn(6)).rules
    info = decompshard.cache_info()
    assert info["derived"].size == 1 and info["traces"].size >= 2 and info["rule_tables"].size >= 1


def test_concurrent_derivations_agree(small_caches):
    """Threads deriving at more shapes than the caches hold: no error, same answers."""
    shapes = [(4, 3), (5, 3), (6, 3), (4, 3), (5, 3), (6, 3)]
    want = {
        s: decompshard.derive_rules(aten.mse_loss.default, torch.randn(s), torch.randn(s)).as_strings()
        for s in set(shapes)
    }
    got, errors = [], []

    def work(s):
        try:
            for _ in range(3):
                r = decompshard.derive_rules(aten.mse_loss.default, torch.randn(s), torch.randn(s))
                got.append((s, r.as_strings()))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(s,)) for s in shapes]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(got) == 18 and all(r == want[s] for s, r in got)
