"""One rank of tests/test_views_gloo.py: the uneven-view, data-dependent, in-place and
as_strided_ fixes on real gloo processes, each result compared on this rank with one
device (every rank computes the one-device numbers itself from the same seed)."""

from __future__ import annotations

import json


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import decompshard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}")
    errors: dict[str, float | str] = {}
    try:
        decompshard.enable()
        mesh = init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(0)
        dt = torch.float64

        # uneven batch through linear's flatten, forward and backward
        x = torch.randn(10, 8, 16, dtype=dt, generator=g, requires_grad=True)
        w = torch.randn(12, 16, dtype=dt, generator=g, requires_grad=True)
        F.linear(x, w).pow(2).sum().backward()
        dx = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
        dw = distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_()
        F.linear(dx, dw).pow(2).sum().backward()
        errors["linear"] = max((dx.grad.full_tensor() - x.grad).abs().max().item(),
                               (dw.grad.full_tensor() - w.grad).abs().max().item())

        # the same with 17 tokens: the input moves S(0) -> S(1), an uneven all-to-all whose
        # result is a narrowed slice of its padded buffer (the local flatten needs it dense)
        x = torch.randn(10, 17, 32, dtype=dt, generator=g, requires_grad=True)
        w = torch.randn(12, 32, dtype=dt, generator=g, requires_grad=True)
        F.linear(x, w).pow(2).sum().backward()
        dx = distribute_tensor(x.detach(), mesh, [Shard(0)]).requires_grad_()
        dw = distribute_tensor(w.detach(), mesh, [Replicate()]).requires_grad_()
        F.linear(dx, dw).pow(2).sum().backward()
        errors["linear_tokens"] = max(((d.grad.full_tensor() - t.grad).abs().max() / t.grad.abs().max()).item()
                                      for d, t in ((dx, x), (dw, w)))

        # data-dependent output size
        m = torch.where(torch.randn(5, 4, dtype=dt, generator=g) > 0, 1.0, 0.0).to(dt)
        got = torch.nonzero(distribute_tensor(m, mesh, [Shard(0)])).full_tensor()
        errors["nonzero"] = (got - torch.nonzero(m)).abs().max().item() if got.shape == torch.nonzero(m).shape else "shape"

        # in place into a sharded self at global indices
        s = torch.randn(12, 6, dtype=dt, generator=g)
        idx = torch.randint(0, 12, (7,), generator=g)
        src = torch.randn(7, 6, dtype=dt, generator=g)
        ds = distribute_tensor(s.clone(), mesh, [Shard(0)])
        ds.index_add_(0, distribute_tensor(idx, mesh, [Replicate()]), distribute_tensor(src, mesh, [Replicate()]))
        errors["index_add_"] = (ds.full_tensor() - s.index_add(0, idx, src)).abs().max().item()

        # channels-last global pool (as_strided_ restride)
        c = torch.randn(5, 5, 5, 6, dtype=dt, generator=g).permute(0, 3, 1, 2)
        pooled = F.adaptive_avg_pool2d(distribute_tensor(c, mesh, [Shard(0)]), 1)
        errors["pool"] = (pooled.full_tensor() - F.adaptive_avg_pool2d(c, 1)).abs().max().item()
    except Exception as e:  # reported, so the parent's assertion says what broke
        errors["crash"] = f"{type(e).__name__}: {e}"
    finally:
        with open(f"{out_dir}/rank{rank}.json", "w") as f:
            json.dump(errors, f)
        dist.destroy_process_group()
