"""One layout's costs (CostContext): its layers' passes with recomputation and offload, its collectives on their
links, the FP8 casts, and each stage's parameters and memory."""

from __future__ import annotations

import copy
import math
import dataclasses
from functools import cached_property

from meshplan.costmodels import comm
from meshplan.costmodels.config import Layout, Workload
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.kernels import copy_engine_exposed, overlapped_exposed, quant_bytes_per_element
from meshplan.costmodels.memory import (FRAGMENTATION, RESERVED_BYTES, MemoryBreakdown, StageParams,
                                        embedding_activation_bytes, layer_activation_bytes, logits_bytes,
                                        model_state_bytes, mtp_activation_bytes, stage_params)
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.passes import GroupLinks, PassCache, PassTimes, SyncCoefficients, with_recompute
from meshplan.costmodels.pipeline import Timeline
from meshplan.costmodels.runtime import Runtime
from meshplan.costmodels.timing import stage_p2p_s
from meshplan.hardware_db.cluster import Cluster

# read grad, master, m, v (16) + write master, m, v (12) + bf16 weight (2) + grad-norm read (4)
ADAM_BYTES_PER_PARAM = 34


FSDP_COPY_OUT_BYTES = 4.0
FSDP_COPY_IN_BYTES = 6.0


class CostContext:
    """Everything one configuration's costs need, resolved once; per-layer results cached (decoder layers differ
    only in being dense or MoE). estimate() and the planner's partitioner both read their numbers from here."""

    def __init__(self, model: ModelSpec, cluster: Cluster, wl: Workload, lay: Layout, rt: Runtime,
                 eff: Efficiency, links: dict[str, comm.Link] | None = None, passes: PassCache | None = None):
        self.model, self.cluster, self.wl, self.lay, self.rt, self.eff = model, cluster, wl, lay, rt, eff
        if passes is not None and any(a is not b for a, b in zip(passes.owner, (model, cluster, wl, rt, eff),
                                                                  strict=True)):
            raise ValueError("a PassCache serves one model, cluster, workload, runtime and efficiency")
        self.pass_cache = passes if passes is not None else PassCache(model, cluster, wl, rt, eff)
        gpu = cluster.gpu
        self.peak16 = gpu.peak_flops("bf16" if "bf16" in gpu.peak_tflops else "fp16")
        self.peak_fp8 = gpu.peak_flops("fp8") if wl.dtype == "fp8" else self.peak16
        self.hbm = gpu.hbm_bytes_per_s
        sizes = {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp, "pp": lay.pp, "ep": lay.ep, "etp": lay.etp, "edp": lay.edp,
                 "dp_cp": lay.dp * lay.cp}
        self.sizes = sizes
        # links depend on the mesh and rank order only: a caller holding them for this mesh may pass them in
        self.links = links if links is not None else GroupLinks(cluster, lay)
        self._layer_times: dict[tuple[bool, str], PassTimes] = {}
        self._layer_passes: dict[bool, tuple[PassTimes, float]] = {}
        self._layer_acts: dict[tuple[bool, str], float] = {}
        self._layer_params: dict[bool, StageParams] = {}

    def derive(self, lay: Layout) -> CostContext:
        """The same costs for a layout that differs only in stage partition or recomputation (what the planner
        varies once the mesh, micro-batch, ZeRO stage and schedule are fixed)."""
        mine = dataclasses.replace(self.lay, stage_layers=lay.stage_layers, stage_recompute=lay.stage_recompute,
                                   recompute=lay.recompute, chunks=lay.chunks)
        if mine != lay:
            raise ValueError("derive() needs the same mesh, micro-batch, ZeRO stage and schedule")
        other = copy.copy(self)
        other.lay = lay
        return other

    def share_layer_cache(self, other: CostContext) -> None:
        """Reuse another context's per-layer costs: valid when tp, cp, cp_comm, sp, mbs, ep and etp agree (and, with
        ZeRO-3's per-layer gathers in them, the DP groups)."""
        names: tuple[str, ...] = ("tp", "cp", "cp_comm", "sp", "mbs", "ep", "etp", "recompute_modules")
        if self.dp_in_layer_times or other.dp_in_layer_times:
            names += ("zero", "pp", "dp", "edp", "rank_order")
        for name in names:
            if getattr(self.lay, name) != getattr(other.lay, name):
                raise ValueError(f"layer costs differ in {name}")
        self._layer_times, self._layer_acts = other._layer_times, other._layer_acts
        self._layer_params, self._layer_passes = other._layer_params, other._layer_passes
        for name in ("embedding", "head"):
            if name in other.__dict__:
                self.__dict__[name] = other.__dict__[name]

    def layer_times(self, i: int, mode: str) -> PassTimes:
        key = (self.model.is_moe_layer(i), mode)
        if key not in self._layer_times:
            base, selective = self._layer_base(i)
            times = with_recompute(base, mode, selective)
            if self.dp_in_layer_times:  # after recomputation: it re-runs the layer with the weights gathered once
                times = times.plus(self._sharded_dp_passes(i, times))
            self._layer_times[key] = times
        return self._layer_times[key]

    @cached_property
    def reduce_in_backward(self) -> bool:
        """ZeRO-2/3 reduce-scatter each layer's gradients in every micro-batch's backward (Runtime.
        reduces_each_microbatch), not once after the step as ZeRO-0/1's accumulated buffer does."""
        return self.rt.reduces_each_microbatch(self.lay.zero, self.lay.pp)

    @property
    def dp_in_layer_times(self) -> bool:
        """The layer times hold DP collectives (so they depend on the DP groups): ZeRO-3's weight gathers, the
        per-micro-batch gradient reduce-scatters."""
        return self.lay.zero == 3 or self.reduce_in_backward

    def _sharded_dp_passes(self, i: int, base: PassTimes) -> PassTimes:
        """ZeRO-3 / FSDP: each micro-batch gathers layer i's weights before its forward and again before its
        backward (PyTorch FSDP2 reshard_after_forward; Megatron-FSDP optim_grads_params), prefetched during the
        layer before: exposed beyond that layer's compute (its recomputed forward included). ZeRO-2/3: the backward
        also reduce-scatters the layer's gradients (fp32, as the step-end reduce: sync); nothing waits on it until
        the optimizer step, so it runs on the link whenever the gathers leave it idle during the layer's compute,
        forward and backward. The hidden parts slow the compute (kernels.overlapped_exposed); a blocking reduce is
        exposed in full."""
        p = self.layer_params(i)

        def alpha_beta(a_d: float, b_d: float, a_e: float, b_e: float) -> float:
            return (a_d + b_d * p.dense if p.dense > 0 else 0.0) + (a_e + b_e * p.expert if p.expert > 0 else 0.0)

        gather = alpha_beta(*self.fsdp_gather) if self.lay.zero == 3 else 0.0
        scatter = alpha_beta(*self.grad_scatter) if self.reduce_in_backward else 0.0
        ph = self.eff.physics
        fwd_window = base.fwd_compute
        bwd_window = base.bwd_input_compute + base.bwd_weight_compute + base.recompute
        fwd = overlapped_exposed(gather, fwd_window, 0.0, ph)
        bwd = overlapped_exposed(gather, bwd_window, 0.0, ph)
        if self.rt.overlap_grad_reduce:
            idle = max(0.0, fwd_window + bwd_window - 2 * gather)  # the layer's compute with the link free
            bwd += overlapped_exposed(scatter, idle, 0.0, ph)
        else:
            bwd += scatter
        if self.rt.fsdp_copies:  # on the compute stream, so never hidden
            params = p.dense + p.expert
            copy_out = FSDP_COPY_OUT_BYTES * params / (self.hbm * self.eff.memory_bandwidth) if gather else 0.0
            copy_in = FSDP_COPY_IN_BYTES * params / (self.hbm * self.eff.memory_bandwidth) if scatter else 0.0
            fwd += copy_out
            bwd += copy_out + copy_in
        return PassTimes(fwd_comm={"dp": fwd}, bwd_comm={"dp": bwd})

    def _layer_base(self, i: int) -> tuple[PassTimes, float]:
        kind = self.model.is_moe_layer(i)
        if kind not in self._layer_passes:
            self._layer_passes[kind] = self.pass_cache.layer(i, self.lay, self.links)
        return self._layer_passes[kind]

    def layer_activation(self, i: int, mode: str) -> float:
        key = (self.model.is_moe_layer(i), mode)
        if key not in self._layer_acts:
            self._layer_acts[key] = (layer_activation_bytes(self.model, i, self.lay, self.wl, self.rt, mode)
                                     * self.eff.activation_ratio(mode))
        return self._layer_acts[key]

    def layer_params(self, i: int) -> StageParams:
        key = self.model.is_moe_layer(i)
        if key not in self._layer_params:
            self._layer_params[key] = stage_params(self.model, self.lay, range(i, i + 1), False, False)
        return self._layer_params[key]

    @cached_property
    def embedding(self) -> PassTimes:
        return self.pass_cache.embedding(self.lay, self.links)

    @cached_property
    def head(self) -> PassTimes:
        """The last stage's own block (PassCache.head: the LM head and loss, and the MTP modules)."""
        return self.pass_cache.head(self.lay, self.links)

    @cached_property
    def p2p_s(self) -> float:
        """P2P of one micro-batch's activations between stages; Megatron sends 1/tp with scatter-gather (SC'21 4.1)."""
        return stage_p2p_s(self.model, self.wl, self.lay, self.links["pp"], self.eff)

    @property
    def blocking_p2p_s(self) -> float:
        return 0.0 if self.rt.p2p_overlap else self.p2p_s

    @cached_property
    def sync(self) -> SyncCoefficients:
        """Megatron reduces fp32 gradients when training in bf16 (--accumulate-allreduce-grads-in-fp32,
        arguments.py; Runtime.grad_bytes, bf16 under the "bf16-grads" option); ZeRO-0 all-reduces, ZeRO >= 1
        reduce-scatters gradients and all-gathers the updated 16-bit weights (Megatron-LM docs,
        distrib_optimizer.md). ZeRO-3 / FSDP gathers each layer's weights for every micro-batch's forward and
        backward instead (CostContext.fsdp_gather, in the stage times), not after the step."""
        lay = self.lay
        coef: dict[str, float] = {}
        for kind, dim in (("dense", "dp_cp"), ("expert", "edp")):
            n, link = self.sizes[dim], self.links[dim]
            ra = rb = ga = gb = 0.0
            if n > 1:
                # alpha-beta ring (comm.py): all-reduce 2(n-1) steps / 2(n-1)/n of the bytes, RS and AG half of that;
                # calibrated: the measured alpha and 1/beta of that collective (timed_collective).
                reduce_kind = "all_reduce" if lay.zero == 0 else "reduce_scatter"
                ra, rb = self._alpha_beta(reduce_kind, n, link, self.rt.grad_bytes)
                if lay.zero in (1, 2):
                    ga, gb = self._alpha_beta("all_gather", n, link, 2)
            coef.update({f"reduce_alpha_{kind}": ra, f"reduce_beta_{kind}": rb, f"gather_alpha_{kind}": ga,
                         f"gather_beta_{kind}": gb})
        per_param = self.eff.optimizer_s_per_param or ADAM_BYTES_PER_PARAM / (self.hbm * self.eff.memory_bandwidth)
        shard_dense = lay.dp * lay.cp if lay.zero >= 1 else 1
        shard_expert = lay.edp if lay.zero >= 1 else 1
        return SyncCoefficients(**coef, optimizer_s_per_dense_param=per_param / shard_dense,
                                optimizer_s_per_expert_param=per_param / shard_expert)

    @cached_property
    def fsdp_gather(self) -> tuple[float, float, float, float]:
        """ZeRO-3 / FSDP: (alpha, seconds per parameter) of one all-gather of 16-bit weights over dp x cp (dense)
        and over the expert-DP group (experts), run for each micro-batch's forward and again for its backward
        (PyTorch FSDP2 reshard_after_forward, Megatron-FSDP optim_grads_params)."""
        return self._dp_collective("all_gather", 2)

    @cached_property
    def grad_scatter(self) -> tuple[float, float, float, float]:
        """ZeRO-2/3: (alpha, seconds per parameter) of one reduce-scatter of gradients (Runtime.grad_bytes) over
        dp x cp (dense) and over the expert-DP group (experts), run in every micro-batch's backward
        (reduce_in_backward)."""
        return self._dp_collective("reduce_scatter", self.rt.grad_bytes)

    def _dp_collective(self, kind: str, bytes_per_param: float) -> tuple[float, float, float, float]:
        """(alpha, seconds per parameter) of one collective over dp x cp, then over the expert-DP group."""
        out = []
        for dim in ("dp_cp", "edp"):
            n = self.sizes[dim]
            out += list(self._alpha_beta(kind, n, self.links[dim], bytes_per_param)) if n > 1 else [0.0, 0.0]
        return out[0], out[1], out[2], out[3]

    @cached_property
    def buffer_bytes(self) -> float:
        return buffer_bytes(self.model, self.lay.zero, self.lay.tp)

    def _alpha_beta(self, kind: str, n: int, link: comm.Link, bytes_per_param: float) -> tuple[float, float]:
        """(seconds, seconds per parameter) of a collective over n ranks moving bytes_per_param per parameter."""
        fit = self.eff.collective_fit(kind, n, link)
        if fit is not None:
            return fit[0], bytes_per_param / fit[1]
        steps, share = comm.ring_shape(kind, n)
        return steps * link.latency_s, share * bytes_per_param / link.bus_bytes_per_s


