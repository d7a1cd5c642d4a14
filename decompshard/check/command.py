"""`decompshard check`: does DTensor with enable() give one-device numbers?

    decompshard check                                   # every derived op, meshes 6 / 2x3 / 2x2x2
    decompshard check --ops "aten.addmv.default,aten.block_diag.*" --mesh 2x3 --combos 12
    decompshard check --ops aten.addmv.default --sample 0 --mesh 2x3 --placements "R,P(sum);S(1),S(0);S(0),R"
    decompshard check --import mypkg.kernels --ops mylib.rmsnorm.default --shapes "8,16;16;" --args 1e-6
    decompshard check --model mypkg.models:build --input-shapes 8,16 --mesh 2x2 --placements "S(0),R"
    decompshard check --model llama --sharding dp-uneven,2d     # the model zoo (check/zoo.py)
    decompshard check --model all                               # every zoo model, every sharding
    decompshard check --format json --output check.json

Placements, per tensor input ';'-separated, per mesh dim ','-separated, in the placement
grammar `explain --mesh-placements` and rule strings share (placements.py): R, S(d),
P(sum|avg|max|min), _S(d,k) (_StridedShard(d, split_factor=k); SS(d,k) is read too).

Exit codes: 0 nothing counts against decompshard (no WRONG, no error where torch's own
fallback runs the case or --no-torch skipped it, no internal error of decompshard's
that enable() caught and ran the op replicated for), 3 something does (each failure
printed with a reproducer), 2 bad arguments (or a model library that is not installed:
the line names the package). The zoo (--model NAME|all): 3 when any
case with enable() is WRONG or an ERROR (an internal error included), whatever torch
alone does. Every op that ran replicated instead of derived is reported, with why.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

EXIT_FAILURES = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Runtime check: real DTensors on simulated meshes, with decompshard and with torch's "
                          "own fallback, forward and backward, against one device.")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "examples:\n" + __doc__.split("\n\n")[1] + "\n\n" + __doc__.split("\n\n")[3]
    parser.add_argument("--ops", metavar="PATTERNS",
                        help="comma-separated globs or exact names; default: every op decompshard derives "
                        "(no DTensor strategy, a decomposition, reached by OpInfo samples or their backward)")
    parser.add_argument("--mesh", default="1d,2d,3d", metavar="MESHES",
                        help="comma-separated mesh shapes such as 6, 2x3, 2x2x2 (or 1d, 2d, 3d for those); "
                        "default 1d,2d,3d")
    parser.add_argument("--combos", type=int, default=6, help="random placement combinations per sample and mesh")
    parser.add_argument("--samples", type=int, default=2, help="OpInfo samples per op, largest first (default 2)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the placement draw (default 0)")
    parser.add_argument("--placements", metavar="TEXT",
                        help="run one case with these placements (needs one op, --sample and one --mesh)")
    parser.add_argument("--sample", type=int, default=None, help="with --placements: which sample (0 = largest)")
    parser.add_argument("--shapes", metavar="SHAPES",
                        help="with one exact op in --ops: run it on random inputs of these shapes instead of OpInfo "
                        "samples (the op's only sample, number 0), as explain takes them: one ';'-separated entry "
                        "per positional arg, empty for a non-tensor arg given in --args. The way to check a custom "
                        "op (--import the module defining it), e.g. --import mypkg.kernels --ops "
                        "mylib.rmsnorm.default --shapes '8,16;16;' --args 1e-6")
    parser.add_argument("--args", dest="op_args", default="", metavar="ARGS",
                        help="with --shapes: non-tensor positional args as comma-separated Python literals")
    parser.add_argument("--kwargs", dest="op_kwargs", default="", metavar="KWARGS",
                        help="with --shapes: keyword args as Python literals, e.g. 'keepdim=True'")
    parser.add_argument("--dtype", default="float32", help="with --shapes: dtype of every tensor (default float32)")
    parser.add_argument("--no-backward", action="store_true", help="forward only")
    parser.add_argument("--no-torch", action="store_true", help="skip torch's own fallback (half the time)")
    parser.add_argument("--model", metavar="NAME|all|MODULE:CALLABLE",
                        help="check one training step of a model. A zoo name (llama, bert-mlm, resnet, ...; "
                        "'all'), a transformers class name (LlamaConfig, Qwen2ForCausalLM) or, with --sharding, "
                        "a MODULE:CALLABLE taking (batch, seed) and returning a check.zoo.Built: the zoo's "
                        "shardings, enable() and torch alone, against one device. A MODULE:CALLABLE without "
                        "--sharding returns an nn.Module or (module, example_inputs), checked on one --mesh with "
                        "--placements, naming the first op that diverges")
    parser.add_argument("--sharding", metavar="NAMES",
                        help="with a zoo --model: comma-separated among dp, dp-uneven, tp, tp-local, 2d, 2d-uneven "
                        "(default: all)")
    parser.add_argument("--input-shapes", metavar="SHAPES", help="with --model: ';'-separated input shapes")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="report format (default text)")
    parser.add_argument("--output", "-o", metavar="FILE", help="write the report here instead of stdout")
    parser.add_argument("--jobs", "-j", type=int, default=min(os.cpu_count() or 1, 8),
                        help="worker processes (default: CPU count, at most 8; 0: in this process)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per op, or per zoo case and path (default 600)")


def _meshes(text: str) -> list[tuple[int, ...]]:
    """--mesh: comma-separated shapes or aliases; a bad one names every accepted form."""
    from decompshard.errors import UsageError
    from decompshard.verify.dtensor_case import MESHES, parse_mesh

    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            out.append(parse_mesh(part))
        except ValueError as e:
            aliases = ", ".join(f"{k} (= {'x'.join(map(str, v))})" for k, v in MESHES.items())
            raise UsageError(f"--mesh: {e}, or an alias: {aliases}") from None
    return out


def run(args: argparse.Namespace) -> int:
    from decompshard.errors import UsageError

    for name in ("combos", "samples"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be >= 1")
    meshes = _meshes(args.mesh)
    if not meshes:
        raise UsageError("--mesh is empty")
    if args.model and (":" not in args.model or args.sharding):
        return _zoo(args)
    if args.model:
        from decompshard.check.model import check_model

        return check_model(args.model, args.input_shapes, meshes, args.placements, args)
    if args.placements is not None:
        return _one_case(args, meshes)
    doc = _sweep(args, meshes)
    _emit(json.dumps(doc, indent=1) if args.format == "json" else render(doc), args.output)
    return EXIT_FAILURES if doc["summary"]["failures"] else 0


def _zoo(args: argparse.Namespace) -> int:
    """The model zoo's table for the models and shardings asked (each case in a worker
    process with --timeout seconds), failures listed under it."""
    from decompshard.check.model import SHARDINGS
    from decompshard.check.zoo import get_entry
    from decompshard.check.zoo_run import against_us, comm_lines, expand_names, render, run_zoo

    from decompshard.check.ecosystem import import_library

    names = expand_names(args.model)
    for n in names:  # an unknown name or a missing library is a usage error before any worker starts
        if ":" not in n:
            entry = get_entry(n)
            import_library(entry.family, f"the zoo's {entry.name}")
    shardings = [s.strip() for s in (args.sharding or ",".join(SHARDINGS)).split(",") if s.strip()]
    quiet = getattr(args, "verbosity", 0) < 0

    def progress(row: dict) -> None:
        if not quiet:
            print(f"check: {row['model']} {row['sharding']}: enable() {row['enable']['verdict']}, torch "
                  f"{row['torch']['verdict'] if row['torch'] else '-'}", file=sys.stderr, flush=True)

    rows = run_zoo(names, shardings, jobs=args.jobs, timeout=args.timeout, seed=args.seed,
                   with_torch=not args.no_torch, on_row=progress)
    text = render(rows)
    if getattr(args, "verbosity", 0) > 0:  # -v: where each case's bytes went
        text += "\n\n" + "\n".join(comm_lines(rows))
    _emit(json.dumps(rows, indent=1) if args.format == "json" else text, args.output)
    return EXIT_FAILURES if against_us(rows) else 0


def _samples_for(patterns: str | None, n: int, progress: bool) -> list[tuple[Any, list]]:
    from decompshard.coverage.op_select import select_ops
    from decompshard.coverage.opinfo_samples import capture_aten_samples, decomp_only_ops, has_dtensor_strategy
    from decompshard.coverage.sweep import pick_samples
    from decompshard.dispatch_modes.decomps import PROJECT_DECOMPOSITIONS

    if progress:
        print("check: capturing aten calls from torch's OpInfo samples...", file=sys.stderr, flush=True)
    captured = capture_aten_samples(backward=True)  # the backward ops a training step reaches, too
    # torch's decomp-only set, plus the ops decompshard writes a decomposition for
    # (searchsorted, scatter_reduce, ...): every op decompshard derives
    derived = sorted(set(decomp_only_ops(captured)) | {
        op for op in captured if op in PROJECT_DECOMPOSITIONS and not has_dtensor_strategy(op)}, key=str)
    ops = select_ops(patterns, derived) if patterns else derived
    return [(op, pick_samples(captured.get(op, []), n)) for op in ops if captured.get(op)]


@dataclass(frozen=True)
class _GivenSample:
    args: tuple
    kwargs: dict


def _given_sample(args: argparse.Namespace) -> list[tuple[Any, list]]:
    """--shapes/--args/--kwargs/--dtype: the one sample of the one op in --ops, random
    values of the shapes given (always the same: a reproducer line rebuilds them),
    checked against the op's schema as explain checks them."""
    import torch
    from decompshard._compat import tree_map

    from decompshard.errors import UsageError
    from decompshard.explain.command import build_call
    from decompshard.dispatch_modes.reference import random_like

    if not args.ops or any(c in args.ops for c in ",*?["):
        raise UsageError("--shapes gives one op's inputs: name one exact op in --ops")
    call = build_call(args.ops, args.shapes, args.op_args, args.dtype, args.op_kwargs)
    gen = torch.Generator().manual_seed(0)
    real = tree_map(lambda x: random_like(x, "cpu", gen) if isinstance(x, torch.Tensor) else x,
                    (call.args, call.kwargs))
    return [(call.op, [_GivenSample(*real)])]


