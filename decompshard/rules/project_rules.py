"""Rule source 3: rules decompshard writes itself, for primitives torch has none for.

Keep each entry small and obviously right; every one is checked numerically by the
tests (tests/test_project_rules.py) like any derived rule.
"""

from __future__ import annotations

from typing import Callable

import torch

from decompshard.dispatch_modes import signs
from decompshard.dispatch_modes.graph import PrimNode
from decompshard.placements import PARTIALS, P, Partial, R, SingleDimRule, ShardPlaceholder, is_shard
from decompshard.rules import torch_single_dim, torch_tables

SOURCE = "decompshard"
# torch's own rule, which decompshard states for uneven shards too (see _UNEVEN_SAFE)
UNEVEN_SOURCE = "torch single-dim (uneven: decompshard)"
aten = torch.ops.aten


def _same_placement_passthrough(node: PrimNode) -> list[SingleDimRule]:
    """Ops that copy values elementwise without changing the layout (clone-like):
    every placement passes through unchanged."""
    meta = node.args[0]
    out = [SingleDimRule((ShardPlaceholder(d),), (ShardPlaceholder(d),), source=SOURCE) for d in range(len(meta.shape))]
    out += [SingleDimRule((p,), (p,), source=SOURCE) for p in PARTIALS]
    return out


def _copy_rules(node: PrimNode) -> list[SingleDimRule]:
    """copy(self, src): src broadcast to self's shape and cast to self's dtype; self's
    values are never read. So the output takes src's placement whatever self holds (R
    or any Partial), a Partial src passes through when both are floating (a cast between
    float types is monotone and additive up to rounding; to an integer it is neither),
    and a self sharded on d gives S(d) when src is split the same way on the aligned dim
    or broadcast along it (size 1 or absent: every rank's slice is the same)."""
    if len(node.inputs) != 2 or len(node.args) < 2:
        return []
    dst, src = node.args[0], node.args[1]
    if not (hasattr(dst, "shape") and hasattr(src, "shape")):
        return []
    not_read = [R] + (list(PARTIALS) if dst.dtype.is_floating_point or dst.dtype.is_complex else [])
    out = [SingleDimRule((q, R), (R,), source=SOURCE) for q in not_read if q != R]
    same_kind = (dst.dtype.is_floating_point and src.dtype.is_floating_point) or (
        dst.dtype.is_complex and src.dtype.is_complex)
    if same_kind:
        partials = [p for p in PARTIALS if not (dst.dtype.is_complex and p.reduce_op in ("max", "min"))]
        out += [SingleDimRule((q, p), (p,), source=SOURCE) for p in partials for q in not_read]
    lead = len(dst.shape) - len(src.shape)
    for d in range(len(dst.shape)):
        s = d - lead
        if s < 0 or src.shape[s] == 1:
            out.append(SingleDimRule((ShardPlaceholder(d), R), (ShardPlaceholder(d),), source=SOURCE))
        elif src.shape[s] == dst.shape[d]:
            out.append(SingleDimRule((ShardPlaceholder(d), ShardPlaceholder(s)), (ShardPlaceholder(d),), source=SOURCE))
    return out


_RULES: dict[torch._ops.OpOverload, Callable[[PrimNode], list[SingleDimRule]]] = {
    aten.lift_fresh.default: _same_placement_passthrough,
    aten.alias.default: _same_placement_passthrough,
    aten.copy.default: _copy_rules,
}


# Pure data movement: every output element is a copy of one input element (or the op
# only relabels the layout), so reduce(parts) commutes with it for every reduce op.
# Torch's strategies for several of these omit Partial (clone keeps only Shard, say).
_PARTIAL_PASSTHROUGH = {
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.detach.default,
    aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.permute.default, aten.transpose.int, aten.t.default,
    aten.unsqueeze.default, aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims,
    aten.expand.default, aten.select.int, aten.slice.Tensor, aten.narrow.default,
    aten.diagonal.default, aten.diagonal_copy.default, aten.flip.default, aten.roll.default,
    aten.unfold.default, aten.index_select.default,
    aten.gather.default, aten.repeat.default, aten.rot90.default,
    aten.permute_copy.default, aten.transpose_copy.int, aten.t_copy.default,
    aten.unsqueeze_copy.default, aten.squeeze_copy.default, aten.squeeze_copy.dim,
    aten.alias_copy.default, aten.view_copy.default, aten.expand_copy.default,
    aten.narrow_copy.default, aten.unfold_copy.default, aten.lift_fresh.default,
    # selections by replicated indices: out[i] = x[idx[i]]
    aten.index.Tensor, aten._unsafe_index.Tensor, aten.take.default,
    aten.take_along_dim.default,
}


