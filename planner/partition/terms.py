"""The per-stage terms of the objective J (forward, backward, memory, sync, the 1F1B end time), written once for
scalars and numpy grids alike, and evaluate(): every solver's result comes out of it."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import numpy as np

from meshplan.costmodels.config import StagePolicy
from meshplan.planner.partition.problem import Granularity, PartitionProblem, PartitionResult, _NO_SYNC


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

    fwd: Any  # each a float, or an array over the (i, j) grid
    bwd: Any
    extra: Any  # recompute extra of [i, d) (selective) and [i, c) (full)
    state: Any
    act: Any  # activation bytes per held micro-batch
    dense: Any
    expert: Any


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
    if any(b <= a for a, b in pairwise(bounds)):
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
                           tuple(fr + br for fr, br in zip(f, b, strict=True)))


def evaluate(problem: PartitionProblem, boundaries, policies) -> PartitionResult | None:
    """J and per-stage memory of one partition; None when a stage exceeds the memory cap.

    boundaries: p + 1 ints, 0 = b_0 < ... < b_p = L (stage r runs layers [b_r, b_{r+1})); policies: p StagePolicy.
    Raises ValueError on malformed boundaries or policies."""
    bounds, pols = _check_partition(problem, boundaries, policies)
    return _evaluate(problem, _tables(problem), bounds, pols, relaxed=False)


def policy_options(n: int, per_stage: bool, policy: Granularity) -> list[StagePolicy]:
    """The policies a stage of n layers may take: with per_stage none, selective and full on its first k = 1..n
    layers (in that order, which breaks ties); else `policy` alone ("full": all its layers)."""
    if per_stage:
        return [StagePolicy(granularity="none"), StagePolicy(granularity="selective")] + [
            StagePolicy(granularity="full", full_layers=k) for k in range(1, n + 1)]
    return [StagePolicy(granularity="full", full_layers=n) if policy == "full" else StagePolicy(granularity=policy)]
