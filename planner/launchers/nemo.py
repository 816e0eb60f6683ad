"""NeMo 2 and Megatron-Bridge: the plan as MegatronStrategy(...) arguments and as ConfigContainer overrides.

Both pass the parallel layout to megatron-core's ModelParallelConfig / TransformerConfig, so the names are those
fields (megatron/core/model_parallel_config.py, megatron/core/transformer/transformer_config.py, v0.16); the
batch goes to the data module (NeMo 2) or cfg.train (Megatron-Bridge, megatron/bridge/training/config.py); the
model itself comes from the user's recipe. The values are the Megatron export's (planner/launchers/megatron.py),
renamed, so both exporters refuse the same plans for the same reasons.
"""

from __future__ import annotations

from meshplan.planner.launchers.common import Exported, ExportedFile, ExportError, header_lines, node_geometry, refuse
from meshplan.planner.launchers.megatron import parallel_settings, training_settings
from meshplan.planner.plan import Plan

__all__ = ["TARGET", "model_parallel_fields", "ddp_fields", "training_fields", "export_nemo"]

TARGET = "nemo"
# Megatron argument -> megatron-core config field (megatron/training/arguments.py, core_transformer_config_from_args)
RENAMED = {
    "decoder_first_pipeline_num_layers": "num_layers_in_first_pipeline_stage",
    "decoder_last_pipeline_num_layers": "num_layers_in_last_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank": "virtual_pipeline_model_parallel_size",
}
MODEL_PARALLEL = {"tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
                  "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage",
                  "pipeline_model_parallel_layout", "context_parallel_size", "cp_comm_type",
                  "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
                  "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
                  "moe_grouped_gemm", "cpu_offloading", "cpu_offloading_num_layers"}
# Megatron argument -> config field for what the model trains with (megatron/training/argument_utils.py,
# core_transformer_config_from_args and _apply_yarn_config_from_args; GPTModel takes rope_scaling and its factor,
# which NeMo's GPTConfig and Megatron-Bridge's GPTModelProvider carry as fields of those names)
TRAINING_RENAMED = {"norm_epsilon": "layernorm_epsilon", "use_rope_scaling": "rope_scaling"}
YARN_RENAMED = {"rotary_scaling_factor": "yarn_rotary_scaling_factor", "mscale": "yarn_mscale",
                "mscale_all_dim": "yarn_mscale_all_dim"}  # a non-MLA YaRN model's config (MLA's are unprefixed)
DDP = {"use_distributed_optimizer", "use_megatron_fsdp", "data_parallel_sharding_strategy", "grad_reduce_in_fp32"}


def _settings(plan: Plan) -> dict[str, object]:
    if "-".join(plan.mesh.rank_order) != "tp-cp-dp-pp":
        raise refuse(TARGET, "this export writes Megatron's default rank order", "re-plan with --order tp-cp-dp-pp",
                     ({"rank_order": "tp-cp-dp-pp"},))
    if plan.inputs.workload.dtype == "fp8":
        raise refuse(TARGET, "NeMo's FP8 recipes are version-specific precision plugins", "re-plan with --dtype bf16")
    try:
        megatron = parallel_settings(plan)
    except ExportError as exc:  # the same limits as Megatron's, said for NeMo
        raise refuse(TARGET, exc.why, exc.fix, exc.pins) from None
    settings = {RENAMED.get(k, k): v for k, v in megatron if v is not None and v is not False}
    settings.pop("num_layers_per_virtual_pipeline_stage", None)
    if plan.pipeline.vpp > 1:  # the strategy builds vpp chunks; with a layout string megatron-core checks they agree
        settings["virtual_pipeline_model_parallel_size"] = plan.pipeline.vpp
    settings.setdefault("sequence_parallel", False)
    if settings.get("cpu_offloading_num_layers"):  # TransformerConfig needs the switch too (Megatron's CLI sets it)
        settings["cpu_offloading"] = True
    if settings.pop("grad_reduce_in_bf16", False):  # DistributedDataParallelConfig's own name for it
        settings["grad_reduce_in_fp32"] = False
    return settings


