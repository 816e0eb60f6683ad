"""One configuration's cost: step time (event-simulated pipeline), throughput, MFU/HFU and memory per stage."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import asdict, dataclass, field
from functools import cached_property
from operator import attrgetter

from meshplan.costmodels import comm
from meshplan.costmodels.calibrate import interpolate
from meshplan.costmodels.config import (DEFAULT_RANK_ORDER, DEFAULT_RUNTIME, Layout, ParallelConfig, Runtime, Workload,
                                        get_runtime, resolve)
from meshplan.costmodels.deadline import Deadline, check
from meshplan.costmodels.kernels import (FA2_BACKWARD_OVER_FORWARD, SDPA_FLASH_OVER_FA2, TE_GEMM_STREAMS, Physics,
                                         attention_keys_factor, causal_tile_factor, column_gemm_count,
                                         copy_engine_exposed, fp8_kernel_ceiling, k_depth_factor, overlapped_exposed,
                                         quant_bytes_per_element, ring_cp_exposed, tp_exposed_fraction, tp_gemm_chunks)
from meshplan.costmodels.memory import (FRAGMENTATION, GIB, RESERVED_BYTES, MemoryBreakdown, StageParams,
                                        embedding_activation_bytes, layer_activation_bytes, logits_bytes,
                                        model_state_bytes, mtp_activation_bytes, stage_params)
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.ops import (ACT_BYTES, Block, Collective, Op, attention_half, embedding_block,
                                     ep_dispatch_bytes, head_block, memory_class, mlp_half, mtp_projection,
                                     recompute_modules_of)
from meshplan.costmodels.pipeline import StageTimes, Timeline, build_schedule, compile_order, simulate
from meshplan.costmodels.realism import RealismCheck
from meshplan.costmodels.realism import check as realism_check
from meshplan.hardware_db.calibration import (Calibration, Curve, LayerOverhead, StepOverhead, calibrated_gpu,
                                              cpu_device_spec, digest)
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import GPUSpec, load_gpu

EXECUTOR_RUNTIME = "meshplan-executor"  # the reference executor's preset (config.RUNTIMES): what profiles measure
ADAM_BYTES_PER_PARAM = 34  # read grad, master, m, v (16) + write master, m, v (12) + bf16 weight (2) + grad-norm read (4)
RANK_ORDER = tuple(DEFAULT_RANK_ORDER.split("-"))  # innermost first: Megatron-LM's default "tp-cp-ep-dp-pp"


@dataclass(frozen=True)
class Efficiency:
    """Achieved fractions that turn peak numbers into time (from the GPU's defaults or a calibration).

    A calibration adds measured curves (FLOPs, seconds), which replace the saturating efficiency for GEMMs and
    attention, and measured (alpha, bytes/s) per collective kind and group size, which replace the ring formula
    inside one node for the group sizes that were profiled."""

    gemm_max: float
    gemm_half_flops: float
    attention_max: float
    memory_bandwidth: float
    kernel_overhead_s: float
    gemm_curve: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    attention_curve: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    gemm_bwd_curve: tuple[tuple[float, ...], tuple[float, ...]] | None = None  # backward passes (else gemm_curve)
    attention_bwd_curve: tuple[tuple[float, ...], tuple[float, ...]] | None = None
    layer_overhead: tuple[LayerOverhead, ...] = ()  # per decoder layer, by TP degree and SP
    head_overhead: StepOverhead | None = None  # per micro-batch, outside the layers
    collectives: tuple[tuple[str, int, float, float], ...] = ()  # (kind, ranks, alpha_s, bytes_per_s)
    memory_classes: tuple[tuple[str, float, float], ...] = ()  # (ops.memory_class, alpha_s, bytes_per_s)
    optimizer_s_per_param: float | None = None  # measured optimizer step per local parameter
    curve_peak: float = 0.0  # the 16-bit peak the curves were measured against (fp8 GEMMs: half the time)
    activation_ratios: tuple[tuple[str, float], ...] = ()  # (recompute mode, measured / formula activations)
    calibration: str | None = None  # "file name sha256:..." of the calibration, for the plan's record
    # kernel ceilings beyond the BF16 GEMM (hardware_db.gpu.EfficiencyDefaults; kernels.py states the physics)
    gemm_k_half: float = 0.0
    fp8_gemm_k_half: float = 0.0  # 0: gemm_k_half
    fp8_gemm_max: float = 0.0  # 0: 0.88 x gemm_max
    fp8_block_factor: float = 0.81
    fp8_any_layout: bool = False  # FP8 GEMMs in any operand layout (Blackwell): no transposed copies of casts
    grouped_gemm_max: float = 0.0  # 0: 0.5 x gemm_max
    fp8_grouped_gemm_max: float = 0.0  # 0: 0.5 x the FP8 ceiling
    attention_bwd_max: float = 0.0  # 0: 0.86 x attention_max
    attention_fa2_max: float = 0.0  # 0: attention_max
    attention_fa2_bwd_max: float = 0.0  # 0: FA2_BACKWARD_OVER_FORWARD x attention_fa2_max
    attention_cudnn_max: float = 0.0  # 0: attention_max
    attention_cudnn_bwd_max: float = 0.0  # 0: attention_bwd_max
    attention_causal_s0: float = 0.0
    bf16_peak: float = 0.0  # the GPU's 16-bit peak: an FP8 GEMM's half-saturation FLOPs scale with its peak
    physics: Physics = Physics()

    def __post_init__(self) -> None:
        """Ceilings left at 0 take their defaults, here only (their sources: hardware_db.gpu.EfficiencyDefaults)."""
        derived = {"fp8_gemm_max": 0.88 * self.gemm_max, "grouped_gemm_max": 0.5 * self.gemm_max}
        derived["fp8_grouped_gemm_max"] = 0.5 * (self.fp8_gemm_max or derived["fp8_gemm_max"])
        derived["attention_bwd_max"] = 0.86 * self.attention_max
        derived["attention_fa2_max"] = self.attention_max
        derived["attention_fa2_bwd_max"] = FA2_BACKWARD_OVER_FORWARD * (self.attention_fa2_max
                                                                        or derived["attention_fa2_max"])
        derived["attention_cudnn_max"] = self.attention_max
        derived["attention_cudnn_bwd_max"] = self.attention_bwd_max or derived["attention_bwd_max"]
        for name, value in derived.items():
            if not getattr(self, name):
                object.__setattr__(self, name, value)

    @classmethod
    def from_gpu(cls, gpu: GPUSpec, physics: Physics | None = None) -> "Efficiency":
        e = gpu.efficiency
        return cls(e.gemm_max, e.gemm_half_flops, e.attention_max, e.memory_bandwidth, e.kernel_overhead_us * 1e-6,
                   gemm_k_half=e.gemm_k_half, fp8_gemm_k_half=e.fp8_gemm_k_half or 0.0,
                   fp8_gemm_max=e.fp8_gemm_max or 0.0,
                   fp8_block_factor=e.fp8_block_factor, fp8_any_layout=e.fp8_any_layout,
                   grouped_gemm_max=e.grouped_gemm_max or 0.0,
                   fp8_grouped_gemm_max=e.fp8_grouped_gemm_max or 0.0,
                   attention_bwd_max=e.attention_bwd_max or 0.0, attention_fa2_max=e.attention_fa2_max or 0.0,
                   attention_fa2_bwd_max=e.attention_fa2_bwd_max or 0.0,
                   attention_cudnn_max=e.attention_cudnn_max or 0.0,
                   attention_cudnn_bwd_max=e.attention_cudnn_bwd_max or 0.0,
                   attention_causal_s0=e.attention_causal_s0,
                   bf16_peak=gpu.peak_flops("bf16" if "bf16" in gpu.peak_tflops else "fp16"),
                   physics=physics or Physics())

    @classmethod
    def from_calibration(cls, cal: Calibration, gpu: GPUSpec, label: str, runtime: str | None = None) -> "Efficiency":
        """`gpu` already calibrated (hardware_db.calibration.calibrated_gpu): its memory roof and launch cost. The
        profiled layer's activation ratios apply to plans for the framework that layer is, the reference executor
        (runtime meshplan-executor); other frameworks save other tensors, so they keep the formula."""
        base = cls.from_gpu(gpu)
        fit = cal.fitted
        def pair(c: Curve | None) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
            return None if c is None else (c.flops, c.seconds)

        return dataclasses.replace(
            base, gemm_curve=pair(fit.gemm), attention_curve=pair(fit.attention),
            gemm_bwd_curve=pair(fit.gemm_backward), attention_bwd_curve=pair(fit.attention_backward),
            layer_overhead=fit.layer_overhead, head_overhead=fit.step_overhead,
            collectives=tuple((c.kind, c.ranks, c.alpha_s, c.bytes_per_s) for c in fit.collectives),
            memory_classes=tuple((c.name, c.alpha_s, c.bytes_per_s) for c in fit.memory_classes),
            optimizer_s_per_param=1.0 / fit.optimizer.params_per_s if fit.optimizer else None,
            curve_peak=gpu.peak_flops("bf16" if "bf16" in gpu.peak_tflops else "fp16"), calibration=label,
            activation_ratios=tuple(sorted(fit.activation_ratios.items())) if runtime == EXECUTOR_RUNTIME else ())

    def overhead(self, tp: int, sp: bool) -> tuple[float, float]:
        """The calibrated per-layer (forward, backward) overhead at this TP degree and sequence parallelism (the
        nearest measured degree below, else the smallest; SP as measured where it was); (0, 0) uncalibrated."""
        if not self.layer_overhead:
            return 0.0, 0.0
        below = [o for o in self.layer_overhead if o.tp <= tp] or [min(self.layer_overhead, key=lambda o: o.tp)]
        degree = max(o.tp for o in below)
        same = [o for o in below if o.tp == degree]
        o = next((o for o in same if o.sp == bool(sp)), same[0])
        return o.forward_s, o.backward_s

    def activation_ratio(self, mode: str) -> float:
        """Measured / formula activation bytes of a layer under this recompute mode (1 where not calibrated)."""
        return next((r for m, r in self.activation_ratios if m == mode), 1.0)

    def memory_op_time(self, name: str, bytes_: float) -> float | None:
        """A memory-bound operator's measured alpha + bytes / rate for its class, None without a calibration."""
        if not self.memory_classes or bytes_ <= 0:
            return None
        cls = memory_class(name)
        for k, alpha, bw in self.memory_classes:
            if k == cls:
                return alpha + bytes_ / bw
        return None

    def collective_fit(self, kind: str, n: int, link: comm.Link) -> tuple[float, float] | None:
        """The measured (alpha_s, bytes/s) of this collective kind and group size, where it applies: a profile
        runs on one host, so never to a group that crosses nodes."""
        if link.crosses_nodes:
            return None
        for k, ranks, alpha, bw in self.collectives:
            if k == kind and ranks == n:
                return alpha, bw
        return None


@dataclass(frozen=True)
class PassTimes:
    """Seconds for one micro-batch through a block: compute and exposed communication per parallel dimension."""

    fwd_compute: float = 0.0
    bwd_input_compute: float = 0.0
    bwd_weight_compute: float = 0.0
    fwd_comm: dict[str, float] = field(default_factory=dict)
    bwd_comm: dict[str, float] = field(default_factory=dict)
    recompute: float = 0.0  # part of the backward spent re-running the forward

    @property
    def forward(self) -> float:
        return self.fwd_compute + sum(self.fwd_comm.values())

    @property
    def backward_input(self) -> float:
        return self.bwd_input_compute + sum(self.bwd_comm.values()) + self.recompute

    @classmethod
    def total(cls, parts: list[tuple["PassTimes", int]]) -> "PassTimes":
        """sum of count x times over (times, count) pairs: a stage's layers by kind, without one add per layer."""
        fwd: dict[str, float] = {}
        bwd: dict[str, float] = {}
        for t, n in parts:
            for k, v in t.fwd_comm.items():
                fwd[k] = fwd.get(k, 0.0) + n * v
            for k, v in t.bwd_comm.items():
                bwd[k] = bwd.get(k, 0.0) + n * v
        return cls(sum(n * t.fwd_compute for t, n in parts), sum(n * t.bwd_input_compute for t, n in parts),
                   sum(n * t.bwd_weight_compute for t, n in parts), fwd, bwd, sum(n * t.recompute for t, n in parts))

    def plus(self, other: "PassTimes") -> "PassTimes":
        def add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
            out = dict(a)  # a's keys first, then b's new ones: float sums do not depend on hashing
            for k, v in b.items():
                out[k] = out[k] + v if k in out else v
            return out

        return PassTimes(self.fwd_compute + other.fwd_compute, self.bwd_input_compute + other.bwd_input_compute,
                         self.bwd_weight_compute + other.bwd_weight_compute, add(self.fwd_comm, other.fwd_comm),
                         add(self.bwd_comm, other.bwd_comm), self.recompute + other.recompute)


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

    @property
    def peak_memory_gib(self) -> float:
        return max(s.peak_gib for s in self.stages)

    @property
    def fits(self) -> bool:
        return self.peak_memory_gib <= self.hbm_gib

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
            "realism": None if self.realism is None else {
                "published_mfu": self.realism.published_mfu, "run": self.realism.run, "source": self.realism.source,
                "exceeds": self.realism.exceeds},
            "stages": [
                {"rank": s.rank, "first_layer": s.layers[0], "num_layers": s.layers[1], "in_flight_microbatches": s.in_flight,
                 "peak_memory_gib": s.peak_gib, "memory_gib": {k: v / GIB for k, v in asdict(s.memory).items()}}
                for s in self.stages
            ],
        }


