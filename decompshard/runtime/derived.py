"""Derived strategies: DTensor's decomposition fallback answered by decompshard.

DTensor's sharding propagator sends every op without a registered strategy to one
object, `sharding_propagator.decomp_strategy` (torch's DecompShardingStrategy).
`enable()` swaps in `DerivedStrategy`, which answers with one strategy: the cheapest
valid one DTensor can run, first in `lift.ranked`'s order (`_first_runnable`; so
DTensor's own cost model never overrides ours), and widens `has_decomp` to the
decompositions decompshard registers itself. Ops with native strategies never reach it.
DTensor moves only positional tensors; keyword tensors (SDPA's keyword-only `attn_mask`)
are routed to the placements our strategy names by support's keyword routing, so slicing
a replicated mask, which is free, wins over moving q, k and v. `out=` and other written
keyword tensors stay put.

If the op cannot be derived (data-dependent, random, no meta kernel), or has no
decomposition at all (many backward ops), it runs fully replicated (always correct)
and says so once in a warning. Under torch.compile with dynamic (symbolic) shapes the
rules are derived at the sizes' hints and a strategy is kept only where it holds at every
size (runtime/symbolic_sizes.py: probe sizes, [even] rules behind a guard); what is not
derived there (a symbolic non-tensor argument, a size with no hint) runs replicated.

Derivation runs with DTensor's and the caller's modes (LocalTensorMode, FakeTensorMode)
switched off and the dispatch keys of a plain thread, so what DTensor gets is what a
direct `derive_rules` call gives, and the cache holds one answer per op and shapes.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import torch

from decompshard._compat import (DTensorSpec, FakeTensorMode, OpSpec, OpStrategy, TensorMeta, TorchReplicate, hint_of, is_symbolic,
                                 same_sizes, same_symbolic,
                                 inferred_schema_info, tree_flatten, tree_unflatten)
from decompshard.dispatch_modes.clean import clean_dispatch_state
from decompshard.dispatch_modes.reference import check_reference, reference_of
from decompshard.dispatch_modes.tracing import has_decomposition
from decompshard.errors import Indeterminate, UnsupportedOp, one_line
from decompshard.mesh.lift import ranked
from decompshard.runtime import fallbacks
from decompshard.runtime.symbolic_sizes import SizeCheck, SymbolicSizes, concrete_metas, is_symbolic_spec
from decompshard.runtime.support.kwarg_routing import kwarg_routing_active, stage_kwarg_targets
from decompshard.runtime.table_patches import TablePatches
from decompshard.solve.derive import derive_rules
from decompshard.solve.localcheck import strict_checks

__all__ = ["DerivedStrategy", "mutates_self", "reaches_decompshard"]


class DerivedStrategy:
    """Stands where torch's DecompShardingStrategy stood."""

    def __init__(self, torch_fallback: Any, patches: TablePatches):
        self.torch_fallback = torch_fallback
        self.patches = patches  # enable()'s record: entries only a call can name go into it
        self.sharding_prop = torch_fallback.sharding_prop
        # torch's own test, read before `enable()` widens it
        self.torch_has_decomp = type(torch_fallback).has_decomp

    @staticmethod
    def has_decomp(op: torch._ops.OpOverload) -> bool:
        return reaches_decompshard(op)

    def ensure_schema_info(self, op: torch._ops.OpOverload) -> None:
        """The op's entry in DTensor's `op_to_schema_info` (it keys the sharding cache).
        Where torch's fallback would take the op itself, torch registers its own entry,
        which stays after `disable()` as it would without decompshard. What only
        decompshard needs (an entry for an op torch cannot decompose; `needs_pytree`, so
        `args_spec` sees the tensors inside `Tensor[]` arguments) is a new object set
        through the patch record, and `disable()` puts torch's entry, or none, back."""
        table = self.sharding_prop.op_to_schema_info
        if self.torch_has_decomp(op):
            self.torch_fallback.ensure_schema_info(op)
        info = table.get(op)
        wanted = info if info is not None else inferred_schema_info(op)
        if _has_tensor_list_arg(op) and not wanted.needs_pytree:
            wanted = dataclasses.replace(wanted, needs_pytree=True)
        if wanted is not info:
            self.patches.add(table, op, wanted)

    def propagate_strategy(self, op_schema: Any, output_tensor_meta: Any = None) -> OpStrategy | None:
        """The one strategy `lift` chose for this call. torch 2.14+ also passes the output
        tensor metas (its fallback hands them to the mesh expansion); DTensor attaches
        them to our output specs itself afterwards, on every supported release, so they
        are not needed here."""
        op = op_schema.op
        _see_into_lists(op_schema, self.sharding_prop)
        flat, spec = tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))
        specs = [x for x in flat if isinstance(x, DTensorSpec)]
        if not specs:
            return None
        mesh = specs[0].mesh
        sizes = SymbolicSizes.of(flat, mesh.size()) if any(is_symbolic_spec(x) for x in specs) else None
        if sizes is not None and sizes.reason:
            return self._symbolic(op_schema, specs, sizes.reason)
        if not has_decomposition(op):
            _fall_back(op, fallbacks.NO_DECOMPOSITION,
                       f"decompshard: {op} has no sharding strategy and no decomposition; running replicated")
            return _replicated(op_schema, specs, mesh)
        current = [tuple(s.placements) for s in specs]
        n_args = len(op_schema.args_spec)
        movable, pinned = _kwarg_tensors(op_schema, n_args, len(specs))
        with clean_dispatch_state():  # plain meta tensors, made outside the caller's modes
            args, kwargs = tree_unflatten(concrete_metas(flat, None if sizes is None else sizes.hints), spec)
            _check_reference(op, args, kwargs, mesh)
            probes = None if sizes is None else sizes.probe_arguments(flat, spec)
        if sizes is not None and probes is None:
            return self._symbolic(op_schema, specs, "sizes that cannot be probed")
        size_check = None if probes is None else SizeCheck(specs, *probes)
        try:
            with clean_dispatch_state(), strict_checks():
                best = _first_runnable(op, args, kwargs, tuple(mesh.shape), current, pinned, size_check)
        except Indeterminate as e:  # every rank must choose alike: never choose alone
            raise Indeterminate(f"decompshard: {e}. Stopping rather than letting this rank choose a strategy "
                                "alone: the other ranks may choose differently and run other collectives") from None
        except UnsupportedOp as e:  # pragma: no cover - derive reports, lift raises only on misuse
            _fall_back(op, fallbacks.UNSUPPORTED, f"decompshard: {op}: {e.reason}; running replicated")
            best = None
        except Exception as e:  # a bug of ours must not take the user's program down (the checks fail on it)
            _fall_back(op, fallbacks.INTERNAL_ERROR,
                       f"decompshard: {op}: internal error ({one_line(e, 300)}); running replicated")
            best = None
        if best is None:
            return _replicated(op_schema, specs, mesh)
        ins = [DTensorSpec(mesh, tuple(p), tensor_meta=s.tensor_meta) for p, s in zip(best.input_placements, specs)]
        outs = _output_specs(op_schema, specs, ins, [None if o is None else tuple(o) for o in best.output_placements])
        output_specs = outs[0] if len(outs) == 1 else tuple(outs)
        if movable:
            stage_kwarg_targets({name: ins[i] for name, i in movable.items()})
        return OpStrategy([OpSpec(output_specs, input_specs=ins[:n_args], redistribute_cost=[[0.0] for _ in ins[:n_args]])])

    def _symbolic(self, op_schema: Any, specs: list, reason: str) -> OpStrategy:
        """Symbolic shapes decompshard does not derive for (runtime/symbolic_sizes.py):
        the op runs replicated, which is right for any size."""
        op = op_schema.op
        _fall_back(op, fallbacks.SYMBOLIC, f"decompshard: {op} has symbolic shapes with {reason}; running replicated")
        return _replicated(op_schema, specs, specs[0].mesh)


