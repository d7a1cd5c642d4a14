"""Numerical ground truth for single-dim sharding rules.

A rule "S(1), S(0) -> P(sum)" for an op claims: on a 1-D mesh of W ranks, if each tensor
input has the given placement, running the ORIGINAL op (same non-tensor arguments) on
each rank's local inputs yields local outputs that, combined per the output placements,
equal the single-device result. We test exactly that, on the caller's real tensors, with
plain per-rank tensors (see `rank_sim`). A passing check is evidence at these shapes and
values, never a proof; everything is arranged so that a wrong rule is very unlikely to
pass (float64, tight tolerance, several random Partial draws plus a mirrored one, and
derived data samples). Cost: input combos x draws x W x samples (up to 7) op calls.

World sizes and [even]: a rule without [even] must pass at every W in `world_sizes`, and
when none of those W splits a sharded input dim unevenly we add one "probe" W (the
smallest in 2..8 that does), because otherwise an even-only rule would pass unnoticed. A
rule with [even] is tested only at the W that split every sharded input dim evenly.

Public entry points: `run_rule_on_ranks` (one W, one draw), `check_rule`,
`ground_truth` (every valid rule at these shapes) and `check_rules` (claimed vs truth).
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch

from decompshard.verify.rank_sim import Draw, OpCase, check_output, draw_schedule, input_alphabet, output_alphabet
from decompshard.placements import MaybePlacement, Partial, R, SingleDimRule, placement_class

PROBE_WORLD_SIZES = range(2, 9)
RECALL_CLASSES = ("R/S", "P(sum)", "P(avg|max|min)")


@dataclass(frozen=True)
class RuleCheck:
    """Verdict on one rule: ok is True (valid), False (invalid) or None (untestable)."""

    ok: bool | None
    reason: str
    rule: SingleDimRule | None = None
    world_sizes: tuple[int, ...] = ()  # the W actually tested


@dataclass
class GroundTruth:
    """Every rule that holds numerically for this op call (all-R-input rules excluded)."""

    valid: list[SingleDimRule]  # pass at every tested W, uneven shards included
    even_only: list[SingleDimRule]  # fail at some uneven W, pass at every even W (even_only=True)
    exhaustive: bool  # False when max_combos forced a restricted input enumeration
    combos_tested: int
    world_sizes: tuple[int, ...]
    untestable: str | None = None  # why nothing could be tested (random op, op raises)
    samples: tuple[str, ...] = ()  # data samples every rule was checked on ("base", "ties", ...)
    dropped_samples: tuple[str, ...] = ()  # variants left out, with why (the op raised, or its kernel
    # disagrees with itself across memory layouts on them)

    @property
    def rules(self) -> list[SingleDimRule]:
        return self.valid + self.even_only


@dataclass
class VerifyReport:
    """Claimed rules judged against the numerics, plus what the claims missed."""

    confirmed: list[SingleDimRule]
    incorrect: list[tuple[SingleDimRule, str]]
    untestable: list[tuple[SingleDimRule, str]]
    missed: list[SingleDimRule]
    weaker: list[SingleDimRule]  # claimed [even], truth holds unconditionally (also confirmed)
    precision: float | None  # confirmed / (confirmed + incorrect)
    recall: float | None  # ground-truth rules matched by a claim / ground-truth rules
    recall_by_class: dict[str, float | None]
    exhaustive: bool
    ground_truth: GroundTruth | None = field(default=None, repr=False)


def _one_thread(fn: Callable) -> Callable:
    """Run with one intra-op thread (restored after): the tensors are tiny, and on a
    busy machine thread-pool hand-offs made a 0.1 s ground truth take several seconds."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        n = torch.get_num_threads()
        if n == 1:
            return fn(*args, **kwargs)
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(n)

    return wrapper


# ------------------------------------------------------------------ world sizes


def _plan_world_sizes(case: OpCase, inputs: Sequence[MaybePlacement], world_sizes: Sequence[int]) -> tuple[list[int], set[int]]:
    """(every W to test, the subset where each sharded input dim splits evenly).

    Adds a probe W when all requested W split evenly, so "unconditional" is never
    concluded without seeing an uneven (possibly empty) shard.
    """
    sizes = case.sharded_sizes(inputs)
    ws = list(dict.fromkeys(int(w) for w in world_sizes))
    even = {w for w in ws if all(s % w == 0 for s in sizes)}
    if sizes and len(even) == len(ws):
        probe = next((w for w in PROBE_WORLD_SIZES if w not in ws and any(s % w for s in sizes)), None)
        if probe is not None:
            ws.append(probe)
    return ws, even


