"""A standalone reproducer script for one wrong native DTensor behaviour.

The run needs only torch: a fake process group, `LocalTensorMode` (every rank in one
process, real numbers), the call's exact inputs (values embedded when small, so ties,
indices and masks are the ones that failed) and the placements. The verdict is
decompshard's one judge (`verify/judge.py`), the same the audit gave: every rank's
`full_tensor()` against one device at the tolerance of its dtype, shapes, local shapes
and layouts, and for a run that raised, whether DTensor had accepted the placements
(a clean refusal is not a bug). It prints REPRODUCED or NOT REPRODUCED and sets
`verdict` and `reproduced`, so a test can exec it and upstream can paste it into an
issue (with decompshard installed to judge it).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from decompshard._compat import SIMULATED_SCRIPT_IMPORTS, tree_flatten, tree_unflatten

from decompshard.verify.rank_sim import make_local, promote
from decompshard.placements import MaybePlacement, Partial, Replicate, ShardPlaceholder

MAX_EMBEDDED = 1024  # elements per tensor written out exactly; larger ones are drawn from a seed


def _literal(t: torch.Tensor, name: str, seed: int) -> str:
    dt = str(t.dtype)
    if t.numel() <= MAX_EMBEDDED:
        line = f"{name} = torch.tensor({t.reshape(-1).tolist()!r}, dtype={dt}).reshape({list(t.shape)})"
    elif t.dtype.is_floating_point or t.dtype.is_complex:
        line = (f"{name} = torch.randn({list(t.shape)}, dtype={dt}, "
                f"generator=torch.Generator().manual_seed({seed}))  # large: random values")
    else:
        line = f"{name} = torch.zeros({list(t.shape)}, dtype={dt})  # large: values not embedded"
    return "\n".join([line, *_layout_code(t, name)])


def _contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def _layout_code(t: torch.Tensor, name: str) -> list[str]:
    """Lines giving `name` (the values, contiguous) `t`'s strides, storage offset and
    conjugate bit. A native strategy reads the global strides (a stride finding is a
    disagreement with them) and a conj-bit input takes other kernels, so a reproducer
    that drops either rebuilds another call. Every storage element is written through
    the linear index of each tensor element (right for overlapping and gapped layouts)."""
    stride, offset, conj = tuple(t.stride()), t.storage_offset(), t.is_conj()
    if stride == _contiguous_strides(t.shape) and offset == 0 and not conj:
        return []
    extent = offset + 1 + sum((int(n) - 1) * s for n, s in zip(t.shape, stride)) if t.numel() else offset
    where = f"{list(t.shape)}, {list(stride)}, {offset}"
    lines = [f"# {name}'s layout: strides {list(stride)}, storage offset {offset}"
             f"{', conjugate bit set' if conj else ''} (the call's own)",
             f"_storage = torch.zeros({extent}, dtype={t.dtype})"]
    if t.numel():
        lines.append(f"_storage[torch.arange({extent}).as_strided({where}).reshape(-1)] = {name}.reshape(-1)")
    if conj:  # stored conjugated, viewed through the conj bit: the same values
        lines.append("_storage = _storage.conj_physical()")
    lines.append(f"{name} = _storage.as_strided({where}){'.conj()' if conj else ''}")
    return lines


def _placement_code(p: MaybePlacement) -> str:
    if isinstance(p, Replicate):
        return "Replicate()"
    if isinstance(p, ShardPlaceholder):
        return f"Shard({p.dim})"
    if isinstance(p, Partial):
        return f"Partial({p.reduce_op!r})"
    raise ValueError(f"not an input placement: {p!r}")


def _value_code(x: Any, names: dict[int, str]) -> str:
    if isinstance(x, torch.Tensor):
        return names[id(x)]
    if isinstance(x, (list, tuple)):
        inner = ", ".join(_value_code(v, names) for v in x)
        return f"[{inner}]" if isinstance(x, list) else f"({inner}{',' if len(x) == 1 else ''})"
    if isinstance(x, dict):
        return "{" + ", ".join(f"{k!r}: {_value_code(v, names)}" for k, v in x.items()) + "}"
    if isinstance(x, torch.dtype):
        return str(x)
    if isinstance(x, torch.device):
        return f"torch.device({str(x)!r})"
    if isinstance(x, torch.memory_format):
        return str(x)
    if isinstance(x, torch.layout):
        return str(x)
    if isinstance(x, float) and (x != x or x in (float("inf"), float("-inf"))):
        return f"float({str(x)!r})"
    return repr(x)


_IMPORTS = (*SIMULATED_SCRIPT_IMPORTS, "")

# The script's second half: run the op on the DTensors built from each rank's pieces
# (after the warm-up call, if any) and judge the outputs against `expected` (the one-device
# result), or the exception it raised.
_ON_DTENSOR = (
    "",
    "def on_dtensor(args, kwargs, pieces, placements):",
    "    \"\"\"The call on DTensors made of each rank's pieces (under LocalTensorMode).\"\"\"",
    "    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]",
    "    swap = {}",
    "    for t, ps, pl in zip(tensors, pieces, placements):",
    "        if isinstance(pl, Shard) and len(ps) < W:  # torch.chunk gave fewer pieces: empty shards",
    "            ps = ps + [ps[0].narrow(pl.dim, 0, 0)] * (W - len(ps))",
    "        lt = LocalTensor({r: ps[r].clone() for r in range(W)})",
    "        swap[id(t)] = DTensor.from_local(lt, mesh, [pl], run_check=False, shape=t.shape, stride=t.stride())",
    "    def put(x):",
    "        if isinstance(x, (list, tuple)):",
    "            return type(x)(put(v) for v in x)",
    "        if isinstance(x, dict):",
    "            return {k: put(v) for k, v in x.items()}",
    "        return swap.get(id(x), x)",
    "    return tree_flatten(op(*put(args), **put(kwargs)))[0]",
    "",
    "expected = tree_flatten(op(*[x.clone() if isinstance(x, torch.Tensor) else x for x in args], **kwargs))[0]",
    "",
    "# decompshard's one judge: values at their dtype's tolerance, shapes, local shapes and",
    "# layouts on every rank; a run that raised counts when DTensor had accepted the placements",
    "from decompshard.verify.judge import judge, judge_raised",
    "from decompshard._compat import clear_dtensor_caches",
    "",
    "clear_dtensor_caches()  # DTensor's cached sharding decisions: only this script's calls count",
    "try:",
    "    with LocalTensorMode(frozenset(range(W))):",
)
_JUDGE = (
    "        out = on_dtensor(args, kwargs, pieces, placements)",
    "        verdict = judge(out, expected, plain='per-rank', values=VALUES, mesh=mesh)",
    "except Exception as e:",
    "    verdict = judge_raised(e)",
    "reproduced = verdict.wrong",
    "print('REPRODUCED' if reproduced else 'NOT REPRODUCED', verdict.kind or 'ok', verdict.detail, sep='\\n  ')",
)
_WARM_UP = (
    "        # first the warm-up call: DTensor caches its decision for it under a key that",
    "        # leaves out an argument the judged call changes, and reuses it there",
    "        on_dtensor(warm_args, warm_kwargs, warm_pieces, warm_placements)",
)

Call = tuple[Sequence[Any], dict[str, Any], Sequence[MaybePlacement]]


def reproducer(op: Any, args: Sequence[Any], kwargs: dict[str, Any] | None,
               placements: Sequence[MaybePlacement], world_size: int, *, seed: int = 0, values: bool = True,
               after: Call | None = None) -> str:
    """Python source that reruns `op(*args, **kwargs)` through DTensor with the tensor
    inputs laid out as `placements` on `world_size` simulated ranks and judges it;
    `values=False` judges shapes and layouts only (an op returning uninitialized memory).
    `after`: (args, kwargs, placements) of a call of the same op run first, unjudged,
    where DTensor is wrong only after it (its cached decision for that call is reused)."""
    calls = [("t", "", args, kwargs, placements)]
    if after is not None:
        calls.insert(0, ("w", "warm_", *after))
    lines = _header(op, placements, world_size)
    lines.append(f"op = torch.ops.{op.namespace}.{op._opname}.{op._overloadname}")
    for prefix, name, a, kw, pls in calls:
        lines += _call_code(prefix, name, a, kw, pls, world_size, seed)
    lines.append(f"VALUES = {values!r}  # False: uninitialized memory, shapes and layouts only")
    lines += _ON_DTENSOR
    lines += _WARM_UP if after is not None else ()
    lines += _JUDGE
    return "\n".join(lines) + "\n"


def _call_code(prefix: str, name: str, args: Sequence[Any], kwargs: dict[str, Any] | None,
               placements: Sequence[MaybePlacement], world_size: int, seed: int) -> list[str]:
    """`{name}args`, `{name}kwargs`, `{name}pieces`, `{name}placements` of one call,
    its tensors written out as `{prefix}0`, `{prefix}1`, ..."""
    leaves, spec = tree_flatten((tuple(args), dict(kwargs or {})))
    leaves = [promote(v) if isinstance(v, torch.Tensor) else v for v in leaves]
    pos = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    names = {id(leaves[i]): f"{prefix}{k}" for k, i in enumerate(pos)}
    a, kw = tree_unflatten(leaves, spec)
    lines = ["", "# the warm-up call (not judged)" if name else "# the judged call"]
    lines += [_literal(leaves[i], f"{prefix}{k}", seed + k) for k, i in enumerate(pos)]
    lines += [f"{name}args = {_value_code(a, names)}", f"{name}kwargs = {_value_code(kw, names)}", ""]
    lines += _pieces([leaves[i] for i in pos], placements, world_size, seed, prefix, name)
    return lines


def _header(op: Any, placements: Sequence[MaybePlacement], world_size: int) -> list[str]:
    """The docstring (what is compared), the imports and the simulated world."""
    return [
        f'"""DTensor vs one device: {op} with inputs on ({", ".join(str(p) for p in placements)}),',
        f'a 1-D mesh of {world_size} simulated ranks (torch {torch.__version__.split("+")[0]}).',
        'Found by `decompshard coverage --verify-native`."""',
        *_IMPORTS,
        f"W = {world_size}",
        "if not dist.is_initialized():",
        '    dist.init_process_group("fake", rank=0, world_size=W, store=FakeStore())',
        "mesh = DeviceMesh(\"cpu\", torch.arange(W))",
        "",
    ]


