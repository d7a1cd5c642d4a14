"""The package's layout is its data flow: each stage imports only the stages below it.

    base (top-level modules) < dispatch_modes < rules < solve < mesh < verify < runtime
    < commands (coverage/, check/, explain/, doctor/, cli.py, the package's __init__)

Every import counts, wherever it sits (module level, inside a function, under
TYPE_CHECKING): an import hidden in a function is still a dependency, and hiding one to
dodge a circle is what this test exists to stop. It also holds the two rules that keep
the stages' insides private: no module imports another module's private name, and only
the `_compat` package imports torch's private modules (so the next torch release breaks in one
listed place).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import decompshard

PACKAGE = Path(decompshard.__file__).parent
STAGES = ["base", "dispatch_modes", "rules", "solve", "mesh", "verify", "runtime", "commands"]
COMMANDS = {"coverage", "check", "explain", "doctor", "cli", "__main__", "__init__"}
BASE_PACKAGES = {"_compat"}  # packages of the base stage (the version shims)


def _module_name(path: Path) -> str:
    parts = ["decompshard", *path.relative_to(PACKAGE).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def stage_of(module: str) -> str:
    parts = module.split(".")[1:] or ["__init__"]
    if parts[0] in COMMANDS:
        return "commands"
    if parts[0] in BASE_PACKAGES:
        return "base"
    return parts[0] if len(parts) > 1 or parts[0] in STAGES else "base"


def _absolute(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    parts = module.split(".")[: None if is_package else -1]
    parts = parts[: len(parts) - (node.level - 1)]
    return ".".join(parts + ([node.module] if node.module else []))


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import in the module."""
    path = MODULES[module]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(module, node, path.name == "__init__.py")
            for a in node.names:
                full = f"{base}.{a.name}"
                found.append((full, None, node.lineno) if full in MODULES else (base, a.name, node.lineno))
    return found


def _package_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for m in MODULES:
        for target, _, _ in _imports(m):
            if target == "decompshard" or target.startswith("decompshard."):
                t = _package_module(target)
                if t and t != m:
                    graph[m].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_module_is_in_a_known_stage():
    assert {stage_of(m) for m in MODULES} <= set(STAGES)
    # the stages the layout promises exist, each with at least one module
    assert {stage_of(m) for m in MODULES} == set(STAGES)


def test_no_import_circle():
    assert cycles(import_graph()) == []


def test_no_stage_imports_a_stage_above_it():
    upward = [
        f"{m} ({stage_of(m)}) imports {t} ({stage_of(t)})"
        for m, targets in import_graph().items() for t in sorted(targets)
        if STAGES.index(stage_of(t)) > STAGES.index(stage_of(m))
    ]
    assert upward == []


def test_no_private_name_crosses_a_module_boundary():
    crossing = [
        f"{m}:{line} imports {name} from {base}"
        for m in MODULES for base, name, line in _imports(m)
        if name and name.startswith("_") and not name.startswith("__")
        and (base == "decompshard" or base.startswith("decompshard."))
    ]
    assert crossing == []


def test_only_compat_imports_private_torch_modules():
    leaks = [
        f"{m}:{line} imports {base}" + (f".{name}" if name else "")
        for m in MODULES if m.split(".")[:2] != ["decompshard", "_compat"]
        for base, name, line in _imports(m)
        if base.split(".")[0] == "torch" and any(p.startswith("_") for p in [*base.split("."), name or ""])
    ]
    assert leaks == []


# ------------------------------------------------------------------ the checker itself


def test_the_cycle_finder_finds_a_circle_and_only_real_ones():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


@pytest.mark.parametrize("module, stage", [
    ("decompshard._compat", "base"), ("decompshard.placements", "base"),
    ("decompshard.dispatch_modes.decomps.scatter", "dispatch_modes"), ("decompshard.solve.derive", "solve"),
    ("decompshard.runtime.enable", "runtime"), ("decompshard.coverage.command", "commands"),
    ("decompshard.cli", "commands"), ("decompshard", "commands"),
])
def test_stage_of_reads_the_path(module, stage):
    assert stage_of(module) == stage


def test_a_function_level_import_counts(tmp_path, monkeypatch):
    """An upward import inside a function is found like one at the top of the file."""
    src = PACKAGE / "solve" / "derive.py"
    fake = tmp_path / "derive.py"
    fake.write_text(src.read_text() + "\n\ndef _late():\n    from decompshard.runtime import enable\n")
    monkeypatch.setitem(MODULES, "decompshard.solve.derive", fake)
    assert "decompshard.runtime.enable" in import_graph()["decompshard.solve.derive"]
