"""Helpers shared by the executor tests (import only where torch is installed)."""

from __future__ import annotations

import functools

import torch

from meshplan.costmodels.config import ParallelConfig, Workload, resolve
from meshplan.executor.mesh import ExecLayout
from meshplan.executor.reference import RunResult, RunSpec, reference_run


@functools.cache
def reference(run: RunSpec) -> RunResult:
    """The single-process run, computed once per RunSpec for the whole test session (one torch thread, as the ranks)."""
    torch.set_num_threads(1)
    return reference_run(run)


def exec_layout(run: RunSpec, world: int, **knobs) -> ExecLayout:
    """The layout `meshplan verify` would run for these knobs on `world` ranks: the cost model's resolve() (defaults
    filled, every rule checked), as the executor takes it."""
    lay = resolve(run.model, world, Workload(global_batch=run.gbs, seq_len=run.seq), ParallelConfig(**knobs))
    return ExecLayout.from_layout(lay)
