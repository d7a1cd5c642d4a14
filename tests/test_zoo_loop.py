"""The training-loop zoo in CI (decompshard/check/loop.py): 3 steps of the zoo's Llama
(2 decoder layers) on 4 gloo processes with `enable()`, forward, loss, backward,
`clip_grad_norm_`, AdamW, each step's loss, total norm and every parameter against one
device. One run per parallelism, the optimizer and clipping variants spread over them:
FSDP2 + tensor parallel in torchtitan's order (its clipping spans two meshes: torch
alone raises), FSDP2 alone, DTensor data parallel (torch alone has no strategy for CPU
SDPA) and Megatron tensor parallel. The check is shown to fail: the same loop with the
learning rate off by 1% is WRONG. Even batches: no fence warns. Tensor parallel once more
with the forward and loss under torch.compile (static shapes), its graphs' collectives
Megatron's; data parallel compiled with the sequence shorter at each step (torch
recompiles with a symbolic length), its graphs' collectives the static compile's. The whole matrix, with torch alone beside it, times and the symbolic compile
modes: `python bench/zoo_loop.py`.
"""

from __future__ import annotations

import time

import pytest
import torch

from decompshard.check.loop import MAX_NORM, VARIANTS
from decompshard.check.loop_run import merge_ranks, render, run_group

RUNS = [
    ["fsdp-tp", "foreach/foreach", True, 3, 0.0],
    ["fsdp", "fused/for-loop", True, 3, 0.0],
    ["dp", "for-loop/foreach", True, 3, 0.0],
    ["tp", "foreach/for-loop", True, 3, 0.0],
    ["tp+compile", "foreach/foreach", True, 3, 0.0],  # the forward and loss compiled (static, aot_eager)
    ["dp+seqlen", "foreach/foreach", True, 3, 0.0],  # compiled, 8 then 6 and 4 tokens: a symbolic length
    ["fsdp-tp", "for-loop/for-loop", True, 2, 1e-2],  # sabotaged: the check must fail
]


# each compiled graph's collectives (forward, backward): tensor parallel Megatron's
# all-reduces; data parallel transformers' mask gathering the batch-sharded position ids
# (two all-gathers) and the loss's all-reduce, nothing in backward (the gradients are
# reduced outside the graph). +seqlen compiles twice: static at 8 tokens, then symbolic.
COMPILED_GRAPHS = {
    "tp": ["forward: all_reduce x4", "backward: all_reduce x10"],
    "dp": ["forward: all_gather_into_tensor x2, all_reduce x1", "backward: none"],
}


@pytest.fixture(scope="module")
def rows():
    t0 = time.perf_counter()
    out = run_group(RUNS, deadline=520.0, warm=False)
    print(f"\ntraining-loop zoo, {len(RUNS)} runs on 4 gloo processes: {time.perf_counter() - t0:.1f} s")
    print(render(out))
    return out


@pytest.mark.parametrize("i", range(len(RUNS) - 1), ids=[f"{r[0]}-{r[1]}" for r in RUNS[:-1]])
def test_loop_matches_one_device_every_step(rows, i):
    row = rows[i]
    assert (row["parallelism"], row["variant"], row["path"]) == (RUNS[i][0], RUNS[i][1], "enable")
    assert row["verdict"] == "OK", f"{row['verdict']} ({row['stage']}): {row['detail']}"
    assert row["ranks"] == 4 and row["worst"] < 1e-6, row  # every rank compared every step
    assert row["clipped"], f"the total norm stayed under {MAX_NORM}: clipping was not exercised"
    assert row["first_s"] and row["later_s"], row
    if "+" in row["parallelism"]:  # the graphs AOT autograd made: a symbolic length moves what static ones do
        graphs = COMPILED_GRAPHS[row["parallelism"].split("+")[0]]
        assert row["graphs"] == graphs * (2 if row["parallelism"].endswith("+seqlen") else 1), row["graphs"]


def test_even_batches_warn_of_no_fence(rows):
    """Each fence warns only where it changed a number (runtime/fences/changed.py). A
    compiled graph has no values to compare: there a fence says what it runs instead
    (2.13's nll_loss mean-of-means fence, in the compiled data-parallel loss)."""
    assert {r["parallelism"]: r["warnings"] for r in rows[:-1] if r["warnings"] and "+" not in r["parallelism"]} == {}
    compiled = [w for r in rows[:-1] if "+" in r["parallelism"] for w in r["warnings"]]
    assert all("decompshard guard" in w for w in compiled), compiled


