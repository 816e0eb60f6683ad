"""Pipeline stage partitioning: which contiguous decoder layers each pipeline rank runs, and what it recomputes.

The objective J is a lower bound on the event-simulated step time (costmodels/pipeline.py) that is tight when no
stage stalls (meshplan docs/cost_model.md, pipeline bounds). Three solvers minimise it over the same feasible set:
solve_dp (exact, one recomputation policy on every stage), solve_cpsat (OR-Tools CP-SAT, also per-stage policies)
and brute_force (enumeration, the test oracle). All results come out of one float evaluation, evaluate().
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, fields, replace
from typing import Literal

import numpy as np
from ortools.sat.python import cp_model

from costmodels.config import StagePolicy
from costmodels.deadline import Deadline, check

Schedule = Literal["1f1b", "gpipe", "zb"]
Granularity = Literal["none", "selective", "full"]
CpPolicies = Literal["uniform-none", "uniform-selective", "uniform-full", "per-stage"]

SCHEDULES = ("1f1b", "gpipe", "zb")
GRANULARITIES = ("none", "selective", "full")
CP_POLICIES = ("uniform-none", "uniform-selective", "uniform-full", "per-stage")
TIE_RTOL = 1e-12  # objectives this close (relative) count as equal; the smallest boundaries win
NS_PER_S = 1e9  # CP-SAT times are integer nanoseconds
FULL_CUT_SCAN_MAX_CELLS = 2**22  # _first_full_cut tries every cut at once up to this many cells (32 MB a float array)
BLOCK_MAX_CELLS = 2**20  # the DPs build their (stage, first layer, end) grids this many cells at a time (8 MB an array)


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
class SyncModel:
    """Per-stage time after the stage's last backward: exposed DP gradient reduce, exposed param gather, optimizer.
    A collective over P parameters takes alpha + beta * P seconds when P > 0 (alpha-beta ring model), else 0."""

    reduce_alpha_dense: float
    reduce_beta_dense: float
    reduce_alpha_expert: float
    reduce_beta_expert: float
    gather_alpha_dense: float
    gather_beta_dense: float
    gather_alpha_expert: float
    gather_beta_expert: float
    overlap_reduce: bool  # True: only max(0, reduce - backward_window) is exposed
    overlap_gather: bool  # True: only max(0, gather - forward_window) is exposed
    optimizer_s_per_dense_param: float
    optimizer_s_per_expert_param: float
    # the compute slowdown per second of overlapped collective (costmodels.kernels.overlapped_exposed): the
    # exposure is then at least (1 - c) max(0, collective - window) + c collective, a bound of the estimate's
    contention: float = 0.0
    # Megatron's overlap leaves one layer's bucket of the stage exposed (kernels.overlapped_exposed's unhidden share,
    # 1 / the stage's layers, as simulate_config): read by the O(p L^3) gap-closing bounds (_uniform_grids) and
    # per_stage_partitions_below, not by J (solve_dp, evaluate, CP-SAT), which stays the looser bound
    overlap_leaves_one_layer: bool = False

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
    def zero(cls) -> "SyncModel":
        """No data parallelism: nothing to reduce, gather or update after the last backward."""
        return cls(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, False, False, 0.0, 0.0, 0.0)


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
            for name, row in zip(_LAYER_FIELDS, table.tolist()):
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
        return tuple(b - a for a, b in zip(self.boundaries, self.boundaries[1:]))

    @property
    def binding_stage(self) -> int:
        """The rank whose J_r is J (the first one on ties)."""
        return self.stage_objective.index(max(self.stage_objective))


# ---- prefix tables and the per-stage terms (scalar and numpy-vectorised alike) ---------------------------------------

@dataclass(frozen=True)
class _Tables:
    """Prefix sums over layers (entry x = sum of layers [0, x)) and per-layer recompute peaks, padded to L + 1.

    evaluate() and solve_dp() read stage sums from the same tables with the same operations, so a stage's memory is
    bit-identical in both and the DP's feasibility is exactly evaluate()'s."""

    fwd: np.ndarray
    bwd: np.ndarray
    sel: np.ndarray
    full: np.ndarray
    zero: np.ndarray
    state: np.ndarray
    act_none: np.ndarray
    act_sel: np.ndarray
    act_full: np.ndarray
    act_min: np.ndarray
    dense: np.ndarray
    expert: np.ndarray
    peak_sel: np.ndarray
    peak_full: np.ndarray
    full_shrinks: bool  # every layer holds no more under full recompute than without: memory falls as it spreads


def _prefix(values) -> np.ndarray:
    out = np.zeros(len(values) + 1)
    np.cumsum(np.asarray(values, dtype=float), out=out[1:])
    return out


def _tables(pr: PartitionProblem) -> _Tables:
    """Prefix sums of the per-layer values, built once per problem (the problem is immutable)."""
    cached = pr.__dict__.get("_tables")
    if cached is None:
        cached = _build_tables(pr)
        object.__setattr__(pr, "_tables", cached)
    return cached


def _build_tables(pr: PartitionProblem) -> _Tables:
    act_none, act_sel, act_full = (np.asarray(v) for v in (pr.layer_act_none, pr.layer_act_selective,
                                                           pr.layer_act_full))
    return _Tables(
        fwd=_prefix(pr.layer_forward), bwd=_prefix(pr.layer_backward), sel=_prefix(pr.layer_selective_extra),
        full=_prefix(pr.layer_full_extra), zero=np.zeros(pr.num_layers + 1), state=_prefix(pr.layer_state_bytes),
        act_none=_prefix(act_none), act_sel=_prefix(act_sel), act_full=_prefix(act_full),
        act_min=_prefix(np.minimum(np.minimum(act_none, act_sel), act_full)),
        dense=_prefix(pr.layer_params_dense), expert=_prefix(pr.layer_params_expert),
        # The first layer is recomputed during its own backward and briefly holds all it regenerates
        # (Korthikanti et al. 2022, sec. 5).
        peak_sel=np.append(act_none - act_sel, 0.0), peak_full=np.append(act_none - act_full, 0.0),
        full_shrinks=bool(np.all(act_full <= act_none)),
    )


def _cuts(t: _Tables, pol: StagePolicy, i: int, j: int) -> tuple[int, int, float]:
    """(c, d, peak): layers [i, c) recompute in full, [i, d) selectively; at most one of the two is non-empty."""
    if pol.granularity == "selective":
        return i, j, float(t.peak_sel[i])
    if pol.granularity == "full":
        return i + pol.full_layers, i, float(t.peak_full[i])
    return i, i, 0.0


def _max(a, b):
    """np.maximum, with plain floats for one stage (evaluate): numpy on scalars costs microseconds a call."""
    if isinstance(a, float) and isinstance(b, float):
        return a if a >= b or a != a else b  # NaN propagates as with np.maximum
    return np.maximum(a, b)


def _when(cond, x: float):
    """x where cond holds, else 0.0: for one rank (a bool) or an array of ranks at once (the same floats)."""
    if isinstance(cond, np.ndarray):
        return np.where(cond, x, 0.0)
    return x if cond else 0.0


def _forward_const(pr: PartitionProblem, r):
    p = pr.num_stages
    return _when(r == 0, pr.first_forward) + _when(r == p - 1, pr.last_forward) + pr.stage_forward_extra


def _backward_const(pr: PartitionProblem, r):
    p = pr.num_stages
    return _when(r == 0, pr.first_backward) + _when(r == p - 1, pr.last_backward) + pr.stage_backward_extra


@dataclass(frozen=True)
class _LayerSums:
    """Sums over a stage's layers [i, j): floats, or arrays over the whole (i, j) grid at once."""

    fwd: object
    bwd: object
    extra: object  # recompute extra of [i, d) (selective) and [i, c) (full)
    state: object
    act: object  # activation bytes per held micro-batch
    dense: object
    expert: object


def _layer_sums(t: _Tables, i, j, c, d, relaxed: bool) -> _LayerSums:
    """act_full on [i, c), act_selective on [i, d), act_none on the rest (c + d - i ends whichever recomputed part is
    non-empty). relaxed: each layer's smallest activations, a bound over every policy."""
    if c is i and d is i and not relaxed:  # no recomputation (the common case): half the gathers
        return _LayerSums(fwd=t.fwd[j] - t.fwd[i], bwd=t.bwd[j] - t.bwd[i], extra=0.0,
                          state=t.state[j] - t.state[i], act=t.act_none[j] - t.act_none[i],
                          dense=t.dense[j] - t.dense[i], expert=t.expert[j] - t.expert[i])
    if relaxed:
        act = t.act_min[j] - t.act_min[i]
    else:
        act = ((t.act_full[c] - t.act_full[i]) + (t.act_sel[d] - t.act_sel[i])
               + (t.act_none[j] - t.act_none[c + d - i]))
    return _LayerSums(fwd=t.fwd[j] - t.fwd[i], bwd=t.bwd[j] - t.bwd[i],
                      extra=(t.sel[d] - t.sel[i]) + (t.full[c] - t.full[i]), state=t.state[j] - t.state[i],
                      act=act, dense=t.dense[j] - t.dense[i], expert=t.expert[j] - t.expert[i])


def _stage_forward(pr, r, s: _LayerSums):
    """f_r (meshplan docs/cost_model.md, pipeline bounds)."""
    return s.fwd + _forward_const(pr, r)


def _stage_backward(pr, r, s: _LayerSums):
    """b_r: backward, recompute extra, the first/last blocks' backward and the blocking P2P."""
    return s.bwd + s.extra + _backward_const(pr, r)


def _stage_memory(pr, r, s: _LayerSums, peak):
    """memory_r = (state + held x activations + recompute peak + buffers) x (1 + fragmentation)
    (meshplan docs/cost_model.md, pipeline bounds; Korthikanti et al. 2022, sec. 4-5)."""
    p = pr.num_stages
    const = _when(r == 0, pr.first_state_bytes) + _when(r == p - 1, pr.last_state_bytes + pr.last_fixed_bytes)
    per_mb = s.act + _when(r == 0, pr.first_act_bytes)
    return ((s.state + const) + pr.held_microbatches(r) * per_mb + peak + pr.fixed_bytes) * (1.0 + pr.fragmentation)


def _collective(alpha: float, beta: float, params):
    """alpha + beta * P when P > 0, else nothing to send (alpha-beta ring model)."""
    if alpha == 0.0 and beta == 0.0:
        return 0.0
    if isinstance(params, float):  # one stage (evaluate): plain floats are several times faster than numpy scalars
        return alpha + beta * params if params > 0 else 0.0
    return np.where(params > 0, alpha + beta * params, 0.0)


