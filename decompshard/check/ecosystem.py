"""Import the ecosystem's model libraries on a CPU-only torch build.

PyPI's torchvision wheel is built against CUDA torch: beside the CPU build its C
extension (`torchvision/_C.so`, which needs `libc10_cuda.so`) does not load, and
`import torchvision` then dies in `_meta_registrations`, which registers fake kernels
for `torchvision::nms` / `qnms` whether or not the extension defined them ("operator
torchvision::nms does not exist"). Everything the model zoo uses (ResNet, timm's
layers) is plain Python over aten ops, so defining the two schemas the import needs
is enough; the detection kernels themselves stay unavailable and raise if called.
A torchvision whose extension does load is imported untouched.
"""

from __future__ import annotations

import sys
from types import ModuleType

import torch

_SHIM_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_shim: torch.library.Library | None = None


def import_torchvision() -> ModuleType:
    """`import torchvision`, defining the schemas its import needs when its C extension
    cannot load against this torch build."""
    global _shim
    try:
        import torchvision
        return torchvision
    except RuntimeError as e:
        if "torchvision::" not in str(e) or _shim is not None:
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]  # the failed import left half-initialised modules behind
    _shim = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SHIM_SCHEMAS:
        _shim.define(schema)
    import torchvision
    return torchvision


def import_timm() -> ModuleType:
    """`import timm` (which imports torchvision) on a CPU-only torch build."""
    import_torchvision()
    import timm
    return timm
