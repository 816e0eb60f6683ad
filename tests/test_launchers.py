"""Exporters and importers (planner/launchers): golden launch configurations written by hand from the launchers'
docs, the launchers' documented rules, refusals, the plan -> export -> import round trip, and the CLI."""

from __future__ import annotations

import ast
import dataclasses
import json
import tomllib
from itertools import pairwise
from pathlib import Path

import pytest
from cli_helpers import assert_input_error, run
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from launcher_helpers import deepseek_v3, flags, llama_405b, make_plan

from meshplan.costmodels.config import ParallelConfig, StagePolicy, Workload, resolve
from meshplan.costmodels.model import ModelSpec, MoESpec
from meshplan.hardware_db.errors import InputError
from meshplan.planner.launchers import (TARGETS, ExportError, export_plan, launch_model, launch_world, pinned_plan,
                                        read_launch, write_export)
from meshplan.planner.launchers.deepspeed import ds_config, megatron_deepspeed_args
from meshplan.planner.launchers.megatron import (megatron_args, parse_layout, parse_megatron_args, parse_moe_layer_freq,
                                                 pipeline_layout)
from meshplan.planner.launchers.nemo import ddp_fields, model_parallel_fields
from meshplan.planner.launchers.torchrun import torchrun_command
from meshplan.planner.launchers.torchtitan import parse_torchtitan_toml, python_text, toml_text
from meshplan.planner.plan import plan_config, write_plan

LLAMA_405B_MODEL_FLAGS = [
    "--num-layers", "126", "--hidden-size", "16384", "--ffn-hidden-size", "53248", "--num-attention-heads", "128",
    "--group-query-attention", "--num-query-groups", "8", "--seq-length", "8192",
    "--max-position-embeddings", "131072", "--swiglu", "--normalization", "RMSNorm",
    "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--vocab-size", "128256",
    # what it trains with (issue 20): RoPE base 500,000 with Llama 3.1's scaling, RMSNorm eps 1e-5, no dropout
    "--rotary-base", "500000", "--use-rope-scaling", "--rope-scaling-factor", "8.0", "--norm-epsilon", "1e-05",
    "--hidden-dropout", "0.0", "--attention-dropout", "0.0"]


# ---- golden configurations -----------------------------------------------------------------------------------------

def test_golden_llama_405b_megatron():
    """Llama 3.1 405B, TP8 PP16 on 16,384 H100, one layer fewer on the first and last stages."""
    plan = llama_405b()
    assert megatron_args(plan) == [
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
        "--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "7",
        "--sequence-parallel", "--use-distributed-optimizer",
        "--micro-batch-size", "1", "--global-batch-size", "2048", "--bf16",
        "--overlap-grad-reduce", "--overlap-param-gather", "--tp-comm-overlap",
    ] + LLAMA_405B_MODEL_FLAGS
    text = export_plan(plan, "megatron").files[0].text
    assert "--nnodes 2048 \\\n    --nproc-per-node 8" in text and "pretrain_gpt.py" in text
    assert "--rdzv-backend c10d" in text


def test_golden_llama_405b_interleaved_layout():
    """With two virtual stages the 7-layer end stages do not split evenly (Megatron's first/last flags need
    multiples of vpp), so the layout string: 16 chunks of 4, then 3, 14 of 4 and 3, in model order."""
    plan = llama_405b(vpp=2)
    got = flags(megatron_args(plan))
    assert got["--pipeline-model-parallel-layout"] == "Et*4|(t*4|)*15ttt|(t*4|)*14tttL"
    assert "--decoder-first-pipeline-num-layers" not in got and "--num-virtual-stages-per-pipeline-rank" not in got


def test_golden_deepseek_v3_megatron():
    """DeepSeek-V3, PP16 EP64 on 2,048 H800: MLA, 256 routed experts + 1 shared, first 3 layers dense, one MTP."""
    assert megatron_args(deepseek_v3()) == [
        "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "16",
        "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "2",
        "--expert-model-parallel-size", "64", "--expert-tensor-parallel-size", "1", "--moe-grouped-gemm",
        "--use-distributed-optimizer", "--micro-batch-size", "1", "--global-batch-size", "15360", "--bf16",
        "--overlap-grad-reduce", "--overlap-param-gather",
        "--num-layers", "61", "--hidden-size", "7168", "--ffn-hidden-size", "18432", "--num-attention-heads", "128",
        "--multi-latent-attention", "--q-lora-rank", "1536", "--kv-lora-rank", "512", "--qk-head-dim", "128",
        "--qk-pos-emb-head-dim", "64", "--v-head-dim", "128", "--seq-length", "4096",
        "--max-position-embeddings", "163840", "--swiglu", "--normalization", "RMSNorm",
        "--position-embedding-type", "rope", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--vocab-size", "129280", "--num-experts", "256", "--moe-router-topk", "8", "--moe-ffn-hidden-size", "2048",
        "--moe-shared-expert-intermediate-size", "2048", "--moe-layer-freq", "([0]*3+[1]*58)",
        "--mtp-num-layers", "1",
        # YaRN x40 on MLA (rope-type yarn), RMSNorm eps 1e-6, no dropout, the sigmoid router with expert bias,
        # scaling 2.5, 8 groups top-4 and a sequence-wise auxiliary loss, all-to-all dispatch
        "--rotary-base", "10000", "--rope-type", "yarn", "--rotary-scaling-factor", "40.0", "--mscale", "1.0",
        "--mscale-all-dim", "1.0", "--norm-epsilon", "1e-06", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
        "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
        "--moe-router-topk-scaling-factor", "2.5", "--moe-router-num-groups", "8", "--moe-router-group-topk", "4",
        "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-token-dispatcher-type", "alltoall"]
    text = export_plan(deepseek_v3(), "megatron").files[0].text
    assert "--nnodes 256 \\\n    --nproc-per-node 8" in text