def layout_dict(lay: Layout) -> dict:
    d = {k: v for k, v in vars(lay).items()}
    d["stage_layers"] = list(lay.stage_layers)
    d["stage_recompute"] = [p.model_dump() for p in lay.stage_recompute]
    return d


def calibrated_cluster(spec: ClusterSpec, cal: Calibration, origin: str,
                       runtime: str | None = None) -> tuple[Cluster, Efficiency]:
    """The cluster on the calibrated device and the efficiency model to price it with (for plans of `runtime`). A
    CPU calibration is its own device (--gpu cpu: ranks are processes on this host); a GPU one must be of the
    cluster's GPU type."""
    if cal.device.kind == "cpu":
        if spec.gpu != "cpu":
            raise InputError(f"{origin} was measured on this host's CPU ({cal.device.name}), not on {spec.gpu}: "
                             f"use --gpu cpu with it, or a calibration of {spec.gpu} (meshplan profile --device cuda)")
        gpu = cpu_device_spec(cal)
    else:
        gpu = calibrated_gpu(load_gpu(spec.gpu), cal, origin)
    cluster = Cluster(spec, gpu=gpu)
    label = f"{origin.rsplit('/', 1)[-1]} sha256:{digest(cal)}"
    return cluster, Efficiency.from_calibration(cal, gpu, label, runtime)