def _judge(case: OpCase, outs_by_sample, world_size: int, j: int, q: MaybePlacement) -> str | None:
    """Why output j does not combine under q on some sample; None if it does on all."""
    for sample, outs in outs_by_sample:
        why = check_output(sample.ref_all[j], [o[j] for o in outs], q, world_size, sample.partial_where_finite)
        if why:
            return why if sample.name == "base" else f"{why} (on the {sample.name} sample)"
    return None


def _passing_outputs(case: OpCase, inputs, world_size: int, draws: Sequence[Draw], alive: list[set]) -> tuple[list[set], str]:
    """Per output, the placements among `alive` that hold at this W for every draw and sample."""
    sets = [set(a) for a in alive]
    for draw in draws:
        outs_by_sample = []
        for sample in case.samples:
            outs = case.run(sample, inputs, world_size, draw)
            if isinstance(outs, str):
                where = "" if sample.name == "base" else f" (on the {sample.name} sample)"
                return [set() for _ in sets], f"W={world_size}: {outs}{where}"
            outs_by_sample.append((sample, outs))
        n_out = len(sets)
        for i in case.mutated:  # an input changed in place must still match its placement
            why = _judge(case, outs_by_sample, world_size, n_out + i, inputs[i])
            if why:
                return [set() for _ in sets], f"W={world_size} draw={draw}: input {i} after the call {why}"
        for j, s in enumerate(sets):
            bad = {q: _judge(case, outs_by_sample, world_size, j, q) for q in s}
            sets[j] = {q for q, why in bad.items() if why is None}
            if not sets[j]:
                why = next(iter(bad.values()), "no placement is consistent")
                return [set() for _ in sets], f"W={world_size} draw={draw}: output {j} {why}"
    return sets, ""


# ------------------------------------------------------------------ single rules


def _check(case: OpCase, rule: SingleDimRule, world_sizes: Sequence[int], draws: int, seed: int) -> RuleCheck:
    if case.untestable:
        return RuleCheck(None, case.untestable, rule)
    err = case.rule_error(rule.inputs, rule.outputs)
    if err:
        return RuleCheck(False, err, rule)
    ws, even = _plan_world_sizes(case, rule.inputs, world_sizes)
    targets = [w for w in ws if w in even] if rule.even_only else ws
    if not targets:
        return RuleCheck(None, f"[even] rule, but no W in {tuple(world_sizes)} splits sharded dims "
                               f"{case.sharded_sizes(rule.inputs)} evenly", rule)
    schedule = draw_schedule(rule.inputs, draws, seed, [x.numel() for x in case.inputs])
    for w in targets:
        sets, why = _passing_outputs(case, rule.inputs, w, schedule, [{q} for q in rule.outputs])
        if not all(sets):
            return RuleCheck(False, why, rule, tuple(targets))
    return RuleCheck(True, f"holds at W={targets}", rule, tuple(targets))


@_one_thread
def run_rule_on_ranks(op: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None,
                      rule: SingleDimRule, world_size: int, *, seed: int = 0, flipped: bool = False) -> RuleCheck:
    """Check `rule` at one world size with one draw of Partial parts (`seed`, `flipped`).

    The building block, exposed for debugging a single verdict; it ignores [even] (the
    caller picked W). Use `check_rule` for a verdict you can rely on.
    """
    case = OpCase(op, args, kwargs)
    if case.untestable:
        return RuleCheck(None, case.untestable, rule)
    err = case.rule_error(rule.inputs, rule.outputs)
    if err:
        return RuleCheck(False, err, rule)
    sets, why = _passing_outputs(case, rule.inputs, world_size, [(seed, flipped)], [{q} for q in rule.outputs])
    if not all(sets):
        return RuleCheck(False, why, rule, (world_size,))
    return RuleCheck(True, f"holds at W={world_size} for draw {(seed, flipped)}", rule, (world_size,))


@_one_thread
def check_rule(op: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None, rule: SingleDimRule,
               *, world_sizes: Sequence[int] = (2, 3), draws: int = 3, seed: int = 0) -> RuleCheck:
    """Verdict on one rule at the given inputs: valid at every planned W and draw, or not.

    `draws` counts Partial draws including the mirrored one (at least 3 are used).
    """
    return _check(OpCase(op, args, kwargs), rule, world_sizes, draws, seed)


