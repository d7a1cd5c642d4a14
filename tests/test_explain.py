"""explain: readable propagation traces, on real ops, checked against what derive_rules says."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from torch.distributed.tensor.placement_types import Replicate, Shard

from decompshard import derive_rules
from decompshard.cli import main
from decompshard.explain import explain
from decompshard.explain.analysis import redistribution
from decompshard.placements import P, R, S, format_rule
from decompshard.rules import rules_for

aten = torch.ops.aten


def meta(*shape, dtype=torch.float32):
    return torch.empty(shape, dtype=dtype, device="meta")


ADDMV = (aten.addmv.default, meta(4), meta(4, 12), meta(12))
ADDMV_CLI = ["explain", "aten.addmv.default", "--shapes", "4;4,12;12"]
LAYER_NORM_CLI = [
    "explain", "aten.native_layer_norm.default", "--shapes", "2,8,16;;16;16", "--args", "[16],1e-5",
]


def cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------ accepted traces


def test_accepted_trace_follows_every_node_with_the_rule_that_matched():
    ex = explain(*ADDMV, placements="S(0); S(0); R")
    assert ex.verdict == "accepted" and ex.accepted
    assert [format_rule(r) for r in ex.rules] == ["S(0), S(0), R -> S(0)"]
    graph = ex.graph
    (surv,) = ex.survivors
    assert surv.ok and surv.survivor.outputs == (S(0),)
    # The path names, per node, a rule of that node's table that fits the placements shown.
    for node, ri in zip(graph.nodes, surv.survivor.path):
        if node.constant:
            continue
        rule = rules_for(node)[ri]
        assert rule.inputs == tuple(surv.survivor.env[v] for v in node.inputs)
        assert rule.outputs == tuple(surv.survivor.env[v] for v in node.outputs)
    text = str(ex)
    assert "ACCEPTED" in text and "S(0), S(0), R -> S(0)" in text
    for node in graph.nodes:  # a numbered list of every primitive call
        assert str(node.op).removeprefix("aten.") in text
    # where the rules came from: the sum's as the running torch registers it (an op
    # strategy up to 2.13, single-dim from 2.14), the muls single-dim
    from decompshard._compat import single_dim_strategy_info

    sum_line = next(line for line in text.splitlines() if "sum.dim_IntList(" in line)
    sum_source = "torch single-dim" if single_dim_strategy_info(aten.sum.dim_IntList) else "torch op strategy"
    assert "S(0) -> S(0)" in sum_line and sum_source in sum_line
    mul_line = next(line for line in text.splitlines() if "mul.Tensor(" in line)
    assert "torch single-dim" in mul_line


def test_partial_bias_is_the_communication_free_rule():
    ex = explain(*ADDMV, placements=[P("sum"), S(1), S(0)])
    assert ex.verdict == "accepted"
    assert [format_rule(r) for r in ex.rules] == ["P(sum), S(1), S(0) -> P(sum)"]
    assert ex.blocked is None and not ex.suggestions


def test_torch_placements_are_accepted_too():
    a = explain(*ADDMV, placements=[Replicate(), Shard(1), Shard(0)])
    b = explain(*ADDMV, placements="R, S(1), S(0)")
    assert a.placements == b.placements == (R, S(1), S(0))
    assert str(a) == str(b)


def test_even_only_rule_is_flagged():
    ex = explain(aten.mse_loss.default, meta(6, 4), meta(6, 4), placements="S(0);S(0)")
    assert [format_rule(r) for r in ex.rules] == ["S(0), S(0) -> P(avg) [even]"]
    assert "splits evenly" in str(ex)


# ------------------------------------------------------------------ rejected traces


def test_replicated_bias_is_rejected_at_the_final_add():
    ex = explain(*ADDMV, placements="R;S(1);S(0)")
    assert ex.verdict == "rejected" and not ex.rules
    b = ex.blocked
    assert b.node.op is aten.add.Tensor
    assert b.node.index == len(ex.graph.nodes) - 1  # the add is the last primitive
    assert b.arriving == (P("sum"), R)  # partial sums of mat@vec, replicated bias
    # derive_rules records the same death for the same candidate
    rej = derive_rules(*ADDMV).rejected
    assert any(c.inputs == (R, S(1), S(0)) and c.node == b.node.index for c in rej)
    # nearest rules of add: each differs from (P(sum), R) in exactly one position
    near = [format_rule(n.rule) for n in b.nearest]
    assert "P(sum), P(sum) -> P(sum)" in near and all(len(n.differs) == 1 for n in b.nearest)
    # cheapest fix: make the bias P(sum) (a local divide), which gives the derived rule
    best = ex.suggestions[0]
    assert [(c.input, c.src, c.dst) for c in best.changes] == [(0, R, P("sum"))]
    assert format_rule(best.rule) == "P(sum), S(1), S(0) -> P(sum)"
    assert "no communication" in best.changes[0].how
    text = str(ex)
    assert f"REJECTED at node {b.node.index} (aten.add.Tensor)" in text
    assert "redistribute input 0 (self) from R to P(sum)" in text
    assert "-> rule P(sum), S(1), S(0) -> P(sum)" in text


def test_channel_shuffle_blocks_where_the_grouped_channel_dim_is_merged_back():
    ex = explain(aten.channel_shuffle.default, meta(2, 8, 3, 3), 2, placements="S(1)")
    assert ex.verdict == "rejected"
    assert ex.blocked.node.op is aten._unsafe_view.default
    assert ex.blocked.arriving == (S(2),)  # view -> S(1) of 5-D, transpose -> S(2)
    derived = {r.inputs for r in derive_rules(aten.channel_shuffle.default, meta(2, 8, 3, 3), 2).rules}
    for s in ex.suggestions:  # every suggested rule is one derive_rules found (or all-R)
        assert s.rule.inputs in derived or s.rule.is_trivial()
    assert ex.suggestions[0].changes[0].how == "all-to-all"
    text = str(ex)
    assert "(not reached)" not in text  # the block is the last node
    assert "_unsafe_view.default" in text and "NO RULE for (S(2))" in text


def test_nodes_after_the_block_are_not_reached():
    ex = explain(
        aten.native_layer_norm.default, meta(2, 8, 16), [16], meta(16), meta(16), 1e-5,
        placements="S(2);R;R",
    )
    assert ex.blocked.node.index == 0 and ex.blocked.node.op is aten.var_mean.correction
    assert str(ex).count("(not reached)") == len(ex.graph.nodes) - 1
    assert ex.suggestions[0].changes[0].dst in (S(0), S(1))


def test_local_shape_check_refusal_is_reported_with_its_reason():
    # group_norm takes the batch size N as an argument and views the input to [N, G, ...]:
    # sharding the batch survives propagation but no rank's local shard fits that view.
    args = (meta(2, 8, 4), meta(8), meta(8), 2, 8, 4, 2, 1e-5)
    ex = explain(aten.native_group_norm.default, *args, placements="S(0);R;R")
    assert ex.verdict == "refused" and not ex.rules
    assert ex.survivors and not any(s.ok for s in ex.survivors)
    rej = [c for c in derive_rules(aten.native_group_norm.default, *args).rejected if c.node is None]
    assert any(c.inputs == (S(0), R, R) and c.reason == ex.local_refusal for c in rej)
    text = str(ex)
    assert "REFUSED by the local-shape check" in text and "view" in ex.local_refusal
    assert ex.suggestions and all(s.rule.inputs != (S(0), R, R) for s in ex.suggestions)


def test_partial_on_an_integer_input_is_not_allowed():
    i = meta(4, dtype=torch.int64)
    ex = explain(aten.add.Tensor, i, i, placements="P(sum);R")
    assert ex.verdict == "rejected" and ex.blocked.node is None
    assert "not allowed for input 0" in str(ex)
    assert all(c.dst is not P("sum") for s in ex.suggestions for c in s.changes)


def test_redistribution_names_the_collective():
    assert redistribution(S(0), R)[0] == "all-gather"
    assert redistribution(P("sum"), R)[0] == "all-reduce"
    assert redistribution(P("sum"), S(0))[0] == "reduce-scatter"
    assert redistribution(S(0), S(1))[0] == "all-to-all"
    assert redistribution(R, S(0))[1] == 0 and redistribution(R, P("sum"))[1] == 0


def test_api_errors_are_value_errors():
    with pytest.raises(ValueError, match="expected 3 placements"):
        explain(*ADDMV, placements="R;R")
    with pytest.raises(ValueError, match="out of range"):
        explain(*ADDMV, placements="R;S(2);R")
    with pytest.raises(ValueError, match="malformed placement"):
        explain(*ADDMV, placements="R;X;R")
    with pytest.raises(ValueError, match="unknown op"):
        explain("aten.not_an_op.default", meta(3), placements="R")


# ------------------------------------------------------------------ native ops


def _torch_single_dim_rules(op, *metas):
    """torch's own single-dim strategy, called directly (TORCH_NOTES), as rule strings."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import TensorMeta

    from decompshard.torch_placements import from_torch_placement
    from decompshard.placements import SingleDimRule

    sp = DTensor._op_dispatcher.sharding_propagator
    tms = tuple(TensorMeta(m.shape, m.stride(), m.dtype) for m in metas)
    out = {"R, R -> R"}
    for entry in sp.op_single_dim_strategy_funcs[op].func(op, tms, {}):
        ps = tuple(from_torch_placement(p) for p in entry)
        out.add(format_rule(SingleDimRule(ps[1:], ps[:1])))
    return out


