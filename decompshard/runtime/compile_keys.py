"""torch.compile's caches keyed on what decompshard installs.

Why: torch's AOT autograd and FX graph caches (on disk, on by default) key a compiled
graph on the dynamo graph, its inputs (a DTensor by its shape and placements) and torch's
own settings, never on what DTensor dispatches an op to. A graph compiled by torch alone
(a mean loss `Partial(avg)`, wrong with ignored targets) would be served to a later run
with `enable()`, and a graph compiled with it to a run without it. Dynamo's in-memory
code cache is the same within a process: it guards on inputs and global state, not on
DTensor's tables.

So each record that changes what DTensor does (`enable()`'s, the guard's) sets torch's
compile cache key tag while installed, as one entry of its declaration: the tag it found
(a user's own, kept) followed by `what:digest`, the digest of decompshard's version and
source and of what the record installs (its switches, the fences installed on this
release, the plans' ops). TablePatches puts the tag back exactly when it is taken out.
And on every change the compiled code dynamo holds is dropped, so the next call compiles
again and meets the keys of what is installed now. Both are torch settings of this
thread's context (torch's configs are ContextVars): a compile in another thread reads
the tag that thread's context holds.
"""

from __future__ import annotations

import functools
import hashlib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Iterable

from decompshard._compat import compile_cache_tag, forget_compiled_code, set_compile_cache_tag
from decompshard.runtime.table_patches import Entry, Slot

__all__ = ["TAG", "fingerprint", "forget_compiled", "tag_entry"]

TAG = Slot("torch.compiler.config.cache_key_tag", set_compile_cache_tag)


@functools.lru_cache(maxsize=None)
def _source_digest() -> str:
    """decompshard's own code and tables, as installed (a checkout's edits included)."""
    package = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for path in sorted(p for p in package.rglob("*") if p.suffix in (".py", ".json")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=None)
def _version() -> str:
    try:
        return version("decompshard")
    except PackageNotFoundError:  # run from a checkout without installing
        return "checkout"


def fingerprint(parts: Iterable[str]) -> str:
    """A digest, stable across processes, of decompshard's version and source and `parts`."""
    digest = hashlib.sha256()
    for part in (_version(), _source_digest(), *parts):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def tag_entry(what: str, parts: Iterable[str]) -> Entry:
    """The entry that sets the compile cache key tag: the tag set now, then `what:` and
    the fingerprint of `parts`."""
    found, mine = compile_cache_tag(), f"{what}:{fingerprint(parts)}"
    return TAG, TAG.name, f"{found}+{mine}" if found else mine


def forget_compiled() -> None:
    """Dynamo's compiled code dropped (a record went in or out): see the module doc."""
    forget_compiled_code()
