"""Derived strategies under torch.compile's symbolic shapes (issue 37, item 1).

With `dynamic=True`, `mark_dynamic` or a second sequence length, DTensor asks for a
strategy with SymInt sizes, and one compiled graph serves every size its guards admit.
decompshard derives at the SymInts' hints and keeps a strategy only where it holds at
every size (runtime/symbolic_sizes.py): what static shapes derive, symbolic shapes
derive, without a collective static shapes would not run.

On the simulated (fake) group rank 0's numbers are real where no collective runs, so a
graph with no collective is checked against one device on rank 0's rows; the graphs'
collectives are counted from the AOT forward graphs (a recording backend).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

import decompshard
from decompshard._compat import TORCH_VERSION
from decompshard.verify.dtensor_case import device_mesh

pytestmark = pytest.mark.usefixtures("world")

S0, R = Shard(0), Replicate()


class Recorder:
    """An aot_eager backend that keeps each forward graph, to count its collectives."""

    def __init__(self):
        self.graphs = []

    def backend(self):
        from decompshard._compat import aot_eager_seeing

        return aot_eager_seeing(lambda kind, gm: self.graphs.append(gm) if kind == "forward" else None)

    def collectives(self) -> list[str]:
        return [str(n.target) for g in self.graphs for n in g.graph.nodes
                if "c10d" in str(n.target) and "wait_tensor" not in str(n.target)]


def _rank0(t: torch.Tensor, mesh, placement) -> DTensor:
    """Rank 0's piece of `t` as a DTensor of `t`'s global shape (`torch.chunk` layout)."""
    local = t if placement == R else t.tensor_split(mesh.size(), placement.dim)[0].clone()
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=t.shape, stride=t.stride())


def _compiled_calls(fn, sizes, make_args, backend, mark_dim=None):
    """Call one compiled `fn` at each size; (outputs, decompshard's warnings). Every size
    symbolic (`dynamic=True`), or with `mark_dim` only that dim of each input
    (`mark_dynamic`)."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend, dynamic=True if mark_dim is None else None, fullgraph=True)
    outs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in sizes:
            args = make_args(n)
            for a in args if mark_dim is not None else ():
                torch._dynamo.mark_dynamic(a, mark_dim)
            outs.append(compiled(*args))
    return outs, [str(w.message) for w in caught if "decompshard" in str(w.message)]


def _addmv(b, m, v):
    return torch.addmv(b, m, v) * 2


def _addmv_args(mesh):
    def make(n):
        g = torch.Generator().manual_seed(n)
        b, m, v = torch.randn(n, generator=g), torch.randn(n, 12, generator=g), torch.randn(12, generator=g)
        return _rank0(b, mesh, S0), _rank0(m, mesh, S0), _rank0(v, mesh, R)
    return make


def test_addmv_on_shard0_keeps_its_sharding_with_no_collective_at_every_size():
    # addmv has no DTensor strategy; static shapes derive S(0) with no collective. Under
    # dynamic=True it ran replicated (4 all-gathers). 16 rows split evenly on 4 ranks,
    # 10 and 7 do not; one graph serves all three.
    mesh = device_mesh((4,))
    rec = Recorder()
    make = _addmv_args(mesh)
    with decompshard.enabled():
        outs, warned = _compiled_calls(_addmv, (16, 10, 7), make, rec.backend())
    assert warned == []
    assert len(rec.graphs) == 1 and rec.collectives() == []
    for n, out in zip((16, 10, 7), outs):
        g = torch.Generator().manual_seed(n)  # one device: the whole inputs, from the seed
        full = torch.randn(n, generator=g), torch.randn(n, 12, generator=g), torch.randn(12, generator=g)
        assert out.placements == (S0,) and out.shape == (n,)
        torch.testing.assert_close(out.to_local(), _addmv(*full).tensor_split(4)[0])


def test_addmv_on_shard0_under_inductor():
    mesh = device_mesh((4,))
    make = _addmv_args(mesh)
    with decompshard.enabled():
        outs, warned = _compiled_calls(_addmv, (16, 10), make, "inductor")
    assert warned == []
    for n, out in zip((16, 10), outs):
        g = torch.Generator().manual_seed(n)
        full = torch.randn(n, generator=g), torch.randn(n, 12, generator=g), torch.randn(12, generator=g)
        assert out.placements == (S0,)
        torch.testing.assert_close(out.to_local(), _addmv(*full).tensor_split(4)[0])


def _slices(x):
    # transformers' causal-LM head takes `hidden_states[:, 0:, :]`; its loss shifts by one
    return x[:, 0:, :] * 2, x[:, :-1] + 1


def test_a_slice_to_the_end_keeps_the_batch_shard_under_symbolic_sizes():
    # torch writes "to the end" as int64's largest; DTensor cannot prove it past a symbolic
    # size and all-gathers the batch for the dim-0 part of the slice (torch alone, 2.13 to
    # 2.15). With enable(): one graph for both sizes, no collective, rank 0's rows right
    # (runtime/support/symbolic_slices.py)
    mesh = device_mesh((4,))

    def make(n):
        return (_rank0(torch.randn(n, 6, 8, generator=torch.Generator().manual_seed(n)), mesh, S0),)

    alone = Recorder()
    _compiled_calls(_slices, (16, 10), make, alone.backend())
    assert alone.collectives() and all("all_gather" in c for c in alone.collectives())
    rec = Recorder()
    with decompshard.enabled():
        outs, _ = _compiled_calls(_slices, (16, 10), make, rec.backend())
    assert len(rec.graphs) == 1 and rec.collectives() == []
    for n, (a, b) in zip((16, 10), outs):
        full = torch.randn(n, 6, 8, generator=torch.Generator().manual_seed(n))
        assert a.placements == b.placements == (S0,)
        torch.testing.assert_close(a.to_local(), (full * 2).tensor_split(4)[0])
        torch.testing.assert_close(b.to_local(), (full[:, :-1] + 1).tensor_split(4)[0])


def test_the_backward_of_a_slice_to_the_end_keeps_the_batch_shard():
    # slice_backward's strategy never keeps the sliced dim's shard; a whole slice's
    # backward is its gradient, so with enable() it passes through (either strategy table)
    from decompshard._compat import aot_eager_seeing
    from decompshard.check.loop import graph_collectives

    mesh = device_mesh((4,))
    graphs = []
    with decompshard.enabled():
        torch._dynamo.reset()
        f = torch.compile(lambda x: x[:, :-1] * 2, dynamic=True,
                          backend=aot_eager_seeing(lambda kind, gm: graphs.append(graph_collectives(kind, gm))))
        for n in (16, 10):
            full = torch.randn(n, 6, generator=torch.Generator().manual_seed(n))
            x = _rank0(full, mesh, S0).requires_grad_()
            y = f(x)
            y.backward(_rank0(torch.ones(n, 5), mesh, S0))
            expected = torch.zeros(n, 6)
            expected[:, :-1] = 2
            assert y.placements == x.grad.placements == (S0,)
            torch.testing.assert_close(x.grad.to_local(), expected.tensor_split(4)[0])
    assert set(graphs) == {"forward: none", "backward: none"}, graphs


@pytest.mark.parametrize("mesh_shape,placements", [
    ((4,), [S0]), ((4,), [Partial()]), ((4,), [Shard(1)]),
    ((2, 2), [S0, Partial()]), ((2, 2), [Shard(1), S0]), ((2, 2), [R, S0]), ((2, 2), [Partial(), Shard(1)]),
])
def test_a_whole_slices_backward_run_directly_matches_one_device(mesh_shape, placements):
    # the pass-through strategy on real DTensors (simulated ranks, 7 rows: uneven on 4 and
    # 2), the sliced dim sharded or not, Partial gradients with random parts: the full
    # tensor is the one-device result, at each dim sliced
    import sys

    from decompshard.verify.dtensor_case import make_dtensor, simulation

    # float64, as the project's Partial checks: make_dtensor's random parts are large
    full = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    mesh = device_mesh(mesh_shape)
    for dim in (0, 1):
        want = torch.ops.aten.slice_backward(full, [7, 5], dim, 0, sys.maxsize, 1)
        with decompshard.enabled(), simulation(mesh.size()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            grad = make_dtensor(full, mesh, placements, seed=1, salt=dim)
            got = torch.ops.aten.slice_backward(grad, [7, 5], dim, 0, sys.maxsize, 1)
            assert got.placements == tuple(placements)  # nothing moved: the gradient passed through
            torch.testing.assert_close(got.full_tensor(), want)


def test_an_end_short_of_int64s_largest_reaches_dtensor_unchanged():
    import sys

    from decompshard.runtime.support.symbolic_slices import to_the_end, whole_slice_dim

    assert to_the_end(("x", 1, 0, sys.maxsize)) == ("x", 1, 0, None)
    assert to_the_end(("x", 1, 0, sys.maxsize, 2)) == ("x", 1, 0, None, 2)
    assert to_the_end(("x", 1, 0, sys.maxsize - 1)) == ("x", 1, 0, sys.maxsize - 1)
    assert to_the_end(("x", 1, 2)) == ("x", 1, 2)
    g = torch.empty(4, 5)
    assert whole_slice_dim((g, [4, 6], -1, 0, sys.maxsize, 1)) == 1
    assert whole_slice_dim((g, [4, 6], 1, 1, sys.maxsize, 1)) is None  # x[:, 1:]: not whole
    assert whole_slice_dim((g, [4, 6], 1, 0, 5, 1)) is None


def _first_column_less_one(x):
    # transformers' packed-sequence mask: `position_ids[:, :1] - 1`
    return x[:, :1] - 1


def test_a_static_shape_with_a_symbolic_stride_runs_where_dtensor_raised():
    # x[:, :1] of a DTensor whose dim 1 is symbolic: shape [b, 1] static, stride (s, 1)
    # symbolic. DTensor's dispatch cache hashes the spec (it checks the shape only for
    # symbols) and raises; Python reports the TypeError as "unsupported operand"
    # (torch alone, 2.13 to 2.15). With enable(): one graph for both lengths, no
    # collective, rank 0's rows right (runtime/support/symbolic_strides.py)
    mesh = device_mesh((4,))

    def full(n):
        return torch.arange(8 * n).reshape(8, n)

    def make(n):
        return (_rank0(full(n), mesh, S0),)

    with pytest.raises(Exception, match="unhashable type: non-nested SymInt|unsupported operand"):
        _compiled_calls(_first_column_less_one, (6,), make, Recorder().backend(), mark_dim=1)
    rec = Recorder()
    with decompshard.enabled():
        outs, _ = _compiled_calls(_first_column_less_one, (6, 9), make, rec.backend(), mark_dim=1)
    assert len(rec.graphs) == 1 and rec.collectives() == []
    for n, out in zip((6, 9), outs):
        assert out.placements == (S0,)
        torch.testing.assert_close(out.to_local(), (full(n)[:, :1] - 1).tensor_split(4)[0])


def test_dtensors_own_hash_is_kept_wherever_it_can_hash_and_restored_after():
    from decompshard._compat import DTensorSpec

    mesh = device_mesh((4,))
    spec = _rank0(torch.randn(8, 3), mesh, S0)._spec
    before, dtensor_hash = hash(spec), DTensorSpec.__dict__["__hash__"]
    with decompshard.enabled():
        assert DTensorSpec.__dict__["__hash__"] is not dtensor_hash
        spec._hash = None  # recomputed under enable()
        assert hash(spec) == before
    assert DTensorSpec.__dict__["__hash__"] is dtensor_hash


def test_a_symbols_first_proxy_is_kept_where_torch_wrote_the_latest_over_it():
    # torch's set_proxy_slot writes each bare-symbol SymInt into the tracer's symbol
    # table over the entry before it; the wrapper puts the first back (and leaves
    # tensors, tracers without the table and new symbols as torch has them)
    from types import SimpleNamespace

    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from decompshard._compat import first_symbol_proxy_kept

    env = ShapeEnv()
    s = env.create_unbacked_symint()
    twin = s + 0  # another SymInt object of the same expression

    def torchs(obj, tracer, proxy):  # what torch does to the table: the latest wins
        if isinstance(obj, torch.SymInt):
            tracer.sympy_expr_tracker[obj.node.expr] = proxy

    tracer = SimpleNamespace(sympy_expr_tracker={})
    kept = first_symbol_proxy_kept(torchs)
    kept(s, tracer, "input's")
    kept(twin, tracer, "derived")
    assert tracer.sympy_expr_tracker == {s.node.expr: "input's"}
    other = env.create_unbacked_symint()
    kept(other, tracer, "other's")
    assert tracer.sympy_expr_tracker[other.node.expr] == "other's"
    seen = []
    first_symbol_proxy_kept(lambda *a: seen.append(a))(s, SimpleNamespace(), "p")
    assert len(seen) == 1


def test_an_n_ary_product_is_rebuilt_from_two_argument_nodes():
    # torch 2.13/2.14 rebuild an unseen `4*s0*s1` as one operator.mul node of three
    # arguments, which computes 4*s0 (the dynamic Llama's flattened rows on 2.14.1: "shape
    # '[2, 32]' is invalid for input of size 384"); the builder is handed `4*(s0*s1)`.
    # 2.13 cannot rebuild a power at all ("s72**2 is not tracked with proxy")
    import sympy

    from decompshard._compat import binary_sym_exprs

    seen = []
    build = binary_sym_exprs(lambda tracer, expr, out=None: seen.append(expr) or expr)
    s0, s1, s2 = sympy.symbols("s0 s1 s2", positive=True, integer=True)
    for expr in (4 * s0 * s1, s0 + s1 + s2 + 1, 4 * s0, s0, s0**3):
        got = build(None, expr)
        assert len(got.args) <= 2 and sympy.expand(got - expr) == 0, got
    assert [len(e.args) for e in seen] == [2, 2, 2, 0, 2]
    assert isinstance(seen[-1], sympy.Mul)  # 2.13 has no handler for a power: s0 * s0**2


def _outer_sum(x):
    return (x[:, :, None] * x[:, None, :]).sum()


def test_a_stride_holding_a_size_squared_compiles():
    # `[3, s, s]`'s stride s**2 on a DTensor: torch 2.13 cannot rebuild a power in AOT
    # autograd's trace ("s**2 is not tracked with proxy", torch alone; 2.14 can); with
    # enable() it is built as s * s on every release
    mesh = device_mesh((4,))

    def make(n):
        return (_rank0(torch.randn(3, n, generator=torch.Generator().manual_seed(n)), mesh, R),)

    if TORCH_VERSION < (2, 14):
        with pytest.raises(Exception, match="not tracked with proxy"):
            _compiled_calls(_outer_sum, (5,), make, "aot_eager")
    with decompshard.enabled():
        outs, _ = _compiled_calls(_outer_sum, (5, 7), make, "aot_eager")
    for n, out in zip((5, 7), outs):
        torch.testing.assert_close(out.full_tensor(), _outer_sum(make(n)[0].to_local()))


def test_max_and_min_are_rebuilt_as_operators_inductor_lowers():
    # torch rebuilds an unseen Max/Min with its own n-ary wrappers, functions inductor cannot
    # lower ("_nary_sym_max is not an OpOverload": the tensor-parallel Llama under
    # dynamic=True and inductor, torch alone too); under enable() torch.sym_max/sym_min,
    # an n-ary one folded into two-argument ones; torch's put back after
    import sympy
    from torch._inductor.lowering import lowerings
    from torch.fx.experimental import proxy_tensor

    from decompshard._compat import binary_sym_exprs, sym_max_min_entries

    table = proxy_tensor._sympy_handlers()
    keys = {key for _, key, _ in sym_max_min_entries()}
    before = {k: table[k] for k in keys}
    assert keys and not any(f in lowerings for f in before.values())
    with decompshard.enabled():
        assert {table[k] for k in keys} == {torch.sym_max, torch.sym_min}
        assert all(table[k] in lowerings for k in keys)
    assert {k: table[k] for k in keys} == before
    seen = []
    build = binary_sym_exprs(lambda tracer, expr, out=None: seen.append(expr) or expr, folded=tuple(keys))
    a, b, c = sympy.symbols("a b c", positive=True, integer=True)
    got = build(None, sympy.Max(a, b, c))
    assert len(got.args) == 2 and got.subs({a: 1, b: 5, c: 3}) == 5


def test_the_weight_gradient_steering_compares_sizes_without_a_guard():
    # node_reads matched the node's shapes with `==`: a size `8*s` against 64 put
    # `Eq(8*s, 64)` on the graph, specializing the sequence length (mark_dynamic then
    # raised ConstraintViolationError). Sizes are compared as expressions
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from decompshard._compat import same_sizes  # what node_reads compares shapes with

    env = ShapeEnv()
    s = env.create_symintnode(env.create_symbol(8, ConstantSource("s")), hint=8)
    assert not same_sizes((8 * s, 3), (64, 3)) and same_sizes((8 * s, 3), (s * 8, 3)) and same_sizes((2, 3), (2, 3))
    assert len(env.guards) == 0
    assert (8 * s, 3) == (64, 3) and len(env.guards) == 1  # what `==` does


def test_llama_data_parallel_with_a_dynamic_sequence_compiles_forward_and_backward():
    # mark_dynamic on the sequence dim: torch alone raises at transformers' mask
    # (`position_ids[:, :1] - 1`, symbolic_strides.py), and past it AOT autograd's trace
    # recursed without end (symbol_proxies.py). With enable(): the forward and backward
    # graphs compile with the static compile's collectives (forward: the mask's two
    # all-gathers and the loss's all-reduce; backward: none). Numbers need real ranks:
    # bench/zoo_loop.py --parallelisms dp+mark_dynamic (docs/results.md)
    from decompshard.check.loop import run_loop

    alone = run_loop("dp+mark_dynamic", "foreach/foreach", False, steps=1)
    assert alone.verdict == "ERROR" and alone.graphs == [], alone.detail
    run = run_loop("dp+mark_dynamic", "foreach/foreach", True, steps=1)
    assert run.verdict in ("OK", "WRONG"), run.detail  # WRONG at most: a fake group's collectives
    assert run.graphs == ["forward: all_gather_into_tensor x2, all_reduce x1", "backward: none"], run.graphs
    assert run.replicated == []
    # 2.13: the guard's nll_loss fence says once what it does instead of DTensor's
    # mean of means (it cannot tell at compile time whether the counts differ)
    assert all("decompshard guard: aten.nll_loss_forward" in w for w in run.warnings), run.warnings


def _mse_args(mesh):
    def make(n):
        g = torch.Generator().manual_seed(n)
        x, y = torch.randn(n, 3, generator=g), torch.randn(n, 3, generator=g)
        return _rank0(x, mesh, S0), _rank0(y, mesh, S0)
    return make


def test_an_even_only_rule_is_guarded_not_reused_at_a_size_that_splits_unevenly():
    # mse_loss on S(0): its derived rule is `S(0), S(0) -> P(avg) [even]`, a mean of the
    # ranks' means, right only when the rows split evenly. Compiled at 16 rows (even on
    # 4) it is used, with no collective, behind a guard on the batch; at 10 rows the
    # guard fails, so another graph is compiled, where the rule is not used: reusing the
    # first graph would average 3, 3, 2 and 2 rows as if they were equal (wrong).
    mesh = device_mesh((4,))
    rec = Recorder()
    make = _mse_args(mesh)
    with decompshard.enabled():
        outs, _ = _compiled_calls(F.mse_loss, (16, 10), make, rec.backend())
    even, uneven = outs
    assert even.placements == (Partial("avg"),)
    x, y = (t.to_local() for t in make(16))
    torch.testing.assert_close(even.to_local(), F.mse_loss(x, y))  # rank 0's own mean
    assert len(rec.graphs) == 2, "the graph compiled at 16 rows was reused at 10"
    assert uneven.placements != (Partial("avg"),)


def test_the_guard_is_not_needed_where_the_size_proves_the_split():
    # A global batch built from local shards (`from_local` without `shape=`) is
    # 4 * (local rows): its split is even at every size, so no guard and one graph.
    mesh = device_mesh((4,))
    rec = Recorder()

    def make(n):
        g = torch.Generator().manual_seed(n)
        return tuple(DTensor.from_local(torch.randn(n, 3, generator=g), mesh, [S0], run_check=False) for _ in range(2))
    with decompshard.enabled():
        outs, _ = _compiled_calls(F.mse_loss, (4, 3), make, rec.backend())
    assert [o.placements for o in outs] == [(Partial("avg"),)] * 2
    assert len(rec.graphs) == 1 and rec.collectives() == []


def test_attention_on_transposed_inputs_compiles_and_its_output_takes_views():
    # q, k, v `x.transpose(1, 2)` of a DTensor sharded on the head dim: SDPA's CPU
    # kernel has no strategy, the derived one moves them (a move makes a local tensor
    # contiguous) and the output's layout follows the local inputs. Under dynamic=True
    # the output used to claim the global inputs' strides, and the reshape after it
    # failed ("Cannot view a tensor with shape ... and strides ...").
    mesh = device_mesh((4,))

    def attention(x):
        b, s = x.shape[:2]
        q = x.transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).reshape(b, s, 64) * 2

    def make(n):
        x = torch.randn(n, 6, 4, 16, generator=torch.Generator().manual_seed(n))
        return (DTensor.from_local(x, mesh, [R], run_check=False).redistribute(mesh, [Shard(3)]),)
    with decompshard.enabled():
        outs, warned = _compiled_calls(attention, (8, 12), make, "aot_eager")
    assert warned == []
    for n, out in zip((8, 12), outs):
        assert out.shape == (n, 6, 64)
        local = out.to_local()
        assert local.is_contiguous() and local.shape == torch.Size(
            [n // 4 if out.placements == (S0,) else n, 6, 64 if out.placements[0] != Shard(2) else 16])


def _llama_dp(mesh):
    """A tiny transformers Llama (the zoo's size), parameters replicated, and rank 0's
    batch rows `Shard(0)`; (one-device model, data-parallel model)."""
    import copy

    from _dp_step import import_transformers
    from torch.distributed.tensor import distribute_tensor

    T = import_transformers()
    torch.manual_seed(0)
    cfg = T.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, use_cache=False)
    model = T.LlamaForCausalLM(cfg).eval()
    dmodel = copy.deepcopy(model)
    for mod in dmodel.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            mod.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [R]), requires_grad=False))
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is not None:
                mod._buffers[name] = distribute_tensor(b, mesh, [R])
    return model, dmodel


