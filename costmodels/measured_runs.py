"""A runs file: the step times a team measured, for `meshplan calibrate --runs` (costmodels/fit.py). TOML or JSON,
one `[[run]]` table per run (docs/calibration.md, "Calibrating on your own runs"; examples/runs/):

    [[run]]
    model = "llama3.1-8b"          # zoo name or model file
    gpu = "h100-sxm"
    gpus = 64
    global_batch = 256
    seq_len = 8192
    runtime = "megatron-core"      # optional, as --runtime
    step_time_s = 10.9             # or tokens_per_s_per_gpu
    source = "our logs, 2026-11"   # optional
    [run.layout]                   # the knobs as `estimate` takes them (unset: estimate's defaults)
    tp = 4
    pp = 2

Every failure is one InputError line that names the file and the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from meshplan.costmodels.config import ParallelConfig, TrainDtype, Workload, resolve
from meshplan.costmodels.fit import MeasuredStep
from meshplan.costmodels.model_io import load_model
from meshplan.costmodels.runtime import DEFAULT_RUNTIME, get_runtime
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.documents import parse_document, read_text
from meshplan.hardware_db.errors import InputError, field_error


class RunEntry(BaseModel):
    """One measured run (the module docstring)."""

    # strict, as every file meshplan reads (hardware_db/documents.STRICT): no "8" for 8 or true for 1
    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid", allow_inf_nan=False, strict=True)
    model: str = Field(min_length=1)
    gpu: str = Field(min_length=1)
    gpus: int = Field(gt=0)
    gpus_per_node: int | None = Field(default=None, gt=0)
    nic_gbps: float | None = Field(default=None, gt=0)  # per GPU, where it differs from the GPU's default
    global_batch: int = Field(gt=0)
    seq_len: int = Field(gt=0)
    dtype: TrainDtype = "bf16"
    fp8_recipe: Literal["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"] = "tensorwise"  # as --fp8-recipe
    runtime: str = DEFAULT_RUNTIME
    step_time_s: float | None = Field(default=None, gt=0)
    tokens_per_s_per_gpu: float | None = Field(default=None, gt=0)
    source: str = ""
    layout: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_measurement(self) -> RunEntry:
        if (self.step_time_s is None) == (self.tokens_per_s_per_gpu is None):
            raise ValueError("give exactly one of step_time_s and tokens_per_s_per_gpu")
        return self


def read_runs(path: str | Path) -> list[MeasuredStep]:
    """The runs of a runs file, each resolved (its degrees divide, its model and GPU exist)."""
    origin = str(path)
    fmt: Literal["json", "toml"] = "json" if str(path).endswith(".json") else "toml"
    doc = parse_document(read_text(path, "a runs file (.toml or .json)"), fmt, origin)
    entries = doc.get("run") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InputError(f"{origin}: no runs; write one [[run]] table per measured run (docs/calibration.md)")
    return [_step(entry, f"{origin}: run {n}") for n, entry in enumerate(entries, 1)]


def _step(entry: Any, where: str) -> MeasuredStep:
    try:
        run = RunEntry.model_validate(entry)
        config = ParallelConfig.model_validate(run.layout)
        workload = Workload(global_batch=run.global_batch, seq_len=run.seq_len, dtype=run.dtype,
                            fp8_recipe=run.fp8_recipe)
    except ValidationError as exc:
        raise InputError(f"{where}: {field_error(exc)}") from None
    try:
        model = load_model(run.model)
        get_runtime(run.runtime)
        spec = ClusterSpec(gpu=run.gpu, num_gpus=run.gpus, gpus_per_node=run.gpus_per_node, nic_gbps=run.nic_gbps)
        cluster = Cluster(spec)
        resolve(model, cluster.num_gpus, workload, config)
    except ValidationError as exc:
        raise InputError(f"{where}: {field_error(exc)}") from None
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    step = run.step_time_s
    if step is None:
        assert run.tokens_per_s_per_gpu is not None
        step = workload.tokens / (run.tokens_per_s_per_gpu * run.gpus)
    return MeasuredStep(model, spec, workload, config, run.runtime, step)
