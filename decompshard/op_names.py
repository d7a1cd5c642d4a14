"""Op names as users type them (`aten.addmv.default`, `aten::addmv`, `mylib.fused`) ->
the OpOverload, with one clear error for every way a name can be wrong.

At the bottom of the package: every command, the public API and the custom-op reference
registry resolve names, and none of them should have to import the solver to do it.
"""

from __future__ import annotations

import difflib

import torch

from decompshard._compat import is_dispatchable

OpOverload = torch._ops.OpOverload

__all__ = ["resolve_op"]


def resolve_op(op: OpOverload | str) -> OpOverload:
    """`aten.addmv.default` / `aten::addmv.default` / an OpOverload -> the OpOverload.
    ValueError for a malformed or unknown name, or an overload the dispatcher lacks."""
    if isinstance(op, torch._ops.OpOverloadPacket) and "default" in op.overloads():
        op = op.default  # aten.mv -> aten.mv.default, as the string "aten.mv" does
    if isinstance(op, OpOverload):
        return _dispatchable(op, str(op))
    if not isinstance(op, str):
        raise ValueError(f"expected an aten OpOverload or its name, got {type(op).__name__}")
    name = op.strip().replace("::", ".")
    parts = name.split(".")
    if parts[:1] == ["torch"] and parts[1:2] == ["ops"]:
        parts = parts[2:]
    if len(parts) == 2:
        parts.append("default")
    if len(parts) != 3 or not all(p.isidentifier() for p in parts):
        raise ValueError(f"malformed op name {op!r}: expected e.g. 'aten.addmv.default'")
    ns, packet, overload = parts
    try:
        resolved = getattr(getattr(getattr(torch.ops, ns), packet), overload)
    except (AttributeError, RuntimeError):
        hint = "" if ns in ("aten", "prims") else (
            " (a custom op exists once the module defining it is imported: decompshard's commands take "
            "--import MODULE)")
        close = did_you_mean(f"{ns}.{packet}.{overload}")
        if close:
            hint = f"; did you mean {_one_of(close)}?" + hint
        raise ValueError(f"unknown op {op!r}: no such operator overload in torch.ops{hint}") from None
    return _dispatchable(resolved, op)


def did_you_mean(name: str, n: int = 3) -> list[str]:
    """The registered overloads of `name`'s namespace nearest to it ('ns.packet.overload'):
    what a misspelled op name most likely meant."""
    known = [_dotted(x) for x in torch._C._dispatch_get_all_op_names()]
    ns = name.split(".", 1)[0] + "."
    mine = [k for k in known if k.startswith(ns)]
    return difflib.get_close_matches(name, mine, n=n, cutoff=0.6)


def _one_of(names: list[str]) -> str:
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _dotted(qualified: str) -> str:
    """'aten::addmv.out' -> 'aten.addmv.out'; 'aten::addmv' -> 'aten.addmv.default'."""
    ns, _, rest = qualified.partition("::")
    return f"{ns}.{rest}" if "." in rest else f"{ns}.{rest}.default"


def _dispatchable(op: OpOverload, name: str) -> OpOverload:
    if not is_dispatchable(op):
        raise ValueError(f"op {name!r} has a schema but no dispatcher entry (a TorchScript-only overload, "
                         f"like aten.add_.t on Python lists): no tensor ever reaches it")
    return op