def test_tiny_llama_data_parallel_recompiled_at_a_second_sequence_length_matches_one_device():
    # A second sequence length recompiles. A DTensor input is not made dynamic
    # automatically (2.15), so this second graph has static shapes; `mark_dynamic` on the
    # sequence dim: test_llama_data_parallel_with_a_dynamic_sequence_compiles_forward_and_backward.
    # Here: attention keeps the batch sharded at both lengths, the same 4 all-gathers per
    # graph as one static compile (transformers' mask indexes the position ids with plain
    # tensors under implicit_replication), rank 0's logits those of one device.
    from torch.distributed.tensor.experimental import implicit_replication

    mesh = device_mesh((4,))
    model, dmodel = _llama_dp(mesh)
    rec = Recorder()
    with decompshard.enabled(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch._dynamo.reset()
        fn = torch.compile(lambda ids, pos: dmodel(input_ids=ids, position_ids=pos).logits, backend=rec.backend())
        for seq in (6, 9):
            ids = torch.randint(0, 64, (8, seq), generator=torch.Generator().manual_seed(seq))
            pos = torch.arange(seq).expand(8, seq).contiguous()
            with implicit_replication():
                out = fn(_rank0(ids, mesh, S0), _rank0(pos, mesh, S0))
            assert out.placements == (S0,)
            torch.testing.assert_close(out.to_local(), model(input_ids=ids, position_ids=pos).logits[:2])
    assert [str(w.message) for w in caught if "running replicated" in str(w.message)] == []
    assert len(rec.graphs) == 2
    assert all("all_gather" in c for c in rec.collectives()) and len(rec.collectives()) == 8


def _fed_by_a_collective(node, depth: int = 6) -> bool:
    """Whether `node` is, through view-like ops and copies, a collective's result."""
    for _ in range(depth):
        name = str(node.target)
        if "c10d" in name:
            return True
        if not any(k in name for k in ("slice", "view", "clone", "transpose", "permute", "expand", "split", "getitem")):
            return False
        node = node.args[0]
    return False


def test_tiny_llama_data_parallel_with_dynamic_true_keeps_attention_sharded_in_one_graph():
    # 20-75 s on 2 cores (DTensor's own propagation over symbolic sizes, most of it).
    # dynamic=True: the compile failed ("Cannot view a tensor with shape [4*s, s, 4, 16]
    # and strides ..." after SDPA ran replicated). Now one graph serves three shapes,
    # nothing of decompshard's runs replicated, and SDPA's q, k, v come from no
    # collective. The graph's 4 all-gathers are DTensor's own (native strategies), those
    # of transformers' mask at static shapes too. Two more (the position ids and the
    # lm_head input sliced "to the end", which DTensor cannot prove whole under symbolic
    # sizes) are gone since support/symbolic_slices.py. Rank 0's numbers on the fake group
    # are not checked here (the mask's gathers are real collectives).
    from torch.distributed.tensor.experimental import implicit_replication

    mesh = device_mesh((4,))
    _, dmodel = _llama_dp(mesh)
    rec = Recorder()
    with decompshard.enabled(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch._dynamo.reset()
        fn = torch.compile(lambda ids, pos: dmodel(input_ids=ids, position_ids=pos).logits, backend=rec.backend(),
                           dynamic=True)
        for batch, seq in ((8, 6), (8, 9), (12, 5)):
            ids = torch.randint(0, 64, (batch, seq), generator=torch.Generator().manual_seed(seq))
            pos = torch.arange(seq).expand(batch, seq).contiguous()
            with implicit_replication():
                out = fn(*(DTensor.from_local(t.tensor_split(4)[0].clone(), mesh, [S0], run_check=False)
                           for t in (ids, pos)))
            assert out.shape == (batch, seq, 64)
    assert [str(w.message) for w in caught if "running replicated" in str(w.message)] == []
    assert len(rec.graphs) == 1
    sdpa = [n for n in rec.graphs[0].graph.nodes if "scaled_dot_product" in str(n.target)]
    assert sdpa and not any(_fed_by_a_collective(a) for n in sdpa for a in n.args[:3])
    assert len(rec.collectives()) == 4
