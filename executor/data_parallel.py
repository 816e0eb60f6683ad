"""Data parallelism of the reference model, with the plan's ZeRO stage, from PyTorch's own pieces.

| ZeRO | what runs | torch piece |
| --- | --- | --- |
| 0 | gradients all-reduced (averaged) once per step | `DistributedDataParallel`, `no_sync()` but on the last |
| 1 | as 0, AdamW states sharded over the dp ranks | DDP + `ZeroRedundancyOptimizer(optimizer_class=AdamW)` |
| 2 | parameters whole from forward to backward, gradients and states sharded | FSDP2, `reshard_after_forward=False` |
| 3 | parameters, gradients and states sharded | FSDP2 `fully_shard(reshard_after_forward=True)` |

FSDP2 wraps every decoder layer and then the root (embeddings, final norm, head, and a tied head with
its embedding). Under ZeRO 2 and 3 gradients are reduce-scattered after every micro-batch and summed
into the sharded gradient, so a full gradient never outlives its micro-batch's backward.

Micro-batching: a global batch of `gbs` sequences is split over the dp ranks in contiguous blocks of
gbs/dp, each rank running gbs/(dp*mbs) micro-batches of `mbs` sequences with gradient accumulation.
Every micro-batch holds mbs*seq tokens, so the global mean loss is the mean of the micro-batch means;
each micro-batch's backward is scaled by 1/micro-batches and the dp reduction averages over ranks,
which gives the gradient of the global-batch mean, i.e. the single-process gradient on the whole batch.

On gloo (torch 2.13, CPU, float32 and float64) every piece above works as is (tests/test_executor_dp.py);
FSDP2's gradient averaging, which summed instead of averaging on gloo in some torch versions, is
probed once per run and corrected if it sums (`fsdp_reduction_factor`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from meshplan.costmodels.model import ModelSpec
from meshplan.executor.reference import ADAMW, RankResult, RunSpec

with warnings.catch_warnings():  # torch.distributed.optim scripts its functional optimizers, and 2.13 deprecates jit
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["INJECTIONS", "DPResult", "dp_run", "dp_step", "fsdp_reduction_factor", "micro_batches"]

# Deliberate faults, so tests (and later `meshplan verify`'s own self-test) can show a wrong layout is caught:
#   "scale-loss"    the last dp rank doubles its loss (a wrong gradient that is still synchronised);
#   "no-grad-sync"  ZeRO 0/1: gradients are never all-reduced (each rank keeps its own);
#   "fsdp-sums"     ZeRO 2/3: FSDP2 is made to sum gradients instead of averaging them, as it did on gloo
#                   in some torch versions; the executor must detect and correct this, so the run still matches.
INJECTIONS = ("scale-loss", "no-grad-sync", "fsdp-sums")


@dataclass(frozen=True, kw_only=True)
class DPResult(RankResult):
    """One rank's report of a data-parallel run (see executor.reference.RunResult for the common fields).

    losses: the global-batch mean loss of every step, before its update (the same on every rank);
    grads: on dp rank 0, every parameter's full gradient after step 1 (before the optimizer step), else None;
    params: on dp rank 0, every full parameter after the last step, else None.
    """

    dp: int
    zero: int
    mbs: int


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
        _make_fsdp_sum(probe)
    x = torch.full((1, dp), float(mesh.get_local_rank() + 1), dtype=dtype, device=mesh.device_type)
    probe(x).sum().backward()
    grad = probe.weight.grad.full_tensor()
    return float(grad.mean()) / ((dp + 1) / 2)


def _make_fsdp_sum(module: FSDPModule) -> None:
    """Emulate the gloo bug: FSDP2 reduces with a plain SUM and divides by nothing."""
    module.set_force_sum_reduction_for_comms(True)
    module.set_gradient_divide_factor(1.0)


def _shard(model: nn.Module, mesh: DeviceMesh, zero: int, emulate_sum: bool) -> None:
    """FSDP2 on every decoder layer, then on the root; ZeRO-2 keeps parameters unsharded after forward."""
    reshard = zero == 3
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    if emulate_sum:
        for module in model.modules():
            if isinstance(module, FSDPModule):
                _make_fsdp_sum(module)


def _full(t: torch.Tensor) -> torch.Tensor:
    """A sharded DTensor gathered (collective), or a plain tensor copied; on the CPU."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)


