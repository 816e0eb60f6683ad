"""The realism guard: a predicted MFU above the best any team has published for that class of model on that
class of GPU is more likely a gap in the cost model than a discovery (DESIGN.md, "a plan that looks too good").

BEST_PUBLISHED holds, per (GPU family, dense or MoE, precision), the highest MFU of the published runs of both
development sets, in meshplan's own accounting (6 x active parameters + the causal half of attention, against
the dense peak of the precision: costmodels.estimate.model_flops_per_step), with the run that set it;
`python benchmarks/realism_table.py` recomputes it from the data files.
"""

from __future__ import annotations

from dataclasses import dataclass

# GPU name (hardware_db) -> family whose published runs bound it
FAMILIES: dict[str, str] = {
    "a100-40gb": "A100", "a100-80gb": "A100",
    "h100-sxm": "H100/H200", "h100-pcie": "H100/H200", "h100-nvl": "H100/H200", "h100-hbm2e-96gb": "H100/H200",
    "h200": "H100/H200", "h200-nvl": "H100/H200", "h800": "H100/H200",
    "b200": "B200/B300", "b300": "B200/B300",
    "gb200": "GB200/GB300", "gb300": "GB200/GB300",
}


@dataclass(frozen=True)
class Published:
    mfu: float
    run: str  # the run's id in benchmarks/training_dev.yaml or benchmarks/published_runs.yaml
    source: str


def gpu_family(gpu: str) -> str | None:
    return FAMILIES.get(gpu)


BEST_PUBLISHED: dict[tuple[str, str, str], Published] = {
    ("A100", "dense", "bf16"): Published(0.559, "korthikanti-1t-sp-selective",
                                         "Korthikanti et al. 2022, Table 5: 1T GPT on 512 A100, 71.49 s/iteration"),
    ("H100/H200", "dense", "bf16"): Published(0.471, "mcore-h100-weak-16b",
                                              "Megatron-LM README weak scaling: 16B on 96 H100, 489 TFLOP/s/GPU"),
    ("H100/H200", "dense", "fp8"): Published(0.479, "mlperf-v4.1-gpt3-dgxh100-32x8",
                                             "MLPerf Training v4.1, NVIDIA GPT-3 175B on 256 H100, 18.37 s/step"),
    ("H100/H200", "moe", "bf16"): Published(0.393, "mcore-moezoo-qwen3-235b-h100-128k",
                                            "Megatron-MoE-ModelZoo, Qwen3-235B-A22B at 128K on 256 H100, "
                                            "389 TFLOP/s/GPU"),
    ("H100/H200", "moe", "fp8"): Published(0.195, "deepseek-v3-paper-2048",
                                           "DeepSeek-V3 report: 180K H800 GPU-hours per trillion tokens on 2,048 H800"),
    ("B200/B300", "dense", "fp8"): Published(0.429, "mlperf-v4.1-gpt3-dgxb200-8x8",
                                             "MLPerf Training v4.1, NVIDIA GPT-3 175B on 64 B200, 36.05 s/step"),
    ("B200/B300", "moe", "fp8"): Published(0.209, "mbridge-26.06-b300-qwen3-30b-a3b-mxfp8",
                                           "Megatron-Bridge 26.06, Qwen3-30B-A3B on 8 B300, 40,769 tokens/s/GPU"),
    ("GB200/GB300", "dense", "fp8"): Published(0.529, "mbridge-26.06-gb300-llama3.1-405b-fp8",
                                               "Megatron-Bridge 26.06, Llama 3.1 405B on 256 GB300, "
                                               "1,048 tokens/s/GPU"),
    ("GB200/GB300", "moe", "bf16"): Published(0.386, "mbridge-25.11-gb300-deepseek-v3-bf16",
                                              "Megatron-Bridge 25.11, DeepSeek-V3 on 256 GB300, 3,848 tokens/s/GPU"),
    ("GB200/GB300", "moe", "fp8"): Published(0.315, "mbridge-26.08-gb300-deepseek-v3-mxfp8",
                                             "Megatron-Bridge 26.08, DeepSeek-V3 on 256 GB300, 6,288 tokens/s/GPU"),
}


@dataclass(frozen=True)
class RealismCheck:
    """A predicted MFU beside the best published one of its class (None where no run of the class is known), and
    the MFU at the slow end of the prediction's interval (None without one: under a calibration)."""

    predicted_mfu: float
    published_mfu: float | None
    run: str | None
    source: str | None
    slow_end_mfu: float | None = None

    @property
    def exceeds(self) -> bool:
        return self.published_mfu is not None and self.predicted_mfu > self.published_mfu

    @property
    def within_error(self) -> bool | None:
        """Above the best published, but the interval reaches down to it (issue 44: the realism line is part of the
        interval); None where nothing is exceeded or there is no interval."""
        if not self.exceeds or self.slow_end_mfu is None:
            return None
        assert self.published_mfu is not None
        return self.slow_end_mfu <= self.published_mfu

    def line(self) -> str:
        if self.published_mfu is None:
            return "no published run of this GPU family, model class and precision to compare the MFU with"
        best = f"the best published for this class ({100 * self.published_mfu:.1f} %, {self.run}: {self.source})"
        if self.exceeds and self.slow_end_mfu is not None and self.within_error:
            return (f"MFU {100 * self.predicted_mfu:.1f} % is above {best}, but the slow end of its range "
                    f"({100 * self.slow_end_mfu:.1f} %) is below it: within the model's error, not yet a measured "
                    f"result")
        if self.exceeds and self.slow_end_mfu is not None:
            return (f"MFU {100 * self.predicted_mfu:.1f} % is above {best}, and so is the slow end of its range "
                    f"({100 * self.slow_end_mfu:.1f} %): more likely a gap in the cost model than a real plan; "
                    f"verify before relying on it")
        if self.exceeds:
            return (f"MFU {100 * self.predicted_mfu:.1f} % is above {best}: more likely a gap in the cost model than "
                    f"a real plan; verify before relying on it")
        return (f"within what has been published for this class (best {100 * self.published_mfu:.1f} %, "
                f"{self.run})")


def check(gpu: str, moe: bool, dtype: str, mfu: float, slow_end_mfu: float | None = None) -> RealismCheck:
    fam = gpu_family(gpu)
    dt = "bf16" if dtype == "fp16" else dtype
    best = BEST_PUBLISHED.get((fam, "moe" if moe else "dense", dt)) if fam else None
    if best is None:
        return RealismCheck(mfu, None, None, None, slow_end_mfu)
    return RealismCheck(mfu, best.mfu, best.run, best.source, slow_end_mfu)
