"""torchtitan: a plan as the TOML job config of releases up to 0.2 (torchtitan/config/job_config.py) and as the
Python config-registry function of 0.3 (torchtitan/config/configs.py, torchtitan/trainer.py), and back from TOML.

The rules are torchtitan's: dp_replicate * dp_shard * cp * tp * pp = world (distributed/parallel_dims.py); data
parallelism is DDP (replicate) or FSDP2 (shard; reshard_after_forward "never" keeps parameters gathered: ZeRO-2,
"always": ZeRO-3), there is no optimizer-only sharding (ZeRO-1); expert parallelism borrows ranks from
dp_shard * cp, and from tp too when expert TP is 1; tensor parallelism always shards the norms' sequence (SP) before
0.3 (enable_sequence_parallel from 0.3); the mesh is pp, dp_replicate, dp_shard, cp, tp (tp innermost); a pipeline
stage is a list of module names (module_fqns_per_model_part); activation checkpointing is none, selective or full
for every block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from meshplan.costmodels.config import (DEFAULT_RANK_ORDER, MAX_GLOBAL_BATCH, MAX_SEQ_LEN, ParallelConfig, Recompute,
                                        Schedule, TrainDtype, Workload, ZeroStage, one_of)
from meshplan.costmodels.kernels import Fp8Recipe
from meshplan.costmodels.model import MAX_LAYERS, ModelSpec
from meshplan.costmodels.model_io import load_zoo, to_model_file
from meshplan.costmodels.runtime import get_runtime
from meshplan.hardware_db.cluster import MAX_GPUS
from meshplan.hardware_db.documents import parse_document
from meshplan.hardware_db.errors import InputError, field_error
from meshplan.planner.launchers.common import (UNIFORM_RECOMPUTE, Exported, ExportedFile, header_lines, refuse,
                                               uniform_recompute)
from meshplan.planner.launchers.megatron import LaunchSpec
from meshplan.planner.plan import Plan

__all__ = ["TARGET", "FLAVORS", "TitanModel", "parallelism_fields", "training_fields", "activation_mode",
           "toml_text", "python_text", "export_torchtitan", "parse_torchtitan_toml", "stage_module_names"]

TARGET = "torchtitan"
# torch.distributed.pipelining
SCHEDULES: dict[Schedule, str] = {"1f1b": "1F1B", "gpipe": "GPipe", "interleaved": "Interleaved1F1B"}


@dataclass(frozen=True)
class TitanModel:
    """A meshplan zoo model and the torchtitan model of the same architecture."""

    module: str  # [model] name (<= 0.2) and the models/ package (0.3)
    flavor: str  # [model] flavor (<= 0.2)
    registry_function: str | None  # models/<module>/config_registry.py function (0.3); None: not in 0.3


# torchtitan/models/{llama3,qwen3}/__init__.py (0.2.2) and config_registry.py (0.3.0)
FLAVORS: dict[str, TitanModel] = {
    "llama3.1-8b": TitanModel("llama3", "8B", "llama3_8b"),
    "llama3.1-70b": TitanModel("llama3", "70B", "llama3_70b"),
    "llama3.1-405b": TitanModel("llama3", "405B", "llama3_405b"),
    "qwen3-30b-a3b": TitanModel("qwen3", "30B-A3B", "qwen3_30b_a3b"),
    "qwen3-235b-a22b": TitanModel("qwen3", "235B-A22B", None),
}


def _titan_model(model: ModelSpec) -> TitanModel:
    known = FLAVORS.get(model.name)
    if known is None:
        raise refuse(TARGET, f"torchtitan trains only the models it defines, and meshplan knows no torchtitan flavor "
                     f"of {model.name}", f"plan one of {', '.join(FLAVORS)}, or write the config by hand")
    if to_model_file(load_zoo(model.name)) != to_model_file(model):
        raise refuse(TARGET, f"the plan's {model.name} differs from the zoo's (a scaled or edited model), so "
                     f"torchtitan's {known.module} {known.flavor} is not it", "plan the zoo model")
    return known


def _data_parallel(plan: Plan) -> tuple[int, int, str]:
    """(dp_replicate, dp_shard, fsdp_reshard_after_forward) for the plan's ZeRO stage. torchtitan shards with FSDP2
    over dp_shard * cp (parallelize.py applies fully_shard whenever dp_shard or cp is on)."""
    zero, dp, cp = plan.memory.zero, plan.mesh.dp, plan.mesh.cp
    if cp > 1 and zero < 2:
        raise refuse(TARGET, f"torchtitan shards parameters with FSDP2 over dp_shard*cp whenever CP is on; the plan "
                     f"has ZeRO-{zero}", "re-plan with --zero 2 or --zero 3", ({"zero": 2}, {"zero": 3}))
    if zero == 1 and dp > 1:
        raise refuse(TARGET, "torchtitan has no ZeRO-1 (optimizer-only sharding): it runs DDP or FSDP2",
                     "re-plan with --zero 0 (DDP), --zero 2 (FSDP2 without resharding) or --zero 3 (FSDP2)",
                     ({"zero": 0}, {"zero": 2}, {"zero": 3}))
    if dp * cp == 1:
        return 1, 1, "default"  # nothing to replicate or shard over
    if zero == 0:
        return dp, 1, "default"
    return 1, dp, "never" if zero == 2 else "always"


def stage_module_names(plan: Plan) -> list[list[str]]:
    """module_fqns_per_model_part: the torchtitan module names of every virtual stage in model order (virtual
    stage v of pipeline rank r is part v*pp + r, torchtitan's 'loop' placement)."""
    pipe, pp = plan.pipeline, plan.mesh.pp
    parts: list[list[str]] = []
    for v in range(pipe.vpp):
        for r in range(pp):
            c = pipe.stages[r].chunks[v]
            parts.append([f"layers.{i}" for i in range(c.first_layer, c.first_layer + c.num_layers)])
    parts[0].insert(0, "tok_embeddings")
    parts[-1] += ["norm", "output"]
    return parts


def parallelism_fields(plan: Plan, release: str) -> dict[str, object]:
    """[parallelism] for `release` "0.2" (TOML) or "0.3" (Python); refuses what torchtitan cannot run."""
    mesh, pipe = plan.mesh, plan.pipeline
    if "-".join(mesh.rank_order) != DEFAULT_RANK_ORDER:
        raise refuse(TARGET, f"torchtitan's mesh is pp, dp, cp, tp (tp innermost), not {'-'.join(mesh.rank_order)}",
                     f"re-plan with --order {DEFAULT_RANK_ORDER}", ({"rank_order": DEFAULT_RANK_ORDER},))
    if mesh.cp > 1 and mesh.cp_comm == "a2a":
        raise refuse(TARGET, "torchtitan's context parallelism exchanges KV shards (ring attention), it has no "
                     "all-to-all over heads (Ulysses)", "re-plan with --cp-comm ring",
                     ({"cp_comm": "ring"},))
    if mesh.tp > 1 and not mesh.sp and release == "0.2":
        raise refuse(TARGET, "torchtitan before 0.3 always shards the norms' sequence with TP (SP)",
                     "re-plan with --sp, or use the 0.3 Python form", ({"sp": True},))
    replicate, shard, reshard = _data_parallel(plan)
    fields: dict[str, object] = {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
                                 "fsdp_reshard_after_forward": reshard, "tensor_parallel_degree": mesh.tp}
    if release == "0.3":
        fields["enable_sequence_parallel"] = mesh.sp
    if mesh.pp > 1:
        if pipe.schedule not in SCHEDULES:
            raise refuse(TARGET, f"torch.distributed.pipelining has no single-stage {pipe.schedule} schedule",
                         "re-plan with --schedule 1f1b", ({"schedule": "1f1b"},))
        fields |= {"pipeline_parallel_degree": mesh.pp, "pipeline_parallel_schedule": SCHEDULES[pipe.schedule],
                   "module_fqns_per_model_part": stage_module_names(plan),
                   "pipeline_parallel_microbatch_size": pipe.micro_batch_size}
    if mesh.cp > 1:
        fields["context_parallel_degree"] = mesh.cp
        if release == "0.2":  # the K,V rotation the plan was priced with (Runtime.cp_rotate)
            rotate = get_runtime(plan.inputs.runtime).cp_rotate
            fields["context_parallel_rotate_method"] = "allgather" if rotate == "allgather" else "alltoall"
    if release == "0.2" and mesh.tp > 1 and get_runtime(plan.inputs.runtime).tp_overlap == "async-tp":
        fields["enable_async_tensor_parallel"] = True  # priced with async TP (needs training.compile)
    if plan.inputs.model_spec().moe is not None and mesh.ep > 1:
        etp_one = release == "0.3" or mesh.etp == 1
        if release == "0.3" and mesh.etp != 1:
            raise refuse(TARGET, "torchtitan 0.3 runs experts without tensor parallelism (EP borrows TP ranks)",
                         "re-plan with --etp 1", ({"etp": 1},))
        if mesh.etp not in (1, mesh.tp):
            raise refuse(TARGET, "torchtitan supports expert TP equal to TP or 1", f"re-plan with --etp 1 or {mesh.tp}",
                         ({"etp": 1},))
        pool = shard * mesh.cp * (mesh.tp if etp_one else 1)
        if pool % mesh.ep:
            raise refuse(TARGET, f"torchtitan's EP borrows ranks from dp_shard*cp{'*tp' if etp_one else ''} = {pool}, "
                         f"which ep {mesh.ep} does not divide", "re-plan with FSDP (--zero 2/3) or another --ep",
                         ({"zero": 2}, {"zero": 3}))
        fields["expert_parallel_degree"] = mesh.ep
        if release == "0.2":
            fields["expert_tensor_parallel_degree"] = mesh.etp
    return fields


def training_fields(plan: Plan) -> dict[str, object]:
    """[training]: with PP a data-parallel rank's batch is all its micro-batches; without, one micro-batch and
    torchtitan accumulates global / (local x dp) of them (torchtitan/train.py)."""
    pipe, wl = plan.pipeline, plan.inputs.workload
    if wl.dtype != "bf16":
        raise refuse(TARGET, f"{wl.dtype} training is set by version-specific converters in torchtitan",
                     "re-plan with --dtype bf16 and add the converter by hand")
    local = pipe.micro_batch_size * (pipe.num_microbatches if plan.mesh.pp > 1 else 1)
    return {"local_batch_size": local, "global_batch_size": wl.global_batch, "seq_len": wl.seq_len,
            "mixed_precision_param": "bfloat16"}


def activation_mode(plan: Plan) -> str:
    try:
        kind, k = uniform_recompute(plan)
    except ValueError as exc:
        raise refuse(TARGET, f"torchtitan checkpoints every block alike, but {exc}",
                     "re-plan with --recompute none, selective or full", UNIFORM_RECOMPUTE) from None
    if k is not None:
        raise refuse(TARGET, f"the plan recomputes {k} layers per stage; torchtitan's full checkpointing takes every "
                     "block", "re-plan with --recompute full", ({"recompute": "full"},))
    return kind


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"no TOML form for {type(value).__name__}")


