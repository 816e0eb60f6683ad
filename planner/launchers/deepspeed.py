"""DeepSpeed: a plan as ds_config.json plus the Megatron-DeepSpeed launch line for TP, PP and Ulysses CP.

The rules are DeepSpeed's: train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x
data-parallel size (deepspeed/runtime/config.py, _configure_train_batch_size); its pipeline engine runs one 1F1B
schedule (deepspeed/runtime/pipe/schedule.py, TrainSchedule), no virtual stages, and refuses ZeRO-2/3
(deepspeed/runtime/pipe/engine.py); Megatron-DeepSpeed partitions layers evenly (partition_method "type:transformer")
and its topology is pipe, data, model (model innermost: deepspeed/runtime/pipe/topology.py); its sequence
parallelism is Ulysses (--ds-sequence-parallel-size), not ring attention.
"""

from __future__ import annotations

import json

from meshplan.planner.launchers.common import (UNIFORM_RECOMPUTE, Exported, Pins, ExportedFile, header_lines, refuse,
                                               shell_lines, torchrun_args, uniform_recompute)
from meshplan.planner.plan import Plan

__all__ = ["TARGET", "ds_config", "megatron_deepspeed_args", "export_deepspeed"]

TARGET = "deepspeed"
SCRIPT = "pretrain_gpt.py"  # Megatron-DeepSpeed's entry point


