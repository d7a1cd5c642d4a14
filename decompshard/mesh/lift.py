"""Lift: from single-dim rules to the cheapest valid strategy on the user's N-D mesh.

A strategy picks one derived rule (or all-Replicate) per mesh dim. Its inputs must be
redistributed from their current placements to the rule's, which the cost model prices;
the cheapest *valid* strategy wins. Valid means, on the real mesh and shapes:

- an [even] rule is used only where every dim it shards splits evenly on that mesh dim
  (after the earlier mesh dims' sharding);
- the original op, run on each distinct set of local input shapes (meta kernel, original
  non-tensor arguments: what DTensor will run), succeeds and returns the local output
  shapes the strategy's output placements promise. This is what refuses pixel_shuffle on
  channels when a rank would hold fewer than upscale_factor**2 of them.

Placeholders S(d) become `Shard(d)`, or `_StridedShard(d, sf)` when the inputs already
carry that kind on that mesh dim (the rule holds for any sharding kind).

Candidates come in cost order from a best-first search over the per-mesh-dim choices
(`cheapest_first`: admissible per-dim bounds from the cost model, exact costs only for
the strategies reached), and are checked for validity only as far as needed: the
runtime (`runtime/enable.py`'s `_first_runnable`) stops at the first valid one of
`ranked` that DTensor can run; `rank_strategies` checks the cheapest
`MAX_LISTED` (all of them on small meshes), for explanations.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import torch

from decompshard._compat import tree_flatten, tree_unflatten
from decompshard._compat import TorchPartial, TorchReplicate, TorchShard, TorchStridedShard
from decompshard.mesh.cost import H100, Cost, CostBound, MeshShape, Topology, bytes_key, lower_bound_model, model_placement, redistribute_cost, target_row
from decompshard.solve.derive import derive_rules
from decompshard.dispatch_modes.clean import clean_dispatch_state
from decompshard.mesh.cost import SECONDS_DIGITS, TargetRow  # the search's pieces (issue 21)
from decompshard.solve.localcheck import real_kernel_refusal
from decompshard.errors import one_line
from decompshard.placements import MaybePlacement, Partial, R, ShardPlaceholder, SingleDimRule, StridedShard, local_shape

TorchPlacement = Any
MAX_LISTED = 4096  # strategies rank_strategies checks (beyond: up to the first valid one)


@dataclass(frozen=True)
class MeshStrategy:
    rules: tuple[SingleDimRule, ...]  # one per mesh dim
    input_placements: tuple[tuple[TorchPlacement, ...], ...]  # per tensor input
    output_placements: tuple[tuple[TorchPlacement, ...] | None, ...]  # per output leaf
    cost: Cost
    valid: bool = True
    reason: str = ""

    def describe(self) -> str:
        rules = " | ".join(str(r) for r in self.rules)
        return f"[{rules}] cost {self.cost.total_seconds * 1e6:.2f} µs" + (
            "" if self.valid else f" (invalid: {self.reason})"
        )


def _fill(p: MaybePlacement, strided: dict[int, int]) -> TorchPlacement | None:
    if p is None:
        return None
    if isinstance(p, ShardPlaceholder):
        sf = strided.get(p.dim)
        return TorchStridedShard(p.dim, split_factor=sf) if sf else TorchShard(p.dim)
    if isinstance(p, Partial):
        return TorchPartial(p.reduce_op)
    return TorchReplicate()


def _strided_factors(rule: SingleDimRule, current_dim: Sequence[TorchPlacement]) -> dict[int, int]:
    """Split factors to keep when the inputs on this mesh dim are _StridedShard already.

    Only when every placeholder input of the rule matches a _StridedShard of one split
    factor: then the whole rule runs in that kind (placeholder semantics)."""
    factors = set()
    for p, cur in zip(rule.inputs, current_dim):
        if isinstance(p, ShardPlaceholder):
            if isinstance(cur, TorchStridedShard) and cur.dim == p.dim:
                factors.add(cur.split_factor)
            else:
                return {}
    if len(factors) != 1:
        return {}
    sf = factors.pop()
    dims = {p.dim for p in rule.inputs + rule.outputs if isinstance(p, ShardPlaceholder)}
    return {d: sf for d in dims}


def expand(rules: Sequence[SingleDimRule], current: Sequence[Sequence[TorchPlacement]]) -> tuple[tuple, tuple]:
    """(input placements per tensor input, output placements per output) for one
    rule per mesh dim."""
    n_in, n_out = len(rules[0].inputs), len(rules[0].outputs)
    ins = [[None] * len(rules) for _ in range(n_in)]
    outs: list[list | None] = [[None] * len(rules) for _ in range(n_out)]
    for m, rule in enumerate(rules):
        strided = _strided_factors(rule, [c[m] for c in current])
        for j, p in enumerate(rule.inputs):
            ins[j][m] = _fill(p, strided)
        for k, p in enumerate(rule.outputs):
            outs[k][m] = _fill(p, strided)
    out_t = tuple(None if any(p is None for p in o) else tuple(o) for o in outs)
    return tuple(tuple(i) for i in ins), out_t


def local_shape_nd(shape: Sequence[int], placements: Sequence[TorchPlacement], mesh: Sequence[int], coord: Sequence[int]) -> tuple[int, ...]:
    """`placements.local_shape` for torch's placements (what DTensors and their specs
    carry): the local shape on the rank at `coord`, mesh dims in order."""
    return local_shape(shape, [_shard_layout(p) for p in placements], mesh, coord)


def _shard_layout(p: TorchPlacement) -> MaybePlacement:
    if isinstance(p, TorchStridedShard):
        return StridedShard(p.dim, p.split_factor)
    if isinstance(p, TorchShard):
        return ShardPlaceholder(p.dim)
    return R  # Replicate, Partial and its subclasses: every rank holds the whole shape


def ranked(
    op, args: tuple, kwargs: dict, mesh_shape: Sequence[int] | MeshShape,
    current: Sequence[Sequence[TorchPlacement]], topology: Topology = H100,
    accept: Callable[[tuple, Cost], bool] | None = None, valid_only: bool = False,
) -> Iterator[MeshStrategy]:
    """Candidate strategies cheapest first (those DTensor can redistribute to before those
    it cannot), each checked for validity only when reached. The first valid one is the
    choice: on a 4x4x4 mesh with 14 rules that is one check instead of 2744, and the
    candidates are found best-first (`cheapest_first`), not by costing all of them.
    `accept(input_placements, cost)` skips candidates before they are checked.
    `valid_only` leaves out, before they are priced, strategies that put a surely-[even]
    rule on a mesh dim some rank's piece cannot split evenly (rot90's [16, 6] on 4x4x4
    meets ~50 of them first); the valid ones come in the same order."""
    mesh = mesh_shape if isinstance(mesh_shape, MeshShape) else MeshShape(tuple(mesh_shape))
    derived = derive_rules(op, *args, **kwargs)
    tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    if len(current) != len(tensors) or any(len(c) != mesh.ndim for c in current):
        raise ValueError(
            f"need {mesh.ndim} placements for each of the {len(tensors)} tensor inputs"
        )
    choices = candidate_rules(derived, len(tensors))
    even = [derived.surely_even(r) for r in choices] if valid_only else None
    for combo, ins, outs, cost in cheapest_first(choices, tensors, current, mesh, topology, even):
        if accept is not None and not accept(ins, cost):
            continue
        checked = [derived.validated(r) for r in combo]
        if None in checked:
            bad = combo[checked.index(None)]
            yield MeshStrategy(tuple(combo), ins, outs, cost, False, f"rule {bad} fails the local-shape check")
            continue
        ins, outs = expand(checked, current)  # outputs may have become P(avg) [even]
        with clean_dispatch_state():  # meta kernels run on meta tensors, not the caller's
            reason = _invalid_reason(derived.op, args, kwargs, checked, ins, outs, tensors, mesh.sizes)
        yield MeshStrategy(tuple(checked), ins, outs, cost, not reason, reason)


def candidate_rules(derived, n_tensors: int) -> list[SingleDimRule]:
    """The choices for each mesh dim: all-Replicate, then propagation's rules, not yet
    local-checked (each is checked only if a strategy using it is reached: a first
    DTensor call checks a handful, not all)."""
    trivial = SingleDimRule((R,) * n_tensors, _trivial_outputs(derived), source="implied")
    return [trivial, *derived.tentative()]


def candidate_key(cost: Cost, order: tuple[int, ...]) -> tuple:
    """The total order of candidates: DTensor-supported first, then `Cost.sort_key()`,
    then the choice indices per mesh dim (rule order) to break the remaining ties."""
    return (not cost.dtensor_supported, *cost.sort_key(), order)


# ------------------------------------------------------------ the best-first search
#
# The candidate order is what every rank must agree on: each rank runs the search on its
# own, with no communication, for the same op, global shapes, placements and mesh, and
# DTensor hangs (or computes garbage) if two ranks pick different strategies. The order
# is a pure function of those inputs: the same float operations in the same order give
# bit-identical results on every rank (IEEE 754 doubles, sequential sums; dicts iterate
# in insertion order, and no order comes from a set of strings, whose hashes are salted
# per process), and every tie is broken by rule indices (derive's order), never by
# anything rank-local. Rounding (`Cost.sort_key`: 1 ns, 10 significant digits of bytes)
# makes float noise a tie. The constants below keep the search's order equal to sorting
# every strategy by `candidate_key`: a prefix's key must be <= each of its completions'
# exact keys, component by component, although the bounds are float sums taken in
# another order than the exact model's (tests/test_lift_pieces.py checks both).

# the search's bound on seconds is scaled by this before rounding: float sums in another
# order than the exact model's must not lift a bound above the exact (their error is
# ~1e-14 relative); 1e-9 relative is far above that and far below the 1 ns rounding
SECONDS_SLACK = 1 - 1e-9
# the same for bytes: they keep 10 significant digits (bytes_key), so a slack this small
# leaves a tight bound tying with the exact key instead of ranking below it
BYTES_SLACK = 1 - 1e-12
# a count of collectives is whole: a bound of 0.999... (float sums of fused shares) is a
# bound of 1, and must be, or every prefix would come before the strategies that tie
# with it on time and count; this tolerance absorbs the float error before rounding up
COUNT_TOLERANCE = 1e-6

# (unsupported, seconds, collectives, bytes): a bound on `candidate_key`'s components,
# summed over inputs and mesh dims, not yet rounded
BoundSum = tuple[bool, float, float, float]
ZERO_BOUND: BoundSum = (False, 0.0, 0.0, 0.0)


@dataclass
class SearchTables:
    """What `cheapest_first` knows of one problem, worked out once, and its caches.

    Indices: i a tensor input, m a mesh dim, c a choice (an index into `choices`), k the
    length of a prefix (mesh dims 0..k-1 chosen). Placements in the model's form
    (`model_placement`) are what the cost model prices fast; small-int target ids
    (`tid`) make cache keys that hash fast."""

    choices: Sequence[SingleDimRule]
    mesh: MeshShape
    topology: Topology
    shapes: list[tuple[int, ...]]  # [i]
    itemsizes: list[int]  # [i]
    srcs: list[tuple]  # [i][m]: current placement, model form
    cols: list[list[tuple[tuple, tuple]]]  # [m][c]: (input, output) torch placements there
    model: list[list[tuple]]  # [m][c][i]: the input's target, model form
    # [i][m]: the targets the choices allow there (what an unchosen mesh dim may end in:
    # the bounds use it to know which tensor dims it may shard)
    unknown: list[tuple[tuple, ...]]
    tid: list[list[tuple[int, ...]]]  # [m][c][i]: index of model[m][c][i] in unknown[i][m]
    members: list[dict[int, list[int]]] = field(default_factory=list)  # see equivalent_choices
    rest: list[BoundSum] = field(default_factory=list)  # see remaining_bounds
    _rows: dict = field(default_factory=dict, repr=False)  # (i, m, target id): TargetRow
    _alone: dict = field(default_factory=dict, repr=False)  # (i, m, target): CostBound
    _known: dict = field(default_factory=dict, repr=False)  # (i, prefix ids): CostBound
    _exact: dict = field(default_factory=dict, repr=False)  # (i, ids): Cost

    @property
    def n_dims(self) -> int:
        return self.mesh.ndim

    def row(self, i: int, m: int, x: int) -> TargetRow:
        """`target_row` of target id x of tensor i on mesh dim m (-1: any it may end in),
        worked out when first needed: most targets are never bounded."""
        r = self._rows.get((i, m, x))
        if r is None:
            u = self.unknown[i][m]
            r = self._rows[(i, m, x)] = target_row(self.srcs[i][m], u if x < 0 else u[x], len(self.shapes[i]))
        return r

    def bound_alone(self, i: int, m: int, dst) -> CostBound:
        """Tensor i's bound for mesh dim m ending in `dst`, every other dim unknown."""
        b = self._alone.get((i, m, dst))
        if b is None:
            u = self.unknown[i]
            rows = [self.row(i, j, u[m].index(dst) if j == m else -1) for j in range(self.n_dims)]
            b = self._alone[(i, m, dst)] = lower_bound_model(
                self.shapes[i], self.itemsizes[i], self.srcs[i], u[:m] + (dst,) + u[m + 1:],
                self.mesh, self.topology, rows)
        return b

    def prefix_bound_of(self, i: int, order: tuple[int, ...]) -> CostBound:
        """Tensor i's bound for the mesh dims `order` chooses, knowing each other (see
        `redistribute_lower_bound`), the others unknown."""
        ids = tuple(self.tid[m][c][i] for m, c in enumerate(order))
        b = self._known.get((i, ids))
        if b is None:
            k = len(order)
            dst = tuple(self.model[m][c][i] for m, c in enumerate(order)) + self.unknown[i][k:]
            rows = [self.row(i, m, ids[m] if m < k else -1) for m in range(self.n_dims)]
            b = self._known[(i, ids)] = lower_bound_model(
                self.shapes[i], self.itemsizes[i], self.srcs[i], dst, self.mesh, self.topology, rows)
        return b

    def cost_of(self, i: int, order: tuple[int, ...]) -> Cost:
        """Tensor i's exact redistribution cost for the full strategy `order`."""
        ids = tuple(self.tid[m][c][i] for m, c in enumerate(order))
        one = self._exact.get((i, ids))
        if one is None:
            dst = tuple(self.model[m][c][i] for m, c in enumerate(order))
            one = self._exact[(i, ids)] = redistribute_cost(
                self.shapes[i], self.itemsizes[i], self.srcs[i], dst, self.mesh, self.topology)
        return one


