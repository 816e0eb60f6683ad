"""One configuration's cost: step time (event-simulated pipeline), throughput, MFU/HFU and memory per stage."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from meshplan.costmodels.config import Layout, ParallelConfig, Workload, resolve
from meshplan.costmodels.context import (CostContext, fp8_weight_cast_s, layer_mix, layer_modes, offload_passes,
                                         stage_memory, stage_params_for, stage_ranges)
from meshplan.costmodels.deadline import Deadline, check
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.kernels import Physics, overlapped_exposed
from meshplan.costmodels.memory import GIB, MemoryBreakdown, stage_params
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.passes import PassTimes
from meshplan.costmodels.pipeline import StageTimes, Timeline, build_schedule, compile_order, simulate
from meshplan.costmodels.realism import RealismCheck
from meshplan.costmodels.realism import check as realism_check
from meshplan.costmodels.runtime import DEFAULT_RUNTIME, Runtime, get_runtime
from meshplan.costmodels.uncertainty import (Interval, MemoryInterval, MemoryVerdict, memory_interval,
                                             prediction_interval, region_of)
from meshplan.hardware_db.cluster import Cluster
from meshplan.hardware_db.errors import InputError




@dataclass(frozen=True)
class StageReport:
    rank: int
    layers: tuple[int, int]  # first layer, count (all chunks of the stage together)
    memory: MemoryBreakdown
    in_flight: int

    @property
    def peak_gib(self) -> float:
        return self.memory.total / GIB


@dataclass(frozen=True)
class Estimate:
    """What one configuration costs. Times in seconds, memory in GiB."""

    layout: Layout
    runtime: str
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    hfu: float
    breakdown_s: dict[str, float]
    stages: tuple[StageReport, ...]
    hbm_gib: float
    bubble_fraction: float
    realism: RealismCheck | None = None  # the MFU beside the best published for its class (costmodels/realism.py)
    # how far measured runs of its region were from their predictions (costmodels/uncertainty.py); None under a
    # calibration or with physics switched off, whose errors the shipped residuals do not describe
    interval: Interval | None = None
    # how far measured peak memory was from its prediction (costmodels/uncertainty.py memory_interval); None where a
    # calibration moved the activations (the shipped errors describe the default memory model), kept under one that
    # moved time only
    memory_interval: MemoryInterval | None = None

    @property
    def peak_memory_gib(self) -> float:
        return max(s.peak_gib for s in self.stages)

    @property
    def fits(self) -> bool:
        """At the estimate: what the search keeps. memory_verdict says how sure that is."""
        return self.peak_memory_gib <= self.hbm_gib

    @property
    def memory_verdict(self) -> MemoryVerdict | None:
        if self.memory_interval is None:
            return None
        return self.memory_interval.verdict(self.peak_memory_gib, self.hbm_gib)

    def to_dict(self) -> dict:
        return {
            "step_time_s": self.step_time_s,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu,
            "hfu": self.hfu,
            "peak_memory_gib": self.peak_memory_gib,
            "hbm_gib": self.hbm_gib,
            "fits": self.fits,
            "bubble_fraction": self.bubble_fraction,
            "breakdown_s": self.breakdown_s,
            "layout": layout_dict(self.layout),
            "runtime": self.runtime,
            "interval": None if self.interval is None else interval_dict(self.interval, self.step_time_s,
                                                                          self.tokens_per_s_per_gpu),
            "memory_range": None if self.memory_interval is None else memory_interval_dict(
                self.memory_interval, self.peak_memory_gib, self.hbm_gib),
            "realism": None if self.realism is None else {
                "published_mfu": self.realism.published_mfu, "run": self.realism.run, "source": self.realism.source,
                "exceeds": self.realism.exceeds, "within_error": self.realism.within_error},
            "stages": [
                {"rank": s.rank, "first_layer": s.layers[0], "num_layers": s.layers[1],
                 "in_flight_microbatches": s.in_flight, "peak_memory_gib": s.peak_gib,
                 "memory_gib": {k: v / GIB for k, v in asdict(s.memory).items()}}
                for s in self.stages
            ],
        }


def interval_dict(interval: Interval, step_time_s: float, tokens_per_s_per_gpu: float) -> dict:
    """An estimate's interval as the plan JSON and `estimate --json` write it."""
    return {"level": interval.level, "runs": interval.runs, "dropped": list(interval.dropped),
            "step_time_s": list(interval.step_time(step_time_s)),
            "tokens_per_s_per_gpu": list(interval.throughput(tokens_per_s_per_gpu))}