def _stage_sync(pr, r, s: _LayerSums, f, b, layers=None):
    """E_r: exposed gradient reduce and parameter gather, then the optimizer step (meshplan docs/cost_model.md).
    layers: the stage's layer count (float or grid); with SyncModel.overlap_leaves_one_layer at least 1/layers of
    each overlapped collective is exposed."""
    p, sy = pr.num_stages, pr.sync
    if sy == _NO_SYNC:  # a bound without DP sync (the search's family bound): nothing to add
        return 0.0
    dense = s.dense + _when(r == 0, pr.first_params_dense) + _when(r == p - 1, pr.last_params_dense)
    expert = s.expert
    reduce = _collective(sy.reduce_alpha_dense, sy.reduce_beta_dense, dense) + _collective(
        sy.reduce_alpha_expert, sy.reduce_beta_expert, expert)
    gather = _collective(sy.gather_alpha_dense, sy.gather_beta_dense, dense) + _collective(
        sy.gather_alpha_expert, sy.gather_beta_expert, expert)
    c = sy.contention
    share = 0.0
    if layers is not None and sy.overlap_leaves_one_layer:
        share = 1.0 / _max(layers, 1.0) if isinstance(layers, float) else 1.0 / np.maximum(layers, 1)
    exposed = ((1 - c) * _max(_max(0.0, reduce - b), share * reduce) + c * reduce if sy.overlap_reduce else reduce) + (
        (1 - c) * _max(_max(0.0, gather - f), share * gather) + c * gather if sy.overlap_gather else gather)
    return exposed + sy.optimizer_s_per_dense_param * dense + sy.optimizer_s_per_expert_param * expert


def _round_trips(pr, r: int, f, b, t_after):
    """The 1F1B round-trip gains of rank r (see _end_pieces): (first, last, middle, n middles with both ends,
    n middles after the first alone), or None when micro-batch 0's and m-1's round trips cannot share a path."""
    p, m, h = pr.num_stages, pr.num_microbatches, pr.hop_s
    trip = t_after + 2 * (p - 1 - r) * h
    w = np.minimum(p - r - 1, m) if isinstance(r, np.ndarray) else min(p - r - 1, m)
    around = np.minimum(w, m - 1) if isinstance(r, np.ndarray) else min(w, m - 1)
    n = w + 1
    first, last = trip - around * f, trip - around * b
    if not isinstance(r, np.ndarray) and m - 1 < n:
        return first, last, None, 0, 0
    return first, last, trip - w * (f + b), (m - 1) // n - 1, (m - 1 - w) // n  # arrays: see _end_time


def _end_pieces(pr, r: int, f, b, start, t_after) -> list:
    """Lower bounds on when rank r ends its last pass, each the length of one dependency path (meshplan
    docs/cost_model.md, pipeline bounds); linear with integer coefficients, for CP-SAT. _end_time is their max.

    A round trip RT = T_>r + 2 (p-1-r) h separates F_k(r) from B_k(r) (the micro-batch goes to the last stage and
    back). A path through rank r's own passes that swaps the passes its order puts between F_k and B_k for that round
    trip gains RT minus their time. 1F1B (Narayanan et al. 2021, sec. 2.2), w = min(p-r-1, m) warm-up forwards:
    between F_0 and B_0 lie min(w, m-1) forwards, between F_{m-1} and B_{m-1} as many backwards, and between a
    steady-state F_k and B_k w of each; round trips share a path when k' >= k + w + 1, so any subset of them does.
    GPipe: F_{m-1}'s round trip after all m forwards, then all m backwards (Huang et al. 2019). ZB-H1 sends the input
    gradient before the weight pass, so without the input/weight split only the rank's own work is certain (Qi et
    al. 2024)."""
    p, m, h = pr.num_stages, pr.num_microbatches, pr.hop_s
    base = start + m * (f + b)
    if pr.schedule == "zb":
        return [base]
    if pr.schedule == "gpipe":
        return [base, start + m * f + t_after + 2 * (p - 1 - r) * h + m * b]
    first, last, middle, k_both, k_first = _round_trips(pr, r, f, b, t_after)
    if middle is None:
        return [base, base + first, base + last]
    pieces = [base + x * first + y * last + z * k_both * middle for x in (0, 1) for y in (0, 1) for z in (0, 1)]
    return pieces + [base + x * first + k_first * middle for x in (0, 1)]


def _end_time(pr, r: int, f, b, start, t_after):
    """max(_end_pieces) in closed form (each round trip counts where it gains): floats and numpy grids."""
    p, m, h = pr.num_stages, pr.num_microbatches, pr.hop_s
    base = start + m * (f + b)
    if pr.schedule == "zb":
        return base
    if pr.schedule == "gpipe":
        return _max(base, start + m * f + t_after + 2 * (p - 1 - r) * h + m * b)
    first, last, middle, k_both, k_first = _round_trips(pr, r, f, b, t_after)
    first, last = _max(first, 0.0), _max(last, 0.0)
    if middle is None:
        return base + _max(first, last)
    middle = _max(middle, 0.0)
    end = base + _max(first + last + k_both * middle, first + k_first * middle)
    if isinstance(r, np.ndarray):  # ranks whose round trips cannot share a path (see _round_trips)
        end = np.where(m - 1 < np.minimum(p - r - 1, m) + 1, base + _max(first, last), end)
    return end


def _stage_objective(pr, r, f, b, e, f_before, b_before, t_after):
    """J_r: rank r's last pass ends no earlier than _end_time; the gradient then still flows back through
    ranks r-1..0 and its DP sync runs (meshplan docs/cost_model.md, pipeline bounds)."""
    end = _end_time(pr, r, f, b, f_before + r * pr.hop_s, t_after)
    if pr.schedule == "zb":  # weight passes may trail (Qi et al. 2024): only the rank's own finish is bounded
        return end + e
    return end + _max(b_before + r * pr.hop_s, e)


# ---- evaluate --------------------------------------------------------------------------------------------------------

def _check_partition(pr: PartitionProblem, boundaries, policies) -> tuple[tuple[int, ...], tuple[StagePolicy, ...]]:
    p, L = pr.num_stages, pr.num_layers
    try:
        bounds = tuple(operator.index(b) for b in boundaries)
    except TypeError as exc:
        raise ValueError(f"boundaries must be integers, got {boundaries!r}") from exc
    if len(bounds) != p + 1 or bounds[0] != 0 or bounds[-1] != L:
        raise ValueError(f"boundaries must be {p + 1} ints from 0 to {L}, got {bounds}")
    if any(b <= a for a, b in zip(bounds, bounds[1:])):
        raise ValueError(f"boundaries must be strictly increasing, got {bounds}")
    pols = tuple(policies)
    if len(pols) != p or not all(isinstance(q, StagePolicy) for q in pols):
        raise ValueError(f"need {p} StagePolicy, got {pols!r}")
    for r, q in enumerate(pols):
        if q.full_layers > bounds[r + 1] - bounds[r]:
            raise ValueError(f"stage {r} has {bounds[r + 1] - bounds[r]} layers, cannot recompute {q.full_layers}")
    return bounds, pols


def _evaluate(pr: PartitionProblem, t: _Tables, bounds: tuple[int, ...], pols: tuple[StagePolicy, ...],
              relaxed: bool) -> PartitionResult | None:
    p = pr.num_stages
    f, b, e, mem = [], [], [], []
    for r in range(p):
        i, j = bounds[r], bounds[r + 1]
        c, d, peak = (i, i, 0.0) if relaxed else _cuts(t, pols[r], i, j)
        sums = _layer_sums(t, i, j, c, d, relaxed)
        mem.append(float(_stage_memory(pr, r, sums, peak)))
        if not mem[-1] <= pr.memory_cap_bytes:
            return None
        f.append(float(_stage_forward(pr, r, sums)))
        b.append(float(_stage_backward(pr, r, sums)))
        e.append(float(_stage_sync(pr, r, sums, f[r], b[r])))
    stage_obj = tuple(float(_stage_objective(pr, r, f[r], b[r], e[r], sum(f[:r]), sum(b[:r]),
                                             sum(f[s] + b[s] for s in range(r + 1, p)))) for r in range(p))
    return PartitionResult(bounds, pols, max(stage_obj), stage_obj, tuple(mem),
                           tuple(fr + br for fr, br in zip(f, b)))


def evaluate(problem: PartitionProblem, boundaries, policies) -> PartitionResult | None:
    """J and per-stage memory of one partition; None when a stage exceeds the memory cap.

    boundaries: p + 1 ints, 0 = b_0 < ... < b_p = L (stage r runs layers [b_r, b_{r+1})); policies: p StagePolicy.
    Raises ValueError on malformed boundaries or policies."""
    bounds, pols = _check_partition(problem, boundaries, policies)
    return _evaluate(problem, _tables(problem), bounds, pols, relaxed=False)


# ---- exact DP for a uniform policy -----------------------------------------------------------------------------------

def solve_dp(problem: PartitionProblem, policy: Granularity, relaxed: bool = False,
             below: float = math.inf, deadline: Deadline | None = None) -> PartitionResult | None:
    """Best contiguous partition with `policy` on every stage ("full": all of a stage's layers), or None.

    With one policy everywhere, every J_r depends only on (r, first layer i, end j), so min max_r J_r is a bottleneck
    path: W[r][i] = min_j max(J_r(i, j), W[r+1][j]), O(p L^2), vectorised per r. Ties within TIE_RTOL go to the
    lexicographically smallest boundaries.

    relaxed=True returns a lower bound over every per-stage policy mix (none / selective / full-k), not a plan:
    times without recompute extras (J_r never decreases when a backward grows: end_r gains >= m x the growth, the
    exposed reduce loses at most it) and memory from each layer's smallest activations without the recompute peak
    (any policy keeps act_none of the stage's first layer plus one of the three amounts per later layer). Its
    policies read "none" and its stage_memory_bytes are those lower bounds.

    below: a search's cutoff; when no partition's J is below it, None (as when none fits) at a fraction of the cost.
    deadline: checked as the DP goes (raises TimeLimitReached).
    """
    if policy not in GRANULARITIES:
        raise ValueError(f"policy must be one of {GRANULARITIES}, got {policy!r}")
    p = problem.num_stages
    t = _tables(problem)
    ext = _uniform_extra(t, "none" if relaxed else policy)
    bounds = _bottleneck_path(problem, t, lambda R, I, J: _uniform_cuts(t, "none" if relaxed else policy, I, J)[0],
                              ext, relaxed, below=below, deadline=deadline)
    if bounds is None:
        return None
    pols = tuple(StagePolicy(granularity="full", full_layers=bounds[r + 1] - bounds[r])
                 if policy == "full" and not relaxed else StagePolicy(granularity="none" if relaxed else policy)
                 for r in range(p))
    result = _evaluate(problem, t, bounds, pols, relaxed)
    assert result is not None, "DP and evaluate disagree on feasibility"
    return result