def search_tables(
    choices: Sequence[SingleDimRule], tensors: Sequence[torch.Tensor],
    current: Sequence[Sequence[TorchPlacement]], mesh: MeshShape, topology: Topology = H100,
) -> SearchTables:
    """The tables `cheapest_first` searches with: each choice's placements per mesh dim
    (strided kinds kept as `expand` keeps them), the targets per tensor and mesh dim, the
    classes of choices that cost alike, and the least each mesh dim can add."""
    shapes = [tuple(t.shape) for t in tensors]
    srcs = [tuple(model_placement(p, len(s)) for p in c) for c, s in zip(current, shapes)]
    cols, model = _columns(choices, current, shapes, mesh.ndim)
    n_t, n_c, dims = len(tensors), len(choices), range(mesh.ndim)
    unknown = [tuple(tuple(dict.fromkeys(model[m][c][i] for c in range(n_c))) for m in dims) for i in range(n_t)]
    tid = [[tuple(unknown[i][m].index(model[m][c][i]) for i in range(n_t)) for c in range(n_c)] for m in dims]
    tables = SearchTables(choices, mesh, topology, shapes, [t.element_size() for t in tensors],
                          srcs, cols, model, unknown, tid)
    bounds = [dim_alone_bounds(tables, m) for m in dims]
    tables.members = [equivalent_choices(tables, m) for m in dims]
    tables.rest = remaining_bounds(bounds)
    return tables


