"""Tighter lower bounds than J where the 1F1B pipeline's sync paths bind, and the partitions whose bound is below a
threshold (what the search enumerates to close a gap)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from meshplan.costmodels.config import StagePolicy
from meshplan.planner.partition.problem import GRANULARITIES, Granularity, PartitionProblem, PartitionResult
from meshplan.planner.partition.terms import (_check_partition, _cuts, _evaluate, _layer_sums, _round_trips,
                                              _stage_backward, _stage_forward, _stage_memory, _stage_objective,
                                              _stage_sync, _tables, policy_options)
from meshplan.planner.partition.dynamic import (_cheapest_fitting, _grid, _uniform_cuts, dp_bound, per_stage_bound,
                                                solve_dp)


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


# ---- rank 0's path to every rank's sync (1F1B) -----------------------------------------------------------------------
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
    None when more than `limit` pairs are below it (the caller's bound then stays open); the partitions walked are
    those whose cheapest-fitting-policy J is below it (_cheapest_partitions_below), at most
    PER_STAGE_ENUMERATION_MAX_PARTITIONS. Per stage the policies are none, selective and full on its first k layers;
    J never decreases when any stage's backward grows (solve_dp's relaxation argument), so each stage's fitting
    policies are tried by growing backward and a branch stops at the first that reaches the threshold with the
    cheapest policies on the stages after it. Brute force over partitions because the DP has no per-stage
    equivalent of partitions_below's table; it closes the gaps of small pipelines, where per-stage plans win."""
    partitions = _cheapest_partitions_below(problem, threshold, PER_STAGE_ENUMERATION_MAX_PARTITIONS)
    if partitions is None:
        return None
    t = _tables(problem)
    found: list[tuple[float, tuple[int, ...], tuple[StagePolicy, ...]]] = []
    for bounds in partitions:
        options = _fitting_options(problem, t, bounds)
        if options is not None and not _policies_below(problem, bounds, options, threshold, limit, found):
            return None
    return sorted(found, key=lambda x: (x[0], x[1]))


StageOption = tuple[float, float, float, StagePolicy]  # (forward, backward, sync, policy) of one stage


def _fitting_options(problem: PartitionProblem, t, bounds: tuple[int, ...]) -> list[list[StageOption]] | None:
    """Per stage of the partition, each policy that fits its memory, by growing backward; None when a stage has
    none."""
    options = []
    for r in range(problem.num_stages):
        i, j = bounds[r], bounds[r + 1]
        row = []
        for pol in policy_options(j - i, True, "none"):
            c, d, peak = _cuts(t, pol, i, j)
            sums = _layer_sums(t, i, j, c, d, False)
            if not float(_stage_memory(problem, r, sums, peak)) <= problem.memory_cap_bytes:
                continue
            f, b = float(_stage_forward(problem, r, sums)), float(_stage_backward(problem, r, sums))
            row.append((f, b, float(_stage_sync(problem, r, sums, f, b, layers=float(j - i))), pol))
        if not row:
            return None
        options.append(sorted(row, key=lambda x: x[1]))
    return options


def _policies_below(problem: PartitionProblem, bounds: tuple[int, ...], options: list[list[StageOption]],
                    threshold: float, limit: int, found: list) -> bool:
    """Add to `found` every choice of the stages' options whose J is below `threshold` (branch and bound over the
    stages in order); False when that would pass `limit`."""
    p = problem.num_stages

    def objective(chosen: list[StageOption]) -> float:
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

    return extend([])


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
        nxt: list[np.ndarray] = [np.empty((0, 0), dtype=int)] * p  # filled for r < p - 1 below
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


# ---- rank 0's own sync after the whole backward flow -----------------------------------------------------------------
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