def memory_interval_dict(interval: MemoryInterval, peak_gib: float, hbm_gib: float) -> dict:
    """An estimate's memory interval as the plan JSON and `estimate --json` write it."""
    return {"level": interval.level, "runs": interval.runs, "peak_gib": list(interval.peak_gib(peak_gib)),
            "verdict": interval.verdict(peak_gib, hbm_gib)}


def layout_dict(lay: Layout) -> dict:
    d = {k: v for k, v in vars(lay).items()}
    d["stage_layers"] = list(lay.stage_layers)
    d["stage_recompute"] = [p.model_dump() for p in lay.stage_recompute]
    return d


@dataclass(frozen=True)
class Simulated:
    """An estimate together with the simulated timeline it came from (for traces)."""

    estimate: Estimate
    timeline: Timeline
    p2p_s: float


def estimate(model: ModelSpec, cluster: Cluster, workload: Workload, cfg: ParallelConfig,
             runtime: str = DEFAULT_RUNTIME, efficiency: Efficiency | None = None) -> Estimate:
    """Cost of one configuration; raises InputError when the configuration is inconsistent."""
    return simulate_config(model, cluster, workload, cfg, runtime, efficiency).estimate


def simulate_config(model: ModelSpec, cluster: Cluster, workload: Workload, cfg: ParallelConfig,
                    runtime: str = DEFAULT_RUNTIME, efficiency: Efficiency | None = None,
                    context: CostContext | None = None, timelines: dict | None = None,
                    deadline: Deadline | None = None) -> Simulated:
    """estimate() that also returns the timeline; `context` reuses cached layer costs of the same mesh, and
    `timelines` (a dict the caller keeps) reuses the simulation of identical stage times (a planner's ZeRO
    variants share their pipeline and differ only after it) and each schedule's pass order. deadline: checked
    per pipeline rank and inside the pipeline simulation (TimeLimitReached)."""
    check(deadline)
    lay = resolve(model, cluster.num_gpus, workload, cfg)
    rt = get_runtime(runtime)
    why = rt.lacks(recompute_modules=lay.recompute_modules)
    if why:
        raise InputError(why)
    eff = efficiency or Efficiency.from_gpu(cluster.gpu)
    ctx = context.derive(lay) if context is not None else CostContext(model, cluster, workload, lay, rt, eff)
    ranges = stage_ranges(lay)
    modes = layer_modes(lay)
    chunk_pass = _chunk_passes(ctx, model, lay, ranges, modes, deadline)
    timeline = _pipeline_timeline(lay, chunk_pass, ctx.p2p_s, ctx.blocking_p2p_s, timelines, deadline)

    # Data-parallel gradient reduction, parameter gather and optimizer step, per pipeline rank.
    ends = [_rank_end(ctx, lay, rt, eff, r, ranges, modes, chunk_pass[r], timeline) for r in range(lay.pp)]
    finish = [timeline.rank_end[r] + end.dp_exposed_s + end.optimizer_s for r, end in enumerate(ends)]
    step = max(finish)
    crit = finish.index(step)
    breakdown = _breakdown(chunk_pass[crit], lay.num_microbatches, timeline.busy[crit], timeline.rank_end[crit],
                           ends[crit])

    tokens = workload.tokens
    model_flops = model_flops_per_step(model, workload)
    hw_flops = model_flops + recompute_flops_per_step(model, workload, modes, lay.recompute_modules)
    gpus = cluster.num_gpus
    peak = ctx.peak_fp8 if workload.dtype == "fp8" else ctx.peak16
    mfu = model_flops / step / gpus / peak
    table = eff.residual_table
    interval = (prediction_interval(region_of(model, lay, workload, cluster.spec.gpu, cluster.gpus_per_node, rt.name),
                                    table=table) if table is not None and eff.physics == Physics() else None)
    est = Estimate(
        layout=lay, runtime=rt.name, step_time_s=step, tokens_per_s=tokens / step,
        tokens_per_s_per_gpu=tokens / step / gpus, tflops_per_gpu=model_flops / step / gpus / 1e12,
        mfu=mfu, hfu=hw_flops / step / gpus / peak, breakdown_s=breakdown,
        stages=tuple(end.report for end in ends), hbm_gib=cluster.gpu.hbm_gib.value,
        bubble_fraction=timeline.bubble_fraction(),
        realism=realism_check(cluster.spec.gpu, model.moe is not None, workload.dtype, mfu,
                              None if interval is None else mfu * math.exp(-interval.hi)),
        interval=interval,
        memory_interval=memory_interval() if eff.activation_factor == 1.0 and not eff.activation_ratios else None,
    )
    return Simulated(est, timeline, ctx.p2p_s)