def _columns(choices: Sequence[SingleDimRule], current: Sequence[Sequence[TorchPlacement]],
             shapes: Sequence[tuple[int, ...]], n_dims: int) -> tuple[list, list]:
    """Per mesh dim, per choice: (its (input, output) torch placements there, its input
    targets in the model's form)."""
    cols: list[list[tuple[tuple, tuple]]] = []
    model: list[list[tuple]] = []
    for m in range(n_dims):
        cur = [c[m] for c in current]
        cols.append([])
        model.append([])
        for rule in choices:
            strided = _strided_factors(rule, cur)
            ins = tuple(_fill(p, strided) for p in rule.inputs)
            cols[m].append((ins, tuple(_fill(p, strided) for p in rule.outputs)))
            model[m].append(tuple(model_placement(p, len(s)) for p, s in zip(ins, shapes)))
    return cols, model


def dim_alone_bounds(tables: SearchTables, m: int) -> list[BoundSum]:
    """Per choice, the least it adds on mesh dim m whatever the other dims choose; only
    a zero one when a choice keeps every input as it is there (nothing is less: the
    others need not be bounded, as only the minimum is used)."""
    t, srcs = tables, tables.srcs
    n_t = len(srcs)
    if any(all(t.model[m][c][i] == srcs[i][m] for i in range(n_t)) for c in range(len(t.choices))):
        return [ZERO_BOUND]
    return [_total([t.bound_alone(i, m, dst) for i, dst in enumerate(t.model[m][c])])
            for c in range(len(t.choices))]


