"""The launchers by name, behind planner/launchers/__init__.py (which re-exports these names on first use).

`export_plan(plan, target)` returns the files that launch the plan with Megatron-LM, torchtitan, DeepSpeed
(Megatron-DeepSpeed), torchrun (meshplan's executor) or NeMo / Megatron-Bridge, or raises ExportError with the reason
when the target cannot express the plan (never a silently changed plan). `pinned_plan` turns a launch
configuration read back (`megatron.parse_megatron_args`, `torchtitan.parse_torchtitan_toml`) into a Plan.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from meshplan.costmodels.config import DEFAULT_RECOMPUTE_MODULES, Workload
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.estimate import Simulated, simulate_config
from meshplan.costmodels.model import ModelSpec
from meshplan.hardware_db.cluster import Cluster
from meshplan.hardware_db.errors import InputError
from meshplan.planner.launchers import deepspeed, megatron, nemo, sglang, torchrun, torchtitan, trtllm, vllm
from meshplan.planner.launchers.common import Exported, ExportedFile, ExportError
from meshplan.planner.launchers.dynamo import DYNAMO_FILE
from meshplan.planner.launchers.megatron import LaunchSpec
from meshplan.planner.outputs import OutputFile, write_all
from meshplan.planner.plan import Plan, ServingPlan

__all__ = ["TARGETS", "SERVING_TARGETS", "EXPORT_NAMES", "Exported", "ExportedFile", "ExportError", "LaunchSpec",
           "export_plan", "write_export",
           "SOURCES", "read_launch", "launch_model", "launch_world", "pinned_plan"]

TARGETS: dict[str, Callable[[Plan], Exported]] = {
    "megatron": megatron.export_megatron,
    "torchtitan": torchtitan.export_torchtitan,
    "deepspeed": deepspeed.export_deepspeed,
    "torchrun": torchrun.export_torchrun,
    "nemo": nemo.export_nemo,
}
SERVING_TARGETS: dict[str, Callable[[ServingPlan], Exported]] = {
    "vllm": vllm.export_vllm,
    "sglang": sglang.export_sglang,
    "trtllm": trtllm.export_trtllm,
}
# the names each target's files may take (fnmatch patterns), against which a command checks its other outputs
# before any work (planner.outputs.check_folder_contents); tests/test_outputs.py holds every export to them
EXPORT_NAMES: dict[str, tuple[str, ...]] = {
    "megatron": ("megatron.sh",), "torchtitan": ("torchtitan.toml", "torchtitan_config.py"),
    "deepspeed": ("ds_config.json", "megatron_deepspeed.sh"), "torchrun": ("torchrun.sh",), "nemo": ("nemo_plan.py",),
    "vllm": ("node-*.sh", "router.sh", DYNAMO_FILE), "sglang": ("node-*.sh", "router.sh", DYNAMO_FILE),
    "trtllm": ("node-*.sh", "router.sh", DYNAMO_FILE)}


def export_plan(plan: Plan | ServingPlan, target: str) -> Exported:
    """The files of `plan` for `target`: a training plan for a training launcher, a serving plan for vLLM, SGLang
    or TensorRT-LLM."""
    if isinstance(plan, ServingPlan):
        if target in SERVING_TARGETS:
            return SERVING_TARGETS[target](plan)
        if target in TARGETS:
            raise InputError(f"{target} launches training; this is a serving plan: export it --to "
                             f"{', '.join(SERVING_TARGETS)}")
    elif target in TARGETS:
        if plan.memory.offload_layers and target not in ("megatron", "nemo"):
            raise ExportError(target, f"the plan offloads {plan.memory.offload_layers} layers' activations to host "
                              f"memory, which only Megatron-LM / NeMo (--cpu-offloading-num-layers) run",
                              "export it --to megatron or nemo, or re-plan without --offload-layers",
                              ({"offload_layers": None},))
        if plan.memory.recompute_group > 1 and target not in ("megatron", "nemo"):
            raise ExportError(target, f"the plan recomputes its layers in groups of {plan.memory.recompute_group}, "
                              f"which only Megatron-LM / NeMo (--recompute-method uniform --recompute-num-layers) run",
                              "export it --to megatron or nemo, or re-plan without --recompute-group",
                              ({"recompute_group": None},))
        modules = tuple(plan.memory.recompute_modules)
        selective = any(s.recompute.granularity == "selective" for s in plan.pipeline.stages)
        if target not in ("megatron", "nemo") and selective and modules != DEFAULT_RECOMPUTE_MODULES:
            # their own selective recompute means something else (torchtitan: per-operator SAC; Megatron-DeepSpeed
            # and meshplan's executor: core attention only), so the plan's memory and time would not hold there
            raise ExportError(target, f"the plan's selective recompute re-runs the Megatron-Core modules "
                              f"{', '.join(modules)} (--recompute-modules), which {target} does not have",
                              "export it --to megatron or nemo, or re-plan without --recompute-modules",
                              ({"recompute_modules": DEFAULT_RECOMPUTE_MODULES},))
        return TARGETS[target](plan)
    elif target in SERVING_TARGETS:
        raise InputError(f"{target} serves models; this is a training plan: export it --to "
                         f"{', '.join(TARGETS)}")
    raise InputError(f"unknown export target '{target}'; choose one of: {', '.join([*TARGETS, *SERVING_TARGETS])}")


def write_export(exported: Exported, out: str | Path) -> list[Path]:
    """Write the exported files all or none (planner/outputs.py): `out` is the file when there is one, a directory
    (made if missing) when there are several. Returns the paths written."""
    return write_all(export_files(exported, out))


def export_files(exported: Exported, out: str | Path) -> list[OutputFile]:
    """The exported files with their targets under `out` (see write_export), for a command's write_all."""
    out = Path(out)
    if len(exported.files) == 1 and not out.is_dir():
        return [OutputFile(out, exported.files[0].text)]
    if out.exists() and not out.is_dir():
        raise InputError(f"{out} is a file, but the {exported.target} export has {len(exported.files)} files "
                         f"({', '.join(f.name for f in exported.files)}); pass a directory to --out")
    return [OutputFile(out / f.name, f.text) for f in exported.files]