def test_native_op_says_dtensor_uses_its_own_strategy():
    x = meta(4, 6)
    ex = explain(aten.mul.Tensor, x, x, placements="S(0);S(0)")
    assert ex.native == "torch single-dim strategy" and ex.derived.native == ex.native
    # what explain calls DTensor's own rules is exactly torch's strategy function
    assert {format_rule(r) for r in ex.native_rules} == _torch_single_dim_rules(aten.mul.Tensor, x, x)
    assert [format_rule(r) for r in ex.native_accepts] == ["S(0), S(0) -> S(0)"]
    native_line = " ".join(str(ex).split("candidate:")[0].split())  # unwrapped
    assert "its own strategy" in native_line and "runs this candidate as it is: S(0), S(0) -> S(0)" in native_line
    assert "for comparison only" in native_line
    assert "DTensor uses its own strategy for aten.mul.Tensor" in str(ex.derived)
    # a placement its own table does not take as it is
    ex = explain(aten.mul.Tensor, x, x, placements="S(0);P(sum)")
    assert ex.native_accepts == []
    assert "DTensor redistributes first" in " ".join(str(ex).split("candidate:")[0].split())


def test_op_without_a_native_strategy_has_no_native_note():
    ex = explain(*ADDMV, placements="S(0);S(0);R")
    assert ex.native is None and ex.native_rules is None and "native:" not in str(ex)
    assert "own strategy" not in str(ex.derived)