def _check_reference(op, args, kwargs, mesh) -> None:
    """An op with a registered plain-torch reference (decompshard.register_reference):
    before its derived strategy is used, its real kernel and the reference must agree on
    one device on random inputs of these (meta) arguments' shapes (reference.check_reference,
    cached); otherwise ReferenceMismatch, naming the op, reaches the caller."""

    if reference_of(op) is None:
        return
    device = "cpu" if mesh.device_type in ("cpu", "meta") else mesh.device_type
    check_reference(op, args, kwargs, device=device)


def _kwarg_tensors(op_schema: Any, n_args: int, n_specs: int) -> tuple[dict[str, int], frozenset[int]]:
    """({keyword: its index among the op's tensors} for the keyword tensors DTensor will
    move to the chosen strategy's placements, indices of the tensors that must keep
    theirs). Keyword tensors move through support/kwarg_routing.py
    (installed by `enable()`); without it, or inside a keyword list, they stay. An `out=`
    or otherwise written keyword argument always stays: the op must write into the
    caller's tensor, not into a redistributed copy of it."""

    kwarg_idx = range(n_args, n_specs)
    names = [k for k, v in op_schema.kwargs_schema.items() if isinstance(v, DTensorSpec)]
    if not kwarg_routing_active() or len(names) != len(kwarg_idx):
        return {}, frozenset(kwarg_idx)
    written = _written_args(op_schema.op)
    movable = {name: i for name, i in zip(names, kwarg_idx) if name not in written}
    return movable, frozenset(i for name, i in zip(names, kwarg_idx) if name in written)


