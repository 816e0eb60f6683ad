"""Branch-and-bound search over the space (planner/space.py), exact under the cost model.

For every candidate (all knobs but the stage partition) the partitioner's objective is a lower bound on the
event-simulated step time over *all* stage partitions (planner/partition/); the exact DP minimises it. Each
candidate is then either pruned (a bound is no better than the K-th best simulated plan so far), infeasible
(no partition fits in memory), or simulated with the DP's partition. The search is best-first (A*) over one queue
of steps ordered by their lower bounds, from the cheapest (a group's work bound) to the dearest (a simulation):
a DP or a simulation runs only when no cheaper bound left in the queue could still prune it.

Optimality: when the search ends, every candidate not simulated has a bound >= the K-th best time found; and a
simulated candidate whose time exceeds its own bound may hide a better partition. The account's gap is
(best time - smallest such open bound) / best time, 0 when the returned plan is proven optimal.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from itertools import pairwise

import numpy as np

from meshplan.costmodels.config import (DEFAULT_RECOMPUTE_MODULES, ParallelConfig, RecomputeModule, StagePolicy,
                                        Workload, resolve, split_evenly)
from meshplan.costmodels.context import CostContext
from meshplan.costmodels.deadline import Deadline, TimeLimitReached, cpu_now
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.estimate import Estimate, Simulated, model_flops_per_step, simulate_config
from meshplan.costmodels.memory import FRAGMENTATION, GIB
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.runtime import DEFAULT_RUNTIME, get_runtime
from meshplan.costmodels.uncertainty import RankKind, Ranking, inputs_region, region_of
from meshplan.hardware_db.cluster import Cluster
from meshplan.hardware_db.errors import InputError
from meshplan.planner.partition import (PartitionProblem, PartitionResult, partitions_below, per_stage_bound,
                                        per_stage_partitions_below, per_stage_tight_bound, solve_dp_pairs,
                                        solve_rank0_path_sync, solve_stage0_sync)
from meshplan.planner.plan import PartitionStatus, SearchStatus
from meshplan.planner.search_bounds import SearchCosts
from meshplan.planner.space import (DEFAULT_MAX_MBS, MEMORY_POLICY, UNIFORM_POLICY, Candidate, Enumeration, Group,
                                    check_pins, enumerate_space)

REL_TOL = 1e-9  # two step times closer than this (relative) are equal
QUICK_SAMPLE_GROUPS = 256  # under a time limit: about this many groups, a stride through them all, searched first
SCORE_CHUNK_GROUPS = 512  # under a time limit: the other groups scored this many at a time between checks
CPSAT_TIME_LIMIT_S = 10.0  # per CP-SAT call; an unproven answer leaves its candidate's bound open (a gap)
QUICK_PLAN_MIN_CELLS = 2**20  # under a time limit, a first plan is an even split where p (L+1)^2 exceeds this
ENUMERATE_PARTITIONS = 32  # closing a gap: simulate every partition below the best when there are at most this many
# a deferred per-stage candidate: simulate every (partition, policy) pair below the cutoff instead of CP-SAT when
# there are at most this many (each simulation is far cheaper than a CP-SAT solve)
DEFERRED_ENUMERATE_PAIRS = 4 * ENUMERATE_PARTITIONS

class Step(Enum):
    """The kinds of entry in the search's queue (_Search), each with the bound that prunes it, for the account."""

    GROUP = "work bound (group)"
    GROUP_FITTED = "work bound of the recomputation that fits (group)"
    CANDIDATE = "work bound"
    CANDIDATE_SHARDED = "work bound with ZeRO-2/3's per-layer DP collectives"
    INTERLEAVED = "pipeline bound (interleaved)"
    FAMILY = "partition bound without memory or DP sync (shared by ZeRO stages)"
    SIMULATE = "partition bound (DP)"
    PER_STAGE = "partition bound (relaxed recompute)"

    @property
    def pruned_by(self) -> str:
        return self.value


@dataclass(frozen=True)
class RankedPlan:
    """One simulated candidate: its knobs, the partitioner's bound for it and the full estimate with its timeline
    (what a plan's trace draws: kept, so the best plan need not be simulated again)."""

    candidate: Candidate
    config: ParallelConfig
    simulated: Simulated
    bound_s: float  # lower bound on this candidate's step time over all partitions
    partition_status: PartitionStatus  # "optimal" (simulated == bound), or "bound gap"
    ranked_s: float = math.nan  # what the search ranked it by: its step time, or under --rank conservative its slow end

    @property
    def estimate(self) -> Estimate:
        return self.simulated.estimate

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s


@dataclass(frozen=True)
class SearchAccount:
    """What the search looked at and what it can prove."""

    space_size: int
    evaluated: int  # candidates simulated
    bounded: int  # candidates whose partition bound was solved (DP or CP-SAT)
    pruned: dict[str, int]  # candidates pruned, by the bound that pruned them
    infeasible: dict[str, int]  # candidates rejected, by rule (divisibility) or memory
    seconds: float
    status: SearchStatus
    gap: float  # proven relative gap of the best plan (0 when optimal), in what was ranked
    lower_bound_s: float  # no candidate in the space ranks below this (its step time, or its slow end)
    domains: dict[str, str]
    cpsat_calls: int
    ranking: RankKind = "expected"
    memory_share: float = 1.0  # the share of the HBM a plan's predicted peak was allowed


@dataclass(frozen=True)
class SearchResult:
    plans: tuple[RankedPlan, ...]  # best first
    account: SearchAccount
    why_nothing_fits: str | None  # set when plans is empty


ProgressFn = Callable[[int, int], None]  # (done, total) over candidate groups


