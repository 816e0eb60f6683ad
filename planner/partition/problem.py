"""The partition problem: per-layer costs of one candidate's stages, the sync model of its gradient reduction, and
the result a solver returns (planner/partition/__init__.py says what the objective is)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from itertools import pairwise
from typing import Literal

import numpy as np

from meshplan.costmodels.config import StagePolicy
from meshplan.costmodels.passes import SyncCoefficients


Schedule = Literal["1f1b", "gpipe", "zb"]
Granularity = Literal["none", "selective", "full"]
CpPolicies = Literal["uniform-none", "uniform-selective", "uniform-full", "per-stage"]

SCHEDULES: tuple[Schedule, ...] = ("1f1b", "gpipe", "zb")
GRANULARITIES: tuple[Granularity, ...] = ("none", "selective", "full")
CP_POLICIES: tuple[CpPolicies, ...] = ("uniform-none", "uniform-selective", "uniform-full", "per-stage")
TIE_RTOL = 1e-12  # objectives this close (relative) count as equal; the smallest boundaries win
NS_PER_S = 1e9  # CP-SAT times are integer nanoseconds


def _check_number(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    return float(value)


def _check_numbers(name: str, values) -> tuple[float, ...]:
    """A sequence of finite numbers >= 0 as a tuple of floats (vectorised: the planner builds thousands)."""
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError):
        arr = None
    if arr is None or arr.ndim != 1:
        for i, v in enumerate(values):  # name the first offending entry
            _check_number(f"{name}[{i}]", v)
        raise ValueError(f"{name} must be a sequence of numbers")
    bad = ~np.isfinite(arr) | (arr < 0)
    if bad.any():
        i = int(np.argmax(bad))
        _check_number(f"{name}[{i}]", values[i])
    return tuple(arr.tolist())


@dataclass(frozen=True)
class SyncModel(SyncCoefficients):
    """Per-stage time after the stage's last backward: exposed DP gradient reduce, exposed param gather, optimizer.
    The cost model's coefficients (a collective over P parameters takes alpha + beta * P seconds when P > 0, else 0)
    and how the runtime overlaps them."""

    overlap_reduce: bool = False  # True: only max(0, reduce - backward_window) is exposed
    overlap_gather: bool = False  # True: only max(0, gather - forward_window) is exposed
    # the compute slowdown per second of overlapped collective (costmodels.kernels.overlapped_exposed): the
    # exposure is then at least (1 - c) max(0, collective - window) + c collective, a bound of the estimate's
    contention: float = 0.0
    # Megatron's overlap leaves one layer's bucket of the stage exposed (kernels.overlapped_exposed's unhidden share,
    # 1 / the stage's layers, as simulate_config): read by the O(p L^3) gap-closing bounds (_uniform_grids) and
    # per_stage_partitions_below, not by J (solve_dp, evaluate, CP-SAT), which stays the looser bound
    overlap_leaves_one_layer: bool = False

    @classmethod
    def of(cls, coefficients: SyncCoefficients, overlap_reduce: bool, overlap_gather: bool, contention: float,
           overlap_leaves_one_layer: bool) -> SyncModel:
        """The cost model's coefficients with the runtime's overlap (the fields above)."""
        return cls(**{f.name: getattr(coefficients, f.name) for f in fields(SyncCoefficients)},
                   overlap_reduce=overlap_reduce, overlap_gather=overlap_gather, contention=contention,
                   overlap_leaves_one_layer=overlap_leaves_one_layer)

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.startswith("overlap_"):
                if not isinstance(value, (bool, np.bool_)):
                    raise ValueError(f"{f.name} must be a bool, got {value!r}")
                object.__setattr__(self, f.name, bool(value))
            else:
                object.__setattr__(self, f.name, _check_number(f.name, value))

    @classmethod
    def zero(cls) -> SyncModel:
        """No data parallelism: nothing to reduce, gather or update after the last backward."""
        return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


_NO_SYNC = SyncModel.zero()
_LAYER_FIELDS = ("layer_forward", "layer_backward", "layer_selective_extra", "layer_full_extra", "layer_state_bytes",
                 "layer_act_none", "layer_act_selective", "layer_act_full", "layer_params_dense",
                 "layer_params_expert")
_SCALAR_FIELDS = ("first_forward", "first_backward", "first_state_bytes", "first_act_bytes", "first_params_dense",
                  "last_forward", "last_backward", "last_state_bytes", "last_fixed_bytes", "last_params_dense",
                  "stage_forward_extra", "stage_backward_extra", "hop_s", "fixed_bytes", "fragmentation",
                  "memory_cap_bytes")


@dataclass(frozen=True)
class PartitionProblem:
    """L decoder layers cut into p contiguous stages; seconds per micro-batch, bytes per GPU.

    Stage 0 also runs the embedding ("first" block), stage p-1 the LM head and loss ("last" block)."""

    num_stages: int  # p
    num_microbatches: int  # m
    schedule: Schedule
    layer_forward: tuple[float, ...]  # len L, forward time of layer i
    layer_backward: tuple[float, ...]  # len L, backward time (input + weight grads) without recomputation
    layer_selective_extra: tuple[float, ...]  # extra backward time of layer i under selective recompute
    layer_full_extra: tuple[float, ...]  # extra backward time of layer i under full recompute
    layer_state_bytes: tuple[float, ...]  # weights + gradients + optimizer states of layer i (one GPU)
    layer_act_none: tuple[float, ...]  # activation bytes layer i keeps per micro-batch, no recompute
    layer_act_selective: tuple[float, ...]
    layer_act_full: tuple[float, ...]
    layer_params_dense: tuple[float, ...]  # parameters of layer i on one GPU, replicated over the dense DP group
    layer_params_expert: tuple[float, ...]  # parameters of layer i on one GPU, replicated over the expert DP group
    first_forward: float
    first_backward: float
    first_state_bytes: float
    first_act_bytes: float  # per held micro-batch
    first_params_dense: float
    last_forward: float
    last_backward: float
    last_state_bytes: float
    last_fixed_bytes: float  # logits buffer
    last_params_dense: float
    stage_forward_extra: float  # added to every stage's forward (blocking P2P), may be 0
    stage_backward_extra: float  # added to every stage's backward
    hop_s: float  # P2P latency between adjacent stages (non-blocking transfer)
    fixed_bytes: float  # per-GPU buffers on every stage
    fragmentation: float  # memory total = (sum of parts) * (1 + fragmentation)
    memory_cap_bytes: float
    sync: SyncModel

    def __post_init__(self) -> None:
        for name in ("num_stages", "num_microbatches"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        lengths = set()
        for name in _LAYER_FIELDS:
            values = getattr(self, name)
            if isinstance(values, (str, bytes)) or not hasattr(values, "__len__"):
                raise ValueError(f"{name} must be a sequence of numbers")
            lengths.add(len(values))
        if len(lengths) != 1:
            raise ValueError(f"per-layer sequences differ in length: {sorted(lengths)}")
        try:  # all per-layer fields in one array (a planner builds thousands of problems); errors name the field
            table = np.array([getattr(self, name) for name in _LAYER_FIELDS], dtype=float)
            valid = table.ndim == 2 and bool(np.all(np.isfinite(table) & (table >= 0)))
        except (TypeError, ValueError):
            valid = False
        if valid:
            for name, row in zip(_LAYER_FIELDS, table.tolist(), strict=True):
                object.__setattr__(self, name, tuple(row))
        else:
            for name in _LAYER_FIELDS:
                object.__setattr__(self, name, _check_numbers(name, getattr(self, name)))
        for name in _SCALAR_FIELDS:
            object.__setattr__(self, name, _check_number(name, getattr(self, name)))
        if not isinstance(self.sync, SyncModel):
            raise ValueError("sync must be a SyncModel")
        if self.num_layers < self.num_stages:
            raise ValueError(f"{self.num_layers} layers cannot fill {self.num_stages} non-empty stages")

    @property
    def num_layers(self) -> int:
        return len(self.layer_forward)

    def held_microbatches(self, r):
        """Micro-batches whose activations rank r holds at its peak: 1F1B and ZB-H1 keep p - r in flight
        (Narayanan et al. 2021, sec. 2.2; Qi et al. 2024, sec. 3.1), GPipe all m (Huang et al. 2019). r: an int or
        an array of ranks."""
        if self.schedule == "gpipe":
            return self.num_microbatches
        if isinstance(r, np.ndarray):
            return np.minimum(self.num_stages - r, self.num_microbatches)
        return min(self.num_stages - r, self.num_microbatches)


@dataclass(frozen=True)
class PartitionResult:
    """One partition and its float evaluation (seconds, bytes per GPU)."""

    boundaries: tuple[int, ...]
    policies: tuple[StagePolicy, ...]
    objective: float  # J = max_r J_r
    stage_objective: tuple[float, ...]  # J_r
    stage_memory_bytes: tuple[float, ...]
    stage_time: tuple[float, ...]  # t_r = f_r + b_r

    @property
    def stage_layers(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in pairwise(self.boundaries))

    @property
    def binding_stage(self) -> int:
        """The rank whose J_r is J (the first one on ties)."""
        return self.stage_objective.index(max(self.stage_objective))
