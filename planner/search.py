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

import dataclasses
import heapq
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from meshplan.costmodels.config import (DEFAULT_RECOMPUTE_MODULES, DEFAULT_RUNTIME, ParallelConfig, StagePolicy,
                                        Workload, get_runtime, resolve, split_evenly)
from meshplan.costmodels.deadline import Deadline, TimeLimitReached
from meshplan.costmodels.estimate import (CostContext, Efficiency, Estimate, GroupLinks, PassCache, buffer_bytes,
                                          fp8_weight_cast_s, model_flops_per_step, simulate_config, stage_p2p_s,
                                          stage_ranges, with_recompute_fb)
from meshplan.costmodels.kernels import CONTENTION_SM, overlapped_exposed
from meshplan.costmodels.memory import (FRAGMENTATION, GIB, StageParams, embedding_activation_bytes,
                                        layer_activation_bytes, logits_bytes, model_state_bytes, mtp_activation_bytes,
                                        stage_params)
from meshplan.costmodels.model import ModelSpec
from meshplan.hardware_db.cluster import Cluster
from meshplan.hardware_db.errors import InputError
from meshplan.planner.partition import (PartitionProblem, PartitionResult, SyncModel, dp_bound, may_fit,
                                        partitions_below, per_stage_bound, per_stage_partitions_below,
                                        per_stage_tight_bound, solve_cpsat, solve_dp, solve_dp_pairs,
                                        solve_rank0_path_sync, solve_stage0_sync)
from meshplan.planner.space import (Candidate, Enumeration, Group, LayerKey, Mesh, Pins, check_pins, enumerate_space,
                                    interleaved_chunks)

REL_TOL = 1e-9  # two step times closer than this (relative) are equal
LOOKAHEAD = 0.1  # a DP solves exactly only below (1 + this) x its step's queue key; above, it is queued again there
UNBOUNDED_BYTES = 1e30  # a memory cap no stage reaches (bounds that ignore memory)
QUICK_SAMPLE_GROUPS = 256  # under a time limit: about this many groups, a stride through them all, searched first
SCORE_CHUNK_GROUPS = 512  # under a time limit: the other groups scored this many at a time between checks
CPSAT_TIME_LIMIT_S = 10.0  # per CP-SAT call; an unproven answer leaves its candidate's bound open (a gap)
PAIR_DP_MAX_CELLS = 2e7  # the O(p L^3) pair and stage-0 sync bounds are tried only below this size
QUICK_PLAN_MIN_CELLS = 2**20  # under a time limit, a first plan is an even split where p (L+1)^2 exceeds this
LIST_MAX_CELLS = 2**22  # partitions are listed (and per-stage plans solved exactly) only where p (L+1)^2 is below this
ENUMERATE_PARTITIONS = 32  # closing a gap: simulate every partition below the best when there are at most this many
# a deferred per-stage candidate: simulate every (partition, policy) pair below the cutoff instead of CP-SAT when
# there are at most this many (each simulation is far cheaper than a CP-SAT solve)
DEFERRED_ENUMERATE_PAIRS = 4 * ENUMERATE_PARTITIONS


@dataclass(frozen=True)
class RankedPlan:
    """One simulated candidate: its knobs, the partitioner's bound for it and the full estimate."""

    candidate: Candidate
    config: ParallelConfig
    estimate: Estimate
    bound_s: float  # lower bound on this candidate's step time over all partitions
    partition_status: str  # "optimal" (simulated == bound), or "bound gap"

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
    status: str  # "optimal" | "gap" | "time-limit" | "infeasible"
    gap: float  # proven relative gap of the best plan (0 when optimal)
    lower_bound_s: float  # no candidate in the space is faster than this
    domains: dict[str, str]
    cpsat_calls: int


@dataclass(frozen=True)
class SearchResult:
    plans: tuple[RankedPlan, ...]  # best first
    account: SearchAccount
    why_nothing_fits: str | None  # set when plans is empty


ProgressFn = Callable[[int, int], None]  # (done, total) over candidate groups


@dataclass
class _Best:
    """The K best simulated plans (a max-heap on time) and the cutoff a bound must beat."""

    k: int
    heap: list[tuple] = field(default_factory=list)
    counter: int = 0

    def cutoff(self) -> float:
        return -self.heap[0][0] if len(self.heap) >= self.k else math.inf

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
                    and abs(other.step_time_s - plan.step_time_s) <= REL_TOL * plan.step_time_s):
                return False
        self.counter += 1
        lay = plan.estimate.layout
        # ties (equal predicted time) go to the simpler plan: no CP, lower ZeRO, then less memory
        item = (-plan.step_time_s, -lay.cp, -lay.zero, -plan.estimate.peak_memory_gib, -self.counter, plan)
        if len(self.heap) < self.k:
            heapq.heappush(self.heap, item)
        elif item[:-1] > self.heap[0][:-1]:
            heapq.heapreplace(self.heap, item)
        return True

    def ranked(self) -> list[RankedPlan]:
        return [x[-1] for x in sorted(self.heap, key=lambda x: tuple(-v for v in x[:-1]))]


def search(model: ModelSpec, cluster: Cluster, wl: Workload, pins: Pins = Pins(), runtime: str = DEFAULT_RUNTIME,
           efficiency: Efficiency | None = None, top_k: int = 10, time_limit_s: float | None = None,
           progress: ProgressFn | None = None) -> SearchResult:
    """The top_k plans by predicted step time, and the account of the search (see the module docstring)."""
    if top_k < 1:
        raise InputError("--top must be at least 1")
    rt = get_runtime(runtime)
    check_pins(model, cluster.num_gpus, wl, pins, rt)
    start = time.perf_counter()
    eff = efficiency or Efficiency.from_gpu(cluster.gpu)
    enum = enumerate_space(model, cluster.num_gpus, cluster.gpus_per_node, wl, pins, rt)
    s = _Search(model, cluster, wl, rt.name, eff, enum, top_k, pins.recompute_modules)
    deadline = None if time_limit_s is None else start + time_limit_s
    timed_out = s.run(deadline, progress)
    return s.result(time.perf_counter() - start, timed_out)


