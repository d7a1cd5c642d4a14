"""torch.compile's caches, as far as decompshard must reach them: the tag torch mixes
into every compile cache key, and dynamo's in-memory code cache.

`torch.compiler.config.cache_key_tag` (2.13 to 2.15) goes into `FxGraphHashDetails`
(inductor's FX graph cache key) and so into `AOTAutogradCacheDetails`, its subclass
(the AOT autograd cache key). A torch config value is a ContextVar override: set in this
thread's context, read by compiles run in it; `_make_closure_patcher` (private, the same
on 2.13 to 2.15) sets one and gives back what restores the override exactly, an unset
one included.
"""

from __future__ import annotations

import sys
from typing import Any, Callable

import torch

__all__ = ["aot_eager_seeing", "binary_sym_exprs", "compile_cache_tag", "first_symbol_proxy_kept", "forget_compiled_code",
           "set_compile_cache_tag", "sym_expr_builder_slot", "sym_max_min_entries", "symbol_proxy_slot"]


def compile_cache_tag() -> str:
    """The tag torch's compile caches key on now (an override, or its environment
    variable TORCH_COMPILE_CACHE_KEY_TAG, else '')."""
    return str(torch.compiler.config.cache_key_tag)


def set_compile_cache_tag(tag: str) -> Callable[[], None]:
    """Set the compile cache key tag; returns what puts the setting back exactly as it
    was (torch's own restore: the override it held, or none)."""
    return torch.compiler.config._make_closure_patcher(cache_key_tag=tag)()


def forget_compiled_code() -> None:
    """Drop dynamo's compiled code (its in-memory cache on each code object, guarded on
    inputs and global state but not on what DTensor dispatches to), so the next call of
    a compiled function compiles again. Nothing to drop where dynamo was never imported."""
    if "torch._dynamo" in sys.modules:
        torch._dynamo.reset_code_caches()


def aot_eager_seeing(see: Callable[[str, torch.fx.GraphModule], None]) -> Callable[..., Any]:
    """torch's `aot_eager` backend (AOT autograd, graphs run as they are) that first
    shows `see` each graph AOT autograd made: ('forward' | 'backward', graph). The graphs
    after AOT autograd are where DTensor's redistributions became collectives, so the
    caller can count what a compiled step moves. `aot_eager(fw_compiler=, bw_compiler=)`
    and `boxed_nop` are the same on 2.13 to 2.15."""
    from torch._dynamo.backends.debugging import aot_eager, boxed_nop

    def compiler(kind: str) -> Callable[..., Any]:
        def compile_graph(gm: torch.fx.GraphModule, example_inputs: Any) -> Callable[..., Any]:
            see(kind, gm)
            return boxed_nop(gm, example_inputs)
        return compile_graph

    def backend(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Callable[..., Any]:
        return aot_eager(gm, example_inputs, fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                         **kwargs)
    return backend


def symbol_proxy_slot() -> tuple[Any, str, Callable[..., Any]]:
    """The slot of proxy_tensor's `set_proxy_slot` (module, name, what it holds), through
    which make_fx (AOT autograd's trace) records each SymInt's proxy. Its symbol table
    (`tracer.sympy_expr_tracker`, bare symbol -> proxy) is how a SymInt the trace never
    saw made (DTensor keeps sizes from an earlier trace in its specs) finds its value:
    the same on 2.13 to 2.15."""
    from torch.fx.experimental import proxy_tensor

    return proxy_tensor, "set_proxy_slot", proxy_tensor.set_proxy_slot


def first_symbol_proxy_kept(set_proxy_slot: Callable[..., Any]) -> Callable[..., Any]:
    """`set_proxy_slot` that leaves a bare symbol's entry in the tracer's symbol table as
    the first SymInt recorded for it set it (an input's size, normally): torch's writes
    the latest over it."""
    from torch.fx.experimental.proxy_tensor import py_sym_types

    def kept(obj: Any, tracer: Any, proxy: Any) -> None:
        table = getattr(tracer, "sympy_expr_tracker", None)
        if table is None or not isinstance(obj, py_sym_types):
            return set_proxy_slot(obj, tracer, proxy)
        first = table.get(obj.node.expr)
        set_proxy_slot(obj, tracer, proxy)
        if first is not None:
            table[obj.node.expr] = first

    kept.__wrapped__ = set_proxy_slot  # type: ignore[attr-defined]
    return kept


def sym_expr_builder_slot() -> tuple[Any, str, Callable[..., Any]]:
    """The slot of proxy_tensor's `_build_proxy_for_sym_expr` (module, name, what it
    holds), where make_fx rebuilds an unseen SymInt from its expression's pieces, one node
    per sympy operation: 2.13 and 2.14 hand an n-ary product or sum (`4*s0*s1`) to the
    two-argument `operator.mul` as one node of three arguments (the graph computes
    `4*s0`); 2.15 folds those itself. The same slot on 2.13 to 2.15."""
    from torch.fx.experimental import proxy_tensor

    return proxy_tensor, "_build_proxy_for_sym_expr", proxy_tensor._build_proxy_for_sym_expr


def sym_max_min_entries() -> list[tuple[dict, Any, Callable[..., Any]]]:
    """(table, key, binary op) for each Max/Min in make_fx's table of what rebuilds a
    sympy operation: torch maps them to its own n-ary wrappers (`_nary_sym_max`), which
    become the graph node's target, and inductor lowers no such function ("is not an
    OpOverload": the tensor-parallel Llama under `dynamic=True`, torch alone too);
    `torch.sym_max`/`sym_min` it lowers (2.13 to 2.15; `_sympy_handlers` is cached, so
    its dict is the table every rebuild reads)."""
    from torch.fx.experimental import proxy_tensor

    handlers = proxy_tensor._sympy_handlers()
    binary = {"_nary_sym_max": torch.sym_max, "_nary_sym_min": torch.sym_min}
    return [(handlers, k, binary[v.__name__]) for k, v in handlers.items()
            if getattr(v, "__name__", None) in binary]


def binary_sym_exprs(build: Callable[..., Any], folded: Any = ()) -> Callable[..., Any]:
    """`_build_proxy_for_sym_expr` that first writes an n-ary product, sum or one of
    `folded` (Max, Min) as its first term and the rest (`4*(s0*s1)`, unevaluated), so each
    node it makes has two arguments, and a whole power as a product (`s*s`: 2.13 has no
    handler for powers: "s72**2 is not tracked with proxy"); the rest is rebuilt the same
    way (the builder calls itself through the slot)."""
    import sympy

    nary = (sympy.Mul, sympy.Add, *folded)

    def binary(tracer: Any, expr: Any, out: Any = None) -> Any:
        if isinstance(expr, nary) and len(expr.args) > 2:
            expr = expr.func(expr.args[0], expr.func(*expr.args[1:]), evaluate=False)
        elif isinstance(expr, sympy.Pow) and expr.exp.is_Integer and int(expr.exp) >= 2:
            expr = sympy.Mul(expr.base, expr.base ** (int(expr.exp) - 1), evaluate=False)
        return build(tracer, expr, out)

    binary.__wrapped__ = build  # type: ignore[attr-defined]
    return binary
