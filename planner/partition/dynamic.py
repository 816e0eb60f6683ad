"""Exact dynamic programs over stage boundaries for one recomputation policy on every stage, the memory
feasibility test, and the cheapest-fitting per-stage policy's bound."""

from __future__ import annotations

import math
from itertools import pairwise

import numpy as np

from meshplan.costmodels.config import StagePolicy
from meshplan.costmodels.deadline import Deadline, check
from meshplan.planner.partition.problem import GRANULARITIES, TIE_RTOL, Granularity, PartitionProblem, PartitionResult
from meshplan.planner.partition.terms import (_Tables, _evaluate, _layer_sums, _stage_backward, _stage_forward,
                                              _stage_memory, _stage_objective, _stage_sync, _tables, _when)

FULL_CUT_SCAN_MAX_CELLS = 2**22  # _first_full_cut tries every cut at once up to this many cells (32 MB a float array)
BLOCK_MAX_CELLS = 2**20  # the DPs build their (stage, first layer, end) grids this many cells at a time (8 MB an array)


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
            + _when(p - 1 > R, pr.last_forward + pr.last_backward))
        jr = _stage_objective(pr, R, f, b, e, f_before, b_before, t_after)
        ends_in_band = (J > I) & (R + width >= J) & (1 + np.arange(J.shape[2]) == J - I)  # clipped ends are out
        return np.where(ends_in_band & (mem <= pr.memory_cap_bytes), jr, np.inf)  # [r][i - r, j - i - 1]


def _cheapest_fitting(pr: PartitionProblem, t: _Tables, R, I, J) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(c, d, peak) on the grids of _stage_grid: for each stage (r, [i, j)) the policy with the least recompute
    extra under which it fits (none, then selective or full on the fewest layers k, the cheaper of the two: a full
    extra only grows with k); (i, i, 0) where none fits.

    With one stage's layers fixed, the others' J_s only grow with its backward (B_<s, T_>s) and so does its own J_r
    (end_r gains m x the growth, its exposed reduce loses at most it): the cheapest fitting policy is the best one."""
    cap = pr.memory_cap_bytes
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
                                 deadline: Deadline | None = None) -> tuple[float, PartitionResult | None] | None:
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
    for r, (a, b) in enumerate(pairwise(bounds)):  # each stage's policy: the same rule on its row, end b
        ends = np.arange(a + 1, b + 1)[None, None, :]
        c_row, d_row, _ = _cheapest_fitting(problem, t, np.full((1, 1, 1), r), np.full((1, 1, 1), a), ends)
        c, d = int(c_row[0, 0, -1]), int(d_row[0, 0, -1])
        pols.append(StagePolicy(granularity="full", full_layers=c - a) if c > a
                    else StagePolicy(granularity="selective") if d > a else StagePolicy(granularity="none"))
    return lower, _evaluate(problem, t, bounds, tuple(pols), relaxed=False)
