"""Data parallelism's own pieces, which the executor (executor/plan_run.py) composes with the others.

| ZeRO | what runs in plan_rank | torch piece |
| --- | --- | --- |
| 0 | gradients averaged over dp x cp once per step, one flat all-reduce | `dist.all_reduce(op=AVG)` |
| 1 | as 0, AdamW states sharded over the dp ranks | `ZeroRedundancyOptimizer(optimizer_class=AdamW)` |
| 2 | parameters whole from forward to backward, gradients and states sharded | FSDP2, `reshard_after_forward=False` |
| 3 | parameters, gradients and states sharded | FSDP2 `fully_shard(reshard_after_forward=True)` |

Micro-batching (`micro_batches`): a global batch of `gbs` sequences is split over the dp ranks in contiguous blocks
of gbs/dp, each rank running gbs/(dp*mbs) micro-batches of `mbs` sequences with gradient accumulation. Every
micro-batch holds mbs*seq tokens, so the global mean loss is the mean of the micro-batch means; each micro-batch's
backward is scaled by 1/micro-batches and the dp reduction averages over ranks, which gives the gradient of the
global-batch mean, i.e. the single-process gradient on the whole batch.

FSDP2's gradient averaging, which summed instead of averaging on gloo in some torch versions, is probed once per
run (`fsdp_reduction_factor`) and corrected if it sums; `make_fsdp_sum` makes it sum, to test that
(`meshplan verify --inject fsdp-sums`). The probe runs on NCCL too (one 2 x dp matrix on the rank's device): gating
it on the backend would be a GPU-only branch the CPU tests never take, and a release that sums on NCCL is caught the
same way.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

__all__ = ["fsdp_reduction_factor", "make_fsdp_sum", "micro_batches"]


def micro_batches(tokens: torch.Tensor, labels: torch.Tensor, dp_rank: int, dp: int,
                  mbs: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This dp rank's micro-batches of a global batch: its contiguous block of gbs/dp sequences, in mbs pieces."""
    gbs = tokens.shape[0]
    if gbs % (dp * mbs):
        raise ValueError(f"global batch {gbs} is not a multiple of dp * mbs = {dp} * {mbs}")
    per_rank = gbs // dp
    lo = dp_rank * per_rank
    return [(tokens[i:i + mbs], labels[i:i + mbs]) for i in range(lo, lo + per_rank, mbs)]


def fsdp_reduction_factor(mesh: DeviceMesh, dtype: torch.dtype, *, emulate_sum: bool = False) -> float:
    """FSDP2's delivered gradient over the true dp-average, measured: 1.0 if it averages, dp if it sums.

    A (2, dp) matrix of ones, sharded like the model, and rank r's loss sum(W x) with x = r + 1: the
    average gradient is (dp + 1) / 2 in every entry, the sum dp (dp + 1) / 2. Collective: every dp rank calls it.
    """
    dp = mesh.size()
    probe = nn.Linear(dp, 2, bias=False, dtype=dtype)
    with torch.no_grad():
        probe.weight.fill_(1.0)
    fully_shard(probe, mesh=mesh)
    if emulate_sum:
        make_fsdp_sum(probe)
    x = torch.full((1, dp), float(mesh.get_local_rank() + 1), dtype=dtype, device=mesh.device_type)
    probe(x).sum().backward()
    grad = probe.weight.grad.full_tensor()
    return float(grad.mean()) / ((dp + 1) / 2)


def make_fsdp_sum(module: FSDPModule) -> None:
    """Emulate the gloo bug: FSDP2 reduces with a plain SUM and divides by nothing."""
    module.set_force_sum_reduction_for_comms(True)
    module.set_gradient_divide_factor(1.0)
