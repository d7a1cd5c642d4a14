"""Steering: DTensor's choice among a native op's strategies, with the moves it underprices
priced at what they lead to.

DTensor picks each op's strategy greedily by the cost of moving its inputs (torch's cost
model), and prices some moves below what they cost later:

* Replicate -> Partial at 0: `add(residual R, block output P)` keeps the residual stream
  Partial, and every consumer that needs it whole reduces it again;
* Partial -> Shard at a reduce-scatter: after a row-parallel layer the model goes on data
  parallel over both mesh dims, and every matmul after it gathers again;
* a strategy that keeps a Partial input Partial while another input moves hands on a
  Partial that each reader all-reduces (a backward gradient summed from Partials);
* a weight gradient that keeps a matmul node's Partial gradient Partial (gathering its
  input beside) where the node's input gradient reduces it next anyway (`node_reads`);
* `_StridedShard` -> Shard at 0, though DTensor all-gathers it first;
* a gather shrunk by chunking a replicated mesh dim, which the next reader gathers again.

While `enable()` is on, where DTensor prices candidates and where it chooses among them
(`_compat.strategy_cost_slots`, `_compat.strategy_selection_slot`), each such move costs
what it defers: (1 + MARGIN) all-reduces of the tensor (`surcharge`, `kept_partial_price`,
`strided_partial_price`, `shared_reduction_price`), an all-gather for a strided move (`strided_floor`), (1 + MARGIN)
all-gathers for a chunked one (`chunked_gather_price`). Reducing where the Partial is made
(Megatron's plan) then wins the tie. Only the choice changes; what a strategy computes and
the redistributions DTensor then plans are DTensor's own. Decision rules:

* Replicate -> Partial is surcharged on meshes of two dims or more, and on a 1-D mesh in
  forward only: in backward, deferring lets a sum of Partial gradients reduce once;
* a kept Partial owes only where what it hands on is at least as large as what it keeps
  (larger, for an elementwise op): a weight gradient from a Partial activation is smaller,
  and deferring it wins (it is reduced once, to the parameter's placement);
* every rank decides alike. DTensor caches the choice per op schema, so an op met first
  in forward keeps its forward choice in backward.

Bytes saved: docs/results.md. Tests: tests/test_partial_pricing.py, test_strided_blocks.py.
"""

from __future__ import annotations

import copy
import functools
import math
from typing import Any, Callable, Iterator

from decompshard._compat import (TorchStridedShard, in_backward, strategy_cost_slots,
                                 strategy_selection_slot)
from decompshard.runtime.steering.node_reads import shared_move
from decompshard.runtime.steering.reduce_once import reduced_dims
from decompshard.runtime.table_patches import Entry, WarnOnce
from decompshard.mesh.cost import dtensor_collective_cost_model

__all__ = ["MARGIN", "entries", "kept_partial_price", "shared_reduction_price", "strided_floor", "strided_partial_price",
           "surcharge"]

MARGIN = 0.01  # over an all-reduce: reducing where the Partial is made wins the tie


def _plain(x: Any) -> bool:
    return isinstance(x, (int, float)) and not math.isinf(x)  # SymFloat costs: torch's alone


def surcharge(cur: Any, tgt: Any, mesh_topo: Any, mesh_dim: int, comm_bytes_gb: float) -> float:
    """What one move on one mesh dim costs above torch's price: a Partial -> Shard, and
    a Replicate -> Partial on a mesh of two dims or more or in a forward pass, at (1 + MARGIN)
    all-reduces of the tensor as it is on that mesh dim (`comm_bytes_gb`: its bytes
    there, in GiB, as torch counts them)."""
    if not _plain(comm_bytes_gb):
        return 0.0
    deferred = cur.is_replicate() and tgt.is_partial() and (len(mesh_topo.mesh_dim_devices) > 1
                                                            or not in_backward())
    scattered = cur.is_partial() and tgt.is_shard()
    if not (deferred or scattered):
        return 0.0
    m = dtensor_collective_cost_model()
    target = (1 + MARGIN) * m.allreduce_cost(comm_bytes_gb, mesh_topo, mesh_dim)
    paid = m.reduce_scatter_cost(comm_bytes_gb, mesh_topo, mesh_dim) if scattered else 0.0
    return max(0.0, target - paid)


