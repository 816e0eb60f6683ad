"""The second development set: published training runs beyond benchmarks/training_dev.yaml.

`benchmarks/published_runs.yaml` is meshplan's own data file. Each entry is one run as its authors published it:
where it was read (URL, the place on the page and the figure itself as printed), the model, the GPUs, the
workload, every parallel knob the source states, the knobs it does not state with the value assumed and why, the
framework and its features, and the measured figure in the source's own metric.

Usage:  python benchmarks/published_runs.py --check [FILE ...]   # validate data files (default: the set)
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILE = ROOT / "benchmarks" / "published_runs.yaml"

# What a source can say of a framework's execution; the scorer maps some of these onto the runtime preset.
Feature = Literal[
    "torch.compile",  # torchtitan / PyTorch: compiled blocks (fused elementwise kernels)
    "compiled-loss",  # torchtitan >= PR #1033 (2025-04): the cross-entropy compiled too (build_cross_entropy_loss)
    "async-tp",  # TP all-gather / reduce-scatter decomposed and overlapped with the GEMMs (PyTorch async TP)
    "tp-comm-overlap",  # Megatron / TransformerEngine userbuffers TP overlap
    "fp8-param-gather",  # FSDP / distributed optimizer gathers fp8 weights
    "bf16-grads",  # gradients kept and reduced in bf16 (Megatron-Bridge perf recipes, NeMo 2 MLPerf pretrain.py:
    # grad_reduce_in_fp32 false; NeMo 1: optim.grad_sync_dtype bf16)
    "cuda-graphs",  # CUDA graphs around layers or the whole step
    "deepep",  # DeepEP all-to-all dispatcher
    "fp8-dispatch",  # EP dispatch in FP8, combine in BF16 (DeepSeek-V3 report sec. 3.3.3)
    "ep-a2a-overlap",  # EP all-to-all overlapped with another micro-batch's compute (1F1B A2A overlap, DualPipe-like)
    "overlap-grad-reduce",
    "overlap-param-gather",
    "packed-sequences",
    "flash-attention-2",
    "flash-attention-3",
    "cudnn-attention",
    "fused-kernels",
    "activation-offload",
    "power-limited",
    "sharded-grad-accumulation",  # ZeRO-2/3 gradients reduce-scattered in every micro-batch's backward under PP too
    "sp-regather",  # SP linears save their input shard and gather it again in the backward (Megatron's SP)
    "native-gqa",  # the attention kernel reads grouped K,V heads in place (no repeat_kv copy to the query heads)
]
Metric = Literal["tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "step_time_s", "samples_per_s"]
# How the source counts model FLOPs when its metric is TFLOP/s or MFU (the scorer implements each):
#   megatron-2021: 96 B s l h^2 (1 + s/6h + V/16lh), recompute counted (Narayanan et al. SC'21 Eq. 3)
#   megatron: 72 B s l h^2 (1 + s/6h + V/12lh) (Korthikanti et al. 2022 Eq. 7; Megatron-LM training.py before
#     2025-03, generalised to GQA/SwiGLU/MoE there: attention scores counted in full)
#   megatron-causal: Megatron-LM training.py from 2025-03-06 (commit 8873b55): the causal half of the scores only,
#     as meshplan's own MFU counts them (costmodels.estimate.model_flops_per_step)
#   6n: 6 x active non-embedding parameters (the LM head counted) x tokens (Kaplan et al. 2020)
#   palm: 6 N + 12 L H Q T per token (Chowdhery et al. 2022, App. B), N the non-embedding parameters
FlopsAccounting = Literal["megatron-2021", "megatron", "megatron-causal", "6n", "palm"]


class Source(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    url: str = Field(pattern=r"^https?://")
    where: str = Field(min_length=3)  # section / table / row on that page
    figure: str = Field(min_length=3)  # the figure as printed (a table row, a sentence), copied exactly
    date: str | None = None  # of the measurement or the page


class Parallel(BaseModel):
    """The run's parallel configuration in meshplan's terms (docs/cost_model.md). FSDP / Megatron-FSDP / ZeRO-3
    is zero 3; Megatron's distributed optimizer zero 1; plain DDP zero 0."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    tp: int = Field(default=1, gt=0)
    pp: int = Field(default=1, gt=0)
    vpp: int = Field(default=1, gt=0)
    cp: int = Field(default=1, gt=0)
    cp_comm: Literal["ring", "a2a", "allgather"] = "ring"
    ep: int = Field(default=1, gt=0)
    etp: int | None = Field(default=None, gt=0)
    dp: int | None = Field(default=None, gt=0)  # default: GPUs / (tp pp cp)
    mbs: int = Field(gt=0)
    zero: Literal[0, 1, 2, 3]
    recompute: Literal["none", "selective", "full"] = "none"
    recompute_layers: int | None = Field(default=None, gt=0)  # full recompute of this many layers per stage
    # selective only: Megatron-Core --recompute-modules as the recipe sets them (default core_attn)
    offload_layers: int = Field(default=0, ge=0)  # Megatron cpu_offloading_num_layers (activations on the host)
    recompute_modules: tuple[Literal["core_attn", "layernorm", "mla_up_proj", "mlp", "moe_act", "moe",
                                     "shared_experts"], ...] | None = None
    sp: bool | None = None  # default: on with tp > 1
    schedule: Literal["1f1b", "interleaved", "gpipe", "zb", "dualpipe"] | None = None
    first_stage_layers: int | None = Field(default=None, ge=0)  # decoder layers on the first pipeline stage
    last_stage_layers: int | None = Field(default=None, ge=0)
    layout: str | None = None  # Megatron --pipeline-model-parallel-layout, as published
    rank_order: Literal["tp-cp-dp-pp", "tp-cp-pp-dp"] | None = None  # tp-cp-pp-dp: Megatron --use-tp-pp-dp-mapping