def _written_args(op) -> set[str]:
    """The op's `out=` and other written (`Tensor(a!)`) arguments."""
    return {a.name for a in op._schema.arguments if a.is_out or (a.alias_info is not None and a.alias_info.is_write)}


def _first_runnable(op, args, kwargs, mesh_shape, current, pinned: frozenset[int] = frozenset(),
                    size_check: SizeCheck | None = None):
    """The cheapest valid strategy DTensor can run: it must be able to redistribute to
    it, and the tensors at the `pinned` indices must keep their current placements.
    `size_check` (symbolic sizes: `args` are at the hints): the strategy must hold at
    every size (runtime/symbolic_sizes.py)."""

    derived = derive_rules(op, *args, **kwargs)
    if derived.unsupported_reason:
        _fall_back(op, fallbacks.UNSUPPORTED,
                   f"decompshard: {op}: unsupported ({derived.unsupported_reason}); running replicated")
        return None

    in_place = mutates_self(op)

    def runnable(ins, cost) -> bool:
        # DTensor must be able to redistribute to it; pinned tensors (written keyword
        # arguments) and an in-place op's self cannot move (DTensor would run the op on
        # a copy and relabel self)
        return cost.dtensor_supported and all(tuple(ins[i]) == tuple(current[i]) for i in pinned) and (
            not in_place or tuple(ins[0]) == tuple(current[0]))

    def keeps_self(s) -> bool:
        return not in_place or tuple(s.output_placements[0]) == tuple(current[0])

    def any_size(s) -> bool:
        return size_check is None or size_check.holds(op, s, mesh_shape)

    return next((s for s in ranked(op, args, kwargs, mesh_shape, current, accept=runnable,
                                valid_only=True) if s.valid and keeps_self(s) and any_size(s)), None)


def mutates_self(op: torch._ops.OpOverload) -> bool:
    """An in-place op: writes its first argument and returns it."""
    args, returns = op._schema.arguments, op._schema.returns
    return bool(args and args[0].alias_info is not None and args[0].alias_info.is_write
                and returns and returns[0].alias_info is not None)


