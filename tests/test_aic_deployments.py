"""AIConfigurator's measured deployments (costmodels/aic_deployments.py, issue 45): the reader takes both row formats
(aggregated, and disaggregated with two pools) without the extra; a row it cannot read, a model meshplan cannot
express and a layout it refuses are each kept with the reason, never dropped; where the extra is installed, the
wheel's own file is read and its rows priced."""

from __future__ import annotations

import math

import pytest

from meshplan.costmodels import aic_deployments as aic
from meshplan.costmodels import kernel_tables
from meshplan.costmodels.serving import EngineLayout, aggregated_state
from meshplan.costmodels.serving_sim import group_view, simulate_benchmark
from meshplan.hardware_db.errors import InputError

HEADER = ("id,silicon_data_source,backend,backend_version,model_path,system,precision,mode,isl,osl,gemm_quant_mode,"
          "moe_quant_mode,batch_size,tp_size,pp_size,attention_dp_size,moe_tp_size,moe_ep_size,prefill_batch_size,"
          "prefill_num_workers,prefill_tp_size,prefill_pp_size,prefill_attention_dp_size,prefill_moe_tp_size,"
          "prefill_moe_ep_size,decode_batch_size,decode_num_workers,decode_tp_size,decode_pp_size,"
          "decode_attention_dp_size,decode_moe_tp_size,decode_moe_ep_size,silicon_ttft_ms,silicon_tpot_ms")
AGG = ("dsr1_agg,src; silicon_concurrency=64; x,trtllm,1.0,deepseek-ai/DeepSeek-R1,h200_sxm,fp8,agg,1024,1024,fp8,"
       "fp8,64,8,1,1,1,8,,,,,,,,,,,,,,,250.5,12.25")
DENSE = ("llama_agg,src; silicon_concurrency=4,vllm,0.12.0,meta-llama/Llama-3.1-8B-Instruct,h100_sxm,,agg,1024,128,,,"
         "4,1,1,,1,1,,,,,,,,,,,,,,,40.0,7.5")
DISAGG = ("dsr1_disagg,src; silicon_concurrency=192,trtllm,1.1,deepseek-ai/DeepSeek-R1,gb200,fp4,disagg,1024,1024,"
          "nvfp4,nvfp4,,,,,,,1,2,1,1,4,1,4,48,4,8,1,1,1,8,395.3,11.7")
INCOMPLETE = ("glm_disagg,src; silicon_concurrency=5,trtllm,,zhipuai/GLM-5,gb200,fp4,disagg,8192,1024,nvfp4,nvfp4,,,"
              ",,,,,,4,1,1,4,1,,,4,1,1,4,1,964.8,11.8")
NO_USERS = ("no_users,src without it,vllm,0.12.0,Qwen/Qwen3-32B,h100_sxm,,agg,1024,1024,,,4,1,1,1,1,1,,,,,,,,,,,,,,,"
            "50,8")
ZERO = ("zero_dp,src; silicon_concurrency=8,sglang,0.5,deepseek-ai/DeepSeek-V3,b200_sxm,fp8,agg,1024,1024,fp8,fp8,8,"
        "8,1,0,8,1,,,,,,,,,,,,,,,100,9")


def table(*rows: str) -> str:
    return "\n".join((HEADER, *rows)) + "\n"


def test_both_row_formats_are_read():
    got = aic.read_deployments(table(AGG, DENSE, DISAGG, INCOMPLETE))
    assert not got.unread
    agg, dense, disagg, incomplete = got.deployments
    assert agg.mode == "aggregated" and agg.prefill is None and agg.gpu == "h200"
    assert agg.pool.layout == EngineLayout(tp=8, dp=1, pp=1, ep=8) and agg.users == 64 and agg.gpus == 8
    assert (agg.ttft_ms, agg.tpot_ms, agg.isl, agg.osl, agg.engine) == (250.5, 12.25, 1024, 1024, "trtllm")
    # AIConfigurator leaves attention DP empty on dense rows: one attention group
    assert dense.pool.layout == EngineLayout(tp=1) and dense.precision == "" and dense.gpu == "h100-sxm"
    assert disagg.mode == "disaggregated" and disagg.users == 192
    assert disagg.prefill is not None and disagg.prefill.layout == EngineLayout(tp=1, dp=4, pp=1, ep=4)
    assert (disagg.prefill.workers, disagg.prefill.batch) == (2, 1)
    assert disagg.pool.layout == EngineLayout(tp=8, dp=1, pp=1, ep=8) and (disagg.pool.workers,
                                                                             disagg.pool.batch) == (4, 48)
    assert disagg.gpus == 2 * 4 + 4 * 8
    # a disaggregated row without its worker counts is read, and has no GPU count or throughput
    assert incomplete.pool.workers is None and incomplete.gpus is None and incomplete.tokens_per_s_per_gpu is None


