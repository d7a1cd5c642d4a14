"""`decompshard coverage --model module:callable`: audit one model before sharding it.

The model's forward and backward are traced once with `make_fx` on fake tensors (no real
compute, no memory for activations) and with an empty decomposition table, which records
the aten overloads at the level DTensor dispatches them (after CompositeImplicitAutograd,
before any compiler decomposition). Each overload is listed with its call count and its
coverage status; an op that needs derivation is derived at the shapes of its actual calls
(at most two distinct call signatures, best and most varied first: `sample_pick`). There is no numerical check here:
the traced arguments are shapes, not values.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any, Callable, Iterator, Sequence

import torch

from decompshard._compat import tree_flatten, tree_leaves, tree_map

from decompshard.errors import UsageError, one_line
from decompshard.coverage import report as rep
from decompshard.coverage.report import Progress
from decompshard.coverage.sample_pick import pick_diverse
from decompshard.coverage.sweep import records_for

__all__ = ["audit_model", "build_model", "load_callable", "model_failed", "one_device_failure", "parse_shapes",
           "trace_calls"]


def load_callable(spec: str) -> Callable[[], Any]:
    """'pkg.module:name' (or 'path/to/file.py:name') -> the callable. The working directory
    is importable, as with `python -m`; the module is imported in the worker processes
    too, so the custom ops it defines resolve there (user_modules)."""
    mod_name, sep, attr = spec.partition(":")
    if not sep or not mod_name or not attr:
        raise UsageError(f"--model {spec!r}: expected MODULE:CALLABLE, e.g. mypkg.models:build_model")
    from decompshard.user_modules import import_user_module

    module = import_user_module(mod_name, "--model")  # the worker processes import it too
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"--model: {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"--model: {spec!r} is not callable")
    return obj


def parse_shapes(text: str) -> list[tuple[int, ...]]:
    """'8,128;4' -> [(8, 128), (4,)]; '()' is a 0-d tensor."""
    shapes = []
    for part in text.split(";"):
        part = part.strip().strip("[]")
        if part in ("()", ""):
            if part == "" and text.strip():
                raise UsageError(f"--input-shapes {text!r}: empty shape (use '()' for a 0-d tensor)")
            shapes.append(())
            continue
        try:
            dims = tuple(int(d) for d in part.strip("()").split(",") if d.strip())
        except ValueError:
            raise UsageError(f"--input-shapes {text!r}: expected ';'-separated shapes like '8,128;4'") from None
        if any(d < 0 for d in dims):
            raise UsageError(f"--input-shapes {text!r}: negative size")
        shapes.append(dims)
    return shapes


def build_model(spec: str, input_shapes: str | None) -> tuple[torch.nn.Module, tuple]:
    """Call the factory; inputs are --input-shapes (float32 randn) if given, else the
    factory's own example inputs."""
    made = load_callable(spec)()
    inputs: Any = None
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], torch.nn.Module):
        module, inputs = made
    elif isinstance(made, torch.nn.Module):
        module = made
    else:
        raise UsageError(f"--model {spec!r} returned {type(made).__name__}; expected an nn.Module "
                         "or (module, example_inputs)")
    if input_shapes:
        inputs = tuple(torch.randn(s) for s in parse_shapes(input_shapes))
    if inputs is None:
        raise UsageError(f"--model {spec!r} returned no example inputs; pass --input-shapes")
    return module, (tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,))


def one_device_failure(module: torch.nn.Module, inputs: Sequence[Any]) -> str | None:
    """None when the model's forward runs on one device with these inputs, else one line
    saying that it fails there, with which input shapes, and torch's own error."""
    try:
        with torch.no_grad():
            module(*inputs)
    except Exception as e:  # noqa: BLE001 - the user's model, any error: reported, not raised
        return model_failed(module, inputs, e)
    return None


