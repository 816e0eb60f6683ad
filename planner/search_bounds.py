"""The costs and lower bounds of the search's candidates (planner/search.py runs the queue over them): cost
contexts and partition problems cached across candidates, work and memory floors of whole groups at once
(vectorised), the family, interleaved and per-stage partition bounds, and the dominance and scoring rules."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from meshplan.costmodels.config import (DEFAULT_RECOMPUTE_MODULES, CpComm, ParallelConfig, RecomputeModule, StagePolicy,
                                        Workload, one_of, resolve)
from meshplan.costmodels.context import CostContext, buffer_bytes, fp8_weight_cast_s, stage_ranges
from meshplan.costmodels.deadline import Deadline
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.kernels import CONTENTION_SM, overlapped_exposed
from meshplan.costmodels.memory import (FRAGMENTATION, GIB, StageParams, embedding_activation_bytes,
                                        layer_activation_bytes, logits_bytes, model_state_bytes, mtp_activation_bytes,
                                        stage_params)
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.passes import GroupLinks, PassCache, SyncCoefficients, with_recompute_fb
from meshplan.costmodels.runtime import get_runtime
from meshplan.costmodels.timing import stage_p2p_s
from meshplan.hardware_db.cluster import Cluster
from meshplan.planner.partition import (SCHEDULES, Granularity, PartitionProblem, PartitionResult, SyncModel, dp_bound,
                                        may_fit, solve_dp)
from meshplan.planner.space import (MEMORY_POLICY, UNIFORM_POLICY, Candidate, Enumeration, Group, LayerKey, Mesh,
                                    interleaved_chunks)

LOOKAHEAD = 0.1  # a DP solves exactly only below (1 + this) x its step's queue key; above, it is queued again there
UNBOUNDED_BYTES = 1e30  # a memory cap no stage reaches (bounds that ignore memory)
PAIR_DP_MAX_CELLS = 2e7  # the O(p L^3) pair and stage-0 sync bounds are tried only below this size
LIST_MAX_CELLS = 2**22  # partitions are listed (and per-stage plans solved exactly) only where p (L+1)^2 is below this


class SearchCosts:
    """What the search knows about candidates, cached: their cost contexts, partition problems, DP results and
    bounds. The search supplies the cutoff the DPs solve below and the time limit they check (cutoff, _limit)."""

    def __init__(self, model: ModelSpec, cluster: Cluster, wl: Workload, runtime: str, eff: Efficiency,
                 enum: Enumeration, modules: tuple[RecomputeModule, ...] = DEFAULT_RECOMPUTE_MODULES,
                 memory_share: float = 1.0):
        self.model, self.cluster, self.wl, self.runtime, self.eff, self.enum = model, cluster, wl, runtime, eff, enum
        self.modules = modules  # what selective recomputation re-runs (ParallelConfig.recompute_modules)
        self.rt = get_runtime(runtime)
        self.memory_share = memory_share  # of the HBM, that a candidate's predicted peak may take
        self.cap = cluster.gpu.hbm_gib.value * memory_share * GIB
        self.contexts: dict[tuple, CostContext] = {}
        self.state_bytes: dict[tuple, tuple[float, float, float]] = {}
        self.fits: dict[tuple, bool] = {}
        self.sp_dominance: dict = {}
        self.layer_memory: dict[tuple, tuple[float, float, float]] = {}
        self.passes = PassCache(model, cluster, wl, self.rt, eff)  # block passes shared by every context
        self.closest_memory: tuple[float, str] | None = None  # the smallest memory excess seen, for "nothing fits"
        self.problems: dict[int, PartitionProblem] = {}
        self.dp_results: dict[tuple, tuple[PartitionResult | None, float]] = {}  # (result, solved below)
        self.mesh_links: dict[Mesh, GroupLinks] = {}
        self.states_floors: dict[tuple, float] = {}  # by mesh degrees and ZeRO stage
        self.model_params: dict[tuple, StageParams] = {}  # the whole model's on one GPU, by what splits it
        self.group_floors: dict[tuple, float] = {}  # _group_floor's, by mesh degrees, mbs, ZeRO stages and policy
        self.hops: dict[tuple, float] = {}  # by pp link and message (_hop)
        self.rank_contents: dict[tuple, tuple] = {}
        self.work_bounds: dict[tuple, list] = {}  # per layer key: the key costs (_key_costs)
        self.layer_parts: dict[tuple, tuple] = {}  # per layer key: each layer kind's (forward, backward, selective)
        self.family_bounds: dict[tuple, tuple[float, float]] = {}  # (bound, solved below)
        self.interleaved_bounds: dict[tuple, list] = {}  # per mesh/mbs/...: each split's per-rank paths
        self.chunk_kinds: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        # simulated pipelines by their stage times  # by id of a context held in self.contexts
        self.timelines: dict[tuple, object] = {}
        self.recomputes_searched = {r for g in enum.groups for r in g.recomputes}
        self.pp_values = sorted({g.mesh.pp for g in enum.groups})
        self.layer_kind_list = [model.is_moe_layer(i) for i in range(model.num_layers)]
        self.layer_kinds = {kind: self.layer_kind_list.index(kind) for kind in dict.fromkeys(self.layer_kind_list)}
        self.moe_prefix = [0]
        for i in range(model.num_layers):
            self.moe_prefix.append(self.moe_prefix[-1] + int(model.is_moe_layer(i)))
        self.kind_counts = np.array([self.moe_prefix[-1] if kind else model.num_layers - self.moe_prefix[-1]
                                     for kind in self.layer_kinds])  # layers of each kind, as layer_kinds


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
        uniform = UNIFORM_POLICY[cand.recompute]
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
                sum(model_state_bytes(params, lay, unsharded, rt.grad_bytes)), ctx.layer_activation(i, "none"),
                ctx.layer_activation(i, "selective"), ctx.layer_activation(i, "full"), params.dense, params.expert)
        rows = [per_type[kind] for kind in self.layer_kind_list]
        columns = (tuple(col) for col in zip(*rows, strict=True))
        f, b, sel, full, state, a_none, a_sel, a_full, p_dense, p_expert = columns
        first = stage_params(model, lay, range(0), True, False)
        last = stage_params(model, lay, range(0), False, True)
        emb, head = ctx.embedding, ctx.head
        prob = PartitionProblem(
            num_stages=lay.pp, num_microbatches=lay.num_microbatches,
            schedule=one_of(lay.schedule, SCHEDULES, "partition schedule"),
            layer_forward=tuple(f), layer_backward=tuple(b), layer_selective_extra=tuple(sel),
            layer_full_extra=tuple(full), layer_state_bytes=tuple(state), layer_act_none=tuple(a_none),
            layer_act_selective=tuple(a_sel), layer_act_full=tuple(a_full), layer_params_dense=tuple(p_dense),
            layer_params_expert=tuple(p_expert),
            first_forward=emb.forward, first_backward=emb.backward_input + emb.bwd_weight_compute,
            first_state_bytes=sum(model_state_bytes(first, lay, unsharded, rt.grad_bytes)),
            first_act_bytes=embedding_activation_bytes(model, lay, wl, rt), first_params_dense=first.dense,
            last_forward=head.forward, last_backward=head.backward_input + head.bwd_weight_compute,
            last_state_bytes=sum(model_state_bytes(last, lay, unsharded, rt.grad_bytes)),
            last_fixed_bytes=logits_bytes(model, lay, wl, rt) + mtp_activation_bytes(model, lay, wl, rt),
            last_params_dense=last.dense,
            stage_forward_extra=ctx.blocking_p2p_s, stage_backward_extra=ctx.blocking_p2p_s, hop_s=ctx.p2p_s,
            fixed_bytes=ctx.buffer_bytes, fragmentation=FRAGMENTATION, memory_cap_bytes=self.cap,
            sync=SyncModel.of(self._step_end_sync(ctx), overlap_reduce=rt.overlap_grad_reduce,
                              overlap_gather=rt.overlap_param_gather,
                              contention=CONTENTION_SM if self.eff.physics.contention else 0.0,
                              overlap_leaves_one_layer=self.eff.physics.overlap_limits),
        )
        self.problems[id(ctx)] = prob
        return prob

    @staticmethod
    def _step_end_sync(ctx: CostContext) -> SyncCoefficients:
        """The context's DP sync coefficients as the partitioner sees them after a stage's last backward: without
        the gradient reduce where each micro-batch's backward reduce-scatters (in the layer times; what is left,
        the edges' gradients and the last bucket, is left out, so the partition's objective stays a bound)."""
        return ctx.sync.without_reduce() if ctx.reduce_in_backward else ctx.sync

    def _dp(self, prob: PartitionProblem, policy: Granularity, relaxed: bool = False,
            below: float = math.inf) -> PartitionResult | None:
        """solve_dp, once per problem and policy (a candidate's ZeRO-free per-stage twin reuses its "none" DP): the
        optimum when it is below `below`, else None (also when nothing fits)."""
        key = (id(prob), policy, relaxed)  # problems live in self.problems, so their ids stay theirs
        res, solved_below = self.dp_results.get(key, (None, -math.inf))
        if res is None and solved_below < below:  # None: nothing below solved_below (res is exact otherwise)
            res = solve_dp(prob, policy, relaxed=relaxed, below=below, deadline=self._limit())
            self.dp_results[key] = (res, below)
        return res if res is not None and res.objective < below else None

    def _may_fit(self, prob: PartitionProblem, policy: Granularity, relaxed: bool) -> bool:
        """may_fit, once per problem and policy (a candidate queued again asks again)."""
        key = (id(prob), "relaxed" if relaxed else policy)
        if key not in self.fits:
            self.fits[key] = may_fit(prob, policy, relaxed=relaxed)
        return self.fits[key]

    def _below(self, key: float) -> float:
        """Where a DP popped at queue key `key` need be exact: the cutoff, or (1 + LOOKAHEAD) x key when that is
        lower (a DP restricted to stages that can finish below it is several times cheaper; what it cannot place
        below it goes back to the queue with that as its key, a lower bound, and is solved again if reached)."""
        return min(self.cutoff(), key * (1 + LOOKAHEAD))

    # ---- bounds
    def states_floor(self, g: Group) -> float:
        """Bytes per GPU the model states need at the least (under the highest ZeRO stage searched), averaged over
        stages: no partition can put less on its fullest stage."""
        model, m = self.model, g.mesh
        # groups differ from their mesh's others only in the micro-batch size, and memory not with the rank order
        key = (m[:-1], max(g.zeros))
        found = self.states_floors.get(key)
        if found is None:
            # the highest ZeRO stage searched shards the most: the least states any candidate of the group needs
            lay = _FloorLayout(tp=m.tp, pp=m.pp, dp=m.dp, cp=m.cp, ep=m.ep, etp=m.etp, edp=m.edp, zero=max(g.zeros))
            split = (m.tp, m.ep, m.etp, m.pp > 1)  # all stage_params reads of the layout
            total = self.model_params.get(split)
            if total is None:
                total = self.model_params[split] = stage_params(model, lay, range(model.num_layers), True,  # type: ignore[arg-type]
                                                                True)
            found = self.states_floors[key] = sum(model_state_bytes(total, lay, False,  # type: ignore[arg-type]
                                                                    self.rt.grad_bytes)) / m.pp
        return found

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
        rec = UNIFORM_POLICY[c.recompute]
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
                  for (f, b), kind in zip(layer_fb, self.layer_kinds, strict=True)]
        passes = [x for x in passes if x[2]] + [(*fb, 1) for fb in edges_fb]
        alpha = min(f / (f + b) for f, b, _ in passes if f + b > 0)
        layers = sorted([t for f, b, n in passes[:-2] for t in [f + b] * n], reverse=True)
        return [sum(n * (f + b) for f, b, n in passes), alpha, len(layers), layers[-1],
                passes[-1][0] + passes[-1][1], layers, None]  # the stage floors: _stage_floors

    def _stage_floors(self, costs: list) -> None:
        """Fill in heaviest_stage_floors of the layer keys that lack them, all in one vectorised call."""
        todo = list({id(k): k for k in costs if k[6] is None}.values())
        if todo:
            floors_of = heaviest_stage_floors(np.array([k[5] for k in todo]), self.pp_values)
            for k, floors in zip(todo, floors_of, strict=True):
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
        if m.pp == 1:
            return 0.0
        # stage_p2p_s reads the pp link and the message (mbs, cp, tp): meshes with the same pp link share it
        key = (self._links(m)["pp"], mbs, m.cp, m.tp)
        found = self.hops.get(key)
        if found is None:
            lay = _MeshLayout(tp=m.tp, cp=m.cp, dp=m.dp, pp=m.pp, ep=m.ep, etp=m.etp, edp=m.edp, mbs=mbs,
                              rank_order=m.order)
            found = self.hops[key] = stage_p2p_s(self.model, self.wl, lay, key[0], self.eff)  # type: ignore[arg-type]
        return found

    def _family_bound(self, c: Candidate, prob: PartitionProblem, below: float) -> float:
        """The DP optimum with no memory cap and no DP-sync or optimizer time: a bound for every ZeRO stage of
        this candidate whose layer times hold no DP collectives (they differ only in memory and sync; ZeRO-2/3 with
        per-layer collectives get their own), and with no recomputation for per-stage too. Exact
        when below `below`; otherwise `below`, a lower bound."""
        rec = UNIFORM_POLICY[c.recompute]
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
        fw: np.ndarray = np.zeros(pp * vpp)
        bw: np.ndarray = np.zeros(pp * vpp)
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
        per_dense = sum(model_state_bytes(StageParams(1.0, 0.0), lay, unsharded, self.rt.grad_bytes))
        per_expert = sum(model_state_bytes(StageParams(0.0, 1.0), lay, unsharded, self.rt.grad_bytes))
        r = np.arange(lay.pp)
        held = np.minimum((lay.pp - r - 1) * 2 + (lay.vpp - 1) * lay.pp + 1, lay.num_microbatches * lay.vpp)
        logits = np.where(r == lay.pp - 1, logits_bytes(self.model, lay, self.wl, self.rt)
                          + mtp_activation_bytes(self.model, lay, self.wl, self.rt), 0.0)
        need = (per_dense * dense + per_expert * expert + held * act + logits + ctx.buffer_bytes) * (1 + FRAGMENTATION)
        return float(need.max())


    def cutoff(self) -> float:
        """The time a bound must beat to matter: the K-th best plan's (planner/search.py); here none is kept."""
        return math.inf

    def _limit(self) -> Deadline | None:
        """The deadline long steps (a partition DP, a pipeline simulation) check as they run; here none."""
        return None


    def _memory_floors(self, cands: list[Candidate]) -> np.ndarray:
        """memory_floors of candidates of one group (per-stage: with full recompute's activations), from per-kind
        layer states and activations alone: no context, no layout."""
        if not cands:
            return np.zeros(0)
        m = cands[0].mesh
        states, acts, held, fixed = [], [], [], []
        p, mb = m.pp, cands[0].num_microbatches(self.wl.global_batch)
        steady = [min(p - r, mb) for r in range(p)]
        # a floor reads only these of a candidate (not cp_comm, vpp or the schedule beyond GPipe's held batches)
        reads = [(c.sp, c.zero, "full" if c.recompute == "per-stage" else c.recompute, c.schedule == "gpipe")
                 for c in cands]
        distinct: dict[tuple, Candidate] = {}
        for c, what in zip(cands, reads, strict=True):
            distinct.setdefault(what, c)
        for c in distinct.values():
            per_dense, per_expert, buffers = self._state_bytes(m, c.zero)
            mode = MEMORY_POLICY[c.recompute]
            rows = [self._layer_memory(c, kind, i, mode) for kind, i in self.layer_kinds.items()]
            states.append([per_dense * dense + per_expert * expert for dense, expert, _ in rows])
            acts.append([act for _, _, act in rows])
            held.append([mb] * p if c.schedule == "gpipe" else steady)
            fixed.append(buffers)
        floors = memory_floors(self.kind_counts, np.array(states), np.array(acts), np.array(held), np.array(fixed),
                               FRAGMENTATION)
        index = {what: n for n, what in enumerate(distinct)}
        return floors[[index[what] for what in reads]]

    def _state_bytes(self, m: Mesh, zero: int) -> tuple[float, float, float]:
        """(bytes per dense, per expert parameter on one GPU, buffers) under a mesh and ZeRO stage: the model states
        are linear in the parameters (memory.model_state_bytes)."""
        key = (m[:-1], zero)  # not the rank order: memory does not depend on where the ranks sit
        found = self.state_bytes.get(key)
        if found is None:
            lay = _FloorLayout(tp=m.tp, pp=m.pp, dp=m.dp, cp=m.cp, ep=m.ep, etp=m.etp, edp=m.edp, zero=zero)
            grad = self.rt.grad_bytes
            found = self.state_bytes[key] = (sum(model_state_bytes(StageParams(1.0, 0.0), lay,  # type: ignore[arg-type]
                                                                   False, grad)),
                                             sum(model_state_bytes(StageParams(0.0, 1.0), lay,  # type: ignore[arg-type]
                                                                   False, grad)),
                                             buffer_bytes(self.model, zero, m.tp))
        return found

    def _group_floor(self, g: Group, sp: bool, gpipe: bool, mode: str) -> float:
        """The memory floor (memory_floors, as _memory_floors: the activations of the micro-batches in flight) of
        the group's candidates with this sp, schedule kind and activation policy, at the least over its ZeRO
        stages: no such candidate of the group fits where it exceeds HBM. Shared by the mesh's rank orders (memory
        does not depend on where the ranks sit)."""
        m, p, mb = g.mesh, g.mesh.pp, g.num_microbatches
        key = (m[:-1], g.mbs, g.zeros, sp, gpipe, mode)
        found = self.group_floors.get(key)
        if found is not None:
            return found
        c = Candidate(m, g.mbs, sp, g.variants[0][1], g.zeros[0], "1f1b", 1, "none", self.modules)
        layers = np.array([self._layer_memory(c, kind, i, mode) for kind, i in self.layer_kinds.items()])
        states = np.array([self._state_bytes(m, z) for z in g.zeros])  # (zeros, 3)
        held = np.array([mb] * p if gpipe else [min(p - r, mb) for r in range(p)])
        per_layer = states[:, None, 0] * layers[None, :, 0] + states[:, None, 1] * layers[None, :, 1]
        floors = memory_floors(self.kind_counts, per_layer, layers[None, :, 2], held[None, :], states[:, 2],
                               FRAGMENTATION)
        found = self.group_floors[key] = float(floors.min())
        return found

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


    def _partition_cells(self, c: Candidate) -> int:
        """p (L+1)^2: the size of the candidate's (stage, first layer, end) grids, what its partition DPs cost."""
        return c.mesh.pp * (self.model.num_layers + 1) ** 2

    def _listable(self, c: Candidate) -> bool:
        """Whether the partition lists' p (L+1)^2-cell grids are small enough to build (about 200 MB at most)."""
        return self._partition_cells(c) <= LIST_MAX_CELLS

    def _pair_dp_fits(self, c: Candidate) -> bool:
        """Whether the O(p L^3) pair and sync DPs stay within about a second."""
        return self._partition_cells(c) * (self.model.num_layers + 1) <= PAIR_DP_MAX_CELLS

    def _group_scores(self, groups: list[Group], memory: bool = False) -> list[float]:
        """A lower bound for every candidate in each group: the least work bound over the group's variants, with no
        recomputation (the fastest). With memory, each variant's bound is that of the fastest recomputation whose
        memory floor may fit (_group_floor; where nothing fits the variant has no candidate, and the group scores
        inf where none of its variants has one). All groups' variants in one vectorised call."""
        rows, owner = [], []
        gbs = self.wl.global_batch
        for n, g in enumerate(groups):
            m, hop, seen = g.mesh, self._hop(g.mesh, g.mbs), set()
            mb = gbs // (g.mbs * m.dp)
            costs: dict = {}
            floors: dict = {}
            for sp, cc, sched, vpp in g.variants:
                work = "none"
                if memory:  # the fastest recomputation that may fit (work bounds: none <= selective <= full)
                    allowed = set(g.recomputes_for(vpp))
                    work = next((w for w, held, r in _BY_WORK if r in allowed
                                 and self._fits_floor(floors, g, sp, sched == "gpipe", held)), "")
                    if not work:
                        continue
                if (sp, cc, sched, work) in seen:  # the work bound reads vpp only through the schedule
                    continue
                seen.add((sp, cc, sched, work))
                if (sp, cc, work) not in costs:
                    costs[(sp, cc, work)] = self._key_costs(m, g.mbs, sp, cc, work)
                rows.append((costs[(sp, cc, work)], mb, m.pp, sched, hop))
                owner.append(n)
        scores = np.full(len(groups), math.inf)
        if rows:
            np.minimum.at(scores, np.array(owner), self._work_bounds(rows))
        return scores.tolist()

    def _fits_floor(self, floors: dict, g: Group, sp: bool, gpipe: bool, mode: str) -> bool:
        """Whether the group's memory floor with these settings fits (cached per group in `floors`); a miss is noted
        (_note_memory) for the "nothing fits" message."""
        key = (sp, gpipe, mode)
        if key not in floors:
            floor = floors[key] = self._group_floor(g, sp, gpipe, mode)
            if floor > self.cap:
                self._note_memory(floor, f"tp={g.mesh.tp} cp={g.mesh.cp} pp={g.mesh.pp} dp={g.mesh.dp}"
                                  + (f" ep={g.mesh.ep}" if g.mesh.ep > 1 else "") + f" mbs={g.mbs}")
        return floors[key] <= self.cap

    def _sp_dominates(self, g: Group, cc: CpComm) -> bool:
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



# recompute choices by their work bound, fastest first: (work bound's recomputation, memory floor's activations,
# the choice); per-stage may recompute no stage, but its floor holds full recomputation's activations
_BY_WORK = (("none", "none", "none"), ("none", "full", "per-stage"), ("selective", "selective", "selective"),
            ("full", "full", "full"))


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
    whole. Leading dimensions broadcast: states and acts (..., kinds), held (..., stages), fixed (...)."""
    per_layer = states[..., :, None] + held[..., None, :] * acts[..., :, None]  # (..., kinds, stages)
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = counts / np.sum(1.0 / per_layer, axis=-1)
    spread = np.where((counts > 0) & (per_layer.min(axis=-1) > 0), spread, 0.0)
    return (spread.max(axis=-1) + fixed) * (1 + fragmentation)


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