# ---- operator and collective times -------------------------------------------------------------------------------

def op_time(flops: float, bytes_: float, kind: str, peak: float, hbm: float, eff: Efficiency,
            backward: bool = False, *, depth: float = 0.0, groups: float = 1.0, fp8: str | None = None,
            keys: float = 0.0, kernel: str = "fused", bandwidth_factor: float = 1.0, chunks: float = 1.0,
            streams: int = 0) -> float:
    """Roofline: max(FLOPs / (peak x efficiency), bytes / achieved bandwidth) + launch overhead (Williams et al.,
    "Roofline", CACM 2009). Efficiency = ceiling x F / (F + F_half) x shape factors (kernels.py): F is the kernel's
    FLOPs (a grouped kernel of `groups` expert GEMMs saturates on all of them, under the grouped ceiling),
    `depth` the pass's inner dimension (the k-depth ramp), `fp8` the recipe of an FP8 GEMM (its ceiling is a
    fraction of the FP8 `peak`), attention by pass and `kernel` with the causal tile factor at `keys`. Memory-bound
    operators run at the framework kernel's `bandwidth_factor` of the GPU's fused-kernel bandwidth. A GEMM split
    into `chunks` to overlap a TP collective (kernels.tp_gemm_chunks) runs at the efficiency of one chunk. A
    grouped GEMM run as one GEMM per group on `streams` streams (0: one grouped kernel) saturates on `streams`
    groups' FLOPs and takes at least one launch per group (kernels.TE_GEMM_STREAMS).
    Calibrated: the measured time at these FLOPs (calibrate.interpolate, the backward curve for backward passes;
    it includes the launch), never below the memory roof. `peak` above the 16-bit one (fp8) shortens a calibrated
    GEMM by the same factor."""
    if flops <= 0 and bytes_ <= 0:
        return 0.0
    ph = eff.physics
    t_mem = bytes_ / (hbm * eff.memory_bandwidth * (bandwidth_factor if ph.memory_kernels else 1.0))
    if flops > 0:
        if kind == "attention":
            curve = (eff.attention_bwd_curve if backward else None) or eff.attention_curve
        else:
            curve = (eff.gemm_bwd_curve if backward else None) or eff.gemm_curve
        if curve is not None:
            at = flops * (eff.curve_peak / peak if eff.curve_peak else 1.0)
            return max(interpolate(curve[0], curve[1], at), t_mem + eff.kernel_overhead_s)
        grouped = groups > 1 and ph.grouped_gemm
        # a grouped GEMM is one launch whose tiles from all groups fill the GPU together, so it saturates on its
        # total FLOPs (TE's CUTLASS grouped GEMM reaches dense efficiency at 8-16 groups; TE PR #2045)
        one = flops / (chunks if ph.overlap_limits else 1.0)
        launches = 0.0
        if grouped and streams > 0:  # one GEMM per expert, `streams` at a time (kernels.TE_GEMM_STREAMS)
            one = one / groups * min(groups, streams)
            launches = groups * eff.kernel_overhead_s
        half = eff.gemm_half_flops * (peak / eff.bf16_peak if eff.bf16_peak and fp8 else 1.0)
        e = one / (one + half)
        if kind == "attention":
            if ph.attention:
                if kernel in ("fa2", "sdpa-fa2"):
                    ceiling = eff.attention_fa2_bwd_max if backward else eff.attention_fa2_max
                    if kernel == "sdpa-fa2":
                        ceiling *= SDPA_FLASH_OVER_FA2
                elif kernel == "cudnn":
                    ceiling = eff.attention_cudnn_bwd_max if backward else eff.attention_cudnn_max
                else:
                    ceiling = eff.attention_bwd_max if backward else eff.attention_max
                e *= ceiling * causal_tile_factor(keys, eff.attention_causal_s0)
                if ph.attention_keys:  # the backward's steeper ramp over short keys (short sequences, CP chunks)
                    e *= attention_keys_factor(keys, kernel, backward)
            else:
                e *= eff.attention_max
        else:
            bf16 = (eff.grouped_gemm_max if grouped else eff.gemm_max) * (
                k_depth_factor(depth, eff.gemm_k_half) if ph.gemm_shape else 1.0)
            if fp8 and ph.fp8:
                ceiling = fp8_kernel_ceiling(eff.gemm_max, eff.fp8_gemm_max, fp8, eff.fp8_block_factor,
                                             eff.fp8_any_layout)
                if grouped:
                    ceiling *= eff.fp8_grouped_gemm_max / eff.fp8_gemm_max
                # FP8's own ramp over k: its main loop covers k twice as fast against the same per-tile costs
                ceiling *= k_depth_factor(depth, eff.fp8_gemm_k_half or eff.gemm_k_half) if ph.gemm_shape else 1.0
                # an FP8 kernel keeps no larger a share of its peak than the BF16 one of its shape (TE's measured
                # GEMMs: 0.69 vs 0.72, docs/examples/gemm_profiling): FP8 at most halves a GEMM
                e *= min(ceiling, bf16)
            else:  # BF16, or (fp8 physics off) an FP8 GEMM at BF16's efficiency of the FP8 peak
                e *= bf16
        return max(flops / (peak * e), t_mem, launches) + eff.kernel_overhead_s
    return t_mem + eff.kernel_overhead_s


def rank_strides(lay: Layout) -> dict[str, int]:
    """Distance between neighbouring ranks of each dense dim: the product of the sizes inside it in the order."""
    sizes = {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp, "pp": lay.pp}
    strides, stride = {}, 1
    for d in lay.rank_order.split("-"):
        strides[d] = stride
        stride *= sizes[d]
    return strides


def group_ranks(dim: str, lay: Layout) -> tuple[int, ...]:
    """Ranks of rank 0's group along `dim`: dense dims by the layout's rank order; the distributed optimizer's
    dp_cp group spans cp x dp; experts fold etp-ep-edp over the non-pp ranks (tp-cp-dp, Megatron's MoE folding)."""
    sizes = {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp, "pp": lay.pp}
    strides = rank_strides(lay)
    if dim in sizes:
        return tuple(i * strides[dim] for i in range(sizes[dim]))
    if dim == "dp_cp":
        return tuple(c * strides["cp"] + d * strides["dp"] for d in range(lay.dp) for c in range(lay.cp))
    folded = {"etp": (1, lay.etp), "ep": (lay.etp, lay.ep), "edp": (lay.etp * lay.ep, lay.edp)}
    if dim in folded:
        step, n = folded[dim]
        return tuple(_unfold(i * step, lay.tp * lay.cp, strides["dp"]) for i in range(n))
    raise ValueError(dim)


