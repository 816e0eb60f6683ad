"""ZeRO-1 for DTensor parameters (executor/sharded_optimizer.py): the same parameters as unsharded AdamW, states
split over the data-parallel group."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from meshplan.executor.launch import run_world


def _sharded_vs_adamw(rank: int, world: int) -> tuple[float, int, int]:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from meshplan.executor.reference import ADAMW
    from meshplan.executor.sharded_optimizer import ShardedAdamW

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = mesh["tp"]
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(4, 3, generator=gen, dtype=torch.float64), torch.randn(7, generator=gen, dtype=torch.float64),
            torch.randn(5, generator=gen, dtype=torch.float64)]
    placements = [[Shard(0)], [Replicate()], None]  # a TP shard, a replicated DTensor, a plain tensor

    def params() -> list[nn.Parameter]:
        return [nn.Parameter(distribute_tensor(f.clone(), tp, pl) if pl else f.clone())
                for f, pl in zip(full, placements, strict=True)]

    mine, ref = params(), params()
    opt = ShardedAdamW(mine, mesh["dp"].get_group(), lr=1e-2, **ADAMW)
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, **ADAMW)
    for _ in range(3):
        for p, r, f, pl in zip(mine, ref, full, placements, strict=True):
            g = torch.randn(f.shape, generator=gen, dtype=torch.float64)
            # the sharded parameter gets a Replicate gradient, as DTensor leaves the vocab-parallel embedding's
            p.grad = distribute_tensor(g, tp, [Replicate()]) if pl else g.clone()
            r.grad = distribute_tensor(g.clone(), tp, pl) if pl else g.clone()
        opt.step()
        ref_opt.step()
    diff = max(float(((p.to_local() - r.to_local()) if pl else (p - r)).abs().max())
               for p, r, pl in zip(mine, ref, placements, strict=True))
    state = sum(v.numel() for s in opt.state.values() for v in s.values() if v.dim() > 0)
    local = sum((p.to_local() if pl else p).numel() for p, pl in zip(mine, placements, strict=True))
    return diff, state, local


def test_sharded_adamw_equals_adamw_and_holds_half_the_states():
    for diff, state, local in run_world(4, _sharded_vs_adamw, timeout_s=120):
        assert diff == 0.0  # elementwise AdamW on a slice: bit-identical
        assert state == 2 * -(-local // 2)  # two moments of this rank's half of the flat buffer