def test_repr_is_the_text_trace():
    ex = explain(*ADDMV, placements="R;S(1);S(0)")
    assert repr(ex) == str(ex) == ex.render(120)


def _html(ex):
    import xml.etree.ElementTree as ET

    return ET.fromstring(ex._repr_html_())  # well-formed: every tag closed, every text escaped


def _add_node(ex) -> int:
    """Where addmv's decomposition adds the bias (node 7 on torch 2.13; 2.14's
    decomposition expands the bias first, so node 8): the node the verdict must name."""
    return next(i for i, n in enumerate(ex.graph.nodes) if n.op is aten.add.Tensor)


def test_notebook_view_is_a_table_with_the_verdict_and_the_blocking_node():
    ex = explain(*ADDMV, placements="R;S(1);S(0)")
    at, n_nodes = _add_node(ex), len(ex.graph.nodes)
    root = _html(ex)
    verdict = next(e for e in root.iter("div") if "verdict" in (e.get("class") or ""))
    assert verdict.get("class") == "verdict verdict-rejected"
    assert verdict.text == f"REJECTED at node {at} (aten.add.Tensor): no rule accepts (P(sum), R)"
    assert "background" in verdict.get("style")
    tables = {t.get("class"): t for t in root.iter("table")}
    assert {"inputs", "decomposition", "arriving", "nearest"} <= set(tables)
    rows = tables["decomposition"].find("tbody").findall("tr")
    assert len(rows) == n_nodes == at + 1  # one per primitive call, the add last
    blocked = [r for r in rows if r.get("class") == "blocked"]
    assert len(blocked) == 1 and blocked[0].find("td").text == str(at)
    assert "background" in blocked[0].get("style")
    assert blocked[0].findall("td")[2].text == "** NO RULE for (P(sum), R)"
    assert all(r.get("class") == "matched" for r in rows[:at])
    # placements are coloured by kind, as torch's visualize_sharding does
    cells = [r.findall("td")[5] for r in tables["inputs"].find("tbody").findall("tr")]
    assert [c.text for c in cells] == ["R", "S(1)", "S(0)"]
    assert cells[0].get("style") != cells[1].get("style") == cells[2].get("style")  # R, then two S
    # what arrived, with the rule that placed it: the text trace's own wording
    arriving = [[td.text for td in r.findall("td")] for r in tables["arriving"].find("tbody").findall("tr")]
    assert [r[3] for r in arriving] == ["P(sum)", "R"]
    assert arriving[0][4].startswith("node 5 mul.Tensor: P(sum) -> P(sum)")
    # the text trace is there too, folded
    text = root.find("details").find("pre").text
    assert f"blocked at node {at}" in text and all(r[4] in text for r in arriving)


