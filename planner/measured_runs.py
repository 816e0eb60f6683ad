"""A runs file: the step times a team measured, for `meshplan calibrate --runs` (costmodels/fit.py). TOML or JSON,
one `[[run]]` table per run (docs/calibration.md, "Calibrating on your own runs"; examples/runs/, examples/logs/):

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

or a run read from the log its framework printed (planner/framework_logs.py), which states its own layout, batch,
sequence, GPU count and step time:

    [[run]]
    log = "pretrain.log"           # beside the runs file, or an absolute path
    format = "megatron"            # or "torchtitan", with config = "its_job.toml"
    gpu = "h100-sxm"               # what the log does not say: the GPU type (and gpus_per_node, nic_gbps)
    model = "llama3.1-8b"          # optional: checked against the log's arguments (default: the model they describe)

Every failure is one InputError line that names the file and the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from meshplan.costmodels.config import ParallelConfig, TrainDtype, Workload, resolve
from meshplan.costmodels.fit import MeasuredStep, MemoryKind
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import load_model
from meshplan.costmodels.runtime import DEFAULT_RUNTIME, get_runtime
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.documents import STRICT, parse_document, read_text
from meshplan.hardware_db.errors import InputError, field_error
from meshplan.planner.framework_logs import LoggedRun, read_megatron_log, read_torchtitan_log
from meshplan.planner.launchers.megatron import model_disagreement


class RunEntry(BaseModel):
    """One measured run (the module docstring)."""

    # strict, as every file meshplan reads (hardware_db/documents.STRICT): no "8" for 8 or true for 1
    model_config = STRICT
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
    peak_memory_gib: float | None = Field(default=None, gt=0)  # optional: the largest peak any GPU reached
    # what that peak counts: "allocated" (the allocator's blocks: Megatron's max allocated), "reserved" (its cache
    # too: torchtitan's max reserved), or "peak" (not said; compared as reserved)
    memory_kind: MemoryKind = "peak"
    source: str = ""
    layout: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _one_measurement(self) -> RunEntry:
        if (self.step_time_s is None) == (self.tokens_per_s_per_gpu is None):
            raise ValueError("give exactly one of step_time_s and tokens_per_s_per_gpu")
        return self


class LogEntry(BaseModel):
    """A run read from its framework's log (the module docstring): what the log cannot say."""

    model_config = STRICT
    log: str = Field(min_length=1)
    format: Literal["megatron", "torchtitan"]
    config: str | None = Field(default=None, min_length=1)  # torchtitan: the job's TOML
    gpu: str = Field(min_length=1)
    gpus_per_node: int | None = Field(default=None, gt=0)
    nic_gbps: float | None = Field(default=None, gt=0)
    model: str | None = Field(default=None, min_length=1)
    runtime: str | None = None  # default: megatron-core, or what the torchtitan config turns on
    skip: int = Field(default=1, ge=0)  # logged intervals left out as warm-up
    source: str = ""

    @model_validator(mode="after")
    def _config_for_torchtitan(self) -> LogEntry:
        if (self.format == "torchtitan") != (self.config is not None):
            raise ValueError("config (the job's TOML) goes with format = \"torchtitan\" and only with it")
        return self


FROM_THE_LOG = ("gpus", "global_batch", "seq_len", "dtype", "fp8_recipe", "step_time_s", "tokens_per_s_per_gpu",
                "peak_memory_gib", "memory_kind", "layout")


def read_runs(path: str | Path) -> list[MeasuredStep]:
    """The runs of a runs file, each resolved (its degrees divide, its model and GPU exist)."""
    origin = str(path)
    fmt: Literal["json", "toml"] = "json" if str(path).endswith(".json") else "toml"
    doc = parse_document(read_text(path, "a runs file (.toml or .json)"), fmt, origin)
    entries = doc.get("run") if isinstance(doc, dict) else None
    if not isinstance(entries, list) or not entries:
        raise InputError(f"{origin}: no runs; write one [[run]] table per measured run (docs/calibration.md)")
    base = Path(path).parent
    return [_logged(entry, f"{origin}: run {n}", base) if isinstance(entry, dict) and "log" in entry
            else _step(entry, f"{origin}: run {n}") for n, entry in enumerate(entries, 1)]


def _logged(entry: dict[str, Any], where: str, base: Path) -> MeasuredStep:
    """A `log = ...` run: the layout, workload and step time as its log states them."""
    given = [name for name in FROM_THE_LOG if name in entry]
    if given:
        raise InputError(f"{where}: {given[0]} is read from the log; remove it")
    try:
        run = LogEntry.model_validate(entry)
    except ValidationError as exc:
        raise InputError(f"{where}: {field_error(exc)}") from None
    log_path = base / run.log
    try:
        text = read_text(log_path, f"a {run.format} log")
        if run.format == "megatron":
            logged = read_megatron_log(text, str(log_path), run.skip)
        else:
            assert run.config is not None
            config_path = base / run.config
            logged = read_torchtitan_log(text, read_text(config_path, "a torchtitan TOML"), str(log_path),
                                         str(config_path), run.skip)
        model = _logged_model(logged, run, log_path)
        runtime = run.runtime or logged.launch.runtime or DEFAULT_RUNTIME
        get_runtime(runtime)
        spec = ClusterSpec(gpu=run.gpu, num_gpus=logged.num_gpus, gpus_per_node=run.gpus_per_node,
                           nic_gbps=run.nic_gbps)
        resolve(model, Cluster(spec).num_gpus, logged.launch.workload, logged.launch.config)
    except ValidationError as exc:
        raise InputError(f"{where}: {field_error(exc)}") from None
    except InputError as exc:
        raise InputError(f"{where}: {exc}") from None
    return MeasuredStep(model, spec, logged.launch.workload, logged.launch.config, runtime, logged.step_time_s,
                        logged.peak_memory_gib, logged.memory_kind)


def _logged_model(logged: LoggedRun, run: LogEntry, log_path: Path) -> ModelSpec:
    """The named model, checked against the log's arguments; else the model the log describes, named after it."""
    if run.model is not None:
        model = load_model(run.model)
        if run.format == "megatron":
            differs = model_disagreement(logged.launch, model)
            if differs is not None:
                raise InputError(f"the log's arguments do not describe {run.model}: {differs}; name the model it "
                                 f"trained, or leave model out to use the arguments'")
        elif logged.launch.model is not None and logged.launch.model.name != model.name:
            raise InputError(f"the torchtitan config trains {logged.launch.model.name}, not {run.model}; leave "
                             f"model out")
        return model
    if logged.launch.model is None:
        raise InputError("the log does not describe its model whole; name it with model = ...")
    if run.format == "megatron":  # the model the arguments describe, named after its log
        return logged.launch.model.model_copy(update={"name": log_path.stem})
    return logged.launch.model


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
    return MeasuredStep(model, spec, workload, config, run.runtime, step, run.peak_memory_gib, run.memory_kind)
