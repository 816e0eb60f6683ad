"""vLLM: a serving plan as `vllm serve` command lines, one per pool, and back.

Flags of vLLM's engine arguments (vllm/engine/arg_utils.py): --tensor-parallel-size, --pipeline-parallel-size,
--data-parallel-size (attention DP of an MoE model; a dense model's DP is replicas), --enable-expert-parallel
(experts over every tp x dp rank: vLLM has no EP size of its own), --max-num-seqs, --max-num-batched-tokens (the
chunked-prefill budget), --gpu-memory-utilization, --kv-cache-dtype, --quantization; disaggregated pools exchange
KV through --kv-transfer-config with the NIXL connector (vLLM docs, "Disaggregated prefilling").
"""

from __future__ import annotations

import argparse
import shlex

from meshplan.planner.launchers.common import (Exported, ExportedFile, engine_nodes, full_ep_only, refuse,
                                               serving_script, shell_lines)
from meshplan.costmodels.serving import redundant_experts
from meshplan.planner.plan import ServingEngine, ServingPlan

__all__ = ["TARGET", "vllm_args", "export_vllm", "parse_vllm_command"]

TARGET = "vllm"
KV_TRANSFER = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'


def vllm_args(plan: ServingPlan, engine: ServingEngine) -> list[str]:
    model = plan.inputs.model_spec()
    wl = plan.inputs.workload
    full_ep_only(TARGET, engine)  # --enable-expert-parallel: EP over all tp x dp ranks, no size of its own
    if model.moe is not None and redundant_experts(model.moe.num_experts, engine.ep):
        raise refuse(TARGET, f"EP {engine.ep} over {model.moe.num_experts} experts needs redundant experts "
                     "(vLLM's EPLB settings), which this export does not write", "use --to sglang")
    args = ["vllm", "serve", "${MODEL}", "--tensor-parallel-size", str(engine.tp)]
    if engine.pp > 1:
        args += ["--pipeline-parallel-size", str(engine.pp)]
    if engine.dp > 1:
        args += ["--data-parallel-size", str(engine.dp)]
    if engine.ep > 1:
        args.append("--enable-expert-parallel")
    args += ["--max-num-seqs", str(engine.max_num_seqs), "--max-num-batched-tokens",
             str(engine.max_num_batched_tokens), "--gpu-memory-utilization", f"{engine.gpu_memory_utilization:g}"]
    if wl.kv_dtype == "fp8":
        args += ["--kv-cache-dtype", "fp8"]
    if wl.weight_dtype == "fp8":
        args += ["--quantization", "fp8"]
    if engine.role != "aggregated":
        args += ["--kv-transfer-config", KV_TRANSFER]
    return args


def _multinode_note(engine: ServingEngine, per_node: int) -> str:
    nodes, local = engine_nodes(engine.gpus_per_engine, per_node)
    if nodes == 1:
        return f"# one engine: {engine.gpus_per_engine} GPUs of one node"
    if engine.dp > 1 and engine.tp * engine.pp <= per_node:
        per = local // (engine.tp * engine.pp)
        return (f"# one engine spans {nodes} nodes: on the first add --data-parallel-size-local {per} "
                f"--data-parallel-address $HEAD --data-parallel-rpc-port 13345; on node k add --headless "
                f"--data-parallel-start-rank k*{per} (vLLM docs, data-parallel deployment)")
    return (f"# one engine spans {nodes} nodes: start a Ray cluster over them and add --distributed-executor-backend "
            f"ray (vLLM docs, multi-node serving)")


def export_vllm(plan: ServingPlan) -> Exported:
    per_node = plan.inputs.cluster.gpus_per_node
    text = serving_script(plan, "vLLM", lambda e: [_multinode_note(e, per_node), shell_lines(vllm_args(plan, e))],
                          "# Put a proxy that sends each request to a prefill engine, then to a decode engine, in "
                          "front (vLLM examples: disaggregated_serving).")
    return Exported(TARGET, (ExportedFile("vllm.sh", text),))


def parse_vllm_command(command: str) -> dict[str, object]:
    """The engine settings of one `vllm serve` command line (for reading an export back)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size", "--max-num-seqs",
                 "--max-num-batched-tokens"):
        p.add_argument(flag, type=int)
    p.add_argument("--gpu-memory-utilization", type=float)
    p.add_argument("--kv-cache-dtype")
    p.add_argument("--quantization")
    p.add_argument("--kv-transfer-config")
    p.add_argument("--enable-expert-parallel", action="store_true")
    a, _ = p.parse_known_args(shlex.split(command.replace("\\\n", " ")))
    return {"tp": a.tensor_parallel_size or 1, "pp": a.pipeline_parallel_size or 1, "dp": a.data_parallel_size or 1,
            "expert_parallel": a.enable_expert_parallel, "max_num_seqs": a.max_num_seqs,
            "max_num_batched_tokens": a.max_num_batched_tokens, "gpu_memory_utilization": a.gpu_memory_utilization,
            "kv_cache_dtype": a.kv_cache_dtype, "disaggregated": a.kv_transfer_config is not None}
