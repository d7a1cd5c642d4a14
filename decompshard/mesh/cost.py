"""An explicit alpha-beta cost model for choosing among N-D sharding strategies.

Why not torch's (``torch/distributed/tensor/_collective_utils.py``)? It prices R->P and
R->S at 0 (so dividing a replicated input by n ties with using it as is), S(i)->S(j) as an
all-gather + 1.0 (DTensor runs an all-to-all moving n times fewer bytes), uses one
A100-era bandwidth whatever the group size, and ignores DTensor fusing reductions over a
flattened mesh. This module prices what DTensor runs.

Modeled:
  * A collective over n ranks costs ``launch + hops*alpha + wire_bytes / busbw(n)``, ring /
    pairwise: all-gather, reduce-scatter, all-to-all put (n-1)/n of the message on the wire
    in n-1 steps, all-reduce 2(n-1)/n in 2(n-1) steps. Message size as in nccl-tests
    (gathered output, reduce-scatter input, all-reduced tensor, per-rank all-to-all
    buffer), for the tensor as it is on that mesh dim given the other dims' sharding,
    largest shard (what padded collectives move). ``launch`` is a fixed per-collective
    cost: without it two small collectives would look as cheap as one.
  * Intra-node bus bandwidth falls with group size (NVSwitch ring efficiency, fitted to
    nccl-tests). A group spanning nodes is bound by the NICs of its ranks on one node (one
    NIC per GPU; same-mesh-dim groups share none under row-major layout) and each ring
    step pays the inter-node alpha. Ranks are row-major: a mesh dim is intra-node iff the
    group of rank 0 stays within one node of ``devices_per_node`` ranks.
  * Local work around collectives, as read+write bytes at memory bandwidth: R->P(sum)
    divides (``_MaskPartial`` masks); R->P(avg/max/min) is the identity in torch, free;
    R->S clones the slice; gathering / scattering a tensor dim that is not outermost costs
    a chunk-and-cat copy; a merged sum/avg reduction divides.
  * Step order is DTensor's greedy planner (``generate_greedy_transform_infos``): if the
    source has shards, mesh dims last-to-first (target Shard(d) becomes Replicate when
    d's sharding on earlier mesh dims differs), then first-to-last for the rest.
    Consecutive all-gathers / reduce-scatters / all-reduces with mergeable placements are
    one collective when ``MeshShape.flattened`` holds exactly their mesh dims (all-gather
    dims descending, reduce-scatter ascending and evenly divisible), as in
    ``_optimize_transform_infos``. Mesh dims of size 1 are free.
  * P(x)->P(y) and S->P, which DTensor's redistribute rejects, are priced as all-reduce /
    all-gather to Replicate then local R->P work, with ``Cost.dtensor_supported`` False.
    _StridedShard is sized like Shard; to / from it goes via Replicate, as DTensor does.

Not modeled: overlap of compute and communication (costs add serially); contention with
other traffic; NCCL's algorithm / protocol choice (tree, NVLS, LL): always ring, so small
message latency is approximate; padding copies for uneven shards, allocation, launch cost
of local work, caches; the op's own compute; DTensor's graph-based planner (non-default
shard orders); non-row-major layouts, rail-optimized or oversubscribed networks.

Units are bytes and seconds. To rank strategies, add the costs of all their inputs with
``+`` and compare ``Cost.sort_key()``.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, Sequence

from torch.distributed.tensor.placement_types import Placement, Shard

from decompshard._compat import TorchStridedShard as _StridedShard
from decompshard._compat import collective_cost_model as _torch_collective_cost_model
from decompshard._compat import redistribute_cost as _torch_redistribute_cost

ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE, ALL_TO_ALL = (
    "all_gather", "reduce_scatter", "all_reduce", "all_to_all")
# kind -> multiplier on the ring's (n-1)/n bytes and (n-1) steps
_RING: dict[str, int] = {ALL_GATHER: 1, REDUCE_SCATTER: 1, ALL_REDUCE: 2, ALL_TO_ALL: 1}


@dataclass(frozen=True)
class Topology:
    """Machine numbers the model needs; bandwidths in bytes/s, latencies in seconds."""

    name: str
    intra_node_bandwidth: float  # bus bandwidth of a 2-rank collective inside a node
    intra_node_latency: float  # per ring step over NVLink
    inter_node_bandwidth: float  # one GPU's NIC, effective
    inter_node_latency: float  # per ring step when the ring crosses nodes
    devices_per_node: int
    memory_bandwidth: float  # HBM, effective for copy kernels (local work)
    intra_node_scaling: float = 0.0  # fraction of bandwidth lost per doubling of ranks
    collective_launch_latency: float = 0.0  # fixed cost of every collective


# H100 SXM, 8 per node on NVSwitch (NVLink4), 400 Gb/s InfiniBand NIC per GPU.
# Calibration: published nccl-tests all-gather bus bandwidth for 1 GB messages on one
# H100 node is ~537 / 434 / 394 GB/s at 2 / 4 / 8 GPUs. busbw = 530 GB/s / (1 + 0.19
# log2(n/2)) makes a modeled 1 GB all-gather reach 527 / 444 / 383 GB/s (-1.9 / +2.2 /
# -2.9%; tests/test_cost.py pins 15%). The 2-GPU figure exceeds NVLink4's 450 GB/s per
# direction: this is a fitted *effective* bandwidth, not a link spec. IB: 400 Gb/s = 50
# GB/s raw, 90% taken as achievable. HBM3: 3.35 TB/s spec, ~3.0 TB/s for copies. Latencies
# are order-of-magnitude NCCL small-message figures, not fitted.
H100 = Topology(
    name="H100", intra_node_bandwidth=530e9, intra_node_latency=0.5e-6,
    inter_node_bandwidth=45e9, inter_node_latency=3e-6, devices_per_node=8,
    memory_bandwidth=3.0e12, intra_node_scaling=0.19, collective_launch_latency=5e-6)
# A100 SXM on NVSwitch (NVLink3): H100's curve shape, scaled so 8 GPUs give ~240 GB/s, the
# middle of commonly reported nccl-tests figures (230-250; not measured here); 200 Gb/s
# InfiniBand per GPU (25 GB/s raw, 90%); HBM2e 2.0 TB/s (~1.8 for copies).
A100 = replace(H100, name="A100", intra_node_bandwidth=330e9, inter_node_bandwidth=22.5e9,
               memory_bandwidth=1.8e12)


def bus_bandwidth(group_size: int, *, inter_node: bool, topology: Topology,
                  ranks_per_node: int = 1) -> float:
    """Per-rank bus bandwidth (bytes/s) of a collective: nccl-tests' ``busbw``.

    Across nodes a group is bound by the NICs of its ``ranks_per_node`` ranks on a node,
    and never faster than NVLink would be for those ranks."""
    def nvlink(n: int) -> float:
        return topology.intra_node_bandwidth / (
            1.0 + topology.intra_node_scaling * math.log2(max(n, 2) / 2))

    if not inter_node:
        return nvlink(group_size)
    rpn = max(1, ranks_per_node)
    return min(nvlink(rpn), rpn * topology.inter_node_bandwidth)


def collective_seconds(kind: str, nbytes: float, group_size: int, *, inter_node: bool,
                       topology: Topology, ranks_per_node: int = 1) -> float:
    """Seconds for one collective of message size ``nbytes`` (nccl-tests convention).

    Ring alpha-beta: launch + hops*alpha + wire bytes / bus bandwidth, so that a model
    number can be compared with a measured nccl-tests ``busbw`` directly."""
    if kind not in _RING:
        raise ValueError(f"unknown collective {kind!r}; expected one of {tuple(_RING)}")
    if group_size <= 1:
        return 0.0
    m, n = _RING[kind], group_size
    alpha = topology.inter_node_latency if inter_node else topology.intra_node_latency
    bw = bus_bandwidth(n, inter_node=inter_node, topology=topology,
                       ranks_per_node=ranks_per_node)
    return topology.collective_launch_latency + m * (n - 1) * alpha + m * (n - 1) / n * nbytes / bw


@dataclass(frozen=True)
class MeshShape:
    """A device mesh as the cost model sees it: sizes, optional names, flattened groups.

    ``flattened`` lists groups of mesh dims for which a flattened DeviceMesh exists
    (``mesh["dp", "tp"]._flatten()``); only those let DTensor fuse reductions."""

    sizes: tuple[int, ...]
    names: tuple[str, ...] | None = None
    flattened: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
        if not self.sizes or any(s < 1 for s in self.sizes):
            raise ValueError(f"mesh sizes must be positive, got {self.sizes}")
        if self.names is not None and len(self.names) != len(self.sizes):
            raise ValueError("names must have one entry per mesh dim")
        groups = tuple(tuple(sorted(g)) for g in self.flattened)
        for g in groups:
            if len(g) < 2 or len(set(g)) != len(g) or not all(0 <= d < self.ndim for d in g):
                raise ValueError(f"bad flattened group {g} for a {self.ndim}-D mesh")
        object.__setattr__(self, "flattened", groups)

    @property
    def ndim(self) -> int:
        return len(self.sizes)

    def group_size(self, dims: Sequence[int]) -> int:
        return math.prod(self.sizes[d] for d in dims)

    def label(self, dims: Sequence[int]) -> str:
        shown = [self.names[d] if self.names else str(d) for d in dims]
        return f"mesh dim {shown[0]}" if len(dims) == 1 else f"mesh dims ({', '.join(shown)})"


@lru_cache(maxsize=4096)
def _layout(sizes: tuple[int, ...], dims: tuple[int, ...], per_node: int) -> tuple[bool, int]:
    """(spans nodes?, most ranks on one node) for the group of rank 0 over ``dims``."""
    strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
    ranks = [0]
    for d in dims:
        ranks = [r + c * strides[d] for r in ranks for c in range(sizes[d])]
    nodes = Counter(r // per_node for r in ranks)
    return len(nodes) > 1, max(nodes.values())


@dataclass(frozen=True)
class CollectiveCost:
    """One collective DTensor would issue, kept separate so a choice can be explained."""

    kind: str
    mesh_dims: tuple[int, ...]
    bytes: float  # message size, nccl-tests convention (see module docstring)
    seconds: float
    group_size: int = 1
    inter_node: bool = False
    label: str = ""  # "mesh dim 1", "mesh dims (dp, tp)"

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends: what the bandwidth term is charged for."""
        n = self.group_size
        return _RING[self.kind] * (n - 1) / n * self.bytes if n > 1 else 0.0


