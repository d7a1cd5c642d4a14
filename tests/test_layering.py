"""The package's layout is its data flow: each stage imports only the stages below it.

    base (top-level modules) < dispatch_modes < rules < solve < mesh < verify < runtime
    < commands (coverage/, check/, explain/, doctor/, cli.py, the package's __init__)

Every import counts, wherever it sits (module level, inside a function, under
TYPE_CHECKING): an import hidden in a function is still a dependency, and hiding one to
dodge a circle is what this test exists to stop. It also holds the rules that keep the
stages' insides private: no module imports another module's private name, and only the
`_compat` package (base) imports torch's private modules or reads a DTensor's private
attributes (`._local_tensor`, `._spec`, `._op_dispatcher`, a LocalTensor's
`._local_tensors`), so the next torch release breaks in one listed place.
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
COMPAT = "decompshard._compat"
PRIVATE_DTENSOR_ATTRIBUTES = {"_local_tensor", "_spec", "_op_dispatcher", "_local_tensors"}


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


def _in_compat(module: str) -> bool:
    return module == COMPAT or module.startswith(COMPAT + ".")


def _is_private_torch(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.startswith("__") for p in parts)


def private_torch_imports(module: str) -> list[str]:
    """Every import of a private torch module or name in `module`: import statements, and
    `importlib.import_module` / `__import__` of a constant module path."""
    found = [f"{module}:{line} imports {base}" + (f".{name}" if name else "")
             for base, name, line in _imports(module) if _is_private_torch(f"{base}.{name}" if name else base)]
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str) and _is_private_torch(node.args[0].value)
                and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__")):
            found.append(f"{module}:{node.lineno} imports {node.args[0].value}")
    return found


def private_dtensor_attributes(module: str) -> list[str]:
    """Every read or write of a DTensor's (or a LocalTensor's) private attributes in
    `module`, on any object: `x._spec`, and `getattr(x, "_spec", ...)` / `setattr` /
    `hasattr` with the name as a constant."""
    found = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Attribute) and node.attr in PRIVATE_DTENSOR_ATTRIBUTES:
            found.append(f"{module}:{node.lineno} reads .{node.attr}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and node.args[1].value in PRIVATE_DTENSOR_ATTRIBUTES):
            found.append(f"{module}:{node.lineno} reads .{node.args[1].value} by {node.func.id}")
    return found


def test_only_compat_imports_private_torch_modules():
    leaks = [leak for m in MODULES if not _in_compat(m) for leak in private_torch_imports(m)]
    assert leaks == []


def test_only_compat_reads_private_dtensor_attributes():
    reads = [read for m in MODULES if not _in_compat(m) for read in private_dtensor_attributes(m)]
    assert reads == []


# ------------------------------------------------------------------ the checker itself


def test_the_cycle_finder_finds_a_circle_and_only_real_ones():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


@pytest.mark.parametrize("module, stage", [
    ("decompshard._compat", "base"), ("decompshard._compat.dtensor", "base"), ("decompshard.placements", "base"),
    ("decompshard.runtime.support.kwarg_routing", "runtime"),
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


def _planted(tmp_path, monkeypatch, module: str, code: str) -> str:
    """`module` with `code` appended, standing in for the real file in MODULES."""
    fake = tmp_path / (module.rpartition(".")[2] + ".py")
    fake.write_text(MODULES[module].read_text() + "\n\n" + code)
    monkeypatch.setitem(MODULES, module, fake)
    return module


def test_a_planted_private_torch_import_is_found(tmp_path, monkeypatch):
    m = _planted(tmp_path, monkeypatch, "decompshard.runtime.plans.softmax", (
        "def _late():\n"
        "    import torch.distributed._local_tensor\n"
        "    from torch.distributed.tensor._ops import utils\n"
        "    from torch.distributed.tensor import _dispatch\n"
        "    import importlib\n"
        "    return importlib.import_module('torch.distributed.tensor._sharding_prop')\n"))
    found = " ".join(private_torch_imports(m))
    for path in ("torch.distributed._local_tensor", "torch.distributed.tensor._ops.utils",
                 "torch.distributed.tensor._dispatch", "torch.distributed.tensor._sharding_prop"):
        assert f"imports {path}" in found, (path, found)
    assert private_torch_imports("decompshard.runtime.enable") == []  # public torch only


def test_a_planted_private_attribute_read_is_found(tmp_path, monkeypatch):
    m = _planted(tmp_path, monkeypatch, "decompshard.check.model", (
        "def _late(dt, lt, DTensor):\n"
        "    dt._local_tensor.mul_(2)\n"
        "    spec = dt._spec\n"
        "    DTensor._op_dispatcher.wrap(None, spec)\n"
        "    dt._spec = spec\n"
        "    return lt._local_tensors, getattr(dt, '_spec', None)\n"))
    found = private_dtensor_attributes(m)
    for attr in ("._local_tensor", "._spec", "._op_dispatcher", "._local_tensors", "._spec by getattr"):
        assert any(f.endswith(f"reads {attr}") for f in found), (attr, found)
    assert len([f for f in found if f.endswith("reads ._spec")]) == 2  # the read and the write


def test_compat_itself_is_exempt_and_would_be_caught_elsewhere():
    """The shims do what no other module may: the checks see it, and skip only `_compat`."""
    assert private_torch_imports("decompshard._compat.dtensor") and private_dtensor_attributes("decompshard._compat.dtensor")
    assert all(_in_compat(m) for m in ("decompshard._compat", "decompshard._compat.simulation"))
    assert not _in_compat("decompshard._compatible") and not _in_compat("decompshard.runtime.support.kwarg_routing")
