"""The native guard's handler for batch norm in training: running statistics written back.

Batch norm in training updates `running_mean` and `running_var` in place (CPU's
`native_batch_norm` does so although its schema does not say it). DTensor's strategy
(torch 2.13, `_ops/_math_ops.py`) shards the channels: input S(1), the per-channel
tensors S(0). A module's running statistics are replicated buffers, so DTensor moves
them to S(0) first, and the kernel's update lands on the moved copy (a chunk of each
rank's replica): every rank's buffer gets its own quarter of the channels updated, the
rest keeps last step's values, and the buffer still says Replicate(). The forward
output and the gradients are right; the running statistics, used at evaluation, are
silently wrong (ResNet-18 with its batch Shard(0) on 4 ranks; tests/test_vision_guard.py).

The handler runs the op as DTensor would (the strategy's placements, the local kernel,
the strategy's output placements), with the moved statistics on memory of their own,
and writes the updated values back to the buffers in their own placements: one small
collective per call (an all-gather of 2 x channels values for replicated buffers). Where
DTensor does not move them, the kernel updates the buffers directly, as on one device.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from decompshard._compat import DTensorSpec, TorchPartial, TorchReplicate, TorchShard, contiguous_spec, op_dispatcher, redistribute_local_tensor
from decompshard.runtime.records import Fix

__all__ = ["FIX", "stats_writing_handler"]

aten = torch.ops.aten


def _shifted(placements: tuple) -> tuple | None:
    """The placements of a tensor stacked along a new dim 0 (None: a kind not handled)."""
    out = []
    for p in placements:
        if type(p) is TorchShard:
            out.append(TorchShard(p.dim + 1))
        elif isinstance(p, (TorchReplicate, TorchPartial)):
            out.append(p)
        else:
            return None
    return tuple(out)


def _spec(like: Any, placements: tuple, shape: tuple) -> Any:
    return contiguous_spec(like.mesh, placements, shape, like.tensor_meta.dtype)


def _write_back(updates: list[tuple[torch.Tensor, Any, Any, torch.Tensor]]) -> None:
    """(updated local, its spec, the buffer's spec, the buffer's local) each: bring the
    update to the buffer's placements and copy it in. Statistics that moved alike
    (running_mean and running_var) go back stacked: one collective per call, not two."""
    groups: dict[tuple, list] = {}
    for u in updates:
        _, moved, original, _ = u
        groups.setdefault((moved, original), []).append(u)
    for (moved, original), items in groups.items():
        src, dst = _shifted(tuple(moved.placements)), _shifted(tuple(original.placements))
        if len(items) == 1 or src is None or dst is None:
            backs = [redistribute_local_tensor(local, moved, original) for local, _, _, _ in items]
        else:
            shape = (len(items), *moved.tensor_meta.shape)
            stacked = torch.stack([local for local, _, _, _ in items])
            back = redistribute_local_tensor(stacked, _spec(moved, src, shape), _spec(moved, dst, shape))
            backs = list(back.unbind(0))
        for (_, _, _, buffer), back in zip(items, backs):
            buffer.copy_(back)


def stats_writing_handler(op: torch._ops.OpOverload, written: tuple[int, ...], training_at: int | None,
                          warn: Callable[[str, str], None]) -> Callable:
    """A DTensor custom handler for `op`: DTensor's own steps (propagate, redistribute
    the local arguments, run the local kernel, wrap), with the moved statistics on
    memory of their own and written back after the kernel."""

    def handler(op_call: Any, args: tuple, kwargs: dict) -> Any:
        dispatcher = op_dispatcher()
        training = True if training_at is None else bool(args[training_at])
        op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
        dispatcher.sharding_propagator.propagate(op_info)
        out = op_info.output_sharding
        updates = []
        if out.needs_redistribute:
            if op_info.args_tree_spec is not None:  # pragma: no cover - batch norm takes no lists
                raise RuntimeError(f"decompshard guard: {op}: unexpected list arguments")
            specs, before = list(op_info.flat_args_schema), list(op_info.local_args)
            wanted = out.redistribute_schema.args_schema
            dispatcher.redistribute_local_args(op_info, out.redistribute_schema, out.use_val_from_redistribute_schema)
            local = list(op_info.local_args)
            for i in written if training else ():
                if isinstance(specs[i], DTensorSpec) and tuple(wanted[i].placements) != tuple(specs[i].placements):
                    local[i] = local[i].clone()  # a redistribution may return a view of the buffer
                    updates.append((local[i], wanted[i], specs[i], before[i]))
            op_info.local_args = tuple(local)
        result = dispatcher.wrap(op_call(*op_info.local_args, **op_info.local_kwargs), out.output_spec)
        if updates:
            warn(f"stats:{op}", (
                f"decompshard guard: {op}: DTensor moves the running statistics to "
                f"{tuple(updates[0][1].placements)} and the kernel updates the moved copy in place; "
                "writing the update back to the buffers"))
            _write_back(updates)
        return result

    return handler


FIX = Fix("the moved running statistics written back after the kernel",
          handler=lambda op, fence, warn, existing: stats_writing_handler(op, *fence.args, warn))