@dataclass(frozen=True)
class LocalWork:
    """A local copy / division around the collectives: cheap, but it decides ties."""

    what: str
    mesh_dim: int
    bytes: float  # memory traffic (read + write)
    seconds: float


# decimal digits of seconds ``Cost.sort_key`` keeps (1 ns): float noise in a sum of
# collectives' times must be a tie, not an order that differs with summation order
SECONDS_DIGITS = 9


def bytes_key(nbytes: float) -> float:
    """Bytes as ``Cost.sort_key`` compares them: to 10 significant digits. Monotone, so a
    lower bound's key is <= the exact key."""
    return float(f"{nbytes:.10g}")


@dataclass(frozen=True)
class Cost:
    """Everything one redistribution costs; ``+`` sums several (one per input)."""

    collectives: tuple[CollectiveCost, ...] = ()
    local_bytes: float = 0.0
    local_seconds: float = 0.0
    local_work: tuple[LocalWork, ...] = ()
    dtensor_supported: bool = True  # False: DTensor's redistribute would raise

    @property
    def total_seconds(self) -> float:
        return sum(c.seconds for c in self.collectives) + self.local_seconds

    @property
    def bytes_moved(self) -> float:
        return self.wire_bytes + self.local_bytes

    @property
    def wire_bytes(self) -> float:
        """Bytes each rank sends over the network: its collectives' alone."""
        return sum(c.wire_bytes for c in self.collectives)

    def sort_key(self) -> tuple[float, int, float]:
        """Order candidates: time (to 1 ns), then fewer collectives, then fewer bytes (to
        10 significant digits).

        Rounding makes float noise a tie, and the tie-breakers make the order total and
        deterministic; a remaining tie is for the caller to break (rule order). Because
        local work counts in ``bytes_moved``, a strategy needing R->P(sum) loses to one
        that keeps the input Replicate even when the division rounds to 0 ns. Bytes are
        rounded so that a search bounding them from below (lift) can see a tie as one:
        a bound a hair under the exact sum would otherwise rank every prefix that ties
        with a strategy on bytes before it."""
        return (round(self.total_seconds, SECONDS_DIGITS), len(self.collectives), bytes_key(self.bytes_moved))

    def __add__(self, other: Cost) -> Cost:
        """Cost of doing both (e.g. redistributing every input of a strategy)."""
        return Cost(self.collectives + other.collectives,
                    self.local_bytes + other.local_bytes,
                    self.local_seconds + other.local_seconds,
                    self.local_work + other.local_work,
                    self.dtensor_supported and other.dtensor_supported)

    def explain(self) -> list[str]:
        """Human-readable lines, one per collective and per piece of local work."""
        lines = []
        for c in self.collectives:
            where = c.label or f"mesh dims {c.mesh_dims}"
            lines.append(f"{c.kind.replace('_', '-')} over {where} ({c.group_size} ranks, "
                         f"{'inter' if c.inter_node else 'intra'}-node): "
                         f"{c.bytes / 1e6:.1f} MB, {c.seconds * 1e6:.1f} µs")
        for w in self.local_work:
            lines.append(f"local {w.what} on mesh dim {w.mesh_dim}: "
                         f"{w.bytes / 1e6:.1f} MB read+write, {w.seconds * 1e6:.1f} µs")
        if not self.dtensor_supported:
            lines.append("note: DTensor's redistribute rejects this conversion")
        return lines or ["free (nothing to do)"]


