"""What every exporter shares: the exported files, the refusal, the header, the node geometry, the torchrun line."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from meshplan.hardware_db.errors import InputError
from meshplan.planner.plan import Plan, ServingEngine, ServingPlan

__all__ = ["ExportError", "ExportedFile", "Exported", "refuse", "header_lines", "node_geometry", "torchrun_args",
           "shell_lines", "uniform_recompute", "serving_header_lines", "full_ep_only"]


Pins = dict[str, object]  # ParallelConfig fields to pin: what a refusal's fix asks for


class ExportError(InputError):
    """The plan cannot be expressed in the target launcher; the message says why and what to re-plan with."""

    def __init__(self, target: str, why: str, fix: str, pins: tuple[Pins, ...] = ()) -> None:
        self.target, self.why, self.fix, self.pins = target, why, fix, pins
        super().__init__(f"cannot export to {target}: {why}; {fix}")


@dataclass(frozen=True)
class ExportedFile:
    name: str  # the file name the exporter suggests (a launcher looks for some by name: ds_config.json)
    text: str


@dataclass(frozen=True)
class Exported:
    target: str
    files: tuple[ExportedFile, ...]


def refuse(target: str, why: str, fix: str, pins: tuple[Pins, ...] = ()) -> ExportError:
    """`pins`: the alternative ParallelConfig pins, each of which the fix means (a re-plan tries each)."""
    return ExportError(target, why, fix, pins)


# every stage with one recompute policy, each a re-plan alternative
UNIFORM_RECOMPUTE: tuple[Pins, ...] = ({"recompute": "none"}, {"recompute": "selective"}, {"recompute": "full"})


# the framework (costmodels.runtime preset) each training launcher runs: a plan made for another is priced again
# under it (runtime_note); DeepSpeed's own engine has no preset
LAUNCHER_RUNTIME: dict[str, str | None] = {"megatron": "megatron-core", "nemo": "megatron-core",
                                           "torchtitan": "torchtitan", "torchrun": "meshplan-executor",
                                           "deepspeed": None}
# the launcher of each runtime preset: a plan made for the preset exports to it (tests/test_export_refusal.py)
RUNTIME_LAUNCHER: dict[str, str] = {"megatron-core": "megatron", "megatron-2022": "megatron",
                                    "torchtitan": "torchtitan", "meshplan-executor": "torchrun"}


def runtime_note(plan: Plan, target: str) -> str | None:
    """When the plan was made for another framework than `target` runs: the plan re-simulated under the target's
    runtime preset beside the plan's own figures (None when they are the same framework)."""
    ours = plan.inputs.runtime.split("+")[0]
    theirs = LAUNCHER_RUNTIME.get(target, ours)
    if theirs == ours:
        return None
    p = plan.prediction
    mine = f"the plan's {plan.inputs.runtime} prediction: step {p.step_time_s:.4g} s, peak {p.peak_memory_gib:.1f} GiB"
    if theirs is None:
        return f"{target}'s framework is not modelled; {mine}"
    from meshplan.costmodels.estimate import simulate_config
    from meshplan.planner.plan import plan_config
    from meshplan.planner.rederive import planned_hardware

    hardware = planned_hardware(plan)
    if hardware is None:
        return f"made for {plan.inputs.runtime} with a calibration the plan does not hold, so not priced under " \
               f"{theirs}; {mine}"
    model, _, workload, config, _ = plan_config(plan)
    try:
        est = simulate_config(model, hardware[0], workload, config, theirs, hardware[1]).estimate
    except InputError as exc:
        return f"{theirs} cannot run the plan as made ({' '.join(str(exc).split())}); {mine}"
    fits = "" if est.fits else " (DOES NOT FIT)"
    return (f"under {theirs}, the framework {target} runs: step {est.step_time_s:.4g} s, peak "
            f"{est.peak_memory_gib:.1f} GiB{fits}; {mine}")


def header_lines(plan: Plan, target: str, launcher: str | None = None) -> list[str]:
    """The header every exported file carries (as comments): where it came from and what it is predicted to do
    (`target` names the file's kind; `launcher`, the export target, adds the plan priced under its framework)."""
    p, mesh, wl = plan.prediction, plan.mesh, plan.inputs.workload
    gpu = plan.inputs.cluster.gpu_spec.name
    lines = [
        f"meshplan {plan.meshplan_version}: {target} launch configuration of a plan (schema v{plan.schema_version})",
        f"model {plan.inputs.model_spec().name}; {mesh.world_size} x {gpu}; global batch {wl.global_batch} x "
        f"{wl.seq_len} tokens, {wl.dtype}; runtime {plan.inputs.runtime}",
        f"mesh tp {mesh.tp} cp {mesh.cp} pp {mesh.pp} (vpp {plan.pipeline.vpp}) dp {mesh.dp} ep {mesh.ep} "
        f"etp {mesh.etp}; mbs {plan.pipeline.micro_batch_size} x {plan.pipeline.num_microbatches} micro-batches",
        f"predicted: step {p.step_time_s:.4g} s, {p.tokens_per_s_per_gpu:.4g} tokens/s/GPU, MFU {p.mfu:.1%}, "
        f"peak memory {p.peak_memory_gib:.1f} of {p.hbm_gib:.0f} GiB" + ("" if p.fits else " (DOES NOT FIT)"),
    ]
    if plan.inputs.calibration:
        lines.append(f"calibration: {plan.inputs.calibration}")
    other = runtime_note(plan, launcher) if launcher is not None else None
    if other is not None:
        lines.append(other)
    return lines


