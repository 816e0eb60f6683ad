"""Calibration files, of two kinds that `--calibration` takes alike:
- what `meshplan profile` measured on one device, and the efficiency model fitted to it (`Calibration`);
- factors on a GPU's defaults fit to measured runs by `meshplan calibrate --runs` (`FactorCalibration`, `"kind":
  "factors"`; costmodels/fit.py).

A calibration is data (this package computes no costs): the device it was measured on, the software, the raw
measurements (every timed GEMM, attention call, memory-bound operator, collective and the activation memory of a
layer) and the fitted model the cost model reads (costmodels/calibrate.py fits it; docs/calibration.md). It is
versioned JSON: a file from a newer meshplan (a higher `schema_version`) or from another device type is refused
with one line that says what to do.
"""

from __future__ import annotations

import hashlib
import math
from functools import cache
from importlib import resources
from itertools import pairwise
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from meshplan.hardware_db.documents import parse_document, read_text
from meshplan.hardware_db.errors import InputError, field_error
from meshplan.hardware_db.gpu import EfficiencyDefaults, GPUSpec, Sourced

CALIBRATION_SCHEMA_VERSION = 1
DocumentT = TypeVar("DocumentT", bound=BaseModel)
CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]


class _Frozen(BaseModel):
    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid", allow_inf_nan=False)


class DeviceInfo(_Frozen):
    """What was profiled. `target` is the hardware_db GPU name the calibration applies to (e.g. "h100-sxm"), or
    "cpu" for a host CPU, which has no hardware_db entry: its device spec is built from the measurements."""

    kind: Literal["cuda", "cpu"]
    target: str = Field(min_length=1)
    name: str = Field(description="the device's own name (torch.cuda.get_device_name, or the CPU model)")
    threads: int = Field(ge=1, description="intra-op threads per rank during the profile")
    memory_bytes: float = Field(gt=0, description="device memory (GPU) or the host's RAM (CPU)")


class Software(_Frozen):
    meshplan: str
    python: str
    torch: str
    backend: str = Field(description="collective backend: gloo or nccl")
    backend_version: str = ""
    cuda: str = ""


class GemmPoint(_Frozen):
    """One [m,k] x [k,n] product: FLOPs 2mnk, the median seconds. Backward points are a forward shape's input
    gradient ([m,n] x [n,k]) and weight gradient ([k,m] x [m,n]) as autograd runs them (transposed operands)."""

    name: str
    direction: Literal["forward", "backward"] = "forward"
    m: int = Field(ge=1)
    n: int = Field(ge=1)
    k: int = Field(ge=1)
    seconds: float = Field(gt=0)

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


class AttentionPoint(_Frozen):
    """One causal SDPA call: shapes, the cost model's FLOPs for it (costmodels/ops.py), forward and backward seconds."""

    batch: int = Field(ge=1)
    heads: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    seq: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    fwd_flops: float = Field(gt=0)
    fwd_seconds: float = Field(gt=0)
    bwd_seconds: float = Field(gt=0)


class MemoryOpPoint(_Frozen):
    """One memory-bound operator: the bytes the cost model counts for it (16-bit elements) and the median seconds."""

    name: str
    direction: Literal["forward", "backward"]
    elements: int = Field(ge=1)
    model_bytes: float = Field(gt=0)
    seconds: float = Field(gt=0)


class OptimizerPoint(_Frozen):
    """One optimizer step (torch AdamW) over `params` parameters held as layer-sized tensors; median seconds."""

    params: int = Field(ge=1)
    seconds: float = Field(gt=0)


class CollectivePoint(_Frozen):
    """One collective over `ranks` ranks on a buffer of `bytes` (comm.py's convention: the logical buffer)."""

    kind: CollectiveKind
    ranks: int = Field(ge=2)
    bytes: float = Field(gt=0)
    seconds: float = Field(gt=0)


class ActivationPoint(_Frozen):
    """Autograd's saved bytes for one decoder layer's forward (the executor's layer) vs the cost model's formula."""

    model: str
    tokens: int = Field(ge=1)
    recompute: Literal["none", "selective", "full"] = "none"
    measured_bytes: float = Field(gt=0)
    predicted_bytes: float = Field(gt=0)


