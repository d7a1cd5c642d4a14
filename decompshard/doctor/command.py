"""`decompshard doctor`: what works on this torch, one line per check.

    decompshard doctor                       # hook points, registries, the smoke run (about a minute)
    decompshard doctor --no-smoke            # hook points and registries only (seconds)
    decompshard doctor --model mlp --format json -o doctor.json

For a user on a torch release decompshard has not been tested on: every hook point it
patches or reads (found by feature detection, not by version), the shapes of DTensor's
strategy registries, and a smoke run (derive_rules of a decomposition-only op, that op
on DTensors with enable() against one device, a data-parallel and a tensor-parallel
training step), each OK, MISSING or FAILED with the reason on the same line.

Exit codes: 0 every check OK, 3 something is missing or failed, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = "What works on this torch: DTensor's hook points, its registries, a short smoke run."
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = "examples:\n" + __doc__.split("\n\n")[1] + "\n\n" + __doc__.split("\n\n")[3]
    parser.add_argument("--no-smoke", action="store_true", help="skip the smoke run (hook points and registries only)")
    parser.add_argument("--model", default="llama", metavar="NAME",
                        help="the model of the training steps: a zoo name (default llama; a minimal torch.nn MLP "
                        "when transformers is missing) or 'mlp' (the built-in MLP block)")
    parser.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                        help="deadline of each smoke step, in seconds (default 120)")
    parser.add_argument("--format", choices=("text", "json"), default="text", help="report format (default text)")
    parser.add_argument("--output", "-o", metavar="FILE", help="write the report here instead of stdout")


def run(args: argparse.Namespace) -> int:
    from decompshard.doctor.findings import as_json, exit_code, verdict
    from decompshard.doctor.probes import header
    from decompshard.errors import UsageError

    if args.timeout <= 0:
        raise UsageError("--timeout must be > 0")
    _check_model_name(args.model)  # with --no-smoke too: a misspelled name is never silently ignored
    head = header()
    stream = args.format == "text" and not args.output
    out = _Printer(stream)
    out.text(f"decompshard doctor: decompshard {head['decompshard']}, torch {head['torch']}, "
             f"Python {head['python']}")
    findings = _gather(args, head, out)
    if args.format == "json":
        text = json.dumps(as_json(head, findings), indent=1)
    else:
        out.text("")
        out.text(verdict(findings))
        text = "\n".join(out.lines)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text + "\n")
    elif not stream:
        print(text)
    return exit_code(findings)


def _check_model_name(name: str) -> None:
    """An unknown --model is a usage error (exit 2) before anything runs."""
    from decompshard.errors import UsageError

    if name == "mlp":
        return
    try:
        from decompshard.check.zoo import ZOO, get_entry
    except Exception:  # torch or decompshard does not import: the report says so
        return
    try:
        get_entry(name)
    except ValueError:
        raise UsageError(f"unknown model {name!r}; known: mlp, {', '.join(ZOO)}, or a transformers "
                         "config/causal-LM class name (e.g. LlamaConfig)") from None


def _gather(args: argparse.Namespace, head: dict, out: _Printer) -> list:
    """Every section's findings, each printed as it comes in text mode."""
    from decompshard.doctor import probes
    from decompshard.doctor.findings import guarded

    found, importable = probes.environment(head)
    out.findings(found)
    if not importable:
        out.text("  (nothing else can be checked: decompshard does not import on this torch)")
        return found
    for section, gather in ((probes.HOOKS, probes.hook_points), (probes.REGISTRIES, probes.registries)):
        found += out.findings(guarded(section, section, gather))
    if not args.no_smoke:
        found += _smoke(args, out)
    return found


def _smoke(args: argparse.Namespace, out: _Printer) -> list:
    """The model line, then each step's line as it finishes. A failure of the doctor
    itself becomes one more FAILED line after the ones already found."""
    from decompshard.doctor.findings import FAILED, Finding
    from decompshard.doctor.smoke import SMOKE, pick_model, run_steps
    from decompshard.errors import one_line

    found: list = []
    try:
        entry, model = pick_model(args.model)
        found += out.findings([model], heading=f"{SMOKE} (each step in its own process, {args.timeout:g} s deadline)")
        for finding in run_steps(entry, args.timeout):
            found += out.findings([finding])
    except Exception as e:
        found += out.findings([Finding(SMOKE, "smoke run", FAILED, f"the doctor could not run it: {one_line(e, 200)}")])
    return found


class _Printer:
    """Text lines, printed as they come when `stream` (a run of a minute shows progress)."""

    def __init__(self, stream: bool) -> None:
        self.stream, self.lines, self.section = stream, [], None

    def text(self, line: str) -> None:
        self.lines.append(line)
        if self.stream:
            print(line, flush=True)

    def findings(self, found: list, heading: str | None = None) -> list:
        for f in found:
            if f.section != self.section:
                self.section = f.section
                self.text("")
                self.text(heading or f.section)
            self.text(f.line())
        return found
