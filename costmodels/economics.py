"""What a plan costs and how long a training run takes with failures: dollars per hour and per million tokens,
GPU-hours, and the expected wall time of a run of a given number of tokens when the job is interrupted at random
and restarts from its last checkpoint (Young 1974, Daly 2006). Small pure functions; the CLI prints them and the
plan records them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from meshplan.hardware_db.errors import InputError

__all__ = ["Budget", "Reliability", "TrainingCost", "ServingCost", "young_interval", "daly_interval", "daly_wall_time",
           "checkpoint_bytes", "training_cost", "serving_cost", "LLAMA3_FAILURES_PER_GPU_HOUR",
           "LLAMA3_STORAGE_BYTES_PER_S_PER_GPU", "CHECKPOINT_BYTES_PER_PARAM"]

# 419 unexpected interruptions in a 54-day snapshot of Llama 3 405B pre-training on 16,384 H100 GPUs (Dubey et al.,
# "The Llama 3 Herd of Models", 2024, sec. 3.3.4): 419 / (54 x 24 h x 16,384 GPUs) per GPU-hour
LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)
# the same paper, sec. 3.3.1: Tectonic sustains 2 TB/s for the 16K-GPU cluster's checkpoints; its share per GPU
LLAMA3_STORAGE_BYTES_PER_S_PER_GPU = 2e12 / 16384
# a checkpoint holds BF16 weights and FP32 master weights and Adam's two moments: 2 + 4 + 4 + 4 bytes a parameter
# (ZeRO, Rajbhandari et al. 2020, sec. 3.1: 2 + 12 bytes of model and optimizer states; gradients are not saved)
CHECKPOINT_BYTES_PER_PARAM = 14.0


@dataclass(frozen=True)
class Reliability:
    """How often the job fails and what a failure costs. Defaults: Llama 3's measured interruption rate and storage
    bandwidth per GPU; the restart (reschedule, reload, warm up) is an assumption, 10 minutes, to be set."""

    failures_per_gpu_hour: float = LLAMA3_FAILURES_PER_GPU_HOUR
    checkpoint_bytes_per_s: float | None = None  # aggregate write bandwidth; None: the Llama 3 share per GPU
    restart_s: float = 600.0


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum compute time between checkpoints: sqrt(2 delta M) (Young, "A first order
    approximation to the optimum checkpoint interval", CACM 17(9), 1974)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum: sqrt(2 delta M) [1 + (1/3) sqrt(delta / 2M) + (1/9) (delta / 2M)] - delta for
    delta < 2M, else M (Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps", Future
    Generation Computer Systems 22, 2006; its Figs. 3-5: 117, 57 and 9.1 minutes at M = 24 h, 6 h and 15 min with
    delta = 5 min)."""
    if checkpoint_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2.0 * mtbf_s)
    return young_interval(checkpoint_s, mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - checkpoint_s


def daly_wall_time(solve_s: float, interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float) -> float:
    """Expected wall time of `solve_s` of computation checkpointed every `interval_s` under Poisson failures of
    mean time `mtbf_s`, each costing a restart and the work since the last checkpoint (Daly 2006, the complete cost
    function): M e^(R/M) (e^((tau + delta)/M) - 1) T_s / tau."""
    m = mtbf_s
    return m * math.exp(restart_s / m) * math.expm1((interval_s + checkpoint_s) / m) * solve_s / interval_s


def checkpoint_bytes(parameters: float) -> float:
    return CHECKPOINT_BYTES_PER_PARAM * parameters


class _Rate(BaseModel):
    """What a set of GPUs costs an hour: the part every plan's economics section shares."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid", allow_inf_nan=False)
    gpus: int = Field(gt=0)
    usd_per_gpu_hour: float = Field(ge=0)
    usd_per_hour: float = Field(ge=0)


class TrainingCost(_Rate):
    """A training plan's cost at its predicted throughput, and with `tokens` its run: the ideal time, the expected
    time with failures at Daly's interval, and what both cost. The plan's `economics` section."""

    tokens_per_s: float = Field(gt=0)
    usd_per_million_tokens: float = Field(ge=0)
    gpu_hours_per_million_tokens: float = Field(ge=0)
    tokens: float | None = Field(default=None, gt=0)
    ideal_s: float | None = Field(default=None, ge=0, description="tokens / throughput")
    expected_s: float | None = Field(default=None, ge=0, description="with failures, checkpoints and restarts")
    goodput: float | None = Field(default=None, ge=0, le=1, description="ideal / expected")
    mtbf_s: float | None = Field(default=None, gt=0, description="the whole job's mean time between failures")
    checkpoint_s: float | None = Field(default=None, ge=0, description="one checkpoint's write")
    checkpoint_interval_s: float | None = Field(default=None, gt=0, description=(
        "Daly's optimum compute time between checkpoints"))
    total_usd: float | None = Field(default=None, ge=0, description="at the expected time")
    gpu_hours: float | None = Field(default=None, ge=0, description="at the expected time")
    restart_s: float | None = Field(default=None, ge=0, description=(
        "one restart (reschedule, reload, warm up); absent in plans written before it was recorded: 600"))

    def budget(self, parameters: float) -> Budget:
        """The budget this section was priced with (price, tokens, failures), to price another prediction of the
        same run: reading a plan re-derives its economics from it."""
        if self.tokens is None or self.mtbf_s is None or not self.checkpoint_s:
            return Budget(self.usd_per_gpu_hour)
        reliability = Reliability(3600.0 / (self.mtbf_s * self.gpus), checkpoint_bytes(parameters) / self.checkpoint_s,
                                  600.0 if self.restart_s is None else self.restart_s)
        return Budget(self.usd_per_gpu_hour, self.tokens, reliability)


def training_cost(gpus: int, usd_per_gpu_hour: float, tokens_per_s: float, parameters: float,
                  tokens: float | None = None, reliability: Reliability = Reliability()) -> TrainingCost:
    usd_per_hour = gpus * usd_per_gpu_hour
    per_million_h = 1e6 / tokens_per_s / 3600.0
    base = TrainingCost(gpus=gpus, usd_per_gpu_hour=usd_per_gpu_hour, tokens_per_s=tokens_per_s,
                        usd_per_hour=usd_per_hour, usd_per_million_tokens=usd_per_hour * per_million_h,
                        gpu_hours_per_million_tokens=gpus * per_million_h)
    if tokens is None:
        return base
    ideal = tokens / tokens_per_s
    mtbf = 3600.0 / (reliability.failures_per_gpu_hour * gpus)
    bandwidth = reliability.checkpoint_bytes_per_s or LLAMA3_STORAGE_BYTES_PER_S_PER_GPU * gpus
    delta = checkpoint_bytes(parameters) / bandwidth
    tau = daly_interval(delta, mtbf)
    try:
        expected = daly_wall_time(ideal, tau, delta, reliability.restart_s, mtbf)
        if not math.isfinite(expected):
            raise OverflowError
    except OverflowError:
        raise InputError(f"a failure every {mtbf:,.0f} s with a {reliability.restart_s:,.0f} s restart and a "
                         f"{delta:,.0f} s checkpoint: the run never finishes; lower --failure-rate or --restart-min, "
                         "or raise --ckpt-gbps") from None
    hours = expected / 3600.0
    # validated, not model_copy'd: every figure printed or written is finite and in its range
    return TrainingCost.model_validate({**base.model_dump(), **dict(
        tokens=tokens, ideal_s=ideal, expected_s=expected, goodput=ideal / expected, mtbf_s=mtbf, checkpoint_s=delta,
        checkpoint_interval_s=tau, total_usd=usd_per_hour * hours, gpu_hours=gpus * hours,
        restart_s=reliability.restart_s)})


class ServingCost(_Rate):
    """A deployment's cost per hour and per million output tokens at its predicted throughput. The serving plan's
    `economics` section."""

    output_tokens_per_s: float = Field(gt=0)
    usd_per_million_output_tokens: float = Field(ge=0)
    gpu_hours_per_million_output_tokens: float = Field(ge=0)


def serving_cost(gpus: int, usd_per_gpu_hour: float, output_tokens_per_s: float) -> ServingCost:
    usd_per_hour = gpus * usd_per_gpu_hour
    per_million_h = 1e6 / output_tokens_per_s / 3600.0
    return ServingCost(gpus=gpus, usd_per_gpu_hour=usd_per_gpu_hour, output_tokens_per_s=output_tokens_per_s,
                       usd_per_hour=usd_per_hour, usd_per_million_output_tokens=usd_per_hour * per_million_h,
                       gpu_hours_per_million_output_tokens=gpus * per_million_h)


@dataclass(frozen=True)
class Budget:
    """What the user prices a plan with: the GPU-hour price (None: the hardware database's), the tokens to train
    on (None: no run), and the failures the run meets."""

    usd_per_gpu_hour: float | None = None
    tokens: float | None = None
    reliability: Reliability = Reliability()