class Measurements(_Frozen):
    dtype: str = Field(description="torch dtype the operators ran in")
    gemms: tuple[GemmPoint, ...] = Field(min_length=2)
    attention: tuple[AttentionPoint, ...] = Field(min_length=2)
    memory_ops: tuple[MemoryOpPoint, ...] = Field(min_length=2)
    collectives: tuple[CollectivePoint, ...] = ()
    activations: tuple[ActivationPoint, ...] = ()
    optimizer: tuple[OptimizerPoint, ...] = ()


class Curve(_Frozen):
    """Seconds as a non-decreasing function of FLOPs, given at points of increasing FLOPs; between points
    log-log interpolation, below the first the first time, above the last the last achieved rate."""

    flops: tuple[float, ...] = Field(min_length=1)
    seconds: tuple[float, ...] = Field(min_length=1)

    @model_validator(mode="after")
    def _monotone(self) -> Curve:
        if len(self.flops) != len(self.seconds):
            raise ValueError("flops and seconds must have the same length")
        if any(f <= 0 for f in self.flops) or any(t <= 0 for t in self.seconds):
            raise ValueError("flops and seconds must be positive")
        if any(b <= a for a, b in pairwise(self.flops)):
            raise ValueError("flops must increase")
        if any(b < a for a, b in pairwise(self.seconds)):
            raise ValueError("seconds must not decrease with flops")
        return self


class LinearFit(_Frozen):
    """t = alpha_s + bytes / bytes_per_s."""

    alpha_s: float = Field(ge=0)
    bytes_per_s: float = Field(gt=0)


class MemoryClassFit(LinearFit):
    """A memory-bound operator class (costmodels/ops.py memory_class): its launch cost and achieved rate."""

    name: str


class OptimizerFit(_Frozen):
    """t = alpha_s + params / params_per_s for one optimizer step."""

    alpha_s: float = Field(ge=0)
    params_per_s: float = Field(gt=0)


class CollectiveFit(LinearFit):
    kind: CollectiveKind
    ranks: int = Field(ge=2)


class Overhead(_Frozen):
    """Seconds beyond the sum of the operators' fitted times (framework dispatch, autograd, copies and kernels
    the cost model does not list), per micro-batch: the median over the profiled sequence lengths. (A line in
    the tokens was tried: on a shared 2-core VM its slope was noise, of either sign from run to run.)"""

    # a residual may be slightly negative (the fitted operators overshoot); past a second either way it is no
    # measurement of a layer or a step (a corrupt or hand-edited file)
    forward_s: float = Field(ge=-1.0, le=3600.0)
    backward_s: float = Field(ge=-1.0, le=3600.0)


class LayerOverhead(Overhead):
    """A decoder layer's overhead, measured on the profile's layer at a TP degree, with or without SP."""

    tp: int = Field(ge=1)
    sp: bool = False


class StepOverhead(Overhead):
    """A whole model's overhead outside its layers (embedding, head, loss and what runs around them)."""


class FittedModel(_Frozen):
    """What the cost model reads (costmodels/efficiency.py: Efficiency.from_calibration)."""

    gemm: Curve
    attention: Curve
    gemm_backward: Curve | None = None
    attention_backward: Curve | None = None
    layer_overhead: tuple[LayerOverhead, ...] = ()
    step_overhead: StepOverhead | None = None
    memory: LinearFit  # memory-bound operators: launch cost + the cost model's bytes at this rate
    memory_classes: tuple[MemoryClassFit, ...] = ()  # the same per operator class
    optimizer: OptimizerFit | None = None
    peak_flops: float = Field(gt=0, description="the fastest measured GEMM's FLOP/s (a CPU's peak; a GPU reports)")
    collectives: tuple[CollectiveFit, ...] = ()
    ring: LinearFit | None = Field(default=None, description="per-step latency and bus bandwidth over all collectives")
    activation_ratio: float | None = Field(default=None, gt=0, description="measured / predicted layer activations")
    activation_ratios: dict[Literal["none", "selective", "full"], Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="the same per recompute mode")

    def activation_ratio_for(self, mode: str) -> float:
        """measured / predicted activations of a layer under this recompute mode (1 where not measured)."""
        for measured, ratio in self.activation_ratios.items():
            if measured == mode:
                return ratio
        return self.activation_ratio if mode == "none" and self.activation_ratio else 1.0


class Calibration(_Frozen):
    schema_version: int
    created: str
    device: DeviceInfo
    software: Software
    measurements: Measurements
    fitted: FittedModel

    def collective(self, kind: str, ranks: int) -> CollectiveFit | None:
        return next((c for c in self.fitted.collectives if c.kind == kind and c.ranks == ranks), None)