@_one_thread
def check_rules_at(op: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None,
                   rules: Sequence[tuple[SingleDimRule, Sequence[int]]], *, draws: int = 3,
                   seed: int = 0) -> list[RuleCheck]:
    """Verdicts on rules, each at exactly the world sizes given with it (no probe W, and
    [even] ignored): for judging someone else's rules under their own conditions, e.g.
    DTensor's, which it applies whenever every sharded dim has at least W elements.
    One `OpCase` (reference runs on every data sample) serves all the rules."""
    case = OpCase(op, args, kwargs)
    out = []
    for rule, world_sizes in rules:
        if case.untestable:
            out.append(RuleCheck(None, case.untestable, rule))
            continue
        err = case.rule_error(rule.inputs, rule.outputs)
        if err:
            out.append(RuleCheck(False, err, rule))
            continue
        ws = tuple(dict.fromkeys(int(w) for w in world_sizes))
        if not ws:
            out.append(RuleCheck(None, "no world size to test", rule))
            continue
        schedule = draw_schedule(rule.inputs, draws, seed, [x.numel() for x in case.inputs])
        verdict = RuleCheck(True, f"holds at W={list(ws)}", rule, ws)
        for w in ws:
            sets, why = _passing_outputs(case, rule.inputs, w, schedule, [{q} for q in rule.outputs])
            if not all(sets):
                verdict = RuleCheck(False, why, rule, (w,))
                break
        out.append(verdict)
    return out


# ------------------------------------------------------------------ ground truth


def _input_combos(case: OpCase, candidates: Iterable[SingleDimRule], max_combos: int) -> tuple[list[tuple], bool]:
    """Input placement combos to try (all-R excluded) and whether that is all of them."""
    alph = [input_alphabet(x) for x in case.inputs]
    total = 1
    for a in alph:
        total *= len(a)
    if total - 1 <= max_combos:
        combos = list(itertools.product(*alph))
        exhaustive = True
    else:  # few non-R inputs, one placement per rank group, and whatever was claimed
        n, combos, exhaustive = len(alph), [], False
        base = [alph[i][0] for i in range(n)]
        for k in (1, 2):
            for idx in itertools.combinations(range(n), k):
                for ps in itertools.product(*(alph[i][1:] for i in idx)):
                    c = list(base)
                    for i, p in zip(idx, ps):
                        c[i] = p
                    combos.append(tuple(c))
        groups: dict[int, list[int]] = {}
        for i, x in enumerate(case.inputs):
            groups.setdefault(x.dim(), []).append(i)
        choices = [list(dict.fromkeys(p for i in g for p in alph[i])) for g in groups.values()]
        for pick in itertools.product(*choices):
            c = list(base)
            for g, p in zip(groups.values(), pick):
                for i in g:
                    c[i] = p if p in alph[i] else base[i]
            combos.append(tuple(c))
        for r in candidates:
            if len(r.inputs) == n and all(p in a for p, a in zip(r.inputs, alph)):
                combos.append(tuple(r.inputs))
    combos = [c for c in dict.fromkeys(combos) if any(p != R for p in c)]
    return combos, exhaustive


def _classify(case: OpCase, inputs: tuple, world_sizes, draws: int, seed: int,
              prune_implied: bool = True) -> tuple[list[tuple], list[tuple]]:
    """(output tuples valid at every W, output tuples valid only at even W) for one combo.

    Each output is judged on its own (a rule holds at W iff each of its output
    placements does), so the op runs once per (W, draw) however many outputs exist.
    With `prune_implied`, an output that can be R does not also list P(avg|max|min):
    identical values on every rank trivially satisfy those, and R is strictly better
    (an empty output, which satisfies everything, lists only R).
    """
    ws, even = _plan_world_sizes(case, inputs, world_sizes)
    schedule = draw_schedule(inputs, draws, seed, [x.numel() for x in case.inputs])
    alphabets = [output_alphabet(ref) for ref in case.ref_leaves]
    all_sets = [set(a) for a in alphabets]
    even_sets = [set(s) for s in all_sets] if even else None
    for w in sorted(ws, key=lambda w: w not in even):  # even W first
        is_even = w in even
        alive = [a | e for a, e in zip(all_sets, even_sets)] if is_even else all_sets
        if not all(alive):
            break
        passed, _ = _passing_outputs(case, inputs, w, schedule, alive)
        all_sets = [a & p for a, p in zip(all_sets, passed)]
        if is_even:
            even_sets = [e & p for e, p in zip(even_sets, passed)]

    def ordered(sets: list[set]) -> list[list]:
        out = []
        for alpha, s, ref in zip(alphabets, sets, case.ref_leaves):
            if prune_implied and R in s:
                s = {q for q in s if not (isinstance(q, Partial) and q.reduce_op != "sum")}
                if ref.numel() == 0:  # an empty output satisfies every placement
                    s = {R}
            out.append([q for q in alpha if q in s])
        return out

    valid = list(itertools.product(*ordered(all_sets)))
    if not even_sets:
        return valid, []
    vs = set(valid)
    return valid, [o for o in itertools.product(*ordered(even_sets)) if o not in vs]


