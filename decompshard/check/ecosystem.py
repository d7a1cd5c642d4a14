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

from decompshard.errors import UsageError, one_line

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


def import_transformers() -> ModuleType:
    """`import transformers`, with torchvision (when it is installed) imported first through
    import_torchvision, so transformers' own import of it finds it loaded. transformers does
    not need torchvision: a missing one is no reason to refuse it."""
    try:
        import_torchvision()
    except ModuleNotFoundError as e:
        if e.name != "torchvision":
            raise
    import transformers
    return transformers


def import_timm() -> ModuleType:
    """`import timm` (which imports torchvision) on a CPU-only torch build."""
    import_torchvision()
    import timm
    return timm


# ------------------------------------------------------------------ a missing library

# the pip name where it is not the module's
_PIP_NAMES = {"PIL": "pillow", "sklearn": "scikit-learn"}


class MissingLibrary(UsageError):
    """A model library (or one it imports) is not installed: one line naming the package
    and how to install it. A usage error (exit 2): the environment, not decompshard."""

    def __init__(self, needed_by: str, library: str, error: ImportError) -> None:
        self.package = missing_package(error) or library
        if isinstance(error, ModuleNotFoundError):
            what = f"{self.package} is not installed"
        else:
            what = f"{library} does not import ({one_line(error, 160, with_type=False)})"
        super().__init__(f"{needed_by} needs {library}, and {what}: {install_hint(self.package)}")


def missing_package(error: ImportError) -> str | None:
    """The pip name of the top-level package an ImportError is about, if it names one."""
    name = (getattr(error, "name", None) or "").split(".")[0]
    return _PIP_NAMES.get(name, name) or None


def install_hint(package: str) -> str:
    """How to install a missing library: by name, or the extras decompshard pins for
    this torch release (pyproject.toml: `test` and `torchXYZ`)."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"pip install {package}, or in a decompshard checkout pip install -e '.[test,torch{major}{minor}]'"


def import_library(library: str, needed_by: str) -> ModuleType | None:
    """Import a zoo family's library (transformers, torchvision, timm; None for the
    others, which need none); MissingLibrary when it, or a package it needs, is missing."""
    importer = {"transformers": import_transformers, "torchvision": import_torchvision,
                "timm": import_timm}.get(library)
    if importer is None:
        return None
    try:
        return importer()
    except ImportError as e:
        raise MissingLibrary(needed_by, library, e) from None
