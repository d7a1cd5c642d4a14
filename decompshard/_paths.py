"""Where decompshard keeps files between runs (no torch import: the CLI needs it early)."""

from __future__ import annotations

import os

__all__ = ["cache_dir"]


def cache_dir() -> str:
    """$DECOMPSHARD_CACHE_DIR, else $XDG_CACHE_HOME/decompshard, else ~/.cache/decompshard:
    the OpInfo capture of `decompshard coverage`, the history of `decompshard explain -i`."""
    explicit = os.environ.get("DECOMPSHARD_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "decompshard")
