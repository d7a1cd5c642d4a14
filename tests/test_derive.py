"""derive_rules end to end on real ops, and its error behaviour on bad input."""

import pytest
import torch

from decompshard import clear_caches, derive_rules, parse_rule
from decompshard.placements import S

aten = torch.ops.aten


def rules_of(op, *args, **kwargs):
    return set(derive_rules(op, *args, **kwargs).as_strings())


def test_addmv_derives_the_communication_free_rules():
    got = rules_of(aten.addmv.default, torch.randn(4), torch.randn(4, 12), torch.randn(12))
    # mat sharded on its reduced dim, vec on its only dim: local mv gives partial sums.
    assert "P(sum), S(1), S(0) -> P(sum)" in got
    assert "S(0), S(0), R -> S(0)" in got
    # bias replicated would be added once per rank: never P(sum).
    assert "R, S(1), S(0) -> P(sum)" not in got


def test_op_name_as_string_matches_overload():
    args = (torch.randn(4), torch.randn(4, 12), torch.randn(12))
    assert derive_rules("aten.addmv.default", *args).as_strings() == derive_rules(aten.addmv.default, *args).as_strings()
    assert derive_rules("aten::addmv", *args).op is aten.addmv.default


def test_meta_and_fake_inputs_give_the_same_rules_as_real():
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = derive_rules(aten.addr.default, torch.randn(4, 6), torch.randn(4), torch.randn(6)).as_strings()
    meta = derive_rules(aten.addr.default, *(torch.empty(s, device="meta") for s in [(4, 6), (4,), (6,)])).as_strings()
    with FakeTensorMode():
        fake_args = (torch.empty(4, 6), torch.empty(4), torch.empty(6))
    fake = derive_rules(aten.addr.default, *fake_args).as_strings()
    assert real == meta == fake and real


def test_mean_loss_over_sharded_batch_is_even_only():
    got = rules_of(aten.mse_loss.default, torch.randn(6, 4), torch.randn(6, 4))
    assert "S(0), S(0) -> P(avg) [even]" in got
    assert "S(0), S(0) -> P(avg)" not in got and "S(0), S(0) -> P(sum)" not in got


def test_channel_shuffle_never_shards_the_grouped_channel_dim():
    got = rules_of(aten.channel_shuffle.default, torch.randn(2, 8, 3, 3), 2)
    assert "S(0) -> S(0)" in got and "S(2) -> S(2)" in got
    assert not any(r.startswith("S(1)") for r in got)
    rej = derive_rules(aten.channel_shuffle.default, torch.randn(2, 8, 3, 3), 2).rejected
    assert any(c.inputs == (S(1),) for c in rej)


def test_trace_keeps_partial_sums():
    assert {"P(sum) -> P(sum)", "P(avg) -> P(avg)"} <= rules_of(aten.trace.default, torch.randn(5, 5))


def test_copy_ops_pass_partials_through():
    got = rules_of(aten.permute_copy.default, torch.randn(2, 3, 4), [2, 0, 1])
    assert {"P(sum) -> P(sum)", "P(max) -> P(max)", "S(0) -> S(1)", "S(2) -> S(0)"} <= got


def test_factory_op_inside_decomposition_is_a_constant():
    # block_diag builds its result with zeros/new_zeros; torch's fallback aborts on it.
    r = derive_rules(aten.block_diag.default, [torch.randn(2, 3), torch.randn(3, 2)])
    assert r.unsupported_reason is None and r.graph is not None
    assert any(n.constant for n in r.graph.nodes)


def test_unknown_and_malformed_op_names_raise_value_error():
    with pytest.raises(ValueError, match="unknown op"):
        derive_rules("aten.not_an_op.default", torch.randn(2))
    with pytest.raises(ValueError, match="malformed"):
        derive_rules("addmv default!", torch.randn(2))
    with pytest.raises(ValueError):
        derive_rules(42, torch.randn(2))


def test_op_without_decomposition_is_unsupported_with_reason():
    r = derive_rules(aten.mm.default, torch.randn(2, 3), torch.randn(3, 4))
    assert r.rules == [] and "no decomposition" in r.unsupported_reason


