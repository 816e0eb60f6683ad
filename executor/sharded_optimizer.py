"""ZeRO-1 for tensor-parallel parameters: AdamW states sharded over the data-parallel group, Megatron-style.

ZeRO stage 1 (Rajbhandari et al. 2020, "ZeRO", sec. 5.1, P_os) keeps every parameter and gradient whole on
each data-parallel rank and shards only the optimizer states: each rank updates its slice of the parameters
and the slices are all-gathered back. Megatron-LM's distributed optimizer (megatron/core/optimizer/
distrib_optimizer.py) cuts one flat buffer of all of a rank's parameters into equal contiguous slices; this
does the same over each parameter's local tensor (a DTensor's shard under TP).

Hand-written because torch's ZeroRedundancyOptimizer takes whole plain tensors only (it partitions and
broadcasts parameters, not DTensor shards), and FSDP2 is ZeRO 2/3, not 1. The update is AdamW's
(torch.optim.AdamW on the slice), which is elementwise, so the result equals unsharded AdamW exactly.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["ShardedAdamW"]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _matching(p: nn.Parameter) -> torch.Tensor:
    """p's gradient laid out as p (zeros if none): DTensor can leave a gradient in another placement than its
    parameter (measured: the vocab-parallel embedding's), and the flat slices must line up element for element."""
    g = p.grad
    if g is None:
        return torch.zeros_like(p)
    if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return g


class ShardedAdamW:
    """AdamW whose states live on one slice of the flat parameter buffer per rank of `group`.

    step() expects every parameter's gradient already averaged over `group` (the executor's gradient sync);
    it updates this rank's slice and all-gathers the slices into every parameter. zero_grad and state follow
    torch.optim's names, so the executor treats it like any optimizer."""

    def __init__(self, params: Iterable[nn.Parameter], group: dist.ProcessGroup, lr: float,
                 **adamw: Any) -> None:
        self.params = list(params)
        self.group = group
        self.numels = [_local(p).numel() for p in self.params]
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        total = sum(self.numels)
        self.shard = -(-total // world)  # equal slices, the last padded (Megatron pads its buffer the same way)
        self.lo, self.hi = min(rank * self.shard, total), min((rank + 1) * self.shard, total)
        with torch.no_grad():
            flat = self._flat([p for p in self.params])
        self.slice = nn.Parameter(flat[self.lo:self.hi].clone())
        self.inner = torch.optim.AdamW([self.slice], lr=lr, **adamw)

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([_local(t).detach().reshape(-1) for t in tensors])

    @property
    def state(self) -> Mapping[Any, Any]:
        return self.inner.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None if set_to_none else (torch.zeros_like(p.grad) if p.grad is not None else None)

    @torch.no_grad()
    def step(self) -> None:
        grads = [_matching(p) for p in self.params]
        self.slice.grad = self._flat(grads)[self.lo:self.hi].clone()
        self.inner.step()
        world = dist.get_world_size(self.group)
        padded = torch.zeros(self.shard * world, dtype=self.slice.dtype, device=self.slice.device)
        mine = torch.zeros(self.shard, dtype=self.slice.dtype, device=self.slice.device)
        mine[: self.hi - self.lo] = self.slice.detach()
        # all_gather_single where torch has it (all_gather_into_tensor warns deprecated from 2.13, once per rank)
        (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(padded, mine, group=self.group)
        offset = 0
        for p, n in zip(self.params, self.numels, strict=True):
            local = _local(p)
            local.copy_(padded[offset:offset + n].view_as(local))
            offset += n
