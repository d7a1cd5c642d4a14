"""Plug derived strategies into DTensor, and take them out again.

DTensor's sharding propagator sends every op without a registered strategy to one
object, `sharding_propagator.decomp_strategy` (torch 2.13: DecompShardingStrategy). We
swap in `DerivedStrategy`, which answers with the one strategy `lift.choose` picked
(so DTensor's own cost model never overrides ours), and widen `has_decomp` to the
decompositions decompshard registers itself. Ops with native strategies never reach it.

If the op cannot be derived (data-dependent, random, no meta kernel) it runs fully
replicated — always correct — and says so once in a warning. Under torch.compile with
dynamic (symbolic) shapes it hands the op to torch's own fallback, also with a warning
(and runs it replicated where torch has no strategy either).

Derivation runs with DTensor's and the caller's modes (LocalTensorMode, FakeTensorMode)
switched off and the dispatch keys of a plain thread, so what DTensor gets is what a
direct `derive_rules` call gives, and the cache holds one answer per op and shapes.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from typing import Any, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ._compat import DTensorSpec, OpSpec, OpStrategy, sharding_propagator
from .dispatch_modes.clean import clean_dispatch_state
from .dispatch_modes.tracing import has_decomposition

_lock = threading.RLock()
_saved: dict[str, Any] = {}
_warned: set[str] = set()
_local = threading.local()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


class DerivedStrategy:
    """Stands where torch's DecompShardingStrategy stood."""

    def __init__(self, torch_fallback: Any):
        self.torch_fallback = torch_fallback
        self.sharding_prop = torch_fallback.sharding_prop

    @staticmethod
    def has_decomp(op: torch._ops.OpOverload) -> bool:
        return has_decomposition(op)

    def ensure_schema_info(self, op: torch._ops.OpOverload) -> None:
        self.torch_fallback.ensure_schema_info(op)
        info = self.sharding_prop.op_to_schema_info.get(op)
        if info is not None and _has_tensor_list_arg(op) and not info.needs_pytree:
            info.needs_pytree = True  # so args_spec sees the tensors inside lists

    def propagate_strategy(self, op_schema: Any) -> OpStrategy | None:
        from .errors import UnsupportedOp

        op = op_schema.op
        flat, spec = tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))
        specs = [x for x in flat if isinstance(x, DTensorSpec)]
        if not specs:
            return None
        if any(not isinstance(s, int) for x in specs for s in x.tensor_meta.shape):
            return self._symbolic(op_schema, specs)
        mesh = specs[0].mesh
        current = [tuple(s.placements) for s in specs]
        try:
            with clean_dispatch_state():
                # plain meta tensors: made here, not under the caller's modes (under
                # LocalTensorMode a factory call would return a LocalTensor)
                meta_flat = [
                    torch.empty_strided(x.tensor_meta.shape, x.tensor_meta.stride, dtype=x.tensor_meta.dtype, device="meta")
                    if isinstance(x, DTensorSpec) else x
                    for x in flat
                ]
                args, kwargs = tree_unflatten(meta_flat, spec)
                best = _first_runnable(op, args, kwargs, tuple(mesh.shape), current, len(op_schema.args_spec))
        except UnsupportedOp as e:  # pragma: no cover - derive reports, lift raises only on misuse
            _warn_once(f"uns:{op}", f"decompshard: {op}: {e.reason}; running replicated")
            best = None
        except Exception as e:  # a bug of ours must not take the user's program down
            _warn_once(f"err:{op}", f"decompshard: {op}: internal error ({type(e).__name__}: {e}); running replicated")
            best = None
        if best is None:
            return _replicated(op_schema, specs, mesh)
        ins = [DTensorSpec(mesh, tuple(p), tensor_meta=s.tensor_meta) for p, s in zip(best.input_placements, specs)]
        outs = [None if o is None else DTensorSpec(mesh, tuple(o)) for o in best.output_placements]
        output_specs = outs[0] if len(outs) == 1 else tuple(outs)
        n_args = len(op_schema.args_spec)
        return OpStrategy([OpSpec(output_specs, input_specs=ins[:n_args], redistribute_cost=[[0.0] for _ in ins[:n_args]])])

    def _symbolic(self, op_schema: Any, specs: list) -> OpStrategy | None:
        """Symbolic shapes (torch.compile, dynamic=True). Derived rules hold for the shapes
        they were derived at ([even] rules, local checks), so these go to torch's own
        fallback; where torch has nothing either, all-Replicate is right for any shape.
        torch's fallback asks the propagator about the ops inside the decomposition too;
        those nested calls get exactly torch's answer."""
        op = op_schema.op
        nested = getattr(_local, "in_torch_fallback", False)
        if not nested:
            _warn_once(f"dyn:{op}", f"decompshard: {op} has symbolic shapes; using torch's own decomposition fallback")
        _local.in_torch_fallback = True
        try:
            theirs = self.torch_fallback.propagate_strategy(op_schema)
        except (NotImplementedError, AssertionError):
            if nested:
                raise
            theirs = None
        finally:
            _local.in_torch_fallback = nested
        if theirs is None and not nested:
            _warn_once(f"dynrep:{op}", f"decompshard: {op}: torch's fallback has no strategy for symbolic shapes; running replicated")
            return _replicated(op_schema, specs, specs[0].mesh)
        return theirs


