"""The exported configurations parsed and validated by the launchers' own code, where it installs on a CPU machine:
megatron-core's TransformerConfig (its __post_init__ checks the parallel layout, uneven stages and the layout
string) and micro-batch calculator, DeepSpeed's DeepSpeedConfig, torchtitan 0.2's ConfigManager and ParallelDims.
CI installs them (`pip install ".[test,launchers]"`); elsewhere these tests skip. Megatron-LM's argument parser
(megatron/training, not packaged), Megatron-DeepSpeed and NeMo do not install here: their rules are encoded in
tests/test_launchers.py instead."""

from __future__ import annotations

import importlib.util
import os
import tomllib

import pytest
from launcher_helpers import deepseek_v3, flags, llama_405b, make_plan

from meshplan.costmodels.config import ParallelConfig, StagePolicy, Workload
from meshplan.costmodels.model import ModelSpec, MoESpec
from meshplan.planner.launchers import export_plan
from meshplan.planner.launchers.deepspeed import ds_config
from meshplan.planner.launchers.megatron import megatron_args, parse_moe_layer_freq
from meshplan.planner.launchers.nemo import ddp_fields, model_parallel_fields
from meshplan.planner.launchers.torchtitan import stage_module_names, toml_text

PACKAGES = ("megatron.core", "deepspeed", "torchtitan")


def test_ci_installs_the_launcher_packages():
    """Under CI the checks below must run, not skip."""
    if not os.environ.get("CI"):
        pytest.skip("only CI must have the launcher packages")
    missing = [p for p in PACKAGES if importlib.util.find_spec(p.split(".")[0]) is None]
    assert not missing, f"CI lacks {missing}: install meshplan[launchers]"


SMALL = ModelSpec(name="small", num_layers=12, hidden=512, num_heads=8, num_kv_heads=4, ffn_hidden=1536,
                  vocab=32000, max_seq_len=4096)
SMALL_MOE = ModelSpec(name="small-moe", num_layers=8, hidden=512, num_heads=8, num_kv_heads=4, ffn_hidden=1536,
                      vocab=32000, max_seq_len=4096,
                      moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden=256, num_shared_experts=1,
                                  first_k_dense=1))
WL = Workload(global_batch=64, seq_len=2048)


def small(model=SMALL, gpus=16, **knobs):
    return make_plan(model, "h100-sxm", gpus, WL, ParallelConfig(**knobs))


def megatron_plans():
    return [
        ("llama-405b tp8 pp16 first/last", llama_405b()),
        ("llama-405b tp8 pp16 vpp2 layout", llama_405b(vpp=2)),
        ("deepseek-v3 pp16 ep64", deepseek_v3()),
        ("deepseek-v3 recompute modules", deepseek_v3(recompute="selective",
                                                      recompute_modules=("layernorm", "mla_up_proj", "moe_act"))),
        ("even vpp2", small(tp=2, pp=2, vpp=2)),
        ("uneven middle", small(tp=2, pp=4, stage_layers=(3, 2, 4, 3))),
        ("first/last with vpp", small(tp=2, pp=4, vpp=2, stage_layers=(2, 4, 4, 2))),
        ("cp2 a2a selective", small(tp=2, cp=2, cp_comm="a2a", recompute="selective")),
        ("block recompute", small(tp=2, pp=2, stage_recompute=(StagePolicy(granularity="full", full_layers=2),) * 2)),
        ("full recompute zero3", small(tp=1, pp=1, zero=3, recompute="full")),
        ("moe ep4 etp1", small(SMALL_MOE, tp=2, pp=2, ep=4, etp=1)),
    ]


# ---- megatron-core: the exported arguments as a TransformerConfig -------------------------------------------------