def equivalent_choices(tables: SearchTables, m: int) -> dict[int, list[int]]:
    """Classes of choices on mesh dim m that cost the same in every strategy, whatever
    the other dims choose, as {lowest index: all its members, ascending}: the search
    visits the lowest and fans the class out when priced. Non-shard targets on a mesh dim
    of size 1 (DTensor skips the dim), and Replicate / P(avg|max|min) from a Replicate
    input (free, no collective) when no flattened group could fuse across the step. On
    2x2x2x2 this turns 6**4 strategies into 3**4."""
    groups: dict[tuple, list[int]] = {}
    for c in range(len(tables.choices)):
        targets = tables.model[m][c]
        key = tuple(None if _free(x, tables.srcs[i][m], tables.mesh, m) else x for i, x in enumerate(targets))
        groups.setdefault(key, []).append(c)
    return {g[0]: g for g in groups.values()}


def remaining_bounds(bounds: Sequence[Sequence[BoundSum]]) -> list[BoundSum]:
    """rest[k]: per component, the least any choice can add on mesh dims k, k+1, ...
    (`bounds[m]`: `dim_alone_bounds` of mesh dim m); rest[len(bounds)] is zero."""
    n_dims = len(bounds)
    rest = [ZERO_BOUND] * (n_dims + 1)
    for m in reversed(range(n_dims)):
        lo = [min(b[j] for b in bounds[m]) for j in range(4)]
        rest[m] = (lo[0] or rest[m + 1][0], *(lo[j] + rest[m + 1][j] for j in (1, 2, 3)))
    return rest


