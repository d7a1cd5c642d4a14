"""Does a candidate survive the decomposition run on *local* shapes?

The solver reasons on the global trace, but DTensor runs the original op on each rank's
local shard with the original non-tensor arguments. So a decomposition that computes
sizes from its inputs (`view(x, [b, g, c // g, ...])` in channel_shuffle, `sum / numel`
in a mean loss, `arange(n)`) computes *different* things per rank. We re-trace at the
local shapes of every rank for world sizes 2 and 3 and demand that the local graph is the
global one seen through the candidate's placements:

- same primitive sequence (a different path means the decomposition branched on a size);
- every value's local shape is the shard of its global shape the placement implies;
- non-tensor arguments are identical, except sizes of shape-defining ops (checked by the
  shape rule above), full-range slice ends, and one recognised pattern: a P(sum) value
  divided by (or multiplied by the inverse of) a count proportional to the shard's size.
  That is a mean over a sharded dim; it is exactly P(avg) when shards are even, so the
  rule is kept with its outputs turned P(sum) -> P(avg) and marked [even].

A rank whose shard is empty (size 2 over 3 ranks) only has its outputs compared:
decompositions legitimately take short-cuts on empty tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch

from decompshard import caches
from decompshard.solve import kernel_sandbox
from decompshard.dispatch_modes.graph import PrimGraph, freeze, map_leaves
from decompshard.solve.substitute import SubstitutedGraph, local_args, substitute
from decompshard.errors import Indeterminate, UnsupportedOp, one_line
from decompshard.solve.kernel_sandbox import isolated  # noqa: F401  (re-exported: a crash-isolated run)
from decompshard.placements import P, Partial, is_shard, local_shape
from decompshard.solve.propagate import Survivor

aten = torch.ops.aten

# Ops whose int arguments are the output shape: checked through the output shape.
SHAPE_ARG_OPS = {
    aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default,
    aten.view_copy.default, aten.expand_copy.default, aten._reshape_alias.default,
    aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
    aten.empty.memory_format, aten.zeros.default, aten.ones.default, aten.full.default,
    aten.empty_strided.default, aten.new_empty_strided.default, aten.unflatten.int,
}
_SCALE_DIV = {aten.div.Tensor, aten.div.Scalar}
_SCALE_MUL = {aten.mul.Tensor, aten.mul.Scalar}
WORLD_SIZES = (2, 3)


@dataclass(frozen=True)
class LocalVerdict:
    ok: bool
    outputs: tuple  # the candidate's outputs, P(sum) -> P(avg) when a mean was found
    even_only: bool
    reason: str = ""


def check_local(
    graph: PrimGraph,
    cand: Survivor,
    args: tuple,
    kwargs: dict,
    trace_at: Callable[[tuple, dict], PrimGraph],
    world_sizes: Sequence[int] = WORLD_SIZES,
) -> LocalVerdict:
    """Accept, accept as [even] (fails only where some sharded dim splits unevenly, and
    holds at an even world size), or refuse with the first disagreement."""
    if not (cand.sharded and any(is_shard(p) for p in cand.env.values())):
        # nothing sharded anywhere: every rank's shapes are the global ones. (A shard
        # made from nothing, e.g. expand R -> S(d), still has to meet the check.)
        return LocalVerdict(True, cand.outputs, cand.even_only)
    scaled, passed_even, uneven_failure = False, False, ""
    for W in _with_uneven_probe(graph, cand, world_sizes):
        even = all(
            graph.meta(v).shape[p.dim] % W == 0
            for v, p in zip(graph.inputs, cand.inputs) if is_shard(p)
        )
        reason, w_scaled = _check_world_size(graph, cand, args, kwargs, trace_at, W)
        if reason and even:
            return _fail(cand, reason)
        if reason:
            uneven_failure = uneven_failure or reason
            continue
        passed_even |= even
        scaled |= w_scaled
    if uneven_failure and not passed_even:
        return _fail(cand, uneven_failure)
    even_only = cand.even_only or bool(uneven_failure)
    note = f"even shards only ({uneven_failure})" if uneven_failure else ""
    if not scaled:
        return LocalVerdict(True, cand.outputs, even_only, note)
    tensor_outs = [p for p in cand.outputs if p is not None]
    if not tensor_outs or any(p != P("sum") for p in tensor_outs):
        return _fail(cand, "a mean over a sharded dim reaches an output that is not P(sum)")
    outs = tuple(None if p is None else P("avg") for p in cand.outputs)
    return LocalVerdict(True, outs, True, "mean over a sharded dim: P(avg) when shards are even")


def _with_uneven_probe(graph: PrimGraph, cand: Survivor, world_sizes: Sequence[int]) -> list[int]:
    """If every world size splits every sharded dim evenly (a dim of 6 at W=2 and 3),
    nothing would test uneven shards; add the smallest W that does not (up to 8)."""
    sizes = [graph.meta(v).shape[p.dim] for v, p in zip(graph.inputs, cand.inputs) if is_shard(p)]
    out = list(world_sizes)
    if all(n % W == 0 for W in out for n in sizes):
        probe = next((W for W in range(2, 9) if any(n % W for n in sizes)), None)
        if probe is not None:
            out.append(probe)
    return out


def _check_world_size(graph, cand, args, kwargs, trace_at, W: int) -> tuple[str, bool]:
    """('' or why world size W breaks the candidate, whether a mean-scaling was seen)."""
    scaled = False
    seen: set[tuple] = set()
    for r in range(W):
        shapes = tuple(
            local_shape(graph.meta(v).shape, (p,), (W,), (r,)) for v, p in zip(graph.inputs, cand.inputs)
        )
        if shapes in seen:
            continue
        seen.add(shapes)
        where = f"rank {r} of {W}"
        empty = any(0 in shp and 0 not in graph.meta(v).shape for v, shp in zip(graph.inputs, shapes))
        local = substitute(graph, args, kwargs, shapes, empty_ok=empty)
        if local is None:  # the decomposition may behave differently here: run it
            try:
                local = trace_at(*local_args(args, kwargs, shapes))
            except UnsupportedOp as e:
                return f"on {where} the decomposition fails: {e.reason}", False
        if empty:
            reason = _compare_outputs_only(graph, local, cand, W, r)
            reason = reason or _real_kernel_on_empty_shard(graph, cand, args, kwargs, shapes, W, r)
            node_scaled = False
        else:
            reason, node_scaled = _compare(graph, local, cand, W, r, shapes)
        if reason:
            return f"on {where}: {reason}", False
        scaled |= node_scaled
    return "", scaled


def _fail(cand: Survivor, reason: str) -> LocalVerdict:
    return LocalVerdict(False, cand.outputs, cand.even_only, reason)


def _compare(g: PrimGraph, l: PrimGraph, cand: Survivor, W: int, r: int, shapes) -> tuple[str, bool]:
    """('' or the first disagreement, whether a mean-scaling node was found).

    Copies that only change memory layout are left out of the comparison, and the view
    ops count as one: matmul reshapes a non-contiguous operand with clone +
    _unsafe_view and a contiguous one with view, and a shard can be contiguous where the
    global tensor is not (a transposed [B, H, S, hd] with one head per rank)."""
    if isinstance(l, SubstitutedGraph):
        # the global nodes with the same arguments (nothing differs but shapes): only
        # the shapes are compared, and no argument can be a mean's scaling
        return _compare_shapes(g, l, cand, W, r, g.nodes, l.nodes), False
    g_nodes, l_nodes = _compared_nodes(g), _compared_nodes(l)
    if [_op_class(n.op) for n in g_nodes] != [_op_class(n.op) for n in l_nodes]:
        return "the decomposition takes a different path on local shapes", False
    fraction = _shard_fraction(g, cand, shapes)
    scaled = False
    for gn, ln in zip(g_nodes, l_nodes):
        reason = _compare_shapes(g, l, cand, W, r, (gn,), (ln,))
        if reason:
            return reason, False
        diffs = [(a, b) for a, b in zip(gn.non_tensor_leaves(), ln.non_tensor_leaves()) if a != b]
        if not diffs or gn.op in SHAPE_ARG_OPS:
            continue
        if gn.op is aten.slice.Tensor and _full_range_slice(gn, ln, g, l):
            continue
        if _is_mean_scaling(gn, diffs, cand, fraction):
            scaled = True
            continue
        a, b = diffs[0]
        return (
            f"node {gn.index} ({gn.op}) takes a size-dependent argument: "
            f"{a!r} globally, {b!r} locally"
        ), False
    return "", scaled


_LAYOUT_COPIES = {aten.clone.default, aten.contiguous.default}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def _compare_shapes(g: PrimGraph, l, cand: Survivor, W: int, r: int, g_nodes, l_nodes) -> str:
    """'' or the first value whose local shape is not the shard its placement implies."""
    env = cand.env
    for gn, ln in zip(g_nodes, l_nodes):
        for gv, lv in zip(gn.outputs, ln.outputs):
            if gv is None or lv is None:
                continue
            p = env.get(gv)
            if p is None and not gn.constant:
                continue
            want = local_shape(g.meta(gv).shape, (p,), (W,), (r,))
            got = tuple(l.meta(lv).shape)
            if got != want:
                return (
                    f"node {gn.index} ({gn.op}) makes shape {list(got)} locally, "
                    f"but {p} of {list(g.meta(gv).shape)} needs {list(want)}"
                )
    return ""


def _compared_nodes(graph: PrimGraph | SubstitutedGraph) -> list:
    return [
        n for n in graph.nodes
        if not (n.op in _LAYOUT_COPIES and len(n.inputs) == 1 and n.outputs and n.outputs[0] is not None
                and graph.meta(n.outputs[0]).shape == graph.meta(n.inputs[0]).shape)
    ]


def _op_class(op):
    return aten.view.default if op in _VIEWS else op


def _compare_outputs_only(g: PrimGraph, l: PrimGraph, cand: Survivor, W: int, r: int) -> str:
    """A rank with an empty shard: decompositions often short-cut on empty tensors, so only
    the op's outputs are compared. A non-empty P(max)/P(min) output computed from nothing
    has no trustworthy value (the max of an empty set), so it fails."""
    if len(g.outputs) != len(l.outputs):
        return "the decomposition returns a different number of outputs on an empty shard"
    for gv, lv, p in zip(g.outputs, l.outputs, cand.outputs):
        if gv is None or lv is None:
            continue
        want = local_shape(g.meta(gv).shape, (p,), (W,), (r,))
        got = tuple(l.meta(lv).shape)
        if got != want:
            return f"an empty shard gives output shape {list(got)}, {p} needs {list(want)}"
        if isinstance(p, Partial) and p.reduce_op in ("max", "min") and math.prod(got) > 0:
            return f"{p} output computed from an empty shard has no defined value"
    return ""


EMPTY_SHARD_REAL_RUN_LIMIT = 1 << 22  # elements: beyond, refuse rather than allocate
# (op, zero-filled input shapes and dtypes, other args) -> the isolated run's verdict:
# candidates of one op often hand the kernel the same empty shard.
_EMPTY_RUNS = caches.BoundedCache("empty-shard kernel runs", 512)


def _real_kernel_on_empty_shard(g: PrimGraph, cand: Survivor, args, kwargs, shapes, W: int, r: int) -> str:
    """Kernels special-case empty inputs, and not always like their decomposition or
    meta kernel (pixel_unshuffle of a [0, 1, 6, 6] tensor returns [0, 1, 6, 6] on CPU).
    DTensor runs the real kernel, so the real kernel decides, on zero-filled inputs.
    Some kernels do not raise but crash: CPU flash attention divides by the head count
    (SIGFPE with 0 heads), so the run happens in a sandbox process (kernel_sandbox)."""
    if sum(math.prod(s) for s in shapes) > EMPTY_SHARD_REAL_RUN_LIMIT:
        return "an empty shard would need a real kernel run on large inputs; refused"
    meta_args, meta_kwargs = local_args(args, kwargs, shapes)
    try:  # CPU kernels do not all check sizes: never hand one shapes its meta kernel refuses
        g.op(*meta_args, **meta_kwargs)
    except Exception as e:
        return f"the op's meta kernel refuses an empty shard: {one_line(e, 120, with_type=False)}"
    status, got = _kernel_on_zeros(g.op, meta_args, meta_kwargs)
    if status == "timeout":
        return f"the op's kernel gave no answer on an empty shard ({got}); refused"
    if status == "crash":
        return f"the op's kernel crashes on an empty shard ({got})"
    if status == "error":
        return f"the op fails on an empty shard: {got}"
    for shape, gv, p in zip(got, g.outputs, cand.outputs):
        if gv is None or shape is None:
            continue
        want = local_shape(g.meta(gv).shape, (p,), (W,), (r,))
        if shape != want:
            return f"on an empty shard the op returns shape {list(shape)}, {p} needs {list(want)}"
    return ""


def _kernel_on_zeros(op, meta_args, meta_kwargs, where: str = "on an empty shard") -> tuple[str, Any]:
    """The op's real CPU kernel on zeros shaped like the meta arguments, in the sandbox
    (kernel_sandbox.output_shapes_on_zeros), remembered per (op, shapes, dtypes, other
    arguments). A timeout says nothing about the op: it is counted, not remembered, and
    under `strict_checks` raises Indeterminate."""
    key = (op, freeze(map_leaves(lambda x: (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x,
                                 (meta_args, meta_kwargs))))
    try:
        hit = _EMPTY_RUNS.get(key)
    except TypeError:  # an unhashable argument: no caching
        key, hit = None, None
    if hit is None:
        hit = kernel_sandbox.output_shapes_on_zeros(op, meta_args, meta_kwargs)
        if key is not None and hit[0] != "timeout":
            _EMPTY_RUNS.put(key, hit)
    if hit[0] == "timeout":
        global _TIMEOUTS
        _TIMEOUTS += 1
        if _STRICT.get():
            raise Indeterminate(f"{op}: the op's kernel gave no answer {where} ({hit[1]})")
    return hit


# Ops whose meta kernel accepts local shapes their real CPU kernel refuses, so a strategy
# the decomposition proves can still stop the user's program where DTensor runs the
# kernel. CPU flash attention's backward derives `S(3), R, R, S(3), S(3), R, R ->
# P(sum), P(sum), S(3)` (v's head dim sharded, q's and k's not: valid for the math), and
# its kernel raises "Q/K/V should have the same head size"; the meta kernel does not check.
REAL_KERNEL_SHAPE_CHECKED = frozenset({
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
})


REAL_KERNEL_PROBE_LIMIT = 1 << 16  # elements: beyond, probe at small sizes (the check runs per candidate)


def real_kernel_refusal(op, meta_args: tuple, meta_kwargs: dict) -> str:
    """'' or why `op`'s real CPU kernel refuses these local shapes (meta tensors), for
    the ops in REAL_KERNEL_SHAPE_CHECKED (others: ''). Shapes larger than
    REAL_KERNEL_PROBE_LIMIT (attention on zeros is not free, and it runs for every
    candidate checked) are probed at small sizes with the same equalities (each distinct size above 1
    renumbered 2, 3, ... in order; 0 and 1 kept): these kernels check that sizes agree
    and broadcast, which the renumbering keeps."""
    if op not in REAL_KERNEL_SHAPE_CHECKED:
        return ""
    tensors = _tensor_leaves((meta_args, meta_kwargs))
    if sum(math.prod(t.shape) for t in tensors) > REAL_KERNEL_PROBE_LIMIT:
        sizes = sorted({d for t in tensors for d in t.shape if d > 1})
        small = {d: i + 2 for i, d in enumerate(sizes)}
        meta_args, meta_kwargs = map_leaves(
            lambda x: torch.empty([small.get(d, d) for d in x.shape], dtype=x.dtype, device="meta")
            if isinstance(x, torch.Tensor) else x, (meta_args, meta_kwargs))
    status, got = _kernel_on_zeros(op, meta_args, meta_kwargs, "on zero-filled local shapes")
    if status == "ok":
        return ""
    if status == "timeout":
        return f"the op's kernel gave no answer on these local shapes ({got}); refused"
    return f"the op's real kernel {'crashes' if status == 'crash' else 'refuses them'}: {got}"


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_leaves(lambda x: found.append(x) if isinstance(x, torch.Tensor) else None, tree)
    return found


_TIMEOUTS = 0  # kernel runs that timed out, ever: a verdict reached past one is not kept


def timeouts() -> int:
    """How many empty-shard kernel runs have timed out in this process so far."""
    return _TIMEOUTS


# Set while enable() chooses a strategy for DTensor: see strict_checks.
_STRICT: contextvars.ContextVar[bool] = contextvars.ContextVar("decompshard_strict_checks", default=False)


@contextlib.contextmanager
def strict_checks() -> Iterator[None]:
    """Within: a check that cannot answer from the op and its shapes alone raises
    `Indeterminate` instead of refusing the candidate. Every rank of a job decides its
    strategy on its own, from the same global shapes and placements; a refusal that one
    rank's timeout caused would make that rank's choice differ from the others'."""
    token = _STRICT.set(True)
    try:
        yield
    finally:
        _STRICT.reset(token)