def _unfold(k: int, tp_cp: int, stride_dp: int) -> int:
    """Global rank of index k of the folded tp-cp-dp ranks (tp and cp are innermost in every order)."""
    return k % tp_cp + (k // tp_cp) * stride_dp


def stage_p2p_s(model: ModelSpec, wl: Workload, lay: Layout, link: comm.Link, eff: Efficiency) -> float:
    """P2P of one micro-batch's activations between stages; Megatron sends 1/tp with scatter-gather (SC'21 4.1)."""
    if lay.pp == 1:
        return 0.0
    return timed_collective("p2p", ACT_BYTES * lay.mbs * wl.seq_len / lay.cp * model.hidden / lay.tp, 2, link, eff)


def group_link(cluster: Cluster, ranks: tuple[int, ...]) -> comm.Link:
    """Achieved bus bandwidth: line rate x the GPU's NCCL efficiency on the level the ring crosses."""
    e = cluster.gpu.efficiency
    bw, lat, crosses = cluster.group_link(ranks, e.scaleup_bandwidth, e.scaleout_bandwidth)
    a2a = cluster.scaleup.bytes_per_s * (e.scaleup_a2a_bandwidth or e.scaleup_bandwidth)
    if not crosses:
        return comm.Link(bw, lat, crosses, min(a2a, bw) if e.scaleup_a2a_bandwidth else 0.0)
    per_node: dict[int, int] = {}
    for r in ranks:
        per_node[cluster.node_of(r)] = per_node.get(cluster.node_of(r), 0) + 1
    return comm.Link(bw, lat, crosses, a2a, cluster.scaleout.bytes_per_s * e.scaleout_bandwidth, min(per_node.values()))


_RING = {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather, "reduce_scatter": comm.reduce_scatter,
         "all_to_all": comm.all_to_all}


def timed_collective(kind: str, bytes_: float, n: int, link: comm.Link, eff: Efficiency, dedup_top_k: int = 0) -> float:
    """A collective's seconds: the calibration's measured alpha + bytes / beta for this kind and group size inside
    one node (Hockney's model, fitted by costmodels/calibrate.py), else the ring formula of comm.py."""
    if n <= 1 or bytes_ <= 0:
        return 0.0
    fit = eff.collective_fit(kind, n, link)
    if fit is not None:
        return fit[0] + bytes_ / fit[1]
    if kind == "all_to_all":
        return comm.all_to_all(bytes_, n, link, dedup_top_k)
    return comm.p2p(bytes_, link) if kind == "p2p" else _RING[kind](bytes_, n, link)


def collective_time(c: Collective, n: int, link: comm.Link, eff: Efficiency, backward: bool = False) -> float:
    """One forward (or, `backward`, one backward-mirror) instance of a block's collective."""
    return timed_collective(c.kind, c.pass_bytes(backward), 2 if c.kind == "p2p" else n, link, eff,  # P2P: 2 ranks
                            c.dedup_top_k)


# ---- the estimate ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SyncCoefficients:
    """DP gradient reduce and parameter gather over P parameters take alpha + beta * P seconds (ring alpha-beta,
    comm.py) when P > 0; the optimizer step streams ADAM_BYTES_PER_PARAM bytes per local parameter from HBM."""

    reduce_alpha_dense: float
    reduce_beta_dense: float
    reduce_alpha_expert: float
    reduce_beta_expert: float
    gather_alpha_dense: float
    gather_beta_dense: float
    gather_alpha_expert: float
    gather_beta_expert: float
    optimizer_s_per_dense_param: float
    optimizer_s_per_expert_param: float

    def reduce(self, dense: float, expert: float) -> float:
        return ((self.reduce_alpha_dense + self.reduce_beta_dense * dense if dense > 0 else 0.0)
                + (self.reduce_alpha_expert + self.reduce_beta_expert * expert if expert > 0 else 0.0))

    def gather(self, dense: float, expert: float) -> float:
        return ((self.gather_alpha_dense + self.gather_beta_dense * dense if dense > 0 else 0.0)
                + (self.gather_alpha_expert + self.gather_beta_expert * expert if expert > 0 else 0.0))

    def optimizer(self, dense: float, expert: float) -> float:
        return self.optimizer_s_per_dense_param * dense + self.optimizer_s_per_expert_param * expert


# The layout fields and links each block of ops.py reads: a PassCache shares a block's passes under this key.
BLOCK_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "attention": (("tp", "cp", "cp_comm", "sp", "mbs"), ("tp", "cp")),
    "mlp": (("tp", "cp", "sp", "mbs"), ("tp",)),
    "moe": (("tp", "cp", "mbs", "ep", "etp"), ("ep", "etp")),
    "embedding": (("tp", "cp", "sp", "mbs"), ("tp",)),
    "head": (("tp", "cp", "sp", "mbs"), ("tp",)),
    "mtp_projection": (("tp", "cp", "sp", "mbs"), ()),
}
_BLOCK_GETTERS = {name: (attrgetter(*fields), dims) for name, (fields, dims) in BLOCK_KEYS.items()}


class GroupLinks(dict):
    """The links of a layout's process groups by dim, each read off the cluster on first use (a planner's bounds
    need only a few of them for most meshes)."""

    def __init__(self, cluster: Cluster, lay: Layout):
        super().__init__()
        self.cluster, self.lay = cluster, lay

    def __missing__(self, dim: str) -> comm.Link:
        link = self[dim] = group_link(self.cluster, group_ranks(dim, self.lay))
        return link