def model_parallel_fields(plan: Plan) -> dict[str, object]:
    """The TransformerConfig fields of the plan's layout (what GPTModelProvider / MegatronStrategy take)."""
    return {k: v for k, v in _settings(plan).items() if k in MODEL_PARALLEL}


def training_fields(plan: Plan) -> dict[str, object]:
    """The model's RoPE, norm epsilon, dropout and MoE router fields (megatron.training_settings, renamed)."""
    model = plan.inputs.model_spec()
    renamed = TRAINING_RENAMED | (YARN_RENAMED if model.mla is None else {})
    return {renamed.get(k, k): v for k, v in training_settings(model) if v is not None and v is not False}


def ddp_fields(plan: Plan) -> dict[str, object]:
    """DistributedDataParallelConfig fields (megatron/core/distributed/distributed_data_parallel_config.py)."""
    return {k: v for k, v in _settings(plan).items() if k in DDP}


# MegatronStrategy's own layout arguments (nemo/lightning/pytorch/strategies/megatron_strategy.py); the other fields go
# on the model's config, a megatron-core TransformerConfig in every NeMo 2 recipe
STRATEGY = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
            "context_parallel_size", "sequence_parallel", "expert_model_parallel_size")


def export_nemo(plan: Plan) -> Exported:
    mp, ddp = model_parallel_fields(plan) | training_fields(plan), ddp_fields(plan)
    pipe, wl = plan.pipeline, plan.inputs.workload
    nodes, per_node = node_geometry(plan)
    precision = "bf16-mixed" if wl.dtype == "bf16" else "16-mixed"
    header = "\n".join("# " + line for line in header_lines(plan, "NeMo 2 / Megatron-Bridge", TARGET))
    strategy_args = "".join(f"\n    {k}={v!r}," for k, v in mp.items() if k in STRATEGY)
    on_config = "".join(f"\n    {k}={v!r}," for k, v in mp.items() if k not in STRATEGY)
    ddp_args = "".join(f"{k}={v!r}, " for k, v in ddp.items()).rstrip(", ")
    bridge = "".join(f"\n    cfg.model.{k} = {v!r}" for k, v in mp.items())
    bridge += "".join(f"\n    cfg.ddp.{k} = {v!r}" for k, v in ddp.items())
    if ddp.get("use_distributed_optimizer"):
        bridge += "\n    cfg.optimizer.use_distributed_optimizer = True"
    bridge += (f"\n    cfg.train.micro_batch_size = {pipe.micro_batch_size}"
               f"\n    cfg.train.global_batch_size = {wl.global_batch}"
               f"\n    cfg.model.seq_length = {wl.seq_len}"
               f"\n    cfg.dataset.sequence_length = {wl.seq_len}")
    text = f'''{header}
# The model comes from your recipe (meshplan planned {plan.inputs.model_spec().name}); these set its parallel layout
# and what it trains with where meshplan's model states it (RoPE, norm epsilon, dropout, MoE router).
import torch
from megatron.core.distributed import DistributedDataParallelConfig
from nemo import lightning as nl

# ---- NeMo 2 (nemo.lightning): the trainer's strategy, the model config's layout fields, the data module's batch ---
strategy = nl.MegatronStrategy({strategy_args}
    pipeline_dtype=torch.{"bfloat16" if wl.dtype == "bf16" else "float16"},
    ddp=DistributedDataParallelConfig({ddp_args}),
)
trainer = nl.Trainer(num_nodes={nodes}, devices={per_node}, strategy=strategy,
                     plugins=nl.MegatronMixedPrecision(precision="{precision}"))
model_config_fields = dict({on_config}
)  # set each on your recipe's model config: for k, v in model_config_fields.items(): setattr(model.config, k, v)
data_kwargs = dict(micro_batch_size={pipe.micro_batch_size}, global_batch_size={wl.global_batch},
                   seq_length={wl.seq_len})


# ---- Megatron-Bridge (megatron.bridge.training.config.ConfigContainer): the same layout as overrides --------------
def apply_meshplan(cfg):
    """Set the plan's layout and batch on a ConfigContainer from a Megatron-Bridge recipe."""{bridge}
    return cfg
'''
    return Exported(TARGET, (ExportedFile("nemo_plan.py", text),))