def prefix_bound(tables: SearchTables, order: tuple[int, ...]) -> BoundSum:
    """The admissible bound of every strategy starting with `order` (choices for mesh
    dims 0..k-1): the chosen dims' bound, knowing each other, plus the least each
    unchosen dim can add on its own (`remaining_bounds`). Each component is <= that of
    any completion's exact cost (tests/test_lift_pieces.py checks it by brute force)."""
    acc = _total([tables.prefix_bound_of(i, order) for i in range(len(tables.srcs))])
    r = tables.rest[len(order)]
    return (acc[0] or r[0], acc[1] + r[1], acc[2] + r[2], acc[3] + r[3])


def prefix_key(bound: BoundSum, order: tuple[int, ...]) -> tuple:
    """The heap key of a prefix (or of a full strategy not yet priced) with `bound`:
    `candidate_key`'s components, rounded as `Cost.sort_key` rounds them but never above
    (SECONDS_SLACK, COUNT_TOLERANCE, BYTES_SLACK), then `order`, a prefix of each
    completion's tie-break. So no key is above a completion's: when a full strategy is
    popped, nothing unpopped is cheaper, and the order is the sorted enumeration's."""
    return (bound[0], round(bound[1] * SECONDS_SLACK, SECONDS_DIGITS),
            math.ceil(bound[2] - COUNT_TOLERANCE), bytes_key(bound[3] * BYTES_SLACK), order)


def price(tables: SearchTables, order: tuple[int, ...]) -> Cost:
    """The exact cost of the full strategy `order`: the sum over inputs, in input order."""
    cost = Cost()
    for i in range(len(tables.srcs)):
        cost = cost + tables.cost_of(i, order)
    return cost