def _replicated(op_schema, specs, mesh) -> OpStrategy:
    """Every tensor replicated, keyword ones included: a keyword tensor left sharded
    reaches the kernel as one rank's piece beside whole positional tensors, and an
    attention mask of one example broadcasts over the whole batch (a wrong result that
    claims Replicate). A keyword tensor DTensor cannot move here raises instead; an
    `out=` tensor keeps its placement (the kernel writes the whole result into it)."""

    if mutates_self(op_schema.op) and not all(p.is_replicate() for p in specs[0].placements):
        raise RuntimeError(
            f"decompshard: {op_schema.op} in place on self {tuple(specs[0].placements)}: no derived strategy "
            "keeps self's placement, and DTensor cannot move the self of an in-place op (it would update a "
            "copy); redistribute self first or use the out-of-place op")

    rep = tuple(TorchReplicate() for _ in range(mesh.ndim))
    n_args = len(op_schema.args_spec)
    ins = [DTensorSpec(mesh, rep, tensor_meta=s.tensor_meta) for s in specs[:n_args]]
    movable, pinned = _kwarg_tensors(op_schema, n_args, len(specs))
    written = _written_args(op_schema.op)
    names = [k for k, v in op_schema.kwargs_schema.items() if isinstance(v, DTensorSpec)]
    kw_ins = []
    for i, spec in enumerate(specs[n_args:], start=n_args):
        if i not in pinned:
            kw_ins.append(DTensorSpec(mesh, rep, tensor_meta=spec.tensor_meta))
            continue
        name = names[i - n_args] if len(names) == len(specs) - n_args else None
        if name not in written and any(not isinstance(p, TorchReplicate) for p in spec.placements):
            raise RuntimeError(
                f"decompshard: {op_schema.op} must run replicated, and its keyword tensor argument "
                f"{name or i - n_args} is {tuple(spec.placements)}, which DTensor does not redistribute here")
        kw_ins.append(spec)
    if movable:
        stage_kwarg_targets({name: kw_ins[i - n_args] for name, i in movable.items()})
    n_out = _n_tensor_outputs(op_schema)
    outs = _output_specs(op_schema, specs, ins + kw_ins, [rep] * max(n_out, 1))
    return OpStrategy([OpSpec(outs[0] if n_out <= 1 else tuple(outs), input_specs=ins, redistribute_cost=[[0.0] for _ in ins])])


def _n_tensor_outputs(op_schema: Any) -> int:
    """How many tensors the op returns: one per `Tensor` in the schema, and for a
    `Tensor[]` return (`_histogramdd_bin_edges`) as many as a fake run gives (fake, as
    DTensor's own propagation runs it: some such ops have no meta kernel). DTensor wants
    one output spec per tensor; one spec for a list failed the call."""

    returns = op_schema.op._schema.returns
    if not any(isinstance(r.type, torch.ListType) for r in returns):
        return sum(1 for r in returns if "Tensor" in str(r.type))
    flat, spec = tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))
    with clean_dispatch_state(), FakeTensorMode():
        metas = [torch.empty_strided(x.tensor_meta.shape, x.tensor_meta.stride, dtype=x.tensor_meta.dtype)
                 if isinstance(x, DTensorSpec) else x for x in flat]
        args, kwargs = tree_unflatten(metas, spec)
        out = op_schema.op(*args, **kwargs)
    return sum(1 for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor))


