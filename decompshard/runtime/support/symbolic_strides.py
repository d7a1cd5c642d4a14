"""A DTensor whose shape is static and whose stride is symbolic runs under torch.compile.

`x[:, :1]` of a DTensor whose sequence length is symbolic (`mark_dynamic`, a second
sequence length) has a static shape `[b, 1]` and a symbolic stride `(s, 1)`. DTensor's C++
dispatch (2.13 to 2.15) looks every op up in its own sharding cache unless a spec's
*shape* holds a SymInt; it checks the shape only, so it hashes this spec, and hashing a
symbolic stride raises "unhashable type: non-nested SymInt". Python turns that TypeError
inside `-` into "unsupported operand type(s) for -: 'DTensor' and 'int'": transformers'
packed-sequence mask (`position_ids[:, :1] - 1`) stopped every data-parallel Llama
compiled with a symbolic sequence length, with or without decompshard.

Such a spec is hashed here by its identity. The cache then finds an entry only for the
very same spec object, which the cache itself keeps alive (its id is not reused), so
within one trace an op met twice on it reuses the decision, and nothing crosses to
another trace or another size; two equal specs hash apart, which costs a cache miss,
never a wrong decision. The cache holds such specs (with their sizes' symbols) until
DTensor's caches are cleared, as `enable()` and `disable()` do: one entry per op met on
one in a trace. Every spec whose hash DTensor can compute keeps DTensor's hash.
Tests: tests/test_symbolic_sizes.py.
"""

from __future__ import annotations

from typing import Any, Iterator

from decompshard._compat import DTensorSpec
from decompshard.runtime.table_patches import Entry, WarnOnce

__all__ = ["entries"]


def _hash_of(dtensor_hash: Any) -> Any:
    def __hash__(spec: Any) -> int:
        try:
            return dtensor_hash(spec)
        except TypeError:  # a symbolic stride (or size) DTensor cannot hash
            return object.__hash__(spec)

    __hash__.__wrapped__ = dtensor_hash  # type: ignore[attr-defined]
    return __hash__


def entries(warn_once: WarnOnce) -> Iterator[Entry]:
    """DTensorSpec's hash, where DTensor's raises, the spec's identity."""
    yield DTensorSpec, "__hash__", _hash_of(DTensorSpec.__hash__)
