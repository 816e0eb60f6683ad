"""Helpers shared by the executor tests (import only where torch is installed)."""

from __future__ import annotations

import functools

import torch

from meshplan.costmodels.config import (DEFAULT_RANK_ORDER, CpComm, Layout, ParallelConfig, RankOrder, Schedule,
                                        StagePolicy, Workload, ZeroStage, resolve)
from meshplan.executor.reference import RunResult, RunSpec, reference_run


@functools.cache
def reference(run: RunSpec) -> RunResult:
    """The single-process run, computed once per RunSpec for the whole test session (one torch thread, as the ranks)."""
    torch.set_num_threads(1)
    return reference_run(run)


def exec_layout(run: RunSpec, world: int, **knobs) -> Layout:
    """The layout `meshplan verify` would run for these knobs on `world` ranks: the cost model's resolve() (defaults
    filled, every rule checked)."""
    return resolve(run.model, world, Workload(global_batch=run.gbs, seq_len=run.seq), ParallelConfig(**knobs))


def layout(*, tp: int = 1, pp: int = 1, vpp: int = 1, dp: int = 1, cp: int = 1, cp_comm: CpComm = "ring", ep: int = 1,
           etp: int = 1, mbs: int = 1, num_microbatches: int = 1, zero: ZeroStage = 0, sp: bool = False,
           schedule: Schedule = "1f1b", stage_layers: tuple[int, ...] = (1,),
           stage_recompute: tuple[tuple[str, int], ...] | None = None, rank_order: RankOrder = DEFAULT_RANK_ORDER,
           chunks: tuple[int, ...] = ()) -> Layout:
    """A Layout given field by field and not checked (resolve() checks a plan's): the executor's pieces tested on
    layouts a plan would not have, or without a model. stage_recompute: (granularity, full_layers) per stage."""
    policies = tuple(StagePolicy.model_construct(granularity=g, full_layers=k)
                     for g, k in (stage_recompute or (("none", 0),) * len(stage_layers)))
    return Layout(tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, cp_comm=cp_comm, ep=ep, etp=etp,
                  edp=tp * cp * dp // (etp * ep), mbs=mbs, num_microbatches=num_microbatches, zero=zero,
                  recompute="per-stage", sp=sp, schedule=schedule, stage_layers=stage_layers,
                  stage_recompute=policies, rank_order=rank_order, chunks=chunks)