SOURCES = ("megatron", "torchtitan")


def read_launch(source: str, text: str, origin: str, num_layers: int | None = None) -> LaunchSpec:
    """A launch configuration: Megatron-LM arguments (optionally with their torchrun line) or a torchtitan TOML;
    `num_layers` of the model named beside it, for arguments that leave the model out."""
    if source == "megatron":
        return megatron.parse_megatron_args(text, num_layers=num_layers)
    if source == "torchtitan":
        return torchtitan.parse_torchtitan_toml(text, origin)[0]
    raise InputError(f"unknown import source '{source}'; choose one of: {', '.join(SOURCES)}")


def launch_model(launch: LaunchSpec, named: ModelSpec | None) -> ModelSpec:
    """The model to plan: `named` (which the launch's model arguments must not contradict), else the one the
    launch describes whole."""
    if named is None:
        if launch.model is None:
            raise InputError("the arguments do not describe a whole model (--num-layers, --hidden-size, "
                             "--num-attention-heads and --vocab-size); name one with --model")
        return launch.model
    problem = megatron.model_disagreement(launch, named)
    if (problem is None and launch.model is not None and not launch.model_fields  # torchtitan: its own flavor
            and launch.model.name != named.name):
        problem = f"the config trains {launch.model.name}, not {named.name}"
    if problem is not None:
        raise InputError(f"--model {named.name} disagrees with the launch configuration: {problem}")
    return named


def launch_world(launch: LaunchSpec, gpus: int | None) -> int:
    """The world size: the launch's own (torchrun's nodes x processes, torchtitan's degrees) or --gpus."""
    if launch.num_gpus is not None and gpus is not None and gpus != launch.num_gpus:
        raise InputError(f"--gpus {gpus} but the launch configuration runs {launch.num_gpus} processes")
    world = gpus if gpus is not None else launch.num_gpus
    if world is None:
        raise InputError("the arguments do not say the world size (no torchrun --nnodes/--nproc-per-node); "
                         "give --gpus")
    return world


def pinned_plan(launch: LaunchSpec, model: ModelSpec, cluster: Cluster, runtime: str,
                efficiency: Efficiency | None = None, calibration: str | None = None) -> tuple[Plan, Simulated]:
    """The plan of exactly the imported configuration on `cluster`, and its simulation (the cost model's
    prediction)."""
    # the builders import the search; the exporters need only the schema
    from meshplan.planner.builders import build_plan

    workload = Workload(**launch.workload.model_dump())
    sim = simulate_config(model, cluster, workload, launch.config, runtime, efficiency)
    return build_plan(model, cluster, workload, launch.config, sim, runtime, calibration=calibration), sim