def test_data_dependent_decomposition_is_reported():
    # masked_select's output shape depends on the mask's values.
    r = derive_rules(aten.masked_select.default, torch.randn(4), torch.rand(4) > 0.5)
    assert r.rules == [] and r.unsupported_reason
    assert "data-dependent" in r.unsupported_reason or "no decomposition" in r.unsupported_reason


def test_results_are_cached_and_clear_caches_forgets_them():
    args = (torch.randn(4, 6), torch.randn(4), torch.randn(6))
    a = derive_rules(aten.addr.default, *args)
    assert derive_rules(aten.addr.default, *args) is a
    clear_caches()
    b = derive_rules(aten.addr.default, *args)
    assert b is not a and b.as_strings() == a.as_strings()


def test_string_form_parses_back():
    for text in rules_of(aten.addr.default, torch.randn(4, 6), torch.randn(4), torch.randn(6)):
        assert str(parse_rule(text)) == text


def test_ambient_fake_tensor_mode_does_not_change_the_answer():
    from torch._subclasses.fake_tensor import FakeTensorMode

    plain = rules_of(aten.addr.default, torch.randn(4, 6), torch.randn(4), torch.randn(6))
    clear_caches()
    with FakeTensorMode():
        inside = derive_rules(aten.addr.default, torch.empty(4, 6), torch.empty(4), torch.empty(6))
        assert set(inside.as_strings()) == plain and plain


def test_ambient_local_tensor_mode_does_not_change_the_answer():
    import torch.distributed as dist
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    plain = rules_of(aten.addr.default, torch.randn(4, 6), torch.randn(4), torch.randn(6))
    clear_caches()
    owns_pg = not dist.is_initialized()
    if owns_pg:
        dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with LocalTensorMode(2):
            inside = derive_rules(aten.addr.default, torch.randn(4, 6), torch.randn(4), torch.randn(6))
            assert set(inside.as_strings()) == plain and plain
    finally:
        if owns_pg:
            dist.destroy_process_group()


def test_linear_through_addmm_claims_no_average_of_a_sharded_contraction():
    # Regression: P(sum) -> P(avg) "twins" of addmm's `P(sum), S(1), S(0) -> P(sum)` made
    # `S(1), S(1), R -> P(avg)` for linear, which is wrong (the contraction is a sum).
    from decompshard.verify.rule_check import check_rules

    x, w, b = torch.randn(4, 6), torch.randn(3, 6), torch.randn(3)
    derived = derive_rules(aten.linear.default, x, w, b)
    report = check_rules(aten.linear.default, (x, w, b), {}, derived.rules)
    assert not report.incorrect, report.incorrect
    assert "S(1), S(1), P(sum) -> P(sum) [even]" in derived.as_strings() or any(
        r.startswith("S(1), S(1), P(sum) -> P(sum)") for r in derived.as_strings()
    )


AS_STRIDED_GATHERS = [
    (torch.randn(16), [2, 2, 2, 2], [1, 1, 1, 1], 0),  # overlapping windows: a gather may repeat
    (torch.randn(4, 6), [3, 3], [6, 2], 1),
    (torch.randn(3, 3), [2, 2], [1, 2]),  # storage_offset left out: x's own (0)
]


@pytest.mark.parametrize("args", AS_STRIDED_GATHERS)
def test_as_strided_copy_within_its_input_passes_every_partial(args):
    from decompshard.verify.rule_check import check_rules

    derived = derive_rules(aten.as_strided_copy.default, *args)
    assert set(derived.as_strings()) == {f"P({op}) -> P({op})" for op in ("sum", "avg", "max", "min")}
    report = check_rules(aten.as_strided_copy.default, args, {}, derived.rules)
    assert not report.incorrect and not report.missed


def test_as_strided_scatter_without_overlap_passes_matching_partials():
    from decompshard.verify.rule_check import check_rules

    args = (torch.randn(4, 6), torch.randn(2, 3), [2, 3], [6, 2], 1)
    derived = derive_rules(aten.as_strided_scatter.default, *args)
    got = set(derived.as_strings())
    assert {"P(sum), P(sum) -> P(sum)", "R, P(max) -> P(max)", "P(avg), R -> P(avg)"} <= got
    assert "P(sum), R -> P(sum)" not in got  # R self elements would be summed W times
    report = check_rules(aten.as_strided_scatter.default, args, {}, derived.rules)
    assert not report.incorrect and not report.missed