def test_golden_llama_405b_torchtitan_fsdp():
    """torchtitan runs the 405B layout with FSDP2 (ZeRO-3): dp_shard 128, explicit stages by module name."""
    plan = llama_405b(zero=3)
    doc = tomllib.loads(toml_text(plan))
    assert doc["model"] == {"name": "llama3", "flavor": "405B"}
    assert doc["training"] == {"local_batch_size": 16, "global_batch_size": 2048, "seq_len": 8192,
                               "mixed_precision_param": "bfloat16"}
    par = doc["parallelism"]
    parts = par.pop("module_fqns_per_model_part")
    assert par == {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 128,
                   "fsdp_reshard_after_forward": "always", "tensor_parallel_degree": 8,
                   "pipeline_parallel_degree": 16, "pipeline_parallel_schedule": "1F1B",
                   "pipeline_parallel_microbatch_size": 1}
    assert parts[0] == ["tok_embeddings"] + [f"layers.{i}" for i in range(7)]
    assert parts[1] == [f"layers.{i}" for i in range(7, 15)]
    assert parts[-1] == [f"layers.{i}" for i in range(119, 126)] + ["norm", "output"]
    assert doc["activation_checkpoint"] == {"mode": "none"}


def test_golden_llama_70b_deepspeed():
    """Llama 3.1 70B, TP8 PP4 DP32 with ZeRO-1 on 1,024 H100: the DeepSpeed config and Megatron-DeepSpeed flags."""
    plan = make_plan("llama3.1-70b", "h100-sxm", 1024, Workload(global_batch=512, seq_len=8192),
                     ParallelConfig(tp=8, pp=4, mbs=1, zero=1))
    config = ds_config(plan)
    assert {k: v for k, v in config.items() if k != "_meshplan"} == {
        "train_batch_size": 512, "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 16,
        "zero_optimization": {"stage": 1}, "bf16": {"enabled": True}, "fp16": {"enabled": False}}
    args = megatron_deepspeed_args(plan)
    assert args[:10] == ["--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "4",
                         "--sequence-parallel", "--micro-batch-size", "1", "--global-batch-size", "512",
                         "--seq-length"]
    got = flags(args)
    assert got["--zero-stage"] == "1" and got["--num-key-value-heads"] == "8" and got["--bf16"] is True
    assert got["--deepspeed_config"] == "${MESHPLAN_DIR}/ds_config.json"


def test_golden_nemo_fields():
    assert model_parallel_fields(llama_405b()) == {
        "tensor_model_parallel_size": 8, "pipeline_model_parallel_size": 16,
        "num_layers_in_first_pipeline_stage": 7, "num_layers_in_last_pipeline_stage": 7, "sequence_parallel": True}
    assert ddp_fields(llama_405b()) == {"use_distributed_optimizer": True}
    assert model_parallel_fields(llama_405b(vpp=2))["pipeline_model_parallel_layout"] == \
        "Et*4|(t*4|)*15ttt|(t*4|)*14tttL"


# ---- the launchers' rules ------------------------------------------------------------------------------------------

SMALL = ModelSpec(name="small", num_layers=12, hidden=512, num_heads=8, num_kv_heads=4, ffn_hidden=1536,
                  vocab=32000, max_seq_len=4096)
SMALL_MOE = ModelSpec(name="small-moe", num_layers=8, hidden=512, num_heads=8, num_kv_heads=4, ffn_hidden=1536,
                      vocab=32000, max_seq_len=4096,
                      moe=MoESpec(num_experts=8, top_k=2, expert_ffn_hidden=256, first_k_dense=1))
WL = Workload(global_batch=64, seq_len=2048)


def small(gpus: int = 16, model: ModelSpec = SMALL, wl: Workload = WL, **knobs):
    return make_plan(model, "h100-sxm", gpus, wl, ParallelConfig(**knobs))


def test_torchrun_world_is_the_plans():
    """torchrun starts nnodes x nproc-per-node ranks (torch/distributed/run.py): the plan's world, whole nodes."""
    for gpus, nodes, per in ((4, 1, 4), (8, 1, 8), (32, 4, 8)):
        plan = small(gpus, tp=2)
        got = flags(torchrun_command(plan))
        assert int(got["--nnodes"]) * int(got["--nproc-per-node"]) == plan.mesh.world_size
        assert (int(got["--nnodes"]), int(got["--nproc-per-node"])) == (nodes, per)
        assert ("--standalone" in got) == (nodes == 1) and ("--rdzv-endpoint" in got) == (nodes > 1)