def _op_samples(args: argparse.Namespace, n: int) -> list[tuple[Any, list]]:
    """(op, samples) to check: the --shapes sample, or up to `n` OpInfo samples per op."""
    from decompshard.errors import UsageError

    if args.shapes is not None:
        return _given_sample(args)
    if args.op_args or args.op_kwargs:
        raise UsageError("--args and --kwargs go with --shapes")
    if args.ops and not any(c in args.ops for c in "*?[") and all(
            _namespace(name) not in ("aten", "prims") for name in args.ops.split(",") if name.strip()):
        raise UsageError(f"--ops {args.ops}: a custom op has no OpInfo samples; give its inputs with --shapes")
    per_op = _samples_for(args.ops, n, getattr(args, 'verbosity', 0) >= 0)
    if args.ops and not per_op:  # never an empty, successful check
        raise UsageError(f"--ops {args.ops}: no OpInfo sample reaches it; give its inputs with --shapes "
                         "(a custom op: --import the module defining it)")
    return per_op


def _namespace(name: str) -> str:
    parts = name.strip().replace("::", ".").removeprefix("torch.ops.").split(".")
    return parts[0] if len(parts) >= 3 else "aten"  # 'addmv.default' is aten's


def _sweep(args: argparse.Namespace, meshes: list) -> dict[str, Any]:
    from decompshard.check.sweep import check_ops, summarize

    t0 = time.perf_counter()
    per_op = _op_samples(args, args.samples)
    done = [0]

    def step(name: str) -> None:
        done[0] += 1
        if getattr(args, 'verbosity', 0) >= 0:
            print(f"check: [{done[0]}/{len(per_op)}] {name}", file=sys.stderr, flush=True)

    records = check_ops(per_op, meshes=meshes, combos=args.combos, seed=args.seed, backward=not args.no_backward,
                        with_torch=not args.no_torch, jobs=args.jobs, timeout=args.timeout, on_op=step)
    given = _given_flags(args)
    for r in records:  # the reproducer rebuilds the same inputs
        r["given"] = given
    summary = summarize(records)
    run_info = {"meshes": ["x".join(map(str, m)) for m in meshes], "combos": args.combos, "samples": args.samples,
                "seed": args.seed, "backward": not args.no_backward, "seconds": round(time.perf_counter() - t0, 1)}
    return {"run": run_info, "summary": summary, "cases": records}