def strided_floor(cur: Any, tgt: Any, mesh_topo: Any, mesh_dim: int, comm_bytes_gb: float) -> float:
    """The least a move of one mesh dim from a `_StridedShard` costs: an all-gather of the
    tensor as it is there (`comm_bytes_gb`), DTensor's first step to any other placement.
    Torch prices a block spec's `_StridedShard` -> `Shard` move (the layout `strided_blocks`
    hands on) at 0, so DTensor chose to gather a packed weight rather than its input."""
    if type(cur) is not TorchStridedShard or cur == tgt or not _plain(comm_bytes_gb):
        return 0.0
    return dtensor_collective_cost_model().allgather_cost(comm_bytes_gb, mesh_topo, mesh_dim)


def _step_cost(original: Callable) -> Callable:
    """`_compute_placement_transition_cost` no less than `strided_floor`, with the surcharge."""

    @functools.wraps(original)
    def step(cur: Any, tgt: Any, mesh_topo: Any, mesh_dim: int, comm_bytes_gb: float) -> tuple[Any, Any]:
        cost, after = original(cur, tgt, mesh_topo, mesh_dim, comm_bytes_gb)
        if _plain(cost):
            cost = max(cost, strided_floor(cur, tgt, mesh_topo, mesh_dim, comm_bytes_gb))
            cost = cost + surcharge(cur, tgt, mesh_topo, mesh_dim, comm_bytes_gb)
        return cost, after

    return step


def _spec_cost(original: Callable) -> Callable:
    """`redistribute_cost(current_spec, target_spec)` no less than `strided_floor`'s and with
    the surcharge of each mesh dim's move, at the current spec's local bytes (torch's starting size; its own steps
    shrink it after a reduce-scatter, a difference of at most one collective's price)."""

    @functools.wraps(original)
    def spec_cost(current: Any, target: Any) -> Any:
        cost = original(current, target)
        if not _plain(cost) or current.mesh != target.mesh or current.tensor_meta is None:
            return cost
        m = dtensor_collective_cost_model()
        gb = m.spec_to_bytes(current) / current.num_shards / 1024**3
        topo = m.MeshTopoInfo.build_from_mesh(current.mesh)
        pairs = list(enumerate(zip(current.placements, target.placements)))
        cost = max(cost, sum(strided_floor(c, t, topo, i, gb) for i, (c, t) in pairs))
        return cost + sum(surcharge(c, t, topo, i, gb) for i, (c, t) in pairs)

    return spec_cost


def _communicates(cur: Any, tgt: Any) -> bool:
    """Whether moving one mesh dim from `cur` to `tgt` is a collective (from a Replicate
    it is a local chunk or division)."""
    return cur != tgt and not cur.is_replicate()


def _local_gb(spec: Any) -> Any:
    """The bytes one rank holds of `spec`, in GiB (None without a tensor meta)."""
    if spec is None or getattr(spec, "tensor_meta", None) is None:
        return None
    return dtensor_collective_cost_model().spec_to_bytes(spec) / spec.num_shards / 1024**3


def _outputs(spec: Any) -> tuple:
    """A strategy's output specs as a tuple (one output spec is not wrapped)."""
    return spec.output_specs if isinstance(spec.output_specs, tuple) else (spec.output_specs,)


def _owed_reductions(outs: tuple, dim: int, topo: Any, owes: Callable[[float], bool]) -> float:
    """(1 + MARGIN) all-reduces on mesh dim `dim` of each output handed on Partial there
    whose local size in GiB `owes` accepts (outputs without sizes owe nothing)."""
    m = dtensor_collective_cost_model()
    owed = 0.0
    for out in outs:
        gb = _local_gb(out) if out is not None and out.placements[dim].is_partial() else None
        if _plain(gb) and owes(gb):
            owed += (1 + MARGIN) * m.allreduce_cost(gb, topo, dim)
    return owed