def _check(plan: Plan) -> None:
    mesh, pipe, wl = plan.mesh, plan.pipeline, plan.inputs.workload
    model = plan.inputs.model_spec()
    if wl.dtype == "fp8":
        raise refuse(TARGET, "DeepSpeed's config has no FP8 training switch (FP8 comes from TransformerEngine "
                     "layers)", "re-plan with --dtype bf16")
    if mesh.pp > 1 and plan.memory.zero >= 2:
        raise refuse(TARGET, f"DeepSpeed's pipeline engine refuses ZeRO-{plan.memory.zero} "
                     "(deepspeed/runtime/pipe/engine.py)", "re-plan with --zero 0 or --zero 1",
                     ({"zero": 0}, {"zero": 1}))
    if pipe.vpp > 1 or (mesh.pp > 1 and pipe.schedule != "1f1b"):
        raise refuse(TARGET, f"DeepSpeed's pipeline engine runs one 1F1B schedule without virtual stages (the plan: "
                     f"{pipe.schedule}, vpp {pipe.vpp})", "re-plan with --schedule 1f1b --vpp 1",
                     ({"schedule": "1f1b", "vpp": 1},))
    if len({s.num_layers for s in pipe.stages}) > 1:
        layers = sum(s.num_layers for s in pipe.stages)
        even: tuple[Pins, ...] = ({"stage_layers": (layers // mesh.pp,) * mesh.pp},) if layers % mesh.pp == 0 else ()
        raise refuse(TARGET, "Megatron-DeepSpeed partitions layers evenly; the plan's stages hold "
                     f"{[s.num_layers for s in pipe.stages]}", "re-plan with even stages (--pp dividing the layers)",
                     even + ({"pp": 1},))
    if mesh.cp > 1 and mesh.cp_comm != "a2a":
        raise refuse(TARGET, "DeepSpeed's sequence parallelism is Ulysses (all-to-all over heads), not ring attention",
                     "re-plan with --cp-comm a2a", ({"cp_comm": "a2a"}, {"cp": 1}))
    if "-".join(mesh.rank_order) != "tp-cp-dp-pp":
        raise refuse(TARGET, "DeepSpeed's topology is pipe, data, model (model innermost)",
                     "re-plan with --order tp-cp-dp-pp", ({"rank_order": "tp-cp-dp-pp"},))
    if model.moe is not None:
        raise refuse(TARGET, "this exporter writes dense Megatron-DeepSpeed runs; DeepSpeed-MoE's expert groups are "
                     "not mapped", "use --to megatron for MoE plans")
    if model.mla is not None or model.mlp == "relu2":
        raise refuse(TARGET, "Megatron-DeepSpeed has no multi-latent attention or squared-ReLU MLP",
                     "use --to megatron")


def ds_config(plan: Plan) -> dict[str, object]:
    """ds_config.json as a dict: batch, ZeRO stage, precision; the header as "_meshplan" (DeepSpeed ignores keys
    it does not know, and JSON has no comments)."""
    _check(plan)
    pipe, wl = plan.pipeline, plan.inputs.workload
    config: dict[str, object] = {
        "_meshplan": header_lines(plan, "DeepSpeed", TARGET),
        "train_batch_size": wl.global_batch,
        "train_micro_batch_size_per_gpu": pipe.micro_batch_size,
        "gradient_accumulation_steps": pipe.num_microbatches,
        "zero_optimization": {"stage": plan.memory.zero},
        "bf16": {"enabled": wl.dtype == "bf16"},
        "fp16": {"enabled": wl.dtype == "fp16"},
    }
    return config


def megatron_deepspeed_args(plan: Plan) -> list[str]:
    _check(plan)
    mesh, pipe, wl = plan.mesh, plan.pipeline, plan.inputs.workload
    model = plan.inputs.model_spec()
    args = ["--tensor-model-parallel-size", str(mesh.tp)]
    args += ["--pipeline-model-parallel-size", str(mesh.pp)] if mesh.pp > 1 else ["--no-pipeline-parallel"]
    if mesh.cp > 1:
        args += ["--ds-sequence-parallel-size", str(mesh.cp)]
    if mesh.sp:
        args.append("--sequence-parallel")
    try:
        kind, k = uniform_recompute(plan)
    except ValueError as exc:
        raise refuse(TARGET, f"Megatron-DeepSpeed applies one recompute policy to every stage, but {exc}",
                     "re-plan with --recompute none, selective or full", UNIFORM_RECOMPUTE) from None
    if kind == "full" and k is not None:
        raise refuse(TARGET, f"the plan recomputes {k} layers per stage", "re-plan with --recompute full",
                     ({"recompute": "full"},))
    if kind == "full":
        args += ["--checkpoint-activations", "--checkpoint-num-layers", "1"]
    elif kind == "selective":
        args += ["--recompute-granularity", "selective"]
    args += ["--micro-batch-size", str(pipe.micro_batch_size), "--global-batch-size", str(wl.global_batch),
             "--seq-length", str(wl.seq_len), "--zero-stage", str(plan.memory.zero)]
    args += ["--bf16"] if wl.dtype == "bf16" else ["--fp16"]
    args += ["--num-layers", str(model.num_layers), "--hidden-size", str(model.hidden),
             "--ffn-hidden-size", str(model.ffn_hidden), "--num-attention-heads", str(model.num_heads)]
    if model.kv_heads < model.num_heads:
        args += ["--num-key-value-heads", str(model.kv_heads)]
    args += ["--max-position-embeddings", str(model.max_seq_len or wl.seq_len)]
    if model.mlp == "swiglu":
        args.append("--swiglu")
    if model.norm == "rmsnorm":
        args += ["--normalization", "rmsnorm"]
    if not model.learned_positions:
        args.append("--use-rotary-position-embeddings")
    if not model.tied_embeddings:
        args.append("--untie-embeddings-and-output-weights")
    if not model.linear_bias:
        args.append("--disable-bias-linear")
    return args + ["--deepspeed", "--deepspeed_config", "${MESHPLAN_DIR}/ds_config.json"]


def export_deepspeed(plan: Plan) -> Exported:
    config = json.dumps(ds_config(plan), indent=2) + "\n"
    header = "\n".join("# " + line for line in header_lines(plan, "Megatron-DeepSpeed", TARGET))
    command = shell_lines(torchrun_args(plan) + [SCRIPT] + megatron_deepspeed_args(plan))
    here = 'MESHPLAN_DIR="$(cd "$(dirname "$0")" && pwd)"'
    script = (f"#!/usr/bin/env bash\n{header}\n# Add your data, tokenizer and optimizer arguments; ds_config.json "
              f"sits beside this script.\nset -euo pipefail\n{here}\n{command} \\\n    \"$@\"\n")
    return Exported(TARGET, (ExportedFile("ds_config.json", config), ExportedFile("megatron_deepspeed.sh", script)))