def _given_flags(args: argparse.Namespace) -> str:
    """The --import/--shapes/... flags a reproducer line needs ('' for OpInfo samples)."""
    import shlex

    if args.shapes is None:
        return ""
    parts = [f"--import {shlex.quote(m)}" for m in args.imports]
    parts.append(f"--shapes {shlex.quote(args.shapes)}")
    parts += [f"{flag} {shlex.quote(v)}" for flag, v in
              (("--args", args.op_args), ("--kwargs", args.op_kwargs)) if v]
    if args.dtype != "float32":
        parts.append(f"--dtype {args.dtype}")
    return " ".join(parts)


def _one_case(args: argparse.Namespace, meshes: list) -> int:
    from decompshard.errors import UsageError
    from decompshard.verify.dtensor_case import simulated_world
    from decompshard.check.sweep import run_one

    if len(meshes) != 1 or args.sample is None or not args.ops or any(c in args.ops for c in ",*?["):
        raise UsageError("--placements runs one case: give one exact op in --ops, --sample and one --mesh")
    per_op = _op_samples(args, args.sample + 1)
    if not per_op or len(per_op[0][1]) <= args.sample:
        if args.shapes is not None:
            raise UsageError(f"{args.ops}: --shapes gives one sample, number 0")
        raise UsageError(f"{args.ops}: no OpInfo sample number {args.sample}")
    op, samples = per_op[0]
    sample = samples[args.sample]
    with simulated_world(math.prod(meshes[0])):
        rec = run_one(op, (sample.args, sample.kwargs), args.sample, meshes[0], args.placements, args.seed,
                      backward=not args.no_backward, with_torch=not args.no_torch)
    from dataclasses import asdict

    d = asdict(rec)
    if args.format == "json":
        _emit(json.dumps(d, indent=1), args.output)
    else:
        lines = [f"{d['op']} sample {d['sample']} ({d['shapes']}) on mesh {d['mesh']}: {d['placements']}",
                 f"  decompshard: {_outcome(d['ours'])}"]
        if d["torch"]:
            lines.append(f"  torch:       {_outcome(d['torch'])}")
        lines += [f"  ran replicated ({f['kind']}): {f['op']}: {f['message']}" for f in d["fallbacks"]]
        _emit("\n".join(lines), args.output)
    from decompshard.check.sweep import counts_against_us

    return EXIT_FAILURES if counts_against_us(d) else 0