def buffer_bytes(model: ModelSpec, zero: int, tp: int) -> float:
    """Per-GPU buffers on every stage: the reserved allowance, and under ZeRO-3 two gathered layers in flight."""
    buffers = RESERVED_BYTES
    if zero == 3:
        kinds = {model.is_moe_layer(i): i for i in range(model.num_layers)}  # layers differ only in kind
        biggest = max(model.layer_params(i) for i in kinds.values()) / tp
        buffers += 2 * 2 * biggest  # two gathered 16-bit layers in flight (prefetch)
    return buffers


def offload_passes(ctx: CostContext, modes: tuple[str, ...]) -> PassTimes:
    """What activation offload adds to a micro-batch (pp 1): each offloaded layer's activations leave for the host
    during the next layer's forward and come back during the next layer's backward, over the GPU-host link on the
    copy engines (TransformerEngine cpu_offload.py, Megatron --cpu-offloading-num-layers)."""
    bw = ctx.cluster.gpu.host_link_bytes_per_s
    ph = ctx.eff.physics
    out = inn = 0.0
    for i in range(ctx.lay.offload_layers):
        t = ctx.layer_activation(i, modes[i]) / bw
        nxt = ctx.layer_times(i + 1, modes[i + 1])
        out += copy_engine_exposed(t, nxt.fwd_compute, ph)
        inn += copy_engine_exposed(t, nxt.bwd_input_compute + nxt.bwd_weight_compute, ph)
    return PassTimes(fwd_comm={"offload": out}, bwd_comm={"offload": inn})


