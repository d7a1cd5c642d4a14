"""Simulated ranks: every rank of a mesh played in this process by a fake process group
(FakeStore, from torch's test utilities) and LocalTensorMode
(torch.distributed._local_tensor), both private; imported on first use, since neither
is needed outside a simulated run. Also the two places DTensor splits a tensor with
`torch.chunk` (the simulator's chunk mend, verify/per_rank.py, replaces them) and the
imports a standalone simulated script needs (verify/native_repro.py writes one)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from decompshard._compat.dtensor import TorchShard

__all__ = [
    "SIMULATED_SCRIPT_IMPORTS", "chunk_split_points", "fake_store", "local_tensor_api", "local_tensor_mode",
    "make_local_tensor", "outside_simulation", "rank_tensors", "simulating_ranks",
]


def fake_store() -> Any:
    """The store of a "fake" process group (collectives that move no data)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def local_tensor_mode(ranks: Any) -> Any:
    """LocalTensorMode over `ranks`: every tensor op runs once per simulated rank."""
    from torch.distributed._local_tensor import LocalTensorMode

    return LocalTensorMode(ranks)


def make_local_tensor(per_rank: dict) -> Any:
    """A LocalTensor holding a different plain tensor per simulated rank."""
    from torch.distributed._local_tensor import LocalTensor

    return LocalTensor(per_rank)


def rank_tensors(t: Any) -> dict | None:
    """A LocalTensor's plain tensor per simulated rank; None for anything else."""
    return getattr(t, "_local_tensors", None)


def simulating_ranks() -> bool:
    """Whether a LocalTensorMode is active (one process plays every rank)."""
    from torch.distributed._local_tensor import local_tensor_mode as active_mode

    return active_mode() is not None


@contextlib.contextmanager
def outside_simulation() -> Iterator[None]:
    """LocalTensorMode off inside (if one is active): plain arithmetic on one rank's
    tensors stays plain, instead of running once per simulated rank."""
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    with maybe_disable_local_tensor_mode():
        yield


def local_tensor_api() -> str:
    """The module of LocalTensorMode, LocalTensor and the mode helpers the functions above
    use; raises ImportError where this torch lacks one of them."""
    import torch.distributed._local_tensor as module
    from torch.distributed._local_tensor import (  # noqa: F401
        LocalTensor, LocalTensorMode, local_tensor_mode, maybe_disable_local_tensor_mode,
    )

    return module.__name__


def chunk_split_points() -> tuple[tuple[Any, str], tuple[Any, str]]:
    """The two places DTensor and its collectives split a tensor with `torch.chunk`, each
    as (owner, attribute): `Shard._custom_chunk` (a staticmethod of DTensor's Shard) and
    `torch._utils._chunk_or_narrow_cat` (a module function). The same in 2.13-2.15."""
    import torch._utils as tutils

    return (TorchShard, "_custom_chunk"), (tutils, "_chunk_or_narrow_cat")


# The imports of a standalone script that plays every rank with LocalTensorMode on a fake
# process group (no decompshard needed to build the DTensors).
SIMULATED_SCRIPT_IMPORTS = (
    "import torch",
    "import torch.distributed as dist",
    "from torch.distributed._local_tensor import LocalTensor, LocalTensorMode",
    "from torch.distributed.device_mesh import DeviceMesh",
    "from torch.distributed.tensor import DTensor, Partial, Replicate, Shard",
    "from torch.testing._internal.distributed.fake_pg import FakeStore",
    "from torch.utils._pytree import tree_flatten",
)