FactorName = Literal["gemm", "attention", "memory", "network", "overhead"]  # costmodels/efficiency.scaled


class FittedFactor(_Frozen):
    factor: float = Field(gt=0, description="the default's multiplier")
    log_sd: float = Field(ge=0, description="posterior spread of log(factor)")


class FactorCalibration(_Frozen):
    """Factors on a GPU type's defaults, fit to measured runs (meshplan calibrate --runs; costmodels/fit.py)."""

    kind: Literal["factors"]
    schema_version: int
    created: str
    gpu: str  # the hardware_db GPU the runs ran on
    runtimes: list[str]  # the runs' runtimes
    runs: int = Field(ge=1)
    sources: list[str]  # the runs files
    factors: dict[FactorName, FittedFactor]
    error_before: float = Field(ge=0, description="MAPE of the runs' step times with the defaults")
    error_after: float = Field(ge=0, description="the same with the factors (runs the fit saw)")
    prior: str = Field(default="defaults", description=(
        "where the priors are centred: the GPU's defaults, its public calibration, a kernel table"))
    error_prior: float | None = Field(default=None, ge=0, description=(
        "MAPE of the runs' step times with the factors the priors centre on, where not the defaults"))
    held_out_before: float | None = Field(default=None, ge=0, description="MAPE of runs left out of the fit")
    held_out_after: float | None = Field(default=None, ge=0)
    # memory, where the runs report their peak (costmodels/fit.py fit_memory): one factor on the layers' activations
    activations: FittedFactor | None = Field(default=None, description=(
        "factor on every layer's predicted activation memory, fit to the runs' measured peaks"))
    memory_runs: int = Field(default=0, ge=0, description="runs with a measured peak memory")
    memory_error_before: float | None = Field(default=None, ge=0, description="MAPE of those peaks, defaults")
    memory_error_after: float | None = Field(default=None, ge=0, description="the same with the factor")
    memory_held_out_before: float | None = Field(default=None, ge=0, description="MAPE of peaks left out of the fit")
    memory_held_out_after: float | None = Field(default=None, ge=0)

    def log_factors(self) -> dict[str, float]:
        return {name: math.log(f.factor) for name, f in self.factors.items()}


ServeMetric = Literal["ttft", "tpot", "throughput"]


class ServingResidual(_Frozen):
    """One measured deployment's error under a fit that never saw its model, as the serving intervals read it
    (costmodels/serving_uncertainty.py): positive where the prediction was optimistic, as the training residuals."""

    id: str  # the measured row's (AIConfigurator's silicon_sample.csv `id`), to set meshplan's figure beside others'
    model: str  # the row's checkpoint
    architecture: str  # the model it is an instance of (engine_fit.architecture): the unit a new model's error is of
    gpu: str
    mode: Literal["aggregated", "disaggregated"]
    moe: bool
    sequences: int = Field(ge=1, description="the closed loop's users per engine (decode engine where disaggregated)")
    ttft: float = Field(description="log(measured / predicted TTFT)")
    tpot: float = Field(description="log(measured / predicted TPOT)")
    throughput: float | None = Field(default=None, description=(
        "log(predicted / measured tokens/s/GPU); None where the row lacks a pool's engine count"))


class EngineCalibration(_Frozen):
    """A serving engine's parameters fit to measured deployments (meshplan calibrate --deployments aic;
    costmodels/engine_fit.py): factors on each GPU's defaults and two additive times, with their posterior spreads
    and the leave-one-model-out error beside the uncalibrated one on the same rows."""

    kind: Literal["engine"]
    schema_version: int
    created: str
    engine: str  # vllm, sglang, trtllm (AIConfigurator's backend names)
    source: str  # the deployments: the wheel's version and the file's hash
    rows: int = Field(ge=1, description="the engine's rows the parameters were fit to")
    models: list[str]  # their checkpoints
    gpus: list[str]  # the GPU types they ran on
    factors: dict[FactorName, FittedFactor]
    iteration_s: float = Field(ge=0, le=0.02, description="host time per engine iteration (s)")
    iteration_sd_s: float = Field(ge=0)
    request_s: float = Field(ge=0, le=0.5, description="front-end time per request, on TTFT only (s)")
    request_sd_s: float = Field(ge=0)
    held_out: dict[ServeMetric, float] = Field(description=(
        "median absolute error of the engine's rows, each model's predicted by a fit that never saw it"))
    uncalibrated: dict[ServeMetric, float] = Field(description="the same rows with the GPUs' defaults")
    residuals: list[ServingResidual] = Field(default_factory=list, description=(
        "each held-out row's error, for the intervals of `serve` under this calibration"))


