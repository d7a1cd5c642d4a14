"""`decompshard <command>`: a thin dispatcher. Each command's module owns its arguments
(`add_arguments(parser)`) and its behaviour (`run(args) -> int`), so this file never grows.

Exit codes: 0 success, 2 bad arguments (one-line message on stderr), 1 internal error.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS = {
    "coverage": ("decompshard.coverage.command", "op coverage tables: native, derived, unsupported and why"),
    "explain": ("decompshard.explain.command", "why an op gets (or refuses) a sharding: a readable trace"),
}


class UsageError(Exception):
    """Bad user input: printed as one line, exit code 2."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="decompshard",
        description="DTensor sharding strategies derived from aten decompositions: coverage tables and traces.",
    )
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        try:
            modules[name] = importlib.import_module(module_name)
        except ImportError as e:  # a command not installed in this build
            p.set_defaults(_missing=str(e))
            continue
        modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "_missing", None):
        print(f"decompshard {args.command}: unavailable ({args._missing})", file=sys.stderr)
        return 1
    try:
        return int(modules[args.command].run(args) or 0)
    except (UsageError, ValueError) as e:
        print(f"decompshard {args.command}: error: {e}", file=sys.stderr)
        return 2


def _version() -> str:
    """decompshard's version and the torch it runs on: the first thing a bug report needs."""
    from importlib.metadata import PackageNotFoundError, version

    import torch

    from ._compat import SUPPORTED

    try:
        mine = version("decompshard")
    except PackageNotFoundError:  # run from a checkout without installing
        mine = "unknown (not installed)"
    supported = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED)
    return f"decompshard {mine} (torch {torch.__version__}; supported: torch {supported})"


if __name__ == "__main__":
    sys.exit(main())