def extra_rules(node: PrimNode) -> list[SingleDimRule]:
    """Rules added on top of whichever source answered (never replacing it, except
    that a rule stated here without [even] drops that condition from the same rule of
    the source: see registry._compute_rules).

    Only the first tensor input may be Partial; every other tensor input (an index,
    say) must be Replicate, and every output gets the same Partial.
    """
    if node.op not in _SPECIAL:  # the common case: one look-up, not the chain below
        return _passthrough_rules(node)
    if node.op in _SCALAR_OPS and len(node.inputs) == 1:
        return _scalar_rules(node)
    if node.op is aten.mul.Tensor and len(node.inputs) == 2:
        return _signed_factor_rules(node)
    if node.op in _BINARY_SHIFT:
        return _binary_shift_rules(node)
    if node.op is aten.where.self:
        return _where_rules(node)
    if node.op in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        return _masked_fill_rules(node)
    if node.op in _BILINEAR:
        return _uneven_torch_rules(node) + _bilinear_rules(node)
    if node.op in (aten.index_put.default, aten._unsafe_index_put.default):
        return _index_put_rules(node)
    if node.op in _INDEX:
        return _index_uneven_rules(node) + _passthrough_rules(node)
    if node.op is aten.expand.default and len(node.inputs) == 1 and len(node.args) > 1:
        return _expand_rules(node) + _passthrough_rules(node)
    if node.op in _ZERO_FILL_ARG:
        return _zero_fill_rules(node)
    if node.op in _UNEVEN_SAFE:  # dot is _BILINEAR's, above
        return _uneven_torch_rules(node) + _passthrough_rules(node)
    return _passthrough_rules(node)


def _passthrough_rules(node: PrimNode) -> list[SingleDimRule]:
    if node.op not in _PARTIAL_PASSTHROUGH or not node.inputs or not node.args:
        return []
    meta = node.args[0]
    if not hasattr(meta, "dtype") or not (meta.dtype.is_floating_point or meta.dtype.is_complex):
        return []
    rest = (R,) * (len(node.inputs) - 1)
    n_out = len(node.outputs)
    partials = [p for p in PARTIALS if not (meta.dtype.is_complex and p.reduce_op in ("max", "min"))]
    return [SingleDimRule((p, *rest), (p,) * n_out, source=SOURCE) for p in partials]


# Tensor-scalar arithmetic. Adding a constant shifts every part: avg, max and min
# follow (sum does not: the constant would be added once per rank). Scaling by s > 0
# keeps max/min, s < 0 swaps them. Torch lists only some of these.
_SHIFT = {aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar}
_SCALE = {aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar}
_FLIP = {aten.rsub.Scalar, aten.rsub.Tensor}  # c - alpha * x


def _scalar_rules(node: PrimNode) -> list[SingleDimRule]:
    if len(node.inputs) != 1 or len(node.args) < 2 or not _is_real_number(node.args[1]):
        return []
    meta = node.args[0]
    if not getattr(meta, "dtype", None) or not meta.dtype.is_floating_point:
        return []
    c = node.args[1]
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
    if not _is_real_number(alpha):
        return []
    mx, mn, avg = P("max"), P("min"), P("avg")
    if node.op in _SHIFT:
        pairs = [(avg, avg), (mx, mx), (mn, mn)]
    elif node.op in _SCALE and c != 0:
        pairs = [(avg, avg)] + ([(mx, mx), (mn, mn)] if c > 0 else [(mx, mn), (mn, mx)])
    elif node.op in _FLIP and alpha != 0:
        pairs = [(avg, avg)] + ([(mx, mn), (mn, mx)] if alpha > 0 else [(mx, mx), (mn, mn)])
    else:
        return []
    n_out = len(node.outputs)
    return [SingleDimRule((a,), (b,) * n_out, source=SOURCE) for a, b in pairs]


