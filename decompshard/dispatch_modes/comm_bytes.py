"""`CommBytes`: a dispatch mode that counts the collectives a DTensor program issues and
the bytes each rank puts into them (the model zoo's communication columns,
check/model.py `run_training_step`).

It sits below DTensor on purpose: DTensor turns each op into local ops and collectives,
and only those collectives reach this mode. Not torch's `CommDebugMode` itself: its
module tracker raises on models whose hooks return early (transformers' output
capturing); the collectives counted are the ones CommDebugMode's registry names.

`CommBytes.listing` keeps one `Collective` per collective, named by the
DTensor op that issued it (the last op DTensor dispatched: an op's own input moves, or
a `redistribute()` after it), so that a byte count can be read as what moved and why
(bench/comm_listing.py prints it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from decompshard._compat import TorchDispatchMode
from decompshard._compat import rank_tensors, tree_leaves

__all__ = ["CommBytes", "Collective"]


@dataclass(frozen=True)
class Collective:
    """One collective: the DTensor op in flight (its DTensor arguments as
    'shape placements'), the collective's name, the largest rank's local shape and its
    bytes (as counted in `CommBytes.bytes`)."""

    op: str
    operands: str
    collective: str
    local_shape: tuple[int, ...]
    bytes: int


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
        self.listing: list[Collective] = []  # one record per collective, in order
        # the DTensor op in flight (its text, its DTensor operands); a caller relabels
        # collectives it issues itself (the zoo: its gradient redistribution)
        self.in_flight = ("(before any DTensor op)", "")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            self.in_flight = (str(func), _operands(args, kwargs))
            return NotImplemented  # let DTensor turn the op into local ops and collectives
        out = func(*args, **(kwargs or {}))
        if getattr(func, "_overloadpacket", None) in self.registry:
            self.count += 1
            nbytes = _arg_bytes(args)
            self.bytes += nbytes
            name = func._overloadpacket.__name__
            self.bytes_by_kind[name] = self.bytes_by_kind.get(name, 0) + nbytes
            self.listing.append(Collective(*self.in_flight, name, _arg_shape(args), nbytes))
        return out

    def top(self, n: int = 12) -> list[dict[str, Any]]:
        """The `n` (op with its operands, collective) pairs that moved the most bytes,
        most first: where to look when a plan moves more than it should."""
        by_op: dict[tuple[str, str], list[int]] = {}
        for c in self.listing:
            row = by_op.setdefault((f"{c.op}({c.operands})", c.collective), [0, 0])
            row[0] += 1
            row[1] += c.bytes
        rows = sorted(by_op.items(), key=lambda kv: -kv[1][1])[:n]
        return [{"op": op, "collective": c, "count": k, "bytes": b} for (op, c), (k, b) in rows]

    def get_total_counts(self) -> int:
        """The number of collectives counted (CommDebugMode's name for it)."""
        return self.count


def _arg_bytes(args: Sequence[Any]) -> int:
    """Bytes of the first tensor argument on the rank that holds the most (a
    LocalTensor's ranks may hold different sizes: uneven shards)."""
    for a in tree_leaves(args):
        if isinstance(a, torch.Tensor):
            per_rank = rank_tensors(a)
            ts = list(per_rank.values()) if per_rank else [a]
            return max(t.numel() * t.element_size() for t in ts)
    return 0


def _arg_shape(args: Sequence[Any]) -> tuple[int, ...]:
    """The local shape of the first tensor argument on the rank that holds the most."""
    for a in tree_leaves(args):
        if isinstance(a, torch.Tensor):
            per_rank = rank_tensors(a)
            ts = list(per_rank.values()) if per_rank else [a]
            return tuple(max(ts, key=lambda t: t.numel()).shape)
    return ()


def _operands(args: Any, kwargs: Any) -> str:
    from torch.distributed.tensor import DTensor

    return " ".join(f"{list(a.shape)}{''.join(map(str, a.placements))}"
                    for a in tree_leaves((args, kwargs)) if isinstance(a, DTensor))