def test_notebook_view_of_an_accepted_and_of_an_unsupported_call():
    root = _html(explain(*ADDMV, placements="S(0);S(0);R"))
    verdict = next(e for e in root.iter("div") if "verdict" in (e.get("class") or ""))
    assert verdict.get("class") == "verdict verdict-accepted" and verdict.text.startswith("ACCEPTED")
    assert not [r for r in root.iter("tr") if r.get("class") == "blocked"]
    assert [li.text for li in root.iter("li")] == ["S(0), S(0), R -> S(0)"]
    x = torch.randn(4)
    root = _html(explain(aten.bernoulli.default, x, placements="R"))
    verdict = next(e for e in root.iter("div") if "verdict" in (e.get("class") or ""))
    assert verdict.get("class") == "verdict verdict-unsupported" and "random" in verdict.text


@pytest.mark.parametrize("width", [100, 80])
def test_traces_fit_the_width_they_are_given(width):
    for pl in ("R;S(1);S(0)", "S(0);S(0);R", "P(sum);S(1);S(0)"):
        text = explain(*ADDMV, placements=pl, show_all=True).render(width)
        assert max(len(line) for line in text.splitlines()) <= width, pl


def test_traces_fit_in_120_columns():
    for pl in ("R;S(1);S(0)", "S(0);S(0);R", "P(sum);S(1);S(0)", "R;R;P(avg)"):
        text = explain(*ADDMV, placements=pl, show_all=True).render()
        assert max(len(line) for line in text.splitlines()) <= 120, pl
    ln = (aten.native_layer_norm.default, meta(2, 8, 16), [16], meta(16), meta(16), 1e-5)
    for pl in ("S(0);R;R", "R;R;P(avg)", "S(2);R;R"):
        text = explain(*ln, placements=pl, show_all=True).render()
        assert max(len(line) for line in text.splitlines()) <= 120, pl


# ------------------------------------------------------------------------- CLI


def test_cli_trace_and_its_exit_code(capsys):
    rc, out, err = cli(capsys, *ADDMV_CLI, "--placements", "R;S(1);S(0)")
    assert rc == 3 and not err  # rejected: needs redistribution
    assert "REJECTED at node" in out and "aten.add.Tensor" in out
    assert "from R to P(sum)" in out
    rc, out, err = cli(capsys, *ADDMV_CLI, "--placements", "S(0);S(0);R")
    assert rc == 0 and "ACCEPTED" in out
    args = ("aten.native_group_norm.default", "--shapes", "2,8,4;8;8", "--args", "2,8,4,2,1e-5")
    rc, out, _ = cli(capsys, "explain", *args, "--placements", "S(0);R;R")
    assert rc == 3 and "REFUSED by the local-shape check" in out


def test_cli_quiet_prints_the_verdict_only(capsys):
    rc, out, err = cli(capsys, *ADDMV_CLI, "--placements", "R;S(1);S(0)", "-q")
    assert rc == 3 and not err
    at = _add_node(explain(*ADDMV, placements="R;S(1);S(0)"))
    assert out.splitlines() == [
        "explain aten.addmv.default(self: f32[4], mat: f32[4,12], vec: f32[12])",
        "candidate: R, S(1), S(0)",
        f"verdict:   REJECTED at node {at} (aten.add.Tensor): no rule accepts (P(sum), R)",
    ]


