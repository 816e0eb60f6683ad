"""GPU specifications: one TOML file per GPU under hardware_db/gpus/, every number with its source."""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from hardware_db.errors import InputError, field_error

DType = Literal["bf16", "fp16", "fp8", "fp32"]


class Sourced(BaseModel):
    """A number and where it was read."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    value: float = Field(gt=0)
    source: str = Field(min_length=3)


class EfficiencyDefaults(BaseModel):
    """Achieved fractions of peak used when no calibration file is given.

    One set per GPU type, never per run. `source` says how the values were chosen. The schema defaults below are
    meshplan's stated assumptions (docs/cost_model.md, "Efficiency defaults") until `meshplan profile` measures them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")
    gemm_max: float = Field(default=0.75, gt=0, le=1)  # best GEMM efficiency at large shapes
    gemm_half_flops: float = Field(default=2.0e9, gt=0)  # GEMM FLOPs at which efficiency is half of gemm_max
    attention_max: float = Field(default=0.55, gt=0, le=1)  # fused (flash) attention core
    memory_bandwidth: float = Field(default=0.80, gt=0, le=1)  # elementwise / norm kernels vs HBM peak
    scaleup_bandwidth: float = Field(default=0.80, gt=0, le=1)  # NCCL bus bandwidth vs NVLink peak
    scaleout_bandwidth: float = Field(default=0.85, gt=0, le=1)  # NCCL bus bandwidth vs NIC line rate
    scaleup_latency_us: float = Field(default=8.0, gt=0)  # per collective step inside a domain
    scaleout_latency_us: float = Field(default=15.0, gt=0)  # per collective step across nodes
    kernel_overhead_us: float = Field(default=4.0, ge=0)  # launch + sync per operator
    source: str = Field(min_length=3)


class GPUSpec(BaseModel):
    """One accelerator. Bandwidths: HBM in TB/s, scale-up in GB/s per GPU per direction, NIC in Gb/s per GPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")
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
    efficiency: EfficiencyDefaults

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
    def nic_bytes_per_s(self) -> float:
        return self.nic_gb_s.value * 1e9 / 8


def _gpu_dir():
    return resources.files("hardware_db.gpus")


def list_gpus() -> list[str]:
    """Names of the built-in GPUs."""
    return sorted(p.name[: -len(".toml")] for p in _gpu_dir().iterdir() if p.name.endswith(".toml"))


def parse_gpu(text: str, origin: str) -> GPUSpec:
    """Validate one GPU TOML document; `origin` names it in errors."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{origin}: not valid TOML ({exc})") from None
    try:
        return GPUSpec.model_validate(data)
    except ValidationError as exc:
        raise InputError(f"{origin}: {field_error(exc)}") from None


def load_gpu(name_or_path: str) -> GPUSpec:
    """A built-in GPU by name (e.g. 'h100-sxm') or a GPU TOML file by path."""
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.exists():
        return parse_gpu(path.read_text(), str(path))
    key = name_or_path.strip().lower()
    entry = _gpu_dir() / f"{key}.toml"
    if not entry.is_file():
        known = ", ".join(list_gpus())
        raise InputError(f"unknown GPU '{name_or_path}'; known GPUs: {known} (or pass a GPU .toml file)")
    return parse_gpu(entry.read_text(), f"hardware_db/gpus/{key}.toml")