class _LocalLayoutSpec(DTensorSpec):
    """An output spec whose strides describe what the local kernel returns.

    DTensor gives an op's output the strides its meta kernel computes from the *global*
    inputs. After a redistribution a local input is contiguous whatever the global
    layout says (an all-gathered `x.view(B,S,H,d).transpose(1,2)`), so an op whose output
    layout follows its input's (CPU flash attention) returns a local tensor laid out
    differently from what the DTensor claims, and the next view fails ("view size is
    not compatible"). DTensor attaches the output's metadata through this method; we
    keep its shape and dtype and put in the strides the local kernel will produce:
    `local_stride` (concrete sizes), or under symbolic sizes `local_order`, the dims
    outermost first of a dense layout, whose strides are made here from DTensor's own
    (traced) sizes: a SymInt made outside the trace would not be tracked in the graph."""

    local_stride: tuple[int, ...] = ()
    local_order: tuple[int, ...] = ()

    def shallow_copy_with_tensor_meta(self, tensor_meta: Any) -> DTensorSpec:
        if tensor_meta is not None and self.local_order and len(self.local_order) == len(tensor_meta.shape):
            tensor_meta = TensorMeta(tensor_meta.shape, _dense_strides(tensor_meta.shape, self.local_order),
                                     tensor_meta.dtype)
        elif tensor_meta is not None and self.local_stride and len(self.local_stride) == len(tensor_meta.shape):
            tensor_meta = TensorMeta(tensor_meta.shape, self.local_stride, tensor_meta.dtype)
        return DTensorSpec(self.mesh, self.placements, tensor_meta=tensor_meta)


def _dense_strides(shape: tuple, order: tuple[int, ...]) -> tuple:
    """The strides of a dense tensor of `shape` whose dims, outermost first, are `order`."""
    strides: list[Any] = [0] * len(shape)
    acc: Any = 1
    for d in reversed(order):
        strides[d] = acc
        acc = acc * shape[d]
    return tuple(strides)


def _dense_order(shape: tuple, stride: tuple) -> tuple[int, ...] | None:
    """The dim order (outermost first) of a dense layout with these (symbolic) strides,
    found at the hints and confirmed as expressions; None for any other layout."""
    order = tuple(sorted(range(len(shape)), key=lambda d: (-hint_of(stride[d]), d)))
    expect = _dense_strides(shape, order)
    ok = all((not is_symbolic(shape[d]) and int(shape[d]) <= 1) or same_symbolic(stride[d], expect[d])
             for d in range(len(shape)))
    return order if ok else None


def _output_specs(op_schema: Any, specs: list, targets: list, placements: list) -> list:
    """Output DTensorSpecs for these placements, laid out as the local kernel will lay
    them out when a redistribution makes a non-contiguous input contiguous. Symbolic
    sizes too: the layouts are compared as expressions and the strides given are
    symbolic, read without a guard (the meta kernel runs on symbolic meta tensors)."""
    mesh = specs[0].mesh
    plain = [None if p is None else DTensorSpec(mesh, tuple(p)) for p in placements]
    moved = [tuple(t.placements) != tuple(s.placements) and not _is_contiguous(s.tensor_meta)
             for s, t in zip(specs, targets)]
    if not any(moved):
        return plain
    try:
        strides = _local_output_strides(op_schema, moved)
    except Exception:  # a meta kernel that refuses the contiguous layout: keep DTensor's
        return plain
    if strides is None:
        return plain
    out = []
    for spec, (shape, stride) in zip(plain, list(strides) + [(None, None)] * len(plain)):
        if spec is not None and stride is not None:
            spec = _local_layout_spec(mesh, spec.placements, shape, stride)
        out.append(spec)
    return out


def _local_layout_spec(mesh: Any, placements: tuple, shape: tuple, stride: tuple) -> DTensorSpec:
    """A `_LocalLayoutSpec` for this local layout; DTensor's own spec where a symbolic
    layout is not dense (its strides could not be made from traced sizes)."""
    spec = _LocalLayoutSpec(mesh, placements)
    if not any(is_symbolic(v) for v in (*shape, *stride)):
        object.__setattr__(spec, "local_stride", stride)
        return spec
    order = _dense_order(shape, stride)
    if order is None:
        return DTensorSpec(mesh, placements)
    object.__setattr__(spec, "local_order", order)
    return spec


def _is_contiguous(tm: Any) -> bool:
    """Row-major strides, size-1 dims aside; symbolic ones compared as expressions (a
    symbolic size is never 1: torch.compile specializes sizes 0 and 1)."""
    expect, acc = [], 1
    for size in reversed(tm.shape):
        expect.append(acc)
        acc = acc * size if is_symbolic(size) else acc * max(int(size), 1)
    return all((not is_symbolic(sz) and int(sz) <= 1) or same_symbolic(st, e)
               for sz, st, e in zip(tm.shape, tm.stride, reversed(expect)))


