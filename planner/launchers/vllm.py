"""vLLM: a serving plan as scripts that start it (planner/launchers/serving_launch.py: one per node and a router),
and its `vllm serve` command lines read back.

Flags of vLLM's engine arguments (vllm/engine/arg_utils.py): --tensor-parallel-size, --pipeline-parallel-size,
--data-parallel-size (attention DP of an MoE model; a dense model's DP is replicas), --enable-expert-parallel
(experts over every tp x dp rank: vLLM has no EP size of its own), --max-num-seqs, --max-num-batched-tokens (the
chunked-prefill budget), --gpu-memory-utilization, --kv-cache-dtype, --quantization; disaggregated pools exchange
KV through --kv-transfer-config with the NIXL connector (vLLM docs, "Disaggregated prefilling").
"""

from __future__ import annotations

import argparse
import shlex

from meshplan.costmodels.serving import redundant_experts
from meshplan.planner.launchers.common import Exported, full_ep_only, refuse
from meshplan.planner.launchers.dynamo import dynamo_graph
from meshplan.planner.launchers.serving_launch import (Placement, engine_url, launch_files, max_model_len,
                                                       router_argv)
from meshplan.planner.plan import ServingEngine, ServingPlan

__all__ = ["TARGET", "vllm_args", "export_vllm", "parse_vllm_command"]

TARGET = "vllm"
KV_TRANSFER = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
# the NIXL handshake's port (VLLM_NIXL_SIDE_CHANNEL_PORT, default 5600, vLLM's NixlConnector usage guide): an engine
# listens on it plus data_parallel_rank x tensor_parallel_size (vLLM's nixl_connector.py; data_parallel_index in later
# releases), an offset below its GPU count, so engines sharing a node need bases apart
NIXL_SIDE_CHANNEL_BASE = 5600


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
    elif wl.weight_dtype == "fp4":  # an NVFP4 checkpoint quantised by NVIDIA Model Optimizer (e.g. nvidia/*-FP4)
        args += ["--quantization", "modelopt_fp4"]
    if wl.two_batch_overlap and engine.ep > 1 and engine.dp > 1:
        # vLLM's dual batch overlap needs DP + EP and DeepEP's all-to-all (vLLM docs, design/dbo.md): low-latency
        # kernels for decode, high-throughput ones for prefill
        kernels = "deepep_high_throughput" if engine.role == "prefill" else "deepep_low_latency"
        args += ["--enable-dbo", "--all2all-backend", kernels]
    if engine.role != "aggregated":
        args += ["--kv-transfer-config", KV_TRANSFER]
    if wl.spec_tokens and engine.role != "prefill":
        # vLLM's SpeculativeConfig: DeepSeek's MTP module in the checkpoint, else an EAGLE draft model of the user's
        draft = ('"method":"deepseek_mtp"' if model.num_mtp_layers else '"method":"eagle","model":"${DRAFT_MODEL}"')
        args += ["--speculative-config", "{" + draft + f',"num_speculative_tokens":{wl.spec_tokens}' + "}"]
    return args


def _instance_args(plan: ServingPlan, p: Placement, rank: int, nodes: int) -> list[str]:
    """One engine's `vllm serve` on one of its nodes: its port and --max-model-len; across nodes attention DP
    ranks spread by --data-parallel-size-local, the head taking requests and the others --headless (vLLM docs,
    "Data Parallel Deployment"), else one Ray cluster whose head runs the engine (vLLM docs, "Multi-Node
    Serving")."""
    e = p.engine
    per_node = plan.inputs.cluster.gpus_per_node
    args = vllm_args(plan, e) + ["--host", "0.0.0.0", "--port", str(p.port), "--max-model-len",
                                 str(max_model_len(plan, e))]
    if nodes == 1:
        return args
    if e.dp > 1 and e.tp * e.pp <= per_node:
        local = per_node // (e.tp * e.pp)
        args += ["--data-parallel-size-local", str(local), "--data-parallel-address", f"${{HOSTS[{p.nodes[0]}]}}",
                 "--data-parallel-rpc-port", str(13345 + p.index)]
        return args + (["--headless", "--data-parallel-start-rank", str(rank * local)] if rank else [])
    return args + ["--distributed-executor-backend", "ray"] if rank == 0 else []


def _ray_setup(plan: ServingPlan, p: Placement, rank: int) -> list[str]:
    """A multi-node engine without attention DP across nodes: its nodes join one Ray cluster first."""
    e = p.engine
    per_node = plan.inputs.cluster.gpus_per_node
    if len(p.nodes) == 1 or (e.dp > 1 and e.tp * e.pp <= per_node):
        return []
    port = 6379 + p.index
    if rank:
        return [f'ray start --address="${{HOSTS[{p.nodes[0]}]}}:{port}" --block > "$LOG_DIR/{p.name}-ray.log" 2>&1 &']
    gpus = e.gpus_per_engine
    return [f"ray start --head --port={port}",
            f"until python3 -c \"import ray, sys; ray.init(address='127.0.0.1:{port}'); "
            f"sys.exit(ray.cluster_resources().get('GPU', 0) < {gpus})\" 2>/dev/null; do sleep 5; done"]


def _nixl_env(p: Placement) -> list[str]:
    """A disaggregated engine's NIXL side-channel port: the base plus its first GPU on its node, so the engines of
    one node, on disjoint GPU slices, take disjoint port ranges (an engine's workers add at most its GPUs on the
    node); an engine of whole nodes starts at the base."""
    if p.engine.role == "aggregated":
        return []
    return [f"VLLM_NIXL_SIDE_CHANNEL_PORT={NIXL_SIDE_CHANNEL_BASE + p.gpus[0]}"]


def _router(plan: ServingPlan) -> list[str]:
    """vllm-router (github.com/vllm-project/router, `pip install vllm-router`): round robin over the engines, or
    each request to a prefill engine, then a decode engine (--vllm-pd-disaggregation)."""
    return router_argv(plan, ["vllm-router", "--policy", "round_robin"], "--vllm-pd-disaggregation",
                       lambda p: [engine_url(p)])


def export_vllm(plan: ServingPlan) -> Exported:
    for e in plan.engines:
        vllm_args(plan, e)  # the refusals, before any file
    files = launch_files(plan, "vLLM", lambda p, rank, nodes: _instance_args(plan, p, rank, nodes), _router(plan),
                         lambda p, rank: _ray_setup(plan, p, rank), env=_nixl_env)
    # Dynamo's vLLM worker takes vLLM's engine arguments, the model as --model
    def worker(e: ServingEngine) -> list[str]:
        return ["--model", "${MODEL}"] + vllm_args(plan, e)[3:] + ["--max-model-len", str(max_model_len(plan, e))]

    return Exported(TARGET, files + (dynamo_graph(plan, TARGET, worker),))


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
            "kv_cache_dtype": a.kv_cache_dtype, "quantization": a.quantization,
            "disaggregated": a.kv_transfer_config is not None}