# x * c with c replicated and of a sign the trace knows (dispatch_modes/signs.py): every
# part of a P(max)/P(min) x is scaled by the same c, so c >= 0 keeps max and min, c <= 0
# swaps them. (P(sum)/P(avg) times R is linear: torch's own mul rule has it.)
_KEEP = ((P("max"), P("max")), (P("min"), P("min")))
_SWAP = ((P("max"), P("min")), (P("min"), P("max")))


def _signed_factor_rules(node: PrimNode) -> list[SingleDimRule]:
    metas = node.args[:2]
    if len(node.in_signs) != 2 or not all(getattr(m, "dtype", None) is not None and m.dtype.is_floating_point for m in metas):
        return []
    n_out = len(node.outputs)
    out = []
    for side, sign in enumerate(node.in_signs):  # `side` is the replicated factor
        pairs = (_KEEP if sign & signs.NONNEG else ()) + (_SWAP if sign & signs.NONPOS else ())
        for p_in, p_out in pairs:
            ins = (p_in, R) if side == 1 else (R, p_in)
            out.append(SingleDimRule(ins, (p_out,) * n_out, source=SOURCE))
    return out


# Tensor-tensor add/sub where one side is Replicate: a shift of every part of the other.
_BINARY_SHIFT = {aten.add.Tensor: 1, aten.sub.Tensor: -1}


def _binary_shift_rules(node: PrimNode) -> list[SingleDimRule]:
    if len(node.inputs) != 2 or not all(getattr(m, "dtype", None) is not None and m.dtype.is_floating_point for m in node.args[:2]):
        return []
    alpha = node.kwargs.get("alpha", node.args[2] if len(node.args) > 2 else 1)
    if not _is_real_number(alpha) or alpha == 0:
        return []
    sign = _BINARY_SHIFT[node.op] * (1 if alpha > 0 else -1)
    swap = {P("max"): P("min"), P("min"): P("max"), P("avg"): P("avg")}
    n_out = len(node.outputs)
    rules = []
    for p in (P("avg"), P("max"), P("min")):
        rules.append(SingleDimRule((p, R), (p,) * n_out, source=SOURCE))  # x + alpha*c
        q = p if sign > 0 else swap[p]  # c + alpha*x (or c - alpha*x)
        rules.append(SingleDimRule((R, p), (q,) * n_out, source=SOURCE))
    return rules


# where(cond, x, y) picks every element from x or y: a Partial on both sides survives.
def _where_rules(node: PrimNode) -> list[SingleDimRule]:
    if len(node.inputs) != 3:
        return []
    n_out = len(node.outputs)
    return [SingleDimRule((R, p, p), (p,) * n_out, source=SOURCE) for p in PARTIALS]


# masked_fill(x, mask, c): elements become the replicated constant c, which satisfies
# avg/max/min (identical copies); only c == 0 also satisfies sum.
def _masked_fill_rules(node: PrimNode) -> list[SingleDimRule]:
    n_out = len(node.outputs)
    if node.op is aten.masked_fill.Tensor and len(node.inputs) == 3:
        return [SingleDimRule((p, R, p), (p,) * n_out, source=SOURCE) for p in PARTIALS]
    if len(node.inputs) != 2 or len(node.args) < 3 or not _is_real_number(node.args[2]):
        return []
    ps = [P("avg"), P("max"), P("min")] + ([P("sum")] if node.args[2] == 0 else [])
    return [SingleDimRule((p, R), (p,) * n_out, source=SOURCE) for p in ps]


# Bilinear contractions: with one side Replicate, the other side's Partial(sum/avg)
# passes through (linear in each argument). Torch lists only the sharded pair for dot.
_BILINEAR = {aten.dot.default, aten.vdot.default}


def _bilinear_rules(node: PrimNode) -> list[SingleDimRule]:
    n_out = len(node.outputs)
    out = []
    for p in (P("sum"), P("avg")):
        out += [SingleDimRule((p, R), (p,) * n_out, source=SOURCE), SingleDimRule((R, p), (p,) * n_out, source=SOURCE)]
    return out