def _ground_truth(case: OpCase, world_sizes, candidates, max_combos: int, draws: int, seed: int) -> GroundTruth:
    ws = tuple(world_sizes)
    if case.untestable:
        return GroundTruth([], [], False, 0, ws, case.untestable)
    combos, exhaustive = _input_combos(case, candidates or (), max_combos)
    valid, even_only = [], []
    for c in combos:
        v, e = _classify(case, c, world_sizes, draws, seed)
        valid += [SingleDimRule(c, o, False, "ground_truth") for o in v]
        even_only += [SingleDimRule(c, o, True, "ground_truth") for o in e]
    return GroundTruth(valid, even_only, exhaustive, len(combos), ws, None,
                       tuple(s.name for s in case.samples), tuple(case.dropped))


@_one_thread
def ground_truth(op: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None, *,
                 world_sizes: Sequence[int] = (2, 3), candidates: Iterable[SingleDimRule] | None = None,
                 max_combos: int = 4000, draws: int = 3, seed: int = 0) -> GroundTruth:
    """Every non-trivial single-dim rule that holds numerically for this op call.

    Input combos range over R, S(d) and (float inputs only) each P; rules whose tensor
    inputs are all R are left out (implied, or useless R -> P variants). Above
    `max_combos` combos the search is restricted (see `_input_combos`) and
    `exhaustive` is False.
    """
    return _ground_truth(OpCase(op, args, kwargs), world_sizes, candidates, max_combos, draws, seed)


# ------------------------------------------------------------------ claimed vs truth


def rule_classes(rule: SingleDimRule) -> set[str]:
    """Recall classes of a rule, by its input placements (a rule may be in two)."""
    cls = {placement_class(p) for p in rule.inputs}
    out = set()
    if "P(sum)" in cls:
        out.add("P(sum)")
    if cls & {"P(avg)", "P(max)", "P(min)"}:
        out.add("P(avg|max|min)")
    return out or {"R/S"}


@_one_thread
def check_rules(op: Callable[..., Any], args: Sequence[Any], kwargs: dict[str, Any] | None,
                rules: Iterable[SingleDimRule], *, world_sizes: Sequence[int] = (2, 3), find_missing: bool = True,
                draws: int = 3, seed: int = 0, max_combos: int = 4000) -> VerifyReport:
    """Judge claimed rules (precision) and, with `find_missing`, compare to ground truth.

    Matching is by `(inputs, outputs)`: a truth rule that holds unconditionally but was
    claimed [even] counts as confirmed (and is listed in `weaker`); a truth [even] rule
    claimed without [even] is incorrect (it fails at an uneven W).
    """
    case = OpCase(op, args, kwargs)
    claimed = list(dict.fromkeys(rules))
    truth = _ground_truth(case, world_sizes, claimed, max_combos, draws, seed) if find_missing else None
    truth_valid = {r.key() for r in truth.valid} if truth else set()
    confirmed, incorrect, untestable, weaker = [], [], [], []
    for rule in claimed:
        res = _check(case, rule, world_sizes, draws, seed)
        if rule.even_only and rule.key() in truth_valid:
            weaker.append(rule)
            res = RuleCheck(True, "holds unconditionally; claimed only [even]", rule)
        if res.ok:
            confirmed.append(rule)
        elif res.ok is False:
            incorrect.append((rule, res.reason))
        else:
            untestable.append((rule, res.reason))
    tested = len(confirmed) + len(incorrect)
    precision = len(confirmed) / tested if tested else None
    missed: list[SingleDimRule] = []
    by_class: dict[str, list[int]] = {c: [0, 0] for c in RECALL_CLASSES}
    if truth is not None and not truth.untestable:
        ok = {(r.key(), r.even_only) for r in confirmed}
        for t in truth.rules:
            hit = (t.key(), False) in ok or (t.key(), True) in ok if not t.even_only else (t.key(), True) in ok
            if not hit:
                missed.append(t)
            for c in rule_classes(t):
                by_class[c][0] += hit
                by_class[c][1] += 1
    n_truth = len(truth.rules) if truth and not truth.untestable else 0
    recall = (n_truth - len(missed)) / n_truth if n_truth else None
    return VerifyReport(
        confirmed=confirmed, incorrect=incorrect, untestable=untestable, missed=missed, weaker=weaker,
        precision=precision, recall=recall,
        recall_by_class={c: (h / n if n else None) for c, (h, n) in by_class.items()},
        exhaustive=truth.exhaustive if truth else False, ground_truth=truth,
    )