def _outcome(o: dict) -> str:
    if o["status"] == "ok":
        return "ok"
    return f"{o['status']} ({o['stage']}): {o['detail']}"


def render(doc: dict[str, Any]) -> str:
    from tabulate import tabulate

    from decompshard.check.sweep import internal_errors, reproducer

    s = doc["summary"]
    rows = []
    for mesh, m in sorted(s["by_mesh"].items()):
        rows.append([mesh, m["cases"], m.get("ok", 0), m.get("WRONG", 0), m.get("error", 0), m.get("n/a", 0),
                     m.get("torch_ok", 0), m.get("torch_WRONG", 0), m.get("torch_error", 0)])
    out = [f"decompshard check: {s['ops']} ops, {s['cases']} cases ({doc['run']['seconds']:.0f} s)", "",
           tabulate(rows, headers=["mesh", "cases", "ok", "WRONG", "error", "n/a", "torch ok", "torch WRONG",
                                   "torch error"]), ""]
    out += fallback_lines(s["fallbacks"]) + [""]
    fails = s["failures"]
    out.append(f"against decompshard: {len(fails)} (WRONG, an error where torch's fallback runs the case or was "
               "not run, or an internal error)")
    for r in fails:
        out.append(f"  {r['op']} [{r['shapes']}] mesh {r['mesh']} {r['placements']}: {_outcome(r['ours'])}")
        out += [f"    internal error of decompshard at {f['op']} (ran replicated): {f['message']}"
                for f in internal_errors(r)]
        out.append(f"    torch: {_outcome(r['torch']) if r.get('torch') else '-'}")
        out.append(f"    reproduce: {reproducer(r)}")
    both = s["errors_where_torch_fails_too"]
    if both:
        out.append("")
        out.append(f"errors where torch's fallback fails too: {len(both)} cases in "
                   f"{len({r['op'] for r in both})} ops (first of each op):")
        seen = set()
        for r in both:
            if r["op"] in seen:
                continue
            seen.add(r["op"])
            out.append(f"  {r['op']} mesh {r['mesh']} {r['placements']}: {_outcome(r['ours'])}")
    return "\n".join(out)


def fallback_lines(by_kind: dict[str, dict[str, int]]) -> list[str]:
    """The ops that ran replicated under enable() instead of with a derived strategy, per
    reason (runtime/fallbacks.py), with how many cases each."""
    if not by_kind:
        return ["ran replicated under enable(): none (every op reached ran a native or derived strategy)"]
    out = [f"ran replicated under enable(): {sum(len(ops) for ops in by_kind.values())} ops"]
    for kind, ops in sorted(by_kind.items()):
        names = ", ".join(f"{op} ({n} case{'s' if n > 1 else ''})" for op, n in sorted(ops.items()))
        out.append(f"  {kind}: {len(ops)} ops: {names}")
    return out


def _emit(text: str, output: str | None) -> None:
    if output:
        with open(output, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
