"""The native guard's handler for batch norm in training (guard.py).

Batch norm in training updates `running_mean` and `running_var` in place (CPU's
`native_batch_norm` does so although its schema does not say it). DTensor's strategy
(torch 2.13, `_ops/_math_ops.py`) shards the channels: input S(1), the per-channel
tensors S(0). A module's running statistics are replicated buffers, so DTensor moves
them to S(0) first, and the kernel's update lands on the moved copy (a chunk of each
rank's replica): every rank's buffer gets its own quarter of the channels updated, the
rest keeps last step's values, and the buffer still says Replicate(). The forward
output and the gradients are right; the running statistics, used at evaluation, are
silently wrong (ResNet-18, batch Shard(0) on 4 ranks: errors up to 0.34).

The handler runs the op as DTensor would (the strategy's placements, the local kernel,
the strategy's output placements), with the moved statistics on memory of their own,
and writes the updated values back to the buffers in their own placements. Where
DTensor does not move them, the kernel updates the buffers directly, as on one device.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ._compat import DTensor, dtensor_local

__all__ = ["stats_writing_handler"]

aten = torch.ops.aten

def _own_memory(d: Any) -> Any:
    """`d` on a local tensor of its own (a redistribution may return a view of its input)."""
    return DTensor.from_local(dtensor_local(d).clone(), d.device_mesh, d.placements, run_check=False,
                              shape=d.shape, stride=d.stride())


def stats_writing_handler(op: torch._ops.OpOverload, written: tuple[int, ...], training_at: int | None,
                          warn: Callable[[str, str], None]) -> Callable:
    """A DTensor custom handler for `op` that keeps in-place statistics updates."""

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        dispatcher = DTensor._op_dispatcher
        training = True if training_at is None else bool(args[training_at])
        op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        dispatcher.sharding_propagator.propagate(op_info)
        out = op_info.output_sharding
        suggestion = out.redistribute_schema if out.needs_redistribute else None
        moved = list(args)
        write_back = []
        if suggestion is not None:
            for i, arg in enumerate(args):
                want = suggestion.args_schema[i] if i < len(suggestion.args_schema) else None
                if not isinstance(arg, DTensor) or not hasattr(want, "placements") or \
                        tuple(want.placements) == tuple(arg.placements):
                    continue
                moved[i] = arg.redistribute(arg.device_mesh, want.placements)
                if training and i in written:
                    moved[i] = _own_memory(moved[i])
                    write_back.append(i)
            op_info = dispatcher.unwrap_to_op_info(op_call, tuple(moved), kwargs)
            dispatcher.sharding_propagator.propagate(op_info)
            out = op_info.output_sharding
            if out.needs_redistribute:
                raise RuntimeError(f"decompshard guard: {op}: DTensor's strategy asks for another move after "
                                   "the one it asked for; not running a kernel that updates statistics in place")
        local = op_call(*op_info.local_args, **op_info.local_kwargs)
        result = dispatcher.wrap(local, out.output_spec)
        if write_back:
            warn(f"stats:{op}", (
                f"decompshard guard: {op}: DTensor moves the running statistics to "
                f"{tuple(moved[write_back[0]].placements)} and the kernel updates the moved copy in place; "
                "writing the update back to the buffers"))
        for i in write_back:
            back = moved[i].redistribute(args[i].device_mesh, args[i].placements)
            dtensor_local(args[i]).copy_(dtensor_local(back))
        return result

    return handler
