"""The user's own modules, imported for the CLI: `--import MODULE` and `--model MODULE:...`.

A custom op (`torch.library.custom_op`) exists only once the module defining it has been
imported, and its registered reference (decompshard.register_reference) only once the
module registering it has. The commands import what the user names here; the worker
processes the commands run ops in (decompshard.workers) import the same modules before
their first job, so a custom op resolves by name there as in the parent.

MODULE is a dotted module name importable from the working directory
(`mypkg.kernels`) or a path to a Python file (`kernels.py`, `path/to/ops.py`).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from types import ModuleType
from typing import Any, Callable, Sequence

_IMPORTED: list[str] = []  # specs imported in this process, in order (what workers repeat)


def import_user_module(spec: str, flag: str = "--import") -> ModuleType:
    """Import `spec` (a dotted name, or a path ending in .py) and remember it for the
    worker processes. A failure is a UsageError naming `flag` and the cause."""
    from decompshard.errors import UsageError, one_line

    try:
        module = _import(spec)
    except Exception as e:  # ImportError, or the module's own import-time error
        raise UsageError(f"{flag}: cannot import {spec!r}: {one_line(e)}") from None
    if spec not in _IMPORTED:
        _IMPORTED.append(spec)
    return module


def imported() -> tuple[str, ...]:
    """The specs imported so far in this process."""
    return tuple(_IMPORTED)


def call_with_user_modules(specs: Sequence[str], fn: Callable[..., Any], args: tuple) -> Any:
    """In a worker: import `specs` (once per process) and run fn(*args)."""
    for spec in specs:
        if spec not in _IMPORTED:
            _import(spec)
            _IMPORTED.append(spec)
    return fn(*args)


def _import(spec: str) -> ModuleType:
    """The working directory is importable, as with `python -m`. A file is loaded under a
    name derived from its absolute path, so loading it again (in this process, or the
    same file named twice) returns the module already loaded rather than running it
    twice: a second run would register its custom ops twice, which torch refuses."""
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    if not spec.endswith(".py"):
        return importlib.import_module(spec)
    path = os.path.abspath(spec)
    if not os.path.isfile(path):
        raise ImportError(f"no such file: {spec}")
    name = "_decompshard_user_" + hashlib.sha1(path.encode()).hexdigest()[:12]
    if name in sys.modules:
        return sys.modules[name]
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
