"""SGLang: a serving plan as `python -m sglang.launch_server` command lines, one per pool, and back.

Flags of SGLang's server arguments (python/sglang/srt/server_args.py): --tp-size is every GPU of a stage (attention
TP x attention DP), --dp-size with --enable-dp-attention splits attention into DP groups, --pp-size, --ep-size (and
--ep-num-redundant-experts beyond the experts), --max-running-requests, --chunked-prefill-size,
--mem-fraction-static, --kv-cache-dtype, --quantization, --disaggregation-mode prefill|decode, and --nnodes,
--node-rank, --dist-init-addr for an engine over several nodes.
"""

from __future__ import annotations

import argparse
import shlex

from meshplan.planner.launchers.common import (Exported, ExportedFile, engine_nodes, full_ep_only, serving_script,
                                               shell_lines)
from meshplan.costmodels.serving import redundant_experts
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
    if engine.role != "aggregated":
        args += ["--disaggregation-mode", engine.role]
    nodes, _ = engine_nodes(engine.gpus_per_engine, plan.inputs.cluster.gpus_per_node)
    if nodes > 1:
        args += ["--nnodes", str(nodes), "--node-rank", "${NODE_RANK}", "--dist-init-addr", "${HEAD}:5000"]
    return args


def export_sglang(plan: ServingPlan) -> Exported:
    def pool(e: ServingEngine) -> list[str]:
        nodes, _ = engine_nodes(e.gpus_per_engine, plan.inputs.cluster.gpus_per_node)
        where = (f"# on each of its {nodes} nodes, with NODE_RANK 0..{nodes - 1} and HEAD the first node's address"
                 if nodes > 1 else "# on one node")
        return [where, shell_lines(sglang_args(plan, e), head=3)]

    text = serving_script(plan, "SGLang", pool, "# Put SGLang's router in front with the prefill and decode engines' "
                          "addresses (python -m sglang_router.launch_router --pd-disaggregation --prefill ... "
                          "--decode ...).")
    return Exported(TARGET, (ExportedFile("sglang.sh", text),))


def parse_sglang_command(command: str) -> dict[str, object]:
    """The engine settings of one launch_server command line (for reading an export back)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flag in ("--tp-size", "--dp-size", "--pp-size", "--ep-size", "--ep-num-redundant-experts",
                 "--max-running-requests", "--chunked-prefill-size", "--nnodes"):
        p.add_argument(flag, type=int)
    p.add_argument("--mem-fraction-static", type=float)
    p.add_argument("--kv-cache-dtype")
    p.add_argument("--disaggregation-mode")
    p.add_argument("--enable-dp-attention", action="store_true")
    a, _ = p.parse_known_args(shlex.split(command.replace("\\\n", " ")))
    dp = a.dp_size or 1
    return {"tp": (a.tp_size or 1) // dp, "dp": dp, "pp": a.pp_size or 1, "ep": a.ep_size or 1,
            "dp_attention": a.enable_dp_attention, "max_num_seqs": a.max_running_requests,
            "max_num_batched_tokens": a.chunked_prefill_size, "gpu_memory_utilization": a.mem_fraction_static,
            "role": a.disaggregation_mode or "aggregated", "nnodes": a.nnodes or 1}