def _kept_on_dim(current: list, inputs: list, moved: list[int], outs: tuple, dim: int, topo: Any) -> float | None:
    """`kept_partial_price` on one mesh dim: the reduction of each output handed on
    Partial there, where an input kept Partial there no larger; 0 where no input is kept
    Partial on `dim` or none of the others moves; None without sizes."""
    pairs = [(c.placements[dim], t.placements[dim]) for c, t in zip(current, inputs)]
    kept = [i for i, (c, t) in enumerate(pairs) if c.is_partial() and t.is_partial()]
    if not kept or not any(j not in kept for j in moved):
        return 0.0
    kept_gb = [_local_gb(current[i]) for i in kept]
    if not all(_plain(gb) for gb in kept_gb):
        return None  # no tensor meta, or symbolic sizes: torch's price alone
    # an elementwise op (every moved input shaped like a kept one) hands on the same
    # reduction it keeps: deferring it there is torch's call (docs/results.md: Llama dp-uneven)
    kept_shapes = {tuple(current[i].shape) for i in kept}
    elementwise = all(tuple(current[j].shape) in kept_shapes for j in moved if j not in kept)
    least = min(kept_gb)
    return _owed_reductions(outs, dim, topo, lambda gb: gb > least or (gb == least and not elementwise))


def kept_partial_price(current: list, spec: Any) -> float:
    """What strategy `spec` owes beyond its input moves, given the inputs' `current`
    specs: on each mesh dim where it keeps a Partial input Partial while another input is
    moved by a collective (on any mesh dim), (1 + MARGIN) all-reduces on that dim of each
    output it hands on Partial there that is at least as large as the kept input (larger,
    for an elementwise op): the reduction it defers is no smaller than the one it avoids,
    and the move is paid on top. A weight gradient made from a Partial activation is
    smaller: deferring it wins (it is reduced once, to the parameter). 0 where nothing
    applies."""
    inputs = spec.input_specs
    if inputs is None or len(inputs) != len(current) or not current:
        return 0.0
    moved = [j for j, (c, t) in enumerate(zip(current, inputs))
             if any(_communicates(a, b) for a, b in zip(c.placements, t.placements))]
    outs, topo = _outputs(spec), dtensor_collective_cost_model().MeshTopoInfo.build_from_mesh(current[0].mesh)
    owed = 0.0
    for dim in range(current[0].mesh.ndim):
        on_dim = _kept_on_dim(current, inputs, moved, outs, dim, topo)
        if on_dim is None:
            return 0.0
        owed += on_dim
    return owed


def strided_partial_price(current: list, spec: Any) -> float:
    """What strategy `spec` owes for a Partial it makes from blocks it keeps: on each mesh
    dim where an input stays `_StridedShard` (a packed weight contracted in its blocks)
    and an output is Partial, (1 + MARGIN) all-reduces of that output there, the
    reduction it hands on. Gathering the blocks instead is priced by `strided_floor`, so
    the two compare as `strided_blocks`' mm override compares them (a [40, 8] @ [8, 20]
    product reduced later moves more than the [8, 20] weight gathered now)."""
    inputs = spec.input_specs
    if inputs is None or len(inputs) != len(current) or not current:
        return 0.0
    outs, topo = _outputs(spec), dtensor_collective_cost_model().MeshTopoInfo.build_from_mesh(current[0].mesh)
    return sum(_owed_reductions(outs, dim, topo, lambda gb: True) for dim in range(current[0].mesh.ndim)
               if any(type(c.placements[dim]) is TorchStridedShard and t.placements[dim] == c.placements[dim]
                      for c, t in zip(current, inputs)))