class PassCache:
    """Block passes (ops.py) by what they depend on (BLOCK_KEYS), for one model, cluster, workload, runtime and
    efficiency, and the per-layer, embedding and head passes composed from them. Every CostContext reads its
    passes here; a planner shares one cache among thousands of contexts (and reads it without any) because the
    attention, MLP and MoE halves repeat across them, and computing them is most of what a context costs.
    `lay` is anything with the BLOCK_KEYS fields (a Layout, or the planner's per-layer key); `links` the groups'
    links by dim."""

    def __init__(self, model: ModelSpec, cluster: Cluster, wl: Workload, rt: Runtime, eff: Efficiency):
        self.owner = (model, cluster, wl, rt, eff)
        self.model, self.wl, self.rt, self.eff = model, wl, rt, eff
        gpu = cluster.gpu
        self.peak16 = gpu.peak_flops("bf16" if "bf16" in gpu.peak_tflops else "fp16")
        self.peak_fp8 = gpu.peak_flops("fp8") if wl.dtype == "fp8" else self.peak16
        self.hbm = gpu.hbm_bytes_per_s
        self.store: dict[tuple, tuple[PassTimes, float]] = {}

    def layer(self, i: int, lay, links) -> tuple[PassTimes, float]:
        """A decoder layer's passes without recomputation and its selective part: the attention half plus the MLP
        (or MoE) half (ops.decoder_layer)."""
        model, wl, rt, any_layout = self.model, self.wl, self.rt, self.eff.fp8_any_layout
        kind = model.is_moe_layer(i)
        attn_key, attn_build = self._key("attention", lay, links), lambda: attention_half(model, lay, wl, rt, any_layout)
        mlp_name = "moe" if kind else "mlp"
        mlp_key, mlp_build = self._key(mlp_name, lay, links), lambda: mlp_half(model, i, lay, wl, rt, any_layout)
        key = ("layer", attn_key, mlp_key)
        found = self.store.get(key)
        if found is None:
            attn, sel_attn = self._block(attn_key, attn_build, lay, links)
            mlp, sel_mlp = self._block(mlp_key, mlp_build, lay, links)
            found = self.store[key] = (self._ep_overlapped(attn, mlp), _merge_parts(sel_attn, sel_mlp))
        return found[0], self._selective_s(found[1], lay)

    def _ep_overlapped(self, attn: PassTimes, mlp: PassTimes) -> PassTimes:
        """The layer (attention then MLP half). DualPipe and Megatron-Core's EP A2A overlap
        (--overlap-moe-expert-parallel-comm) run one micro-batch's forward chunk beside another's backward chunk,
        each all-to-all under one piece of the other's compute (DeepSeek-V3 report sec. 3.2.1, Fig. 4): the forward
        dispatch under the paired MLP backward, the forward combine under the attention backward, the backward
        dispatch under the MLP forward, the backward combine under the attention forward. Dispatch and combine
        move the same elements; the first piece of each pass is the dispatch, at ops.ep_dispatch_bytes per element
        (FP8 with +fp8-dispatch), the second a BF16 combine; what is hidden slows the compute (kernels.CONTENTION_SM)."""
        layer = attn.plus(mlp)
        tf, tb = mlp.fwd_comm.get("ep", 0.0), mlp.bwd_comm.get("ep", 0.0)
        if not self.rt.ep_overlap or tf + tb <= 0:
            return layer
        ph = self.eff.physics

        dispatch = ep_dispatch_bytes(self.rt, self.wl)
        first = dispatch / (dispatch + ACT_BYTES)  # the dispatch's share of the pair's bytes

        def hidden(comm_s: float, window_a: float, window_b: float) -> float:
            return (overlapped_exposed(comm_s * first, window_a, 0.0, ph)
                    + overlapped_exposed(comm_s * (1 - first), window_b, 0.0, ph))

        mlp_bwd = mlp.bwd_input_compute + mlp.bwd_weight_compute
        attn_bwd = attn.bwd_input_compute + attn.bwd_weight_compute
        fwd_comm = {**layer.fwd_comm, "ep": hidden(tf, mlp_bwd, attn_bwd)}
        bwd_comm = {**layer.bwd_comm, "ep": hidden(tb, mlp.fwd_compute, attn.fwd_compute)}
        return dataclasses.replace(layer, fwd_comm=fwd_comm, bwd_comm=bwd_comm)

    def _selective_s(self, parts: "RecomputeParts", lay) -> float:
        """Forward seconds selective recomputation re-runs: torchtitan's op-SAC share, or the layout's modules."""
        if self.rt.selective == "op-sac":
            return dict(parts).get("op-sac", 0.0)
        return sum(t for m, t in parts if m in lay.recompute_modules)

    def layer_times(self, i: int, mode: str, lay, links) -> PassTimes:
        base, selective = self.layer(i, lay, links)
        return _with_recompute(base, mode, selective)

    def embedding(self, lay, links) -> PassTimes:
        return self._block(self._key("embedding", lay, links), lambda: embedding_block(self.model, lay, self.wl),
                           lay, links)[0]

    def head(self, lay, links) -> PassTimes:
        """The last stage's own block: final norm, LM head and loss, and after them each MTP module (its
        projection, a decoder layer like the model's last, the head again; ops.mtp_projection). Each module's ring
        exchange overlaps its own attention."""
        model = self.model
        head_key = self._key("head", lay, links)
        key: tuple = ("head+mtp", head_key)
        if model.num_mtp_layers:  # the modules' decoder layer is like the model's last
            last = "moe" if model.is_moe_layer(model.num_layers - 1) else "mlp"
            key += (self._key("attention", lay, links), self._key(last, lay, links), self._key("mtp_projection", lay,
                                                                                                links))
        found = self.store.get(key)
        if found is None:
            head = self._block(head_key, lambda: head_block(model, lay, self.wl), lay, links)[0]
            if model.num_mtp_layers:
                projection = self._block(self._key("mtp_projection", lay, links),
                                         lambda: mtp_projection(model, lay, self.wl), lay, links)[0]
                module = projection.plus(self.layer(model.num_layers - 1, lay, links)[0]).plus(head)
                head = head.plus(PassTimes.total([(module, model.num_mtp_layers)]))
            found = self.store[key] = (head, 0.0)
        return found[0]

    def layer_fb(self, i: int, mode: str, lay, links) -> tuple[float, float]:
        """(forward, backward) seconds of decoder layer i under a recompute mode (backward: input and weight
        gradients and the recomputation) from the halves' totals alone: what the planner's work bounds read, for
        thousands of layer keys, without composing PassTimes."""
        return with_recompute_fb(self.layer_parts(i, lay, links), mode)

    def layer_parts(self, i: int, lay, links) -> tuple[float, float, float]:
        """(forward, backward without recomputation, selective recomputation's forward seconds) of decoder layer i:
        layer_fb of every mode from one lookup (with_recompute_fb)."""
        model = self.model
        if self.rt.ep_overlap and model.is_moe_layer(i):  # the overlap pairs the halves' passes (_ep_overlapped)
            base, selective = self.layer(i, lay, links)
            return base.forward, base.backward_input + base.bwd_weight_compute, selective
        any_layout = self.eff.fp8_any_layout
        attn = self._totals(self._key("attention", lay, links),
                            lambda: attention_half(model, lay, self.wl, self.rt, any_layout), lay, links)
        mlp = self._totals(self._key("moe" if model.is_moe_layer(i) else "mlp", lay, links),
                           lambda: mlp_half(model, i, lay, self.wl, self.rt, any_layout), lay, links)
        return (attn[0] + mlp[0], attn[1] + mlp[1],
                self._selective_s(attn[2], lay) + self._selective_s(mlp[2], lay))

    def edges_fb(self, lay, links) -> tuple[tuple[float, float], tuple[float, float]]:
        """((forward, backward) of the embedding, of the head with the MTP modules): as layer_fb."""
        model, wl = self.model, self.wl
        emb = self._totals(self._key("embedding", lay, links), lambda: embedding_block(model, lay, wl), lay, links)
        head = self._totals(self._key("head", lay, links), lambda: head_block(model, lay, wl), lay, links)
        f, b = head[0], head[1]
        if model.num_mtp_layers:
            proj = self._totals(self._key("mtp_projection", lay, links), lambda: mtp_projection(model, lay, wl),
                                lay, links)
            layer_f, layer_b = self.layer_fb(model.num_layers - 1, "none", lay, links)
            f += model.num_mtp_layers * (proj[0] + layer_f + head[0])
            b += model.num_mtp_layers * (proj[1] + layer_b + head[1])
        return (emb[0], emb[1]), (f, b)

    def _totals(self, key: tuple, build, lay, links) -> tuple[float, float, "RecomputeParts"]:
        """A block's (forward, backward without recomputation, recompute parts), cached beside its passes."""
        found = self.store.get(("totals", key))
        if found is None:
            t, sel = self._block(key, build, lay, links)
            found = self.store[("totals", key)] = (t.forward, t.backward_input + t.bwd_weight_compute, sel)
        return found

    @staticmethod
    def _key(name: str, lay, links) -> tuple:
        fields, dims = _BLOCK_GETTERS[name]
        return (name, fields(lay), *[links[d] for d in dims])

    def _block(self, key: tuple, build, lay, links) -> tuple[PassTimes, "RecomputeParts"]:
        found = self.store.get(key)
        if found is None:
            block = build()
            if block.name != key[0]:
                raise ValueError(f"block {block.name!r} cached as {key[0]!r}")
            found = self.store[key] = self._passes_of(block, lay, links)
        return found

    def _passes_of(self, block: Block, lay, links) -> tuple[PassTimes, "RecomputeParts"]:
        """The block's passes without recomputation, and the forward seconds of what each recompute module (and
        torchtitan's op-SAC, as "op-sac") would re-run."""
        fwd = bwd_i = bwd_w = 0.0
        parts: dict[str, float] = {}
        attn_core = attn_core_bwd = 0.0
        eff = self.eff
        columns = column_gemm_count(op.name for op in block.ops)
        for op in block.ops:
            fp8 = op.kind == "gemm" and op.gemm_dtype_scale > 1
            if op.name.startswith("fp8_cast") and not eff.physics.fp8:
                continue
            if op.name == "cp_merge" and not eff.physics.cp_steps:  # the ring's per-step merges go with its steps
                continue
            if op.name.startswith("async_tp_") and not eff.physics.overlap_limits:  # what the overlap costs
                continue
            peak = self.peak_fp8 if fp8 else self.peak16
            measured = eff.memory_op_time(op.name, op.fwd_bytes) if op.kind == "memory" else None
            if measured is not None:  # calibrated: this operator class's measured rate (forward, backward)
                f = measured
                bwd_i += eff.memory_op_time(op.name, op.bwd_input_bytes) or 0.0
                fwd += f
            else:
                m, n, k = op.shape or (0.0, 0.0, 0.0)  # each pass's inner dimension: k, then n (dgrad), m (wgrad)
                kw = dict(groups=op.groups, fp8=self.wl.fp8_recipe if fp8 else None, keys=op.keys,
                          kernel=op.kernel or "fused",
                          streams=TE_GEMM_STREAMS if self.rt.grouped_gemm == "multi-stream" else 0,
                          bandwidth_factor=self.rt.memory_kernel(memory_class(op.name)) if op.kind == "memory" else 1.0)
                split = tp_gemm_chunks(self.rt.tp_overlap, op.name, lay.tp, lay.sp,
                                       column_gemms=columns) if op.kind == "gemm" else 1
                split_b = tp_gemm_chunks(self.rt.tp_overlap, op.name, lay.tp, lay.sp, True,
                                         column_gemms=columns) if op.kind == "gemm" else 1
                f = op_time(op.fwd_flops, op.fwd_bytes, op.kind, peak, self.hbm, eff, depth=k, chunks=split, **kw)
                fwd += f
                if op.kind == "memory":  # a class's backward kernel may run at its own rate (Runtime.memory_kernel)
                    kw["bandwidth_factor"] = self.rt.memory_kernel(memory_class(op.name), backward=True)
                b = op_time(op.bwd_input_flops, op.bwd_input_bytes, op.kind, peak, self.hbm, eff, True, depth=n,
                            chunks=split_b, **kw)
                bwd_i += b
                if op.kind == "attention" or op.name.startswith("attn_"):
                    attn_core_bwd += b
                bwd_w += op_time(op.bwd_weight_flops, op.bwd_weight_bytes, op.kind, peak, self.hbm, eff, True,
                                 depth=m, **kw)
            if self.rt.selective == "op-sac":  # torchtitan: per-operator SAC, no modules
                parts["op-sac"] = parts.get("op-sac", 0.0) + f * op_sac_recomputed(op, self.model)
            else:
                for m in recompute_modules_of(op, block.name):
                    parts[m] = parts.get(m, 0.0) + f
            if op.kind == "attention" or op.name.startswith("attn_"):
                attn_core += f
        if block.name == "attention" and eff.layer_overhead:  # once per decoder layer: its measured framework cost
            over_f, over_b = eff.overhead(lay.tp, lay.sp)
            fwd += over_f
            bwd_i += over_b
        elif block.name == "head" and eff.head_overhead is not None:  # per micro-batch, outside the layers
            fwd += eff.head_overhead.forward_s
            bwd_i += eff.head_overhead.backward_s
        fwd_comm: dict[str, float] = {}
        bwd_comm: dict[str, float] = {}
        for c in block.comms:
            t = collective_time(c, getattr(lay, c.dim), links[c.dim], self.eff)  # tp, cp, ep, etp: group sizes
            t_b = t if c.bwd_bytes is None else collective_time(c, getattr(lay, c.dim), links[c.dim], self.eff, True)
            tf, tb = c.fwd_count * t, c.bwd_count * t_b
            if c.overlappable == "tp":
                tf *= tp_exposed_fraction(self.rt.tp_overlap, lay.tp, lay.sp, eff.physics, collective=c.name,
                                          column_gemms=columns)
                tb *= tp_exposed_fraction(self.rt.tp_overlap, lay.tp, lay.sp, eff.physics, backward=True,
                                          collective=c.name, column_gemms=columns)
            attn_bwd = attn_core_bwd or 2.5 * attn_core
            if c.overlappable == "cp":  # the ring exchange runs under the attention steps (kernels.ring_cp_exposed)
                tf = ring_cp_exposed(tf, attn_core, lay.cp, False, eff.physics)
                tb = ring_cp_exposed(tb, attn_bwd, lay.cp, True, eff.physics)
            elif c.overlappable == "cp-first-step":  # waited before the second step: one step's compute hides it
                tf = overlapped_exposed(tf, attn_core / lay.cp, 0.0, eff.physics)
                tb = overlapped_exposed(tb, attn_bwd / lay.cp, 0.0, eff.physics)
            # with rt.ep_overlap the EP all-to-all stays raw here: PassCache.layer hides it under a paired pass
            fwd_comm[c.dim] = fwd_comm.get(c.dim, 0.0) + tf
            bwd_comm[c.dim] = bwd_comm.get(c.dim, 0.0) + tb
            # a recomputed dense MLP or MoE layer runs its own TP pair / dispatch and combine again
            again = {"mlp": ("mlp",), "moe": ("moe",)}.get(block.name, ())
            if self.rt.selective == "op-sac" and c.name == "tp_all_gather":
                # op-level SAC saves reduce-scatter outputs but not all-gather ones (torchtitan parallelize_llama.py
                # _save_list), and the linears it re-runs (wk, wo, w3) need the gathered input: both all-gathered
                # again in the backward
                again = ("op-sac",)
            for m in again:
                parts[m] = parts.get(m, 0.0) + tf
        return PassTimes(fwd, bwd_i, bwd_w, fwd_comm, bwd_comm, 0.0), tuple(sorted(parts.items()))


