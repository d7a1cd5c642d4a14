"""No function in the library is longer than 80 lines (issue 21).

A long function hides its state in closures and local tables, and cannot be tested one
step at a time; the project splits them into named helpers instead. Every `def` (and
`async def`, methods and nested functions included) under decompshard/ is measured
from its first decorator to its last line, docstring included. Tables of data are
module-level constants, not functions, so they never count.
"""

from __future__ import annotations

import ast
from pathlib import Path

MAX_LINES = 80
PACKAGE = Path(__file__).resolve().parent.parent / "decompshard"


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, first line, line count) of every function in `tree`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            name = prefix + node.name
            yield name, first, node.end_lineno - first + 1
            yield from _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def long_functions(root: Path = PACKAGE, limit: int = MAX_LINES) -> list[str]:
    """'path:line name (n lines)' for every function under `root` longer than `limit`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for name, line, n in _functions(tree):
            if n > limit:
                found.append(f"{path.relative_to(root.parent)}:{line} {name} ({n} lines)")
    return found


def test_no_function_over_80_lines():
    too_long = long_functions()
    assert not too_long, "functions over 80 lines (split them into named helpers):\n" + "\n".join(too_long)


def test_the_walk_sees_methods_nested_functions_and_decorators(tmp_path):
    """The measure itself: a long method, a long nested function and a decorated one
    are found, with their qualified names; a long table of data is not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(80))
    nested_body = "\n".join(f"        y{i} = {i}" for i in range(80))
    (pkg / "m.py").write_text(
        "TABLE = [\n" + "\n".join(f"    {i}," for i in range(200)) + "\n]\n\n"
        f"def short():\n    return 1\n\n"
        f"def exactly_80():\n{chr(10).join(f'    z{i} = {i}' for i in range(79))}\n\n"
        f"class C:\n    def method(self):\n    {body.replace(chr(10), chr(10) + '    ')}\n\n"
        f"def outer():\n    def inner():\n{nested_body}\n    return inner\n\n"
        f"@staticmethod\n@property\ndef decorated():\n{chr(10).join(f'    w{i} = {i}' for i in range(78))}\n"
    )
    found = long_functions(pkg)
    names = [f.split(" ")[1] for f in found]
    assert names == ["C.method", "outer", "outer.inner", "decorated"]
    assert found[-1].endswith("(81 lines)")
