"""SGLang: a serving plan as scripts that start it (planner/launchers/serving_launch.py: one per node and a
router), and its `python -m sglang.launch_server` command lines read back.

Flags of SGLang's server arguments (python/sglang/srt/server_args.py): --tp-size is every GPU of a stage (attention
TP x attention DP), --dp-size with --enable-dp-attention splits attention into DP groups, --pp-size, --ep-size (and
--ep-num-redundant-experts where EP does not divide the experts), --max-running-requests, --chunked-prefill-size,
--mem-fraction-static, --kv-cache-dtype, --quantization, --context-length, --disaggregation-mode prefill|decode
with --disaggregation-bootstrap-port, and --nnodes, --node-rank, --dist-init-addr for an engine over several nodes.
"""

from __future__ import annotations

import argparse
import shlex

from meshplan.costmodels.serving import redundant_experts
from meshplan.planner.launchers.common import Exported, full_ep_only
from meshplan.planner.launchers.dynamo import dynamo_graph
from meshplan.planner.launchers.serving_launch import (Placement, engine_url, launch_files, max_model_len,
                                                       router_argv)
from meshplan.planner.plan import ServingEngine, ServingPlan

__all__ = ["TARGET", "sglang_args", "export_sglang", "parse_sglang_command"]

TARGET = "sglang"


def sglang_args(plan: ServingPlan, engine: ServingEngine) -> list[str]:
    model = plan.inputs.model_spec()
    wl = plan.inputs.workload
    full_ep_only(TARGET, engine)
    ranks = engine.tp * engine.dp
    args = ["python", "-m", "sglang.launch_server", "--model-path", "${MODEL}", "--tp-size", str(ranks)]
    if engine.dp > 1:
        args += ["--dp-size", str(engine.dp), "--enable-dp-attention"]
    if engine.pp > 1:
        args += ["--pp-size", str(engine.pp)]
    if engine.ep > 1:
        args += ["--ep-size", str(engine.ep)]
        spare = redundant_experts(model.moe.num_experts, engine.ep) if model.moe is not None else 0
        if spare:
            args += ["--ep-num-redundant-experts", str(spare)]
    args += ["--max-running-requests", str(engine.max_num_seqs), "--chunked-prefill-size",
             str(engine.max_num_batched_tokens), "--mem-fraction-static", f"{engine.gpu_memory_utilization:g}"]
    if wl.kv_dtype == "fp8":
        args += ["--kv-cache-dtype", "fp8_e4m3"]
    if wl.weight_dtype == "fp8":
        args += ["--quantization", "fp8"]
    elif wl.weight_dtype == "fp4":  # an NVFP4 checkpoint quantised by NVIDIA Model Optimizer (e.g. nvidia/*-FP4)
        args += ["--quantization", "modelopt_fp4"]
    if wl.two_batch_overlap and engine.ep > 1 and engine.dp > 1:
        # SGLang's TBO runs over DeepEP's all-to-all: its normal kernels for prefill, low-latency ones for decode,
        # chosen per batch when one engine does both (LMSYS large-scale EP post, "Expert Parallelism with DeepEP")
        mode = {"prefill": "normal", "decode": "low_latency"}.get(engine.role, "auto")
        args += ["--enable-two-batch-overlap", "--moe-a2a-backend", "deepep", "--deepep-mode", mode]
    if engine.role != "aggregated":
        args += ["--disaggregation-mode", engine.role]
    if wl.spec_tokens and engine.role != "prefill":
        # SGLang's EAGLE path runs DeepSeek's MTP (NextN) from the checkpoint, else a draft model of the user's:
        # a chain of k drafts (top-k 1), k + 1 tokens verified
        args += ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", str(wl.spec_tokens),
                 "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(wl.spec_tokens + 1)]
        if not model.num_mtp_layers:
            args += ["--speculative-draft-model-path", "${DRAFT_MODEL}"]
    return args


def _instance_args(plan: ServingPlan, p: Placement, rank: int, nodes: int) -> list[str]:
    """One engine's launch_server on one of its nodes: its port, --context-length, a bootstrap port of its own for
    a prefill engine (the router's second --prefill value), and across nodes --nnodes / --node-rank /
    --dist-init-addr on every node (SGLang docs, "Multi-Node Deployment")."""
    e = p.engine
    args = sglang_args(plan, e) + ["--host", "0.0.0.0", "--port", str(p.port), "--context-length",
                                   str(max_model_len(plan, e))]
    if e.role == "prefill":
        args += ["--disaggregation-bootstrap-port", str(_bootstrap_port(p))]
    if nodes > 1:
        args += ["--nnodes", str(nodes), "--node-rank", str(rank), "--dist-init-addr",
                 f"${{HOSTS[{p.nodes[0]}]}}:{5000 + p.index}"]
    return args


def _bootstrap_port(p: Placement) -> int:
    return 8998 + p.index  # SGLang's default bootstrap port is 8998; one per prefill engine of a node


def _router(plan: ServingPlan) -> list[str]:
    """SGLang's router (sglang-router: python -m sglang_router.launch_router): --worker-urls, or each request to a
    prefill engine (with its bootstrap port) and a decode engine (--pd-disaggregation)."""
    return router_argv(plan, ["python", "-m", "sglang_router.launch_router"], "--pd-disaggregation",
                       lambda p: [engine_url(p), str(_bootstrap_port(p))])


def export_sglang(plan: ServingPlan) -> Exported:
    for e in plan.engines:
        sglang_args(plan, e)  # the refusals, before any file
    files = launch_files(plan, "SGLang", lambda p, rank, nodes: _instance_args(plan, p, rank, nodes), _router(plan),
                         head=3)
    # Dynamo's SGLang worker takes SGLang's server arguments (after `python -m sglang.launch_server`)
    def worker(e: ServingEngine) -> list[str]:
        return sglang_args(plan, e)[3:] + ["--context-length", str(max_model_len(plan, e))]

    return Exported(TARGET, files + (dynamo_graph(plan, TARGET, worker),))


def parse_sglang_command(command: str) -> dict[str, object]:
    """The engine settings of one launch_server command line (for reading an export back)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--tp-size", "--dp-size", "--pp-size", "--ep-size", "--ep-num-redundant-experts",
                 "--max-running-requests", "--chunked-prefill-size", "--nnodes"):
        p.add_argument(flag, type=int)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--kv-cache-dtype")
    p.add_argument("--quantization")
    p.add_argument("--disaggregation-mode")
    p.add_argument("--enable-dp-attention", action="store_true")
    a, _ = p.parse_known_args(shlex.split(command.replace("\\\n", " ")))
    dp = a.dp_size or 1
    return {"tp": (a.tp_size or 1) // dp, "dp": dp, "pp": a.pp_size or 1, "ep": a.ep_size or 1,
            "dp_attention": a.enable_dp_attention, "max_num_seqs": a.max_running_requests,
            "max_num_batched_tokens": a.chunked_prefill_size, "gpu_memory_utilization": a.mem_fraction_static,
            "role": a.disaggregation_mode or "aggregated", "nnodes": a.nnodes or 1, "quantization": a.quantization}