def toml_text(plan: Plan) -> str:
    model = _titan_model(plan.inputs.model_spec())
    rt_options = plan.inputs.runtime.split("+")[1:]
    compiled = "compile" in rt_options or get_runtime(plan.inputs.runtime).tp_overlap == "async-tp"  # async TP compiles
    tables: dict[str, dict[str, Any]] = {
        "model": {"name": model.module, "flavor": model.flavor},
        "training": training_fields(plan) | ({"compile": True} if compiled else {}),
        "parallelism": parallelism_fields(plan, "0.2"),
        "activation_checkpoint": {"mode": activation_mode(plan)} | (
            {"selective_ac_option": "op"} if activation_mode(plan) == "selective" else {}),
    }
    lines = ["# " + line for line in header_lines(plan, "torchtitan (<= 0.2, --job.config_file)", TARGET)]
    for name, fields in tables.items():
        lines += ["", f"[{name}]"] + [f"{key} = {_toml_value(value)}" for key, value in fields.items()]
    return "\n".join(lines) + "\n"


def python_text(plan: Plan) -> str | None:
    """The 0.3 config-registry function, or None when torchtitan 0.3 has no registry entry for the model."""
    model = _titan_model(plan.inputs.model_spec())
    if model.registry_function is None:
        return None
    par, train, mode = parallelism_fields(plan, "0.3"), training_fields(plan), activation_mode(plan)
    train.pop("mixed_precision_param")  # 0.3 sets precision in the registry's model spec
    ac = {"none": "None", "selective": "SelectiveAC.Config()", "full": "FullAC.Config()"}[mode]
    header = "\n".join("# " + line for line in header_lines(plan, "torchtitan (>= 0.3, config registry)", TARGET))
    par_args = "".join(f"\n        {k}={v!r}," for k, v in par.items())
    train_sets = "".join(f"\n    config.training.{k} = {v!r}" for k, v in train.items())
    return (f"{header}\n# Put this function in a config_registry.py and run with --module {model.module} "
            f"--config meshplan_plan.\n"
            f"from torchtitan.config import ParallelismConfig\n"
            f"from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC\n"
            f"from torchtitan.models.{model.module}.config_registry import {model.registry_function}\n\n\n"
            f"def meshplan_plan():\n"
            f"    config = {model.registry_function}()\n"
            f"    config.parallelism = ParallelismConfig({par_args}\n    )"
            f"{train_sets}\n"
            f"    config.activation_checkpoint = {ac}\n"
            f"    return config\n")


