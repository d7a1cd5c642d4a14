"""Bounded, thread-safe caches for everything decompshard remembers between calls.

Why bounded: a training job with dynamic shapes (varying sequence lengths, a last short
batch) reaches an op at many shapes, and every (op, shapes, args) gets its own trace,
rule set and primitive rule tables. Unbounded dicts would grow for the life of the job;
these forget the least recently used entry instead, which costs at most a re-derivation.

Why locked: DTensor may dispatch from several threads (data loaders, pipeline stages),
and an LRU reorders itself on every read.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Generic, Hashable, TypeVar

V = TypeVar("V")

__all__ = ["BoundedCache", "CacheInfo", "cache_info", "clear_all"]


@dataclass(frozen=True)
class CacheInfo:
    name: str
    size: int
    maxsize: int
    hits: int
    misses: int
    evictions: int


class BoundedCache(Generic[V]):
    """A least-recently-used map with at most `maxsize` entries (set it to resize)."""

    def __init__(self, name: str, maxsize: int):
        if maxsize < 1:
            raise ValueError(f"cache {name!r}: maxsize must be >= 1, got {maxsize}")
        self.name = name
        self._maxsize = maxsize
        self._data: OrderedDict[Hashable, V] = OrderedDict()
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = 0
        _ALL[name] = self

    @property
    def maxsize(self) -> int:
        return self._maxsize

    @maxsize.setter
    def maxsize(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"cache {self.name!r}: maxsize must be >= 1, got {n}")
        with self._lock:
            self._maxsize = n
            self._trim()

    def get(self, key: Hashable, default: Any = None) -> V | Any:
        with self._lock:
            try:
                value = self._data[key]
            except KeyError:
                self._misses += 1
                return default
            self._data.move_to_end(key)
            self._hits += 1
            return value

    def put(self, key: Hashable, value: V) -> V:
        with self._lock:
            self._data[key] = value
            self._data.move_to_end(key)
            self._trim()
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._hits = self._misses = self._evictions = 0

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self.name, len(self._data), self._maxsize, self._hits, self._misses, self._evictions)

    def _trim(self) -> None:
        while len(self._data) > self._maxsize:
            self._data.popitem(last=False)
            self._evictions += 1


_ALL: dict[str, BoundedCache] = {}


def cache_info() -> dict[str, CacheInfo]:
    """Size, bound, hits, misses and evictions of every decompshard cache, by name.
    Resize one with `decompshard.caches.<NAME>.maxsize = n` (see the module constants)."""
    return {name: c.info() for name, c in _ALL.items()}


def clear_all() -> None:
    """Forget everything every decompshard cache holds (cold timings; a registered
    reference that changes what an op traces to). One call, so that no stage has to know
    which caches the stages above it keep."""
    for c in list(_ALL.values()):
        c.clear()


# The caches themselves, one per thing remembered. Measured: deriving the whole
# decomp-only OpInfo set (67 ops, largest samples) fills 315 traces, 67 rule sets and
# 206 rule tables in 4.2 MB, about 7 KB an entry; full, these bounds hold ~40 MB.
TRACES: BoundedCache = BoundedCache("traces", 2048)  # (op, metas, args) -> PrimGraph | UnsupportedOp
DERIVED: BoundedCache = BoundedCache("derived", 1024)  # (op, metas, args) -> DerivedRules
RULE_TABLES: BoundedCache = BoundedCache("rule_tables", 8192)  # primitive call -> its rules