def test_batch_rule_holds_in_every_export():
    """GBS = mbs x micro-batches x DP (Megatron arguments.py, DeepSpeed _configure_train_batch_size, torchtitan)."""
    plan = small(16, tp=2, pp=2, mbs=2, zero=0)
    got = flags(megatron_args(plan))
    assert int(got["--global-batch-size"]) % (int(got["--micro-batch-size"]) * plan.mesh.dp) == 0
    c = ds_config(plan)
    assert c["train_batch_size"] == c["train_micro_batch_size_per_gpu"] * c["gradient_accumulation_steps"] * \
        plan.mesh.dp
    assert tomllib.loads(toml_text(small(16, model=_titan_small(), tp=2, pp=2, mbs=2, zero=0)))["training"][
        "local_batch_size"] == 2 * plan.pipeline.num_microbatches


def _titan_small() -> ModelSpec:
    from meshplan.costmodels.model_io import load_zoo
    return load_zoo("llama3.1-8b")


def test_even_stages_with_virtual_stages_use_layers_per_virtual_stage():
    got = flags(megatron_args(small(16, tp=2, pp=2, vpp=2, mbs=1)))
    assert got["--num-layers-per-virtual-pipeline-stage"] == "3"
    assert "--pipeline-model-parallel-layout" not in got


def test_uneven_with_divisible_ends_uses_first_last_and_virtual_stages():
    got = flags(megatron_args(small(16, tp=2, pp=4, vpp=2, stage_layers=(2, 4, 4, 2))))
    assert (got["--decoder-first-pipeline-num-layers"], got["--decoder-last-pipeline-num-layers"],
            got["--num-virtual-stages-per-pipeline-rank"]) == ("2", "2", "2")


def test_uneven_middle_needs_the_layout_string():
    got = flags(megatron_args(small(16, tp=2, pp=4, stage_layers=(3, 2, 4, 3))))
    assert got["--pipeline-model-parallel-layout"] == "Ettt|tt|t*4|tttL"


def test_layout_string_reads_back():
    """parse_layout follows megatron-core's grammar: parentheses and x*n repeat, commas are cosmetic."""
    for chunks, pp, mtp in (([4, 4, 4, 3], 4, 0), ([7] + [8] * 14 + [7], 16, 1), ([2, 1, 1, 2, 2, 1], 3, 0)):
        text = pipeline_layout(chunks, pp, mtp)
        assert parse_layout(text, pp) == (chunks, mtp, True, True)
    assert parse_layout("Et*3|(tt|)*29,m|L", 16)[0] == [3] + [2] * 29 + [0, 0]


def test_moe_layer_freq_round_trip():
    assert parse_moe_layer_freq("([0]*3+[1]*58)", 61) == [0] * 3 + [1] * 58
    assert parse_moe_layer_freq("2", 4) == [1, 0, 1, 0]
    assert parse_moe_layer_freq("[0,1,1]", 3) == [0, 1, 1]
    with pytest.raises(InputError, match="describes 4 layers"):
        parse_moe_layer_freq("([0]*1+[1]*3)", 5)
    with pytest.raises(InputError, match="cannot read"):
        parse_moe_layer_freq("__import__('os')", 5)


@pytest.mark.parametrize("target, knobs, words", [
    ("megatron", dict(pp=2, schedule="gpipe"), ["gpipe", "--schedule 1f1b"]),
    ("megatron", dict(pp=2, schedule="zb"), ["zb"]),
    ("megatron", dict(pp=2, stage_recompute=(StagePolicy(granularity="full", full_layers=2), StagePolicy())),
     ["one recompute policy", "full:2, none"]),
    ("torchtitan", dict(zero=1), ["ZeRO-1", "--zero 3"]),
    ("torchtitan", dict(tp=2, sp=False), ["SP"]),
    ("torchtitan", dict(cp=2, cp_comm="a2a", zero=3), ["Ulysses", "--cp-comm ring"]),
    ("torchtitan", dict(cp=2, zero=0), ["dp_shard*cp", "--zero 2"]),
    ("torchtitan", dict(zero=3, order="tp-cp-pp-dp"), ["tp innermost"]),
    ("deepspeed", dict(pp=2, zero=2), ["ZeRO-2", "pipe/engine.py"]),
    ("deepspeed", dict(pp=4, zero=1, stage_layers=(2, 4, 4, 2)), ["evenly"]),
    ("deepspeed", dict(cp=2, cp_comm="ring"), ["Ulysses"]),
    ("deepspeed", dict(pp=2, vpp=2), ["virtual stages"]),
    ("nemo", dict(pp=2, schedule="gpipe"), ["gpipe"]),
])
def test_refusals_say_why(target, knobs, words):
    knobs = dict(knobs)
    order = knobs.pop("order", None)
    if order:
        knobs["rank_order"] = order
    model = _titan_small() if target == "torchtitan" else SMALL
    plan = small(16, model=model, **knobs)
    with pytest.raises(ExportError) as info:
        export_plan(plan, target)
    message = str(info.value)
    assert message.startswith(f"cannot export to {target}: ") and "\n" not in message
    for w in words:
        assert w in message, (w, message)