def calibration_dir() -> Path:
    return Path(str(resources.files("meshplan.hardware_db.calibrations")))


PUBLIC = "public"  # --calibration public: the GPU's calibration from the development sets' published runs
NONE = "none"  # --calibration none: the GPU's efficiency defaults as the hardware database states them, uncalibrated


def public_log_factors(gpu: str) -> dict[str, float] | None:
    """The log factors of `gpu`'s public calibration (where `meshplan calibrate` centres its priors), or None where
    meshplan ships none."""
    name = default_calibration(gpu)
    if name is None:
        return None
    cal = load_any_calibration(name)
    return cal.log_factors() if isinstance(cal, FactorCalibration) else None


def default_calibration(gpu: str) -> str | None:
    """What a command without --calibration uses: the GPU's public calibration where meshplan ships one (its factors
    fit to the published runs on that GPU, its ranges from their held-out errors), else None (the GPU's defaults)."""
    name = f"public-{gpu}"
    return name if (calibration_dir() / f"{name}.json").exists() else None


def public_calibration(gpu: str) -> str:
    """The name of `gpu`'s public calibration under hardware_db/calibrations (factors fit to every published run of
    that GPU in meshplan's development sets: benchmarks/crossval.py --write-public); one error line where the sets
    hold too few runs on it."""
    name = default_calibration(gpu)
    if name is None:
        have = sorted(p.stem.removeprefix("public-") for p in calibration_dir().glob("public-*.json"))
        raise InputError(f"no public calibration for {gpu}: the development sets hold too few published runs on it "
                         f"(there is one for {', '.join(have)}); plan without --calibration (its defaults), or fit "
                         f"one to your own runs with meshplan calibrate --runs")
    return name


def is_public(cal: FactorCalibration) -> bool:
    """Whether these are the shipped public factors of their GPU (by content, wherever the file was read from):
    the calibration whose held-out errors costmodels/residuals.json holds."""
    shipped = calibration_dir() / f"public-{cal.gpu}.json"
    return shipped.exists() and digest(load_any_calibration(shipped)) == digest(cal)


def shipped_calibration(label: str) -> FactorCalibration | None:
    """The public calibration a plan records by `label` ("public-<gpu> sha256:<digest>", Efficiency.calibration),
    where this meshplan ships that very file, so a reader re-simulates the plan under it; None otherwise (another
    calibration, or another version of the public one)."""
    name, _, recorded = label.partition(" sha256:")
    path = calibration_dir() / f"{name}.json"
    if not name.startswith("public-") or not path.exists():
        return None
    cal = load_any_calibration(path)
    return cal if isinstance(cal, FactorCalibration) and digest(cal) == recorded else None


def shipped_engine_calibration(engine: str) -> EngineCalibration | None:
    """The engine calibration this meshplan ships for `engine` (hardware_db/calibrations/engine-ENGINE.json, fit by
    benchmarks/serving_engine_fit.py --write), or None. Read once per version of the file: a serve reads it to price
    the engines, to give the plan its intervals and to re-derive a plan, and its residuals take ~0.1 s to validate."""
    path = calibration_dir() / f"engine-{engine}.json"
    return _engine_calibration_at(str(path), path.stat().st_mtime_ns) if path.exists() else None


@cache
def _engine_calibration_at(path: str, mtime_ns: int) -> EngineCalibration:
    """load_engine_calibration, kept per path and modification time (the model is frozen, so sharing it is safe)."""
    return load_engine_calibration(path)


def engine_calibration_named(label: str) -> EngineCalibration | None:
    """The shipped engine calibration a serving plan records by `label` ("engine-vllm sha256:..."), where this
    meshplan ships that very file; None otherwise."""
    name, _, recorded = label.partition(" sha256:")
    stem = name.removesuffix(".json")
    if not stem.startswith("engine-"):
        return None
    cal = shipped_engine_calibration(stem.removeprefix("engine-"))
    return cal if cal is not None and digest(cal) == recorded else None