# index_put(self, indices, values, accumulate): overwriting picks each element from
# self or values (any Partial on both survives); accumulating adds replicated values
# to every part, a shift (avg/max/min survive, sum does not).
def _index_put_rules(node: PrimNode) -> list[SingleDimRule]:
    if len(node.inputs) < 3:
        return []
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    idx = (R,) * (len(node.inputs) - 2)
    n_out = len(node.outputs)
    if accumulate:
        return [SingleDimRule((p, *idx, R), (p,) * n_out, source=SOURCE) for p in (P("avg"), P("max"), P("min"))]
    return [SingleDimRule((p, *idx, p), (p,) * n_out, source=SOURCE) for p in PARTIALS]


# expand(x, shape): a dim that is broadcast (size 1 or new) holds the same values along
# it, so each rank can expand straight to its own chunk: R -> S(d) with no data moved.
def _expand_rules(node: PrimNode) -> list[SingleDimRule]:
    meta, shape = node.args[0], list(node.args[1])
    lead = len(shape) - len(meta.shape)
    out = []
    for d, size in enumerate(shape):
        src = d - lead
        if size != 1 and (src < 0 or meta.shape[src] == 1):
            out.append(SingleDimRule((R,), (ShardPlaceholder(d),), source=SOURCE))
    return out


# Factories that read only their input's metadata: whatever the input holds on each rank
# (R or any Partial part), every rank makes the same constant. Torch's rules give R out
# (and R already reads as P(avg|max|min)); a constant of zeros is also a valid P(sum),
# which lets a zero-initialised accumulator take Partial sums. The new_* factories take
# their size as an argument, so a sharded input gives a full-size output too.
_ZERO_FILL_ARG = {  # op -> position of the fill value (None: always zeros)
    aten.full_like.default: 1, aten.zeros_like.default: None, aten.new_zeros.default: None,
    aten.new_full.default: 2, aten.fill.Scalar: 1, aten.zero.default: None,
}
_NEW_FACTORIES = {aten.new_zeros.default, aten.new_full.default}


def _zero_fill_rules(node: PrimNode) -> list[SingleDimRule]:
    pos = _ZERO_FILL_ARG[node.op]
    if len(node.inputs) != 1 or len(node.outputs) != 1:
        return []
    if pos is not None:
        value = node.args[pos] if len(node.args) > pos else node.kwargs.get("fill_value", node.kwargs.get("value"))
        if not _is_real_number(value) or value != 0:
            return []
    meta = node.args[0]
    ins = [R] + (list(PARTIALS) if meta.dtype.is_floating_point or meta.dtype.is_complex else [])
    if node.op in _NEW_FACTORIES:
        ins += [ShardPlaceholder(d) for d in range(len(meta.shape))]
    return [SingleDimRule((p,), (P("sum"),), source=SOURCE) for p in ins]


# Kernels that check input *values* (binary_cross_entropy: all elements in [0, 1]): a
# Partial part of a valid value can fail the check, so those inputs never take Partial.
_VALUE_CHECKED = {
    aten.binary_cross_entropy.default: {0, 1},
    aten.binary_cross_entropy_backward.default: {1, 2},
}


def value_checked_inputs(op) -> set[int]:
    return _VALUE_CHECKED.get(op, set())


def _is_real_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def has_rules(op) -> bool:
    return op in _RULES


def rules(node: PrimNode) -> list[SingleDimRule] | None:
    fn = _RULES.get(node.op)
    return None if fn is None else fn(node)


# index(x, [None, .., idx, ..]): a dim of x that no index touches is carried through
# slice by slice (out[.., b, ..] = x[b][idx..]), so sharding it splits the output the
# same way however unevenly (empty shards too). Torch's strategy states these rules
# without `allow_uneven_sharding`, which the torch source reads as [even]; a reflection
# or replication pad and nearest upsampling decompose to these, so their batch rule was
# [even] and an uneven batch got the pad sharded on channels instead.
_INDEX = {aten.index.Tensor, aten._unsafe_index.Tensor}