def stage_ranges(lay: Layout) -> list[list[tuple[int, int]]]:
    """Per pipeline rank, per chunk: (first layer, count)."""
    chunks = lay.chunk_layers()
    return [[chunks[c * lay.pp + r] for c in range(lay.vpp)] for r in range(lay.pp)]


def layer_modes(lay: Layout) -> tuple[str, ...]:
    """Recompute mode of every decoder layer: a stage's policy applies to its layers in model order."""
    modes = [""] * sum(lay.stage_layers)
    for r, chunks in enumerate(stage_ranges(lay)):
        position = 0
        for first, count in chunks:
            for i in range(first, first + count):
                modes[i] = lay.stage_recompute[r].layer_mode(position)
                position += 1
    return tuple(modes)


def fp8_weight_cast_s(ctx: CostContext, params: StageParams, first: bool, last: bool) -> float:
    """FP8 training casts each GEMM weight to FP8 (with its transposed copy) once per step: TransformerEngine
    quantises in the first micro-batch and reuses it (Megatron passes is_first_microbatch), or at the parameter
    gather with FP8 weights (docs/features/low_precision_training, 'Master weights'). Embedding and LM head stay
    16-bit (DeepSeek-V3 report sec. 3.3.1)."""
    if ctx.wl.dtype != "fp8" or not ctx.eff.physics.fp8:
        return 0.0
    edge = stage_params(ctx.model, ctx.lay, range(0), first, last)
    weights = max(0.0, params.dense - edge.dense) + params.expert
    per_element = quant_bytes_per_element(ctx.wl.fp8_recipe, ctx.eff.fp8_any_layout, ctx.rt.mx_cast_per_dim)
    return weights * per_element / (ctx.hbm * ctx.eff.memory_bandwidth)


