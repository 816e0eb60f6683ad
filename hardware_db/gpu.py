"""GPU specifications: one TOML file per GPU under hardware_db/gpus/, every number with its source."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, ValidationError, field_validator

from meshplan.hardware_db.documents import STRICT, parse_document, read_text
from meshplan.hardware_db.errors import InputError, did_you_mean, field_error

DType = Literal["bf16", "fp16", "fp8", "fp4", "fp32"]


class Sourced(BaseModel):
    """A number and where it was read."""

    model_config = STRICT
    value: float = Field(gt=0, le=1e9)  # no figure in these units (TFLOP/s, GiB, GB/s, Gb/s, $) comes near 1e9
    source: str = Field(min_length=3)


class EfficiencyDefaults(BaseModel):
    """Achieved fractions of peak used when no calibration file is given.

    One set per GPU type, never per run. `source` says how the values were chosen. The schema defaults below are
    meshplan's stated assumptions (docs/cost_model.md, "Kernel efficiency") until `meshplan profile` measures them.
    """

    model_config = STRICT
    gemm_max: float = Field(default=0.75, gt=0, le=1)  # best GEMM efficiency at large training shapes (BF16)
    gemm_half_flops: float = Field(default=2.0e9, gt=0)  # GEMM FLOPs at which efficiency is half of gemm_max
    gemm_k_half: float = Field(default=0.0, ge=0)  # inner dimension at which the k-depth ramp halves it (0: none)
    # the same for FP8 GEMMs, whose main loop covers K twice as fast against the same per-tile prologue and epilogue;
    # default gemm_k_half
    fp8_gemm_k_half: float | None = Field(default=None, ge=0)
    # FP8 GEMM kernel ceiling as a fraction of the FP8 peak (per-tensor scaling: tensorwise / delayed); default:
    # 0.88 x gemm_max, the H100 best-shape FP8/BF16 ratio (70.9 % / 80.3 %, stas00/ml-engineering MAMF tables)
    fp8_gemm_max: float | None = Field(default=None, gt=0, le=1)
    fp8_block_factor: float = Field(default=0.81, gt=0, le=1)  # block / row-scaled FP8 kernels vs tensorwise
    # NVFP4 GEMM ceiling as a fraction of the FP4 peak (serving's fp4 weights); default the FP8 ceiling's fraction
    fp4_gemm_max: float | None = Field(default=None, gt=0, le=1)
    # FP8 GEMMs in any operand layout (Blackwell; TransformerEngine nvte_is_non_tn_fp8_gemm_supported: sm 10.x and
    # >= 13.0): per-tensor FP8 casts write no transposed copy (costmodels.kernels.QUANT_BYTES_ANY_LAYOUT)
    fp8_any_layout: bool = False
    # grouped expert GEMMs (BF16); default 0.5 x gemm_max, the conservative end of measured MoE kernels (torch
    # _grouped_mm / Triton fused MoE at 24-50 % of H100 peak: ByteDance-Seed/VeOmni PR #460)
    grouped_gemm_max: float | None = Field(default=None, gt=0, le=1)
    fp8_grouped_gemm_max: float | None = Field(default=None, gt=0, le=1)  # grouped FP8; default 0.5 x the FP8 ceiling
    # serving's routed experts with fp8 weights: (tokens per expert, achieved fraction of the FP8 peak) of the
    # grouped kernel, tokens ascending, held at the ends (below the first point the roofline's weight reads
    # govern). None: the dense ceiling
    fp8_grouped_by_tokens: list[list[float]] | None = None
    attention_max: float = Field(default=0.55, gt=0, le=1)  # fused (flash) attention core, forward
    # its backward; default 0.86 x forward (FlashAttention-3 on H100 at 16k: ~561 backward / 648 forward TFLOP/s)
    attention_bwd_max: float | None = Field(default=None, gt=0, le=1)
    attention_fa2_max: float | None = Field(default=None, gt=0, le=1)  # FlashAttention-2 kernels; default forward's
    # FlashAttention-2's backward; default 0.87 x its forward (costmodels.kernels.FA2_BACKWARD_OVER_FORWARD)
    attention_fa2_bwd_max: float | None = Field(default=None, gt=0, le=1)
    # cuDNN fused attention (TransformerEngine's backend on Hopper+), forward and backward; default the flash ones
    attention_cudnn_max: float | None = Field(default=None, gt=0, le=1)
    attention_cudnn_bwd_max: float | None = Field(default=None, gt=0, le=1)
    attention_causal_s0: float = Field(default=0.0, ge=0)  # keys at which causal tiles halve the rate (0: none)
    memory_bandwidth: float = Field(default=0.80, gt=0, le=1)  # elementwise / norm kernels vs HBM peak
    scaleup_bandwidth: float = Field(default=0.80, gt=0, le=1)  # NCCL bus bandwidth vs NVLink peak
    scaleup_a2a_bandwidth: float | None = Field(default=None, gt=0, le=1)  # all-to-all inside a node; default ring's
    scaleout_bandwidth: float = Field(default=0.85, gt=0, le=1)  # NCCL bus bandwidth vs NIC line rate
    scaleup_latency_us: float = Field(default=8.0, gt=0)  # per collective step inside a domain
    scaleout_latency_us: float = Field(default=15.0, gt=0)  # per collective step across nodes
    kernel_overhead_us: float = Field(default=4.0, ge=0)  # launch + sync per operator
    source: str = Field(min_length=3)

    @field_validator("fp8_grouped_by_tokens")
    @classmethod
    def _pairs_ascending(cls, v: list[list[float]] | None) -> list[list[float]] | None:
        if v is not None:
            if not v or any(len(p) != 2 or p[0] <= 0 or not 0 < p[1] <= 1 for p in v):
                raise ValueError("give [tokens per expert, fraction of the FP8 peak] pairs: tokens > 0, "
                                 "0 < fraction <= 1")
            if any(a[0] >= b[0] for a, b in zip(v, v[1:], strict=False)):
                raise ValueError("tokens per expert must ascend")
        return v


class GPUSpec(BaseModel):
    """One accelerator. Bandwidths: HBM in TB/s, scale-up in GB/s per GPU per direction, NIC in Gb/s per GPU."""

    model_config = STRICT
    name: str
    display_name: str
    vendor: Literal["nvidia", "amd", "cpu"]
    peak_tflops: dict[DType, Sourced]  # dense (no sparsity); fp8 absent where the chip has none
    hbm_gib: Sourced
    hbm_tb_s: Sourced
    scaleup_gb_s: Sourced  # NVLink / Infinity Fabric, per GPU, one direction
    scaleup_domain: Sourced  # GPUs that share the scale-up fabric
    nic_gb_s: Sourced  # scale-out line rate per GPU, Gb/s
    price_usd_per_hour: Sourced
    host_link_gb_s: Sourced | None = None  # GPU <-> host memory, GB/s per GPU per direction (activation offload)
    efficiency: EfficiencyDefaults

    @field_validator("scaleup_domain")
    @classmethod
    def _a_count(cls, v: Sourced) -> Sourced:
        if not float(v.value).is_integer():
            raise ValueError(f"scaleup_domain is a number of GPUs: a whole number, got {v.value:g}")
        return v

    @field_validator("peak_tflops")
    @classmethod
    def _needs_bf16(cls, v: dict[str, Sourced]) -> dict[str, Sourced]:
        if "bf16" not in v and "fp16" not in v:
            raise ValueError("peak_tflops needs at least bf16 or fp16")
        return v

    def peak_flops(self, dtype: str) -> float:
        """Dense peak FLOP/s for a dtype, or InputError if the chip has no such tensor path."""
        if dtype not in self.peak_tflops:
            have = ", ".join(sorted(self.peak_tflops))
            raise InputError(f"GPU '{self.name}' has no {dtype} peak (it has: {have}); choose --dtype from those")
        return self.peak_tflops[dtype].value * 1e12

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib.value * 2**30

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tb_s.value * 1e12

    @property
    def scaleup_bytes_per_s(self) -> float:
        return self.scaleup_gb_s.value * 1e9

    @property
    def host_link_bytes_per_s(self) -> float:
        """GPU-host bandwidth one way; InputError where the GPU file does not give it."""
        if self.host_link_gb_s is None:
            raise InputError(f"GPU '{self.name}' has no host_link_gb_s (its GPU <-> CPU bandwidth), which activation "
                             f"offload needs: add it with its source to the GPU's TOML (docs/hardware.md)")
        return self.host_link_gb_s.value * 1e9

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gb_s.value * 1e9 / 8


def _gpu_dir():
    return resources.files("meshplan.hardware_db.gpus")


def list_gpus() -> list[str]:
    """Names of the built-in GPUs."""
    return sorted(p.name[: -len(".toml")] for p in _gpu_dir().iterdir() if p.name.endswith(".toml"))


def parse_gpu(text: str, origin: str) -> GPUSpec:
    """Validate one GPU TOML document; `origin` names it in errors."""
    data = parse_document(text, "toml", origin)
    try:
        return GPUSpec.model_validate(data)
    except ValidationError as exc:
        raise InputError(f"{origin}: {field_error(exc)}") from None


def load_gpu(name_or_path: str) -> GPUSpec:
    """A built-in GPU by name (e.g. 'h100-sxm') or a GPU TOML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.exists():
        return parse_gpu(read_text(path, "a GPU .toml"), str(path))
    key = name_or_path.strip().lower()
    entry = _gpu_dir() / f"{key}.toml"
    if not entry.is_file():
        known = ", ".join(list_gpus())
        hint = did_you_mean(key, list_gpus())
        raise InputError(f"unknown GPU '{name_or_path}';{hint} known GPUs: {known} (or pass a GPU .toml file)")
    return parse_gpu(entry.read_text(encoding="utf-8"), f"hardware_db/gpus/{key}.toml")