def engine_calibration_file(path: str | Path) -> Path | None:
    """The file `path` names (a path, or a name under hardware_db/calibrations/ as --calibration takes it) where it
    declares itself a serving engine calibration ("kind": "engine"); None where it is another kind or no file."""
    try:
        p = _calibration_path(path)
    except InputError:
        return None
    if not p.is_file():
        return None
    data = parse_document(read_text(p, "a calibration .json"), "json", str(path))
    return p if isinstance(data, dict) and data.get("kind") == "engine" else None


def digest(cal: Calibration | FactorCalibration | EngineCalibration) -> str:
    """A short content hash: a plan records the calibration by file name and this, so a changed file shows."""
    return hashlib.sha256(cal.model_dump_json().encode()).hexdigest()[:12]


def parse_any_calibration(text: str, origin: str) -> Calibration | FactorCalibration:
    """Either kind of calibration document (the module docstring); InputError, one line, otherwise."""
    data = parse_document(text, "json", origin)
    if isinstance(data, dict) and data.get("kind") == "factors":
        return _validated(FactorCalibration, data, text, origin, "run meshplan calibrate again")
    if isinstance(data, dict) and data.get("kind") == "engine":
        raise InputError(f"{origin} holds a serving engine's parameters (meshplan calibrate --deployments), which "
                         f"only meshplan serve takes; give this command a GPU calibration (meshplan profile, or "
                         f"meshplan calibrate --runs)")
    return parse_calibration(text, origin)


def load_engine_calibration(path: str | Path) -> EngineCalibration:
    """A serving engine calibration file (meshplan calibrate --deployments); one InputError line otherwise."""
    text = read_text(Path(path), "an engine calibration .json")
    data = parse_document(text, "json", str(path))
    if not isinstance(data, dict) or data.get("kind") != "engine":
        raise InputError(f"{path} is not a serving engine calibration (no \"kind\": \"engine\"); make one with "
                         f"meshplan calibrate --deployments aic --engine ENGINE --out {path}")
    return _validated(EngineCalibration, data, text, str(path), "run meshplan calibrate --deployments again")


def load_any_calibration(path: str | Path) -> Calibration | FactorCalibration:
    """A calibration of either kind by path, or by name under hardware_db/calibrations/."""
    return parse_any_calibration(read_text(_calibration_path(path), "a calibration .json"), str(path))


def parse_calibration(text: str, origin: str) -> Calibration:
    """Validate a calibration document; every failure is one InputError line naming `origin` and the fix."""
    data = parse_document(text, "json", origin)
    if isinstance(data, dict) and data.get("kind") == "factors":
        raise InputError(f"{origin} holds factors fit to measured runs (meshplan calibrate); this needs the kernels "
                         f"measured on a device: make one with meshplan profile")
    if not isinstance(data, dict) or "schema_version" not in data:
        raise InputError(f"{origin}: not a calibration file (no schema_version); make one with meshplan profile")
    return _validated(Calibration, data, text, origin, "re-run meshplan profile")