@dataclass
class _Best:
    """The K best simulated plans (a max-heap on the ranked quantity) and the cutoff a step-time bound must beat:
    under a ranking whose factor is at least `floor` everywhere, a bound b ranks at least b x floor, so the cutoff
    is the K-th best ranked value over the floor (1 when ranking by time)."""

    k: int
    floor: float = 1.0
    heap: list[tuple] = field(default_factory=list)
    counter: int = 0

    def cutoff(self) -> float:
        return -self.heap[0][0] / self.floor if len(self.heap) >= self.k else math.inf

    def add(self, plan: RankedPlan) -> bool:
        """Keep the plan if it is among the k best; a plan that ties one already kept and differs from it only
        in the ZeRO stage is dropped (the table would repeat itself): returns False for those."""
        c = plan.candidate
        twin = (c.mesh, c.mbs, c.sp, c.cp_comm, c.schedule, c.vpp, plan.estimate.layout.stage_layers,
                plan.estimate.layout.stage_recompute)
        for item in self.heap:
            other = item[-1]
            o = other.candidate
            if ((o.mesh, o.mbs, o.sp, o.cp_comm, o.schedule, o.vpp, other.estimate.layout.stage_layers,
                 other.estimate.layout.stage_recompute) == twin
                    and abs(other.ranked_s - plan.ranked_s) <= REL_TOL * plan.ranked_s):
                return False
        self.counter += 1
        lay = plan.estimate.layout
        # ties (equal ranked value) go to the simpler plan: no CP, lower ZeRO, then less memory
        item = (-plan.ranked_s, -lay.cp, -lay.zero, -plan.estimate.peak_memory_gib, -self.counter, plan)
        if len(self.heap) < self.k:
            heapq.heappush(self.heap, item)
        elif item[:-1] > self.heap[0][:-1]:
            heapq.heapreplace(self.heap, item)
        return True

    def ranked(self) -> list[RankedPlan]:
        return [x[-1] for x in sorted(self.heap, key=lambda x: tuple(-v for v in x[:-1]))]


def search(model: ModelSpec, cluster: Cluster, wl: Workload, pins: ParallelConfig = ParallelConfig(),
           runtime: str = DEFAULT_RUNTIME, efficiency: Efficiency | None = None, top_k: int = 10,
           time_limit_s: float | None = None, progress: ProgressFn | None = None,
           max_mbs: int = DEFAULT_MAX_MBS, ranking: Ranking = Ranking(), memory_share: float = 1.0) -> SearchResult:
    """The top_k plans by predicted step time (or by what `ranking` ranks: the slow end of each plan's interval),
    and the account of the search (see the module docstring). `pins`: the knobs fixed; each one left None is
    searched (`max_mbs`: the largest micro-batch size tried). `memory_share`: the share of the HBM a plan's
    predicted peak may take (uncertainty.memory_share)."""
    if top_k < 1:
        raise InputError("--top must be at least 1")
    if not (math.isfinite(memory_share) and memory_share > 0):
        raise InputError(f"the share of HBM a plan may use must be positive, not {memory_share}")
    rt = get_runtime(runtime)
    check_pins(model, cluster.num_gpus, wl, pins, rt)
    start, cpu_start = time.perf_counter(), cpu_now()
    eff = efficiency or Efficiency.from_gpu(cluster.gpu)
    enum = enumerate_space(model, cluster.num_gpus, cluster.gpus_per_node, wl, pins, rt, max_mbs)
    s = _Search(model, cluster, wl, rt.name, eff, enum, top_k, pins.recompute_modules, ranking, memory_share)
    deadline = None if time_limit_s is None else cpu_start + time_limit_s  # CPU seconds (costmodels/deadline.py)
    timed_out = s.run(deadline, progress)
    return s.result(time.perf_counter() - start, timed_out)


