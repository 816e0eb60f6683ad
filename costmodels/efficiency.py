"""How close to its peaks the GPU runs each kind of work (Efficiency: defaults from hardware_db, or fitted to a
calibration), and the calibrated cluster a calibration file stands for."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

from meshplan.costmodels import comm
from meshplan.costmodels.kernels import FA2_BACKWARD_OVER_FORWARD, Physics
from meshplan.costmodels.ops import memory_class
from meshplan.hardware_db.calibration import (Calibration, Curve, FactorCalibration, LayerOverhead, StepOverhead,
                                              calibrated_gpu, cpu_device_spec, digest, is_public)
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.decode_kernels import decode_kernels
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import GPUSpec, load_gpu

EXECUTOR_RUNTIME = "meshplan-executor"  # the reference executor's preset (runtime.RUNTIMES): what profiles measure


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
    request_s: float = 0.0  # serving: a request's front-end time, on TTFT only (an engine calibration's; else 0)
    collectives: tuple[tuple[str, int, float, float], ...] = ()  # (kind, ranks, alpha_s, bytes_per_s)
    memory_classes: tuple[tuple[str, float, float], ...] = ()  # (ops.memory_class, alpha_s, bytes_per_s)
    optimizer_s_per_param: float | None = None  # measured optimizer step per local parameter
    curve_peak: float = 0.0  # the 16-bit peak the curves were measured against (fp8 GEMMs: half the time)
    activation_ratios: tuple[tuple[str, float], ...] = ()  # (recompute mode, measured / formula activations)
    activation_factor: float = 1.0  # on every layer's activations: fit to measured peak memory (fit.fit_memory)
    calibration: str | None = None  # "file name sha256:..." of the calibration, for the plan's record
    public: bool = False  # the calibration is --calibration public's, whose errors residuals.json holds too
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
    # serving: decode attention on paged caches and decode GEMMs as the engine's kernels run them, (KV dtype or
    # weight format, fixed seconds, share of HBM bandwidth) (hardware_db/decode_kernels.py; from_gpu: the engines'
    # median); () keeps the roofline
    decode_attention: tuple[tuple[str, float, float], ...] = ()
    decode_gemm: tuple[tuple[str, float, float], ...] = ()
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
    def from_gpu(cls, gpu: GPUSpec, physics: Physics | None = None) -> Efficiency:
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
                   decode_attention=decode_kernels(gpu.name, "attention"),
                   decode_gemm=decode_kernels(gpu.name, "gemm"), physics=physics or Physics())

    @classmethod
    def from_calibration(cls, cal: Calibration, gpu: GPUSpec, label: str, runtime: str | None = None) -> Efficiency:
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

    @property
    def residual_table(self) -> Literal["defaults", "public"] | None:
        """The shipped residuals that describe this model's errors (costmodels/uncertainty.py): the defaults', the
        public calibration's, or none (any other calibration)."""
        if self.calibration is None:
            return "defaults"
        return "public" if self.public else None

    def highest_ceiling(self) -> float | None:
        """The largest fraction of its dtype's peak any compute kernel reaches (op_time: ceiling x saturation x
        shape factors, none above 1), or None where measured curves set the rate instead."""
        if self.gemm_curve or self.attention_curve or self.gemm_bwd_curve or self.attention_bwd_curve:
            return None
        return max(self.gemm_max, self.fp8_gemm_max, self.grouped_gemm_max, self.fp8_grouped_gemm_max,
                   self.attention_max, self.attention_bwd_max, self.attention_fa2_max, self.attention_fa2_bwd_max,
                   self.attention_cudnn_max, self.attention_cudnn_bwd_max)

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
        return self.activation_factor * next((r for m, r in self.activation_ratios if m == mode), 1.0)

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


GEMM_CEILINGS = ("gemm_max", "fp8_gemm_max", "grouped_gemm_max", "fp8_grouped_gemm_max")
ATTENTION_CEILINGS = ("attention_max", "attention_bwd_max", "attention_fa2_max", "attention_fa2_bwd_max",
                      "attention_cudnn_max", "attention_cudnn_bwd_max")
NETWORK_SHARES = ("scaleup_bandwidth", "scaleup_a2a_bandwidth", "scaleout_bandwidth")


def scaled(gpu: GPUSpec, eff: Efficiency, log_factors: dict[str, float]) -> tuple[GPUSpec, Efficiency]:
    """The GPU spec and efficiency model with each factor applied to its defaults (shares and ceilings at most 1)."""
    def factor(name: str) -> float:
        return math.exp(log_factors.get(name, 0.0))

    network = {f: None if v is None else min(v * factor("network"), 1.0)
               for f in NETWORK_SHARES for v in [getattr(gpu.efficiency, f)]}
    gpu = gpu.model_copy(update={"efficiency": gpu.efficiency.model_copy(update=network)})
    update: dict[str, float] = {f: min(getattr(eff, f) * factor("gemm"), 1.0) for f in GEMM_CEILINGS}
    update |= {f: min(getattr(eff, f) * factor("attention"), 1.0) for f in ATTENTION_CEILINGS}
    update["memory_bandwidth"] = min(eff.memory_bandwidth * factor("memory"), 1.0)
    update["kernel_overhead_s"] = eff.kernel_overhead_s * factor("overhead")
    # the engines' measured decode kernels stream at their own shares of HBM, scaled as the memory-bound kernels are
    tables = {name: tuple((dtype, fixed, min(share * factor("memory"), 1.0)) for dtype, fixed, share in
                          getattr(eff, name)) for name in ("decode_attention", "decode_gemm")}
    return gpu, dataclasses.replace(eff, **update, **tables)  # type: ignore[arg-type]


def factor_cluster(spec: ClusterSpec, cal: FactorCalibration, origin: str) -> tuple[Cluster, Efficiency]:
    """The cluster and efficiency model under factors fit to measured runs (meshplan calibrate): the GPU's defaults
    scaled (scaled), for the GPU type the runs ran on."""
    if cal.gpu != spec.gpu:
        raise InputError(f"{origin} was fit to runs on {cal.gpu}, not on {spec.gpu}: calibrate on runs of {spec.gpu} "
                         f"or plan without --calibration")
    gpu = load_gpu(spec.gpu)
    gpu, eff = scaled(gpu, Efficiency.from_gpu(gpu), cal.log_factors())
    label = f"{origin.rsplit('/', 1)[-1]} sha256:{digest(cal)}"
    activations = 1.0 if cal.activations is None else cal.activations.factor
    return Cluster(spec, gpu=gpu), dataclasses.replace(eff, calibration=label, activation_factor=activations,
                                                       public=is_public(cal))


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