# ---------------------------------------------------------------- placements helpers


@dataclass(frozen=True)
class _Pl:
    """A placement as the model sees it, normalized (non-negative dim).

    Why not torch's classes: comparing two of them of different kinds costs ~18 µs
    (``Shard(0) == Replicate()``), and a search prices thousands of placement tuples.
    Mirrors the bits of torch's API used here; ``split_factor`` > 0 is _StridedShard."""

    kind: str  # "R", "S" or "P"
    dim: int = 0
    split_factor: int = 0
    reduce_op: str = ""

    def is_partial(self) -> bool:
        return self.kind == "P"

    def is_replicate(self) -> bool:
        return self.kind == "R"

    def __str__(self) -> str:  # as torch prints them (explanations quote these)
        if self.kind == "S":
            return f"_S({self.dim}, {self.split_factor})" if self.split_factor else f"S({self.dim})"
        return f"P({self.reduce_op})" if self.kind == "P" else "R"


_REPLICATE = _Pl("R")


def _is_shard(p: _Pl) -> bool:
    return p.kind == "S"


def _strided(p: _Pl) -> bool:
    return p.split_factor > 0


def model_placement(p: Placement, ndim: int) -> _Pl:
    """``p`` (a torch placement) in the model's own form, for callers that price many
    placement tuples: pass these to ``redistribute_cost`` to skip converting each time."""
    return _normalize(p, ndim)


def _normalize(p: Placement, ndim: int) -> _Pl:
    if type(p) is _Pl:
        return p
    kind = type(p)
    if issubclass(kind, (Shard, _StridedShard)):
        if not -ndim <= p.dim < ndim:
            raise ValueError(f"{p} out of range for a {ndim}-D tensor")
        sf = p.split_factor if issubclass(kind, _StridedShard) else 0
        return _Pl("S", p.dim % ndim, sf)
    if p.is_replicate():
        return _REPLICATE
    if p.is_partial():
        return _Pl("P", reduce_op=p.reduce_op)
    raise TypeError(f"unsupported placement {p!r}")