def export_torchtitan(plan: Plan) -> Exported:
    files = [ExportedFile("torchtitan.toml", toml_text(plan))]
    py = python_text(plan)
    if py is not None:
        files.append(ExportedFile("torchtitan_config.py", py))
    return Exported(TARGET, tuple(files))


# ---- import --------------------------------------------------------------------------------------------------------

def _stages_from_fqns(parts: list[list[str]], pp: int, num_layers: int) -> tuple[tuple[int, ...], int, tuple[int, ...]]:
    """(layers per pipeline stage, virtual stages, layers per model part in model order)."""
    if len(parts) % pp:
        raise InputError(f"module_fqns_per_model_part has {len(parts)} parts, not a multiple of "
                         f"pipeline_parallel_degree {pp}")
    counts = [sum(name.startswith("layers.") for name in part) for part in parts]
    order = [name for part in parts for name in part if name.startswith("layers.")]
    if order != [f"layers.{i}" for i in range(num_layers)]:
        raise InputError("module_fqns_per_model_part must list layers.0 ... layers.N-1 once each, in order")
    vpp = len(parts) // pp
    per_stage = [sum(counts[r::pp]) for r in range(pp)]
    if min(per_stage) < 1:
        raise InputError(f"module_fqns_per_model_part: pipeline rank {per_stage.index(min(per_stage))} holds no "
                         f"decoder layer; meshplan needs at least one per rank")
    return tuple(per_stage), vpp, tuple(counts)