def may_fit(problem: PartitionProblem, policy: Granularity, relaxed: bool = False) -> bool:
    """False only when no partition fits in memory under `policy` on every stage (relaxed: under any per-stage
    policy mix, as solve_dp's relaxed mode), in O(p log L) instead of the DP's O(p L^2).

    A relaxation, then a greedy: stages may be empty and each non-empty stage's recompute peak is the smallest any
    layer has; a stage's memory then only grows when its layer range grows, so taking as many layers as fit, stage
    by stage, places all L layers whenever any partition of the relaxation does (exchange argument: the greedy's
    r-th boundary is never behind a feasible partition's). Every real partition is one of the relaxation's, so a
    greedy that falls short proves that none fits. The cap gets 1e-9 of slack against rounding."""
    if policy not in GRANULARITIES:
        raise ValueError(f"policy must be one of {GRANULARITIES}, got {policy!r}")
    pr, t = problem, _tables(problem)
    p, L = pr.num_stages, pr.num_layers
    if relaxed:
        act, peak = t.act_min, 0.0
    else:
        act = {"none": t.act_none, "selective": t.act_sel, "full": t.act_full}[policy]
        peak = 0.0 if policy == "none" else float(np.min((t.peak_sel if policy == "selective" else t.peak_full)[:L]))
    room = pr.memory_cap_bytes * (1 + 1e-9) / (1.0 + pr.fragmentation) - pr.fixed_bytes
    start = 0
    for r in range(p):
        held = pr.held_microbatches(r)
        const = ((pr.first_state_bytes + held * pr.first_act_bytes if r == 0 else 0.0)
                 + (pr.last_state_bytes + pr.last_fixed_bytes if r == p - 1 else 0.0))
        if const > room:
            return False
        # the largest end e with state[start, e) + held x act[start, e) + peak <= room - const
        level = t.state + held * act
        end = int(np.searchsorted(level, room - const - peak + level[start], side="right")) - 1
        start = max(start, min(end, L))
    return start >= L


def dp_bound(problem: PartitionProblem, policy: Granularity, below: float = math.inf,
             deadline: Deadline | None = None) -> float:
    """solve_dp's optimal objective alone (inf when nothing fits): what a search needs to prune, without building
    the plan. Equal to solve_dp(problem, policy).objective up to float rounding of the same sums when that is below
    `below` (a search's cutoff), inf otherwise (the optimum is then >= below)."""
    if policy not in GRANULARITIES:
        raise ValueError(f"policy must be one of {GRANULARITIES}, got {policy!r}")
    t = _tables(problem)
    return _bottleneck_path(problem, t, lambda R, I, J: _uniform_cuts(t, policy, I, J)[0], _uniform_extra(t, policy),
                            False, value_only=True, below=below, deadline=deadline)


def _uniform_cuts(t: _Tables, policy: Granularity, i, j):
    """((c, d, peak), ext) of one policy on every stage: on the (i, j) grid the full-recompute part [i, c), the
    selective part [i, d) and the recompute peak; ext the prefix of the recompute extras of every layer."""
    if policy == "none":
        return (i, i, 0.0), t.zero
    if policy == "selective":
        return (i, j, t.peak_sel[i]), t.sel
    return (j, i, t.peak_full[i]), t.full


def _uniform_extra(t: _Tables, policy: Granularity) -> np.ndarray:
    """The prefix of the recompute extras of every layer under one policy everywhere."""
    return _uniform_cuts(t, policy, 0, 0)[1]


def _grid(L: int) -> tuple[np.ndarray, np.ndarray]:
    """Index grids: i (first layer) down the rows, j (end) across the columns."""
    return np.arange(L + 1)[:, None], np.arange(L + 1)[None, :]