def test_little_law_throughput():
    agg = aic.read_deployments(table(AGG)).deployments[0]
    # 64 users, each request 0.2505 + 1023 x 0.01225 s, on 8 GPUs
    assert agg.tokens_per_s_per_gpu == pytest.approx(64 * 1024 / (0.2505 + 1023 * 0.01225) / 8)


def test_an_unreadable_row_is_kept_with_its_reason():
    got = aic.read_deployments(table(AGG, NO_USERS, ZERO))
    assert [d.id for d in got.deployments] == ["dsr1_agg"]
    reasons = {u.id: u.why for u in got.unread}
    assert "silicon_concurrency" in reasons["no_users"]
    assert "attention_dp_size is 0" in reasons["zero_dp"]


def test_a_copied_row_counts_once_and_a_remeasured_one_is_a_repeat():
    """A row equal to an earlier one in all but its id and source is one run listed twice: kept as unread, naming the
    row it copies. A row of the same deployment with other figures (another engine version) is read, and the two
    are a Repeat whose spread is larger / smaller - 1 of each figure."""
    copy = AGG.replace("dsr1_agg,src;", "dsr1_copy,other source;")
    rerun = AGG.replace("dsr1_agg", "dsr1_rerun").replace(",trtllm,1.0,", ",trtllm,1.1,").replace(
        ",250.5,12.25", ",300.6,9.8")
    got = aic.read_deployments(table(AGG, DENSE, copy, rerun))
    assert [d.id for d in got.deployments] == ["dsr1_agg", "llama_agg", "dsr1_rerun"]
    assert [(u.id, u.why.split(" (")[0]) for u in got.unread] == [("dsr1_copy", f"{aic.COPY} dsr1_agg")]
    pairs = aic.repeats(got.deployments)
    assert [(p.first.id, p.second.id) for p in pairs] == [("dsr1_agg", "dsr1_rerun")]
    assert not pairs[0].same_version
    assert pairs[0].spread("ttft") == pytest.approx(300.6 / 250.5 - 1)
    assert pairs[0].spread("tpot") == pytest.approx(12.25 / 9.8 - 1)
    # the same deployment at other users is another deployment
    assert aic.repeats(aic.read_deployments(table(AGG, AGG.replace("dsr1_agg", "more").replace(
        "silicon_concurrency=64", "silicon_concurrency=128"))).deployments) == []


def test_the_token_budget_is_the_benchmark_rules():
    """Each attention-DP rank's batch + ISL + 1,500 tokens per iteration (AIConfigurator's benchmark rules),
    TensorRT-LLM's rounded up to 32-token blocks; the engine's is its ranks' sum."""
    agg, dense = aic.read_deployments(table(AGG, DENSE)).deployments
    assert aic.token_budget(agg) == 2592  # TensorRT-LLM: 64 + 1,024 + 1,500 = 2,588, up to 81 blocks of 32
    assert aic.token_budget(dense) == 4 + 1024 + 1500  # vLLM: not rounded
    wide = aic.read_deployments(table(AGG.replace(",64,8,1,1,1,8,", ",8,1,1,8,1,8,"))).deployments[0]
    assert aic.token_budget(wide) == 8 * 2560  # 8 ranks of 8 + 1,024 + 1,500 = 2,532, up to 80 blocks
    no_batch = aic.read_deployments(table(DENSE.replace(",,agg,1024,128,,,4,", ",,agg,1024,128,,,,"))).deployments[0]
    assert no_batch.pool.batch is None and aic.token_budget(no_batch) == 4 + 1024 + 1500  # the users per rank


def test_workload_dtypes():
    agg, dense = aic.read_deployments(table(AGG, DENSE)).deployments
    assert (aic.deployment_workload(agg).weight_dtype, aic.deployment_workload(agg).kv_dtype) == ("fp8", "fp8")
    assert (aic.deployment_workload(dense).weight_dtype, aic.deployment_workload(dense).kv_dtype) == ("bf16", "bf16")
    int4 = aic.read_deployments(table(AGG.replace(",fp8,agg,", ",int4,agg,"))).deployments[0]
    with pytest.raises(InputError, match="int4 weights"):
        aic.deployment_workload(int4)