def clear_empty_shard_runs() -> None:
    _EMPTY_RUNS.clear()


def _shard_fraction(g: PrimGraph, cand: Survivor, shapes) -> float | None:
    """numel(local)/numel(global), if every sharded input agrees on it."""
    fracs = set()
    for v, p, shp in zip(g.inputs, cand.inputs, shapes):
        if is_shard(p):
            n = math.prod(g.meta(v).shape)
            fracs.add(round(math.prod(shp) / n, 12) if n else None)
    return fracs.pop() if len(fracs) == 1 else None


def _is_mean_scaling(node, diffs: list[tuple[Any, Any]], cand: Survivor, fraction) -> bool:
    if node.op not in _SCALE_DIV | _SCALE_MUL or fraction in (None, 0):
        return False
    if len(node.inputs) != 1 or cand.env.get(node.inputs[0]) != P("sum"):
        return False
    for a, b in diffs:
        if not isinstance(a, (int, float)) or not isinstance(b, (int, float)) or a == 0 or b == 0:
            return False
        ratio = b / a if node.op in _SCALE_DIV else a / b
        if not math.isclose(ratio, fraction, rel_tol=1e-9):
            return False
    return True


def _full_range_slice(gn, ln, g: PrimGraph, l: PrimGraph) -> bool:
    """slice(x, dim, start, end) whose end covers the whole dim both globally and locally."""
    ga, la = gn.non_tensor_leaves(), ln.non_tensor_leaves()
    if len(ga) < 3 or ga[:2] != la[:2] or (len(ga) > 3 and ga[3:] != la[3:]):
        return False
    dim = ga[0] % len(g.meta(gn.inputs[0]).shape)
    return ga[2] >= g.meta(gn.inputs[0]).shape[dim] and la[2] >= l.meta(ln.inputs[0]).shape[dim]