def model_failed(module: torch.nn.Module, inputs: Sequence[Any], e: BaseException) -> str:
    """The one line for a model that fails on one device, before any sharding: not
    decompshard's doing (a usage error: the inputs, most often, do not fit the model)."""
    shapes = "; ".join(",".join(map(str, x.shape)) or "()" for x in inputs if isinstance(x, torch.Tensor))
    return (f"--model: {type(module).__name__} fails on one device, before any sharding, with input shapes "
            f"{shapes}: {one_line(e, 300)}")


@contextlib.contextmanager
def _quiet_fake_tensor_log() -> Iterator[None]:
    """FakeTensor logs the traceback of a failing meta kernel at ERROR level and then
    raises: the error is reported once, as one line, by the caller."""
    log = logging.getLogger("torch._subclasses.fake_tensor")
    before = log.disabled
    log.disabled = True
    try:
        yield
    finally:
        log.disabled = before


def _step(module: torch.nn.Module) -> Callable[..., Any]:
    """forward, then backward of sum(floating outputs), as a function of the parameters,
    buffers and inputs (so make_fx lifts them all to fake tensors)."""

    def step(params: dict, buffers: dict, inputs: list) -> Any:
        out = torch.func.functional_call(module, {**params, **buffers}, tuple(inputs))
        leaves = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
        wrt = [p for p in params.values() if p.requires_grad]
        wrt += [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad]
        if not leaves or not wrt:
            return out
        loss = sum(o.sum() for o in leaves)
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        return out, [g for g in grads if g is not None]

    return step


def _meta(x: Any) -> Any:
    if isinstance(x, torch.fx.Node):
        v = x.meta.get("val")
        if isinstance(v, torch.Tensor):
            return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device="meta")
        return v
    return x


def trace_calls(module: torch.nn.Module, inputs: Sequence[Any]) -> tuple[collections.Counter, dict]:
    """(call count per overload, overload -> distinct calls as (args, kwargs, label)) for
    forward + backward, traced on fake tensors."""
    from torch.fx.experimental.proxy_tensor import make_fx

    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    try:
        with _quiet_fake_tensor_log():  # torch logs a traceback of its own before raising
            gm = make_fx(_step(module), tracing_mode="fake", decomposition_table={})(params, buffers, list(inputs))
    except Exception as e:
        failed = one_device_failure(module, inputs)  # the model's own error says it best
        if failed is not None:
            raise UsageError(failed) from None
        raise UsageError(f"--model: tracing forward + backward failed: {one_line(e)}") from None
    counts: collections.Counter = collections.Counter()
    calls: dict[Any, dict[str, tuple]] = collections.defaultdict(dict)
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        op = node.target
        counts[op] += 1
        args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), _meta)
        leaves = tree_flatten((args, kwargs))[0]
        if any(isinstance(x, (torch.SymInt, torch.SymFloat)) for x in leaves):
            continue
        key = repr(tree_map(lambda x: (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x,
                            (args, kwargs)))
        calls[op].setdefault(key, (tuple(args), dict(kwargs), node.name))
    return counts, {op: list(c.values()) for op, c in calls.items()}


def audit_model(spec: str, input_shapes: str | None, *, jobs: int = 1, timeout: float = 60.0,
                samples_per_op: int = 2, progress: bool = True) -> dict[str, Any]:
    """The coverage JSON document of one model's forward + backward (records carry `calls`)."""
    module, inputs = build_model(spec, input_shapes)
    counts, calls = trace_calls(module, inputs)
    bar = Progress(len(counts), enabled=progress)
    per_op = [
        (op, pick_diverse(calls.get(op, []), samples_per_op, args_of=lambda s: (s[0], s[1])))
        for op in sorted(counts, key=str)
    ]
    records = records_for(per_op, jobs=jobs, timeout=timeout, verify=False, bar=bar)
    by_name = {str(op): n for op, n in counts.items()}
    for r in records:
        r["calls"] = by_name.get(r["op"], 0)
    info = {"spec": spec, "inputs": [list(x.shape) for x in inputs if isinstance(x, torch.Tensor)],
            "aten_calls": sum(counts.values()), "distinct_ops": len(counts)}
    return rep.build_report(records, model=info)