def payload(tables: SearchTables, order: tuple[int, ...], cost: Cost) -> tuple:
    """What `cheapest_first` yields for the full strategy `order`."""
    cols = tables.cols
    ins = tuple(tuple(cols[m][c][0][i] for m, c in enumerate(order)) for i in range(len(tables.srcs)))
    n_out = len(cols[0][order[0]][1])
    outs = tuple(tuple(cols[m][c][1][k] for m, c in enumerate(order)) for k in range(n_out))
    outs = tuple(None if any(p is None for p in o) else o for o in outs)
    return tuple(tables.choices[c] for c in order), ins, outs, cost


def cuts_unevenly(tables: SearchTables, even: Sequence[bool], order: tuple[int, ...]) -> bool:
    """The validity check the search can make early: the last choice of `order` is a
    surely-[even] rule (`even`, for every member of its class) that shards a tensor dim
    some rank's piece before it cannot split. Every completion fails the lift's [even]
    check, so none is generated."""
    m, c = len(order) - 1, order[-1]
    if not all(even[x] for x in tables.members[m][c]):
        return False
    for i in range(len(tables.srcs)):
        placements = tuple(tables.cols[j][order[j]][0][i] for j in range(m + 1))
        if _uneven_piece(tables.shapes[i], placements, tables.mesh.sizes) is not None:
            return True
    return False


def expand_prefix(tables: SearchTables, order: tuple[int, ...],
                  even: Sequence[bool] | None) -> Iterator[tuple]:
    """The expansion step: heap entries (key, order, None) for `order` extended by each
    class of choices on the next mesh dim, in rule order, less those `cuts_unevenly`
    rules out (only when `even` is given)."""
    for c in tables.members[len(order)]:
        child = order + (c,)
        if even is not None and cuts_unevenly(tables, even, child):
            continue
        yield prefix_key(prefix_bound(tables, child), child), child, None


def priced_entry(tables: SearchTables, order: tuple[int, ...]) -> tuple:
    """The heap entry of a full strategy reached on its bound, now priced: it goes back
    in at its exact key, standing for its class (state (cost, key, members left)). Its
    equivalents cost the same; they come in rule order (the product of ascending member
    lists, the first being this one), so each is pushed when the one before it is
    yielded, not all at once (8**3 on 2x2x2x2 for addmv)."""
    cost = price(tables, order)
    key = candidate_key(cost, ())[:-1]
    same = itertools.product(*(tables.members[m][c] for m, c in enumerate(order)))
    return key + (next(same),), order, (cost, key, same)


def cheapest_first(
    choices: Sequence[SingleDimRule], tensors: Sequence[torch.Tensor],
    current: Sequence[Sequence[TorchPlacement]], mesh: MeshShape, topology: Topology = H100,
    even: Sequence[bool] | None = None,
) -> Iterator[tuple[tuple[SingleDimRule, ...], tuple, tuple, Cost]]:
    """Every strategy (one of `choices` per mesh dim) as (rules, input placements, output
    placements, cost), in `candidate_key` order, without costing them all first.

    Why best-first and not enumeration: a mesh of d dims has len(choices)**d strategies
    (50625 for 15 rules on 2x2x2x2), and the first call only needs the cheapest few.
    Exact cost is a sum over inputs of `redistribute_cost` of whole placement tuples,
    which does not split over mesh dims; `redistribute_lower_bound` bounds the share of
    the mesh dims chosen so far, knowing each other, admissibly. A* over the choices for
    mesh dims 0, 1, ...: a prefix is keyed by `prefix_key` of its `prefix_bound`, a full
    strategy by its exact key once priced (`priced_entry`). Every component of a
    prefix's key is <= that of each completion, so when a full strategy is popped,
    nothing unpopped is cheaper: the order is exactly the sorted enumeration's. A full
    strategy is priced only when its bound comes up, so most are never priced.
    `even`: per choice, whether it is surely [even] (see `cuts_unevenly`)."""
    tables = search_tables(choices, tensors, current, mesh, topology)
    heap: list = [(prefix_key(prefix_bound(tables, ()), ()), (), None)]
    # entries: (key, order, state); state None: bounded (a prefix, or a full strategy not
    # yet priced); (cost, key, members left): priced, stands for its class
    while heap:
        _, order, state = heapq.heappop(heap)
        if state is None and len(order) < tables.n_dims:
            for entry in expand_prefix(tables, order, even):
                heapq.heappush(heap, entry)
        elif state is None:
            heapq.heappush(heap, priced_entry(tables, order))
        else:
            cost, key, same = state
            yield payload(tables, order, cost)
            one = next(same, None)
            if one is not None:
                heapq.heappush(heap, (key + (one,), one, state))