# PyTorch FSDP2's copies around its collectives, per parameter of the layer (torch/distributed/fsdp/_fully_shard/
# _fsdp_collectives.py): after each all-gather, foreach_all_gather_copy_out splits the gathered 16-bit buffer into
# the parameters (split_with_sizes_copy: read 2 B, write 2 B) on the compute stream once the gather is waited;
# before each reduce-scatter, foreach_reduce_scatter_copy_in concatenates the 16-bit gradients into the fp32
# reduce-scatter input (chunk_cat: read 2 B, write 4 B), on the compute stream too ("Only after the copy-in
# finishes can we free the gradients"). Megatron's distributed optimizer and Megatron-FSDP gather into and reduce
# from contiguous buffers (no copies).
FSDP_COPY_OUT_BYTES = 4.0
FSDP_COPY_IN_BYTES = 6.0


class CostContext:
    """Everything one configuration's costs need, resolved once; per-layer results cached (decoder layers differ
    only in being dense or MoE). estimate() and the planner's partitioner both read their numbers from here."""

    def __init__(self, model: ModelSpec, cluster: Cluster, wl: Workload, lay: Layout, rt: Runtime,
                 eff: Efficiency, links: dict[str, comm.Link] | None = None, passes: PassCache | None = None):
        self.model, self.cluster, self.wl, self.lay, self.rt, self.eff = model, cluster, wl, lay, rt, eff
        if passes is not None and any(a is not b for a, b in zip(passes.owner, (model, cluster, wl, rt, eff))):
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

    def derive(self, lay: Layout) -> "CostContext":
        """The same costs for a layout that differs only in stage partition or recomputation (what the planner
        varies once the mesh, micro-batch, ZeRO stage and schedule are fixed)."""
        mine = dataclasses.replace(self.lay, stage_layers=lay.stage_layers, stage_recompute=lay.stage_recompute,
                                   recompute=lay.recompute, chunks=lay.chunks)
        if mine != lay:
            raise ValueError("derive() needs the same mesh, micro-batch, ZeRO stage and schedule")
        other = copy.copy(self)
        other.lay = lay
        return other

    def share_layer_cache(self, other: "CostContext") -> None:
        """Reuse another context's per-layer costs: valid when tp, cp, cp_comm, sp, mbs, ep and etp agree (and, with
        ZeRO-3's per-layer gathers in them, the DP groups)."""
        names = ("tp", "cp", "cp_comm", "sp", "mbs", "ep", "etp", "recompute_modules")
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
            times = _with_recompute(base, mode, selective)
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
        arguments.py); ZeRO-0 all-reduces, ZeRO >= 1 reduce-scatters gradients and all-gathers the updated 16-bit
        weights (Megatron-LM docs, distrib_optimizer.md). ZeRO-3 / FSDP gathers each layer's weights for every
        micro-batch's forward and backward instead (CostContext.fsdp_gather, in the stage times), not after the step."""
        lay = self.lay
        coef: dict[str, float] = {}
        for kind, dim in (("dense", "dp_cp"), ("expert", "edp")):
            n, link = self.sizes[dim], self.links[dim]
            ra = rb = ga = gb = 0.0
            if n > 1:
                # alpha-beta ring (comm.py): all-reduce 2(n-1) steps / 2(n-1)/n of the bytes, RS and AG half of that;
                # calibrated: the measured alpha and 1/beta of that collective (timed_collective).
                reduce_kind = "all_reduce" if lay.zero == 0 else "reduce_scatter"
                ra, rb = self._alpha_beta(reduce_kind, n, link, 4)
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
        """ZeRO-2/3: (alpha, seconds per parameter) of one reduce-scatter of fp32 gradients over dp x cp (dense)
        and over the expert-DP group (experts), run in every micro-batch's backward (reduce_in_backward)."""
        return self._dp_collective("reduce_scatter", 4)

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