def _pieces(tensors: list[torch.Tensor], placements: Sequence[MaybePlacement], world_size: int,
            seed: int, prefix: str = "t", name: str = "") -> list[str]:
    """`pieces` (each rank's piece of each tensor input `t{k}`) and `placements`. A
    Partial input's parts are written out (drawn so that they reduce to the input); a
    shard is cut by torch.chunk in the script; a replicated input is the whole tensor."""
    lines = ["# each rank's piece of each input (Partial: parts that reduce to the input)"]
    part_names = []
    for k, (t, p) in enumerate(zip(tensors, placements)):
        if isinstance(p, Partial):
            parts = make_local(t, p, world_size, (seed, False), salt=k)
            for r, q in enumerate(parts):
                lines.append(_literal(q, f"{prefix}{k}_rank{r}", seed + 100 * k + r))
            part_names.append(f"[{', '.join(f'{prefix}{k}_rank{r}' for r in range(world_size))}]")
        elif isinstance(p, ShardPlaceholder):
            # contiguous pieces, as the audit's ranks hold them (rank_sim.make_local)
            part_names.append(f"[q.clone(memory_format=torch.contiguous_format) "
                              f"for q in torch.chunk({prefix}{k}, W, dim={p.dim})]")
        else:
            part_names.append(f"[{prefix}{k}] * W")
    lines.append(f"{name}pieces = [{', '.join(part_names)}]")
    lines.append(f"{name}placements = [{', '.join(_placement_code(p) for p in placements)}]")
    return lines