def _free(target, src, mesh: MeshShape, m: int) -> bool:
    """Whether `target` on mesh dim m costs nothing in any strategy (see cheapest_first)."""
    if target.kind == "S":
        return False
    if mesh.sizes[m] == 1:
        return True
    return (not mesh.flattened and src.kind == "R"
            and (target.kind == "R" or target.reduce_op in ("avg", "max", "min")))


def _total(parts: Sequence[CostBound]) -> tuple[bool, float, float, float]:
    return (any(b.unsupported for b in parts), sum(b.seconds for b in parts),
            sum(b.collectives for b in parts), sum(b.bytes for b in parts))


def rank_strategies(
    op, args: tuple, kwargs: dict, mesh_shape: Sequence[int] | MeshShape,
    current: Sequence[Sequence[TorchPlacement]], topology: Topology = H100,
    limit: int = MAX_LISTED,
) -> list[MeshStrategy]:
    """Candidate strategies, cheapest valid first (invalid ones last, with reasons).

    All of them on small meshes; on large ones (15 rules on 2x2x2x2 is 50625) the
    cheapest `limit`, and further ones only until a valid one is among them: each is
    checked on the mesh, which is what an explanation costs."""
    out: list[MeshStrategy] = []
    found = False
    for s in ranked(op, args, kwargs, mesh_shape, current, topology):
        out.append(s)
        found = found or s.valid
        if len(out) >= limit and found:
            break
    out.sort(key=lambda s: not s.valid)  # stable: cost order within each group
    return out


def _trivial_outputs(derived) -> tuple:
    if derived.graph is not None:
        return tuple(None if v is None else R for v in derived.graph.outputs)
    if derived.rules:
        return tuple(None if p is None else R for p in derived.rules[0].outputs)
    return (R,)


def strategy_invalid_reason(op, args: tuple, kwargs: dict, strategy: MeshStrategy, mesh_shape: Sequence[int]) -> str:
    """Why `strategy` (chosen at other shapes) is not valid for these arguments, or '':
    each of its rules must be one these arguments' derivation keeps, with the same
    outputs and [even] only where it was [even] already, and the strategy must pass the
    lift's mesh check here (an [even] rule: these shapes must split evenly)."""
    derived = derive_rules(op, *args, **kwargs)
    if derived.unsupported_reason:
        return f"not derivable here: {derived.unsupported_reason}"
    for rule in strategy.rules:
        if rule.is_trivial():
            continue
        here = _same_rule_here(derived, rule)
        if here is None or (here.even_only and not rule.even_only):
            return f"rule {rule} does not hold here" if here is None else f"rule {rule} holds here as {here}"
    tensors = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
    with clean_dispatch_state():
        return _invalid_reason(derived.op, args, kwargs, strategy.rules, strategy.input_placements,
                               strategy.output_placements, tensors, tuple(mesh_shape))


def _same_rule_here(derived, rule: SingleDimRule) -> SingleDimRule | None:
    """The checked rule of `derived` with `rule`'s inputs and outputs (the local check
    may have turned a tentative P(sum) output into P(avg)), or None."""
    for tentative in derived.tentative():
        if tentative.inputs == rule.inputs:
            here = derived.validated(tentative)
            if here is not None and here.outputs == rule.outputs:
                return here
    return None


def _invalid_reason(op, args, kwargs, combo, ins, outs, tensors, mesh: tuple[int, ...]) -> str:
    mixed = _mixed_partials(ins, outs)
    if mixed:
        return mixed
    if all(all(isinstance(p, TorchReplicate) for p in i) for i in ins):
        return ""  # everything replicated: the op runs as on one device
    for m, rule in enumerate(combo):
        if not rule.even_only:
            continue
        for t, pl in zip(tensors, ins):
            size = _uneven_piece(t.shape, pl[:m + 1], mesh)
            if size is not None:
                return (f"rule {rule} on mesh dim {m} needs even shards; dim {pl[m].dim} of size "
                        f"{size} does not split over {mesh[m]}")
    return _meta_check(op, args, kwargs, ins, outs, tensors, mesh)