class _Search(SearchCosts):
    """The best-first queue over SearchCosts' bounds: its steps, the CP-SAT solves and gap closing, and the
    account."""

    def __init__(self, model: ModelSpec, cluster: Cluster, wl: Workload, runtime: str, eff: Efficiency,
                 enum: Enumeration, top_k: int, modules: tuple[RecomputeModule, ...] = DEFAULT_RECOMPUTE_MODULES,
                 ranking: Ranking = Ranking(), memory_share: float = 1.0):
        super().__init__(model, cluster, wl, runtime, eff, enum, modules, memory_share)
        self.ranking = ranking
        floor = ranking.floor(inputs_region(model, wl, cluster.spec.gpu, runtime))
        if not math.isfinite(floor) or floor <= 0:
            raise InputError(f"--rank {ranking.kind}: no measured run bounds a {cluster.spec.gpu} prediction at the "
                             f"{100 * ranking.level:.0f} % level; use --rank expected")
        self.best = _Best(top_k, floor)
        self.deadline: float | None = None  # the time limit's cpu_now() end (see run and _limit)
        self.pruned: dict[str, int] = {}
        self.infeasible: dict[str, int] = dict(enum.infeasible)
        self.evaluated = self.bounded = self.cpsat_calls = 0
        # simulated candidates whose time exceeds their bound: another partition might be faster
        self.open_bounds: list[tuple[float, Candidate, tuple[int, ...] | None, tuple | None]] = []
        self.unexplored_bound = math.inf  # smallest bound left when a time limit stopped the search
        self.queue: list[tuple[float, int, Step, tuple]] = []  # the search's steps by lower bound (see run)
        self.seq = 0
        self.eager = False  # see _next
        self.expanded = 0  # candidate groups expanded (the progress bar's count)
        self.deferred: list[tuple[float, int, Candidate, PartitionProblem]] = []  # per-stage candidates for CP-SAT
        self.gaps_tried: set[tuple] = set()  # open bounds _close_gaps has worked on
        self.recompute_choices = {r for g in enum.groups for r in g.recomputes}  # what the space recomputes

    # ---- the search
    # Every step of the search is an entry (lower bound, sequence, step, payload) of one priority queue: a group of
    # candidates (bound: its work bound), a candidate (its work bound), a candidate with its next bound (the family
    # DP, the interleaved bound, the relaxed per-stage DP) or a partition to simulate (its DP bound J). The smallest
    # bound is always taken next (A*), so a DP or a simulation runs only when nothing cheaper could prune it, and
    # the search ends when the smallest bound left reaches the K-th best simulated time. Each step names the bound
    # that prunes what is left of it, for the account.

    def _push(self, bound: float, step: Step, *payload) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (bound, self.seq, step, payload))

    def run(self, deadline: float | None, progress: ProgressFn | None) -> bool:
        """The search; True when the time limit stopped it. Under a limit it is anytime: a stride sample of the
        groups is scored and searched first, until it yields a plan (the quick first plan), then the other groups
        are scored a chunk at a time; the limit stops the search only once a plan is kept, so a search under any
        limit returns a plan when one fits, with the gap to the smallest bound it did not reach."""
        groups = self.enum.groups
        self.eager, self.deadline = deadline is not None, deadline
        # Level 0: model states alone (no activations) must fit.
        fitting = []
        for g in groups:
            floor = self.states_floor(g) * (1 + FRAGMENTATION)
            if floor > self.cap:
                self._count(self.infeasible, "memory: model states alone exceed HBM", g.size())
                self._note_memory(floor, f"tp={g.mesh.tp} pp={g.mesh.pp} ep={g.mesh.ep}")
                continue
            fitting.append(g)
        live, self.expanded = len(fitting), 0
        if deadline is None:
            self._push_groups(fitting)
        else:
            stride = max(1, len(fitting) // QUICK_SAMPLE_GROUPS)
            sample = set(range(0, len(fitting), stride))
            self._push_groups([fitting[n] for n in sorted(sample)])
            if self._loop(deadline, progress, live, until_a_plan=True):
                return True
            rest = [g for n, g in enumerate(fitting) if n not in sample]
            for at in range(0, len(rest), SCORE_CHUNK_GROUPS):
                if self._past(deadline):
                    self._stop_for_time(progress, live, rest[at:])
                    return True
                self._push_groups(rest[at:at + SCORE_CHUNK_GROUPS])
        if self._loop(deadline, progress, live):
            return True
        for _, _, step, payload in self.queue:  # every bound left is at or above the K-th best time
            self._count(self.pruned, step.pruned_by, _entries(step, payload))
        self.queue.clear()
        # first: the partitions it simulates tighten the cutoff CP-SAT then meets; then the bounds CP-SAT left open
        timed_out = self._close_gaps(deadline) or self._run_cpsat(deadline) or self._close_gaps(deadline)
        if progress:
            progress(live, live)
        return timed_out

    def _push_groups(self, groups: list[Group]) -> None:
        for g, score in zip(groups, self._group_scores(groups), strict=True):
            self._push(score, Step.GROUP, g)

    def _fit_group(self, bound: float, g: Group) -> None:
        """A group at the head of the queue: its score again with the recomputations its memory floor allows
        (_group_scores with memory; a few floors, where expanding it builds every candidate). Where that lifts the
        bound the group goes back to the queue; where nothing fits it is infeasible; else it is expanded."""
        score = self._group_scores([g], memory=True)[0]
        if math.isinf(score):  # no candidate's activations fit under any recomputation or ZeRO stage
            self._count(self.infeasible, "memory: activations of the micro-batches in flight (floor)", g.size())
        elif score > bound * (1 + REL_TOL):
            self._push(score, Step.GROUP_FITTED, g)
        else:
            self._expand_group(g)

    def cutoff(self) -> float:
        return self.best.cutoff()

    def _limit(self) -> Deadline | None:
        """The deadline that long steps (a partition DP, a pipeline simulation) check as they run: none before the
        first plan is kept, as the search's own checks (_past)."""
        return Deadline(self.deadline) if self.deadline is not None and self.best.heap else None

    def _past(self, deadline: float | None) -> bool:
        """The time limit has passed and a plan is kept (before the first plan the limit waits: see run)."""
        return deadline is not None and bool(self.best.heap) and cpu_now() > deadline

    def _loop(self, deadline: float | None, progress: ProgressFn | None, live: int,
              until_a_plan: bool = False) -> bool:
        """Take the queue's smallest bound until it reaches the K-th best time (until_a_plan: until a plan is kept,
        leaving the rest queued); True when the time limit stopped it."""
        while self.queue:
            if until_a_plan and self.best.heap:
                return False
            bound, _, step, payload = self.queue[0]
            if bound >= self.best.cutoff() * (1 - REL_TOL):
                break
            if self._past(deadline):
                self._stop_for_time(progress, live, [])
                return True
            heapq.heappop(self.queue)
            if step is Step.GROUP:
                self.expanded += 1
                if progress:
                    progress(self.expanded, live)
            try:
                self._run_step(bound, step, payload)
            except TimeLimitReached:  # the limit stopped the step midway: its bound is not reached either
                self.unexplored_bound = min(self.unexplored_bound, bound)
                self._count(self.pruned, "not reached before the time limit",
                            _entries(step, payload))
                self._stop_for_time(progress, live, [])
                return True
        return False

    def _stop_for_time(self, progress: ProgressFn | None, live: int, unscored: list[Group]) -> None:
        """The limit stopped the search: what is left counts as not reached, and the smallest bound left (the queue's,
        the deferred CP-SAT solves', and for groups never scored the space's compute floor) bounds the gap."""
        for bound, _, rest, load in self.queue:
            self.unexplored_bound = min(self.unexplored_bound, bound)
            self._count(self.pruned, "not reached before the time limit", _entries(rest, load))
        self.queue.clear()
        for later, _, _, _ in self.deferred:
            self.unexplored_bound = min(self.unexplored_bound, later)
        self._count(self.pruned, "not reached before the time limit", len(self.deferred))
        self.deferred.clear()
        if unscored:
            self.unexplored_bound = min(self.unexplored_bound, self._compute_floor())
            self._count(self.pruned, "not reached before the time limit", sum(g.size() for g in unscored))
        if progress:
            progress(live, live)

    def _compute_floor(self) -> float:
        """No plan is faster than the model's FLOPs on every GPU at the highest rate any kernel reaches: the
        workload dtype's dense peak (FP8 runs keep their attention in 16 bits, below it) times the highest kernel
        ceiling (Efficiency.highest_ceiling; a calibration's curves: the chip's highest peak). The bound of the
        groups a time limit left unscored (loose, but it needs no per-group cost)."""
        gpu, ceiling = self.cluster.gpu, self.eff.highest_ceiling()
        if ceiling is None:
            rate = max(p.value for p in gpu.peak_tflops.values()) * 1e12
        else:
            rate = gpu.peak_flops(self.wl.dtype) * ceiling
        return model_flops_per_step(self.model, self.wl) / (self.cluster.num_gpus * rate)

    def _run_step(self, bound: float, step: Step, payload: tuple) -> None:
        if step is Step.GROUP:
            self._fit_group(bound, payload[0])
        elif step is Step.GROUP_FITTED:
            self._expand_group(payload[0])
        elif step is Step.CANDIDATE:
            self._step_candidate(bound, payload[0])
        elif step is Step.CANDIDATE_SHARDED:
            self._step_candidate(bound, payload[0], sharded_bound=True)
        elif step is Step.INTERLEAVED:
            self._step_interleaved(bound, *payload)
        elif step is Step.FAMILY:
            self._step_family(bound, *payload)
        elif step is Step.SIMULATE:
            self._simulate(payload[0], payload[1], None, bound, self._context(payload[0]))
        else:
            self._per_stage(bound, *payload)

    def _next(self, bound: float, step: Step, *payload) -> None:
        """A candidate's next step: queued by its bound or, under a time limit, taken at once while fewer than K
        plans are kept (the cutoff is infinite, nothing could prune it, and a time-limited search needs plans early;
        without a limit the queue order does the least work)."""
        if self.eager and math.isinf(self.best.cutoff()):
            self._run_step(bound, step, payload)
        else:
            self._push(bound, step, *payload)

    def _expand_group(self, g: Group) -> None:
        with_sp = {cc for sp, cc, _, _ in g.variants if sp} if g.mesh.tp > 1 else set()
        dominated_sp = {cc for cc in with_sp if self._sp_dominates(g, cc)}
        cands = []
        for sp, cc, sched, vpp in g.variants:
            if not sp and cc in dominated_sp:
                self._count(self.pruned, "dominated: sequence parallel is no slower and uses less memory",
                            len(g.zeros) * len(g.recomputes_for(vpp)))
                continue
            cands += [Candidate(g.mesh, g.mbs, sp, cc, zero, sched, vpp, rec, self.modules) for zero in g.zeros
                      for rec in g.recomputes_for(vpp)]
        # the memory floor first (the group's candidates at once): it needs no context, and most memory-hungry
        # candidates fail it. It holds for virtual stages too: interleaving keeps ((p-r-1) 2 + (v-1) p + 1)
        # chunk-micro-batches on rank r, at least the p - r whole stages the 1F1B floor counts (their difference is
        # (p - 1 + r (v - 2)) / v >= 0)
        floors = self._memory_floors(cands)
        over = floors > self.cap
        if over.any():
            self._count(self.infeasible, "memory: activations of the micro-batches in flight (floor)", int(over.sum()))
            k = int(np.argmin(np.where(over, floors, np.inf)))
            self._note_memory(float(floors[k]), _describe(cands[k]))
            cands = [c for c, bad in zip(cands, over.tolist(), strict=True) if not bad]
        if not cands:
            return
        bounds = self.work_bounds_of(cands)
        # ZeRO-2/3 candidates whose layer times hold per-layer DP collectives: the work bound over those layer times
        # (most end here: a gather or reduce-scatter per layer and micro-batch can outweigh the layer)
        # (CostContext.dp_in_layer_times, read off the candidate without building its context). That bound is at
        # least the work bound, so where the work bound already reaches the best plan it is not computed.
        cutoff = self.best.cutoff() * (1 - REL_TOL)
        has_dp = [c.zero == 3 or self.rt.reduces_each_microbatch(c.zero, c.mesh.pp) for c in cands]
        sharded = [n for n, (dp_in_layers, bound) in enumerate(zip(has_dp, bounds.tolist(), strict=True))
                   if dp_in_layers and bound < cutoff]
        if sharded:
            gbs = self.wl.global_batch
            rep: dict[tuple, Candidate] = {}
            for n in sharded:  # one context per (sp, cp_comm, zero): the layer times read nothing else of these
                rep.setdefault((cands[n].sp, cands[n].cp_comm, cands[n].zero), cands[n])
            ctxs = {k: self._context(c) for k, c in rep.items()}
            rows = [(self._sharded_key_costs(c, ctxs[(c.sp, c.cp_comm, c.zero)]), c.num_microbatches(gbs),
                     c.mesh.pp, c.schedule, self._hop(c.mesh, c.mbs)) for c in (cands[n] for n in sharded)]
            bounds[sharded] = np.maximum(bounds[sharded], self._work_bounds(rows))
        for c, bound, dp_in_layers in zip(cands, bounds.tolist(), has_dp, strict=True):
            if dp_in_layers and bound >= cutoff:
                self._count(self.pruned, Step.CANDIDATE_SHARDED.pruned_by)
            else:
                self._push(bound, Step.CANDIDATE_SHARDED if dp_in_layers else Step.CANDIDATE, c)

    def _step_candidate(self, key: float, c: Candidate, sharded_bound: bool = False) -> None:
        """The candidate's next bound: the interleaved bound with virtual stages, else (after the memory floor) the
        partition DP without memory or DP sync, shared by its ZeRO stages (ZeRO-2/3 candidates come queued by
        their work bound over layer times with the per-layer DP collectives: _expand_group)."""
        ctx = self._context(c)
        assert sharded_bound or not ctx.dp_in_layer_times, "ZeRO-2/3 candidates are queued with their sharded bound"
        if self.eager and not self.best.heap and c.vpp == 1 and self._partition_cells(c) > QUICK_PLAN_MIN_CELLS:
            self._quick_plan(c, ctx, key)
        if c.vpp > 1:
            self._next(min(b for b, _ in self._chunk_options(c, ctx)), Step.INTERLEAVED, c, ctx)
            return
        prob = self.problem(c, ctx)
        below = self._below(key)
        bound = self._family_bound(c, prob, below)
        if bound >= self.best.cutoff() * (1 - REL_TOL):
            self._count(self.pruned, Step.FAMILY.pruned_by)
            return
        self._next(bound, Step.FAMILY, c, prob)

    def _quick_plan(self, c: Candidate, ctx: CostContext, key: float) -> None:
        """Under a time limit, before any plan is kept, where the candidate's exact partition DPs are slow (hundreds
        of layers: a second each): its even split simulated at once (one estimate), so that a first plan comes
        quickly and the limit can start to count. Where the DPs are fast the first plan comes from them, a better
        one (DeepSeek-V3's first candidate: 1.18x the optimum with its DP partition, 1.65x evenly split). The
        candidate's own steps follow as usual; this is one more partition of it, not another account entry. Where
        its even split does not fit and the space holds full recomputation, the same mesh with every layer recomputed
        (the least memory; a candidate of the space, met later in its own right) is tried too: without it, under a
        runtime that recomputes every stage alike, a 1,024-layer model waited for the exact DPs of the candidates
        that do not fit (13 s instead of 1)."""
        even = tuple(split_evenly(self.model.num_layers, c.mesh.pp))
        policies = tuple(StagePolicy(granularity="full", full_layers=n) for n in even) \
            if c.recompute == "per-stage" else None  # per-stage: its plan with the least memory
        self._simulate(c, even, policies, key, ctx, another_partition=True)
        if not self.best.heap and c.recompute in ("none", "selective") and "full" in self.recompute_choices:
            full = c._replace(recompute="full")
            self._simulate(full, even, None, key, self._context(full), another_partition=True)

    def _step_interleaved(self, bound: float, c: Candidate, ctx: CostContext) -> None:
        """Each virtual-stage split (one partition each, so its bound and memory floor are of the partition itself)
        simulated where its bound beats the cutoff and its memory floor fits."""
        self.bounded += 1
        simulated = False
        for option_bound, chunks in self._chunk_options(c, ctx):
            if simulated and option_bound >= self.best.cutoff() * (1 - REL_TOL):
                break
            option = self._option_context(c, ctx, chunks)
            need = self._interleaved_memory_floor(c, option, c.recompute)
            if need > self.cap:
                self._note_memory(need, _describe(c))
                continue
            self._simulate(c, None, None, max(bound, option_bound), ctx=ctx, chunks=option.lay.chunks,
                           another_partition=simulated)
            simulated = True
        if not simulated:
            self._count(self.infeasible, "memory: in-flight micro-batches of the interleaved schedule")

    def _step_family(self, key: float, c: Candidate, prob: PartitionProblem) -> None:
        """The candidate's own partition bound: the exact DP (per-stage recomputation: the relaxed DP first),
        after the greedy memory test that most misfits fail; exact below _below(key), else queued again there."""
        per_stage = c.recompute == "per-stage"
        policy = UNIFORM_POLICY[c.recompute]
        if not self._may_fit(prob, policy, per_stage):
            self._no_partition(c, prob, "memory: no partition fits even with full recompute" if per_stage
                               else "memory: no stage partition fits", Step.PER_STAGE if per_stage else Step.SIMULATE)
            return
        below = self._below(key)
        res = self._dp(prob, policy, relaxed=per_stage, below=below)  # per-stage: no-recompute times, least memory
        if res is None:
            if below < self.best.cutoff():
                self._push(below, Step.FAMILY, c, prob)  # nothing below `below`: a lower bound, solved again if reached
            else:
                self._no_partition(c, prob, "memory: no partition fits even with full recompute" if per_stage
                                   else "memory: no stage partition fits",
                                   Step.PER_STAGE if per_stage else Step.SIMULATE)
            return
        self.bounded += 1
        if per_stage:
            self._next(res.objective, Step.PER_STAGE, c, prob, res)
        else:
            self._next(res.objective, Step.SIMULATE, c, res.stage_layers)

    def _no_partition(self, c: Candidate, prob: PartitionProblem, reason: str, step: Step) -> None:
        """A DP found nothing: infeasible when the greedy memory test or an uncut DP says so, else pruned (no
        partition below the cutoff; one the greedy test missed that does not fit has no bound below it either)."""
        recompute = MEMORY_POLICY[c.recompute]
        if not math.isinf(self.best.cutoff()) and self._may_fit(prob, recompute, c.recompute == "per-stage"):
            self._count(self.pruned, step.pruned_by)
            return
        self._count(self.infeasible, reason)
        self._note_memory(min_stage_overflow(prob, recompute), _describe(c))

    def _per_stage(self, key: float, c: Candidate, prob: PartitionProblem, relaxed: PartitionResult) -> None:
        """One per-stage-recomputation candidate whose relaxed bound beats the cutoff: dominance by no
        recomputation, the cheapest-fitting bound and plan, and CP-SAT (deferred) only where those two do not
        meet."""
        below = self._below(key)  # uniform only matters below `lower`, and `lower` only below `below`
        uniform = self._dp(prob, "none", below=below)
        none_searched = "none" in self.recomputes_searched
        if uniform is not None and uniform.objective <= relaxed.objective * (1 + REL_TOL):
            # recomputing nowhere already reaches the relaxed bound, which no per-stage choice can beat: that plan
            # is this candidate's best, and it is searched as the "none" candidate unless recomputation was pinned
            if none_searched:
                self._count(self.pruned, "dominated: no recompute reaches the per-stage bound")
            else:
                self._simulate(c, uniform.stage_layers, _policies(uniform), uniform.objective, self._context(c))
            return
        lower, plan = per_stage_bound(prob, below=below, deadline=self._limit())
        if plan is None and below < self.best.cutoff():
            self._push(below, Step.PER_STAGE, c, prob, relaxed)  # nothing below `below`: solved again if reached
            return
        if plan is None and math.isinf(self.best.cutoff()):
            self._count(self.infeasible, "memory: no partition fits even with full recompute")
            return
        if plan is None or lower >= self.best.cutoff() * (1 - REL_TOL):
            self._count(self.pruned, "partition bound (cheapest fitting recompute per stage)")
            return
        if uniform is not None and uniform.objective <= lower * (1 + REL_TOL):
            if none_searched:
                self._count(self.pruned, "dominated: no recompute reaches the per-stage bound")
            else:
                self._simulate(c, uniform.stage_layers, _policies(uniform), uniform.objective, self._context(c))
            return
        if plan.objective <= lower * (1 + REL_TOL):  # the heuristic meets the bound: optimal, no CP-SAT
            self._simulate(c, plan.stage_layers, _policies(plan), lower, self._context(c))
            return
        # CP-SAT is the dearest step: it runs after everything else, when the cutoff is the tightest it gets
        self.deferred.append((lower, len(self.deferred), c, prob))

    def _run_cpsat(self, deadline: float | None) -> bool:
        """The deferred per-stage candidates, smallest bound first, through CP-SAT; True when time ran out."""
        self.deferred.sort(key=lambda x: (x[0], x[1]))
        for n, (lower, _, c, prob) in enumerate(self.deferred):
            if lower >= self.best.cutoff() * (1 - REL_TOL):
                self._count(self.pruned, "partition bound (cheapest fitting recompute per stage)",
                            len(self.deferred) - n)
                break
            remaining = None if deadline is None else deadline - cpu_now()
            if remaining is not None and remaining <= 0:
                self.unexplored_bound = min(self.unexplored_bound, lower)
                self._count(self.pruned, "not reached before the time limit", len(self.deferred) - n)
                return True
            self._cpsat(c, prob, lower, remaining)
        self.deferred.clear()
        return False

    def _cpsat(self, c: Candidate, prob: PartitionProblem, bound: float, remaining: float | None) -> None:
        """The candidate's best per-stage plan: every (partition, policy) whose J beats the cutoff simulated when
        they are few (per_stage_partitions_below, which also leaves no gap), else CP-SAT's J-optimal plan."""
        ctx = self._context(c)
        cutoff = self.best.cutoff()
        if not self._listable(c):  # too many layers to list pairs or solve CP-SAT in a search: the bound stays open
            self.open_bounds.append((bound, c, None, None))
            self._count(self.pruned, "per-stage plans of too many layers to solve exactly (bound left open)")
            return
        if not math.isinf(cutoff):
            found = per_stage_partitions_below(prob, cutoff * (1 - REL_TOL), limit=DEFERRED_ENUMERATE_PAIRS)
            if found is not None:
                self.bounded += 1
                simulated = 0
                for lower, bounds, pols in found:
                    if lower >= self.best.cutoff() * (1 - REL_TOL):
                        break
                    layers = tuple(b - a for a, b in pairwise(bounds))
                    self._simulate(c, layers, pols, lower, ctx, another_partition=simulated > 0)
                    simulated += 1
                if not simulated:  # the candidate's one account column
                    self._count(self.pruned, "partition bound (per-stage plans listed: none below the cutoff)")
                return
            if self._pair_dp_fits(c) and per_stage_tight_bound(prob) >= cutoff * (1 - REL_TOL):
                self.bounded += 1
                self._count(self.pruned, "partition bound (per-stage pair and sync paths)")
                return
        optimum = _per_stage_optimum(prob)
        if optimum is not None:  # proven without CP-SAT: the same J-optimum, as CP-SAT's OPTIMAL answer gives it
            self.bounded += 1
            value, layers, pols = optimum
            if value >= self.best.cutoff() * (1 - REL_TOL):
                self._count(self.pruned, "partition bound (per-stage optimum listed)")
            else:
                self._simulate(c, layers, pols, value, ctx)
            return
        self.cpsat_calls += 1
        limit = CPSAT_TIME_LIMIT_S if remaining is None else min(CPSAT_TIME_LIMIT_S, remaining)
        cutoff = self.best.cutoff()
        from meshplan.planner.partition.cpsat import solve_cpsat  # OR-Tools, loaded when a search first needs it

        res, status = solve_cpsat(prob, "per-stage", time_limit_s=limit,
                                  below_s=None if math.isinf(cutoff) else cutoff)
        if res is None:
            if status == "INFEASIBLE" and not math.isinf(cutoff):
                self._count(self.pruned, "partition bound (CP-SAT: nothing fits below the cutoff)")
            elif status == "INFEASIBLE":
                self._count(self.infeasible, "memory: no per-stage policy fits")
            else:  # no answer within the limit: the bound stays open
                self.open_bounds.append((bound, c, None, None))
                self._count(self.pruned, f"CP-SAT {status.lower()} within its time limit")
            return
        proven = status == "OPTIMAL"
        if res.objective >= self.best.cutoff() * (1 - REL_TOL):
            if not proven:
                self.open_bounds.append((bound, c, None, None))
            self._count(self.pruned, "partition bound (CP-SAT)")
            return
        self._simulate(c, res.stage_layers, _policies(res), res.objective if proven else bound, ctx)

    def _close_per_stage_gap(self, c: Candidate, prob: PartitionProblem, ctx: CostContext, stage_layers, policies,
                             best: float) -> bool:
        """Simulate every (partition, per-stage policy) of a per-stage candidate whose J is below the best plan
        (planner/partition/bounds.py per_stage_partitions_below), which closes its gap; False when they are too many."""
        if not self._listable(c):
            return False
        found = per_stage_partitions_below(prob, best * (1 - REL_TOL), limit=ENUMERATE_PARTITIONS)
        if found is None:
            return False
        self.bounded += 1
        for lower, bounds, pols in found:
            if lower >= self.best.ranked()[0].step_time_s * (1 - REL_TOL):
                break
            layers = tuple(b - a for a, b in pairwise(bounds))
            if (layers, pols) != (stage_layers, policies):
                self._simulate(c, layers, pols, lower, ctx, another_partition=True)
        return True

    def _close_gaps(self, deadline: float | None) -> bool:
        """Where a candidate's simulated time exceeds its J bound and the bound is below the best plan: simulate
        every partition whose bound is below the best when there are few (partitions_below), which closes the gap;
        else try its even split, and replace J by the larger of two tighter bounds (planner/partition/bounds.py): the
        1F1B pair chain (solve_dp_pairs, whose own best partition is simulated when it differs) and rank 0's sync
        after the whole backward flow (solve_stage0_sync, likewise). True when the time limit stopped it."""
        still_open = []
        pending = sorted(self.open_bounds, key=lambda x: x[0])
        for n, (bound, c, stage_layers, policies) in enumerate(pending):
            best = self.best.ranked()[0].step_time_s if self.best.heap else math.inf
            late = deadline is not None and cpu_now() > deadline
            tried = (c, stage_layers, policies) in self.gaps_tried  # a second call takes only the new bounds
            if bound >= best * (1 - REL_TOL) or late or c.vpp > 1 or tried:
                still_open.append((bound, c, stage_layers, policies))
                continue
            try:
                self.gaps_tried.add((c, stage_layers, policies))
                ctx = self._context(c)
                prob = self.problem(c, ctx)
                if c.recompute == "per-stage" or policies is not None:
                    if not self._close_per_stage_gap(c, prob, ctx, stage_layers, policies, best):
                        # too many partitions to list: the pair / sync path bounds, each stage on its cheapest
                        # fitting policy
                        tighter = bound
                        if self._pair_dp_fits(c):
                            self.bounded += 1
                            tighter = max(bound, per_stage_tight_bound(prob))
                        if tighter < best * (1 - REL_TOL):
                            still_open.append((tighter, c, stage_layers, policies))
                    continue
                parts = partitions_below(prob, c.recompute, best * (1 - REL_TOL), limit=ENUMERATE_PARTITIONS) \
                    if self._listable(c) else None
                if parts is not None:  # every partition that could beat the best: simulate them, and the gap is closed
                    self.bounded += 1
                    for lower, bounds in parts:
                        layers = tuple(b - a for a, b in pairwise(bounds))
                        if lower >= self.best.ranked()[0].step_time_s * (1 - REL_TOL):
                            break
                        if layers != stage_layers:
                            self._simulate(c, layers, None, lower, ctx, another_partition=True)
                    continue
                balanced = resolve(self.model, self.cluster.num_gpus, self.wl, self._config(c)).stage_layers
                if balanced != stage_layers:  # the even split is a partition too: it may simulate faster
                    self._simulate(c, balanced, None, bound, ctx, another_partition=True)
                if c.schedule == "zb" or not self._pair_dp_fits(c):
                    still_open.append((bound, c, stage_layers, policies))
                    continue
                res = solve_dp_pairs(prob, c.recompute)
                self.bounded += 1
                if res is None:
                    continue
                if res.stage_layers != stage_layers and res.objective < self.best.cutoff() * (1 - REL_TOL):
                    self._simulate(c, res.stage_layers, None, res.objective, ctx, another_partition=True)
                # both are lower bounds over every partition, so the larger one is too
                sync = solve_stage0_sync(prob, c.recompute)
                if (sync is not None and sync.stage_layers not in (stage_layers, res.stage_layers)
                        and sync.objective < self.best.cutoff() * (1 - REL_TOL)):
                    self._simulate(c, sync.stage_layers, None, sync.objective, ctx, another_partition=True)
                # rank 0's path to every rank's sync (1F1B), likewise: its own partition simulated when it differs
                path = solve_rank0_path_sync(prob, c.recompute) if c.schedule == "1f1b" else None
                if (path is not None and path.stage_layers not in (stage_layers, res.stage_layers)
                        and path.objective < self.best.cutoff() * (1 - REL_TOL)):
                    self._simulate(c, path.stage_layers, None, path.objective, ctx, another_partition=True)
                tighter = max(res.objective, sync.objective if sync is not None else math.inf,
                              path.objective if path is not None else -math.inf)
                still_open.append((tighter, c, res.stage_layers, None))
            except TimeLimitReached:  # the limit stopped this one midway: it and the rest stay open
                self.open_bounds = still_open + pending[n:]
                return True
        self.open_bounds = still_open
        return False

    def _simulate(self, c: Candidate, stage_layers, policies, bound: float, ctx: CostContext,
                  another_partition: bool = False, chunks: tuple[int, ...] | None = None) -> None:
        """Simulate one candidate with the given partition and rank it. Each candidate lands in exactly one
        account column: evaluated (ranked), infeasible (over memory once simulated) or pruned (a ZeRO-only tie).
        another_partition: a further partition of a candidate already counted (closing a gap): no new count."""
        cfg = self._config(c, stage_layers, policies, chunks)
        sim = simulate_config(self.model, self.cluster, self.wl, cfg, self.runtime, self.eff, context=ctx,
                              timelines=self.timelines, deadline=self._limit())
        est = sim.estimate
        if est.peak_memory_gib * GIB > self.cap:
            if not another_partition:
                self._count(self.infeasible, "memory: simulated peak over HBM" if self.memory_share == 1 else
                            f"memory: simulated peak over {100 * self.memory_share:.0f} % of HBM")
            self._note_memory(est.peak_memory_gib * GIB, _describe(c))
            return
        tight = est.step_time_s <= bound * (1 + 1e-6)
        status: PartitionStatus = "optimal" if (tight or c.vpp > 1) else "bound gap"
        if not tight and c.vpp == 1 and not another_partition:
            self.open_bounds.append((bound, c, stage_layers, policies))
        ranked = est.step_time_s
        if self.ranking.kind != "expected":  # the slow end: the step time times its region's factor
            ranked *= self.ranking.factor(region_of(self.model, est.layout, self.wl, self.cluster.spec.gpu,
                                                    self.cluster.gpus_per_node, self.runtime))
        kept = self.best.add(RankedPlan(c, cfg, sim, bound if c.vpp == 1 else est.step_time_s, status, ranked))
        if another_partition:
            return
        if kept:
            self.evaluated += 1
        else:
            self._count(self.pruned, "tie: a kept plan differs only in its ZeRO stage")

    def result(self, seconds: float, timed_out: bool) -> SearchResult:
        plans = tuple(self.best.ranked())
        if not plans:
            if timed_out:
                acc = self._account(seconds, "time-limit", math.nan, self.unexplored_bound * self.best.floor)
                return SearchResult((), acc, f"no plan was evaluated within the time limit ({seconds:.2f} s); "
                                             f"raise --time-limit or pin more knobs")
            acc = self._account(seconds, "infeasible", math.nan, math.nan)
            return SearchResult((), acc, self._why_nothing_fits())
        best, floor = plans[0].ranked_s, self.best.floor
        lows = [b * floor for b, _, _, _ in self.open_bounds if b * floor < best] + [self.unexplored_bound * floor]
        low = min([best] + lows)
        gap = max(0.0, (best - low) / best)
        status: SearchStatus = "time-limit" if timed_out else ("optimal" if gap <= 1e-6 else "gap")
        return SearchResult(plans, self._account(seconds, status, gap, low), None)

    def _account(self, seconds: float, status: SearchStatus, gap: float, low: float) -> SearchAccount:
        return SearchAccount(self.enum.space_size, self.evaluated, self.bounded, dict(self.pruned),
                             dict(self.infeasible), seconds, status, gap, low, dict(self.enum.domains),
                             self.cpsat_calls, self.ranking.kind, self.memory_share)

    def _why_nothing_fits(self) -> str:
        model, n = self.model, self.cluster.num_gpus
        hbm = self.cluster.gpu.hbm_gib.value
        if not self.enum.groups:
            rules = ", ".join(f"{k} ({v})" for k, v in sorted(self.infeasible.items(), key=lambda x: -x[1])[:3])
            if not rules:
                return f"no configuration of {n} GPUs passes the divisibility rules with these pins; unpin some"
            return f"no configuration of {n} GPUs passes the divisibility rules: {rules}"
        need = _gpus_needed(model, hbm * self.memory_share, self.cluster.gpus_per_node)
        closest = ""
        if self.closest_memory is not None:
            closest = f"; the closest candidate ({self.closest_memory[1]}) needs {self.closest_memory[0] / GIB:.1f} GiB"
        states = (f"the model states alone (weights, gradients, Adam: 18 bytes per parameter, "
                  f"{model.total_params() / 1e9:.1f}B parameters) need {model.total_params() * 18 / GIB:.0f} GiB")
        if need > n:
            advice = f"{states}, so >= {need} GPUs even fully sharded; use more GPUs"
        else:
            advice = (f"{states}, which {n} GPUs could hold fully sharded, so the activations are what does not fit: "
                      f"use a smaller --seq or --gbs, more GPUs, or unpin --mbs/--recompute/--zero/--pp")
        room = f"{hbm:g} GiB" if self.memory_share == 1 else (
            f"{hbm * self.memory_share:.1f} GiB ({100 * self.memory_share:.0f} % of {hbm:g}, so that the memory "
            f"model's high end fits: --memory sure; --memory estimate allows all of it)")
        return f"nothing fits in {room} per GPU on {n} GPUs{closest}; {advice}"


def _policies(res: PartitionResult) -> tuple[StagePolicy, ...]:
    return tuple(res.policies)


def _per_stage_optimum(prob: PartitionProblem) -> tuple[float, tuple[int, ...], tuple[StagePolicy, ...]] | None:
    """(J, stage layers, policies) of the J-optimal per-stage plan without CP-SAT, or None when it cannot be had
    cheaply: the heuristic plan of per_stage_bound (each stage on its cheapest fitting policy) is optimal when no
    (partition, policy) pair has a smaller J, and the fewest pairs under it are few to list (CP-SAT can take
    seconds to prove a start that is already optimal; this takes a tenth of one)."""
    _, plan = per_stage_bound(prob)
    if plan is None:
        return None
    under = per_stage_partitions_below(prob, plan.objective * (1 - REL_TOL), limit=DEFERRED_ENUMERATE_PAIRS)
    if under is None:
        return None
    if not under:
        return plan.objective, tuple(plan.stage_layers), _policies(plan)
    value, bounds, pols = under[0]  # smallest J first
    return value, tuple(b - a for a, b in pairwise(bounds)), tuple(pols)


def _entries(step: Step, payload: tuple) -> int:
    """How many candidates a queue entry stands for (a group: all of its own)."""
    return payload[0].size() if step in (Step.GROUP, Step.GROUP_FITTED) else 1


def _describe(c: Candidate) -> str:
    m = c.mesh
    return (f"tp={m.tp} cp={m.cp} pp={m.pp} dp={m.dp}" + (f" ep={m.ep}" if m.ep > 1 else "")
            + f" mbs={c.mbs} zero={c.zero}")


def min_stage_overflow(prob: PartitionProblem, recompute: str) -> float:
    """The balanced partition's fullest stage (bytes), to say how far from fitting a candidate is."""
    p = prob.num_stages
    act = {"none": prob.layer_act_none, "selective": prob.layer_act_selective}.get(recompute, prob.layer_act_full)
    per = (sum(prob.layer_state_bytes) + prob.first_state_bytes + prob.last_state_bytes) / p
    held = prob.num_microbatches if prob.schedule == "gpipe" else min(p, prob.num_microbatches)
    return (per + held * sum(act) / p + prob.fixed_bytes + prob.last_fixed_bytes / p) * (1 + prob.fragmentation)


def _gpus_needed(model: ModelSpec, hbm_gib: float, per_node: int) -> int:
    """GPUs whose memory holds the model states fully sharded (18 bytes per parameter), rounded up to nodes."""
    need = math.ceil(model.total_params() * 18 / (hbm_gib * GIB * (1 - 0.1)))
    if need > per_node:
        need = math.ceil(need / per_node) * per_node
    return max(1, need)