class _Search:
    def __init__(self, model: ModelSpec, cluster: Cluster, wl: Workload, runtime: str, eff: Efficiency,
                 enum: Enumeration, top_k: int, modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES):
        self.model, self.cluster, self.wl, self.runtime, self.eff, self.enum = model, cluster, wl, runtime, eff, enum
        self.modules = modules  # what selective recomputation re-runs (Pins.recompute_modules)
        self.rt = get_runtime(runtime)
        self.best = _Best(top_k)
        self.cap = cluster.gpu.hbm_gib.value * GIB
        self.pruned: dict[str, int] = {}
        self.infeasible: dict[str, int] = dict(enum.infeasible)
        self.evaluated = self.bounded = self.cpsat_calls = 0
        # simulated candidates whose time exceeds their bound: another partition might be faster
        self.open_bounds: list[tuple[float, Candidate, tuple[int, ...] | None, tuple | None]] = []
        self.unexplored_bound = math.inf  # smallest bound left when a time limit stopped the search
        self.contexts: dict[tuple, CostContext] = {}
        self.state_bytes: dict[tuple, tuple[float, float, float]] = {}
        self.fits: dict[tuple, bool] = {}
        self.sp_dominance: dict = {}
        self.layer_memory: dict[tuple, tuple[float, float, float]] = {}
        self.passes = PassCache(model, cluster, wl, self.rt, eff)  # block passes shared by every context
        self.closest_memory: tuple[float, str] | None = None  # the smallest memory excess seen, for "nothing fits"
        self.problems: dict[int, PartitionProblem] = {}
        self.dp_results: dict[tuple, PartitionResult | None] = {}
        self.mesh_links: dict[Mesh, dict] = {}
        self.states_floors: dict[tuple[Mesh, int], float] = {}
        self.hops: dict[tuple[Mesh, int], float] = {}
        self.rank_contents: dict[tuple, tuple] = {}
        self.work_bounds: dict[tuple, tuple[float, float]] = {}
        self.layer_parts: dict[tuple, tuple] = {}  # per layer key: each layer kind's (forward, backward, selective)
        self.family_bounds: dict[tuple, float] = {}
        self.interleaved_bounds: dict[tuple, list] = {}  # per mesh/mbs/...: each split's per-rank paths
        self.chunk_kinds: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        self.timelines: dict[tuple, object] = {}  # simulated pipelines by their stage times  # by id of a context held in self.contexts
        self.recomputes_searched = {r for g in enum.groups for r in g.recomputes}
        self.pp_values = sorted({g.mesh.pp for g in enum.groups})
        self.layer_kind_list = [model.is_moe_layer(i) for i in range(model.num_layers)]
        self.layer_kinds = {kind: self.layer_kind_list.index(kind) for kind in dict.fromkeys(self.layer_kind_list)}
        self.moe_prefix = [0]
        for i in range(model.num_layers):
            self.moe_prefix.append(self.moe_prefix[-1] + int(model.is_moe_layer(i)))
        self.queue: list[tuple[float, int, str, tuple]] = []  # the search's steps by lower bound (see run)
        self.seq = 0
        self.eager = False  # see _next
        self.expanded = 0  # candidate groups expanded (the progress bar's count)
        self.deferred: list[tuple[float, int, Candidate, PartitionProblem]] = []  # per-stage candidates for CP-SAT
        self.gaps_tried: set[tuple] = set()  # open bounds _close_gaps has worked on
        self.deadline: float | None = None  # the time limit's perf_counter() end (see run and _limit)

    # ---- bookkeeping
    def _count(self, table: dict[str, int], reason: str, n: int = 1) -> None:
        if n:
            table[reason] = table.get(reason, 0) + n

    def _note_memory(self, need_bytes: float, what: str) -> None:
        if self.closest_memory is None or need_bytes < self.closest_memory[0]:
            self.closest_memory = (need_bytes, what)

    # ---- costs
    def _config(self, cand: Candidate, stage_layers: tuple[int, ...] | None = None,
                policies: tuple[StagePolicy, ...] | None = None,
                chunks: tuple[int, ...] | None = None) -> ParallelConfig:
        m = cand.mesh
        uniform = cand.recompute if cand.recompute != "per-stage" else "none"
        if chunks is None and cand.vpp > 1 and stage_layers is None:  # the first virtual-stage split searched
            chunks = interleaved_chunks(self.model.num_layers, m.pp, cand.vpp)[0]
        return ParallelConfig(tp=m.tp, pp=m.pp, vpp=cand.vpp, dp=m.dp, cp=m.cp, cp_comm=cand.cp_comm, ep=m.ep,
                              etp=m.etp, mbs=cand.mbs, zero=cand.zero, recompute=uniform, sp=cand.sp,
                              schedule=cand.schedule, stage_layers=stage_layers, stage_recompute=policies,
                              chunk_layers=chunks, rank_order=m.order, recompute_modules=cand.modules)

    def _context(self, cand: Candidate) -> CostContext:
        """Per-layer costs are shared by every candidate with the same layer key; links by the same mesh."""
        key = (cand.mesh, cand.mbs, cand.sp, cand.cp_comm, cand.zero, cand.schedule, cand.vpp)
        ctx = self.contexts.get(key)
        if ctx is None:
            lay = resolve(self.model, self.cluster.num_gpus, self.wl, self._config(cand))
            ctx = CostContext(self.model, self.cluster, self.wl, lay, self.rt, self.eff,
                              links=self._links(cand.mesh), passes=self.passes)
            # ZeRO-2/3's layer times hold per-layer DP collectives (CostContext._sharded_dp_passes)
            layers_key = ("layers", cand.layer_key, (cand.mesh, cand.zero) if ctx.dp_in_layer_times else None)
            shared = self.contexts.get(layers_key)
            if shared is not None:
                ctx.share_layer_cache(shared)
            else:
                self.contexts[layers_key] = ctx
            self.contexts[key] = ctx
        return ctx

    def problem(self, cand: Candidate, ctx: CostContext) -> PartitionProblem:
        """The partitioner's view of one candidate, with every number read from the estimator's CostContext.
        Shared by the candidates that differ only in recomputation (cached on the context)."""
        cached = self.problems.get(id(ctx))
        if cached is not None:
            return cached
        model, lay, wl, rt = self.model, ctx.lay, self.wl, self.rt
        unsharded = rt.holds_unsharded_grads(lay.zero, lay.pp)
        per_type: dict[bool, tuple] = {}
        for kind, i in self.layer_kinds.items():  # layers of one kind cost the same
            base = ctx.layer_times(i, "none")
            params = ctx.layer_params(i)
            per_type[kind] = (
                base.forward, base.backward_input + base.bwd_weight_compute,
                ctx.layer_times(i, "selective").recompute, ctx.layer_times(i, "full").recompute,
                sum(model_state_bytes(params, lay, unsharded)), ctx.layer_activation(i, "none"),
                ctx.layer_activation(i, "selective"), ctx.layer_activation(i, "full"), params.dense, params.expert)
        rows = [per_type[kind] for kind in self.layer_kind_list]
        f, b, sel, full, state, a_none, a_sel, a_full, p_dense, p_expert = (tuple(col) for col in zip(*rows))
        first = stage_params(model, lay, range(0), True, False)
        last = stage_params(model, lay, range(0), False, True)
        emb, head = ctx.embedding, ctx.head
        prob = PartitionProblem(
            num_stages=lay.pp, num_microbatches=lay.num_microbatches, schedule=lay.schedule,
            layer_forward=tuple(f), layer_backward=tuple(b), layer_selective_extra=tuple(sel),
            layer_full_extra=tuple(full), layer_state_bytes=tuple(state), layer_act_none=tuple(a_none),
            layer_act_selective=tuple(a_sel), layer_act_full=tuple(a_full), layer_params_dense=tuple(p_dense),
            layer_params_expert=tuple(p_expert),
            first_forward=emb.forward, first_backward=emb.backward_input + emb.bwd_weight_compute,
            first_state_bytes=sum(model_state_bytes(first, lay, unsharded)),
            first_act_bytes=embedding_activation_bytes(model, lay, wl, rt), first_params_dense=first.dense,
            last_forward=head.forward, last_backward=head.backward_input + head.bwd_weight_compute,
            last_state_bytes=sum(model_state_bytes(last, lay, unsharded)), last_fixed_bytes=logits_bytes(model, lay, wl, rt) + mtp_activation_bytes(model, lay, wl, rt),
            last_params_dense=last.dense,
            stage_forward_extra=ctx.blocking_p2p_s, stage_backward_extra=ctx.blocking_p2p_s, hop_s=ctx.p2p_s,
            fixed_bytes=ctx.buffer_bytes, fragmentation=FRAGMENTATION, memory_cap_bytes=self.cap,
            sync=SyncModel(**self._step_end_sync(ctx), overlap_reduce=rt.overlap_grad_reduce,
                           overlap_gather=rt.overlap_param_gather,
                           contention=CONTENTION_SM if self.eff.physics.contention else 0.0,
                           overlap_leaves_one_layer=self.eff.physics.overlap_limits),
        )
        self.problems[id(ctx)] = prob
        return prob

    @staticmethod
    def _step_end_sync(ctx: CostContext) -> dict[str, float]:
        """The context's DP sync coefficients as the partitioner sees them after a stage's last backward: without
        the gradient reduce where each micro-batch's backward reduce-scatters (in the layer times; what is left,
        the edges' gradients and the last bucket, is left out, so the partition's objective stays a bound)."""
        coef = dict(vars(ctx.sync))
        if ctx.reduce_in_backward:
            for name in ("reduce_alpha_dense", "reduce_beta_dense", "reduce_alpha_expert", "reduce_beta_expert"):
                coef[name] = 0.0
        return coef

    def _dp(self, prob: PartitionProblem, policy: str, relaxed: bool = False,
            below: float = math.inf) -> PartitionResult | None:
        """solve_dp, once per problem and policy (a candidate's ZeRO-free per-stage twin reuses its "none" DP): the
        optimum when it is below `below`, else None (also when nothing fits)."""
        key = (id(prob), policy, relaxed)  # problems live in self.problems, so their ids stay theirs
        res, solved_below = self.dp_results.get(key, (None, -math.inf))
        if res is None and solved_below < below:  # None: nothing below solved_below (res is exact otherwise)
            res = solve_dp(prob, policy, relaxed=relaxed, below=below, deadline=self._limit())
            self.dp_results[key] = (res, below)
        return res if res is not None and res.objective < below else None

    def _may_fit(self, prob: PartitionProblem, policy: str, relaxed: bool) -> bool:
        """may_fit, once per problem and policy (a candidate queued again asks again)."""
        key = (id(prob), "relaxed" if relaxed else policy)
        if key not in self.fits:
            self.fits[key] = may_fit(prob, policy, relaxed=relaxed)
        return self.fits[key]

    def _below(self, key: float) -> float:
        """Where a DP popped at queue key `key` need be exact: the cutoff, or (1 + LOOKAHEAD) x key when that is
        lower (a DP restricted to stages that can finish below it is several times cheaper; what it cannot place
        below it goes back to the queue with that as its key, a lower bound, and is solved again if reached)."""
        return min(self.best.cutoff(), key * (1 + LOOKAHEAD))

    # ---- bounds
    def states_floor(self, g: Group) -> float:
        """Bytes per GPU the model states need at the least (under the highest ZeRO stage searched), averaged over
        stages: no partition can put less on its fullest stage."""
        model, m = self.model, g.mesh
        key = (m, max(g.zeros))  # groups differ from their mesh's others only in the micro-batch size
        if key not in self.states_floors:
            # the highest ZeRO stage searched shards the most: the least states any candidate of the group needs
            lay = _FloorLayout(tp=m.tp, pp=m.pp, dp=m.dp, cp=m.cp, ep=m.ep, etp=m.etp, edp=m.edp, zero=max(g.zeros))
            total = stage_params(model, lay, range(model.num_layers), True, True)  # type: ignore[arg-type]
            self.states_floors[key] = sum(model_state_bytes(total, lay)) / m.pp  # type: ignore[arg-type]
        return self.states_floors[key]

    def work_bound(self, cand: Candidate) -> float:
        """A lower bound on the step time of every stage partition of this candidate (see pipeline_floor)."""
        return float(self.work_bounds_of([cand])[0])

    def work_bounds_of(self, cands: list[Candidate]) -> np.ndarray:
        """work_bound of many candidates in one vectorised pipeline_floors call (a group's expansion, or its
        variants for the group score). Reads only per-layer costs (shared by every candidate with the same layer
        key); blocking P2P, which depends on where the pipeline ranks sit, is left out (so the bound stays a
        bound)."""
        gbs = self.wl.global_batch
        return self._work_bounds([(self._key_costs(c.mesh, c.mbs, c.sp, c.cp_comm, c.recompute),
                                   gbs // (c.mbs * c.mesh.dp), c.mesh.pp, c.schedule, self._hop(c.mesh, c.mbs))
                                  for c in cands])

    def _work_bounds(self, rows: list[tuple]) -> np.ndarray:
        """pipeline_floors over rows of (key costs, micro-batches, pp, schedule, hop)."""
        costs = [row[0] for row in rows]
        self._stage_floors(costs)
        total, alpha, layers, layer_min, head = (np.array([k[n] for k in costs]) for n in range(5))
        p = np.array([row[2] for row in rows])
        stage_min = np.array([row[0][6][row[2]] for row in rows])
        return pipeline_floors(total, alpha, np.array([row[1] for row in rows]), p, np.array([row[3] for row in rows]),
                               layers, layer_min, head, np.array([row[4] for row in rows]), stage_min)

    def _key_costs(self, m: Mesh, mbs: int, sp: bool, cp_comm: str, recompute: str) -> list:
        """(one micro-batch through every block, the smallest forward share, layers, the fastest layer, the head
        block, the layers' times, heaviest_stage_floors) for a layer key and recomputation: the blocks' times do not
        depend on pp, dp, ZeRO or schedule."""
        rec = "none" if recompute == "per-stage" else recompute
        key = (m.tp, m.cp, cp_comm, sp, mbs, m.ep, m.etp, rec)  # the layer key's fields, as a tuple
        found = self.work_bounds.get(key)
        if found is None:
            parts = self.layer_parts.get(key[:-1])  # every recompute mode's layer times from one lookup
            if parts is None:
                lay = LayerKey(m.tp, m.cp, cp_comm, sp, mbs, m.ep, m.etp)  # it has every field the blocks read
                links = self._links(m)
                parts = self.layer_parts[key[:-1]] = (
                    [self.passes.layer_parts(i, lay, links) for i in self.layer_kinds.values()],
                    self.passes.edges_fb(lay, links))
            found = self.work_bounds[key] = self._costs_of([with_recompute_fb(x, rec) for x in parts[0]], parts[1])
        return found

    def _sharded_key_costs(self, c: Candidate, ctx: CostContext) -> list:
        """_key_costs with the layer times of the candidate's context, which hold ZeRO-2/3's per-layer DP
        collectives (CostContext._sharded_dp_passes): they depend on the DP groups, so per mesh and ZeRO stage."""
        rec = "none" if c.recompute == "per-stage" else c.recompute
        key = (c.layer_key, rec, c.mesh, c.zero)
        found = self.work_bounds.get(key)
        if found is None:
            times = [ctx.layer_times(i, rec) for i in self.layer_kinds.values()]
            edges = [(t.forward, t.backward_input + t.bwd_weight_compute) for t in (ctx.embedding, ctx.head)]
            found = self.work_bounds[key] = self._costs_of(
                [(t.forward, t.backward_input + t.bwd_weight_compute) for t in times], edges)
        return found

    def _costs_of(self, layer_fb: list[tuple[float, float]], edges_fb) -> list:
        """The key costs' list (see _key_costs) from each layer kind's and the two edge blocks' (forward,
        backward)."""
        n_moe = self.moe_prefix[-1]
        passes = [(f, b, n_moe if kind else self.model.num_layers - n_moe)
                  for (f, b), kind in zip(layer_fb, self.layer_kinds)]
        passes = [x for x in passes if x[2]] + [(*fb, 1) for fb in edges_fb]
        alpha = min(f / (f + b) for f, b, _ in passes if f + b > 0)
        layers = sorted([t for f, b, n in passes[:-2] for t in [f + b] * n], reverse=True)
        return [sum(n * (f + b) for f, b, n in passes), alpha, len(layers), layers[-1],
                passes[-1][0] + passes[-1][1], layers, None]  # the stage floors: _stage_floors

    def _stage_floors(self, costs: list) -> None:
        """Fill in heaviest_stage_floors of the layer keys that lack them, all in one vectorised call."""
        todo = list({id(k): k for k in costs if k[6] is None}.values())
        if todo:
            for k, floors in zip(todo, heaviest_stage_floors(np.array([k[5] for k in todo]), self.pp_values)):
                k[6] = floors

    def _links(self, m: Mesh) -> GroupLinks:
        """The mesh's group links (read lazily off the cluster), shared by every context of the mesh."""
        links = self.mesh_links.get(m)
        if links is None:
            lay = _MeshLayout(tp=m.tp, cp=m.cp, dp=m.dp, pp=m.pp, ep=m.ep, etp=m.etp, edp=m.edp, mbs=1,
                              rank_order=m.order)
            links = self.mesh_links[m] = GroupLinks(self.cluster, lay)  # type: ignore[arg-type]
        return links

    def _hop(self, m: Mesh, mbs: int) -> float:
        """P2P latency between neighbouring stages of this mesh (CostContext.p2p_s, without building a context)."""
        key = (m, mbs)
        if key not in self.hops:
            lay = _MeshLayout(tp=m.tp, cp=m.cp, dp=m.dp, pp=m.pp, ep=m.ep, etp=m.etp, edp=m.edp, mbs=mbs,
                              rank_order=m.order)
            self.hops[key] = stage_p2p_s(self.model, self.wl, lay, self._links(m)["pp"], self.eff)  # type: ignore[arg-type]
        return self.hops[key]

    def _family_bound(self, c: Candidate, prob: PartitionProblem, below: float) -> float:
        """The DP optimum with no memory cap and no DP-sync or optimizer time: a bound for every ZeRO stage of
        this candidate whose layer times hold no DP collectives (they differ only in memory and sync; ZeRO-2/3 with
        per-layer collectives get their own), and with no recomputation for per-stage too. Exact
        when below `below`; otherwise `below`, a lower bound."""
        rec = "none" if c.recompute == "per-stage" else c.recompute
        # ZeRO-2/3's per-layer DP collectives are in the layer times: their own bound, not shared
        key = (c.mesh, c.mbs, c.sp, c.cp_comm, c.schedule, rec, c.zero if self._context(c).dp_in_layer_times else None)
        value, solved_below = self.family_bounds.get(key, (math.inf, -math.inf))
        if value >= solved_below and solved_below < below:
            free = dataclasses.replace(prob, memory_cap_bytes=UNBOUNDED_BYTES, sync=SyncModel.zero())
            value, solved_below = dp_bound(free, rec, below=below, deadline=self._limit()), below
            self.family_bounds[key] = (value, solved_below)
        return value if value < solved_below else solved_below

    def _kind_counts(self, first: int, count: int) -> dict[bool, int]:
        """Dense and MoE layers in [first, first + count), from the MoE prefix count (no loop over layers)."""
        n_moe = self.moe_prefix[first + count] - self.moe_prefix[first]
        return {True: n_moe, False: count - n_moe}

    def _chunk_times(self, ctx: CostContext, mode: str) -> list[list[tuple[float, float]]]:
        """(forward, backward) seconds per micro-batch of every model chunk, per rank (as simulate_config sums:
        layers of one kind cost the same)."""
        lay = ctx.lay
        per = {}
        for kind, i in self.layer_kinds.items():
            t = ctx.layer_times(i, mode)
            per[kind] = (t.forward, t.backward_input + t.bwd_weight_compute)
        emb, head = ctx.embedding, ctx.head
        out = []
        for r, chunks in enumerate(stage_ranges(lay)):
            row = []
            for c, (first, count) in enumerate(chunks):
                n = self._kind_counts(first, count)
                f = sum(n[k] * per[k][0] for k in per)
                b = sum(n[k] * per[k][1] for k in per)
                if r == 0 and c == 0:
                    f += emb.forward
                    b += emb.backward_input + emb.bwd_weight_compute
                if r == lay.pp - 1 and c == lay.vpp - 1:
                    f += head.forward
                    b += head.backward_input + head.bwd_weight_compute
                row.append((f + ctx.blocking_p2p_s, b + ctx.blocking_p2p_s))
            out.append(row)
        return out

    def _chunk_kinds(self, chunks: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        """(MoE layers, dense layers) of every chunk (model order), from the MoE prefix count, as arrays."""
        found = self.chunk_kinds.get(chunks)
        if found is None:
            ends = np.cumsum(np.array(chunks, dtype=np.int64))
            starts = ends - np.array(chunks, dtype=np.int64)
            prefix = np.asarray(self.moe_prefix)
            moe = prefix[ends] - prefix[starts]
            found = self.chunk_kinds[chunks] = (moe.astype(float), (np.array(chunks) - moe).astype(float))
        return found

    def _interleaved_ranks(self, c: Candidate, ctx: CostContext,
                           mode: str) -> tuple[tuple[float, float, float, float, float, float], ...]:
        """Per rank: (chunk 0's forward + backward, all its chunks' forward + backward, its dense and expert
        parameters, its forward and backward windows) for one micro-batch (_interleaved_bound reads them); the
        chunks' sums as simulate_config makes them (layers of one kind cost the same), in numpy."""
        lay = ctx.lay
        pp, vpp = lay.pp, lay.vpp
        moe, dense_n = self._chunk_kinds(lay.chunks)
        fw, bw = np.zeros(pp * vpp), np.zeros(pp * vpp)
        for kind, i in self.layer_kinds.items():
            t = ctx.layer_times(i, mode)
            n = moe if kind else dense_n
            fw += n * t.forward
            bw += n * (t.backward_input + t.bwd_weight_compute)
        emb, head = ctx.embedding, ctx.head
        fw[0] += emb.forward
        bw[0] += emb.backward_input + emb.bwd_weight_compute
        fw[-1] += head.forward
        bw[-1] += head.backward_input + head.bwd_weight_compute
        fw, bw = (fw + ctx.blocking_p2p_s).reshape(vpp, pp), (bw + ctx.blocking_p2p_s).reshape(vpp, pp)
        dense, expert, _ = self._rank_contents(c, ctx, mode)
        f_rank, b_rank = fw.sum(axis=0), bw.sum(axis=0)
        first = fw[0] + bw[0]
        return tuple((float(first[r]), float(f_rank[r] + b_rank[r]), float(dense[r]), float(expert[r]),
                      float(f_rank[r]), float(b_rank[r])) for r in range(pp))

    def _interleaved_bound(self, ranks, ctx: CostContext) -> float:
        """Rank r starts after chunk 0 of ranks < r ran micro-batch 0 forward, runs m passes of each of its chunks,
        and its last backward (chunk 0, Megatron's order) must still flow back through chunk 0 of ranks < r; then
        its DP sync (a lower bound of simulate_config's: the partition's SyncModel exposure, optimizer step and
        FP8 weight casts). The bound is the max over ranks."""
        sync, rt, physics = ctx.sync, self.rt, self.eff.physics
        h, m = ctx.p2p_s, ctx.lay.num_microbatches
        best = prefix = 0.0
        last = len(ranks) - 1
        for r, (first_fb, per_mb, dense, expert, f, b) in enumerate(ranks):
            path = prefix + 2 * r * h + m * per_mb
            prefix += first_fb
            # per-micro-batch reduce-scatters are in the layer times; what remains after the step (the edges'
            # gradients, the last bucket) is left out: a lower bound still
            reduce = 0.0 if ctx.reduce_in_backward else sync.reduce(dense, expert)
            gather = sync.gather(dense, expert)
            # no unhidden share: simulate_config's last-bucket exposure only adds to this
            exposed = ((overlapped_exposed(reduce, b, 0.0, physics) if rt.overlap_grad_reduce else reduce)
                       + (overlapped_exposed(gather, f, 0.0, physics) if rt.overlap_param_gather else gather))
            extra = exposed + sync.optimizer(dense, expert) + fp8_weight_cast_s(
                ctx, StageParams(dense, expert), r == 0, r == last)
            best = max(best, path + extra)
        return best

    def _rank_contents(self, c: Candidate, ctx: CostContext, mode: str) -> tuple[np.ndarray, ...]:
        """Per rank under virtual stages: dense and expert parameters on one GPU and the smallest chunk's
        activations. They depend on the layer costs and the chunks only, so every ZeRO stage and dp shares them."""
        key = (c.layer_key, c.mesh.pp, ctx.lay.chunks, mode)
        if key not in self.rank_contents:
            lay, model = ctx.lay, self.model
            per = {k: (ctx.layer_params(i), ctx.layer_activation(i, mode)) for k, i in self.layer_kinds.items()}
            edges = {(first, last): stage_params(model, lay, range(0), first, last)
                     for first in (False, True) for last in (False, True)}
            dense, expert, act = [], [], []
            for r, chunks in enumerate(stage_ranges(lay)):
                edge = edges[(r == 0, r == lay.pp - 1)]
                counts = [self._kind_counts(f, n) for f, n in chunks]
                dense.append(edge.dense + sum(n[k] * per[k][0].dense for n in counts for k in per))
                expert.append(edge.expert + sum(n[k] * per[k][0].expert for n in counts for k in per))
                act.append(min(sum(n[k] * per[k][1] for k in per) for n in counts))
            self.rank_contents[key] = (np.array(dense), np.array(expert), np.array(act))
        return self.rank_contents[key]

    def _interleaved_memory_floor(self, c: Candidate, ctx: CostContext, mode: str) -> float:
        """Bytes on the fullest rank: states plus the chunk-micro-batches Megatron's interleaved warm-up holds
        before the first backward ((pp - r - 1) * 2 + (vpp - 1) * pp + 1, schedules.py), each at least the
        smallest chunk's activations."""
        lay = ctx.lay
        dense, expert, act = self._rank_contents(c, ctx, mode)
        # model_state_bytes is linear in the parameter counts: its bytes per dense and per expert parameter
        unsharded = self.rt.holds_unsharded_grads(lay.zero, lay.pp)
        per_dense = sum(model_state_bytes(StageParams(1.0, 0.0), lay, unsharded))
        per_expert = sum(model_state_bytes(StageParams(0.0, 1.0), lay, unsharded))
        r = np.arange(lay.pp)
        held = np.minimum((lay.pp - r - 1) * 2 + (lay.vpp - 1) * lay.pp + 1, lay.num_microbatches * lay.vpp)
        logits = np.where(r == lay.pp - 1, logits_bytes(self.model, lay, self.wl, self.rt)
                          + mtp_activation_bytes(self.model, lay, self.wl, self.rt), 0.0)
        need = (per_dense * dense + per_expert * expert + held * act + logits + ctx.buffer_bytes) * (1 + FRAGMENTATION)
        return float(need.max())

    # ---- the search
    # Every step of the search is an entry (lower bound, sequence, step, payload) of one priority queue: a group of
    # candidates (bound: its work bound), a candidate (its work bound), a candidate with its next bound (the family
    # DP, the interleaved bound, the relaxed per-stage DP) or a partition to simulate (its DP bound J). The smallest
    # bound is always taken next (A*), so a DP or a simulation runs only when nothing cheaper could prune it, and
    # the search ends when the smallest bound left reaches the K-th best simulated time. Each step names the bound
    # that prunes what is left of it, for the account.
    PRUNED_BY = {"group": "work bound (group)", "cand": "work bound",
                 "cand-dp": "work bound with ZeRO-2/3's per-layer DP collectives",
                 "ileave": "pipeline bound (interleaved)",
                 "family": "partition bound without memory or DP sync (shared by ZeRO stages)",
                 "sim": "partition bound (DP)", "per-stage": "partition bound (relaxed recompute)"}

    def _push(self, bound: float, step: str, *payload) -> None:
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
            self._count(self.pruned, self.PRUNED_BY[step], payload[0].size() if step == "group" else 1)
        self.queue.clear()
        # first: the partitions it simulates tighten the cutoff CP-SAT then meets; then the bounds CP-SAT left open
        timed_out = self._close_gaps(deadline) or self._run_cpsat(deadline) or self._close_gaps(deadline)
        if progress:
            progress(live, live)
        return timed_out

    def _push_groups(self, groups: list[Group]) -> None:
        for g, score in zip(groups, self._group_scores(groups)):
            self._push(score, "group", g)

    def _limit(self) -> Deadline | None:
        """The deadline that long steps (a partition DP, a pipeline simulation) check as they run: none before the
        first plan is kept, as the search's own checks (_past)."""
        return Deadline(self.deadline) if self.deadline is not None and self.best.heap else None

    def _past(self, deadline: float | None) -> bool:
        """The time limit has passed and a plan is kept (before the first plan the limit waits: see run)."""
        return deadline is not None and bool(self.best.heap) and time.perf_counter() > deadline

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
            if step == "group":
                self.expanded += 1
                if progress:
                    progress(self.expanded, live)
            try:
                self._run_step(bound, step, payload)
            except TimeLimitReached:  # the limit stopped the step midway: its bound is not reached either
                self.unexplored_bound = min(self.unexplored_bound, bound)
                self._count(self.pruned, "not reached before the time limit",
                            payload[0].size() if step == "group" else 1)
                self._stop_for_time(progress, live, [])
                return True
        return False

    def _stop_for_time(self, progress: ProgressFn | None, live: int, unscored: list[Group]) -> None:
        """The limit stopped the search: what is left counts as not reached, and the smallest bound left (the queue's,
        the deferred CP-SAT solves', and for groups never scored the space's compute floor) bounds the gap."""
        for bound, _, rest, load in self.queue:
            self.unexplored_bound = min(self.unexplored_bound, bound)
            self._count(self.pruned, "not reached before the time limit", load[0].size() if rest == "group" else 1)
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
        """No plan is faster than the model's FLOPs on every GPU at the chip's highest dense peak: the bound of
        the groups a time limit left unscored (loose, but it needs no per-group cost)."""
        peak = max(p.value for p in self.cluster.gpu.peak_tflops.values()) * 1e12
        return model_flops_per_step(self.model, self.wl) / (self.cluster.num_gpus * peak)

    def _run_step(self, bound: float, step: str, payload: tuple) -> None:
        if step == "group":
            self._expand_group(*payload)
        elif step == "cand":
            self._step_candidate(bound, *payload)
        elif step == "cand-dp":
            self._step_candidate(bound, *payload, sharded_bound=True)
        elif step == "ileave":
            self._step_interleaved(bound, *payload)
        elif step == "family":
            self._step_family(bound, *payload)
        elif step == "sim":
            self._simulate(payload[0], payload[1], None, bound, self._context(payload[0]))
        else:
            self._per_stage(bound, *payload)

    def _next(self, bound: float, step: str, *payload) -> None:
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
            cands = [c for c, bad in zip(cands, over.tolist()) if not bad]
        if not cands:
            return
        bounds = self.work_bounds_of(cands)
        # ZeRO-2/3 candidates whose layer times hold per-layer DP collectives: the work bound over those layer times
        # (most end here: a gather or reduce-scatter per layer and micro-batch can outweigh the layer)
        # (CostContext.dp_in_layer_times, read off the candidate without building its context). That bound is at
        # least the work bound, so where the work bound already reaches the best plan it is not computed.
        cutoff = self.best.cutoff() * (1 - REL_TOL)
        has_dp = [c.zero == 3 or self.rt.reduces_each_microbatch(c.zero, c.mesh.pp) for c in cands]
        sharded = [n for n, (dp_in_layers, bound) in enumerate(zip(has_dp, bounds.tolist()))
                   if dp_in_layers and bound < cutoff]
        if sharded:
            gbs, rep = self.wl.global_batch, {}
            for n in sharded:  # one context per (sp, cp_comm, zero): the layer times read nothing else of these
                rep.setdefault((cands[n].sp, cands[n].cp_comm, cands[n].zero), cands[n])
            ctxs = {k: self._context(c) for k, c in rep.items()}
            rows = [(self._sharded_key_costs(c, ctxs[(c.sp, c.cp_comm, c.zero)]), c.num_microbatches(gbs),
                     c.mesh.pp, c.schedule, self._hop(c.mesh, c.mbs)) for c in (cands[n] for n in sharded)]
            bounds[sharded] = np.maximum(bounds[sharded], self._work_bounds(rows))
        for c, bound, dp_in_layers in zip(cands, bounds.tolist(), has_dp):
            if dp_in_layers and bound >= cutoff:
                self._count(self.pruned, self.PRUNED_BY["cand-dp"])
            else:
                self._push(bound, "cand-dp" if dp_in_layers else "cand", c)

    def _step_candidate(self, key: float, c: Candidate, sharded_bound: bool = False) -> None:
        """The candidate's next bound: the interleaved bound with virtual stages, else (after the memory floor) the
        partition DP without memory or DP sync, shared by its ZeRO stages (ZeRO-2/3 candidates come queued by
        their work bound over layer times with the per-layer DP collectives: _expand_group)."""
        ctx = self._context(c)
        assert sharded_bound or not ctx.dp_in_layer_times, "ZeRO-2/3 candidates are queued with their sharded bound"
        if self.eager and not self.best.heap and c.vpp == 1 and self._partition_cells(c) > QUICK_PLAN_MIN_CELLS:
            self._quick_plan(c, ctx, key)
        if c.vpp > 1:
            self._next(min(b for b, _ in self._chunk_options(c, ctx)), "ileave", c, ctx)
            return
        prob = self.problem(c, ctx)
        below = self._below(key)
        bound = self._family_bound(c, prob, below)
        if bound >= self.best.cutoff() * (1 - REL_TOL):
            self._count(self.pruned, self.PRUNED_BY["family"])
            return
        self._next(bound, "family", c, prob)

    def _quick_plan(self, c: Candidate, ctx: CostContext, key: float) -> None:
        """Under a time limit, before any plan is kept, where the candidate's exact partition DPs are slow (hundreds
        of layers: a second each): its even split simulated at once (one estimate), so that a first plan comes
        quickly and the limit can start to count. Where the DPs are fast the first plan comes from them, a better
        one (DeepSeek-V3's first candidate: 1.18x the optimum with its DP partition, 1.65x evenly split). The
        candidate's own steps follow as usual; this is one more partition of it, not another account entry."""
        even = tuple(split_evenly(self.model.num_layers, c.mesh.pp))
        policies = tuple(StagePolicy(granularity="full", full_layers=n) for n in even) \
            if c.recompute == "per-stage" else None  # per-stage: its plan with the least memory
        self._simulate(c, even, policies, key, ctx, another_partition=True)

    def _memory_floors(self, cands: list[Candidate]) -> np.ndarray:
        """memory_floors of candidates of one group (per-stage: with full recompute's activations), from per-kind
        layer states and activations alone: no context, no layout."""
        if not cands:
            return np.zeros(0)
        m = cands[0].mesh
        n_moe = self.moe_prefix[-1]
        counts = np.array([n_moe if kind else self.model.num_layers - n_moe for kind in self.layer_kinds])
        states, acts, held, fixed = [], [], [], []
        p, mb = m.pp, cands[0].num_microbatches(self.wl.global_batch)
        steady = [min(p - r, mb) for r in range(p)]
        # a floor reads only these of a candidate (not cp_comm, vpp or the schedule beyond GPipe's held batches)
        reads = [(c.sp, c.zero, "full" if c.recompute == "per-stage" else c.recompute, c.schedule == "gpipe")
                 for c in cands]
        distinct = {}
        for c, what in zip(cands, reads):
            distinct.setdefault(what, c)
        for c in distinct.values():
            key = (m, c.zero)
            if key not in self.state_bytes:  # (bytes per dense, per expert parameter) on one GPU: linear in them
                lay = _FloorLayout(tp=m.tp, pp=m.pp, dp=m.dp, cp=m.cp, ep=m.ep, etp=m.etp, edp=m.edp, zero=c.zero)
                self.state_bytes[key] = (sum(model_state_bytes(StageParams(1.0, 0.0), lay)),  # type: ignore[arg-type]
                                         sum(model_state_bytes(StageParams(0.0, 1.0), lay)),  # type: ignore[arg-type]
                                         buffer_bytes(self.model, c.zero, m.tp))
            per_dense, per_expert, buffers = self.state_bytes[key]
            mode = "full" if c.recompute == "per-stage" else c.recompute
            rows = [self._layer_memory(c, kind, i, mode) for kind, i in self.layer_kinds.items()]
            states.append([per_dense * dense + per_expert * expert for dense, expert, _ in rows])
            acts.append([act for _, _, act in rows])
            held.append([mb] * p if c.schedule == "gpipe" else steady)
            fixed.append(buffers)
        floors = memory_floors(counts, np.array(states), np.array(acts), np.array(held), np.array(fixed),
                               FRAGMENTATION)
        index = {what: n for n, what in enumerate(distinct)}
        return floors[[index[what] for what in reads]]

    def _layer_memory(self, c: Candidate, kind: bool, i: int, mode: str) -> tuple[float, float, float]:
        """(dense, expert parameters on one GPU, activation bytes per micro-batch) of one layer of this kind: they
        read only the layer key's fields (memory.py)."""
        m = c.mesh
        key = (m.tp, m.cp, c.sp, c.mbs, m.ep, m.etp, kind, mode)
        found = self.layer_memory.get(key)
        if found is None:
            lay = c.layer_key
            params = stage_params(self.model, lay, range(i, i + 1), False, False)  # type: ignore[arg-type]
            act = (layer_activation_bytes(self.model, i, lay, self.wl, self.rt, mode)  # type: ignore[arg-type]
                   * self.eff.activation_ratio(mode))
            found = self.layer_memory[key] = (params.dense, params.expert, act)
        return found

    def _chunk_options(self, c: Candidate, ctx: CostContext) -> list[tuple[float, tuple[int, ...]]]:
        """(interleaved bound, chunks) of every virtual-stage split searched for this candidate (space.
        interleaved_chunks), fastest bound first. The splits' rank paths are shared by the candidate's ZeRO
        stages (cached), their DP sync is the candidate's own (its context's)."""
        # the rank sums read the layer costs and pp only (not dp, unless ZeRO-2/3's per-layer collectives are in
        # the layer costs): candidates of other meshes and micro-batch counts share them
        key = (c.layer_key, c.mesh.pp, c.vpp, c.recompute, ctx.blocking_p2p_s,
               (c.mesh, c.zero) if ctx.dp_in_layer_times else None)
        paths = self.interleaved_bounds.get(key)
        if paths is None:
            paths = []
            for chunks in interleaved_chunks(self.model.num_layers, c.mesh.pp, c.vpp):
                paths.append((chunks, self._interleaved_ranks(c, self._option_context(c, ctx, chunks), c.recompute)))
            self.interleaved_bounds[key] = paths
        return sorted(((self._interleaved_bound(ranks, ctx), chunks) for chunks, ranks in paths), key=lambda x: x[0])

    def _option_context(self, c: Candidate, ctx: CostContext, chunks: tuple[int, ...]) -> CostContext:
        """The candidate's context with another virtual-stage split (its layer costs shared)."""
        if chunks == ctx.lay.chunks:
            return ctx
        return ctx.derive(resolve(self.model, self.cluster.num_gpus, self.wl, self._config(c, chunks=chunks)))

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
        policy = "none" if per_stage else c.recompute
        if not self._may_fit(prob, policy, per_stage):
            self._no_partition(c, prob, "memory: no partition fits even with full recompute" if per_stage
                               else "memory: no stage partition fits", "per-stage" if per_stage else "sim")
            return
        below = self._below(key)
        res = self._dp(prob, policy, relaxed=per_stage, below=below)  # per-stage: no-recompute times, least memory
        if res is None:
            if below < self.best.cutoff():
                self._push(below, "family", c, prob)  # nothing below `below`: a lower bound, solved again if reached
            else:
                self._no_partition(c, prob, "memory: no partition fits even with full recompute" if per_stage
                                   else "memory: no stage partition fits", "per-stage" if per_stage else "sim")
            return
        self.bounded += 1
        if per_stage:
            self._next(res.objective, "per-stage", c, prob, res)
        else:
            self._next(res.objective, "sim", c, res.stage_layers)

    def _no_partition(self, c: Candidate, prob: PartitionProblem, reason: str, step: str) -> None:
        """A DP found nothing: infeasible when the greedy memory test or an uncut DP says so, else pruned (no
        partition below the cutoff; one the greedy test missed that does not fit has no bound below it either)."""
        recompute = "full" if c.recompute == "per-stage" else c.recompute
        if not math.isinf(self.best.cutoff()) and self._may_fit(prob, recompute, c.recompute == "per-stage"):
            self._count(self.pruned, self.PRUNED_BY[step])
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
            self._push(below, "per-stage", c, prob, relaxed)  # nothing below `below`: solved again if reached
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
            remaining = None if deadline is None else deadline - time.perf_counter()
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
                    layers = tuple(b - a for a, b in zip(bounds, bounds[1:]))
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
            layers = tuple(b - a for a, b in zip(bounds, bounds[1:]))
            if (layers, pols) != (stage_layers, policies):
                self._simulate(c, layers, pols, lower, ctx, another_partition=True)
        return True

    def _close_gaps(self, deadline: float | None) -> bool:
        """Where a candidate's simulated time exceeds its J bound and the bound is below the best plan: simulate
        every partition whose bound is below the best when there are few (partitions_below), which closes the gap;
        else try its even split, and replace J by the larger of two tighter bounds (planner/partition/bounds.py): the 1F1B
        pair chain (solve_dp_pairs, whose own best partition is simulated when it differs) and rank 0's sync after
        the whole backward flow (solve_stage0_sync, likewise). True when the time limit stopped it."""
        still_open = []
        pending = sorted(self.open_bounds, key=lambda x: x[0])
        for n, (bound, c, stage_layers, policies) in enumerate(pending):
            best = self.best.ranked()[0].step_time_s if self.best.heap else math.inf
            late = deadline is not None and time.perf_counter() > deadline
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
                        layers = tuple(b - a for a, b in zip(bounds, bounds[1:]))
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

    def _partition_cells(self, c: Candidate) -> int:
        """p (L+1)^2: the size of the candidate's (stage, first layer, end) grids, what its partition DPs cost."""
        return c.mesh.pp * (self.model.num_layers + 1) ** 2

    def _listable(self, c: Candidate) -> bool:
        """Whether the partition lists' p (L+1)^2-cell grids are small enough to build (about 200 MB at most)."""
        return self._partition_cells(c) <= LIST_MAX_CELLS

    def _pair_dp_fits(self, c: Candidate) -> bool:
        """Whether the O(p L^3) pair and sync DPs stay within about a second."""
        return self._partition_cells(c) * (self.model.num_layers + 1) <= PAIR_DP_MAX_CELLS

    def _group_scores(self, groups: list[Group]) -> list[float]:
        """A lower bound for every candidate in each group: the work bound with no recomputation (the fastest), the
        least over the group's variants; all groups' variants in one vectorised call."""
        rows, owner = [], []
        gbs = self.wl.global_batch
        for n, g in enumerate(groups):
            m, hop, seen = g.mesh, self._hop(g.mesh, g.mbs), set()
            mb = gbs // (g.mbs * m.dp)
            costs: dict = {}
            for sp, cc, sched, _ in g.variants:
                if (sp, cc, sched) not in seen:  # the work bound reads vpp only through the schedule
                    seen.add((sp, cc, sched))
                    if (sp, cc) not in costs:
                        costs[(sp, cc)] = self._key_costs(m, g.mbs, sp, cc, "none")
                    rows.append((costs[(sp, cc)], mb, m.pp, sched, hop))
                    owner.append(n)
        scores = np.full(len(groups), math.inf)
        if rows:
            np.minimum.at(scores, np.array(owner), self._work_bounds(rows))
        return scores.tolist()

    def _sp_dominates(self, g: Group, cc: str) -> bool:
        """Sequence parallelism is never slower and never uses more memory than plain TP for this mesh: every
        block's pass times (each recompute mode) and activations are no larger with it (checked, not assumed;
        once per layer key, from the PassCache)."""
        m = g.mesh
        key = (m.tp, m.cp, cc, g.mbs, m.ep, m.etp)  # the layer key's fields but sp (the modules are the search's)
        found = self.sp_dominance.get(key)
        if found is None:
            on, off = (Candidate(g.mesh, g.mbs, sp, cc, min(g.zeros), "1f1b", 1, "none", self.modules)
                       for sp in (True, False))
            links = self._links(g.mesh)
            pairs = [(self.passes.embedding(on.layer_key, links), self.passes.embedding(off.layer_key, links)),
                     (self.passes.head(on.layer_key, links), self.passes.head(off.layer_key, links))]
            smaller = True
            for kind, i in self.layer_kinds.items():
                for mode in ("none", "selective", "full"):
                    pairs.append((self.passes.layer_times(i, mode, on.layer_key, links),
                                  self.passes.layer_times(i, mode, off.layer_key, links)))
                    smaller &= self._layer_memory(on, kind, i, mode)[2] <= self._layer_memory(off, kind, i, mode)[2]
            found = self.sp_dominance[key] = smaller and all(
                a.forward <= b.forward and a.backward_input <= b.backward_input
                and a.bwd_weight_compute <= b.bwd_weight_compute for a, b in pairs)
        return found

    def _simulate(self, c: Candidate, stage_layers, policies, bound: float, ctx: CostContext,
                  another_partition: bool = False, chunks: tuple[int, ...] | None = None) -> None:
        """Simulate one candidate with the given partition and rank it. Each candidate lands in exactly one
        account column: evaluated (ranked), infeasible (over memory once simulated) or pruned (a ZeRO-only tie).
        another_partition: a further partition of a candidate already counted (closing a gap): no new count."""
        cfg = self._config(c, stage_layers, policies, chunks)
        sim = simulate_config(self.model, self.cluster, self.wl, cfg, self.runtime, self.eff, context=ctx,
                              timelines=self.timelines, deadline=self._limit())
        est = sim.estimate
        if not est.fits:
            if not another_partition:
                self._count(self.infeasible, "memory: simulated peak over HBM")
            self._note_memory(est.peak_memory_gib * GIB, _describe(c))
            return
        tight = est.step_time_s <= bound * (1 + 1e-6)
        status = "optimal" if (tight or c.vpp > 1) else "bound gap"
        if not tight and c.vpp == 1 and not another_partition:
            self.open_bounds.append((bound, c, stage_layers, policies))
        kept = self.best.add(RankedPlan(c, cfg, est, bound if c.vpp == 1 else est.step_time_s, status))
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
                acc = self._account(seconds, "time-limit", math.nan, self.unexplored_bound)
                return SearchResult((), acc, f"no plan was evaluated within the time limit ({seconds:.2f} s); "
                                             f"raise --time-limit or pin more knobs")
            acc = self._account(seconds, "infeasible", math.nan, math.nan)
            return SearchResult((), acc, self._why_nothing_fits())
        best = plans[0].step_time_s
        lows = [b for b, _, _, _ in self.open_bounds if b < best] + [self.unexplored_bound]
        low = min([best] + lows)
        gap = max(0.0, (best - low) / best)
        status = "time-limit" if timed_out else ("optimal" if gap <= 1e-6 else "gap")
        return SearchResult(plans, self._account(seconds, status, gap, low), None)

    def _account(self, seconds: float, status: str, gap: float, low: float) -> SearchAccount:
        return SearchAccount(self.enum.space_size, self.evaluated, self.bounded, dict(self.pruned),
                             dict(self.infeasible), seconds, status, gap, low, dict(self.enum.domains),
                             self.cpsat_calls)

    def _why_nothing_fits(self) -> str:
        model, n = self.model, self.cluster.num_gpus
        hbm = self.cluster.gpu.hbm_gib.value
        if not self.enum.groups:
            rules = ", ".join(f"{k} ({v})" for k, v in sorted(self.infeasible.items(), key=lambda x: -x[1])[:3])
            if not rules:
                return f"no configuration of {n} GPUs passes the divisibility rules with these pins; unpin some"
            return f"no configuration of {n} GPUs passes the divisibility rules: {rules}"
        need = _gpus_needed(model, hbm, self.cluster.gpus_per_node)
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
        return f"nothing fits in {hbm:g} GiB per GPU on {n} GPUs{closest}; {advice}"


@dataclass(frozen=True)
class _MeshLayout:
    """The Layout fields group_ranks and stage_p2p_s read: a mesh's links and hop without resolving a layout."""

    tp: int
    cp: int
    dp: int
    pp: int
    ep: int
    etp: int
    edp: int
    mbs: int
    rank_order: str


@dataclass(frozen=True)
class _FloorLayout:
    """The Layout fields stage_params and model_state_bytes read: a states floor without resolving a layout."""

    tp: int
    pp: int
    dp: int
    cp: int
    ep: int
    etp: int
    edp: int
    zero: int


def memory_floors(counts: np.ndarray, states: np.ndarray, acts: np.ndarray, held: np.ndarray, fixed: np.ndarray,
                  fragmentation: float) -> np.ndarray:
    """A lower bound on the fullest stage's memory over all partitions, per candidate (rows). counts: layers of each
    kind; states, acts: (candidates, kinds) state bytes and activation bytes per micro-batch of one such layer;
    held: (candidates, p) micro-batches each stage holds; fixed: buffers. For one kind alone, stage r holds x_r of
    its layers at s + held_r a bytes each, so max_r x_r (s + held_r a) >= n / sum_r 1 / (s + held_r a) (equalising
    the stages, as in pipeline_floor); the other layers only add to it, so the largest over the kinds bounds the
    whole."""
    per_layer = states[:, :, None] + held[:, None, :] * acts[:, :, None]  # (candidates, kinds, stages)
    with np.errstate(divide="ignore"):
        spread = counts[None, :] / np.sum(1.0 / per_layer, axis=2)
    spread = np.where((counts[None, :] > 0) & (per_layer.min(axis=2) > 0), spread, 0.0)
    return (spread.max(axis=1) + fixed) * (1 + fragmentation)


def heaviest_stage_floor(layer_times: tuple[float, ...], p: int) -> float:
    """A lower bound on the heaviest of p stages' time, whatever the partition: for the j slowest layers, some stage
    holds ceil(j / p) of them (pigeonhole), at least the ceil(j / p) fastest of those; the best j. layer_times sorted
    slowest first. With two kinds of layer (dense, MoE) this is ceil(n_MoE / p) MoE layers."""
    return float(heaviest_stage_floors(np.array([layer_times]), [p])[0, p]) if layer_times else 0.0


def heaviest_stage_floors(layer_times: np.ndarray, stages) -> np.ndarray:
    """heaviest_stage_floor of each row of layer_times (rows sorted slowest first) for each p in `stages` at once:
    entry [row, p] of the result (other p: 0)."""
    rows, n = layer_times.shape
    ps = np.asarray(sorted(set(stages)), dtype=np.int64)
    out = np.zeros((rows, int(ps.max()) + 1 if len(ps) else 1))
    if not n or not len(ps):
        return out
    prefix = np.concatenate((np.zeros((rows, 1)), np.cumsum(layer_times, axis=1)), axis=1)
    j = np.arange(1, n + 1)[None, :]
    lo = j - (-(-j // ps[:, None]))  # (p, j): the first of the ceil(j / p) fastest among the j slowest
    out[:, ps] = np.max(prefix[:, None, 1:] - prefix[:, lo], axis=2)
    return out


def pipeline_floor(total: float, alpha: float, m: int, p: int, schedule: str, layers: int = 0,
                   layer_min: float = 0.0, head: float = 0.0, hop: float = 0.0,
                   stage_min: float | None = None) -> float:
    """min over all stage partitions of the partitioner's objective, relaxed to continuous stage times t_r >= 0
    summing to `total` (one micro-batch through every stage): a sound lower bound that needs no partition.

    Rank r cannot finish before micro-batch 0 reaches it and it ran all its m micro-batches; under 1F1B and GPipe
    the gradient must then flow back through ranks r-1..0 (planner/partition/bounds.py), so the step is at least
    max_r (sum_{s<r} t_s + m t_r). Equalising the terms (the LP optimum) gives X = total / (1 - (1 - 1/m)^p).
    Under ZB only the forward prefix is certain: f_s >= alpha t_s gives X = alpha total / (1 - (1 - alpha/m)^p).
    With virtual stages only the work bound m total / p is used. GPipe: J_r >= total + (m - 1) t_r, so the step is
    at least (m + p - 1) total / p. 1F1B with m >= p + 1: rank r's path through micro-batch 0's and m-1's round
    trips gives J_r >= B_r = T_<r + (m - w_r) t_r + 2 T_>r (w_r = p - r - 1); dual weights y_{r+1} = y_r (m - p + r
    - 1) / (m - p + r + 1), scaled to sum 1 (all >= 0 when m >= p + 1), make sum_r y_r B_r the same multiple of
    total for every t, and the even split, where every B_r is equal, attains it: min_t max_r B_r = (m + p - 1) total
    / p, the textbook
    1F1B bubble (Narayanan et al. 2021) as a bound for any partition. Both also pay 2 (p-1) hops (hop: P2P latency
    between stages) on the way there and back. 1F1B, rank 0 alone: micro-batch 0's and m-1's round trips and the
    (m-1)//p - 1 steady ones between them (planner/partition/terms.py, _end_pieces) sum to ((m-1)//p + 1) (total +
    2 (p-1) hop) + ((m-1) mod p) t_0, which is the floor that sees P2P latency paid every p micro-batches.
    stage_min bounds the heaviest stage's time t_r (heaviest_stage_floor: stages hold whole layers); that rank's own
    paths give J_r >= total + (m-1) t_r (GPipe) and, 1F1B, B_r = T_<r + (m - w_r) t_r + 2 T_>r >= total + (m - p)
    t_r, each with 2 (p-1) hops. Stages hold whole layers: some rank runs at
    least ceil(layers / p) of them m times, and the last rank runs the head and at least one layer m times after
    micro-batch 0 went through every other rank (alpha times that with ZB)."""
    return float(pipeline_floors(*(np.asarray([x]) for x in (total, alpha, m, p, schedule, layers, layer_min, head,
                                                             hop, 0.0 if stage_min is None else stage_min)))[0])


def pipeline_floors(total, alpha, m, p, schedule, layers, layer_min, head, hop, stage_min) -> np.ndarray:
    """pipeline_floor over arrays (one entry per candidate; schedule an array of names): the search's work bounds
    in one call."""
    total, alpha, layer_min, head, hop, stage_min = (np.asarray(x, dtype=float) for x in (
        total, alpha, layer_min, head, hop, stage_min))
    m, p, layers = (np.asarray(x, dtype=np.int64) for x in (m, p, layers))
    gpipe, one_f, zb = schedule == "gpipe", schedule == "1f1b", schedule == "zb"
    work = m * total / p
    heaviest = np.maximum(stage_min, np.where(layers > 0, -(-layers // p) * layer_min, 0.0))
    a = np.where(zb, alpha, 1.0)
    last = head + layer_min
    with np.errstate(divide="ignore", invalid="ignore"):
        # 1 - (1 - a/m)^p without cancellation for small a; its limit as a -> 0 is the work bound
        share = np.where(a >= m, 1.0, -np.expm1(p * np.log1p(-a / m)))
        chain = np.where(a > 0, a * total / share, work)
    floor = np.maximum.reduce([work, chain, m * heaviest, a * (total - last) + m * last])
    round_trip = 2 * (p - 1) * hop
    steady = gpipe | (one_f & (m >= p + 1))
    floor = np.where(steady, np.maximum(floor, (m + p - 1) * total / p + round_trip), floor)  # the textbook bubble
    floor = np.where(gpipe, np.maximum(floor, total + (m - 1) * heaviest + round_trip), floor)  # the heaviest J_r
    rank0 = one_f & (m >= p + 1)
    floor = np.where(rank0, np.maximum.reduce([floor, ((m - 1) // p + 1) * (total + round_trip),  # rank 0's trips
                                               total + (m - p) * heaviest + round_trip]), floor)  # heaviest J_r
    return np.where((p == 1) | (schedule == "interleaved"), np.maximum(work, m * heaviest), floor)


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
    return value, tuple(b - a for a, b in zip(bounds, bounds[1:])), tuple(pols)


def _describe(c: Candidate) -> str:
    m = c.mesh
    return f"tp={m.tp} cp={m.cp} pp={m.pp} dp={m.dp}" + (f" ep={m.ep}" if m.ep > 1 else "") + f" mbs={c.mbs} zero={c.zero}"


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