def _device() -> torch.device:
    """The device of this rank's tensors: its current GPU under NCCL (run_torchrun binds LOCAL_RANK), else the CPU.
    The GPU path is written but not yet run by the tests (no GPU here)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def _no_context() -> Iterator[None]:
    yield


def dp_run(rank: int, world: int, run: RunSpec, zero: int, mbs: int, *, mesh: DeviceMesh | None = None,
           inject: str | None = None) -> DPResult:
    """Run `run` data-parallel over `mesh` (default: all `world` ranks) with ZeRO stage `zero` and micro-batch
    size `mbs`. Collective: every rank of the mesh calls it with the same arguments. See the module docstring."""
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {zero}")
    if inject is not None and inject not in INJECTIONS:
        raise ValueError(f"unknown injection {inject!r}; known: {', '.join(INJECTIONS)}")
    if inject == "no-grad-sync" and zero >= 2:
        raise ValueError("no-grad-sync is a ZeRO 0/1 fault (FSDP2 reduces inside backward)")
    if inject == "fsdp-sums" and zero < 2:
        raise ValueError("fsdp-sums emulates an FSDP2 fault: ZeRO 2/3 only")
    device = _device()
    if device.type == "cpu":
        torch.set_num_threads(1)  # also under torchrun on CPU; the launcher already does it
    if mesh is None:
        mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    dp, dp_rank, group = mesh.size(), mesh.get_local_rank(), mesh.get_group()
    if run.gbs % (dp * mbs):
        raise ValueError(f"global batch {run.gbs} is not a multiple of dp * mbs = {dp} * {mbs}")
    n_micro = run.gbs // (dp * mbs)

    model = run.build().to(device)
    scale = 1.0  # what FSDP2's reduction is divided by after backward (1.0: it averages, as it should)
    if zero <= 1:
        # torch DDP works on gloo with float64/float32 CPU tensors: it divides by dp and all-reduces with SUM
        net: nn.Module = model if inject == "no-grad-sync" else DistributedDataParallel(model, process_group=group)
        if zero == 0:
            opt: torch.optim.Optimizer = torch.optim.AdamW(model.parameters(), lr=run.lr, **ADAMW)
        else:
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                          process_group=group, lr=run.lr, **ADAMW)
    else:
        emulate = inject == "fsdp-sums"
        scale = fsdp_reduction_factor(mesh, run.torch_dtype, emulate_sum=emulate)
        if abs(scale - 1.0) > 1e-12 and abs(scale - dp) > 1e-12 * dp:
            raise RuntimeError(f"FSDP2 delivered {scale:g} x the average gradient (expected 1 or {dp})")
        _shard(model, mesh, zero, emulate)
        net = model
        opt = torch.optim.AdamW(model.parameters(), lr=run.lr, **ADAMW)  # on the DTensor shards: ZeRO states

    losses: list[float] = []
    grads: dict[str, torch.Tensor] | None = None
    for step in range(run.steps):
        opt.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64, device=device)
        tokens_labels = (t.to(device) for t in run.batch(step))
        for i, (tokens, labels) in enumerate(micro_batches(*tokens_labels, dp_rank, dp, mbs)):
            last = i == n_micro - 1
            sync = net.no_sync() if isinstance(net, DistributedDataParallel) and not last else _no_context()
            with sync:
                loss = net(tokens, labels)
                if inject == "scale-loss" and dp_rank == dp - 1:
                    loss = loss * 2
                (loss / n_micro).backward()
            total += loss.detach().to(torch.float64)
        if scale != 1.0:
            # FSDP2 summed over the dp ranks instead of averaging (seen on gloo in some torch versions)
            for p in model.parameters():
                p.grad.div_(scale)
        dist.all_reduce(total, group=group)
        losses.append(float(total) / (dp * n_micro))
        if step == 0:
            full = {name: _full(p.grad) for name, p in model.named_parameters()}
            grads = full if dp_rank == 0 else None
        opt.step()
    full = {name: _full(p) for name, p in model.named_parameters()}
    params = full if dp_rank == 0 else None
    layout = f"dp{dp} zero{zero} mbs{mbs} x{n_micro}" + (f" [{inject}]" if inject else "")
    return DPResult(run=run, losses=tuple(losses), grads=grads, params=params, layout=layout,
                    rank=rank, dp=dp, zero=zero, mbs=mbs)


def dp_step(rank: int, world: int, spec: ModelSpec | str | Mapping[str, Any], zero: int, gbs: int, seq: int,
            mbs: int, steps: int = 1, seed: int = 0, lr: float = 1e-3, dtype: str = "float64",
            inject: str | None = None) -> DPResult:
    """`dp_run` over all `world` ranks, the run given field by field (spec as a ModelSpec, its JSON or dict).

    Made for `run_world(dp, dp_step, spec, zero, gbs, seq, mbs, steps, seed)` and `run_torchrun(dp_step, ...)`."""
    run = RunSpec(model=spec, gbs=gbs, seq=seq, steps=steps, seed=seed, lr=lr, dtype=dtype)
    return dp_run(rank, world, run, zero, mbs, inject=inject)