def _stage_grid(p: int, L: int, longest: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(R, I, J) index grids of shape (p, 1, 1), (p, width, 1) and (p, width, longest): stage r runs layers [I, J),
    J = I + 1 + k for k < longest. Stage r starts at layer r or later and leaves a layer to each later stage, so
    I = r + a for a < width = L - p + 1, and ends past r + width are masked (their J is clipped to L)."""
    width = L - p + 1
    R = np.arange(p)[:, None, None]
    I = R + np.arange(width)[None, :, None]
    return R, I, np.minimum(I + 1 + np.arange(longest)[None, None, :], L)


def _longest_stage(pr: PartitionProblem, t: _Tables, below: float) -> int:
    """No stage of more layers than this can lie on a partition whose J is below `below` and that fits: m x (its
    layers' forward + backward) <= J_r, and its layers' states plus one micro-batch of their smallest activations
    (x (1 + fragmentation), plus the buffers) <= its memory. Both sums over a window only grow with its length, so
    the smallest over all windows of a length grows too: binary searches over the length."""
    p, L, m = pr.num_stages, pr.num_layers, pr.num_microbatches
    width = L - p + 1
    work = m * (t.fwd + t.bwd)
    bytes_ = t.state + t.act_min
    room = pr.memory_cap_bytes * (1 + 1e-9) / (1.0 + pr.fragmentation) - pr.fixed_bytes

    def fits(n: int) -> bool:
        if math.isfinite(below) and np.min(work[n:] - work[:-n]) >= below:
            return False
        return bool(np.min(bytes_[n:] - bytes_[:-n]) <= room)

    lo, hi = 1, width  # fits(lo) or nothing fits at all (then any length gives the same empty answer)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _bottleneck_path(pr: PartitionProblem, t: _Tables, cuts, ext: np.ndarray, relaxed: bool,
                     value_only: bool = False, with_value: bool = False, below: float = math.inf,
                     deadline: Deadline | None = None):
    """min over partitions of max_r J_r(i, j) when J_r depends on (r, i, j) only: cuts(R, I, J) gives every stage's
    (c, d, peak) on the grids of _stage_grid; ext the prefix of recompute extras assumed for the other stages'
    layers. The stages' terms are evaluated as arrays over (r, i, j), a block of stages at a time (at most
    BLOCK_MAX_CELLS cells, so a thousand layers stay within memory; the deadline is checked between blocks), and
    the min-max recursion runs over r: W[r][i] = min_j max(J_r(i, j), W[r+1][j]). Stages too long to fit or to
    finish below `below` are left out (_longest_stage): the answer is exact when it is below `below`, else inf
    (None): the optimum is >= below."""
    p, L = pr.num_stages, pr.num_layers
    width = L - p + 1
    R, I, J = _stage_grid(p, L, _longest_stage(pr, t, below))
    per_stage = J.shape[1] * J.shape[2]
    step = max(1, BLOCK_MAX_CELLS // per_stage)
    w = np.full((p + 1, L + 1), np.inf)  # w[r][i]: best max_{s >= r} J_s with stage r starting at layer i
    w[p, L] = 0.0
    rows = {}  # jm of each stage when all fit in one block (else recomputed for the boundaries below)
    for top in range(p, 0, -step):
        check(deadline)
        block = slice(max(0, top - step), top)
        jm = _stage_objectives(pr, t, cuts, ext, relaxed, R[block], I[block], J[block])
        if step >= p:
            rows = dict(enumerate(jm))
        for r in reversed(range(block.start, block.stop)):
            w[r, r:r + width] = np.min(np.maximum(jm[r - block.start], w[r + 1][J[r]]), axis=1)
    best = w[0, 0] if w[0, 0] < below else np.inf  # at or above `below` the restricted grid's answer is not exact
    if value_only:
        return float(best)
    if not np.isfinite(best):
        return None
    bounds, start = [0], 0
    for r in range(p):  # the smallest next boundary that still completes within the optimum
        a = start - r
        jm_row = rows[r][a] if r in rows else _stage_objectives(
            pr, t, cuts, ext, relaxed, R[r:r + 1], I[r:r + 1, a:a + 1], J[r:r + 1, a:a + 1])[0, 0]
        row = np.maximum(jm_row, w[r + 1][J[r, a]])
        end = start + 1 + int(np.flatnonzero(row <= best + TIE_RTOL * abs(best))[0])
        bounds.append(end)
        start = end
    return (float(best), tuple(bounds)) if with_value else tuple(bounds)


def _stage_objectives(pr: PartitionProblem, t: _Tables, cuts, ext: np.ndarray, relaxed: bool, R, I, J) -> np.ndarray:
    """J_r(i, j) on grids of _stage_grid (any block of its stages and first layers), inf where the stage does not
    fit in memory or its end is out of the band (_bottleneck_path)."""
    p, L = pr.num_stages, pr.num_layers
    width = L - p + 1
    c, d, peak = cuts(R, I, J)
    with np.errstate(invalid="ignore"):
        band = _layer_sums(t, I, J, c, d, relaxed)
        f, b = _stage_forward(pr, R, band), _stage_backward(pr, R, band)
        e = _stage_sync(pr, R, band, f, b)
        mem = _stage_memory(pr, R, band, peak)
        # Other stages' layers from prefix tables: F_<r, B_<r over layers [0, i), T_>r over layers [j, L).
        f_before = t.fwd[I] + (_when(R > 0, pr.first_forward) + R * pr.stage_forward_extra)
        b_before = (t.bwd[I] + ext[I]) + (_when(R > 0, pr.first_backward) + R * pr.stage_backward_extra)
        t_after = ((t.fwd[L] - t.fwd[J]) + (t.bwd[L] - t.bwd[J]) + (ext[L] - ext[J])) + (
            (p - 1 - R) * (pr.stage_forward_extra + pr.stage_backward_extra)
            + _when(R < p - 1, pr.last_forward + pr.last_backward))
        jr = _stage_objective(pr, R, f, b, e, f_before, b_before, t_after)
        ends_in_band = (J > I) & (J <= R + width) & (J - I == 1 + np.arange(J.shape[2]))  # clipped ends are out
        return np.where(ends_in_band & (mem <= pr.memory_cap_bytes), jr, np.inf)  # [r][i - r, j - i - 1]


def _cheapest_fitting(pr: PartitionProblem, t: _Tables, R, I, J) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(c, d, peak) on the grids of _stage_grid: for each stage (r, [i, j)) the policy with the least recompute
    extra under which it fits (none, then selective or full on the fewest layers k, the cheaper of the two: a full
    extra only grows with k); (i, i, 0) where none fits.

    With one stage's layers fixed, the others' J_s only grow with its backward (B_<s, T_>s) and so does its own J_r
    (end_r gains m x the growth, its exposed reduce loses at most it): the cheapest fitting policy is the best one."""
    L, cap = pr.num_layers, pr.memory_cap_bytes
    zero = np.zeros(J.shape, dtype=float)
    none_fits = _stage_memory(pr, R, _layer_sums(t, I, J, I, I, False), zero) <= cap
    peak_sel, peak_full = t.peak_sel[I] + zero, t.peak_full[I] + zero
    sel_fits = _stage_memory(pr, R, _layer_sums(t, I, J, I, J, False), peak_sel) <= cap
    full_fits, cut = _first_full_cut(pr, t, R, I, J, peak_full)
    sel_extra = np.where(sel_fits, t.sel[J] - t.sel[I], np.inf)
    full_extra = np.where(full_fits, t.full[cut] - t.full[I], np.inf)
    use_sel = ~none_fits & sel_fits & (sel_extra <= full_extra)
    use_full = ~none_fits & ~use_sel & full_fits
    return (np.where(use_full, cut, I), np.where(use_sel, J, I),
            np.where(use_sel, peak_sel, np.where(use_full, peak_full, 0.0)))


def _first_full_cut(pr: PartitionProblem, t: _Tables, R, I, J, peak_full) -> tuple[np.ndarray, np.ndarray]:
    """(fits, c): whether full recompute on some [i, c), i < c <= j, fits each stage (r, [i, j)) of the grids, and
    the first such c. Small grids try every c at once (one more axis); above FULL_CUT_SCAN_MAX_CELLS that axis would
    take O(p L^3) memory, so where memory only falls as c grows (_Tables.full_shrinks) a binary search per cell
    finds it in O(log L) passes over the grid instead."""
    L, cap = pr.num_layers, pr.memory_cap_bytes
    if J.size * J.shape[2] <= FULL_CUT_SCAN_MAX_CELLS or not t.full_shrinks:
        C = np.minimum(I[..., None] + 1 + np.arange(J.shape[2]), L)
        I4, J4 = I[..., None], J[..., None]
        fits4 = (C <= J4) & (_stage_memory(pr, R[..., None], _layer_sums(t, I4, J4, C, I4, False),
                                           t.peak_full[I4]) <= cap)
        return fits4.any(axis=-1), np.minimum(I + 1 + np.argmax(fits4, axis=-1), L)

    def fits(c):
        return _stage_memory(pr, R, _layer_sums(t, I, J, c, I, False), peak_full) <= cap

    lo, hi = np.minimum(I + 1, J), J  # the first fitting c lies in [lo, hi] where c = j itself fits
    found = (J > I) & fits(hi)
    while True:
        open_ = found & (lo < hi)
        if not open_.any():
            break
        mid = (lo + hi) // 2
        ok = fits(mid)
        hi, lo = np.where(open_ & ok, mid, hi), np.where(open_ & ~ok, mid + 1, lo)
    return found, np.where(found, hi, np.minimum(I + 1, L))


def per_stage_bound(problem: PartitionProblem, below: float = math.inf,
                    deadline: Deadline | None = None) -> tuple[float, PartitionResult | None]:
    """(lower, plan) for per-stage recomputation without CP-SAT. lower: the DP optimum when each stage takes its
    cheapest fitting policy and the other stages' recompute extras are left out of B_<r and T_>r; every J_r only
    grows with any stage's backward, so no per-stage plan beats it (a sound bound, inf when nothing fits). plan:
    that DP's partition re-evaluated with the other stages' extras in (a feasible plan, an upper bound). When the
    two meet, the plan is optimal and CP-SAT is not needed. below: as solve_dp's (inf, None when nothing is below)."""
    found = _cheapest_policies_partition(problem, below, deadline)
    return (math.inf, None) if found is None else found


def _cheapest_policies_partition(problem: PartitionProblem, below: float = math.inf,
                                 deadline: Deadline | None = None) -> tuple[float, PartitionResult] | None:
    """(the DP's optimum, its plan) with each stage on its cheapest fitting policy and the other stages' recompute
    extras left out of B_<r and T_>r; the plan re-evaluated in full. A heuristic plan (a start for CP-SAT) and a
    lower bound (see per_stage_bound); None when nothing fits (or nothing is below `below`)."""
    t = _tables(problem)
    found = _bottleneck_path(problem, t, lambda R, I, J: _cheapest_fitting(problem, t, R, I, J), t.zero,
                             relaxed=False, with_value=True, below=below, deadline=deadline)
    if found is None:
        return None
    lower, bounds = found
    pols = []
    for r, (a, b) in enumerate(zip(bounds, bounds[1:])):  # each stage's policy: the same rule on its row, end b
        ends = np.arange(a + 1, b + 1)[None, None, :]
        c_row, d_row, _ = _cheapest_fitting(problem, t, np.full((1, 1, 1), r), np.full((1, 1, 1), a), ends)
        c, d = int(c_row[0, 0, -1]), int(d_row[0, 0, -1])
        pols.append(StagePolicy(granularity="full", full_layers=c - a) if c > a
                    else StagePolicy(granularity="selective") if d > a else StagePolicy(granularity="none"))
    return lower, _evaluate(problem, t, bounds, tuple(pols), relaxed=False)


# ---- brute force (test oracle) ---------------------------------------------------------------------------------------

def _policy_options(n: int, per_stage: bool, policy: Granularity) -> list[StagePolicy]:
    if per_stage:
        return [StagePolicy(granularity="none"), StagePolicy(granularity="selective")] + [
            StagePolicy(granularity="full", full_layers=k) for k in range(1, n + 1)]
    return [StagePolicy(granularity="full", full_layers=n) if policy == "full" else StagePolicy(granularity=policy)]


def brute_force(problem: PartitionProblem, per_stage: bool = False,
                policy: Granularity = "none") -> PartitionResult | None:
    """Best partition by enumerating every composition of L into p parts and, with per_stage, every stage's policy
    (none, selective, full k = 1..n); without per_stage, `policy` on every stage ("full": all its layers). Small
    instances only (L <= 12). Ties within TIE_RTOL go to the lexicographically smallest boundaries (then policies in
    the order none, selective, full k = 1, 2, ...)."""
    L, p = problem.num_layers, problem.num_stages
    assert L <= 12, "brute force is for small instances"
    if policy not in GRANULARITIES:
        raise ValueError(f"policy must be one of {GRANULARITIES}, got {policy!r}")
    t = _tables(problem)
    found = []
    for cuts in itertools.combinations(range(1, L), p - 1):
        bounds = (0, *cuts, L)
        options = [_policy_options(bounds[r + 1] - bounds[r], per_stage, policy) for r in range(p)]
        for pols in itertools.product(*options):
            res = _evaluate(problem, t, bounds, pols, relaxed=False)
            if res is not None:
                found.append(res)
    if not found:
        return None
    best = min(res.objective for res in found)
    return next(res for res in found if res.objective <= best + TIE_RTOL * abs(best))


# ---- CP-SAT ----------------------------------------------------------------------------------------------------------

def cpsat_tolerance_s(problem: PartitionProblem) -> float:
    """How far solve_cpsat's J (re-evaluated in float) may exceed the float optimum through integer nanoseconds.

    Every table entry and constant is off by <= 0.5 ns. f_r holds 3 rounded terms (<= 1.5 ns), b_r 7 (<= 3.5 ns),
    E_r <= 13 ns (its exposures take b_r and f_r along), the hop 0.5 ns per use. Summing with J_r's coefficients:
    start + m t_r <= 2r + 5m, the first-backward path <= 6p + 5m, the tail max(B_<r + r h, E_r) <= 4p + 13, so
    |J_int - J| <= 5m + 10p + 15 ns for every plan, and the integer optimum re-evaluated is within twice that of the
    float optimum (plus float rounding, ~1e-15 relative). Memory is exact or conservative instead: see solve_cpsat."""
    return 2.0 * (5 * problem.num_microbatches + 10 * problem.num_stages + 15) / NS_PER_S


def _ns(seconds: float) -> int:
    return int(round(seconds * NS_PER_S))


def _largest_fitting_sum(cap: float, scale: float) -> int:
    """The largest integer S with fl(S x scale) <= cap: evaluate()'s test for an integer sum of parts, exactly."""
    s = math.floor(cap / scale)
    if s >= 2**52:  # integers this large are not all floats; the quotient is as close as it gets
        return s
    while float(s + 1) * scale <= cap:
        s += 1
    while s >= 0 and float(s) * scale > cap:
        s -= 1
    return s


@dataclass(frozen=True)
class _CpData:
    """Integer tables for CP-SAT: prefix times in rounded ns; bytes rounded up per layer, then summed exactly."""

    fwd: list[int]
    bwd: list[int]
    sel: list[int]
    full: list[int]
    reduce: list[int]  # beta_d x dense + beta_e x expert parameters, ns
    gather: list[int]
    optimizer: list[int]
    count_dense: list[int]  # layers with dense parameters
    count_expert: list[int]
    state: list[int]
    act_none: list[int]
    act_sel: list[int]
    act_full: list[int]
    peak_sel: list[int]
    peak_full: list[int]
    cap: int  # a stage's sum of parts (before fragmentation) must not exceed this
    max_memory: int  # no stage's sum of parts can exceed this

    @classmethod
    def build(cls, pr: PartitionProblem) -> "_CpData":
        t, s = _tables(pr), pr.sync

        def ns(prefix) -> list[int]:
            return [_ns(x) for x in prefix]

        def up(values) -> list[int]:
            return [0] + list(itertools.accumulate(math.ceil(v) for v in values))

        def count(values) -> list[int]:
            return [0] + list(itertools.accumulate(int(v > 0) for v in values))

        an, asel, af = (np.asarray(v) for v in (pr.layer_act_none, pr.layer_act_selective, pr.layer_act_full))
        cap = _largest_fitting_sum(pr.memory_cap_bytes, 1.0 + pr.fragmentation)
        data = cls(
            fwd=ns(t.fwd), bwd=ns(t.bwd), sel=ns(t.sel), full=ns(t.full),
            reduce=ns(s.reduce_beta_dense * t.dense + s.reduce_beta_expert * t.expert),
            gather=ns(s.gather_beta_dense * t.dense + s.gather_beta_expert * t.expert),
            optimizer=ns(s.optimizer_s_per_dense_param * t.dense + s.optimizer_s_per_expert_param * t.expert),
            count_dense=count(pr.layer_params_dense), count_expert=count(pr.layer_params_expert),
            state=up(pr.layer_state_bytes), act_none=up(an), act_sel=up(asel), act_full=up(af),
            peak_sel=[math.ceil(x) for x in an - asel] + [0], peak_full=[math.ceil(x) for x in an - af] + [0],
            cap=cap, max_memory=0,
        )
        biggest = (data.state[-1] + sum(math.ceil(x) for x in (pr.first_state_bytes, pr.last_state_bytes,
                                                                pr.last_fixed_bytes, pr.fixed_bytes))
                   + max(pr.held_microbatches(r) for r in range(pr.num_stages))
                   * (max(data.act_none[-1], data.act_sel[-1], data.act_full[-1]) + math.ceil(pr.first_act_bytes))
                   + max(0, *data.peak_sel, *data.peak_full))
        if cap < biggest and biggest >= 2**62:
            raise ValueError("bytes too large for CP-SAT's 64-bit integers")
        return replace(data, max_memory=biggest)


class _Reader:
    """table[index] as a CP-SAT value: the entry itself for a fixed index, else one AddElement per (table, index)."""

    def __init__(self, model: cp_model.CpModel):
        self.model = model
        self.cache: dict[tuple[int, int], cp_model.IntVar] = {}

    def __call__(self, table: list[int], index):
        if isinstance(index, int):
            return table[index]
        key = (id(table), index.index)
        if key not in self.cache:
            target = self.model.new_int_var(min(table), max(table), f"elem_{len(self.cache)}")
            self.model.add_element(index, table, target)
            self.cache[key] = target
        return self.cache[key]


@dataclass(frozen=True)
class _CpStage:
    """One stage in the CP-SAT model: f_r, b_r, E_r in integer ns and the policy choice."""

    forward: cp_model.LinearExprT
    backward: cp_model.LinearExprT
    sync: cp_model.LinearExprT
    selective: object  # BoolVar or bool
    full: object
    k: object  # IntVar or int: layers recomputed in full


def _cp_boundaries(model: cp_model.CpModel, pr: PartitionProblem) -> list:
    """b_0 = 0, b_p = L, b_{r+1} >= b_r + 1 (every stage non-empty)."""
    p, L = pr.num_stages, pr.num_layers
    bounds: list = [0] + [model.new_int_var(r, L - (p - r), f"b_{r}") for r in range(1, p)] + [L]
    for r in range(p):
        if not (isinstance(bounds[r], int) and isinstance(bounds[r + 1], int)):
            model.add(bounds[r + 1] >= bounds[r] + 1)
    return bounds


def _cp_policy(model: cp_model.CpModel, pr: PartitionProblem, policies: str, r: int, i, j):
    """(selective, full, k, c, d): stage r's choice; [i, c) recomputes in full, [i, d) selectively."""
    if policies == "uniform-none":
        return False, False, 0, i, i
    if policies == "uniform-selective":
        return True, False, 0, i, j
    if policies == "uniform-full":
        return False, True, j - i, j, i
    none, sel, full = (model.new_bool_var(f"{g}_{r}") for g in GRANULARITIES)
    model.add_exactly_one(none, sel, full)
    k = model.new_int_var(0, pr.num_layers - pr.num_stages + 1, f"k_{r}")
    model.add(k >= 1).only_enforce_if(full)
    model.add(k <= j - i)
    model.add(k == 0).only_enforce_if(~full)
    c = model.new_int_var(0, pr.num_layers, f"c_{r}")
    model.add(c == i + k)
    d = model.new_int_var(0, pr.num_layers, f"d_{r}")
    model.add(d == j).only_enforce_if(sel)
    model.add(d == i).only_enforce_if(~sel)
    return sel, full, k, c, d


def _cp_index(model: cp_model.CpModel, expr, name: str, hi: int):
    """An element index must be a variable or a constant."""
    if isinstance(expr, (int, cp_model.IntVar)):
        return expr
    var = model.new_int_var(0, hi, name)
    model.add(var == expr)
    return var


def _cp_positive(model: cp_model.CpModel, count, const: bool, name: str):
    """[P > 0] for a stage: its fixed blocks carry parameters, or it holds a layer that does."""
    if const:
        return 1
    if isinstance(count, int):
        return int(count > 0)
    pos = model.new_bool_var(name)
    model.add(count >= 1).only_enforce_if(pos)
    model.add(count == 0).only_enforce_if(~pos)
    return pos


def _cp_stage(model: cp_model.CpModel, pr: PartitionProblem, data: _CpData, read: _Reader, policies: str,
              r: int, i, j, ub: int) -> _CpStage:
    """Stage r on layers [i, j): f_r, b_r, E_r as linear expressions and its memory constraint."""
    p, s, L = pr.num_stages, pr.sync, pr.num_layers
    sel, full, k, c, d = _cp_policy(model, pr, policies, r, i, j)
    c = _cp_index(model, c, f"c_{r}", L)
    forward = read(data.fwd, j) - read(data.fwd, i) + _ns(_forward_const(pr, r))
    extra = (read(data.sel, d) - read(data.sel, i)) + (read(data.full, c) - read(data.full, i))
    backward = read(data.bwd, j) - read(data.bwd, i) + extra + _ns(_backward_const(pr, r))

    # Memory: held micro-batches x activations, recompute peak of the first layer, state, buffers.
    u = d if c is i else c if d is i else _cp_index(model, c + d - i, f"u_{r}", L)  # end of the recomputed part
    act = ((read(data.act_full, c) - read(data.act_full, i)) + (read(data.act_sel, d) - read(data.act_sel, i))
           + (read(data.act_none, j) - read(data.act_none, u)) + (math.ceil(pr.first_act_bytes) if r == 0 else 0))
    if isinstance(sel, bool) and isinstance(full, bool):
        peak = read(data.peak_sel, i) if sel else read(data.peak_full, i) if full else 0
    else:
        ps, pf = read(data.peak_sel, i), read(data.peak_full, i)
        peak = model.new_int_var(min(0, *data.peak_sel, *data.peak_full), max(0, *data.peak_sel, *data.peak_full),
                                 f"peak_{r}")
        model.add(peak == ps).only_enforce_if(sel)
        model.add(peak == pf).only_enforce_if(full)
        model.add(peak == 0).only_enforce_if(~sel, ~full)
    state = read(data.state, j) - read(data.state, i) + (math.ceil(pr.first_state_bytes) if r == 0 else 0) + (
        math.ceil(pr.last_state_bytes) + math.ceil(pr.last_fixed_bytes) if r == p - 1 else 0)
    total = state + pr.held_microbatches(r) * act + peak + math.ceil(pr.fixed_bytes)
    if data.cap < data.max_memory:  # else every stage fits whatever it holds
        model.add(total <= data.cap)

    # Sync: alpha only when the stage has parameters of that kind (alpha-beta model), beta x P from the tables.
    first_d = pr.first_params_dense if r == 0 else 0.0
    last_d = pr.last_params_dense if r == p - 1 else 0.0
    pos_d = _cp_positive(model, read(data.count_dense, j) - read(data.count_dense, i), first_d + last_d > 0,
                         f"dense_{r}")
    pos_e = _cp_positive(model, read(data.count_expert, j) - read(data.count_expert, i), False, f"expert_{r}")

    def collective(table: list[int], alpha_d: float, beta_d: float, alpha_e: float):
        return (_ns(alpha_d) * pos_d + _ns(alpha_e) * pos_e + read(table, j) - read(table, i)
                + _ns(beta_d * first_d) + _ns(beta_d * last_d))

    reduce = collective(data.reduce, s.reduce_alpha_dense, s.reduce_beta_dense, s.reduce_alpha_expert)
    gather = collective(data.gather, s.gather_alpha_dense, s.gather_beta_dense, s.gather_alpha_expert)
    if s.overlap_reduce:
        exposed = model.new_int_var(0, ub, f"reduce_exposed_{r}")
        model.add(exposed >= reduce - backward)
        reduce = exposed
    if s.overlap_gather:
        exposed = model.new_int_var(0, ub, f"gather_exposed_{r}")
        model.add(exposed >= gather - forward)
        gather = exposed
    optimizer = (read(data.optimizer, j) - read(data.optimizer, i) + _ns(s.optimizer_s_per_dense_param * first_d)
                 + _ns(s.optimizer_s_per_dense_param * last_d))
    return _CpStage(forward, backward, reduce + gather + optimizer, sel, full, k)


@dataclass(frozen=True)
class _NsView:
    """The fields _end_pieces reads, with the hop in integer nanoseconds (CP-SAT's unit)."""

    num_stages: int
    num_microbatches: int
    schedule: str
    hop_s: int

    def __init__(self, pr: PartitionProblem):
        for name, value in (("num_stages", pr.num_stages), ("num_microbatches", pr.num_microbatches),
                            ("schedule", pr.schedule), ("hop_s", _ns(pr.hop_s))):
            object.__setattr__(self, name, value)


def _cp_objective(model: cp_model.CpModel, pr: PartitionProblem, stages: list[_CpStage], ub: int):
    """J = max_r J_r (AddMaxEquality), J_r as in _stage_objective over integer nanoseconds.

    J_r = max(_end_pieces) + max(B_<r + r h, E_r) is bounded below by every (piece, tail) sum (the exposures in E_r
    likewise by 0 and reduce - b_r): minimising J drives every one of them down to the max, so the optimum is the
    same, and the LP relaxation stays tight (AddMaxEquality for these inner maxima took the 16-stage uniform solve
    from 0.06 s to over 10 s)."""
    h = _ns(pr.hop_s)
    stage_obj = []
    for r, st in enumerate(stages):
        f_before = sum(x.forward for x in stages[:r])
        b_before = sum(x.backward for x in stages[:r])
        t_after = sum(x.forward + x.backward for x in stages[r + 1:])
        start = f_before + r * h
        jr = model.new_int_var(0, ub, f"J_{r}")
        tails = [st.sync] if pr.schedule == "zb" else [b_before + r * h, st.sync]
        pieces = _end_pieces(_NsView(pr), r, st.forward, st.backward, start, t_after)
        for a in pieces:
            for b in tails:
                model.add(jr >= a + b)
        stage_obj.append(jr)
    obj = model.new_int_var(0, ub, "J")
    model.add_max_equality(obj, stage_obj)
    return obj


def _cp_upper_bound(pr: PartitionProblem, data: _CpData) -> int:
    """A domain bound for every time variable: J <= (2m + 4) x (all passes + hops + all sync)."""
    s = pr.sync
    passes = (data.fwd[-1] + data.bwd[-1] + max(data.sel[-1], data.full[-1])
              + _ns(pr.first_forward + pr.first_backward + pr.last_forward + pr.last_backward)
              + pr.num_stages * (_ns(pr.stage_forward_extra) + _ns(pr.stage_backward_extra) + 2 * _ns(pr.hop_s)))
    alphas = sum(_ns(a) for a in (s.reduce_alpha_dense, s.reduce_alpha_expert, s.gather_alpha_dense,
                                  s.gather_alpha_expert))
    params = pr.first_params_dense + pr.last_params_dense
    sync = (data.reduce[-1] + data.gather[-1] + data.optimizer[-1] + pr.num_stages * alphas
            + 2 * _ns((s.reduce_beta_dense + s.gather_beta_dense + s.optimizer_s_per_dense_param) * params))
    ub = (2 * pr.num_microbatches + 4) * (passes + sync + 1) + 1000
    if ub >= 2**62:
        raise ValueError("times too large for CP-SAT's 64-bit integers at nanosecond resolution")
    return ub


def _cp_solve(problem: PartitionProblem, policies: str, data: _CpData, time_limit_s: float,
              hint: PartitionResult | None, below_s: float | None = None):
    """One CP-SAT solve against data.cap; returns (boundaries, policies) or None, and the status."""
    p = problem.num_stages
    ub = _cp_upper_bound(problem, data)
    # Creates the model.
    model = cp_model.CpModel()
    read = _Reader(model)
    # Creates the variables: stage boundaries.
    bounds = _cp_boundaries(model, problem)
    # Creates the per-stage policy variables, times and memory constraints.
    stages = [_cp_stage(model, problem, data, read, policies, r, bounds[r], bounds[r + 1], ub) for r in range(p)]
    # Creates the objective.
    obj = _cp_objective(model, problem, stages, ub)
    if below_s is not None:  # a search's cutoff: only better solutions are wanted (rounding slack kept sound)
        model.add(obj <= math.ceil((below_s + cpsat_tolerance_s(problem)) * NS_PER_S))
    model.minimize(obj)
    if hint is not None:
        # A start, not a constraint: the solver still proves the optimum on its own.
        for var, value in zip(bounds[1:-1], hint.boundaries[1:-1]):
            model.add_hint(var, value)
        for st, q in zip(stages, hint.policies if policies == "per-stage" else ()):
            model.add_hint(st.selective, q.granularity == "selective")
            model.add_hint(st.full, q.granularity == "full")
            model.add_hint(st.k, q.full_layers)
    # Creates a solver and solves the model.
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    # OR-Tools 9.15's presolve proved a suboptimal J "OPTIMAL" on a partition whose only cost was one stage's
    # expert-gradient reduce (280 ns returned, 140 ns feasible; tests/test_partition.py found it). Probing off, or
    # inclusion detection off, or presolve off solve it to 140 ns; probing off is the cheapest (405B-like per-stage
    # solve: 2.1 s default, 2.4 s without probing, 8.2 s without inclusion detection).
    solver.parameters.cp_model_probing_level = 0
    solver.parameters.max_time_in_seconds = time_limit_s
    code = solver.solve(model)
    if code == cp_model.MODEL_INVALID:
        raise RuntimeError(f"invalid CP-SAT model: {model.validate()}")
    status = {cp_model.OPTIMAL: "OPTIMAL", cp_model.FEASIBLE: "FEASIBLE",
              cp_model.INFEASIBLE: "INFEASIBLE"}.get(code, "UNKNOWN")
    if status not in ("OPTIMAL", "FEASIBLE"):
        return None, status
    # Reads the solution back.
    found = tuple(b if isinstance(b, int) else solver.value(b) for b in bounds)
    pols = []
    for st, a, b in zip(stages, found, found[1:]):
        if st.full is True or (not isinstance(st.full, bool) and solver.boolean_value(st.full)):
            k = b - a if policies == "uniform-full" else solver.value(st.k)
            pols.append(StagePolicy(granularity="full", full_layers=int(k)))
        elif st.selective is True or (not isinstance(st.selective, bool) and solver.boolean_value(st.selective)):
            pols.append(StagePolicy(granularity="selective"))
        else:
            pols.append(StagePolicy(granularity="none"))
    return (found, tuple(pols)), status


def solve_cpsat(problem: PartitionProblem, policies: CpPolicies = "per-stage",
                time_limit_s: float = 10.0, below_s: float | None = None) -> tuple[PartitionResult | None, str]:
    """The partition problem as a CP-SAT model; returns (evaluate() of its solution, status).

    policies: "uniform-none" / "-selective" / "-full" (every stage, "full" = all its layers, as solve_dp) or
    "per-stage" (each stage picks none, selective or full on its first k_r layers, 1 <= k_r <= n_r).
    Status: "OPTIMAL", "FEASIBLE" (time limit hit with a solution), "INFEASIBLE", "UNKNOWN".
    below_s: only solutions with J below it (within the rounding tolerance) are sought, so "INFEASIBLE" then means
    "none fits, or none beats below_s" (a search passes its cutoff; the proof of no better plan comes faster).

    The model (named steps as in the OR-Tools samples): boundary variables b_0 = 0 < b_1 < ... < b_p = L; prefix-sum
    tables read with AddElement at b_r, at b_r + k_r (end of the full-recompute part) and at the end of the selective
    part; f_r, b_r, E_r and memory as linear expressions, so the other stages' policies enter F_<r, B_<r and T_>r;
    J = max_r J_r minimised. One worker and a fixed seed keep it deterministic (up to the time limit). The search
    starts from a hint (solve_dp's plan; for "per-stage" the best of the uniform DPs and a cheapest-fitting-policy
    heuristic), which constrains nothing: CP-SAT still proves the optimum itself, so it stays a check on the DP.

    Tolerance. Times are integer nanoseconds, so the returned J (always re-evaluated in float) may exceed the float
    optimum by at most cpsat_tolerance_s(problem), about 1 us at p = 16, m = 64. Bytes are rounded up per layer and
    the cap is the largest integer sum S with fl(S x (1 + fragmentation)) <= cap: with integer byte counts (sums below
    2^53) the memory constraint is exactly evaluate()'s; with fractional bytes it is conservative by under one byte
    per layer value. Should float rounding still reject a solution, the model is solved again one byte tighter.
    """
    if policies not in CP_POLICIES:
        raise ValueError(f"policies must be one of {CP_POLICIES}, got {policies!r}")
    # Creates the data.
    data = _CpData.build(problem)
    if policies == "per-stage":  # start from the best of the uniform DPs and the cheapest-policy heuristic
        starts = [solve_dp(problem, g) for g in GRANULARITIES] + [per_stage_bound(problem)[1]]
    else:
        starts = [solve_dp(problem, policies.removeprefix("uniform-"))]
    hint = min((x for x in starts if x is not None), key=lambda x: x.objective, default=None)
    for _ in range(3):
        solution, status = _cp_solve(problem, policies, data, time_limit_s, hint, below_s)
        if solution is None:
            return None, status
        # Evaluates the solution in float: the one currency DP, brute force and CP-SAT results share.
        result = evaluate(problem, *solution)
        if result is not None:
            return result, status
        data = replace(data, cap=data.cap - 1 - data.cap // 10**12)
    raise RuntimeError("CP-SAT solutions keep exceeding the memory cap in float evaluation")


@dataclass(frozen=True)
class _StageGrid:
    """Stage r's terms on the (first layer i, end j) grid under one uniform policy (what the O(p L^3) bounds read)."""

    f: np.ndarray
    b: np.ndarray
    e: np.ndarray
    f_before: np.ndarray
    b_before: np.ndarray
    t_after: np.ndarray
    fits: np.ndarray  # non-empty and within the memory cap

    def objective(self, pr: PartitionProblem, r: int, sync: bool = True) -> np.ndarray:
        """J_r where the stage fits, else inf; sync=False gives A_r = end_r + B_<r + r h (1F1B, GPipe)."""
        jr = _stage_objective(pr, r, self.f, self.b, self.e if sync else 0.0, self.f_before, self.b_before,
                              self.t_after)
        return np.where(self.fits, jr, np.inf)


def _uniform_grids(pr: PartitionProblem, policy: Granularity, cheapest: bool = False) -> list[_StageGrid]:
    """Every stage's grid with `policy` on every stage (the other stages' extras enter through the prefix tables).
    cheapest: each stage (r, [i, j)) on its cheapest fitting policy instead (_cheapest_fitting) and the other
    stages' extras left out, as per_stage_bound does: a bound over every per-stage policy mix (`policy` "none")."""
    if policy not in GRANULARITIES:
        raise ValueError(f"policy must be one of {GRANULARITIES}, got {policy!r}")
    if cheapest and policy != "none":
        raise ValueError("cheapest-fitting grids take policy 'none'")
    p, L = pr.num_stages, pr.num_layers
    t = _tables(pr)
    i, j = _grid(L)
    at, ext = _uniform_cuts(t, policy, i, j)
    ahead = j > i
    layers_before_f, layers_before_b = t.fwd[i], t.bwd[i] + ext[i]
    layers_after = (t.fwd[L] - t.fwd[j]) + (t.bwd[L] - t.bwd[j]) + (ext[L] - ext[j])
    grids = []
    with np.errstate(invalid="ignore"):
        for r in range(p):
            if cheapest:  # on the (1, L+1, L+1) grid of one rank; j <= i is masked by `ahead`
                c, d, peak = _cheapest_fitting(pr, t, np.full((1, 1, 1), r), i[None], np.maximum(j, i)[None])
                at = (c[0], d[0], peak[0])
            s = _layer_sums(t, i, j, at[0], at[1], False)
            f, b = _stage_forward(pr, r, s), _stage_backward(pr, r, s)
            grids.append(_StageGrid(
                f=f, b=b, e=_stage_sync(pr, r, s, f, b, layers=j - i),
                f_before=layers_before_f + ((pr.first_forward if r > 0 else 0.0) + r * pr.stage_forward_extra),
                b_before=layers_before_b + ((pr.first_backward if r > 0 else 0.0) + r * pr.stage_backward_extra),
                t_after=layers_after + ((p - 1 - r) * (pr.stage_forward_extra + pr.stage_backward_extra)
                                        + (pr.last_forward + pr.last_backward if r < p - 1 else 0.0)),
                fits=ahead & (_stage_memory(pr, r, s, at[2]) <= pr.memory_cap_bytes)))
    return grids


# ---- rank 0's path to every rank's sync (1F1B) -------------------------------------------------------------------------
#
# J_r adds rank r's sync E_r to a path through rank r's own passes. Rank 0's paths are the longest (its warm-up
# starts the step): the one through micro-batch m-1's round trip passes every later rank's last pass B_{m-1}(r), r
# steps of (b_s + h) before its own end, so rank r's sync cannot start before that point:
#   step >= X_0 + E_r - B_<r - r h,   X_0 = the longest rank-0 path through m-1's round trip (_end_through_last).
# With stage 0's end j0 fixed X_0 is a number, and the term is stage r's own (r, i, j): one DP per j0, side by side.

def _end_through_last(pr, r: int, f, b, start, t_after):
    """The longest of _end_pieces that runs micro-batch m-1's round trip (it reaches every later rank's last pass)."""
    base = start + pr.num_microbatches * (f + b)
    first, last, middle, k_both, _ = _round_trips(pr, r, f, b, t_after)
    if middle is None:
        return base + last
    return base + last + np.maximum(first, 0.0) + k_both * np.maximum(middle, 0.0)


def rank0_path_sync_bound(problem: PartitionProblem, policy: Granularity) -> float:
    """min over contiguous partitions (one uniform policy) of max(J, max_r X_0 + E_r - B_<r - r h) (see above):
    a lower bound on the simulated 1F1B step; other schedules: solve_dp's value. inf when nothing fits."""
    if problem.schedule != "1f1b" or problem.num_stages == 1:
        return dp_bound(problem, policy)
    found = _rank0_path_sync_dp(problem, policy)
    return math.inf if found is None else found[0]


def solve_rank0_path_sync(problem: PartitionProblem, policy: Granularity) -> PartitionResult | None:
    """The partition attaining rank0_path_sync_bound, evaluated, its objective replaced by the bound (a plan to
    simulate where the DP's own partition left a gap); solve_dp for other schedules and a single stage."""
    if problem.schedule != "1f1b" or problem.num_stages == 1:
        return solve_dp(problem, policy)
    return _bound_plan(problem, policy, _rank0_path_sync_dp(problem, policy))


def _bound_plan(problem: PartitionProblem, policy: Granularity,
                found: tuple[float, tuple[int, ...]] | None) -> PartitionResult | None:
    """A bound DP's (value, boundaries) as a plan: the partition evaluated, its objective the larger of J and the
    bound."""
    if found is None:
        return None
    best, bounds = found
    pols = tuple(StagePolicy(granularity="full", full_layers=bounds[r + 1] - bounds[r]) if policy == "full"
                 else StagePolicy(granularity=policy) for r in range(problem.num_stages))
    result = _evaluate(problem, _tables(problem), bounds, pols, relaxed=False)
    assert result is not None, "a bound DP and evaluate disagree on feasibility"
    return replace(result, objective=max(result.objective, best))


def _rank0_path_sync_dp(pr: PartitionProblem, policy: Granularity,
                        cheapest: bool = False) -> tuple[float, tuple[int, ...]] | None:
    """(the bound, a partition attaining it), or None when nothing fits (cheapest: see _uniform_grids)."""
    p, L = pr.num_stages, pr.num_layers
    grids = _uniform_grids(pr, policy, cheapest)
    full = (L + 1, L + 1)
    with np.errstate(invalid="ignore"):
        jm = [g.objective(pr, r) for r, g in enumerate(grids)]
        g0 = grids[0]
        x0 = np.broadcast_to(_end_through_last(pr, 0, g0.f, g0.b, g0.f_before, g0.t_after), full)[0]  # by j0
        x0 = np.where(np.isfinite(jm[0][0]), x0, 0.0)
        tails = {r: np.broadcast_to(g.e - (g.b_before + r * pr.hop_s), full) for r, g in enumerate(grids)}
        return _by_end_of_stage0(p, L, jm[0][0], lambda r: np.maximum(jm[r][None, :, :],
                                                                      x0[:, None, None] + tails[r][None, :, :]))


def _by_end_of_stage0(p: int, L: int, first: np.ndarray, term) -> tuple[float, tuple[int, ...]] | None:
    """min over partitions of max(first[j0], max_r term(r)[j0, i, j]) when stage r >= 1's term depends on where stage 0
    ends (j0) and on its own (i, j): one bottleneck DP per j0, side by side (w[j0, i]). (bound, boundaries) or None."""
    w = np.full((L + 1, L + 1), np.inf)  # w[j0, i]: best max over stages >= r, stage r starting at i
    w[:, L] = 0.0
    nxt = {}
    with np.errstate(invalid="ignore"):
        for r in reversed(range(1, p)):
            total_r = np.maximum(term(r), w[:, None, :])
            nxt[r] = np.argmin(total_r, axis=2)  # stage r's end, by (end of stage 0, start of stage r)
            w = np.min(total_r, axis=2)
        ends = np.arange(L + 1)
        total = np.maximum(first, w[ends, ends])
    best = float(np.min(total))
    if not math.isfinite(best):
        return None
    end0 = int(np.argmin(total))
    bounds, start = [0, end0], end0
    for r in range(1, p):
        start = int(nxt[r][end0, start])
        bounds.append(start)
    return best, tuple(bounds)


def partitions_below(problem: PartitionProblem, policy: Granularity, threshold: float,
                     limit: int = 64) -> list[tuple[float, tuple[int, ...]]] | None:
    """Every contiguous partition (one uniform policy) whose lower bound, J and under 1F1B also rank 0's path to each
    rank's sync (see _rank0_path_sync_dp), is below `threshold`: (that bound, boundaries), smallest first. None when
    more than `limit` partitions have J below it (the caller's bound then stays open). Depth-first over the stages,
    each branch cut by the exact min-max J of the stages after it (solve_dp's table), so it visits only prefixes of
    partitions it returns. A search that simulates these has looked at every partition that could beat
    `threshold`."""
    p, L = problem.num_stages, problem.num_layers
    grids = _uniform_grids(problem, policy)
    full = (L + 1, L + 1)
    with np.errstate(invalid="ignore"):
        jm = [np.broadcast_to(g.objective(problem, r), full) for r, g in enumerate(grids)]
        if problem.schedule == "1f1b" and p > 1:
            g0 = grids[0]
            x0 = np.broadcast_to(_end_through_last(problem, 0, g0.f, g0.b, g0.f_before, g0.t_after), full)[0]
            tails = [np.broadcast_to(g.e - (g.b_before + r * problem.hop_s), full) for r, g in enumerate(grids)]

    def finish(b: tuple[int, ...], worst: float) -> tuple[float, tuple[int, ...]] | None:
        if problem.schedule == "1f1b" and p > 1:  # rank 0's path to every later rank's sync
            worst = max(worst, float(x0[b[1]]) + max(float(tails[s][b[s], b[s + 1]]) for s in range(1, p)))
        return (worst, b) if worst < threshold else None

    found = _walk_below(jm, p, L, threshold, limit, finish)
    return None if found is None else sorted(found)


def _walk_below(jm: list[np.ndarray], p: int, L: int, threshold: float, limit: int, finish) -> list | None:
    """Depth-first over the stage boundaries of every partition whose max of jm[r][i, j] is below `threshold`,
    each branch cut by the least max over the stages after it (after[r][i], stage r from i); finish(boundaries,
    that max) gives each one's entry, or None to leave it out. None when more than `limit` are reached."""
    with np.errstate(invalid="ignore"):
        after = np.full((p + 1, L + 1), np.inf)
        after[p, L] = 0.0
        for r in reversed(range(p)):
            after[r] = np.min(np.maximum(jm[r], after[r + 1][None, :]), axis=1)
    found: list = []

    def extend(r: int, i: int, worst: float, bounds: list[int]) -> bool:
        if r == p:
            if len(found) == limit:
                return False
            entry = finish(tuple(bounds), worst)
            if entry is not None:
                found.append(entry)
            return True
        for j in range(i + 1, L - (p - 1 - r) + 1):
            here = max(worst, float(jm[r][i, j]))
            if max(here, float(after[r + 1][j])) < threshold and not extend(r + 1, j, here, bounds + [j]):
                return False
        return True

    return found if extend(0, 0, 0.0, [0]) else None


PER_STAGE_ENUMERATION_MAX_PARTITIONS = 512  # partitions per_stage_partitions_below walks before it gives up


def _cheapest_partitions_below(problem: PartitionProblem, threshold: float,
                               limit: int) -> list[tuple[int, ...]] | None:
    """The boundaries of every partition whose J with each stage on its cheapest fitting policy (the other stages'
    extras left out: a lower bound on J under any policy mix, per_stage_bound's argument) is below `threshold`;
    None when more than `limit` (a depth-first walk, as partitions_below's)."""
    p, L = problem.num_stages, problem.num_layers
    full = (L + 1, L + 1)
    with np.errstate(invalid="ignore"):
        jm = [np.broadcast_to(g.objective(problem, r), full)
              for r, g in enumerate(_uniform_grids(problem, "none", cheapest=True))]
    return _walk_below(jm, p, L, threshold, limit, lambda bounds, worst: bounds)


def per_stage_partitions_below(problem: PartitionProblem, threshold: float, limit: int = 64
                               ) -> list[tuple[float, tuple[int, ...], tuple[StagePolicy, ...]]] | None:
    """Every (partition, per-stage policy) whose J is below `threshold`: (J, boundaries, policies), smallest first;
    None when more than `limit` pairs are below it (the caller's bound then stays open); the partitions walked are those whose cheapest-fitting-policy J
    is below it (_cheapest_partitions_below), at most PER_STAGE_ENUMERATION_MAX_PARTITIONS. Per stage the policies are none, selective and full on its first
    k layers; J never decreases when any stage's backward grows (solve_dp's relaxation argument), so each stage's
    fitting policies are tried by growing backward and a branch stops at the first that reaches the threshold with
    the cheapest policies on the stages after it. Brute force over partitions because the DP has no per-stage
    equivalent of partitions_below's table; it closes the gaps of small pipelines, where per-stage plans win."""
    p, L = problem.num_stages, problem.num_layers
    partitions = _cheapest_partitions_below(problem, threshold, PER_STAGE_ENUMERATION_MAX_PARTITIONS)
    if partitions is None:
        return None
    t = _tables(problem)
    found: list[tuple[float, tuple[int, ...], tuple[StagePolicy, ...]]] = []
    for bounds in partitions:
        options = []  # per stage: (f, b, e, policy) of each fitting policy, by growing backward
        for r in range(p):
            i, j = bounds[r], bounds[r + 1]
            row = []
            for pol in _policy_options(j - i, True, "none"):
                c, d, peak = _cuts(t, pol, i, j)
                sums = _layer_sums(t, i, j, c, d, False)
                if not float(_stage_memory(problem, r, sums, peak)) <= problem.memory_cap_bytes:
                    continue
                f, b = float(_stage_forward(problem, r, sums)), float(_stage_backward(problem, r, sums))
                row.append((f, b, float(_stage_sync(problem, r, sums, f, b, layers=float(j - i))), pol))
            if not row:
                break
            options.append(sorted(row, key=lambda x: x[1]))
        if len(options) < p:
            continue

        def objective(chosen: list[tuple[float, float, float, StagePolicy]]) -> float:
            f = [x[0] for x in chosen]
            b = [x[1] for x in chosen]
            return max(float(_stage_objective(problem, r, f[r], b[r], chosen[r][2], sum(f[:r]), sum(b[:r]),
                                              sum(f[s] + b[s] for s in range(r + 1, p)))) for r in range(p))

        def extend(chosen: list) -> bool:
            r = len(chosen)
            if r == p:
                j = objective(chosen)
                if j < threshold:
                    if len(found) == limit:
                        return False
                    found.append((j, bounds, tuple(x[3] for x in chosen)))
                return True
            for option in options[r]:
                if objective(chosen + [option] + [o[0] for o in options[r + 1:]]) >= threshold:
                    break  # a larger backward here (or after) only raises J
                if not extend(chosen + [option]):
                    return False
            return True

        if not extend([]):
            return None
    return sorted(found, key=lambda x: (x[0], x[1]))


# ---- the 1F1B steady-state pair bound --------------------------------------------------------------------------------
#
# J_r above sees each rank alone. In 1F1B's steady state two neighbours also chain each other: on rank r the pair
# (F_{w+i}, B_i) runs in that order (w = p - r - 1 warm-up forwards) and on rank r+1 (F_{w-1+i}, B_i), so
#   F_{w+i}(r) -> [hop] -> F_{w+i}(r+1) -> B_{i+1}(r+1) -> [hop] -> B_{i+1}(r) -> F_{w+i+2}(r)
# is a dependency chain: every two steady forwards of rank r take at least C_r = t_r + t_{r+1} + 2h. With
# S0 = F_<r + r h + w f_r (the start of rank r's first steady forward) and K = floor((m - 1 - w) / 2):
#   end_r >= S0 + K C_r + f_r + (m - 2K) b_r + (m - 1 - w - 2K) f_r,
# and P_r = that + max(B_<r + r h, E_r) as in J_r. It matters when P2P latency is not small against a stage's
# pass (each micro-batch pays about h twice on every link), where J alone leaves a gap.
#
# The same loops also fit between micro-batch 0's and m-1's round trips to the last stage (_end_pieces): the path
# F_0(r) -> RT -> B_0(r) -> F_{w+1}(r), then loops F_k(r) -> F_k(r+1) -> B_{k-w+1}(r+1) -> B_{k-w+1}(r) for
# k = w+1, w+3, ..., m-3 (each swaps rank r's B_{k-w}, F_{k+1} for t_{r+1} + 2h), then F_{m-1}(r) -> RT -> B_{m-1}(r):
#   end_r >= start_r + m t_r + max(0, RT - a f_r) + max(0, RT - a b_r) + K2 max(0, t_{r+1} + 2h - t_r),
# K2 = floor((m - w - 4) / 2) + 1 loops, a = min(w, m - 1). P_r is the larger of the two paths.

def pair_terms(problem: PartitionProblem, boundaries, policies) -> tuple[float, ...]:
    """P_r for r = 0..p-2 of one partition (empty unless the schedule is 1f1b)."""
    pr = problem
    bounds, pols = _check_partition(pr, boundaries, policies)
    if pr.schedule != "1f1b":
        return ()
    t = _tables(pr)
    p = pr.num_stages
    f, b, e = [], [], []
    for r in range(p):
        i, j = bounds[r], bounds[r + 1]
        c, d, _ = _cuts(t, pols[r], i, j)
        sums = _layer_sums(t, i, j, c, d, False)
        f.append(float(_stage_forward(pr, r, sums)))
        b.append(float(_stage_backward(pr, r, sums)))
        e.append(float(_stage_sync(pr, r, sums, f[r], b[r])))
    return tuple(_pair_term(pr, r, f[r], b[r], e[r], sum(f[:r]), sum(b[:r]), f[r + 1] + b[r + 1],
                            sum(f[s] + b[s] for s in range(r + 1, p))) for r in range(p - 1))


def _pair_term(pr: PartitionProblem, r: int, f, b, e, f_before, b_before, t_next, t_after):
    """P_r (see the comment above); works on floats and on numpy grids alike."""
    p, m, h = pr.num_stages, pr.num_microbatches, pr.hop_s
    w = min(p - r - 1, m)
    if w >= m:  # every forward of rank r is a warm-up forward: no steady state, no pair chain
        shape = np.shape(np.asarray(f) + np.asarray(t_next))
        return np.full(shape, -np.inf) if shape else -math.inf
    k = max(0, (m - 1 - w) // 2)
    s0 = f_before + r * h + w * f
    end = s0 + k * (f + b + t_next + 2 * h) + f + (m - 2 * k) * b + max(0, m - 1 - w - 2 * k) * f
    loops = (m - w - 4) // 2 + 1
    if loops > 0:  # both round trips with the pair loops between them
        trip, a = t_after + 2 * (p - 1 - r) * h, min(w, m - 1)
        trips = np.maximum(trip - a * f, 0.0) + np.maximum(trip - a * b, 0.0)
        end = np.maximum(end, f_before + r * h + m * (f + b) + trips
                         + loops * np.maximum(t_next + 2 * h - (f + b), 0.0))
    return end + np.maximum(b_before + r * h, e)


def solve_dp_pairs(problem: PartitionProblem, policy: Granularity) -> PartitionResult | None:
    """The exact optimum of max(J, max_r P_r) over contiguous partitions with one uniform policy (1F1B), by a DP over
    (stage, first layer, end) since P_r reads the next stage's time: O(p L^3), so meant for the few candidates whose
    simulated time exceeds their J bound. Returns evaluate() of the plan with objective replaced by the tighter value.
    For other schedules it is solve_dp."""
    if problem.schedule != "1f1b" or problem.num_stages == 1:
        return solve_dp(problem, policy)
    return _bound_plan(problem, policy, _pairs_dp(problem, policy))


def _pairs_dp(pr: PartitionProblem, policy: Granularity,
              cheapest: bool = False) -> tuple[float, tuple[int, ...]] | None:
    """(min over partitions of max(J, max_r P_r), a partition attaining it), or None when nothing fits (1F1B,
    p > 1; cheapest: see _uniform_grids)."""
    p, L = pr.num_stages, pr.num_layers
    j = _grid(L)[1]
    grids = _uniform_grids(pr, policy, cheapest)
    with np.errstate(invalid="ignore"):
        # v[r][i, j]: best max over stages >= r when stage r runs [i, j).
        v = np.where(j == L, grids[p - 1].objective(pr, p - 1), np.inf)
        nxt = [None] * p
        for r in reversed(range(p - 1)):
            g = grids[r]
            jr = g.objective(pr, r)
            t_next = grids[r + 1].f + grids[r + 1].b  # [j, k] grid of stage r+1
            # pair[i, j, k] = P_r with stage r on [i, j) and stage r+1 on [j, k)
            pair = _pair_term(pr, r, g.f[:, :, None], g.b[:, :, None], g.e[:, :, None], g.f_before[:, :, None],
                              g.b_before[:, :, None], t_next[None, :, :], g.t_after[:, :, None])
            total = np.maximum(np.maximum(jr[:, :, None], pair), v[None, :, :])
            nxt[r] = np.argmin(total, axis=2)
            v = np.min(total, axis=2)
    best = float(v[0].min())
    if not np.isfinite(best):
        return None
    start, end = 0, int(np.argmin(v[0]))
    bounds = [0, end]
    for r in range(p - 1):
        k = int(nxt[r][start, end])
        start, end = end, k
        bounds.append(end)
    return best, tuple(bounds)


def per_stage_tight_bound(problem: PartitionProblem) -> float:
    """A lower bound on the step of every (partition, per-stage recompute policy): the largest of per_stage_bound
    and the pair, rank-0-sync and rank-0-path bounds, each with every stage on its cheapest fitting policy and the
    other stages' extras left out. Every path only grows with any stage's backward while the exposed sync it adds
    loses at most that (solve_dp's relaxation argument), so each stays a bound; inf when no policy mix fits. Meant
    for a per-stage candidate whose J bound stays below its simulated time and whose partitions are too many to
    list."""
    if problem.num_stages == 1 or problem.schedule == "zb":
        return per_stage_bound(problem)[0]
    # each DP below is a min over partitions of max(J_cheapest, ...), so none is below per_stage_bound's value
    values = [_found(_stage0_sync_dp(problem, "none", cheapest=True))]
    if problem.schedule == "1f1b":
        values += [_found(_pairs_dp(problem, "none", cheapest=True)),
                   _found(_rank0_path_sync_dp(problem, "none", cheapest=True))]
    return max(values)


def _found(found: tuple[float, tuple[int, ...]] | None) -> float:
    return math.inf if found is None else found[0]


# ---- rank 0's own sync after the whole backward flow ------------------------------------------------------------------
#
# Rank 0 finishes last in 1F1B and GPipe: every rank's last backward still flows back to it (A_r = end_r + B_<r + r h),
# and only then does rank 0 run its exposed DP sync and optimizer step E_0. So the step is at least max_r A_r + E_0.
# J takes max(tail, E_r) per rank and misses this sum; E_0 depends on stage 0's layers, which couples stage 0 with
# the binding stage, so the DP runs once per end of stage 0 (vectorised over it: O(p L^3)).

def stage0_sync_bound(problem: PartitionProblem, policy: Granularity) -> float:
    """min over contiguous partitions (one uniform policy) of max(J, max_r A_r + E_0): a lower bound on the simulated
    step that adds rank 0's DP sync after the last gradient reaches it; inf when nothing fits. ZB: solve_dp's value
    (its tail is not bounded)."""
    if problem.schedule == "zb" or problem.num_stages == 1:
        return dp_bound(problem, policy)
    found = _stage0_sync_dp(problem, policy)
    return math.inf if found is None else found[0]


def solve_stage0_sync(problem: PartitionProblem, policy: Granularity) -> PartitionResult | None:
    """The partition attaining stage0_sync_bound, evaluated, with objective replaced by the bound (a plan to simulate
    where the DP's own partition left a gap); solve_dp for ZB and a single stage."""
    if problem.schedule == "zb" or problem.num_stages == 1:
        return solve_dp(problem, policy)
    return _bound_plan(problem, policy, _stage0_sync_dp(problem, policy))


def _stage0_sync_dp(pr: PartitionProblem, policy: Granularity,
                    cheapest: bool = False) -> tuple[float, tuple[int, ...]] | None:
    """(the bound, a partition attaining it), or None when nothing fits (cheapest: see _uniform_grids)."""
    p, L = pr.num_stages, pr.num_layers
    grids = _uniform_grids(pr, policy, cheapest)
    with np.errstate(invalid="ignore"):
        jm = [g.objective(pr, r) for r, g in enumerate(grids)]
        am = [g.objective(pr, r, sync=False) for r, g in enumerate(grids)]  # A_r = end_r + B_<r + r h
        e0 = np.broadcast_to(grids[0].e, (L + 1, L + 1))[0]  # E_0 for stage 0 = [0, j0), by j0
        c = np.where(np.isfinite(jm[0][0]), e0, 0.0)  # one DP per end of stage 0, side by side
        first = np.maximum(jm[0][0], am[0][0] + c)  # stage 0's own terms (A_0 + E_0 <= J_0 unless tail > E_0)
        return _by_end_of_stage0(p, L, first, lambda r: np.maximum(jm[r][None, :, :], am[r][None, :, :]
                                                                   + c[:, None, None]))