def test_torchtitan_refuses_a_model_it_has_not():
    with pytest.raises(ExportError, match="no torchtitan flavor of small"):
        export_plan(small(16, zero=3), "torchtitan")


def test_torchtitan_python_form_matches_the_toml():
    """The 0.3 form sets the same parallelism (less the fields 0.3 dropped, plus enable_sequence_parallel), on
    ParallelismConfig fields of torchtitan 0.3.0's torchtitan/config/configs.py."""
    plan = make_plan("llama3.1-8b", "h100-sxm", 32, WL, ParallelConfig(tp=2, pp=2, vpp=2, cp=2, zero=3))
    doc = tomllib.loads(toml_text(plan))
    tree = ast.parse(python_text(plan))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") ==
                "ParallelismConfig")
    kwargs = {k.arg: ast.literal_eval(k.value) for k in call.keywords}
    fields_030 = {"data_parallel_replicate_degree", "data_parallel_shard_degree", "fsdp_reshard_after_forward",
                  "tensor_parallel_degree", "enable_sequence_parallel", "pipeline_parallel_degree",
                  "module_fqns_per_model_part", "pipeline_parallel_schedule", "pipeline_parallel_microbatch_size",
                  "context_parallel_degree", "expert_parallel_degree"}
    assert set(kwargs) <= fields_030
    only_02 = {"context_parallel_rotate_method", "expert_tensor_parallel_degree"}
    assert {k: v for k, v in doc["parallelism"].items() if k not in only_02} == \
        {k: v for k, v in kwargs.items() if k != "enable_sequence_parallel"}
    assert kwargs["enable_sequence_parallel"] is True and kwargs["pipeline_parallel_schedule"] == "Interleaved1F1B"


def test_exported_files_carry_the_prediction():
    plan = small(16, model=_titan_small(), tp=2, zero=3)
    for target in TARGETS:
        for f in export_plan(plan, target).files:
            assert f"{plan.prediction.step_time_s:.4g} s" in f.text, (target, f.name)
            assert f"meshplan {plan.meshplan_version}" in f.text, (target, f.name)
    assert json.loads(export_plan(plan, "deepspeed").files[0].text)["_meshplan"][0].startswith("meshplan ")


# ---- round trip: plan -> export -> import -> the same pinned configuration ----------------------------------------

def _same_layout(plan, launch, model):
    spec, cluster, wl, cfg, _ = plan_config(plan)
    world = launch_world(launch, None if launch.num_gpus else cluster.num_gpus)
    assert world == cluster.num_gpus
    got, want = resolve(model, world, launch.workload, launch.config), resolve(spec, world, wl, cfg)
    if want.dp * want.cp == 1 and spec.moe is None:  # one data-parallel rank: no ZeRO stage to say
        got, want = dataclasses.replace(got, zero=0), dataclasses.replace(want, zero=0)
    assert got == want
    assert launch.workload.model_dump(exclude={"moe_imbalance"}) == wl.model_dump(exclude={"moe_imbalance"})