def test_a_perturbed_learning_rate_is_wrong_at_the_first_step(rows):
    row = rows[-1]
    assert row["verdict"] == "WRONG" and row["step"] == 1 and row["detail"].startswith("param"), row


def test_merge_takes_the_worst_rank_and_counts_warnings():
    def one(verdict, first, warned):
        return {"parallelism": "dp", "variant": "foreach/foreach", "path": "enable", "verdict": verdict,
                "detail": verdict.lower(), "stage": "", "step": None, "first_s": first, "later_s": first / 2,
                "worst": first / 10, "clipped": True, "warnings": warned}

    row = merge_ranks([one("OK", 1.0, ["w"]), one("WRONG", 2.0, ["w", "v"]), one("OK", 1.5, [])])
    assert (row["verdict"], row["detail"], row["first_s"], row["worst"]) == ("WRONG", "wrong", 2.0, 0.2)
    assert row["warnings"] == {"w": 2, "v": 1} and row["ranks"] == 3
    table = render([row, {**row, "path": "torch", "verdict": "OK", "warnings": {}}])
    assert "| dp " in table and "Failures:" in table and "- w: dp foreach/foreach (2 ranks)" in table, table


def test_variants_cover_every_optimizer_and_clipping():
    assert {(v.optimizer, v.clip_foreach) for v in VARIANTS.values()} == {
        (o, c) for o in ("foreach", "for-loop", "fused") for c in (True, False)}


def test_fold_keeps_the_worst_verdict_and_the_fastest_times():
    from decompshard.check.loop_run import fold

    def one(verdict, first, warned):
        return {"parallelism": "tp", "variant": "fused/foreach", "path": "torch", "verdict": verdict,
                "detail": verdict, "stage": "", "step": None, "first_s": first, "later_s": None, "first_cpu_s": first,
                "later_cpu_s": None, "worst": first, "clipped": True, "warnings": warned}

    rows = fold([one("OK", 2.0, {"w": 4}), one("ERROR", 1.0, {}), {**one("OK", 3.0, {}), "path": "enable"}])
    assert [(r["path"], r["verdict"], r["first_s"], r["worst"], r["warnings"]) for r in rows] == [
        ("torch", "ERROR", 1.0, 2.0, {"w": 4}), ("enable", "OK", 3.0, 3.0, {})]


def test_compile_modes_name_a_parallelism_and_its_compile():
    from decompshard.check.loop import COMPILE_MODES, PARALLELISMS, split_mode

    assert split_mode("fsdp-tp") == ("fsdp-tp", "")
    assert {split_mode(f"{p}{m}") for p in PARALLELISMS for m in COMPILE_MODES} == {
        (p, m) for p in PARALLELISMS for m in COMPILE_MODES}


def test_seqlen_mode_shortens_the_sequence_at_every_step():
    from decompshard.check.loop import _at_length, _lengths

    assert _lengths("+seqlen", 4) == [8, 6, 4, 8] and _lengths("+dynamic", 2) == [None, None]
    x = torch.arange(16).reshape(2, 8)
    assert torch.equal(_at_length({"ids": x}, 6)["ids"], x[:, :6]) and _at_length({"ids": x}, None)["ids"] is x


def test_mark_dynamic_inputs_compile_once_for_two_lengths():
    """The +mark_dynamic mode's inputs: a second sequence length reuses the first graph
    (a symbolic length), where unmarked inputs of a static compile recompile."""
    from torch._dynamo.testing import CompileCounter

    from decompshard.check.loop import _at_length

    x = torch.randn(2, 8)
    for marked, frames in ((True, 1), (False, 2)):
        torch._dynamo.reset()
        counter = CompileCounter()
        f = torch.compile(lambda t: (t * 2).sum(-1), backend=counter, dynamic=None if marked else False)
        for length in (8, 6):
            f(_at_length({"x": x}, length, mark_dynamic=marked)["x"])
        assert counter.frame_count == frames, (marked, counter.frame_count)


def test_graph_collectives_count_functional_collectives_not_waits():
    from decompshard.check.loop import graph_collectives

    def f(x):
        c10d = torch.ops._c10d_functional
        y = c10d.wait_tensor.default(c10d.all_reduce.default(x, "sum", "0"))
        z = c10d.wait_tensor.default(c10d.all_gather_into_tensor.default(y, 2, "0"))
        return c10d.wait_tensor.default(c10d.all_reduce.default(z * 2, "sum", "0"))

    assert graph_collectives("backward", torch.fx.symbolic_trace(f)) == \
        "backward: all_gather_into_tensor x1, all_reduce x2"
    assert graph_collectives("forward", torch.fx.symbolic_trace(lambda x: x + 1)) == "forward: none"