def layer_mix(model: ModelSpec, layers: range, modes: tuple[str, ...]) -> dict[tuple[int, str], int]:
    """How many of `layers` run in each (kind, recompute mode), keyed by one layer of that kind: layers of one
    kind cost the same (CostContext caches by kind), so a stage's sums need one term per key, not per layer."""
    first_of_kind: dict[bool, int] = {}
    mix: dict[tuple[int, str], int] = {}
    for i in layers:
        rep = first_of_kind.setdefault(model.is_moe_layer(i), i)
        mix[(rep, modes[i])] = mix.get((rep, modes[i]), 0) + 1
    return mix


def stage_params_for(ctx: CostContext, chunks: list[tuple[int, int]], modes: tuple[str, ...], first: bool,
                  last: bool) -> StageParams:
    """stage_params of a rank's chunks (non-contiguous under virtual stages) from the context's per-kind counts."""
    edge = stage_params(ctx.model, ctx.lay, range(0), first, last)
    dense, expert = edge.dense, edge.expert
    for f, n in chunks:
        for (rep, _), count in layer_mix(ctx.model, range(f, f + n), modes).items():
            per = ctx.layer_params(rep)
            dense += count * per.dense
            expert += count * per.expert
    return StageParams(dense, expert)


def stage_memory(ctx: CostContext, rank: int, chunks: list[tuple[int, int]], params: StageParams,
                  timeline: Timeline, modes: tuple[str, ...]) -> MemoryBreakdown:
    model, lay, wl, rt = ctx.model, ctx.lay, ctx.wl, ctx.rt
    weights, grads, optim = model_state_bytes(params, lay, rt.holds_unsharded_grads(lay.zero, lay.pp), rt.grad_bytes)
    acts = 0.0
    group = lay.recompute_group
    for c, (first, count) in enumerate(chunks):
        held = timeline.peak_in_flight[rank][c]
        mix = layer_mix(ctx.model, range(first, first + count), modes)
        per_mb = sum(n * ctx.layer_activation(i, mode) for (i, mode), n in mix.items())
        if group > 1 and count:
            # Megatron's uniform method keeps one input per group of `group` layers of a chunk, the last group
            # smaller (transformer_block.py _checkpointed_forward): ceil(count / group) inputs, not count
            per_mb -= (count - math.ceil(count / group)) * ctx.layer_activation(first, "full")
        acts += held * per_mb
    if rank == 0:
        acts += sum(timeline.peak_in_flight[0]) * embedding_activation_bytes(model, lay, wl, rt)
    if lay.offload_layers:  # pp 1: the first layers' activations wait on the host, one layer's in transit
        off = [ctx.layer_activation(i, modes[i]) for i in range(lay.offload_layers)]
        acts -= timeline.peak_in_flight[0][0] * sum(off) - max(off)
    first = chunks[0][0]
    if lay.stage_recompute[rank].granularity != "none":
        # The layer being recomputed holds what recomputation regenerates during its backward (Korthikanti sec. 5);
        # in groups, the group's layers all at once over its one kept input (Megatron's uniform method)
        rebuilt = min(group, max(n for _, n in chunks)) if lay.stage_recompute[rank].granularity == "full" else 1
        acts += rebuilt * ctx.layer_activation(first, "none") - ctx.layer_activation(first, modes[first])
    logits = logits_bytes(model, lay, wl, rt) if rank == lay.pp - 1 else 0.0
    if rank == lay.pp - 1:
        acts += mtp_activation_bytes(model, lay, wl, rt)  # one micro-batch's, as for the logits
    buffers = ctx.buffer_bytes
    sub = weights + grads + optim + acts + logits + buffers
    return MemoryBreakdown(weights, grads, optim, acts, logits, buffers, FRAGMENTATION * sub)