def _first_runnable(op, args, kwargs, mesh_shape, current, n_args):
    from .derive import derive_rules
    from .lift import ranked

    derived = derive_rules(op, *args, **kwargs)
    if derived.unsupported_reason:
        _warn_once(f"uns:{op}", f"decompshard: {op}: unsupported ({derived.unsupported_reason}); running replicated")
        return None

    def runnable(ins, cost) -> bool:
        # DTensor must be able to redistribute to it, and kwarg tensors cannot be
        # redistributed through DTensor's schema suggestion at all
        return cost.dtensor_supported and all(
            tuple(p) == tuple(c) for p, c in zip(ins[n_args:], current[n_args:]))

    return next((s for s in ranked(op, args, kwargs, mesh_shape, current, accept=runnable) if s.valid), None)


def _replicated(op_schema, specs, mesh) -> OpStrategy:
    from ._compat import TorchReplicate

    rep = tuple(TorchReplicate() for _ in range(mesh.ndim))
    n_args = len(op_schema.args_spec)
    ins = [DTensorSpec(mesh, rep, tensor_meta=s.tensor_meta) for s in specs[:n_args]]
    n_out = sum(1 for r in op_schema.op._schema.returns if "Tensor" in str(r.type))
    out = DTensorSpec(mesh, rep)
    return OpStrategy([OpSpec(out if n_out <= 1 else tuple(out for _ in range(n_out)), input_specs=ins, redistribute_cost=[[0.0] for _ in ins])])


def _has_tensor_list_arg(op) -> bool:
    return any("Tensor" in str(a.type) and "[]" in str(a.type) for a in op._schema.arguments)


def _clear_dtensor_caches() -> None:
    sp = sharding_propagator()
    sp.propagate_op_sharding.cache_clear()
    clear = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if clear is not None:
        clear()


def enable(guard_native: bool | None = None) -> None:
    """Route every DTensor op that lacks a strategy through decompshard. Idempotent.

    `guard_native=True` (default: the DECOMPSHARD_GUARD_NATIVE environment variable) also
    keeps DTensor away from native strategies decompshard's audit proved wrong (guard.py)."""
    from . import guard
    from ._compat import DecompShardingStrategy

    if guard.wanted(guard_native):
        guard.install()
    elif guard_native is False:
        guard.uninstall()
    with _lock:
        if _saved:
            return
        sp = sharding_propagator()
        _saved["decomp_strategy"] = sp.decomp_strategy
        _saved["has_decomp"] = DecompShardingStrategy.__dict__["has_decomp"]
        sp.decomp_strategy = DerivedStrategy(sp.decomp_strategy)
        DecompShardingStrategy.has_decomp = staticmethod(has_decomposition)
        _clear_dtensor_caches()


def disable() -> None:
    """Restore DTensor exactly as it was before `enable()`. Idempotent."""
    from . import guard
    from ._compat import DecompShardingStrategy

    guard.uninstall()
    with _lock:
        if not _saved:
            return
        sharding_propagator().decomp_strategy = _saved.pop("decomp_strategy")
        DecompShardingStrategy.has_decomp = _saved.pop("has_decomp")
        _clear_dtensor_caches()


def is_enabled() -> bool:
    return bool(_saved)


@contextlib.contextmanager
def enabled(guard_native: bool | None = None) -> Iterator[None]:
    """`with decompshard.enabled(): ...` — enabled inside, previous state restored after."""
    from . import guard

    was, guarded = is_enabled(), guard.is_installed()
    enable(guard_native)
    try:
        yield
    finally:
        if not was:
            disable()
        (guard.install if guarded else guard.uninstall)()