def chunked_gather_price(current: list, spec: Any) -> float:
    """What strategy `spec` owes for chunking an input on a mesh dim where it is
    Replicate while gathering it on another: (1 + MARGIN) all-gathers of the moved input
    on each chunked dim. DTensor shrinks a gather that way (`(S(0), R) -> (R, S(1))`
    moves half the bytes of `(R, R)`) and hands the chunk on; the next op that needs the
    rows whole on that dim, the column-parallel matmul after an MoE's token routing,
    gathers them again, forward and backward, once per reader (Mixtral 2d: each expert's
    tokens gathered in halves, then the halves gathered by five matmuls). Charged only beside a gather: chunking a replicated input alone is
    how a strategy shards work, and costs nothing to undo that it did not save."""
    inputs = spec.input_specs
    if inputs is None or len(inputs) != len(current) or not current:
        return 0.0
    m = dtensor_collective_cost_model()
    topo = m.MeshTopoInfo.build_from_mesh(current[0].mesh)
    owed = 0.0
    for c, t in zip(current, inputs):
        pairs = list(zip(c.placements, t.placements))
        if not any(a.is_shard() and b.is_replicate() for a, b in pairs):
            continue
        gb = _local_gb(t)
        if not _plain(gb):
            continue
        for dim, (a, b) in enumerate(pairs):
            if a.is_replicate() and b.is_shard():
                owed += (1 + MARGIN) * m.allgather_cost(gb, topo, dim)
    return owed


def shared_reduction_price(current: list, spec: Any, shared: tuple[int, Any] | None) -> float:
    """What strategy `spec` owes where the op's gradient argument is reduced anyway by the
    next op of its backward node (`node_reads.shared_move`: `(index, target spec)`): a
    candidate that moves that argument to the target shares the reduction (`reduce_once`
    reuses it) and owes nothing; any other keeps a Partial whose reduction it does not
    save, and owes it: (1 + MARGIN) all-reduces of the argument on each mesh dim the
    target reduces (a row-parallel weight gradient gathering its input beside it pays
    the gather for nothing). 0 where nothing is shared."""
    if shared is None or spec.input_specs is None or len(spec.input_specs) != len(current):
        return 0.0
    index, target = shared
    if tuple(spec.input_specs[index].placements) == tuple(target.placements):
        return 0.0
    gb, dims = _local_gb(current[index]), reduced_dims(current[index], target)
    if not _plain(gb) or dims is None:
        return 0.0
    m = dtensor_collective_cost_model()
    topo = m.MeshTopoInfo.build_from_mesh(current[index].mesh)
    return sum((1 + MARGIN) * m.allreduce_cost(gb, topo, dim) for dim, _ in dims)


def _select(original: Callable) -> Callable:
    """`_select_min_cost_strategy(strategy, op_schema)` choosing with what each candidate
    owes beyond its input moves added to its cost (`kept_partial_price`,
    `strided_partial_price`, `chunked_gather_price`, `shared_reduction_price`); the
    candidate returned is DTensor's own object."""

    @functools.wraps(original)
    def select(strategy: Any, op_schema: Any = None) -> Any:
        if op_schema is None or len(strategy.strategies) < 2:
            return original(strategy, op_schema)
        current, shared = list(op_schema.args_spec), shared_move(op_schema)
        owed = [kept_partial_price(current, s) + strided_partial_price(current, s) + chunked_gather_price(current, s)
                + shared_reduction_price(current, s, shared) for s in strategy.strategies]
        if not any(owed):
            return original(strategy, op_schema)
        priced = []
        for s, extra in zip(strategy.strategies, owed):
            c = copy.copy(s)
            if extra and s.redistribute_cost is not None:
                c.redistribute_cost = [*s.redistribute_cost, [extra]]
            priced.append(c)
        chosen = original(type(strategy)(priced), op_schema)
        return strategy.strategies[next(i for i, c in enumerate(priced) if c is chosen)]

    return select


def entries(warn: WarnOnce) -> Iterator[Entry]:
    """What `enable()` puts where: each slot where DTensor prices candidate strategies
    (`_compat.strategy_cost_slots`) and the one where it chooses among them
    (`_compat.strategy_selection_slot`), wrapped."""
    wrap = {"spec": _spec_cost, "step": _step_cost}
    for module, attribute, kind in strategy_cost_slots():
        yield module, attribute, wrap[kind](vars(module)[attribute])
    slot = strategy_selection_slot()
    if slot is not None:
        module, attribute = slot
        yield module, attribute, _select(vars(module)[attribute])