def _validated(kind: type[DocumentT], data: Any, text: str, origin: str, remedy: str) -> DocumentT:
    """The document as `kind` once its schema version is this meshplan's; one InputError line ending in `remedy`
    otherwise."""
    version = data.get("schema_version") if isinstance(data, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
        raise InputError(f"{origin}: schema_version must be an integer, got {version!r}")
    if version > CALIBRATION_SCHEMA_VERSION:
        raise InputError(f"{origin}: calibration schema v{version} is newer than this meshplan reads "
                         f"(v{CALIBRATION_SCHEMA_VERSION}); upgrade meshplan or {remedy}")
    if version < CALIBRATION_SCHEMA_VERSION:
        raise InputError(f"{origin}: calibration schema v{version} is older than this meshplan reads "
                         f"(v{CALIBRATION_SCHEMA_VERSION}); {remedy}")
    try:
        # a file: no coercion (hardware_db/documents.STRICT); JSON mode, where arrays are tuples
        return kind.model_validate_json(text, strict=True)
    except ValidationError as exc:
        raise InputError(f"{origin}: {field_error(exc)}; {remedy}") from None


def load_calibration(path: str | Path) -> Calibration:
    """A calibration file by path, or by name under hardware_db/calibrations/ (with or without .json)."""
    return parse_calibration(read_text(_calibration_path(path), "a calibration .json"), str(path))


def _calibration_path(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        named = calibration_dir() / (p.name if p.suffix == ".json" else f"{p.name}.json")
        if p.parent == Path(".") and named.exists():
            return named
        raise InputError(f"calibration file '{path}' not found; make one with meshplan profile --out {path} or "
                         f"meshplan calibrate --runs RUNS --out {path}")
    return p


def check_target(cal: Calibration, gpu_name: str, origin: str) -> None:
    """Refuse a calibration measured on another device type than the one being planned for."""
    if cal.device.target != gpu_name:
        raise InputError(f"{origin} was measured on {cal.device.target} ({cal.device.name}), not on {gpu_name}: "
                         f"profile a {gpu_name} (meshplan profile --device cuda) or plan without --calibration")


def cpu_device_spec(cal: Calibration) -> GPUSpec:
    """A CPU host as the cost model's 'GPU', every number from the calibration's measurements (a CPU has no
    hardware_db entry: its peak and bandwidths are what this machine did). Ranks share one host: one scale-up
    domain, the collectives' measured rates (costmodels/calibrate.py applies them per kind and group size)."""
    if cal.device.kind != "cpu":
        raise InputError(f"the calibration is of a {cal.device.kind} device ({cal.device.target}); "
                         f"use it with --gpu {cal.device.target}")
    src = f"measured by meshplan profile on {cal.device.name}, {cal.created}"
    fit = cal.fitted
    ring = fit.ring or LinearFit(alpha_s=fit.memory.alpha_s, bytes_per_s=fit.memory.bytes_per_s)
    peak = Sourced(value=fit.peak_flops / 1e12, source=f"{src}: the fastest GEMM")
    return GPUSpec(
        name="cpu", display_name=f"CPU ({cal.device.name})", vendor="cpu",
        peak_tflops={"bf16": peak, "fp32": peak},
        hbm_gib=Sourced(value=cal.device.memory_bytes / 2**30, source=f"{src}: host RAM"),
        hbm_tb_s=Sourced(value=fit.memory.bytes_per_s / 1e12, source=f"{src}: memory-bound operators"),
        scaleup_gb_s=Sourced(value=ring.bytes_per_s / 1e9, source=f"{src}: ring fit over the collectives"),
        scaleup_domain=Sourced(value=1024, source="one host: every rank on the same machine"),
        nic_gb_s=Sourced(value=ring.bytes_per_s * 8 / 1e9, source="one host: no network (the ring fit)"),
        price_usd_per_hour=Sourced(value=1e-9, source="not applicable: a local CPU"),
        efficiency=EfficiencyDefaults(gemm_max=1.0, attention_max=1.0, memory_bandwidth=1.0, scaleup_bandwidth=1.0,
                                      scaleout_bandwidth=1.0, scaleup_latency_us=max(ring.alpha_s * 1e6, 1e-3),
                                      scaleout_latency_us=max(ring.alpha_s * 1e6, 1e-3),
                                      kernel_overhead_us=fit.memory.alpha_s * 1e6,
                                      source=f"{src} (a calibration replaces these)"),
    )


def calibrated_gpu(gpu: GPUSpec, cal: Calibration, origin: str = "the calibration") -> GPUSpec:
    """The GPU spec with the efficiency defaults replaced by what the calibration measured (memory roof and launch
    cost; the collectives' ring fit where ranks were profiled). The GEMM and attention curves replace gemm_max and
    attention_max in the cost model itself (costmodels/efficiency.py, Efficiency.from_calibration)."""
    check_target(cal, gpu.name, origin)  # a CPU calibration is its own device: cpu_device_spec
    fit = cal.fitted
    src = f"meshplan profile on {cal.device.name}, {cal.created}"
    update: dict[str, float | str] = {
        "memory_bandwidth": min(1.0, fit.memory.bytes_per_s / gpu.hbm_bytes_per_s),
        "kernel_overhead_us": fit.memory.alpha_s * 1e6,
        "source": f"calibrated: {src}",
    }
    if fit.ring is not None:
        update["scaleup_bandwidth"] = min(1.0, fit.ring.bytes_per_s / gpu.scaleup_bytes_per_s)
        update["scaleup_latency_us"] = max(fit.ring.alpha_s * 1e6, 1e-3)
    return gpu.model_copy(update={"efficiency": gpu.efficiency.model_copy(update=update)})