def test_cli_all_lists_every_derived_rule_and_rejection(capsys):
    rc, out, err = cli(capsys, *LAYER_NORM_CLI, "--all")
    assert rc == 0 and not err
    args = (meta(2, 8, 16), [16], meta(16), meta(16), 1e-5)
    derived = derive_rules(aten.native_layer_norm.default, *args)
    assert derived.rules
    lines = out.splitlines()
    for rule in derived.rules:
        lhs, rhs = format_rule(rule).split(" -> ")
        assert any(line.strip().startswith(lhs) and rhs in line for line in lines), rule
    assert f"{len(derived.rules)} rules" in out
    # S(2) on the normalized dim never reaches a rule: explained per input
    assert "input 0 (input) S(2): no rule of node 0 (var_mean.correction) takes it" in out

    rc, out, _ = cli(capsys, *ADDMV_CLI, "--all")
    rej = derive_rules(*ADDMV).rejected
    assert rc == 0 and rej
    for c in rej:
        assert str(c) in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["explain", "aten.no_such_op.default", "--shapes", "4"], "unknown op"),
        (["explain", "aten.addmv.default", "--shapes", "4;4,12"], "missing vec"),
        (["explain", "aten.addmv.default", "--shapes", "4;4,12;12;3"], "got 4 --shapes entries"),
        (ADDMV_CLI + ["--placements", "R;S(1)"], "expected 3 placements"),
        (ADDMV_CLI + ["--placements", "R;S(1);Q(0)"], "malformed placement"),
        (ADDMV_CLI + ["--placements", "R;S(1);P(prod)"], "unknown Partial reduce op"),
        (ADDMV_CLI + ["--placements", "R;S(5);R"], "out of range"),
        (["explain", "aten.addmv.default", "--shapes", "4;4,13;12"], "rejects these arguments"),
        (["explain", "aten.native_layer_norm.default", "--shapes", "2,8,16;16;16;16", "--args", "1e-5"],
         "is not a tensor"),
        (LAYER_NORM_CLI[:-1] + ["[16"], "malformed --args"),
        (ADDMV_CLI + ["--mesh", "2x4"], "go together"),
        (ADDMV_CLI + ["--mesh", "2xq", "--mesh-placements", "R,R;R,R;R,R"], "malformed mesh"),
        (ADDMV_CLI + ["--mesh", "2x4", "--mesh-placements", "R,R;R,R"], "mesh placements for 3"),
        (ADDMV_CLI + ["--mesh", "2x4", "--mesh-placements", "R;R,R;R,R"], "expected 2 placements"),
        (ADDMV_CLI + ["--dtype", "float33"], "unknown dtype"),
        (["explain", "aten.addmv.default"], "missing --shapes"),
        (["explain", "aten.no_such_op.default"], "unknown op"),  # the op first, then its shapes
        (["explain", "aten.add_.t", "--shapes", ";"], "no dispatcher entry"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    rc, out, err = cli(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("decompshard explain: error:")
    assert message in err


def test_cli_unsupported_op_exits_1(capsys):
    rc, out, _ = cli(capsys, "explain", "aten.bernoulli.default", "--shapes", "4", "--placements", "R")
    assert rc == 1 and "unsupported:" in out


# ------------------------------------------------------------------------- REPL


def test_interactive_session_from_piped_stdin(capsys, monkeypatch):
    script = "R;S(1);S(0)\nbogus\nS(0);S(0);R\nR;S(1)\nall\nshapes 4;4,6;6\nP(sum);S(1);S(0)\nquit\nS(0);S(0);R\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    rc, out, err = cli(capsys, *ADDMV_CLI, "-i")
    assert rc == 0
    assert out.count("REJECTED at node") == 1
    assert "error: unknown command 'bogus'" in out
    assert out.count("ACCEPTED") == 2  # S(0);S(0);R and the P(sum) rule on the new shapes
    assert "error: expected 3 placements" in out
    assert "every derived rule" in out and "P(sum), S(1), S(0)" in out
    assert "mat=f32[4,6]" in out  # the new call
    assert out.count("candidate: S(0), S(0), R") == 1  # nothing after quit runs


def test_interactive_bad_changes_keep_the_working_call(capsys, monkeypatch):
    script = ("shapes 4;4,13;12\nS(0);S(0);R\nargs 3\ncall\n"  # bad shapes, bad args: addmv stays
              "op aten.mv.default\nS(0);R\ncall\nshapes 4,12;12\nS(0);R\nquit\n")  # mv waits for its shapes
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    rc, out, _ = cli(capsys, *ADDMV_CLI, "-i")
    assert rc == 0
    assert "error: aten.addmv.default rejects these arguments" in out
    assert out.count("still: aten.addmv.default(self=f32[4], mat=f32[4,12], vec=f32[12])") == 3
    assert "candidate: S(0), S(0), R" in out and "ACCEPTED" in out  # on the kept call
    assert "pending: op aten.mv.default" in out
    assert "error: expected 3 placements" in out  # S(0);R went to addmv, still the call
    assert "call: aten.mv.default(self=f32[4,12], vec=f32[12])" in out
    assert "explain aten.mv.default(self: f32[4,12], vec: f32[12])" in out


def test_interactive_eof_exits_cleanly_and_op_can_be_set_inside(capsys, monkeypatch):
    script = "S(1)\nop aten.channel_shuffle.default\nshapes 2,8,3,3\nargs 2\nS(1)\ngraph"
    monkeypatch.setattr(sys, "stdin", io.StringIO(script))
    rc, out, _ = cli(capsys, "explain", "-i")
    assert rc == 0
    assert "error: no op call yet" in out
    assert "call: aten.channel_shuffle.default(self=f32[2,8,3,3], groups=2)" in out
    assert "REJECTED at node 3 (aten._unsafe_view.default)" in out
    assert "decomposition: 4 primitive calls" in out


# ------------------------------------------------------------------------- mesh


MESH_CURRENT = "R,S(0);S(1),S(0);S(0),R"


def test_mesh_ranking_follows_the_cost_model():
    ex = explain(*ADDMV, mesh=(2, 4), mesh_placements=MESH_CURRENT)
    strategies = ex.mesh.strategies
    assert strategies
    valid = [s for s in strategies if s.valid]
    # valid strategies come first, and each group is in non-decreasing cost order
    assert strategies[: len(valid)] == valid
    supported = [s for s in valid if s.cost.dtensor_supported]
    keys = [s.cost.sort_key() for s in supported]
    assert keys == sorted(keys)
    chosen = ex.mesh.chosen
    assert chosen is valid[0]
    assert chosen.cost.total_seconds == min(s.cost.total_seconds for s in supported)
    # mat and vec already sit where P(sum),S(1),S(0) | S(0),S(0),R wants them: nothing to move
    assert [format_rule(r) for r in chosen.rules] == ["P(sum), S(1), S(0) -> P(sum)", "S(0), S(0), R -> S(0)"]
    assert not chosen.cost.collectives

    text = str(ex)
    rows = [line.split() for line in text.splitlines() if line.strip().startswith(("1 ", "2 "))]
    assert rows[0][:2] == ["1", "CHOSEN"]
    assert "mesh dim 0: P(sum), S(1), S(0) -> P(sum)" in text
    assert "all-gather over mesh dim" in text  # the runner-up's collectives are spelled out


def test_cli_mesh(capsys):
    rc, out, err = cli(capsys, *ADDMV_CLI, "--placements", "R;S(1);S(0)", "--mesh", "2x4",
                       "--mesh-placements", MESH_CURRENT)
    assert rc == 3 and not err  # the single-dim candidate is rejected
    assert "REJECTED at node" in out  # the single-dim trace is still there
    assert "N-D strategies on mesh 2x4" in out and "CHOSEN" in out
    assert max(len(line) for line in out.splitlines()) <= 120


def test_cli_version_names_decompshard_and_torch(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert out.startswith("decompshard ") and f"torch {torch.__version__}" in out


# ------------------------------------------------------------------------- structure


def _imports(path) -> set[str]:
    """The decompshard.explain modules a file imports (relative imports resolved)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names |= {node.module} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("decompshard.explain."):
            names.add(node.module.split(".")[2])
    return names


def test_explain_modules_import_one_way():
    """command -> api -> notebook -> render -> analysis -> plans: each module imports only
    modules below it (no cycle, no import from above hidden in a function)."""
    from pathlib import Path

    from decompshard.explain import analysis as analysis_module

    folder = Path(analysis_module.__file__).parent
    order = ["plans", "analysis", "render", "notebook", "api", "command"]
    for k, name in enumerate(order):
        assert _imports(folder / f"{name}.py") <= set(order[:k]), name
