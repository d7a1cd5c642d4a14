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

__all__ = ["aot_eager_seeing", "compile_cache_tag", "forget_compiled_code", "set_compile_cache_tag"]


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
