"""`CommBytes`: a dispatch mode that counts the collectives a DTensor program issues and
the bytes each rank puts into them (the model zoo's communication columns,
check/model.py `run_training_step`).

It sits below DTensor on purpose: DTensor turns each op into local ops and collectives,
and only those collectives reach this mode. Not torch's `CommDebugMode` itself: its
module tracker raises on models whose hooks return early (transformers' output
capturing); the collectives counted are the ones CommDebugMode's registry names.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from decompshard._compat import TorchDispatchMode
from decompshard._compat import tree_leaves

__all__ = ["CommBytes"]


class CommBytes(TorchDispatchMode):
    """The collectives CommDebugMode counts (its registry: functional and c10d
    collectives), and the bytes each rank puts into them (the first tensor argument's
    size, the largest rank's where ranks differ). Not CommDebugMode itself: its module
    tracker raises on models whose hooks return early (transformers' output capturing)."""

    def __init__(self) -> None:
        from torch.distributed.tensor.debug import CommDebugMode
        from decompshard._compat import c10d_collective_ops

        super().__init__()
        self.registry = set(CommDebugMode().comm_registry) | set(c10d_collective_ops)
        self.count = self.bytes = 0
        self.bytes_by_kind: dict[str, int] = {}  # collective name -> bytes
        # what moved and why: (the DTensor op whose dispatch issued it, with its inputs'
        # placements and shapes; collective) -> [count, bytes]. A caller relabels
        # collectives it issues itself (`label`: the zoo's gradient redistribution)
        self.label = ""
        self.by_op: dict[tuple[str, str], list[int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            self.label = _op_text(func, args)
            return NotImplemented  # let DTensor turn the op into local ops and collectives
        out = func(*args, **(kwargs or {}))
        if getattr(func, "_overloadpacket", None) in self.registry:
            self.count += 1
            nbytes = _arg_bytes(args)
            self.bytes += nbytes
            name = func._overloadpacket.__name__
            self.bytes_by_kind[name] = self.bytes_by_kind.get(name, 0) + nbytes
            row = self.by_op.setdefault((self.label, name), [0, 0])
            row[0] += 1
            row[1] += nbytes
        return out

    def top(self, n: int = 12) -> list[dict[str, Any]]:
        """The `n` (op, collective) pairs that moved the most bytes, most first: where to
        look when a plan moves more than it should."""
        rows = sorted(self.by_op.items(), key=lambda kv: -kv[1][1])[:n]
        return [{"op": op, "collective": c, "count": k, "bytes": b} for (op, c), (k, b) in rows]

    def get_total_counts(self) -> int:
        """The number of collectives counted (CommDebugMode's name for it)."""
        return self.count


def _op_text(func: Any, args: Sequence[Any]) -> str:
    """`aten.mm.default(S(0),P(sum) [64, 32]; R,S(1) [32, 64])`: the op and each DTensor
    input's placements and global shape."""
    from torch.distributed.tensor import DTensor

    ins = [f"{','.join(map(str, a.placements))} {list(a.shape)}" for a in tree_leaves(args) if isinstance(a, DTensor)]
    return f"{func}({'; '.join(ins)})"


def _arg_bytes(args: Sequence[Any]) -> int:
    """Bytes of the first tensor argument on the rank that holds the most (a
    LocalTensor's ranks may hold different sizes: uneven shards)."""
    for a in tree_leaves(args):
        if isinstance(a, torch.Tensor):
            per_rank = getattr(a, "_local_tensors", None)
            ts = list(per_rank.values()) if per_rank else [a]
            return max(t.numel() * t.element_size() for t in ts)
    return 0