# The fields meshplan reads from a torchtitan (<= 0.2) job config, typed as torchtitan's config_manager.py declares
# them; strict (no coercion: true is not 1, "8" is not 8, 1.5 is not a degree) and bounded. A job config holds many
# more sections and fields (job, optimizer, lr_scheduler, checkpoint, metrics, comm, ...): meshplan leaves those out.
_TITAN = ConfigDict(defer_build=True, frozen=True, extra="ignore", strict=True, allow_inf_nan=False)
_Degree = Annotated[int, Field(ge=1, le=MAX_GPUS)]


class _TitanModel(BaseModel):
    model_config = _TITAN
    name: str = "llama3"
    flavor: str = "debugmodel"
    converters: list[str] = []


class _TitanTraining(BaseModel):
    model_config = _TITAN
    local_batch_size: int = Field(default=8, ge=1, le=MAX_GLOBAL_BATCH)
    global_batch_size: int = Field(default=-1, ge=-1, le=MAX_GLOBAL_BATCH)  # -1: local x data-parallel degree
    seq_len: int = Field(default=2048, ge=1, le=MAX_SEQ_LEN)
    compile: bool = False
    mixed_precision_param: Literal["bfloat16", "float32"] = "bfloat16"

    @model_validator(mode="after")
    def _batch(self) -> _TitanTraining:
        if self.global_batch_size == 0:
            raise ValueError("global_batch_size 0: give the batch, or -1 for local_batch_size x the DP degree")
        return self