def _chunk_passes(ctx: CostContext, model: ModelSpec, lay: Layout, ranges: list[list[tuple[int, int]]],
                  modes: tuple[str, ...], deadline: Deadline | None) -> list[list[PassTimes]]:
    """Each pipeline rank's model chunks' pass times: their layers', plus the embedding (and offload) on the first
    chunk of rank 0 and the head on the last chunk of the last rank."""
    last_rank, last_chunk = lay.pp - 1, lay.vpp - 1
    chunk_pass: list[list[PassTimes]] = []
    for r in range(lay.pp):
        check(deadline)
        row = []
        for c, (first, count) in enumerate(ranges[r]):
            mix = layer_mix(model, range(first, first + count), modes)
            t = PassTimes.total([(ctx.layer_times(i, mode), n) for (i, mode), n in mix.items()])
            if r == 0 and c == 0:
                t = t.plus(ctx.embedding)
                if lay.offload_layers:
                    t = t.plus(offload_passes(ctx, modes))
            if r == last_rank and c == last_chunk:
                t = t.plus(ctx.head)
            row.append(t)
        chunk_pass.append(row)
    return chunk_pass


def _pipeline_timeline(lay: Layout, chunk_pass: list[list[PassTimes]], p2p_s: float, blocking_p2p: float,
                       timelines: dict | None, deadline: Deadline | None) -> Timeline:
    """The schedule simulated under these stage times (pipeline.py), reusing `timelines`' copy of the same times
    and of the schedule's compiled pass order."""
    times = [[StageTimes(t.forward + blocking_p2p, t.backward_input + blocking_p2p, t.bwd_weight_compute)
              for t in row] for row in chunk_pass]
    key = (lay.schedule, lay.num_microbatches, p2p_s, tuple(tuple(row) for row in times))
    timeline = timelines.get(key) if timelines is not None else None
    if timeline is not None:
        return timeline
    order_key = ("schedule", lay.schedule, lay.pp, lay.num_microbatches, lay.vpp)  # the pass order alone
    sched = timelines.get(order_key) if timelines is not None else None
    if sched is None:
        sched = build_schedule(lay.schedule, lay.pp, lay.num_microbatches, lay.vpp)
        if lay.schedule != "zb":  # a fixed order: compiled once, simulated under every stage time
            sched = compile_order(sched, deadline)
        if timelines is not None:
            timelines[order_key] = sched
    timeline = simulate(sched, times, p2p_s, split_weight=lay.schedule == "zb", deadline=deadline)
    if timelines is not None:
        timelines[key] = timeline
    return timeline


@dataclass(frozen=True)
class _RankEnd:
    """What a pipeline rank does after its last pass: the exposed DP sync, the optimizer step, and its report."""

    dp_exposed_s: float
    optimizer_s: float
    report: StageReport


def _rank_end(ctx: CostContext, lay: Layout, rt: Runtime, eff: Efficiency, r: int,
              ranges: list[list[tuple[int, int]]], modes: tuple[str, ...], passes: list[PassTimes],
              timeline: Timeline) -> _RankEnd:
    """Rank r's data-parallel gradient reduction and parameter gather left exposed after its backward and forward
    windows, its optimizer step (with FP8 weight casts) and its stage report (memory, micro-batches in flight)."""
    sync = ctx.sync
    first_rank, last_rank = r == 0, r == lay.pp - 1
    first = ranges[r][0][0]
    count = sum(n for _, n in ranges[r])
    params = stage_params_for(ctx, ranges[r], modes, first_rank, last_rank)
    t_reduce, t_gather = sync.reduce(params.dense, params.expert), sync.gather(params.dense, params.expert)
    bwd_window = sum(t.backward_input + t.bwd_weight_compute for t in passes)
    fwd_window = sum(t.forward for t in passes)
    # Megatron's overlap leaves one bucket exposed: the last layer's gradients, the first layer's weights
    # (one virtual stage with interleaving): kernels.overlapped_exposed
    unhidden = 1 / lay.vpp if lay.vpp > 1 else 1 / max(count, 1)
    if ctx.reduce_in_backward:
        # the layers' reduce-scatters ran in each backward (layer_times); the embedding / head / MTP gradients
        # of the last micro-batch remain, and the last layer bucket, which no compute follows
        edges = stage_params(ctx.model, lay, range(0), first_rank, last_rank)
        t_edges = sync.reduce(edges.dense, edges.expert)
        tail = unhidden * (t_reduce - t_edges) if eff.physics.overlap_limits and rt.overlap_grad_reduce else 0.0
        exposed = tail + (t_edges if not rt.overlap_grad_reduce
                          else overlapped_exposed(t_edges, bwd_window, 0.0, eff.physics))
    else:
        exposed = (t_reduce if not rt.overlap_grad_reduce
                   else overlapped_exposed(t_reduce, bwd_window, unhidden, eff.physics))
    exposed += (t_gather if not rt.overlap_param_gather
                else overlapped_exposed(t_gather, fwd_window, unhidden, eff.physics))
    optim = sync.optimizer(params.dense, params.expert) + fp8_weight_cast_s(ctx, params, first_rank, last_rank)
    report = StageReport(r, (first, count), stage_memory(ctx, r, ranges[r], params, timeline, modes),
                         sum(timeline.peak_in_flight[r]))
    return _RankEnd(exposed, optim, report)


