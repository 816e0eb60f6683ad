"""Helpers shared by the executor tests (import only where torch is installed)."""

from __future__ import annotations

import functools

import torch

from meshplan.executor.reference import RunResult, RunSpec, reference_run


@functools.cache
def reference(run: RunSpec) -> RunResult:
    """The single-process run, computed once per RunSpec for the whole test session (one torch thread, as the ranks)."""
    torch.set_num_threads(1)
    return reference_run(run)