class _TitanParallelism(BaseModel):
    model_config = _TITAN
    data_parallel_replicate_degree: _Degree = 1
    data_parallel_shard_degree: int = Field(default=-1, ge=-1, le=MAX_GPUS)  # -1: fill the world
    tensor_parallel_degree: _Degree = 1
    pipeline_parallel_degree: _Degree = 1
    context_parallel_degree: _Degree = 1
    expert_parallel_degree: _Degree = 1
    expert_tensor_parallel_degree: _Degree = 1
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    module_fqns_per_model_part: list[list[str]] | None = Field(default=None, max_length=MAX_LAYERS + 2)
    pipeline_parallel_schedule: str = "1F1B"
    pipeline_parallel_microbatch_size: int = Field(default=1, ge=1, le=MAX_GLOBAL_BATCH)
    enable_async_tensor_parallel: bool = False
    context_parallel_rotate_method: str | None = None

    @model_validator(mode="after")
    def _shard(self) -> _TitanParallelism:
        if self.data_parallel_shard_degree == 0:
            raise ValueError("data_parallel_shard_degree 0: give the degree (1 for none)")
        return self


class _TitanActivationCheckpoint(BaseModel):
    model_config = _TITAN
    mode: str = "selective"


class _TitanFloat8(BaseModel):
    model_config = _TITAN
    enable_float8_linear: bool = False  # torchtitan of 2024; model.converters = ["float8"] since
    recipe_name: str | None = None


class _TitanCompile(BaseModel):  # torchtitan 0.2: a section of its own (job_config.py Compile)
    model_config = _TITAN
    enable: bool = False
    components: list[str] = ["model", "loss"]


class _TitanQuantizeLinear(BaseModel):  # torchtitan 0.2: [quantize.linear.float8] (job_config.py Float8Linear)
    model_config = _TITAN
    float8: _TitanFloat8 = _TitanFloat8()


class _TitanQuantize(BaseModel):
    model_config = _TITAN
    linear: _TitanQuantizeLinear = _TitanQuantizeLinear()


class _TitanExperimental(BaseModel):
    model_config = _TITAN
    context_parallel_rotate_method: str | None = None  # before 2025; under parallelism since


class TorchtitanJob(BaseModel):
    """What meshplan reads of a torchtitan job config."""

    model_config = _TITAN
    model: _TitanModel = _TitanModel()
    training: _TitanTraining = _TitanTraining()
    parallelism: _TitanParallelism = _TitanParallelism()
    activation_checkpoint: _TitanActivationCheckpoint = _TitanActivationCheckpoint()
    float8: _TitanFloat8 = _TitanFloat8()
    compile: _TitanCompile = _TitanCompile()
    quantize: _TitanQuantize = _TitanQuantize()
    experimental: _TitanExperimental = _TitanExperimental()

    @model_validator(mode="before")
    @classmethod
    def _before_2025_03(cls, data: Any) -> Any:
        """torchtitan until 2025-03 kept the batch and the DP/TP degrees under [training] (`batch_size` for the local
        batch) and the CP/PP degrees under [experimental] (train_configs/llama3_8b.toml at 37c4b81, 2025-02): read
        them as the [parallelism] section they became, and refuse a file that gives one setting in both places."""
        if not isinstance(data, dict):
            return data
        data = {k: dict(v) if isinstance(v, dict) else v for k, v in data.items()}
        moves = [("training", "batch_size", "training", "local_batch_size")]
        moves += [("training", f, "parallelism", f) for f in ("data_parallel_replicate_degree",
                                                              "data_parallel_shard_degree", "tensor_parallel_degree")]
        moves += [("experimental", f, "parallelism", f) for f in ("context_parallel_degree",
                                                                  "pipeline_parallel_degree",
                                                                  "pipeline_parallel_schedule")]
        for old, name, new, target in moves:
            section = data.get(old)
            if not isinstance(section, dict) or name not in section:
                continue
            into = data.setdefault(new, {})
            if not isinstance(into, dict):
                continue
            if target in into:
                raise ValueError(f"{old}.{name} and {new}.{target} both given (the first is torchtitan's name before "
                                 f"2025-03); keep one")
            into[target] = section.pop(name)
        return data