def _breakdown(passes: list[PassTimes], m: int, busy: float, rank_end: float, end: _RankEnd) -> dict[str, float]:
    """The critical rank's step split into compute, recompute, each dimension's exposed communication, the
    pipeline's P2P and bubble, the DP sync and the optimizer (seconds; they sum to the step)."""
    comm_by_dim: dict[str, float] = {}
    compute = recompute = 0.0
    for t in passes:
        compute += m * (t.fwd_compute + t.bwd_input_compute + t.bwd_weight_compute)
        recompute += m * t.recompute
        for d, v in list(t.fwd_comm.items()) + list(t.bwd_comm.items()):
            comm_by_dim[d] = comm_by_dim.get(d, 0.0) + m * v
    pp_comm = busy - compute - recompute - sum(comm_by_dim.values())
    breakdown = {"compute": compute, "recompute": recompute}
    breakdown.update({f"{d}_comm": v for d, v in sorted(comm_by_dim.items())})
    breakdown["pp_comm"] = max(0.0, pp_comm)
    breakdown["pipeline_bubble"] = rank_end - busy
    # the step-end DP exposure adds to the per-layer DP collectives of ZeRO-2/3 (their "dp" key above)
    breakdown["dp_comm"] = breakdown.get("dp_comm", 0.0) + end.dp_exposed_s
    breakdown["optimizer"] = end.optimizer_s
    return breakdown


def model_flops_per_step(model: ModelSpec, wl: Workload) -> float:
    """6 x active non-embedding parameters x tokens (LM head included, as Megatron counts it) + causal attention
    3 x L x heads x s x (d_qk + d_v) per token: the PaLM accounting (Chowdhery et al. 2022, App. B) with the masked
    half of causal attention left out, so long sequences do not inflate MFU (Megatron-LM's 2021 formula and the
    published runs count it in full; benchmarks/reference_runs.py uses each run's own accounting)."""
    n = model.active_params() - model.embedding_params()
    if model.tied_embeddings:
        n += model.vocab * model.hidden  # the LM head matmul runs even when its weight is the embedding's
    if model.mla is None:
        d_qk = d_v = model.head_size
    else:
        d_qk, d_v = model.mla.qk_head_dim, model.mla.v_head_dim
    attn = 3 * model.num_layers * model.num_heads * wl.seq_len * (d_qk + d_v)
    return (6 * n + attn) * wl.tokens


def recompute_flops_per_step(model: ModelSpec, wl: Workload, modes: tuple[str, ...],
                             modules: tuple[str, ...] = ("core_attn",)) -> float:
    """Extra forward FLOPs recomputation executes (counted in HFU, not MFU; Korthikanti et al. 2022, sec. 6):
    the whole layer's forward under full; under selective its modules' matmuls (2 FLOPs per weight per token; the
    attention core's causal half, as above)."""
    d = model.head_size if model.mla is None else model.mla.qk_head_dim
    core = 2 * model.num_heads * wl.seq_len * d
    total = 0.0
    for i, mode in enumerate(modes):
        if mode == "full":
            total += 2 * model.layer_params(i, active_only=True) + core
        elif mode == "selective":
            total += _selective_flops_per_token(model, i, modules, core)
    return total * wl.tokens


def _selective_flops_per_token(model: ModelSpec, i: int, modules: tuple[str, ...], core: float) -> float:
    total = core if "core_attn" in modules else 0.0
    a, moe = model.mla, model.moe
    if "mla_up_proj" in modules and a is not None:
        total += 2 * model.num_heads * ((a.q_lora_rank or 0) * a.qk_head_dim
                                        + a.kv_lora_rank * (a.qk_nope_head_dim + a.v_head_dim))
    if not model.is_moe_layer(i):
        return total + (2 * model.mlp_params(model.ffn_hidden) if "mlp" in modules else 0.0)
    assert moe is not None
    shared = moe.num_shared_experts * model.mlp_params(moe.shared_hidden) if moe.num_shared_experts else 0
    if "moe" in modules:
        total += 2 * (moe.top_k * model.mlp_params(moe.expert_ffn_hidden) + shared + model.hidden * moe.num_experts)
    elif "shared_experts" in modules:
        total += 2 * shared
    return total