class Run(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    id: str = Field(pattern=r"^[a-z0-9][a-z0-9.\-]+$")
    name: str
    source: Source
    tuned: bool  # from a tuned performance recipe or a team's production run (reference_search's 1.10x check)
    framework: str  # as the source names it, with its version
    runtime: str  # meshplan runtime preset that models this framework (costmodels/config.py RUNTIMES)
    features: tuple[Feature, ...] = ()
    model: str  # zoo name, or a model file under benchmarks/models/
    gpu: str  # hardware_db GPU name
    gpus: int = Field(gt=0)
    gpus_per_node: int = Field(gt=0)  # GPUs of one scale-up (NVLink) domain
    nic_gbps: float | None = Field(default=None, gt=0)  # per GPU, where it differs from the GPU's default
    global_batch: int = Field(gt=0)  # sequences
    seq_len: int = Field(gt=0)
    dtype: Literal["bf16", "fp16", "fp8"]
    fp8_recipe: Literal["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"] | None = None
    moe_balanced: bool = False  # the benchmark forces a balanced token distribution among experts
    # hidden / attention dropout; None: off, as every Llama, Qwen, DeepSeek, Nemotron and MLPerf recipe trains,
    # except on the megatron-2022 runtime, whose GPT defaults (0.1) apply
    dropout: bool | None = None
    parallel: Parallel
    assumed: dict[str, str] = {}  # knob -> the value assumed and why (knobs the source leaves out)
    metric: Metric
    value: float = Field(gt=0)
    flops_accounting: FlopsAccounting | None = None  # for tflops_per_gpu / mfu
    mfu_peak_tflops: float | None = Field(default=None, gt=0)  # the peak an MFU was divided by
    # the source's peak memory per GPU, GiB as it prints it (torchtitan logs the caching allocator's max reserved)
    memory_gib: float | None = Field(default=None, gt=0)
    notes: str = ""

    @model_validator(mode="after")
    def _check(self) -> Run:
        if self.metric in ("tflops_per_gpu", "mfu") and self.flops_accounting is None:
            raise ValueError(f"{self.id}: metric {self.metric} needs flops_accounting")
        if self.metric == "mfu" and self.mfu_peak_tflops is None:
            raise ValueError(f"{self.id}: metric mfu needs mfu_peak_tflops")
        if (self.dtype == "fp8") != (self.fp8_recipe is not None):
            raise ValueError(f"{self.id}: fp8_recipe is given exactly when dtype is fp8")
        p = self.parallel
        if self.gpus % (p.tp * p.pp * p.cp):
            raise ValueError(f"{self.id}: tp*pp*cp does not divide {self.gpus} GPUs")
        return self


def load_runs(path: Path = DEFAULT_FILE) -> list[Run]:
    """Every run of a data file, validated; ids unique."""
    entries = yaml.safe_load(path.read_text()) or []
    runs = [Run.model_validate(e) for e in entries]
    ids = [r.id for r in runs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    if dup:
        raise ValueError(f"{path}: duplicate ids {dup}")
    return runs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", nargs="*", type=Path, help="validate these data files (default: the set)")
    args = ap.parse_args()
    files = args.check or [DEFAULT_FILE]
    bad = 0
    for f in files:
        try:
            runs = load_runs(f)
        except (ValidationError, ValueError, yaml.YAMLError) as exc:
            print(f"{f}: INVALID\n{exc}")
            bad += 1
            continue
        print(f"{f}: {len(runs)} runs valid")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