def parse_torchtitan_toml(text: str, origin: str = "torchtitan config",
                          world_size: int | None = None) -> tuple[LaunchSpec, str]:
    """A torchtitan (<= 0.2) TOML job config as a LaunchSpec and the zoo name of its model. `world_size`: the GPUs
    the job ran on (its log says), which resolves data_parallel_shard_degree -1."""
    try:
        job = TorchtitanJob.model_validate(parse_document(text, "toml", origin))
    except ValidationError as exc:
        raise InputError(f"{origin}: {field_error(exc)}") from None
    model_t, train, par, ac = job.model, job.training, job.parallelism, job.activation_checkpoint
    key = (model_t.name, model_t.flavor)
    zoo = next((name for name, m in FLAVORS.items() if (m.module, m.flavor) == key), None)
    if zoo is None:
        raise InputError(f"{origin}: meshplan knows no zoo model for torchtitan {key[0]} {key[1]}; known: "
                         + ", ".join(f"{m.module} {m.flavor}" for m in FLAVORS.values()))
    model = load_zoo(zoo)
    rep, shard = par.data_parallel_replicate_degree, par.data_parallel_shard_degree
    tp, pp, cp = par.tensor_parallel_degree, par.pipeline_parallel_degree, par.context_parallel_degree
    if shard == -1 and world_size is not None:  # torchtitan parallel_dims.py: dp_shard = world / (the others)
        shard, left = divmod(world_size, rep * tp * pp * cp)
        if left or shard == 0:
            raise InputError(f"{origin}: {world_size} GPUs are not a multiple of the other degrees "
                             f"({rep * tp * pp * cp}); data_parallel_shard_degree -1 cannot fill them")
    if shard == -1:
        raise InputError(f"{origin}: data_parallel_shard_degree -1 (fill the world) needs the world size; write "
                         f"the degree")
    if rep > 1 and shard > 1:
        raise InputError(f"{origin}: HSDP (replicate {rep} x shard {shard}) is not modelled; meshplan has one DP "
                         f"dimension")
    if train.mixed_precision_param != "bfloat16":
        raise InputError(f"{origin}: mixed_precision_param {train.mixed_precision_param!r}: meshplan models "
                         f"bfloat16 compute (FSDP2 MixedPrecisionPolicy param_dtype)")
    dp = rep * shard
    if dp * tp * pp * cp > MAX_GPUS:
        raise InputError(f"{origin}: the degrees multiply to {dp * tp * pp * cp:,} GPUs; meshplan plans at most "
                         f"{MAX_GPUS:,}")
    reshard = par.fsdp_reshard_after_forward
    # the "default" policy reshards after forward only without PP (torchtitan parallelize.py apply_fsdp:
    # reshard_after_forward = not pp_enabled), so under PP the weights stay whole, as ZeRO-2
    zero: ZeroStage = 0 if shard * cp == 1 else 2 if reshard == "never" or (reshard == "default" and pp > 1) else 3
    if par.module_fqns_per_model_part is not None and pp > 1:
        stage_layers, vpp, chunk_layers = _stages_from_fqns(par.module_fqns_per_model_part, pp, model.num_layers)
    elif pp > 1:
        raise InputError(f"{origin}: give module_fqns_per_model_part (meshplan reads explicit stages)")
    else:
        stage_layers, vpp, chunk_layers = None, 1, None
    schedule = {v: k for k, v in SCHEDULES.items()}.get(par.pipeline_parallel_schedule)
    if pp > 1 and schedule is None:
        raise InputError(f"{origin}: pipeline_parallel_schedule {par.pipeline_parallel_schedule!r:.40}: meshplan "
                         f"models {', '.join(SCHEDULES.values())}")
    mbs = par.pipeline_parallel_microbatch_size if pp > 1 else train.local_batch_size
    gbs = train.local_batch_size * dp if train.global_batch_size == -1 else train.global_batch_size
    if ac.mode not in ("none", "selective", "full"):
        raise InputError(f"{origin}: activation_checkpoint mode {ac.mode!r:.40}: meshplan models none, selective, "
                         f"full")
    config = ParallelConfig(
        tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, ep=par.expert_parallel_degree,
        etp=par.expert_tensor_parallel_degree if model.moe is not None else None, mbs=mbs, zero=zero,
        recompute=one_of(ac.mode, get_args(Recompute), "activation_checkpoint mode"), sp=tp > 1,
        schedule=(schedule if pp > 1 else None), stage_layers=stage_layers,
        chunk_layers=chunk_layers)
    dtype, recipe = _float8(job, origin)
    try:
        workload = Workload(global_batch=gbs, seq_len=train.seq_len, dtype=dtype, fp8_recipe=recipe)
    except ValidationError as exc:
        raise InputError(f"{origin}: the global batch ({gbs:,}): {field_error(exc)}") from None
    return LaunchSpec(config=config, workload=workload, num_gpus=dp * tp * pp * cp, gpus_per_node=None, model=model,
                      model_fields=(), runtime=_runtime(job, origin)), zoo