def _local_output_strides(op_schema: Any, moved: list[bool]) -> list | None:
    """The op's (output shape, strides) on inputs laid out as they will be locally
    (moved ones contiguous), where the strides differ from those on the global layout;
    else None."""
    flat, spec = tree_flatten((op_schema.args_schema, op_schema.kwargs_schema))

    def run(contiguous: list[bool]) -> list:
        it = iter(contiguous)
        metas = []
        for x in flat:
            if isinstance(x, DTensorSpec):
                tm = x.tensor_meta
                t = torch.empty(tm.shape, dtype=tm.dtype, device="meta")
                metas.append(t if next(it) else t.as_strided(tm.shape, tm.stride))
            else:
                metas.append(x)
        args, kwargs = tree_unflatten(metas, spec)
        return [(tuple(o.shape), tuple(o.stride())) if isinstance(o, torch.Tensor) else (None, None)
                for o in tree_flatten(op_schema.op(*args, **kwargs))[0]]

    with clean_dispatch_state():
        local, claimed = run(moved), run([False] * len(moved))
    return None if _same_layouts([s for _, s in local], [s for _, s in claimed]) else local


def _same_layouts(a: list, b: list) -> bool:
    """Equal stride lists, symbolic strides compared as expressions (no guard)."""
    return len(a) == len(b) and all(
        (x is None) == (y is None) and (x is None or same_sizes(x, y))
        for x, y in zip(a, b))


def _see_into_lists(op_schema: Any, sharding_prop: Any) -> None:
    """Make DTensor see (and redistribute) the tensors inside list arguments.

    DTensor builds an op's schema before asking the fallback, so on an op's first call
    its `schema_info` is None and `args_spec` lists only top-level tensors: the input
    specs we return for `Tensor[]` elements would be silently dropped, and the local
    kernel would run on shards the chosen strategy never asked for (block_diag returning
    a [5, 9] tensor claiming [11, 9]). Torch reads `args_spec` and rewraps its
    redistribution suggestion from this same object after we return."""
    if op_schema.schema_info is not None and op_schema.schema_info.needs_pytree:
        return
    if not _has_tensor_list_arg(op_schema.op):
        return
    info = sharding_prop.op_to_schema_info.get(op_schema.op)
    if info is not None and info.needs_pytree:
        op_schema.schema_info = info


@functools.lru_cache(maxsize=None)
def reaches_decompshard(op: torch._ops.OpOverload) -> bool:
    """The ops DTensor sends us when it has no strategy: those with a decomposition, and
    those without one that can safely run replicated (deterministic, out-of-place,
    returning fresh tensors), which otherwise stop a user's program with "does not have
    a sharding strategy registered" (backward ops such as replication_pad2d_backward)."""
    if has_decomposition(op):
        return True
    schema = op._schema
    return (
        op.namespace == "aten"
        and torch.Tag.nondeterministic_seeded not in op.tags
        and not any(a.alias_info is not None for a in schema.arguments)
        and not any(r.alias_info is not None for r in schema.returns)
        and any("Tensor" in str(r.type) for r in schema.returns)
    )


def _has_tensor_list_arg(op) -> bool:
    """`Tensor[]` or `Tensor?[]` in the schema (printed `List[Tensor]`, `List[Optional[Tensor]]`)."""
    return any(isinstance(a.type, torch.ListType) and "Tensor" in str(a.type.getElementType())
               for a in op._schema.arguments)


_warned: set[str] = set()


def _fall_back(op: Any, kind: str, message: str) -> None:
    """`op` runs replicated: recorded for the checks (runtime/fallbacks.py), and said once
    per process in a warning for the user (the derivation behind it is cached: a
    `with enabled():` around each training step must not repeat it)."""
    fallbacks.record(op, kind, message)
    key = f"{kind}:{op}"
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=2)
