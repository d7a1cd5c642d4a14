"""Which ops a command sweeps: `--ops` patterns (exact names and globs) checked early,
then matched against the ops OpInfo reaches. Shared by `coverage`, its native audit and
`check`.
"""

from __future__ import annotations

import fnmatch
import os
from typing import TYPE_CHECKING, Any, Sequence

from decompshard.errors import UsageError

if TYPE_CHECKING:
    import torch

__all__ = ["all_aten_overloads", "select_ops", "validate_globs", "validate_patterns"]

_GLOB = set("*?[")


def _normalize(pattern: str) -> str:
    p = pattern.strip().replace("::", ".")
    if p.startswith("torch.ops."):
        p = p[len("torch.ops."):]
    if p.startswith("aten.") or p.startswith("aten*") or p.count(".") >= 2:  # ns.name.overload: a custom op too
        return p
    return f"aten.{p}"


def split_patterns(patterns: str) -> list[str]:
    parts = [p.strip() for p in patterns.split(",") if p.strip()]
    if not parts:
        raise UsageError(f"--ops {patterns!r} names no op: expected comma-separated names or globs, "
                         "e.g. 'aten.addmv.default,aten.pixel_*'")
    return parts


def all_aten_overloads(cache_dir: str | None = None) -> list[str]:
    """Every aten overload registered with the dispatcher, as 'aten.<name>.<overload>':
    what a glob can possibly match. Asking the dispatcher needs torch (2 s to import);
    with `cache_dir` the list is kept there, keyed by the installed torch's version.py
    (its version and commit), and read back without importing torch."""
    key = _torch_build_key()
    path = os.path.join(cache_dir, f"aten-overloads-{key}.txt") if cache_dir and key else None
    if path is not None and os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            names = f.read().split()
        if names:
            return names
    import torch

    names = []
    for name in torch._C._dispatch_get_all_op_names():
        if name.startswith("aten::"):
            base, _, overload = name[len("aten::"):].partition(".")
            names.append(f"aten.{base}.{overload or 'default'}")
    if path is not None:
        _write_atomically(path, "\n".join(sorted(names)) + "\n")
    return names


def _torch_build_key() -> str | None:
    """A hash of the installed torch's version.py (version and git commit), found without
    importing torch; None when there is no such file."""
    import hashlib
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    try:
        with open(os.path.join(os.path.dirname(spec.origin), "version.py"), "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return None


def _write_atomically(path: str, text: str) -> None:
    import tempfile

    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError:  # a read-only cache folder only costs the next run 2 s
        return


def validate_globs(patterns: str, cache_dir: str | None = None) -> None:
    """A glob that matches no aten op at all (see `all_aten_overloads`: no torch import
    once the list is kept in `cache_dir`)."""
    names: list[str] | None = None
    for raw in split_patterns(patterns):
        pat = _normalize(raw)
        if _GLOB & set(pat):
            names = all_aten_overloads(cache_dir) if names is None else names
            if not any(fnmatch.fnmatchcase(n, pat) for n in names):
                raise UsageError(f"--ops pattern {raw!r} matches no aten op")


def validate_patterns(patterns: str, cache_dir: str | None = None) -> None:
    """Fail fast, before the (slow) OpInfo capture: an empty --ops, a glob that matches no
    aten op at all, an unknown exact name. (A glob that matches aten ops none of which
    OpInfo reaches is found out by `select_ops`.)"""
    validate_globs(patterns, cache_dir)
    from decompshard.op_names import resolve_op

    for raw in split_patterns(patterns):
        pat = _normalize(raw)
        if not _GLOB & set(pat):
            try:
                resolve_op(pat)
            except ValueError as e:
                raise UsageError(f"--ops: {e}") from None


def select_ops(patterns: str | None, reached: Sequence["torch._ops.OpOverload"]) -> list["torch._ops.OpOverload"]:
    """Ops to sweep: every reached op (no patterns), or those matching the comma-separated
    globs, plus exact overload names OpInfo does not reach. A pattern that selects nothing
    is a usage error: a typo should not produce an empty, successful report."""
    from decompshard.op_names import resolve_op

    if patterns is None:
        return sorted(reached, key=str)
    names = {str(op): op for op in reached}
    chosen: dict[str, Any] = {}
    for raw in split_patterns(patterns):
        pat = _normalize(raw)
        if _GLOB & set(pat):
            hits = [n for n in names if fnmatch.fnmatchcase(n, pat)]
            if not hits:
                raise UsageError(f"--ops pattern {raw!r} matches no aten op reached by OpInfo")
            chosen.update((n, names[n]) for n in hits)
        elif pat in names:
            chosen[pat] = names[pat]
        else:
            try:
                op = resolve_op(pat)
            except ValueError as e:
                raise UsageError(f"--ops: {e}") from None
            chosen[str(op)] = op
    return [chosen[n] for n in sorted(chosen)]