def _uneven_piece(shape: Sequence[int], placements: Sequence[TorchPlacement], mesh: Sequence[int]) -> int | None:
    """For a tensor placed `placements` on mesh dims 0..m: if the last one shards it, the
    size of the first rank's piece (before mesh dim m) that does not split evenly over
    mesh dim m, else None. Every rank's piece: earlier uneven shards differ per rank (7
    rows over 2 are 4 and 3; over 4 more, 4 splits evenly and 3 does not)."""
    m = len(placements) - 1
    p = placements[m]
    if not isinstance(p, (TorchShard, TorchStridedShard)):
        return None
    earlier = tuple(placements[:m]) + (TorchReplicate(),) * (len(mesh) - m)
    for coord in itertools.product(*(range(k) for k in mesh[:m])):
        before = local_shape_nd(shape, earlier, mesh, coord + (0,) * (len(mesh) - m))
        if before[p.dim] % mesh[m]:
            return before[p.dim]
    return None


def _mixed_partials(ins, outs) -> str:
    """DTensor refuses a placement list that mixes Partial reduce ops across mesh dims
    (`[Partial(sum), Partial(max)]`: the order of reductions would change the value), so
    a strategy that needs one, as an input target or an output, cannot run."""
    for kind, rows in (("input", ins), ("output", outs)):
        for j, row in enumerate(rows):
            ops = {p.reduce_op for p in row or () if isinstance(p, TorchPartial)}
            if len(ops) > 1:
                return f"{kind} {j} would mix Partial reduce ops {sorted(ops)} across mesh dims"
    return ""


def _meta_check(op, args, kwargs, ins, outs, tensors, mesh) -> str:
    """Run the original op's meta kernel on every distinct set of local input shapes, and
    its real CPU kernel too where the meta kernel is known to check less
    (localcheck.REAL_KERNEL_SHAPE_CHECKED): DTensor runs the real one."""
    flat, spec = tree_flatten((args, kwargs))
    out_global = _global_outputs(op, args, kwargs)
    seen = set()
    for coord in itertools.product(*(range(s) for s in mesh)):
        shapes = tuple(local_shape_nd(t.shape, pl, mesh, coord) for t, pl in zip(tensors, ins))
        try:
            want = tuple(
                None if o is None or g is None else local_shape_nd(g, o, mesh, coord)
                for g, o in zip(out_global, outs)
            )
        except (IndexError, ValueError, RuntimeError, AssertionError) as e:
            # the decomposition's output is not the op's (e.g. torch's sdpa-for-cpu
            # decomposition returns the attention weights where the op returns logsumexp)
            return f"the output placements {outs} do not fit the op's real outputs {out_global}: {e}"
        if (shapes, want) in seen:
            continue
        seen.add((shapes, want))
        it = iter(shapes)
        local_flat = [
            torch.empty(next(it), dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x
            for x in flat
        ]
        la, lk = tree_unflatten(local_flat, spec)
        try:
            result = op(*la, **lk)
        except Exception as e:
            return (f"the op fails on rank {list(coord)}'s local shapes {[list(s) for s in shapes]}: "
                    f"{one_line(e, 160, with_type=False)}")
        got = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in tree_flatten(result)[0]]
        for g, w in zip(got, want):
            if w is not None and g != w:
                return f"on rank {list(coord)} the op returns local shape {list(g)}, the strategy needs {list(w)}"
        refusal = real_kernel_refusal(op, la, lk)  # ops whose meta kernel checks less than the kernel
        if refusal:
            return f"on rank {list(coord)}'s local shapes {[list(s) for s in shapes]} {refusal}"
    return ""


def _global_outputs(op, args, kwargs) -> list:
    flat, spec = tree_flatten((args, kwargs))
    meta = [
        torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") if isinstance(x, torch.Tensor) else x
        for x in flat
    ]
    a, k = tree_unflatten(meta, spec)
    res = op(*a, **k)
    return [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in tree_flatten(res)[0]]
