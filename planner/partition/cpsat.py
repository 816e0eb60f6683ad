"""The OR-Tools CP-SAT model of the partition with per-stage recomputation policies: a few named steps (variables,
stages, objective), solved and re-evaluated in float."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import numpy as np
from ortools.sat.python import cp_model

from meshplan.costmodels.config import StagePolicy, one_of
from meshplan.planner.partition.problem import (CP_POLICIES, CpPolicies, GRANULARITIES, NS_PER_S, PartitionProblem,
                                                PartitionResult)
from meshplan.planner.partition.terms import _backward_const, _end_pieces, _forward_const, _tables, evaluate
from meshplan.planner.partition.dynamic import per_stage_bound, solve_dp

# CP-SAT's deterministic time per second of solving on one core: the 405B-like per-stage solve of
# tests/test_partition.py counts 0.83 units in its 2.1 s on the 2-core dev box (OR-Tools 9.15)
DETERMINISTIC_PER_S = 0.4
WALL_BACKSTOP = 10.0  # the wall-clock limit, as a multiple of the time limit: reached only on a stalled machine


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
    def build(cls, pr: PartitionProblem) -> _CpData:
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

    forward: cp_model.LinearExpr | int
    backward: cp_model.LinearExpr | int
    sync: cp_model.LinearExpr | int
    selective: cp_model.IntVar | bool  # a BoolVar, or fixed
    full: cp_model.IntVar | bool
    k: cp_model.IntVar | int  # layers recomputed in full


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
        for var, value in zip(bounds[1:-1], hint.boundaries[1:-1], strict=True):
            model.add_hint(var, value)
        for st, q in zip(stages, hint.policies if policies == "per-stage" else (), strict=False):
            for var, value in ((st.selective, q.granularity == "selective"), (st.full, q.granularity == "full"),
                               (st.k, q.full_layers)):
                if isinstance(var, cp_model.IntVar):  # per-stage: every choice is a variable
                    model.add_hint(var, value)
    # Creates a solver and solves the model.
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    # OR-Tools 9.15's presolve proved a suboptimal J "OPTIMAL" on a partition whose only cost was one stage's
    # expert-gradient reduce (280 ns returned, 140 ns feasible; tests/test_partition.py found it). Probing off, or
    # inclusion detection off, or presolve off solve it to 140 ns; probing off is the cheapest (405B-like per-stage
    # solve: 2.1 s default, 2.4 s without probing, 8.2 s without inclusion detection).
    solver.parameters.cp_model_probing_level = 0
    # the limit is CP-SAT's deterministic time (its count of work), so the answer is the same on an idle or a
    # loaded machine; the wall clock is only a backstop far behind
    solver.parameters.max_deterministic_time = DETERMINISTIC_PER_S * time_limit_s
    solver.parameters.max_time_in_seconds = WALL_BACKSTOP * time_limit_s
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
    for st, (a, b) in zip(stages, itertools.pairwise(found), strict=True):
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
    J = max_r J_r minimised. One worker, a fixed seed and a limit counted in CP-SAT's deterministic time
    (time_limit_s seconds of one core's solving, DETERMINISTIC_PER_S) keep it deterministic, whatever else the
    machine runs. The search
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
        starts = [solve_dp(problem, one_of(policies.removeprefix("uniform-"), GRANULARITIES, "policy"))]
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