def transformer_config_kwargs(argv: list[str]) -> tuple[dict, bool]:
    """Megatron arguments -> megatron-core config fields, as megatron/training/arguments.py's
    core_transformer_config_from_args maps them; (kwargs, whether MLA)."""
    import torch

    f = flags(argv)
    num = {k: int(v) for k, v in f.items() if isinstance(v, str) and v.isdigit()}
    n_layers, pp = num["--num-layers"], num["--pipeline-model-parallel-size"]
    kw = dict(num_layers=n_layers, hidden_size=num["--hidden-size"], ffn_hidden_size=num["--ffn-hidden-size"],
              num_attention_heads=num["--num-attention-heads"],
              tensor_model_parallel_size=num["--tensor-model-parallel-size"], pipeline_model_parallel_size=pp,
              context_parallel_size=num.get("--context-parallel-size", 1),
              expert_model_parallel_size=num.get("--expert-model-parallel-size", 1),
              expert_tensor_parallel_size=num.get("--expert-tensor-parallel-size"),
              sequence_parallel=bool(f.get("--sequence-parallel")), gated_linear_unit=bool(f.get("--swiglu")),
              add_bias_linear=not f.get("--disable-bias-linear"), add_qkv_bias=bool(f.get("--add-qkv-bias")),
              normalization=f["--normalization"], bf16=bool(f.get("--bf16")), fp16=bool(f.get("--fp16")),
              pipeline_dtype=torch.bfloat16 if f.get("--bf16") else torch.float16,
              num_query_groups=num.get("--num-query-groups"), kv_channels=num.get("--kv-channels"),
              num_layers_in_first_pipeline_stage=num.get("--decoder-first-pipeline-num-layers"),
              num_layers_in_last_pipeline_stage=num.get("--decoder-last-pipeline-num-layers"),
              pipeline_model_parallel_layout=f.get("--pipeline-model-parallel-layout"),
              cp_comm_type=f.get("--cp-comm-type"), mtp_num_layers=num.get("--mtp-num-layers"))
    if "--num-virtual-stages-per-pipeline-rank" in num:
        kw["virtual_pipeline_model_parallel_size"] = num["--num-virtual-stages-per-pipeline-rank"]
    if "--num-layers-per-virtual-pipeline-stage" in num:  # arguments.py: layers per rank / layers per virtual stage
        kw["virtual_pipeline_model_parallel_size"] = n_layers // pp // num["--num-layers-per-virtual-pipeline-stage"]
    if "--recompute-granularity" in f:
        kw["recompute_granularity"] = f["--recompute-granularity"]
        kw["recompute_method"] = f.get("--recompute-method")
        kw["recompute_num_layers"] = num.get("--recompute-num-layers")
    if "--num-experts" in num:
        kw |= dict(num_moe_experts=num["--num-experts"], moe_router_topk=num["--moe-router-topk"],
                   moe_ffn_hidden_size=num["--moe-ffn-hidden-size"],
                   moe_shared_expert_intermediate_size=num.get("--moe-shared-expert-intermediate-size"),
                   moe_layer_freq=parse_moe_layer_freq(str(f["--moe-layer-freq"]), n_layers))
    mla = bool(f.get("--multi-latent-attention"))
    if mla:
        kw |= dict(q_lora_rank=num.get("--q-lora-rank"), kv_lora_rank=num["--kv-lora-rank"],
                   qk_head_dim=num["--qk-head-dim"], qk_pos_emb_head_dim=num["--qk-pos-emb-head-dim"],
                   v_head_dim=num["--v-head-dim"])
        # MLATransformerConfig's RoPE fields take the same-named arguments (core_transformer_config_from_args)
        kw |= {field: real(f.get(flag)) for field, flag in (
            ("rotary_scaling_factor", "--rotary-scaling-factor"), ("mscale", "--mscale"),
            ("mscale_all_dim", "--mscale-all-dim"))}
        kw |= dict(rope_type=f.get("--rope-type"), rotary_base=real(f.get("--rotary-base")))
    # the training fields: TransformerConfig field names (--norm-epsilon is layernorm_epsilon's argparse name)
    kw |= {field: real(f.get(flag)) for field, flag in (
        ("layernorm_epsilon", "--norm-epsilon"), ("hidden_dropout", "--hidden-dropout"),
        ("attention_dropout", "--attention-dropout"),
        ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor"))}
    kw |= dict(moe_router_score_function=f.get("--moe-router-score-function"),
               moe_router_enable_expert_bias=bool(f.get("--moe-router-enable-expert-bias")),
               moe_router_num_groups=num.get("--moe-router-num-groups"),
               moe_router_group_topk=num.get("--moe-router-group-topk"),
               moe_router_load_balancing_type=f.get("--moe-router-load-balancing-type"),
               moe_token_dispatcher_type=f.get("--moe-token-dispatcher-type"),
               moe_grouped_gemm=bool(f.get("--moe-grouped-gemm")))
    return {k: v for k, v in kw.items() if v is not None}, mla


def real(value: str | bool | None) -> float | None:
    return None if value is None else float(str(value))


def build_transformer_config(kwargs: dict, mla: bool):
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    return (MLATransformerConfig if mla else TransformerConfig)(**kwargs)


@pytest.mark.parametrize("name, plan", megatron_plans(), ids=[n for n, _ in megatron_plans()])
def test_megatron_core_accepts_the_export(name, plan):
    pytest.importorskip("megatron.core")
    from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator

    argv = megatron_args(plan)
    kwargs, mla = transformer_config_kwargs(argv)
    config = build_transformer_config(kwargs, mla)
    vpp = plan.pipeline.vpp
    assert (config.virtual_pipeline_model_parallel_size or 1) == vpp
    layout = config.pipeline_model_parallel_layout
    if layout is not None:  # megatron-core's own reading of the string: our layers on each (rank, virtual stage)
        from megatron.core.transformer.enums import LayerType

        for r, stage in enumerate(plan.pipeline.stages):
            for v, chunk in enumerate(stage.chunks):
                assert layout.layout[r][v].count(LayerType.decoder) == chunk.num_layers
    f = flags(argv)
    calc = ConstantNumMicroBatchesCalculator(int(f["--global-batch-size"]), int(f["--micro-batch-size"]),
                                             plan.mesh.dp, False, 0)
    assert calc.get() == plan.pipeline.num_microbatches


def test_megatron_core_check_can_fail():
    """The same path rejects a layout Megatron cannot build: the validation is live."""
    pytest.importorskip("megatron.core")
    kwargs, mla = transformer_config_kwargs(megatron_args(llama_405b()))
    with pytest.raises(ValueError, match="middle"):
        build_transformer_config(kwargs | {"num_layers_in_first_pipeline_stage": 6}, mla)
    kwargs, mla = transformer_config_kwargs(megatron_args(llama_405b(vpp=2)))
    with pytest.raises(AssertionError, match="Number of decoder layers"):
        build_transformer_config(kwargs | {"num_layers": 125}, mla)


@pytest.mark.parametrize("name, plan", megatron_plans(), ids=[n for n, _ in megatron_plans()])
def test_megatron_core_accepts_the_nemo_fields(name, plan):
    pytest.importorskip("megatron.core")
    from megatron.core.distributed import DistributedDataParallelConfig

    shape, mla = transformer_config_kwargs(megatron_args(plan))
    model_only = {k: v for k, v in shape.items() if k not in model_parallel_fields(plan) and
                  not k.startswith("num_layers_in_") and k not in ("virtual_pipeline_model_parallel_size",
                                                                   "pipeline_model_parallel_layout")}
    build_transformer_config(model_only | model_parallel_fields(plan), mla)
    DistributedDataParallelConfig(**ddp_fields(plan))


# ---- DeepSpeed: DeepSpeedConfig checks the batch arithmetic and the ZeRO section ----------------------------------

class _DataParallel:
    """The one method of Megatron's mpu that DeepSpeedConfig asks: the data-parallel size."""

    def __init__(self, size: int) -> None:
        self.size = size

    def get_data_parallel_world_size(self) -> int:
        return self.size


@pytest.fixture()
def deepspeed_config(monkeypatch):
    pytest.importorskip("deepspeed")
    import deepspeed.runtime.config as ds

    # DeepSpeedConfig reads the data-parallel size from mpu only once torch.distributed answers get_rank();
    # stand in for an initialised world of rank 0 (the batch checks themselves are DeepSpeed's)
    monkeypatch.setattr(ds.dist, "get_rank", lambda *a, **k: 0)
    return ds.DeepSpeedConfig


@pytest.mark.parametrize("knobs", [dict(tp=2, pp=2, zero=1, mbs=2), dict(tp=1, zero=3), dict(tp=2, zero=2),
                                   dict(tp=4, pp=3, zero=0)])
def test_deepspeed_config_accepts_the_export(deepspeed_config, knobs):
    plan = small(gpus=24 if knobs.get("pp") == 3 else 16, **knobs)
    config = deepspeed_config(ds_config(plan), mpu=_DataParallel(plan.mesh.dp))
    assert config.train_batch_size == plan.inputs.workload.global_batch
    assert config.gradient_accumulation_steps == plan.pipeline.num_microbatches
    assert config.zero_optimization_stage == plan.memory.zero
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        deepspeed_config(ds_config(plan), mpu=_DataParallel(plan.mesh.dp + 1))


def test_deepspeed_pipeline_rule_is_still_deepspeeds():
    """The refusal of ZeRO-2/3 with PP cites deepspeed/runtime/pipe/engine.py: check the rule is still there."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None:
        pytest.skip("deepspeed not installed")
    engine = os.path.join(os.path.dirname(spec.origin), "runtime", "pipe", "engine.py")
    with open(engine, encoding="utf-8") as fh:
        assert "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" in fh.read()


# ---- torchtitan 0.2: ConfigManager reads the TOML, ParallelDims checks the degrees --------------------------------

def titan_plans():
    return [("405b fsdp tp8 pp16", llama_405b(zero=3)),
            ("8b ddp tp2", make_plan("llama3.1-8b", "h100-sxm", 16, WL, ParallelConfig(tp=2, zero=0))),
            ("8b fsdp cp2 pp2 vpp2", make_plan("llama3.1-8b", "h100-sxm", 32, WL,
                                               ParallelConfig(tp=2, cp=2, pp=2, vpp=2, zero=3, recompute="full"))),
            ("qwen3 moe ep4", make_plan("qwen3-30b-a3b", "h100-sxm", 32, WL,
                                        ParallelConfig(tp=2, pp=2, ep=4, etp=1, zero=2)))]


@pytest.mark.parametrize("name, plan", titan_plans(), ids=[n for n, _ in titan_plans()])
def test_torchtitan_reads_the_toml(name, plan, tmp_path):
    pytest.importorskip("torchtitan")
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims

    path = tmp_path / "job.toml"
    path.write_text(toml_text(plan))
    job = ConfigManager().parse_args(["--job.config_file", str(path)])
    p = job.parallelism
    ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                 cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                 ep=p.expert_parallel_degree, etp=p.expert_tensor_parallel_degree, world_size=plan.mesh.world_size)
    assert job.training.global_batch_size == plan.inputs.workload.global_batch
    assert job.model.name == tomllib.loads(path.read_text())["model"]["name"]
    if plan.mesh.pp > 1:
        assert p.module_fqns_per_model_part == stage_module_names(plan)


def test_torchtitan_stage_names_are_the_models_modules():
    """module_fqns_per_model_part names modules that torchtitan's Llama 3 has (built on the meta device)."""
    pytest.importorskip("torchtitan")
    import torch
    from torchtitan.models.llama3 import Transformer, llama3_args

    with torch.device("meta"):
        model = Transformer(llama3_args["405B"])
    names = {name for name, _ in model.named_modules()}
    parts = stage_module_names(llama_405b(zero=3))
    assert all(name in names for part in parts for name in part)
    assert sum(len(part) for part in parts) == 126 + 3


def test_torchtitan_config_check_can_fail(tmp_path):
    pytest.importorskip("torchtitan")
    from torchtitan.config.manager import ConfigManager

    path = tmp_path / "job.toml"
    path.write_text(toml_text(llama_405b(zero=3)).replace("tensor_parallel_degree", "tensor_parallel_degre"))
    with pytest.raises(ValueError, match="tensor_parallel_degre"):
        ConfigManager().parse_args(["--job.config_file", str(path)])


def test_every_target_exports_something_checkable():
    plan = make_plan("llama3.1-8b", "h100-sxm", 16, WL, ParallelConfig(tp=2, zero=3))
    for target in ("megatron", "torchtitan", "torchrun", "nemo"):
        assert export_plan(plan, target).files


# ---- the model the export trains: RoPE, norm, dropout, MoE router (issue 20) --------------------------------------

def test_megatron_core_config_carries_llama_31_70b_as_the_model_states_it():
    """Llama-3.1-70B exported: the TransformerConfig megatron-core builds from the arguments has its norm epsilon
    and no dropout; the RoPE arguments are GPTModel's (rotary_base, rope_scaling, rope_scaling_factor, by its
    signature) with the model's base and factor, and megatron-core's fixed Llama 3 bands (its RotaryEmbedding's
    own defaults) are the model's."""
    pytest.importorskip("megatron.core")
    import inspect

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_model import GPTModel

    from meshplan.costmodels.model_io import load_zoo

    model = load_zoo("llama3.1-70b")
    plan = make_plan(model, "h100-sxm", 64, Workload(global_batch=64, seq_len=8192),
                     ParallelConfig(tp=8, pp=2, mbs=1, zero=1, recompute="none"))
    argv = megatron_args(plan)
    config = build_transformer_config(*transformer_config_kwargs(argv))
    assert config.layernorm_epsilon == model.norm_eps == 1e-5
    assert config.hidden_dropout == config.attention_dropout == model.dropout == 0.0
    f = flags(argv)
    gpt = inspect.signature(GPTModel.__init__).parameters
    assert {"rotary_base", "rope_scaling", "rope_scaling_factor"} <= set(gpt)
    assert int(f["--rotary-base"]) == model.rope_theta == 500000
    assert f["--use-rope-scaling"] is True and float(f["--rope-scaling-factor"]) == model.rope_scaling.factor == 8
    bands = inspect.signature(RotaryEmbedding._apply_scaling).parameters
    scaling = model.rope_scaling
    assert (bands["low_freq_factor"].default, bands["high_freq_factor"].default,
            bands["original_max_position_embeddings"].default) == (
        scaling.low_freq_factor, scaling.high_freq_factor, scaling.original_max_position_embeddings)


def test_megatron_core_config_carries_deepseek_v3_router_and_yarn():
    """DeepSeek-V3 exported: MLATransformerConfig from the arguments has the model's YaRN (factor, mscales; its
    original length and betas are the config's defaults and equal the model's), norm epsilon, no dropout, and the
    router: sigmoid scores, expert bias, scaling 2.5, 8 groups top-4, sequence auxiliary loss, all-to-all dispatch;
    megatron-core's own checks (expert bias needs sigmoid, groups divide the experts) pass."""
    pytest.importorskip("megatron.core")
    from meshplan.costmodels.model_io import load_zoo

    model = load_zoo("deepseek-v3")
    config = build_transformer_config(*transformer_config_kwargs(megatron_args(deepseek_v3())))
    moe, rope = model.moe, model.rope_scaling
    assert type(config).__name__ == "MLATransformerConfig"
    assert (config.rope_type, config.rotary_base, config.rotary_scaling_factor) == ("yarn", model.rope_theta,
                                                                                   rope.factor)
    assert (config.mscale, config.mscale_all_dim) == (rope.mscale, rope.mscale_all_dim)
    assert (config.original_max_position_embeddings, config.beta_fast, config.beta_slow) == (
        rope.original_max_position_embeddings, rope.beta_fast, rope.beta_slow)
    assert config.layernorm_epsilon == model.norm_eps == 1e-6
    assert config.hidden_dropout == config.attention_dropout == 0.0
    assert (config.moe_router_score_function, config.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert config.moe_router_topk_scaling_factor == moe.routed_scaling_factor == 2.5
    assert (config.moe_router_num_groups, config.moe_router_group_topk) == (moe.num_groups, moe.group_topk) == (8, 4)
    assert config.moe_router_load_balancing_type == "seq_aux_loss"
    assert config.moe_token_dispatcher_type == "alltoall" and config.moe_grouped_gemm
    assert config.num_moe_experts == moe.num_experts and config.mtp_num_layers == model.num_mtp_layers
    from meshplan.planner.launchers.nemo import training_fields
    nemo = training_fields(deepseek_v3())
    assert {k: getattr(config, k) for k in nemo} == nemo  # NeMo / Bridge set the same fields to the same values


def test_megatron_core_refuses_what_the_router_fields_must_not_be():
    """The router check is live: expert bias under softmax scores is refused by megatron-core itself."""
    pytest.importorskip("megatron.core")
    kwargs, mla = transformer_config_kwargs(megatron_args(deepseek_v3()))
    with pytest.raises((ValueError, AssertionError), match="sigmoid"):
        build_transformer_config(kwargs | {"moe_router_score_function": "softmax"}, mla)