def _runtime(job: TorchtitanJob, origin: str) -> str:
    """The torchtitan runtime with the options the config turns on (torchtitan config_manager.py of 0.1-0.2:
    training.compile, or 0.2's compile section (job_config.py Compile), parallelism.enable_async_tensor_parallel,
    the CP rotate method under parallelism or, before 2025, experimental)."""
    par = job.parallelism
    options = []
    if job.training.compile or (job.compile.enable and "model" in job.compile.components):
        options.append("compile")
    if par.enable_async_tensor_parallel:
        options.append("async-tp")
    rotate = par.context_parallel_rotate_method or job.experimental.context_parallel_rotate_method or "allgather"
    if rotate not in ("allgather", "alltoall"):
        raise InputError(f"{origin}: context_parallel_rotate_method {rotate!r:.40}: torchtitan has allgather and "
                         f"alltoall")
    if rotate == "alltoall":
        options.append("cp-alltoall")
    return "+".join(["torchtitan", *options])


def _float8(job: TorchtitanJob, origin: str) -> tuple[TrainDtype, Fp8Recipe]:
    """(dtype, FP8 recipe): float8 training when model.converters holds "float8" (or, before 2025, the float8
    section's enable_float8_linear), with float8.recipe_name (unset: torchao's tensorwise default)."""
    # 0.2 registers it as "quantize.linear.float8" (components/quantization/float8.py register_model_converter)
    converters = {c.removeprefix("quantize.linear.") for c in job.model.converters}
    if not ("float8" in converters or job.float8.enable_float8_linear):
        return "bf16", "tensorwise"
    recipe = job.float8.recipe_name or job.quantize.linear.float8.recipe_name or "tensorwise"
    if recipe not in ("tensorwise", "rowwise"):
        raise InputError(f"{origin}: float8 recipe_name {recipe!r:.40}: meshplan models tensorwise and rowwise")
    return "fp8", one_of(recipe, get_args(Fp8Recipe), "float8 recipe_name")
