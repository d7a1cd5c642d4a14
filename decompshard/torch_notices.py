"""torch's notices that say nothing to a decompshard user, each dropped by its own text:
never a whole logger, level or warning category, so whatever else torch says still shows.

Used by the CLI around every command and by `decompshard doctor`'s probes. No torch
import here (`decompshard --help` must not pay for one): a logging filter attaches to
the logger by name before torch creates it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

_CPP_EXTENSION_LOGGER = "torch.utils.cpp_extension"


class _NoCudaRuntime(logging.Filter):
    """A CUDA build of torch on a machine without a GPU logs "No CUDA runtime is found,
    using CUDA_HOME=..." once, when torch.utils.cpp_extension is first imported (OpInfo's
    database imports it: coverage's capture, doctor's hook probes). It is about building
    C++ extensions, which decompshard never does; the logger's other messages (a compiler
    mismatch while a user's --import module builds its own extension) stay."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("No CUDA runtime is found")


_FILTER = _NoCudaRuntime()


@contextlib.contextmanager
def no_cuda_runtime_notice() -> Iterator[None]:
    """Drop the "No CUDA runtime is found" notice inside (nested uses are fine)."""
    logger = logging.getLogger(_CPP_EXTENSION_LOGGER)
    added = _FILTER not in logger.filters
    if added:
        logger.addFilter(_FILTER)
    try:
        yield
    finally:
        if added:
            logger.removeFilter(_FILTER)