def test_without_the_extra_the_file_is_one_line(monkeypatch):
    monkeypatch.setattr(kernel_tables, "PACKAGE", "meshplan_no_such_package")
    with pytest.raises(InputError, match=r"meshplan\[aic\]"):
        aic.read_deployments()


# ---- with the extra ----------------------------------------------------------------------------------------------

def test_priced_refused_and_unexpressible_rows_are_all_kept():
    pytest.importorskip("aiconfigurator_core")
    # DeepSeek-R1's 128 heads over TP 48
    refused = AGG.replace("dsr1_agg", "tp_refused").replace(",64,8,1,1,1,8,", ",64,48,1,1,48,1,")
    alien = AGG.replace("dsr1_agg", "alien").replace("deepseek-ai/DeepSeek-R1", "openai/gpt-oss-120b")
    rows = aic.read_deployments(table(AGG, DENSE, refused, alien, INCOMPLETE)).deployments
    outcomes = {o.deployment.id: o for o in aic.price_all(rows)}
    assert set(outcomes) == {"dsr1_agg", "llama_agg", "tp_refused", "alien", "glm_disagg"}
    for key in ("dsr1_agg", "llama_agg"):
        p = outcomes[key].priced
        assert p is not None and p.ttft_ms > 0 and p.tpot_ms > 0 and p.tokens_per_s_per_gpu is not None
        assert math.isfinite(p.tokens_per_s_per_gpu)
    assert outcomes["tp_refused"].priced is None and "does not divide the 128 attention heads" in outcomes[
        "tp_refused"].why
    assert outcomes["alien"].priced is None and "gpt_oss" in outcomes["alien"].why
    assert outcomes["glm_disagg"].priced is None
    assert "gpt_oss" in aic.models_named(rows)["openai/gpt-oss-120b"]
    assert aic.models_named(rows)["deepseek-ai/DeepSeek-R1"] == ""


def test_the_wheels_file_is_read():
    pytest.importorskip("aiconfigurator_core")
    got = aic.read_deployments()
    assert got.source.startswith("aiconfigurator-core ") and "sha256:" in got.source
    assert len(got.deployments) > 1000
    assert {d.mode for d in got.deployments} == {"aggregated", "disaggregated"}
    assert {d.engine for d in got.deployments} == {"vllm", "sglang", "trtllm"}
    assert all(u.why for u in got.unread)


def test_aggregated_engines_are_run_from_idle():
    """An aggregated engine is priced as its client ran it, from idle (the first wave's cohorts: 64 prompts of 1,024
    tokens through a budget of 2,592 wait for each other), above the steady state's TTFT; an attention-DP engine as
    one of its groups, with its share of the users and of the budget and the engine's iterations."""
    pytest.importorskip("aiconfigurator_core")
    agg = aic.read_deployments(table(AGG)).deployments[0]
    assert agg.pool.layout.dp == 1
    from_idle, steady = aic.price(agg), aic.price(agg, from_idle=False)
    assert from_idle.ttft_ms > 2 * steady.ttft_ms
    wide = aic.read_deployments(table(AGG.replace(",64,8,1,1,1,8,", ",8,1,1,8,1,8,"))).deployments[0]
    assert wide.pool.layout == EngineLayout(tp=1, dp=8, ep=8)
    model, wl = aic.deployment_model(wide.model_path), aic.deployment_workload(wide)
    budget = aic.token_budget(wide)
    curve = [s for b in aic.curve_batches(8) for s in [aggregated_state(model, aic.cluster_of("h200", 8),
                                                                        wide.pool.layout, wl, 8 * b, budget)]]
    groups = group_view(curve)
    assert [(g.batch, g.chunk, g.step_s, g.layout.dp) for g in groups] == [(s.batch // 8, s.chunk // 8, s.step_s, 1)
                                                                          for s in curve]
    run = simulate_benchmark(groups, wl, 8, aic.ROUNDS)
    assert aic.price(wide) == aic.Priced(run.ttft(None) * 1e3, run.tpot(None) * 1e3,
                                         aic.little_throughput(64, 1024, run.ttft(None), run.tpot(None), 8))
    assert aic.price(wide) != aic.price(wide, from_idle=False)