RecomputeParts = tuple[tuple[str, float], ...]  # (recompute module or "op-sac", forward seconds it re-runs)


def _merge_parts(a: RecomputeParts, b: RecomputeParts) -> RecomputeParts:
    out = dict(a)
    for k, v in b:
        out[k] = out.get(k, 0.0) + v
    return tuple(sorted(out.items()))


def _offload_passes(ctx: CostContext, modes: tuple[str, ...]) -> PassTimes:
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


def with_recompute_fb(parts: tuple[float, float, float], mode: str) -> tuple[float, float]:
    """(forward, backward) of a layer's (forward, backward, selective forward) under a recompute mode: full re-runs
    the forward in the backward, selective its modules' share (as _with_recompute)."""
    forward, backward, selective = parts
    again = forward if mode == "full" else selective if mode == "selective" else 0.0
    return forward, backward + again


def _with_recompute(base: PassTimes, recompute: str, selective_s: float) -> PassTimes:
    """Full recomputation re-runs the whole forward, its communication included; selective what its modules re-run
    (the attention core by default: Korthikanti et al. 2022, sec. 5)."""
    re = base.forward if recompute == "full" else selective_s if recompute == "selective" else 0.0
    return PassTimes(base.fwd_compute, base.bwd_input_compute, base.bwd_weight_compute, base.fwd_comm, base.bwd_comm, re)


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
    last_rank, last_chunk = lay.pp - 1, lay.vpp - 1

    chunk_pass: list[list[PassTimes]] = []
    for r in range(lay.pp):
        check(deadline)
        row = []
        for c, (first, count) in enumerate(ranges[r]):
            mix = _layer_mix(model, range(first, first + count), modes)
            t = PassTimes.total([(ctx.layer_times(i, mode), n) for (i, mode), n in mix.items()])
            if r == 0 and c == 0:
                t = t.plus(ctx.embedding)
                if lay.offload_layers:
                    t = t.plus(_offload_passes(ctx, modes))
            if r == last_rank and c == last_chunk:
                t = t.plus(ctx.head)
            row.append(t)
        chunk_pass.append(row)

    p2p_s, blocking_p2p = ctx.p2p_s, ctx.blocking_p2p_s
    times = [[StageTimes(t.forward + blocking_p2p, t.backward_input + blocking_p2p, t.bwd_weight_compute)
              for t in row] for row in chunk_pass]
    key = (lay.schedule, lay.num_microbatches, p2p_s, tuple(tuple(row) for row in times))
    timeline = timelines.get(key) if timelines is not None else None
    if timeline is None:
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
    rank_end = timeline.rank_end

    # Data-parallel gradient reduction, parameter gather and optimizer step, per pipeline rank.
    m = lay.num_microbatches
    sync = ctx.sync
    stages: list[StageReport] = []
    finish = []
    dp_exposed_per_rank = []
    optim_per_rank = []
    for r in range(lay.pp):
        first = ranges[r][0][0]
        count = sum(n for _, n in ranges[r])
        params = _stage_params(ctx, ranges[r], modes, r == 0, r == last_rank)
        t_reduce, t_gather = sync.reduce(params.dense, params.expert), sync.gather(params.dense, params.expert)
        bwd_window = sum(t.backward_input + t.bwd_weight_compute for t in chunk_pass[r])
        fwd_window = sum(t.forward for t in chunk_pass[r])
        # Megatron's overlap leaves one bucket exposed: the last layer's gradients, the first layer's weights
        # (one virtual stage with interleaving): kernels.overlapped_exposed
        unhidden = 1 / lay.vpp if lay.vpp > 1 else 1 / max(count, 1)
        if ctx.reduce_in_backward:
            # the layers' reduce-scatters ran in each backward (layer_times); the embedding / head / MTP gradients
            # of the last micro-batch remain, and the last layer bucket, which no compute follows
            edges = stage_params(ctx.model, lay, range(0), r == 0, r == last_rank)
            t_edges = sync.reduce(edges.dense, edges.expert)
            tail = unhidden * (t_reduce - t_edges) if eff.physics.overlap_limits and rt.overlap_grad_reduce else 0.0
            exposed = tail + (t_edges if not rt.overlap_grad_reduce
                              else overlapped_exposed(t_edges, bwd_window, 0.0, eff.physics))
        else:
            exposed = (t_reduce if not rt.overlap_grad_reduce
                       else overlapped_exposed(t_reduce, bwd_window, unhidden, eff.physics))
        exposed += (t_gather if not rt.overlap_param_gather
                    else overlapped_exposed(t_gather, fwd_window, unhidden, eff.physics))
        optim = sync.optimizer(params.dense, params.expert) + fp8_weight_cast_s(ctx, params, r == 0, r == last_rank)
        dp_exposed_per_rank.append(exposed)
        optim_per_rank.append(optim)
        finish.append(rank_end[r] + exposed + optim)
        stages.append(StageReport(r, (first, count), _stage_memory(ctx, r, ranges[r], params, timeline, modes),
                                  sum(timeline.peak_in_flight[r])))

    step = max(finish)
    crit = finish.index(step)
    busy = timeline.busy[crit]
    comm_by_dim: dict[str, float] = {}
    compute = recompute = 0.0
    for t in chunk_pass[crit]:
        compute += m * (t.fwd_compute + t.bwd_input_compute + t.bwd_weight_compute)
        recompute += m * t.recompute
        for d, v in list(t.fwd_comm.items()) + list(t.bwd_comm.items()):
            comm_by_dim[d] = comm_by_dim.get(d, 0.0) + m * v
    pp_comm = busy - compute - recompute - sum(comm_by_dim.values())
    breakdown = {"compute": compute, "recompute": recompute}
    breakdown.update({f"{d}_comm": v for d, v in sorted(comm_by_dim.items())})
    breakdown["pp_comm"] = max(0.0, pp_comm)
    breakdown["pipeline_bubble"] = rank_end[crit] - busy
    # the step-end DP exposure adds to the per-layer DP collectives of ZeRO-2/3 (their "dp" key above)
    breakdown["dp_comm"] = breakdown.get("dp_comm", 0.0) + dp_exposed_per_rank[crit]
    breakdown["optimizer"] = optim_per_rank[crit]

    tokens = workload.tokens
    model_flops = model_flops_per_step(model, workload)
    hw_flops = model_flops + recompute_flops_per_step(model, workload, modes, lay.recompute_modules)
    gpus = cluster.num_gpus
    peak = ctx.peak_fp8 if workload.dtype == "fp8" else ctx.peak16
    est = Estimate(
        layout=lay, runtime=rt.name, step_time_s=step, tokens_per_s=tokens / step,
        tokens_per_s_per_gpu=tokens / step / gpus, tflops_per_gpu=model_flops / step / gpus / 1e12,
        mfu=model_flops / step / gpus / peak, hfu=hw_flops / step / gpus / peak, breakdown_s=breakdown,
        stages=tuple(stages), hbm_gib=cluster.gpu.hbm_gib.value,
        bubble_fraction=timeline.bubble_fraction(),
        realism=realism_check(cluster.spec.gpu, model.moe is not None, workload.dtype, model_flops / step / gpus / peak),
    )
    return Simulated(est, timeline, p2p_s)


