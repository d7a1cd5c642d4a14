"""The native guard's fix for DTensor's convolution handlers, which skip the
redistribution their strategy asks for: the inputs are moved first.

DTensor (torch 2.13, torch/distributed/tensor/_tp_conv.py) runs `convolution` and
`convolution_backward` through custom handlers that ask the sharding propagator for a
strategy and then ignore its redistribution: the local kernel runs on the inputs as they
are, and the result is labelled with the strategy's output placements. The backward
handler makes one move of its own first: `grad_output` to the input's placements.

The handlers compute right only with no data exchange and the kernel on whole channels:
activations (forward: the input; backward: grad_output and the input) Replicate or
`Shard(0)` on at most one mesh dim, weight and bias replicated, and the strategy matching
those placements as they are. Such a call is left alone (no move, no warning); any other
is moved to the nearest such layout first:

1. the handler's own move (backward: grad_output to the input's placements, Replicate
   where the input is Partial: DTensor never redistributes *to* Partial), so the layout
   judged is the one the handler would see;
2. the strategy's target made one the handler can take: `Shard(0)` kept on the first
   mesh dim the strategy put it on, Replicate elsewhere (`[Shard(0), Shard(0)]` is
   rejected by the handlers), weight and bias Replicate;
3. after the move the propagator must agree with no further redistribution; if it does
   not, the call raises rather than let the handler label a wrong result.

A call whose weight is sharded on its channels reaches this fix only where the
channel-parallel plan (plans/conv_channels.py, in front of it in the op's chain)
declines: the weight all-gather these steps make is what that plan avoids. Installed by
the guard (fences/guard.py). Tests: tests/test_vision_guard.py.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from decompshard._compat import DTensor, TorchPartial, TorchReplicate, TorchShard, op_dispatcher
from decompshard.runtime.records import Fix

__all__ = ["FIX", "handler_layout", "redistributing_handler"]

aten = torch.ops.aten


def _tensor_slots(op: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(activation argument indices, parameter argument indices) of a conv op."""
    if op == aten.convolution_backward.default:
        return (0, 1), (2,)
    return (0,), (1, 2)


def handler_layout(placements: Sequence[Any]) -> tuple[Any, ...]:
    """The nearest activation layout the handlers take: Shard(0) kept on the first mesh
    dim that has it, Replicate elsewhere (all of them Replicate if none has it)."""
    out, kept = [], False
    for p in placements:
        if type(p) is TorchShard and p.dim == 0 and not kept:
            out.append(p)
            kept = True
        else:
            out.append(TorchReplicate())
    return tuple(out)


def _own_move_target(input_placements: Sequence[Any]) -> tuple[Any, ...]:
    """Where the backward handler's own first move takes grad_output: the input's
    placements, with Replicate where the input is Partial. DTensor refuses to
    redistribute *to* Partial ("for internal use only"): ConvNeXt on a 2x2 DP x TP mesh
    feeds a depthwise conv the rowwise MLP's [Shard(0), Partial(sum)] output, and its
    backward met grad_output on [Shard(0), Shard(0)]. No handler layout keeps Partial
    (`handler_layout` makes it Replicate), so this is the nearest layout the move could
    end at anyway; the input's Partial is reduced in step 2."""
    return tuple(TorchReplicate() if isinstance(p, TorchPartial) else p for p in input_placements)


def _propagate(op_call: Any, args: tuple, kwargs: dict) -> Any:
    dispatcher = op_dispatcher()
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    return op_info.output_sharding


def _targets(op_call: Any, args: tuple, kwargs: dict) -> dict[int, tuple[Any, ...]]:
    """Per DTensor argument index: the placements the strategy wants (as they are
    where it wants no move)."""
    out = _propagate(op_call, args, kwargs)
    suggestion = getattr(out, "redistribute_schema", None)
    wanted = list(suggestion.args_schema) if out is not None and out.needs_redistribute and suggestion else []
    targets = {}
    for i, arg in enumerate(args):
        if isinstance(arg, DTensor):
            spec = wanted[i] if i < len(wanted) else None
            targets[i] = tuple(spec.placements) if hasattr(spec, "placements") else tuple(arg.placements)
    return targets


def redistributing_handler(op: torch._ops.OpOverload, original: Callable,
                           warn: Callable[[str, str], None]) -> Callable:
    """`original` (DTensor's handler for `op`), run on a layout it computes right."""
    activations, parameters = _tensor_slots(op)
    backward = op == aten.convolution_backward.default

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        args = list(args)
        if backward and isinstance(args[0], DTensor) and isinstance(args[1], DTensor):
            # the handler's own first move, made one DTensor allows (never *to* Partial)
            own = _own_move_target(args[1].placements)
            if tuple(args[0].placements) != own:
                args[0] = args[0].redistribute(args[1].device_mesh, own)
        current = {i: tuple(a.placements) for i, a in enumerate(args) if isinstance(a, DTensor)}
        targets = _targets(op_call, tuple(args), kwargs)
        asked = targets != current
        act = [i for i in activations if i in targets]
        if act:
            # backward: one layout for grad_output and input (the handler equalises them)
            layout = handler_layout(targets[act[-1]])
            for i in act:
                targets[i] = layout
        for i in parameters:
            if i in targets:
                targets[i] = tuple(TorchReplicate() for _ in targets[i])
        if targets == current:
            return original(op_call, tuple(args), kwargs)
        reason = ("its handler skips the redistribution its strategy asks for (wrong results or a kernel "
                  "error)" if asked else "its handler cannot take the batch sharded on two mesh dims")
        moves = "; ".join(f"argument {i}: {_fmt(current[i])} -> {_fmt(targets[i])}"
                          for i in sorted(targets) if targets[i] != current[i])
        warn(f"handler:{op}", f"decompshard guard: {op}: {reason}; redistributing first ({moves})")
        for i, want in targets.items():
            if want != current[i]:
                args[i] = args[i].redistribute(args[i].device_mesh, want)
        after = _propagate(op_call, tuple(args), kwargs)
        if after is None or after.needs_redistribute:
            raise RuntimeError(
                f"decompshard guard: {op}: DTensor's strategy still asks to move "
                f"{[_fmt(targets[i]) for i in sorted(targets)]}, a layout its handler would compute "
                "wrong; redistribute the inputs to Replicate or Shard(0) of the batch first")
        return original(op_call, tuple(args), kwargs)

    handler.__wrapped__ = original  # type: ignore[attr-defined]
    return handler


def _fmt(placements: Sequence[Any]) -> str:
    return "[" + ", ".join(str(p) for p in placements) + "]"


FIX = Fix("the inputs moved to a layout DTensor's handler computes right before it runs",
          handler=lambda op, fence, warn, existing: redistributing_handler(op, existing, warn),
          wraps_dtensor_handler=True)