def node_geometry(plan: Plan) -> tuple[int, int]:
    """(nodes, processes per node) for the plan's world on its cluster's nodes."""
    world, per_node = plan.mesh.world_size, plan.inputs.cluster.gpus_per_node
    if world <= per_node:
        return 1, world
    if world % per_node:
        raise refuse("torchrun", f"{world} GPUs do not fill whole nodes of {per_node}",
                     "plan for a multiple of the node size")
    return world // per_node, per_node


def torchrun_args(plan: Plan) -> list[str]:
    """torchrun's own arguments for the plan's world: one process per GPU, c10d rendezvous at $MASTER_ADDR (the
    elastic-launch flags of torch/distributed/run.py)."""
    nodes, per_node = node_geometry(plan)
    if nodes == 1:
        return ["torchrun", "--standalone", "--nnodes", "1", "--nproc-per-node", str(per_node)]
    return ["torchrun", "--nnodes", str(nodes), "--nproc-per-node", str(per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", "${MASTER_ADDR}:${MASTER_PORT:-29500}", "--rdzv-id", "${JOB_ID:-meshplan}"]


def _quote(arg: str) -> str:
    """shlex.quote, but a `${VAR}` reference stays expandable (double quotes)."""
    if "${" in arg:
        return '"' + arg.replace('"', '\\"') + '"'
    return shlex.quote(arg)


def shell_lines(argv: list[str], head: int = 1) -> str:
    """One command as a shell continuation: the program (its first `head` words), then each flag with its value
    on its own line."""
    groups: list[list[str]] = [argv[:head]]
    for arg in argv[head:]:
        flag = arg.startswith("-") and not re.fullmatch(r"-[0-9.]+", arg)  # a negative number is a value
        after_value = len(groups[-1]) > 1 and groups[-1][0].startswith("-")  # a program after "--flag value"
        if flag or after_value:
            groups.append([arg])
        else:
            groups[-1].append(arg)
    rendered = [" ".join(_quote(a) for a in g) for g in groups]
    return " \\\n    ".join(rendered)


def uniform_recompute(plan: Plan) -> tuple[str, int | None]:
    """The one recompute policy the plan applies on every stage: ("none"|"selective", None), ("full", None) when
    every layer is recomputed, ("full", k) for the first k layers of each stage; raises ValueError otherwise (the
    caller turns it into its launcher's refusal)."""
    stages = plan.pipeline.stages
    kinds = {s.recompute.granularity for s in stages}
    if len(kinds) != 1:
        raise ValueError("the stages recompute differently (" +
                         ", ".join(s.recompute.label(s.num_layers) for s in stages) + ")")
    kind = kinds.pop()
    if kind != "full":
        return kind, None
    if all(s.recompute.full_layers == s.num_layers for s in stages):
        return "full", None
    ks = {s.recompute.full_layers for s in stages}
    if len(ks) == 1:
        return "full", ks.pop()
    raise ValueError("the stages recompute different numbers of layers in full (" +
                     ", ".join(s.recompute.label(s.num_layers) for s in stages) + ")")


def serving_header_lines(plan: ServingPlan, target: str) -> list[str]:
    """The header of a serving export: where it came from and what the deployment is predicted to do."""
    p, wl = plan.prediction, plan.inputs.workload
    gpu = plan.inputs.cluster.gpu_spec.name
    lines = [
        f"meshplan {plan.meshplan_version}: {target} commands of a serving plan (schema v{plan.schema_version})",
        f"model {plan.inputs.model_spec().name}; {p.gpus} x {gpu}; ISL {wl.isl}, OSL {wl.osl}; weights "
        f"{wl.weight_dtype}, KV {wl.kv_dtype}; {plan.mode}",
        f"predicted: TTFT {p.ttft_ms:.0f} ms, TPOT {p.tpot_ms:.1f} ms, {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
        f"{p.tokens_per_s_per_user:.1f} tokens/s/user, {p.requests_per_s:.2f} requests/s"
        + ("" if p.meets_targets else f" (misses {p.misses})"),
    ]
    return lines


def full_ep_only(target: str, engine: ServingEngine) -> None:
    """vLLM and SGLang run experts with EP over every tp x dp rank of an engine, or without EP."""
    ranks = engine.tp * engine.dp
    if engine.ep not in (1, ranks):
        raise refuse(target, f"{target} spreads experts over every tp x dp = {ranks} rank or runs them without EP "
                     f"(the plan: ep {engine.ep})", f"re-plan with ep 1 or {ranks}")