def test_as_strided_outside_a_gather_or_scatter_is_refused():
    # reads past the input's own elements (storage beyond x is not x's to read)
    assert not derive_rules(aten.as_strided_copy.default, torch.randn(6), [3, 3], [1, 1], 4).rules
    # a scatter whose windows overlap writes some elements twice (undefined in torch)
    assert not derive_rules(aten.as_strided_scatter.default, torch.randn(6), torch.randn(3, 3), [3, 3], [1, 1], 0).rules
    # a non-contiguous input: positions would not be its logical elements
    assert not derive_rules(aten.as_strided_copy.default, torch.randn(4, 4).t(), [2, 2], [1, 4], 0).rules


def test_torchscript_only_overload_is_a_clear_value_error():
    """torch.ops lists aten.add_.t (Python lists, TorchScript only); the dispatcher has no
    entry, and asking torch about it raises from deep inside. We say what it is."""
    from decompshard.dispatch_modes.tracing import has_decomposition

    for op in ("aten.add_.t", torch.ops.aten.add_.t):
        with pytest.raises(ValueError, match="no dispatcher entry"):
            derive_rules(op, [1], [2])
    assert has_decomposition(torch.ops.aten.add_.t) is False


@pytest.mark.filterwarnings("ignore::UserWarning")  # prototype/deprecation notes from torch
@pytest.mark.parametrize(
    "make, kind",
    [
        (lambda: torch.nested.nested_tensor([torch.randn(2, 5), torch.randn(3, 5)]), "nested"),
        (lambda: torch.quantize_per_tensor(torch.randn(4, 5), 0.1, 0, torch.qint8), "quantized"),
        (lambda: torch.randn(4, 5).to_sparse(), "sparse_coo"),
    ],
)
def test_tensors_decompshard_cannot_trace_are_unsupported_with_the_reason(make, kind):
    from decompshard import explain

    got = derive_rules(torch.ops.aten.mv.default, make(), torch.randn(5))
    assert got.rules == [] and kind in got.unsupported_reason and "dense strided" in got.unsupported_reason
    with pytest.raises(ValueError, match=kind):
        explain(torch.ops.aten.mv.default, make(), torch.randn(5), placements="S(0);R")


def test_an_op_packet_means_its_default_overload():
    x, v = torch.randn(4, 5), torch.randn(5)
    assert derive_rules(torch.ops.aten.mv, x, v).op is torch.ops.aten.mv.default
    assert derive_rules(torch.ops.aten.mv, x, v).as_strings() == derive_rules("aten.mv.default", x, v).as_strings()


def test_isin_keeps_elements_sharded_whichever_algorithm_torch_picks():
    """torch's isin decomposition sorts when test_elements is large next to elements (a
    branch on sizes, through ops without rules); the project's broadcast form is the same
    function, so elements' sharding survives on both sides of torch's branch."""
    from decompshard.verify.rule_check import check_rules

    isin = torch.ops.aten.isin.Tensor_Tensor
    for elements, test in [(torch.randint(0, 30, (20,)), torch.randint(0, 30, (5,))),  # broadcast branch
                           (torch.randint(0, 30, (5,)), torch.randint(0, 30, (40,)))]:  # sorting branch
        for invert in (False, True):
            got = derive_rules(isin, elements, test, invert=invert)
            assert "S(0), R -> S(0)" in got.as_strings()
            report = check_rules(isin, (elements, test), {"invert": invert}, got.rules)
            assert report.incorrect == [] and len(report.confirmed) == len(got.rules)


def test_take_with_a_0d_index_is_derived_not_called_data_dependent():
    """torch's take decomposition indexes in Python, which reads a 0-d index's value."""
    from decompshard.verify.rule_check import check_rules

    take = torch.ops.aten.take.default
    for x, index in [(torch.randn(3, 3), torch.tensor(-2)), (torch.tensor(3.0), torch.tensor(0))]:
        got = derive_rules(take, x, index)
        assert got.unsupported_reason is None and "P(sum), R -> P(sum)" in got.as_strings()
        report = check_rules(take, (x, index), {}, got.rules)
        assert report.incorrect == [] and report.recall == 1.0