@st.composite
def plans(draw, models=(SMALL, SMALL_MOE)):
    model = draw(st.sampled_from(models))
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 4]))
    vpp = draw(st.sampled_from([1, 2])) if pp > 1 else 1
    cp = draw(st.sampled_from([1, 2]))
    gpus = draw(st.sampled_from([8, 16, 32]))
    assume(gpus % (tp * pp * cp) == 0)
    dp = gpus // (tp * pp * cp)
    mbs = draw(st.sampled_from([1, 2]))
    stage_layers = None
    if pp > 1 and draw(st.booleans()):
        cuts = sorted(draw(st.lists(st.integers(1, model.num_layers - 1), min_size=pp - 1, max_size=pp - 1,
                                    unique=True)))
        bounds = [0] + cuts + [model.num_layers]
        stage_layers = tuple(b - a for a, b in pairwise(bounds))
        assume(min(stage_layers) >= vpp)
    recompute = draw(st.sampled_from(["none", "selective", "full", "block"]))
    stage_recompute = None
    if recompute == "block":
        layers = stage_layers or tuple([model.num_layers // pp] * pp)
        assume(model.num_layers % pp == 0 or stage_layers is not None)
        k = draw(st.integers(1, min(layers)))
        assume(vpp == 1 and k < max(layers))
        stage_recompute = tuple(StagePolicy(granularity="full", full_layers=k) for _ in layers)
        recompute = "none"
    ep = draw(st.sampled_from([1, 2, 4])) if model.moe else 1
    cp_comm = draw(st.sampled_from(["ring", "a2a"])) if cp > 1 else "ring"
    knobs = dict(tp=tp, pp=pp, vpp=vpp, cp=cp, cp_comm=cp_comm, ep=ep,
                 etp=draw(st.sampled_from([1, tp])) if model.moe else None, mbs=mbs,
                 zero=draw(st.sampled_from([0, 1, 2, 3])), recompute=recompute, sp=draw(st.booleans()),
                 stage_layers=stage_layers, stage_recompute=stage_recompute,
                 rank_order=draw(st.sampled_from(["tp-cp-dp-pp", "tp-cp-pp-dp"])))
    wl = Workload(global_batch=mbs * dp * draw(st.sampled_from([4, 8])), seq_len=2048,
                  dtype=draw(st.sampled_from(["bf16", "fp16", "fp8"])))
    config = ParallelConfig(**knobs)
    try:
        resolve(model, gpus, wl, config)
    except InputError:
        assume(False)
    return make_plan(model, "h100-sxm", gpus, wl, config)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(plan=plans())
def test_megatron_round_trip(plan):
    """Every plan Megatron can express comes back from its arguments as the same layout, workload and model."""
    try:
        argv = export_plan(plan, "megatron").files[0].text
    except ExportError:
        assume(False)
    launch = parse_megatron_args(argv)
    spec = plan.inputs.model_spec()
    assert launch.num_gpus == plan.mesh.world_size
    imported = launch_model(launch, None)
    assert imported.model_copy(update={"name": spec.name}) == spec
    _same_layout(plan, launch, imported)
    assert launch_model(launch, spec) == spec  # the named model agrees with every model argument


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(plan=plans(models=(_titan_small(),)))
def test_torchtitan_round_trip(plan):
    try:
        text = toml_text(plan)
    except ExportError:
        assume(False)
    launch, zoo = parse_torchtitan_toml(text)
    assert zoo == plan.inputs.model_spec().name
    _same_layout(plan, launch, launch.model)


def test_round_trip_gives_the_same_prediction():
    plan = deepseek_v3()
    launch = parse_megatron_args(export_plan(plan, "megatron").files[0].text)
    _, cluster, _, _, runtime = plan_config(plan)
    again, _ = pinned_plan(launch, launch_model(launch, plan.inputs.model_spec()), cluster, runtime)
    assert again.prediction == plan.prediction and again.mesh == plan.mesh and again.pipeline == plan.pipeline


# ---- importing what people write -----------------------------------------------------------------------------------

def test_import_reads_a_hand_written_command():
    launch = read_launch("megatron", (
        "torchrun --nnodes=4 --nproc_per_node=8 --rdzv-endpoint=host:29500 pretrain_gpt.py "
        "--tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 4 "
        "--sequence-parallel --use-distributed-optimizer --micro-batch-size 2 --global-batch-size 256 "
        "--seq-length 4096 --bf16 --lr 3e-4 --data-path /data/x --recompute-granularity selective"), "args",
        num_layers=32)
    assert launch.num_gpus == 32 and launch.gpus_per_node == 8
    from meshplan.costmodels.model_io import load_zoo
    lay = resolve(load_zoo("llama3.1-8b"), 32, launch.workload, launch.config)
    assert (lay.tp, lay.pp, lay.vpp, lay.dp, lay.mbs, lay.zero, lay.recompute, lay.sp, lay.schedule) == \
        (4, 2, 4, 4, 2, 1, "selective", True, "interleaved")


@pytest.mark.parametrize("args, words", [
    ("--seq-length 8 --global-batch-size 8 --cp-comm-type all_gather --context-parallel-size 2", ["all_gather"]),
    ("--seq-length 8 --global-batch-size 8 --account-for-embedding-in-pipeline-split", ["decoder layers only"]),
    ("--global-batch-size 8", ["--seq-length"]),
    ("--seq-length 8 --global-batch-size 8 --num-layers 10 --pipeline-model-parallel-size 4 "
     "--decoder-first-pipeline-num-layers 2", ["middle stages"]),
    ("--seq-length 8 --global-batch-size 8 --pipeline-model-parallel-size 2 --pipeline-model-parallel-layout "
     "'Etx|tL'", ["unknown layer"]),
    ("torchrun --nnodes 1:4 --nproc-per-node 8 pretrain_gpt.py --seq-length 8 --global-batch-size 8", ["1:4"]),
    ("--seq-length 8 --global-batch-size 8 'unclosed", ["quotes"]),
])
def test_import_refusals(args, words):
    with pytest.raises(InputError) as info:
        read_launch("megatron", args, "args", num_layers=8)
    for w in words:
        assert w in str(info.value)


def test_named_model_must_agree():
    launch = read_launch("megatron", "--seq-length 8 --global-batch-size 8 --num-layers 31", "args")
    from meshplan.costmodels.model_io import load_zoo
    with pytest.raises(InputError, match="--num-layers 31 but llama3.1-8b has 32"):
        launch_model(launch, load_zoo("llama3.1-8b"))
    with pytest.raises(InputError, match="give --gpus"):
        launch_world(launch, None)


# ---- the CLI -------------------------------------------------------------------------------------------------------

@pytest.fixture()
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    write_plan(small(16, model=_titan_small(), tp=2, pp=2, zero=3), path)
    return path


def test_cli_export_prints_and_writes(capsys, tmp_path, plan_file):
    code, out, err = run(capsys, "export", str(plan_file), "--to", "megatron")
    assert code == 0 and out.startswith("#!/usr/bin/env bash") and "--tensor-model-parallel-size 2" in out
    code, out, _ = run(capsys, "export", str(plan_file), "--to", "torchtitan")
    assert code == 0 and "==> torchtitan.toml <==" in out and "==> torchtitan_config.py <==" in out
    ds_plan = tmp_path / "ds_plan.json"
    write_plan(small(16, tp=2, pp=2, zero=1), ds_plan)
    code, out, _ = run(capsys, "export", str(ds_plan), "--to", "deepspeed", "--out", str(tmp_path / "ds"))
    assert code == 0 and sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["ds_config.json",
                                                                                 "megatron_deepspeed.sh"]
    code, _, _ = run(capsys, "export", str(plan_file), "--to", "torchrun", "--out", str(tmp_path / "run.sh"))
    assert code == 0 and (tmp_path / "run.sh").read_text().startswith("#!/usr/bin/env bash")


def test_cli_export_refusal_writes_nothing(capsys, tmp_path):
    path = tmp_path / "plan.json"
    write_plan(small(16, pp=2, zero=2), path)
    target = tmp_path / "ds"
    assert_input_error(*run(capsys, "export", str(path), "--to", "deepspeed", "--out", str(target)),
                       "cannot export to deepspeed", "ZeRO-2")
    assert not target.exists()
    assert_input_error(*run(capsys, "export", str(tmp_path / "missing.json"), "--to", "megatron"), "no such file")
    assert_input_error(*run(capsys, "export", str(path), "--to", "slurm"), "slurm")
    (tmp_path / "f").write_text("x")
    assert_input_error(*run(capsys, "export", str(path), "--to", "deepspeed", "--out", str(tmp_path / "f")))



def test_cli_export_refuses_recompute_modules_outside_megatron(capsys, tmp_path):
    """A plan whose selective recompute re-runs Megatron-Core modules beyond core attention: one error line, exit 2,
    nothing written, for the launchers whose selective recompute means something else; a per-stage plan with a
    selective stage is refused the same way, one without is not."""
    path = tmp_path / "plan.json"
    write_plan(small(16, tp=2, zero=0, recompute="selective", recompute_modules=("core_attn", "mlp")), path)
    for target in ("torchtitan", "deepspeed", "torchrun"):
        out = tmp_path / target
        assert_input_error(*run(capsys, "export", str(path), "--to", target, "--out", str(out)),
                           f"cannot export to {target}", "--recompute-modules")
        assert not out.exists()
    code, _, err = run(capsys, "export", str(path), "--to", "megatron", "--out", str(tmp_path / "m.sh"))
    assert code == 0, err
    full_1 = StagePolicy(granularity="full", full_layers=1)
    mixed = small(16, pp=2, zero=0, recompute_modules=("core_attn", "mlp"),
                  stage_recompute=(StagePolicy(granularity="selective"), full_1))
    with pytest.raises(InputError, match="--recompute-modules"):
        export_plan(mixed, "deepspeed")
    no_selective = small(16, pp=2, zero=0, recompute_modules=("core_attn", "mlp"),
                         stage_recompute=(StagePolicy(granularity="none"), full_1))
    with pytest.raises(InputError, match="one recompute policy"):  # refused for its mixed stages, not the modules
        export_plan(no_selective, "deepspeed")

def test_cli_plan_export_in_one_go(capsys, tmp_path):
    out = tmp_path / "m.sh"
    code, stdout, err = run(capsys, "plan", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "32",
                            "--seq", "2048", "--pp", "1", "--export", "megatron", "--export-out", str(out))
    assert code == 0, err
    assert "megatron export written" in stdout and "--micro-batch-size" in out.read_text()
    assert_input_error(*run(capsys, "plan", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8",
                            "--export-out", str(out)), "--export")


def test_cli_import_megatron_and_torchtitan(capsys, tmp_path, plan_file):
    run(capsys, "export", str(plan_file), "--to", "megatron", "--out", str(tmp_path / "m.sh"))
    code, out, err = run(capsys, "import", "--from", "megatron", str(tmp_path / "m.sh"), "--gpu", "h100-sxm",
                         "-m", "llama3.1-8b", "--out", str(tmp_path / "back.json"), "--calibration", "none")
    assert code == 0, err
    original, back = json.loads(plan_file.read_text()), json.loads((tmp_path / "back.json").read_text())
    assert back["mesh"] == original["mesh"] and back["pipeline"] == original["pipeline"]
    assert back["prediction"]["step_time_s"] == original["prediction"]["step_time_s"]
    run(capsys, "export", str(plan_file), "--to", "torchtitan", "--out", str(tmp_path / "tt"))
    code, out, err = run(capsys, "import", "--from", "torchtitan", str(tmp_path / "tt" / "torchtitan.toml"),
                         "--gpu", "h100-sxm", "--json")
    assert code == 0, err
    assert json.loads(out)["mesh"] == original["mesh"]
    code, out, err = run(capsys, "import", "--from", "megatron", "--gpu", "h100-sxm", "--gpus", "8", "-m",
                         "llama3.1-8b", "--", "--tensor-model-parallel-size 2 --seq-length 2048 "
                         "--global-batch-size 16")
    assert code == 0, err


def test_cli_import_errors(capsys, tmp_path):
    assert_input_error(*run(capsys, "import", "--from", "megatron", "--tensor-model-parallel-size 2", "--gpu",
                            "h100-sxm"), "after `--`")
    assert_input_error(*run(capsys, "import", "--from", "megatron", "--gpu", "h100-sxm", "-m", "llama3.1-8b", "--",
                            "--tensor-model-parallel-size 2 --seq-length 2048 --global-batch-size 16"), "--gpus")
    assert_input_error(*run(capsys, "import", "--from", "megatron", "--gpu", "h100-sxm", "--gpus", "4", "--",
                            "torchrun --nnodes 1 --nproc-per-node 8 x.py --seq-length 8 --global-batch-size 8"),
                       "--gpus 4", "8 processes")
    assert_input_error(*run(capsys, "import", "--from", "torchtitan", str(tmp_path / "none.toml"), "--gpu",
                            "h100-sxm"), "no such file")
    bad = tmp_path / "bad.toml"
    bad.write_text("[parallelism\n")
    assert_input_error(*run(capsys, "import", "--from", "torchtitan", str(bad), "--gpu", "h100-sxm"), "TOML")
    assert_input_error(*run(capsys, "import", "--from", "megatron", "--gpu", "h100-sxm", "--gpus", "8", "--",
                            "--seq-length 2048 --global-batch-size 16 --tensor-model-parallel-size 2"), "--model")


def test_write_export_needs_a_directory_for_several_files(tmp_path):
    exported = export_plan(small(16, tp=2), "deepspeed")
    written = write_export(exported, tmp_path / "new")
    assert [p.name for p in written] == ["ds_config.json", "megatron_deepspeed.sh"]
    one = write_export(export_plan(small(16, tp=2), "megatron"), tmp_path / "run.sh")
    assert one == [tmp_path / "run.sh"] and not list(tmp_path.glob(".*.tmp"))


# ---- the exported files are well-formed, and the torchrun one runs -------------------------------------------------

def test_exported_files_parse():
    """Shell scripts pass `bash -n`, Python compiles, JSON and TOML load."""
    import subprocess

    plans = [small(16, model=_titan_small(), tp=2, zero=3), small(16, tp=2, pp=2, zero=1)]
    for plan in plans:
        for target in TARGETS:
            try:
                files = export_plan(plan, target).files
            except ExportError:
                continue
            for f in files:
                if f.name.endswith(".sh"):
                    done = subprocess.run(["bash", "-n"], input=f.text, text=True, capture_output=True)
                    assert done.returncode == 0, (f.name, done.stderr)
                elif f.name.endswith(".py"):
                    compile(f.text, f.name, "exec")
                elif f.name.endswith(".json"):
                    json.loads(f.text)
                else:
                    tomllib.loads(f.text)


def test_torchrun_export_runs_the_executor(tmp_path):
    """`bash torchrun.sh plan.json` starts the plan's world under torchrun and the executor checks the layout."""
    pytest.importorskip("torch")
    import os
    import subprocess
    import sys

    plan = make_plan("llama3.1-8b", "h100-sxm", 2, Workload(global_batch=4, seq_len=1024), ParallelConfig(tp=2))
    write_plan(plan, tmp_path / "plan.json")
    write_export(export_plan(plan, "torchrun"), tmp_path / "torchrun.sh")
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(repo), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", "torchrun.sh", "plan.json", "--steps", "1"], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "OK: the layout computes the same training step" in done.stdout


# ---- uneven virtual stages (issue 16): the published DeepSeek-V3 layout, round trip ------------------------------

def test_deepseek_v3_published_layout_round_trips():
    """61 layers on pp 16 x vpp 2 as DeepSeek-V3's Megatron recipes place them: one layer with the embedding, two
    per virtual stage after it, the last virtual stage holding only the MTP module and the loss."""
    from meshplan.costmodels.config import ParallelConfig
    from meshplan.planner.launchers.megatron import parse_layout, pipeline_layout
    from meshplan.planner.space import interleaved_chunks

    options = interleaved_chunks(61, 16, 2)
    assert options[0] == (1,) + (2,) * 30 + (0,)
    assert pipeline_layout(list(options[0]), 16, 1) == "Et|(tt|)*30mL"
    chunks, mtp, e_first, l_last = parse_layout("Et|(tt|)*30mL", 16)
    assert tuple(chunks) == options[0] and mtp == 1 and e_first and l_last
    plan = make_plan("deepseek-v3", "h800", 2048, Workload(global_batch=4096, seq_len=4096),
                     ParallelConfig(tp=1, pp=16, vpp=2, ep=64, mbs=1, zero=1, chunk_layers=options[0]))
    lay = resolve(plan.inputs.model_spec(), 2048, plan.inputs.workload, plan_config(plan)[3])
    assert lay.stage_layers == (3,) + (4,) * 14 + (2,) and not lay.chunks_even
    args = megatron_args(plan)
    assert flags(args)["--pipeline-model-parallel-layout"] == "Et|(tt|)*30mL"
    back = parse_megatron_args(args)
    assert back.config.chunk_layers == options[0]


@pytest.mark.parametrize("runtime,method", [("torchtitan", "allgather"), ("torchtitan+cp-alltoall", "alltoall"),
                                            ("megatron-core", "alltoall")])
def test_torchtitan_exports_the_kv_rotation_the_plan_was_priced_with(runtime, method):
    """torch context_parallel's rotate method follows the plan's runtime (Runtime.cp_rotate): the torchtitan preset
    prices torch's default all-gather, +cp-alltoall the per-step rotation (a ring plan from another runtime too)."""
    plan = make_plan("llama3.1-8b", "h100-sxm", 16, WL, ParallelConfig(tp=2, cp=4, zero=3), runtime=runtime)
    assert tomllib.loads(toml_text(plan))["parallelism"]["context_parallel_rotate_method"] == method


@pytest.mark.parametrize("pp,reshard,zero", [(1, "default", 3), (2, "default", 2), (2, "always", 3),
                                             (1, "never", 2)])
def test_torchtitan_import_reads_the_default_reshard_policy_by_pp(pp, reshard, zero):
    """torchtitan's "default" reshard policy reshards after forward only without PP (parallelize.py apply_fsdp:
    reshard_after_forward = not pp_enabled): under PP it keeps the weights whole, meshplan's ZeRO-2."""
    first = ", ".join(f'"layers.{i}"' for i in range(16))
    second = ", ".join(f'"layers.{i}"' for i in range(16, 32))
    stages = (f'module_fqns_per_model_part = [["tok_embeddings", {first}], [{second}, "norm", "output"]]\n'
              if pp > 1 else "")
    text = ('[model]\nname = "llama3"\nflavor = "8B"\n[training]\nlocal_batch_size = 2\nseq_len = 8192\n'
            f'[parallelism]\ndata_parallel_shard_degree = 4\npipeline_parallel_degree = {pp}\n'
            f'fsdp_reshard_after_forward = "{reshard}"\n' + stages)
    launch, _ = parse_torchtitan_toml(text)
    assert launch.config.zero == zero


@pytest.mark.parametrize("runtime", ["torchtitan", "torchtitan+compile", "torchtitan+compile+async-tp",
                                     "torchtitan+cp-alltoall", "torchtitan+compile+async-tp+cp-alltoall"])
def test_torchtitan_round_trip_keeps_the_runtime_the_plan_was_priced_with(runtime):
    """The TOML export writes the runtime's torchtitan switches (training.compile, enable_async_tensor_parallel,
    context_parallel_rotate_method; async TP compiles) and the import reads them back into the same runtime, so
    `import` prices the config as `plan` did."""
    plan = make_plan("llama3.1-8b", "h100-sxm", 16, WL, ParallelConfig(tp=2, cp=4, zero=3), runtime=runtime)
    launch, _ = parse_torchtitan_toml(toml_text(plan))
    expected = runtime.replace("torchtitan+async-tp", "torchtitan+compile+async-tp")
    assert launch.runtime == expected


@pytest.mark.parametrize("section,dtype,recipe", [
    ('[model]\nconverters = ["float8"]\n', "fp8", "tensorwise"),
    ('[model]\nconverters = ["float8"]\n[float8]\nrecipe_name = "rowwise"\n', "fp8", "rowwise"),
    ('[float8]\nenable_float8_linear = true\n', "fp8", "tensorwise"),  # torchtitan of Dec 2024
    ("", "bf16", "tensorwise")])
def test_torchtitan_import_reads_float8_training(section, dtype, recipe):
    """model.converters = ["float8"] (or the 2024 float8.enable_float8_linear) is FP8 training with torchao's
    recipe (float8.recipe_name; unset = tensorwise); a recipe meshplan does not model is refused with its name."""
    base = '[training]\nlocal_batch_size = 2\nseq_len = 8192\n[parallelism]\ndata_parallel_shard_degree = 8\n'
    head = '[model]\nname = "llama3"\nflavor = "8B"\n'
    text = (head + section.removeprefix("[model]\n") if section.startswith("[model]") else head + section) + base
    launch, _ = parse_torchtitan_toml(text)
    assert (launch.workload.dtype, launch.workload.fp8_recipe) == (dtype, recipe)
    bad = head + 'converters = ["float8"]\n[float8]\nrecipe_name = "rowwise_with_gw_hp"\n' + base
    with pytest.raises(InputError, match="rowwise_with_gw_hp"):
        parse_torchtitan_toml(bad)


@pytest.mark.parametrize("extra,words", [
    ('[model]\nconverters = ["float8"]\n[float8]\nrecipe_name = "rowwise_with_gw_hp"\n', ("rowwise_with_gw_hp",)),
    ('[experimental]\ncontext_parallel_rotate_method = "ring"\n', ("context_parallel_rotate_method", "ring"))])
def test_torchtitan_import_refuses_what_it_does_not_model_in_one_line(tmp_path, capsys, extra, words):
    """A float8 recipe or a CP rotate method meshplan does not model: one error line naming it, exit 2."""
    head = '[model]\nname = "llama3"\nflavor = "8B"\n'
    body = '[training]\nlocal_batch_size = 2\nseq_len = 8192\n[parallelism]\ndata_parallel_shard_degree = 8\n'
    text = head + extra.removeprefix("[model]\n") + body if extra.startswith("[model]") else head + body + extra
    path = tmp_path / "job.toml"
    path.write_text(text)
    assert_input_error(*run(capsys, "import", str(path), "--from", "torchtitan", "--gpu", "h100-sxm"), *words)