def op_sac_recomputed(op: Op, model: ModelSpec) -> float:
    """The share of an operator's forward torchtitan's op-level SAC re-runs in the backward (memory._op_sac_bytes):
    every memory-bound operator; of the matmuls every second one in forward order: the k projection (wk, or its
    share of a fused qkv), the output projection, the SwiGLU up half (w3) or the GeLU down projection; the
    attention kernel's output is saved."""
    if op.name == "cp_merge":  # inside the saved SDPA op (torch context_parallel dispatches it whole)
        return 0.0
    if op.name == "async_tp_partials_sum":  # part of the fused reduce-scatter, whose output the SAC list saves
        return 0.0
    if op.kind == "memory":
        return 1.0
    if op.kind == "attention":
        return 0.0
    if op.name == "qkv_proj" and model.mla is None:
        q, kv = model.num_heads, model.kv_heads
        return kv / (q + 2 * kv)
    swiglu = model.mlp == "swiglu"
    share = {"wq": 0.0, "wk": 1.0, "wv": 0.0, "w1": 0.0, "w3": 1.0, "out_proj": 1.0, "up_gate_proj": 0.5,
             "up_proj": 0.0, "down_proj": 0.0 if swiglu else 1.0}
    return share.get(op.name, 0.5)


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


def _layer_mix(model: ModelSpec, layers: range, modes: tuple[str, ...]) -> dict[tuple[int, str], int]:
    """How many of `layers` run in each (kind, recompute mode), keyed by one layer of that kind: layers of one
    kind cost the same (CostContext caches by kind), so a stage's sums need one term per key, not per layer."""
    first_of_kind: dict[bool, int] = {}
    mix: dict[tuple[int, str], int] = {}
    for i in layers:
        rep = first_of_kind.setdefault(model.is_moe_layer(i), i)
        mix[(rep, modes[i])] = mix.get((rep, modes[i]), 0) + 1
    return mix


def _stage_params(ctx: CostContext, chunks: list[tuple[int, int]], modes: tuple[str, ...], first: bool,
                  last: bool) -> StageParams:
    """stage_params of a rank's chunks (non-contiguous under virtual stages) from the context's per-kind counts."""
    edge = stage_params(ctx.model, ctx.lay, range(0), first, last)
    dense, expert = edge.dense, edge.expert
    for f, n in chunks:
        for (rep, _), count in _layer_mix(ctx.model, range(f, f + n), modes).items():
            per = ctx.layer_params(rep)
            dense += count * per.dense
            expert += count * per.expert
    return StageParams(dense, expert)


def _stage_memory(ctx: CostContext, rank: int, chunks: list[tuple[int, int]], params: StageParams,
                  timeline: Timeline, modes: tuple[str, ...]) -> MemoryBreakdown:
    model, lay, wl, rt = ctx.model, ctx.lay, ctx.wl, ctx.rt
    weights, grads, optim = model_state_bytes(params, lay, rt.holds_unsharded_grads(lay.zero, lay.pp))
    acts = 0.0
    for c, (first, count) in enumerate(chunks):
        held = timeline.peak_in_flight[rank][c]
        per_mb = sum(n * ctx.layer_activation(i, mode)
                     for (i, mode), n in _layer_mix(ctx.model, range(first, first + count), modes).items())
        acts += held * per_mb
    if rank == 0:
        acts += sum(timeline.peak_in_flight[0]) * embedding_activation_bytes(model, lay, wl, rt)
    if lay.offload_layers:  # pp 1: the first layers' activations wait on the host, one layer's in transit
        off = [ctx.layer_activation(i, modes[i]) for i in range(lay.offload_layers)]
        acts -= timeline.peak_in_flight[0][0] * sum(off) - max(off)
    first = chunks[0][0]
    if lay.stage_recompute[rank].granularity != "none":
        # The layer being recomputed holds what recomputation regenerates during its backward (Korthikanti sec. 5).
        acts += ctx.layer_activation(first, "none") - ctx.layer_activation(first, modes[first])
    logits = logits_bytes(model, lay, wl, rt) if rank == lay.pp - 1 else 0.0
    if rank == lay.pp - 1:
        acts += mtp_activation_bytes(model, lay, wl, rt)  # one micro-batch's, as for the logits
    buffers = ctx.buffer_bytes
    sub = weights + grads + optim + acts + logits + buffers
    return MemoryBreakdown(weights, grads, optim, acts, logits, buffers, FRAGMENTATION * sub)


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