def _local_shape(shape: Sequence[int], placements: Sequence[_Pl],
                 sizes: Sequence[int]) -> list[int]:
    """Largest local shard: ceil-divide each sharded dim, mesh dim by mesh dim. Not
    `placements.local_shape`: no rank's shape but the largest (what padded collectives
    move), on the model's own placement type, with _StridedShard sized like Shard (see
    the module docstring)."""
    out = list(shape)
    for p, n in zip(placements, sizes):
        if _is_shard(p):
            out[p.dim] = -(-out[p.dim] // n)
    return out


def _comm_kind(a: _Pl, b: _Pl) -> str | None:
    if a.is_partial():
        return ALL_REDUCE if b.is_replicate() else REDUCE_SCATTER
    if _is_shard(a):
        return ALL_GATHER if b.is_replicate() else ALL_TO_ALL
    return None


def _greedy_plan(src: Sequence[_Pl], dst: Sequence[_Pl],
                 sizes: Sequence[int]) -> list[tuple[int, _Pl, _Pl]]:
    """Mirror of DTensor's ``generate_greedy_transform_infos`` (see module docstring)."""
    cur, steps = list(src), []
    if math.prod(n for p, n in zip(src, sizes) if _is_shard(p)) > 1:
        for i in reversed(range(len(cur))):
            tgt = dst[i]
            if _is_shard(tgt) and [_is_shard(p) and p.dim == tgt.dim for p in cur[:i]] != [
                    _is_shard(p) and p.dim == tgt.dim for p in dst[:i]]:
                tgt = _REPLICATE  # misaligned nested sharding: clear it first
            if cur[i] != tgt:
                steps.append((i, cur[i], tgt))
                cur[i] = tgt
    steps += [(i, c, d) for i, (c, d) in enumerate(zip(cur, dst)) if c != d]
    return steps


def _expand(step: tuple[int, _Pl, _Pl]) -> tuple[list, bool]:
    """Split steps DTensor does not do directly into two, via Replicate."""
    i, a, b = step
    via_r = ((a.is_partial() and b.is_partial())  # P(x)->P(y): rejected by DTensor
             or (_is_shard(a) and b.is_partial())  # S->P: rejected by DTensor
             or (_is_shard(a) and _is_shard(b)  # DTensor goes through R for strided
                 and (_strided(a) or _strided(b))))
    if not via_r:
        return [step], True
    return [(i, a, _REPLICATE), (i, _REPLICATE, b)], not b.is_partial()


def _mergeable(s: tuple[int, _Pl, _Pl], t: tuple[int, _Pl, _Pl]) -> bool:
    kind = _comm_kind(s[1], s[2])
    if kind not in (ALL_GATHER, REDUCE_SCATTER, ALL_REDUCE) or kind != _comm_kind(t[1], t[2]):
        return False
    if any(_strided(p) for p in (*s[1:], *t[1:])):
        return False
    if s[1:] == t[1:]:
        return True
    return (s[2] == t[2] and s[1].is_partial() and t[1].is_partial()
            and {s[1].reduce_op, t[1].reduce_op} <= {"sum", "avg"})


def _try_flatten(run: list, mesh: MeshShape, shape: Sequence[int], src: list) -> bool:
    """Whether DTensor would run ``run`` (>= 2 mergeable steps) as one collective.

    Like DTensor, divisibility is checked on the source's logical shape at the run's
    outermost mesh dim."""
    dims = tuple(s[0] for s in run)
    if tuple(sorted(dims)) not in mesh.flattened:
        return False
    kind = _comm_kind(run[0][1], run[0][2])
    if kind == ALL_GATHER:
        return dims == tuple(sorted(dims, reverse=True))
    if kind == REDUCE_SCATTER:
        full = _local_shape(shape, src[:min(dims)], mesh.sizes)[run[0][2].dim]
        return dims == tuple(sorted(dims)) and full % mesh.group_size(dims) == 0
    return True


def redistribute_cost(global_shape: tuple[int, ...], itemsize: int,
                      src: Sequence[Placement], dst: Sequence[Placement],
                      mesh: MeshShape | Sequence[int], topology: Topology = H100) -> Cost:
    """Cost of DTensor's redistribute from ``src`` to ``dst`` placements (one per mesh dim).

    Prices the collectives DTensor runs, in its order and with its flattening, plus the
    local copies and divisions around them, so candidates can be compared honestly.
    Remembered per arguments: the runtime's collective plans price every call they see
    (a pure function of shapes and placements)."""
    key = (tuple(global_shape), itemsize, tuple(src), tuple(dst),
           mesh if isinstance(mesh, MeshShape) else tuple(mesh), topology)
    try:
        return _redistribute_cost_cached(*key)
    except TypeError:  # an unhashable placement or topology: priced afresh
        return _redistribute_cost(*key)


@lru_cache(maxsize=8192)
def _redistribute_cost_cached(*key: Any) -> Cost:
    return _redistribute_cost(*key)


def _redistribute_cost(global_shape: tuple[int, ...], itemsize: int, src: Sequence[Placement],
                       dst: Sequence[Placement], mesh: MeshShape | Sequence[int], topology: Topology) -> Cost:
    mesh = mesh if isinstance(mesh, MeshShape) else MeshShape(tuple(mesh))
    ndim = len(global_shape)
    if len(src) != mesh.ndim or len(dst) != mesh.ndim:
        raise ValueError(f"need {mesh.ndim} placements, got {len(src)} and {len(dst)}")
    src = [_normalize(p, ndim) for p in src]
    dst = [_normalize(p, ndim) for p in dst]
    steps, supported = [], True
    for step in _greedy_plan(src, dst, mesh.sizes):
        if mesh.sizes[step[0]] > 1:  # DTensor's num_chunks == 1 shortcut
            more, ok = _expand(step)
            steps += more
            supported = supported and ok

    colls, work, state = [], [], list(src)

    def local(what: str, dim: int, b: float) -> None:
        work.append(LocalWork(what, dim, b, b / topology.memory_bandwidth))

    def leading(loc: Sequence[int], d: int) -> bool:  # chunk/cat of dim d needs a copy
        return math.prod(loc[:d]) > 1

    units, k = [], 0  # a unit is one step, or a run DTensor fuses into one collective
    while k < len(steps):
        run = [steps[k]]
        while k + len(run) < len(steps) and _mergeable(run[0], steps[k + len(run)]):
            run.append(steps[k + len(run)])
        k += len(run)
        fuse = len(run) > 1 and _try_flatten(run, mesh, global_shape, src)
        units += [run] if fuse else [[s] for s in run]  # all or nothing, as DTensor
    for run in units:
        (i, a, b), dims = run[0], tuple(sorted(s[0] for s in run))
        loc0 = _local_shape(global_shape, state, mesh.sizes)
        for j, _, t in run:
            state[j] = t
        loc1 = _local_shape(global_shape, state, mesh.sizes)
        before, after = float(math.prod(loc0) * itemsize), float(math.prod(loc1) * itemsize)
        kind = _comm_kind(a, b)
        if kind is None:  # from Replicate: local only
            if _is_shard(b):
                local(f"slice+clone R->{b}", i, 2 * after)
            elif b.reduce_op not in ("avg", "max", "min"):
                local(f"R->{b} (divide or mask)", i, 2 * before)
            continue
        inter, per_node = _layout(mesh.sizes, dims, topology.devices_per_node)
        n = mesh.group_size(dims)
        # padded: n times the largest shard for all-gather (output) / reduce-scatter (input)
        msg = {ALL_GATHER: before * n, REDUCE_SCATTER: after * n}.get(kind, before)
        colls.append(CollectiveCost(kind, dims, msg, collective_seconds(
            kind, msg, n, inter_node=inter, topology=topology, ranks_per_node=per_node),
            n, inter, mesh.label(dims)))
        if kind in (ALL_GATHER, ALL_TO_ALL) and leading(loc1, a.dim):
            local(f"cat gathered chunks on tensor dim {a.dim}", i, 2 * after)
        if kind in (REDUCE_SCATTER, ALL_TO_ALL) and leading(loc0, b.dim):
            local(f"reorder chunks of tensor dim {b.dim}", i, 2 * before)
        if len(run) > 1 and any(s[1].is_partial() and s[1].reduce_op == "avg" for s in run):
            local("divide merged avg", i, 2 * after)
    lb = sum(w.bytes for w in work)
    return Cost(tuple(colls), lb, lb / topology.memory_bandwidth, tuple(work), supported)


# ------------------------------------------------ per-mesh-dim lower bound (for search)


@dataclass(frozen=True)
class CostBound:
    """A lower bound on one input's share of a ``Cost``, charged to one mesh dim.

    Fields bound the components of ``Cost.sort_key()`` (plus its support flag): summed
    over the mesh dims of one input, each is <= the exact value of
    ``redistribute_cost`` for the whole placement tuples, and ``unsupported`` OR-ed over
    mesh dims is exact. ``collectives`` can be fractional (a share of a fused one)."""

    unsupported: bool = False
    seconds: float = 0.0
    collectives: float = 0.0
    bytes: float = 0.0


def _fewest_elems(shape: Sequence[int], known: Sequence[tuple[int, int]], free: int) -> float:
    """Fewest elements a rank can hold: ``known`` (tensor dim, mesh size) divisions surely
    apply (ceil, as torch.chunk), and further mesh dims of total size ``free`` may divide
    any dims: the ceil-divided product over ``free`` is at least both of the bounds below."""
    out = list(shape)
    for d, n in known:
        out[d] = -(-out[d] // n)
    if free <= 1:
        return float(math.prod(out))
    return max(math.prod(out) / free, float(math.prod(-(-x // free) for x in out)))


def _fewest_shape(shape: Sequence[int], known: Sequence[tuple[int, int]], free: int) -> list[int]:
    """Per tensor dim, the least a rank can hold (as ``_fewest_elems``, dim by dim)."""
    out = list(shape)
    for d, n in known:
        out[d] = -(-out[d] // n)
    return [-(-x // free) for x in out]


def _shard_of(p: _Pl | None) -> int | None:
    return p.dim if p is not None and p.kind == "S" else None


@lru_cache(maxsize=64)
def _anything(ndim: int) -> tuple[_Pl, ...]:
    return (_REPLICATE, *(_Pl("S", d) for d in range(ndim)))


def _options(p, ndim: int) -> tuple[_Pl, ...]:
    """The placements a target may be: itself, the listed ones, or (None) any."""
    if p is None:
        return _anything(ndim)
    return p if type(p) is tuple else (p,)


@dataclass(frozen=True)
class TargetRow:
    """What the bounds need to know of one mesh dim's target (known, or one of several)
    against its source, worked out once (a search bounds the same targets many times).

    ``shards``: the tensor dims the target may shard; ``ok[d]``: whether it may shard d
    exactly when the source does (DTensor's greedy planner keeps a Shard(d) target of a
    later mesh dim in its last-to-first pass only if that holds on every mesh dim before
    it); ``off[d]``: whether it may differ from the source on sharding d."""

    shards: frozenset
    ok: tuple[bool, ...]
    off: tuple[bool, ...]


def target_row(src: _Pl, target, ndim: int) -> TargetRow:
    """The `TargetRow` of one mesh dim: ``target`` a placement, a tuple of the placements
    it may be, or None (any), all in the model's form."""
    opts = _options(target, ndim)
    dims = frozenset(o.dim for o in opts if o.kind == "S")
    only = next(iter(dims)) if len(dims) == 1 and all(o.kind == "S" for o in opts) else None
    sd = src.dim if src.kind == "S" else None
    ok = tuple((d in dims) if sd == d else only != d for d in range(ndim))
    off = tuple(any((o.kind == "S" and o.dim == d) != (sd == d) for o in opts) for d in range(ndim))
    return TargetRow(dims, ok, off)


def _divisions(ndim: int, src: Sequence[_Pl], m: int, mesh: MeshShape, reverse: bool,
               in_reverse_pass: bool, rows: Sequence[TargetRow]) -> list[tuple[int, int]]:
    """(tensor dim, most it can be divided by) from the other mesh dims when mesh dim m's
    first step runs (no fusion: each step its own collective).

    The greedy planner: with sharded sources, a last-to-first pass moves each mesh dim j
    to its target, or to Replicate when a Shard(d) target's nesting on the dims before j
    differs from the source's; then a first-to-last pass finishes. So when m's step runs
    in the last-to-first pass, dims before m are at their source and dims after m at that
    pass's target; in the first-to-last pass, dims before m are at their target. Among
    the dims after m, two at Shard(d) where the source does not shard d cannot both be
    kept (the first breaks the second's nesting), so of those only the largest counts."""
    div, new = [1] * ndim, [1] * ndim
    aligned = [True] * ndim  # per tensor dim: every mesh dim so far may match the source
    for j, n in enumerate(mesh.sizes):
        if j != m and n > 1:
            if j < m:
                if in_reverse_pass:
                    if src[j].kind == "S":
                        div[src[j].dim] *= n
                else:
                    for d in rows[j].shards:
                        div[d] *= n
            elif not reverse:
                if src[j].kind == "S":  # (never: no sharded source means no shard > 1)
                    div[src[j].dim] *= n
            else:
                sj = src[j].dim if src[j].kind == "S" else None
                for d in rows[j].shards:
                    if aligned[d]:
                        if sj == d:
                            div[d] *= n
                        elif n > new[d]:
                            new[d] = n
        if reverse:
            ok = rows[j].ok
            aligned = [x and y for x, y in zip(aligned, ok)]
    return [(d, div[d] * new[d]) for d in range(ndim) if div[d] * new[d] > 1]


def _fused_known_free(src: Sequence[_Pl], dst: Sequence, m: int, mesh: MeshShape,
                      reverse: bool) -> tuple[list[tuple[int, int]], int]:
    """As `_divisions`, for a mesh dim whose step may be fused with other dims' steps
    (a flattened group holds it): the run's sizes are taken before its first step, so
    each other dim j is at its source, its target, or Replicate in between. One possible
    tensor dim: assume it divided; two, or an unknown target: it may divide any dim."""
    a = src[m]
    known, free = [], 1
    for j, (s, t) in enumerate(zip(src, dst)):
        if j == m or mesh.sizes[j] <= 1:
            continue
        t = t if t is None or not isinstance(t, tuple) else (t[0] if len(t) == 1 else None)
        if a.kind != "R" and (j < m) == reverse:
            opts = {_shard_of(s)}
        elif t is None:
            free *= mesh.sizes[j]
            continue
        elif a.kind != "R" and j < m:  # first-to-last pass: j already at its target
            opts = {_shard_of(t)}
        else:
            opts = {_shard_of(s), _shard_of(t)}
        opts.discard(None)
        if len(opts) == 1:
            known.append((opts.pop(), mesh.sizes[j]))
        elif opts:
            free *= mesh.sizes[j]
    return known, free


# reduce ops whose Partial is the identity of a Replicate in torch: R -> P(x) is free
_FREE_PARTIALS = ("avg", "max", "min")


def _dim_bound(shape: Sequence[int], itemsize: int, src: Sequence[_Pl], dst: Sequence,
               m: int, mesh: MeshShape, topology: Topology, rows: Sequence[TargetRow],
               reverse: bool) -> CostBound:
    """The bound for mesh dim ``m`` (``dst[m]`` known), given what is known of the others:
    ``dst[j]`` a tuple lists the placements mesh dim j may end in, None means any;
    ``rows[j]`` is `target_row` of ``dst[j]``, ``reverse`` whether the source has shards.

    Four cases, each its own piece: from Replicate the first step is local work
    (`_local_work_bound`); from Shard or Partial it is a collective, which a flattened
    group holding m may fuse with other dims' steps (`_fused_share_bound`: a share only)
    or not (`_collective_bound`)."""
    n = mesh.sizes[m]
    a, b = src[m], dst[m]
    if n <= 1 or a == b:
        return CostBound()
    groups = [len(g) for g in mesh.flattened if m in g]
    if groups:
        known, free = _fused_known_free(src, dst, m, mesh, reverse)
        if a.kind == "R":
            return _local_work_bound(shape, itemsize, b, n, [known], free, topology)
        before = _fewest_elems(shape, known + ([(a.dim, n)] if a.kind == "S" else []), free) * itemsize
        return _fused_share_bound(b, n, before, max(groups), topology)
    if a.kind == "R":  # local work, in whichever pass the planner puts it: the least of both
        knowns = [_divisions(len(shape), src, m, mesh, reverse, in_reverse, rows)
                  for in_reverse in _local_work_passes(b, m, rows, reverse)]
        return _local_work_bound(shape, itemsize, b, n, knowns, 1, topology)
    # a collective, in the last-to-first pass when there is one
    known = _divisions(len(shape), src, m, mesh, reverse, reverse, rows)
    return _collective_bound(shape, itemsize, src, dst, m, mesh, topology, known, reverse)


def _local_work_passes(b: _Pl, m: int, rows: Sequence[TargetRow], reverse: bool) -> set[bool]:
    """The greedy planner's passes (True: last-to-first) that may run mesh dim m's step
    from Replicate to ``b``: without sharded sources only the first-to-last one; a
    non-shard target moves in the last-to-first one; Shard(d) in it when every earlier
    dim may keep d's nesting, and in the first-to-last one when some may break it."""
    if not reverse:
        return {False}
    if b.kind != "S":
        return {True}
    misaligned = any(rows[i].off[b.dim] for i in range(m))
    kept = all(rows[i].ok[b.dim] for i in range(m))
    return ({True} if kept else set()) | ({False} if misaligned else set())


def _local_work_bound(shape: Sequence[int], itemsize: int, b: _Pl, n: int,
                      knowns: Sequence[list[tuple[int, int]]], free: int,
                      topology: Topology) -> CostBound:
    """The least local work of a step from Replicate to ``b`` over a mesh dim of size
    ``n``, the other dims dividing the tensor as one of ``knowns`` (plus ``free``, see
    `_fewest_elems`): a slice copies the sliced piece, a division to P(sum) the whole
    piece, R -> P(avg|max|min) is free. No collective, so no count."""
    if not knowns or (b.kind != "S" and b.reduce_op in _FREE_PARTIALS):
        return CostBound()
    extra = [(b.dim, n)] if b.kind == "S" else []
    least = min(_fewest_elems(shape, known + extra, free) for known in knowns) * itemsize
    return CostBound(False, 2 * least / topology.memory_bandwidth, 0.0, 2 * least)


def _fused_share_bound(b: _Pl, n: int, before: float, largest_group: int,
                       topology: Topology) -> CostBound:
    """A collective step a flattened group may fuse with other mesh dims' steps: this dim
    is charged only its share (1 / the largest group holding it) of the launch, of the
    count and of the wire bytes of ``before`` (bytes a rank holds before it), its own
    hops at the lower latency, and no bandwidth term (see `redistribute_lower_bound`)."""
    share = 1.0 / largest_group
    alpha = min(topology.intra_node_latency, topology.inter_node_latency)
    seconds = topology.collective_launch_latency * share + (n - 1) * alpha
    return CostBound(b.is_partial(), seconds, share, (n - 1) / n * before * share)


def _first_collective(a: _Pl, b: _Pl, before: float, n: int) -> tuple[str, float]:
    """(kind, message bytes) of the least the first collective from ``a`` to ``b`` can be:
    an all-gather when the target is not a shard (to Replicate, or via Replicate to a
    Partial), an all-reduce from a Partial to anything but a shard, else an all-to-all /
    reduce-scatter (or worse, via R)."""
    if a.kind == "S" and b.kind != "S":
        return ALL_GATHER, before * n
    if a.kind == "P" and b.kind != "S":
        return ALL_REDUCE, before
    return ALL_TO_ALL, before


def _chunk_copy_bytes(shape: Sequence[int], itemsize: int, known: list[tuple[int, int]],
                      extra: tuple[int, int] | tuple[()], d: int) -> float:
    """Read+write bytes of the chunk-and-cat copy DTensor makes to gather / scatter tensor
    dim ``d`` of the fewest-elements piece, when ``d`` is not outermost there, else 0."""
    lo = _fewest_shape(shape, known + [extra] if extra else known, 1)
    return 2.0 * math.prod(lo) * itemsize if math.prod(lo[:d]) > 1 else 0.0


def _collective_bound(shape: Sequence[int], itemsize: int, src: Sequence[_Pl], dst: Sequence,
                      m: int, mesh: MeshShape, topology: Topology,
                      known: list[tuple[int, int]], reverse: bool) -> CostBound:
    """The least mesh dim m's first step can cost when it is a collective of its own (no
    flattened group holds m): one collective of `_first_collective`'s kind, plus the
    chunk copies around it when surely needed, on the fewest elements ``known`` allows."""
    n = mesh.sizes[m]
    a, b = src[m], dst[m]
    before = _fewest_elems(shape, known + ([(a.dim, n)] if a.kind == "S" else []), 1) * itemsize
    kind, msg = _first_collective(a, b, before, n)
    copies = 0.0  # chunk copies DTensor makes around it, when surely needed
    if (a.kind == "S" and b.kind == "S" and reverse
            and all(isinstance(x, _Pl) for x in dst[:m])):
        # the planner's choice is known: all-to-all, unless the nesting before m differs
        # (or either side is strided): then all-gather first
        if ([_shard_of(x) == b.dim for x in src[:m]] != [_shard_of(x) == b.dim for x in dst[:m]]
                or a.split_factor or b.split_factor):
            kind, msg = ALL_GATHER, before * n
        else:
            copies = (_chunk_copy_bytes(shape, itemsize, known, (b.dim, n), a.dim)
                      + _chunk_copy_bytes(shape, itemsize, known, (a.dim, n), b.dim))
    elif kind == ALL_GATHER:
        copies = _chunk_copy_bytes(shape, itemsize, known, (), a.dim)
    inter, per_node = _layout(mesh.sizes, (m,), topology.devices_per_node)
    seconds = collective_seconds(kind, msg, n, inter_node=inter, topology=topology,
                                 ranks_per_node=per_node)
    return CostBound(b.is_partial(), seconds + copies / topology.memory_bandwidth, 1.0,
                     _RING[kind] * (n - 1) / n * msg + copies)


def redistribute_lower_bound(global_shape: tuple[int, ...], itemsize: int,
                             src: Sequence[Placement],
                             dst: Sequence[Placement | tuple[Placement, ...] | None],
                             mesh: MeshShape | Sequence[int], topology: Topology = H100) -> CostBound:
    """A lower bound on ``redistribute_cost(src -> dst)`` charged to the mesh dims whose
    target is known (``dst[m]`` a placement); the others end in one of the placements
    listed (``dst[m]`` a tuple) or anywhere (None). Bounds of the unknown dims taken one
    at a time (the others as unknown) add to it admissibly.

    Why it is a bound (``redistribute_cost`` is not a sum over mesh dims: step order,
    fusion and the other dims' sharding all change the price): the greedy plan gives every
    mesh dim whose placement changes (size > 1) at least one step, and the first one
    starts from ``src``. From Replicate that step is local work (a slice or a division);
    from Shard or Partial it is one collective of at least one ring pass, (n-1) hops and
    its kind's share of a message, the kind being forced by the target (see
    ``_dim_bound``). Sizes are the fewest elements a rank can hold at that moment, from
    where the planner has put the other mesh dims by then (``_divisions``; a dim whose
    target is not known divides by its size every tensor dim it may shard). Different mesh dims' first steps are different
    steps, so the bounds add up, except where DTensor fuses one collective over a
    flattened group: there each dim is charged only its share (1/group size) of the
    launch, of the count and of its wire bytes (a fused reduce-scatter puts only (N-1)/N
    of its input on the wire, less than the sum of the dims' (n_i-1)/n_i), its own hops
    (N-1 >= sum of (n_i - 1)) and no bandwidth term. Rejected conversions (to a Partial
    from anything but Replicate or itself) are flagged exactly: nothing else in the plan
    sets the flag. tests/test_cost.py checks all of this against the exact model."""
    mesh = mesh if isinstance(mesh, MeshShape) else MeshShape(tuple(mesh))
    ndim = len(global_shape)
    src = [_normalize(p, ndim) for p in src]
    dst = [None if p is None else tuple(_normalize(q, ndim) for q in p) if isinstance(p, tuple)
           else _normalize(p, ndim) for p in dst]
    if len(src) != mesh.ndim or len(dst) != mesh.ndim:
        raise ValueError(f"need {mesh.ndim} placements, got {len(src)} and {len(dst)}")
    return lower_bound_model(global_shape, itemsize, src, dst, mesh, topology)


def lower_bound_model(global_shape: tuple[int, ...], itemsize: int, src: Sequence[_Pl],
                      dst: Sequence[_Pl | tuple[_Pl, ...] | None], mesh: MeshShape,
                      topology: Topology = H100,
                      rows: Sequence[TargetRow] | None = None) -> CostBound:
    """``redistribute_lower_bound`` for placements already in the model's form
    (``model_placement``), unchecked: for searches that bound many placement tuples, and
    may pass each mesh dim's `target_row` (``rows``), kept from call to call."""
    unsupported, seconds, colls, nbytes = False, 0.0, 0.0, 0.0
    reverse = None
    for m in range(mesh.ndim):
        if type(dst[m]) is _Pl and dst[m] != src[m] and mesh.sizes[m] > 1:
            if reverse is None:
                reverse = any(p.kind == "S" and k > 1 for p, k in zip(src, mesh.sizes))
                if rows is None:
                    rows = [target_row(a, t, len(global_shape)) for a, t in zip(src, dst)]
            b = _dim_bound(global_shape, itemsize, src, dst, m, mesh, topology, rows, reverse)
            unsupported = unsupported or b.unsupported
            seconds, colls, nbytes = seconds + b.seconds, colls + b.collectives, nbytes + b.bytes
    return CostBound(unsupported, seconds, colls, nbytes)


# ---------------------------------------------------------------- DTensor's own estimates
#
# Every decision decompshard makes is priced here. Two kinds of number leave this module:
# `Cost` (this model: what decompshard itself compares), and DTensor's own estimates,
# for a number that goes into DTensor's own comparison among its strategies (the
# steering's surcharges, the uneven views' candidates): DTensor picks the least of its
# `redistribute_cost` matrix, so a term added there must be in DTensor's unit. They are
# reached through these two names only, never beside `redistribute_cost` above.


def dtensor_redistribute_cost(current_spec: Any, target_spec: Any) -> float:
    """DTensor's own estimate of one redistribution, in its unit (torch's cost model)."""
    return _torch_redistribute_cost(current_spec, target_spec)


def dtensor_collective_cost_model() -> Any:
    """DTensor's own per-collective pricing, in its unit (`_compat.collective_cost_model`)."""
    return _torch_collective_cost_model()
