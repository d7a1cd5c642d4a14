"""A transformer attention block, tensor-parallel the standard way, for the end-to-end
test of head-sharded attention (tests/test_e2e_attention.py).

q, k, v are ColwiseParallel (heads split across ranks), out is RowwiseParallel, and the
attention in between runs on DTensors (use_local_output=False): the usual
`x.view(B, S, H, hd).transpose(1, 2)` layout, causal scaled_dot_product_attention (on
CPU: _scaled_dot_product_flash_attention_for_cpu and its backward, which DTensor has no
strategy for). decompshard derives S(1), S(1), S(1) -> S(1), ... for them, so nothing
inside the attention communicates; the only collectives are the out projection's.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

DTYPE = torch.float64
B, S, H, HD = 2, 6, 8, 4
DIM = H * HD


class Attention(nn.Module):
    """The part between the projections: no parameters, its own module so that
    CommDebugMode attributes its collectives (forward and backward) to it."""

    def forward(self, q, k, v):
        b, s, _ = q.shape
        q, k, v = (t.view(b, s, H, HD).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return o.transpose(1, 2).reshape(b, s, DIM)


class Block(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.q, self.k, self.v, self.out = (nn.Linear(DIM, DIM, dtype=DTYPE) for _ in range(4))
        self.attn = Attention()

    def forward(self, x):
        return self.out(self.attn(self.q(x), self.k(x), self.v(x)))


def tensor_parallel(block: Block, mesh) -> Block:
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {name: ColwiseParallel(use_local_output=False) for name in ("q", "k", "v")}
    plan["out"] = RowwiseParallel(input_layouts=Shard(-1))
    return parallelize_module(block, mesh, plan)


def reference(seed: int = 0) -> dict[str, torch.Tensor]:
    """Single-device output and gradients (call outside LocalTensorMode)."""
    block = Block(seed)
    x = _input(seed).requires_grad_()
    out = block(x)
    out.sum().backward()
    return {"output": out.detach(), "x.grad": x.grad, **{n + ".grad": p.grad for n, p in block.named_parameters()}}


def _input(seed: int) -> torch.Tensor:
    return torch.randn(B, S, DIM, dtype=DTYPE, generator=torch.Generator().manual_seed(seed + 1))


def run(mesh, seed: int = 0) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensor-parallel block's output and gradients as full plain tensors (rank 0's
    copy under LocalTensorMode), and the collectives counted per module (fqn -> forward /
    backward -> collective -> count)."""
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    tp = tensor_parallel(Block(seed), mesh)
    x = distribute_tensor(_input(seed), mesh, [Replicate()]).requires_grad_()
    with warnings.catch_warnings(), CommDebugMode() as comm:
        warnings.simplefilter("ignore")
        out = tp(x)
        out.sum().backward()

    def full(t):
        t = t.full_tensor() if isinstance(t, DTensor) else t
        lt = getattr(t, "_local_tensors", None)
        return (lt[0] if lt is not None else t).detach()

    got = {"output": full(out), "x.grad": full(x.grad), **{n + ".grad": full(p.grad) for n, p in tp.named_parameters()}}
    counts = {
        fqn: {k: {str(op): n for op, n in ops.items()} for k, ops in c.items()}
        for fqn, c in comm.comm_module_counts.items()
    }
    return got, counts


def compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    """Largest absolute difference per tensor."""
    return {k: float((got[k] - ref[k]).abs().max()) for k in ref}


def gloo_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import json

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import decompshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    report: dict = {}
    try:
        mesh = init_device_mesh("cpu", (world,))
        ref = reference()
        with decompshard.enabled():
            got, counts = run(mesh)
        report = {"diffs": compare(got, ref), "counts": counts}
    except Exception as e:  # reported, so the parent's assertion says what broke
        report["__error__"] = f"{type(e).__name__}: {e}"
    finally:
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(report, f)
        dist.destroy_process_group()
