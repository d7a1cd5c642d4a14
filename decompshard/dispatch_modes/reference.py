"""Plain-torch references for opaque custom ops.

A custom op whose kernel is C++, Triton or numpy cannot be traced on meta tensors, so
decompshard cannot derive its rules from its implementation. `register_reference(op, fn)`
gives it a plain-torch twin: `fn` is traced like a decomposition (instead of the op's
own implementation) only to decide which placements are valid; the strategy DTensor runs
still calls the op's real kernel on local shards.

A reference can be wrong, so under `enable()`, before a derived strategy is used for an
op with a reference, the real kernel and the reference run on one device on random
inputs of the shapes at hand (once per op and shapes, cached). If they differ, the op is
refused with `ReferenceMismatch`, which names the op: never a silent fallback.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

from decompshard._compat import tree_flatten

from decompshard import caches
from decompshard.errors import DecompShardError, one_line
from decompshard.op_names import resolve_op
from decompshard._compat import custom_op_overload
from decompshard._compat import clear_dtensor_caches
from decompshard._compat import tree_unflatten

_lock = threading.RLock()
_REFERENCES: dict[Any, Callable] = {}
_CHECKED: dict[Any, None] = {}  # (op, shapes, args) keys whose check passed


class ReferenceMismatch(DecompShardError, RuntimeError):
    """An op's registered reference does not compute what its real kernel computes."""

    reaches_caller = True  # under enable(), raised as itself, not as DTensor's "no sharding strategy"


def _resolve(op: Any) -> torch._ops.OpOverload:
    """A custom op (the `torch.library.custom_op` object, its packet, its OpOverload, or
    its 'ns::name[.overload]' string) -> its OpOverload; ValueError otherwise."""


    original = op
    op = custom_op_overload(op) or op  # the object @torch.library.custom_op returns
    if isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket, str)):
        try:
            resolved = resolve_op(op)
        except ValueError as e:
            raise ValueError(f"decompshard.register_reference: {e}") from None
    else:
        raise ValueError(f"decompshard.register_reference: expected a custom op (a torch.library.custom_op, "
                         f"its OpOverload or its name), got {type(original).__name__}: {original!r}")
    if resolved.namespace in ("aten", "prims"):
        raise ValueError(f"decompshard.register_reference: {resolved} is a torch op, not a custom op; references "
                         "are for custom ops whose kernel cannot be traced")
    return resolved


def _forget() -> None:

    _CHECKED.clear()
    caches.clear_all()
    clear_dtensor_caches()


def register_reference(op: Any, fn: Callable) -> Callable:
    """Register `fn`, a plain-torch function with `op`'s signature computing what `op`
    computes, as the reference decompshard derives `op`'s rules from. Takes precedence
    over `op`'s own implementation. Returns `fn`."""
    resolved = _resolve(op)
    if not callable(fn):
        raise TypeError(f"decompshard.register_reference({resolved}, ...): the reference must be a callable, "
                        f"got {type(fn).__name__}")
    with _lock:
        _REFERENCES[resolved] = fn
        _forget()
    return fn


def reference(op: Any) -> Callable[[Callable], Callable]:
    """Decorator form: `@decompshard.reference(torch.ops.mylib.rmsnorm.default)`."""
    _resolve(op)  # a bad op fails at the decorator line

    def decorate(fn: Callable) -> Callable:
        return register_reference(op, fn)

    return decorate


def unregister_reference(op: Any) -> None:
    """Forget `op`'s reference (no error if it has none)."""
    resolved = _resolve(op)
    with _lock:
        if _REFERENCES.pop(resolved, None) is not None:
            _forget()


@contextlib.contextmanager
def registered_reference(op: Any, fn: Callable) -> Iterator[Callable]:
    """`register_reference` for the duration of a `with` block (tests), restoring what
    was registered before."""
    resolved = _resolve(op)
    previous = _REFERENCES.get(resolved)
    register_reference(resolved, fn)
    try:
        yield fn
    finally:
        with _lock:
            if previous is None:
                _REFERENCES.pop(resolved, None)
            else:
                _REFERENCES[resolved] = previous
            _forget()


def reference_of(op: Any) -> Callable | None:
    return _REFERENCES.get(op)


# ------------------------------------------------------------------ the numerical check


def random_like(meta: Any, device: str, gen: torch.Generator) -> torch.Tensor:
    """A real tensor with `meta`'s shape and dtype: standard normal for floating and
    complex dtypes, random bools, integers in [0, 3) (valid as small indices)."""
    shape, dtype = tuple(meta.shape), meta.dtype
    if dtype.is_floating_point or dtype.is_complex:
        t = torch.randn(shape, dtype=dtype, generator=gen)
    elif dtype == torch.bool:
        t = torch.rand(shape, generator=gen) > 0.5
    else:
        t = torch.randint(0, 3, shape, generator=gen).to(dtype)
    return t.to(device)


def _describe(x: Any) -> Any:
    return ("T", tuple(x.shape), str(x.dtype)) if isinstance(x, torch.Tensor) else ("V", repr(x))


def check_reference(op: Any, args: tuple, kwargs: dict, device: str = "cpu") -> None:
    """Run `op`'s real kernel and its reference on one device on random inputs with the
    shapes and dtypes of `args`/`kwargs` (tensors may be meta); raise ReferenceMismatch
    naming the op if they differ. Cached per op and shapes. No-op without a reference."""
    fn = _REFERENCES.get(op)
    if fn is None:
        return
    flat, spec = tree_flatten((args, kwargs))
    key = (op, id(fn), tuple(_describe(x) for x in flat))
    if key in _CHECKED:
        return
    gen = torch.Generator().manual_seed(0)
    real = [random_like(x, device, gen) if isinstance(x, torch.Tensor) else x for x in flat]

    r_args, r_kwargs = tree_unflatten(real, spec)
    shapes = ", ".join(str(tuple(x.shape)) for x in flat if isinstance(x, torch.Tensor))
    where = f"decompshard: custom op {op} (inputs {shapes})"
    try:
        expected = op(*r_args, **r_kwargs)
    except Exception as e:
        raise ReferenceMismatch(f"{where}: its real kernel failed on random inputs while checking the "
                                f"registered reference: {one_line(e)}") from e
    try:
        got = fn(*r_args, **r_kwargs)
    except Exception as e:
        raise ReferenceMismatch(f"{where}: its registered reference {_name(fn)} failed on random inputs: "
                                f"{one_line(e)}") from e
    exp_flat, exp_spec = tree_flatten(expected)
    got_flat, got_spec = tree_flatten(got)
    if exp_spec != got_spec or len(exp_flat) != len(got_flat):
        raise ReferenceMismatch(f"{where}: its registered reference {_name(fn)} returns a different structure "
                                f"than the real kernel ({got_spec} vs {exp_spec}); refusing to derive from it")
    for i, (e, g) in enumerate(zip(exp_flat, got_flat)):
        try:
            torch.testing.assert_close(g, e, equal_nan=True)
        except AssertionError as err:
            first = str(err).strip().splitlines()
            detail = "; ".join(line.strip() for line in first[:4] if line.strip())
            raise ReferenceMismatch(
                f"{where}: its registered reference {_name(fn)} does not match the real kernel on random "
                f"inputs (output {i}: {detail}); refusing to derive its sharding from a wrong reference. "
                "Fix the reference or unregister it (decompshard.unregister_reference)") from None
    _CHECKED[key] = None


def _name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