def _index_uneven_rules(node: PrimNode) -> list[SingleDimRule]:
    """S(d), R, .. -> S(out_d) for every dim d of x no index touches (see _INDEX)."""
    if len(node.args) < 2 or not isinstance(node.args[1], (list, tuple)):
        return []
    x, indices = node.args[0], list(node.args[1])
    if not hasattr(x, "shape"):
        return []
    indexed = [i for i, t in enumerate(indices) if t is not None]
    if not indexed or any(not hasattr(indices[i], "shape") for i in indexed):
        return []
    if any(indices[i].dtype == torch.bool for i in indexed):  # a mask indexes several dims
        return []
    if len(node.inputs) != 1 + len(indexed) or len(node.outputs) != 1:
        return []
    ndim = len(x.shape)
    broadcast = max(len(indices[i].shape) for i in indexed)
    consecutive = all(b - a == 1 for a, b in zip(indexed, indexed[1:]))
    insert = indexed[0] if consecutive else 0
    rest = (R,) * len(indexed)
    out = []
    for d in range(ndim):
        if d in indexed:
            continue
        od = d if d < insert else d + broadcast - sum(1 for i in indexed if i < d)
        out.append(SingleDimRule((ShardPlaceholder(d), *rest), (ShardPlaceholder(od),), source=SOURCE))
    return out


# Ops whose torch rules hold however a dim is split: each output slice along a sharded
# dim comes from the same slice of every input sharded on it (cat/split along another
# dim, a mean over other dims, a transpose), and dot's sharded contraction sums per-rank
# products, exact for any split since both operands have the same size there. Torch
# 2.13 served these from op strategies (read as holding for any shards); 2.14 moved them
# to single-dim strategies registered without `allow_uneven_sharding`, which decompshard
# reads as [even], so an uneven batch lost its batch rule (an RMSNorm's mean
# all-gathered). Stated here unconditional, as on 2.13, except a Shard averaged into
# P(avg), which only even shards make exact (registry's _even_if_averaging_shards).
# gather's rules only where each output slice reads the same slice of every sharded
# tensor: a replicated input (the index alone sharded), or input and index of one size
# on the sharded dim (gather lets the index be smaller, and then the shards misalign).
# Not here: mm/bmm/addmm/baddbmm (single-dim and [even] on 2.13 already: unchanged).
_UNEVEN_SAFE = frozenset({
    aten.dot.default, aten.mean.dim, aten.t.default, aten.cat.default, aten.gather.default,
    aten.split.Tensor, aten.split_with_sizes.default, aten.split_with_sizes_copy.default,
})


def _uneven_torch_rules(node: PrimNode) -> list[SingleDimRule]:
    """Torch's single-dim [even] rules of an _UNEVEN_SAFE op, without the condition."""
    if node.op not in _UNEVEN_SAFE or not torch_single_dim.has_rules(node.op):
        return []  # torch 2.13: an op strategy, already unconditional
    found = torch_tables.torch_rules(torch_single_dim, node) or []
    return [SingleDimRule(r.inputs, r.outputs, source=UNEVEN_SOURCE) for r in found
            if r.even_only and not _averages_a_shard(r) and _slices_align(node, r)]


def _slices_align(node: PrimNode, rule: SingleDimRule) -> bool:
    if node.op is not aten.gather.default:
        return True
    x, index = node.args[0], node.args[2]
    x_p, index_p = rule.inputs[0], rule.inputs[1]
    if x_p == R:
        return True
    return (is_shard(x_p) and is_shard(index_p) and x_p.dim == index_p.dim
            and x.shape[x_p.dim] == index.shape[index_p.dim])


def _averages_a_shard(rule: SingleDimRule) -> bool:
    return any(is_shard(p) for p in rule.inputs) and any(
        isinstance(p, Partial) and p.reduce_op == "avg" for p in rule.outputs)


_SCALAR_OPS = _SHIFT | _SCALE | _FLIP
# every op extra_rules answers other than by _passthrough_rules
_SPECIAL = frozenset(
    _SCALAR_OPS | {aten.mul.Tensor, aten.where.self, aten.masked_fill.Scalar, aten.masked_fill.Tensor,
                   aten.index_put.default, aten._unsafe_index_put.default, aten.expand.default}
    | set(_BINARY_SHIFT) | _BILINEAR | set(_ZERO_FILL_ARG) | _INDEX | _UNEVEN_SAFE
)
