"""The running torch release: its version as a tuple, the releases decompshard is tested on,
and the release string measured findings are looked up by."""

from __future__ import annotations

import torch

__all__ = [
    "SUPPORTED", "TORCH_RELEASE", "TORCH_VERSION",
]

TORCH_VERSION = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
SUPPORTED = ((2, 13), (2, 14), (2, 15))
# The running release as the tested-release data names it ("2.14.1"; local build tags
# such as "+cpu" dropped): findings measured on one release (the native audit's, the
# guard's) are looked up by it, never compared as version numbers.
TORCH_RELEASE = torch.__version__.split("+")[0]
