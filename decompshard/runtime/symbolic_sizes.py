"""Derived strategies at symbolic sizes (torch.compile with dynamic shapes).

One compiled graph serves every size its guards admit, so the strategy chosen for a call
with SymInt sizes must be right at each of them, and choosing it must not specialize the
graph. The rules are derived at the example sizes (the SymInts' hints, read without a
guard), and a strategy is kept only if its validity does not rest on those sizes:

- every rule it uses is derived again, unchanged, at probe sizes (each symbol at 2, the
  smallest size a backed symbol takes, where ranks hold empty or one-row shards; and at
  an odd size past the hint, where shards are uneven), and the strategy passes the
  mesh's local-shape check there (`lift.strategy_invalid_reason`): a rule that holds
  only because of the hint's sizes (a decomposition that branches on a size, a local
  shape a kernel refuses, a dim that splits evenly) is not used;
- a strategy with an [even] rule (right only where the sharded dims split evenly: a mean
  over a sharded dim as P(avg), SDPA's batch rule through its flattening views) is kept
  only where each dim it shards is a multiple of the mesh dims sharding it at the hint,
  and that is made a guard of the graph (`guard_divisible`; none where the expression
  proves it, as a global batch `4*s0` built from local shards): a later size that does
  not split evenly compiles another graph rather than reuse a wrong one. Its probes are
  the sizes above times the mesh size, so they split evenly too.

The probes are sizes, not a proof over every size: they catch what depends on evenness,
on tiny shards and on the hint's own values. Where nothing holds, the op runs
replicated inside the graph (always right). Values that are symbolic outside tensor
sizes (a SymInt argument) or sizes with no hint (unbacked) are not derived: replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from decompshard._compat import (DTensorSpec, TorchShard, guard_divisible, has_hint, is_symbolic, symbol_hints,
                                 symbols_of, tree_unflatten, value_at)
from decompshard.mesh.lift import strategy_invalid_reason

__all__ = ["SizeCheck", "SymbolicSizes", "concrete_metas", "is_symbolic_spec"]


def is_symbolic_spec(spec: Any) -> bool:
    """A DTensorSpec whose shape or strides hold a SymInt."""
    tm = spec.tensor_meta
    return any(is_symbolic(v) for v in (*tm.shape, *tm.stride))


@dataclass(frozen=True)
class SymbolicSizes:
    """The values to derive at: `hints` (symbol -> example value), `probes` and
    `even_probes`, other assignments a chosen strategy must hold at too (the second for
    one with an [even] rule); or `reason`, why not to derive."""

    hints: dict
    probes: tuple[dict, ...] = ()
    even_probes: tuple[dict, ...] = ()
    reason: str = ""

    @staticmethod
    def of(flat: Sequence[Any], n_ranks: int) -> SymbolicSizes:
        hints: dict = {}
        for x in flat:
            if isinstance(x, DTensorSpec):
                for v in (*x.tensor_meta.shape, *x.tensor_meta.stride):
                    known = symbol_hints(v)
                    if not has_hint(v) or len(known) != len(symbols_of(v)):
                        return SymbolicSizes({}, reason="a size with no hint (data-dependent)")
                    hints.update(known)
            elif _holds_symbolic(x):
                return SymbolicSizes({}, reason="a symbolic non-tensor argument")
        probes = ({s: 2 for s in hints}, {s: 2 * h + 1 + i for i, (s, h) in enumerate(hints.items())})
        return SymbolicSizes(hints, probes, tuple({s: v * n_ranks for s, v in p.items()} for p in probes))

    def probe_arguments(self, flat: Sequence[Any], spec: Any) -> tuple[list, list] | None:
        """(args, kwargs) of meta tensors at each probe and at each even probe, or None
        where one cannot be built (a size negative there). Call inside clean_dispatch_state."""
        try:
            return ([tree_unflatten(concrete_metas(flat, values), spec) for values in self.probes],
                    [tree_unflatten(concrete_metas(flat, values), spec) for values in self.even_probes])
        except (RuntimeError, ValueError, KeyError):
            return None


@dataclass(frozen=True)
class SizeCheck:
    """Whether a strategy chosen at the hints holds at every size (see the module)."""

    specs: list  # the call's DTensorSpecs, symbolic sizes
    probes: list  # (args, kwargs) at the probes
    even_probes: list  # the same at the even probes

    def holds(self, op: Any, strategy: Any, mesh_shape: Sequence[int]) -> bool:
        even = any(r.even_only for r in strategy.rules)
        if any(strategy_invalid_reason(op, a, k, strategy, mesh_shape)
               for a, k in (self.even_probes if even else self.probes)):
            return False
        return not even or _guard_even_split(strategy.input_placements, self.specs, mesh_shape)


def _guard_even_split(input_placements: Sequence[tuple], specs: Sequence[Any], mesh_shape: Sequence[int]) -> bool:
    """Each tensor dim a placement shards is a multiple of the product of the mesh dims
    sharding it (so every rank's piece splits evenly at each step), guarded; False
    where the hint is not, or where a _StridedShard makes the pieces other than that."""
    for placements, spec in zip(input_placements, specs):
        need: dict[int, int] = {}
        for m, p in enumerate(placements):
            if p.is_shard():
                if type(p) is not TorchShard:
                    return False
                need[p.dim] = need.get(p.dim, 1) * mesh_shape[m]
        if not all(guard_divisible(spec.tensor_meta.shape[d], n) for d, n in need.items()):
            return False
    return True


def _holds_symbolic(x: Any) -> bool:
    if isinstance(x, (list, tuple)):
        return any(_holds_symbolic(y) for y in x)
    return is_symbolic(x)


def concrete_metas(flat: Sequence[Any], values: dict | None) -> list:
    """Plain meta tensors for the specs in `flat` (other leaves as they are), their
    SymInt sizes and strides set to `values` (symbol -> int); `values` None: the specs
    must be concrete. Made here, not under the caller's modes (under LocalTensorMode a
    factory call would return a LocalTensor): call inside clean_dispatch_state."""
    out = []
    for x in flat:
        if isinstance(x, DTensorSpec):
            tm = x.tensor_meta
            shape = tuple(value_at(v, values) if values is not None else v for v in tm.shape)
            stride = tuple(value_at(v, values) if values is not None else v for v in tm.stride)
            out.append(torch.empty_strided(shape, stride, dtype=tm.dtype, device="meta"))
        else:
            out.append(x)
    return out
