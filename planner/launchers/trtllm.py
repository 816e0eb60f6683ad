"""TensorRT-LLM: a serving plan as scripts that start it (planner/launchers/serving_launch.py: one per node, and for
a disaggregated deployment TensorRT-LLM's own proxy), a Dynamo graph, and its `trtllm-serve` command lines read back.

Flags of `trtllm-serve MODEL` (tensorrt_llm/commands/serve.py): --backend pytorch, --tp_size (every GPU of a stage:
attention TP x attention DP), --pp_size, --ep_size (MoE expert parallel; the rest of a stage's ranks split each
expert, moe_tensor_parallel_size, and the two multiply to the TP size: tensorrt_llm/mapping.py), --max_batch_size,
--max_num_tokens, --max_seq_len, --kv_cache_free_gpu_memory_fraction, and --extra_llm_api_options, a YAML file of
LLM API fields (tensorrt_llm/llmapi/llm_args.py): enable_attention_dp (every rank its own attention group),
kv_cache_config.dtype, enable_chunked_prefill, speculative_config, and for disaggregated serving
cache_transceiver_config on both pools and disable_overlap_scheduler on the context (prefill) servers
(examples/disaggregated/README.md). The options file is written as JSON, which YAML reads as it is, so that the
scripts can expand ${DRAFT_MODEL} in it and the Dynamo worker can take the same object inline. Weight quantisation
is not a flag: TensorRT-LLM reads it from the checkpoint (ModelOpt's hf_quant_config.json, or config.json's
quantization_config), so MODEL must be an FP8 or NVFP4 checkpoint where the plan's weights are.

A disaggregated deployment's proxy is `trtllm-serve disaggregated -c FILE` with each pool's servers' host:port
(context_servers, generation_servers: tensorrt_llm/llmapi/disagg_utils.py). Aggregated engines each serve on their
own port: TensorRT-LLM ships no router for them, so put an HTTP load balancer in front, or use the Dynamo graph. An
engine of several nodes starts from its head node under Open MPI, one rank per GPU, each through
trtllm-llmapi-launch (TensorRT-LLM's multi-node launcher; its docs start it with srun, for which mpirun is the
bare-node equivalent); every node of it needs MPI over SSH from the head, and the same working directory and
LOG_DIR, where each node's script writes the engine's options file.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex

from meshplan.planner.launchers.common import Exported, refuse
from meshplan.planner.launchers.dynamo import dynamo_graph
from meshplan.planner.launchers.serving_launch import ROUTER_PORT, Placement, launch_files, max_model_len, place
from meshplan.planner.plan import ServingEngine, ServingPlan
from meshplan.planner.serve import trtllm_refusal

__all__ = ["TARGET", "trtllm_args", "llm_api_options", "kv_free_fraction", "export_trtllm", "parse_trtllm_command"]

TARGET = "trtllm"
DISAGG_FILE = "${LOG_DIR}/disagg.yaml"


def kv_free_fraction(plan: ServingPlan, engine: ServingEngine) -> float:
    """--kv_cache_free_gpu_memory_fraction: TensorRT-LLM sizes its KV cache as a fraction of the memory free after
    the weights and its buffers (serve.py's help), where the plan's fraction is of the whole HBM. The plan's KV
    cache over the HBM less the weights, rounded down: at most the cache the plan priced, since the buffers take
    some of that free memory too."""
    free = plan.inputs.cluster.gpu_spec.hbm_gib.value - engine.weights_gib
    return max(0.01, min(0.95, int(100 * engine.kv_cache_gib / free) / 100))


def _check(plan: ServingPlan, engine: ServingEngine) -> None:
    """The plans this export refuses, each with why and what to re-plan with."""
    model = plan.inputs.model_spec()
    why = trtllm_refusal(model, engine.tp, engine.dp, engine.ep)
    if why == "tp inside dp":
        raise refuse(TARGET, f"TensorRT-LLM's attention DP makes every rank its own attention group "
                     f"(enable_attention_dp: attention TP 1); the plan's engine has TP{engine.tp} inside DP{engine.dp}",
                     f"re-plan with --layout tp1,dp{engine.tp * engine.dp},ep{engine.ep} or export it --to sglang")
    if why == "redundant experts":
        assert model.moe is not None  # trtllm_refusal finds redundant experts in MoE models only
        raise refuse(TARGET, f"EP {engine.ep} over {model.moe.num_experts} experts needs redundant experts (TensorRT-"
                     "LLM's expert load balancer slots), which this export does not write", "use --to sglang")
    if plan.inputs.workload.two_batch_overlap and engine.ep > 1 and engine.dp > 1:
        raise refuse(TARGET, "the plan overlaps two micro-batches' expert all-to-all (--two-batch-overlap), which "
                     "this export has no TensorRT-LLM setting for", "use --to sglang or vllm, or re-plan without "
                     "--two-batch-overlap")


def llm_api_options(plan: ServingPlan, engine: ServingEngine) -> dict[str, object]:
    """The LLM API fields of one pool's engines beyond the flags (the --extra_llm_api_options file)."""
    model = plan.inputs.model_spec()
    wl = plan.inputs.workload
    options: dict[str, object] = {}
    ranks = engine.tp * engine.dp
    if engine.dp > 1:
        options["enable_attention_dp"] = True
    if model.moe is not None and engine.ep < ranks:
        options["moe_tensor_parallel_size"] = ranks // engine.ep  # x moe_expert_parallel_size = tp_size
    if wl.kv_dtype == "fp8":
        options["kv_cache_config"] = {"dtype": "fp8"}
    if engine.role != "decode":
        options["enable_chunked_prefill"] = True  # prompts in chunks of max_num_tokens, as the plan prices them
    if engine.role != "aggregated":
        options["cache_transceiver_config"] = {"backend": "DEFAULT"}
    if engine.role == "prefill":
        options["disable_overlap_scheduler"] = True
    if wl.spec_tokens and engine.role != "prefill":
        # MTPDecodingConfig where the checkpoint has DeepSeek's MTP module, else EAGLE with the user's draft model
        options["speculative_config"] = (
            {"decoding_type": "MTP", "num_nextn_predict_layers": wl.spec_tokens} if model.num_mtp_layers else
            {"decoding_type": "Eagle", "max_draft_len": wl.spec_tokens, "speculative_model_dir": "${DRAFT_MODEL}"})
    return options


def trtllm_args(plan: ServingPlan, engine: ServingEngine) -> list[str]:
    """One pool's `trtllm-serve` arguments (the options file aside)."""
    _check(plan, engine)
    experts = ["--ep_size", str(engine.ep)] if plan.inputs.model_spec().moe is not None else []
    return ["trtllm-serve", "${MODEL}", "--backend", "pytorch", "--tp_size", str(engine.tp * engine.dp), "--pp_size",
            str(engine.pp), *experts, "--max_batch_size", str(engine.max_num_seqs),
            "--max_num_tokens", str(engine.max_num_batched_tokens), "--max_seq_len", str(max_model_len(plan, engine)),
            "--kv_cache_free_gpu_memory_fraction", f"{kv_free_fraction(plan, engine):g}"]


def _options_file(p: Placement) -> str:
    return f"${{LOG_DIR}}/{p.name}.yaml"


def _write_options(plan: ServingPlan, p: Placement, rank: int) -> list[str]:
    """The engine's options file, written before it starts (a heredoc that expands ${DRAFT_MODEL}) on every node of
    it: mpirun starts the other nodes' ranks with the head's arguments, in the same working directory."""
    dtype = plan.inputs.workload.weight_dtype
    checkpoint = {"fp8": "an FP8", "fp4": "an NVFP4"}.get(dtype)
    note = ([f"# weights {dtype}: TensorRT-LLM takes the quantisation from the checkpoint, so MODEL must be "
             f"{checkpoint} checkpoint (e.g. quantised by NVIDIA Model Optimizer)"] if checkpoint else [])
    text = json.dumps(llm_api_options(plan, p.engine), indent=2)
    return [*note, f'cat > "{_options_file(p)}" <<EOF', text, "EOF"]


def _instance_args(plan: ServingPlan, p: Placement, rank: int, nodes: int) -> list[str]:
    """One engine on one of its nodes: trtllm-serve on its port with its options file; across nodes, mpirun from
    the head over every node's GPUs (the other nodes start nothing themselves)."""
    args = trtllm_args(plan, p.engine) + ["--host", "0.0.0.0", "--port", str(p.port), "--extra_llm_api_options",
                                          _options_file(p)]
    if nodes == 1:
        return args
    if rank:
        return []
    per_node = len(p.gpus)
    hosts = ",".join(f"${{HOSTS[{n}]}}:{per_node}" for n in p.nodes)
    return ["mpirun", "--allow-run-as-root", "-H", hosts, "-np", str(per_node * nodes), "-x",
            "CUDA_VISIBLE_DEVICES", "trtllm-llmapi-launch"] + args


def _disagg_config(plan: ServingPlan) -> list[str]:
    """The proxy's file (disagg_utils.py's keys), written by the router script so that HOSTS expands in it."""
    placements = place(plan)

    def servers(role: str) -> list[str]:
        urls = [f"${{HOSTS[{p.nodes[0]}]}}:{p.port}" for p in placements if p.engine.role == role]
        return [f"  num_instances: {len(urls)}", "  urls:"] + [f'    - "{u}"' for u in urls]

    return ([f'cat > "{DISAGG_FILE}" <<EOF', "hostname: 0.0.0.0", f"port: {ROUTER_PORT}", "backend: pytorch",
             "context_servers:"] + servers("prefill") + ["generation_servers:"] + servers("decode") + ["EOF"])


def export_trtllm(plan: ServingPlan) -> Exported:
    for e in plan.engines:
        _check(plan, e)  # the refusals, before any file
    disaggregated = plan.mode == "disaggregated"
    files = launch_files(plan, "TensorRT-LLM", lambda p, rank, nodes: _instance_args(plan, p, rank, nodes),
                         ["trtllm-serve", "disaggregated", "-c", DISAGG_FILE] if disaggregated else None,
                         lambda p, rank: _write_options(plan, p, rank), head=2,
                         router_setup=_disagg_config(plan) if disaggregated else None)

    # Dynamo's TensorRT-LLM worker (python3 -m dynamo.trtllm) takes its own flags for the layout and limits and the
    # LLM API fields inline as JSON (--override-engine-args); the operator adds MPI across nodes itself
    def worker(e: ServingEngine) -> list[str]:
        experts = ["--expert-parallel-size", str(e.ep)] if plan.inputs.model_spec().moe is not None else []
        return ["--model-path", "${MODEL}", "--tensor-parallel-size", str(e.tp * e.dp), "--pipeline-parallel-size",
                str(e.pp), *experts, "--max-batch-size", str(e.max_num_seqs),
                "--max-num-tokens", str(e.max_num_batched_tokens), "--max-seq-len", str(max_model_len(plan, e)),
                "--free-gpu-memory-fraction", f"{kv_free_fraction(plan, e):g}",
                "--override-engine-args", json.dumps(llm_api_options(plan, e), separators=(",", ":"))]

    return Exported(TARGET, files + (dynamo_graph(plan, TARGET, worker),))


def parse_trtllm_command(command: str) -> dict[str, object]:
    """The engine settings of one engine's block of a node script (trtllm-serve and the options file written before
    it) or of a Dynamo worker's arguments (for reading an export back)."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    for flags, dest in ((("--tp_size", "--tensor-parallel-size"), "tp_size"),
                        (("--pp_size", "--pipeline-parallel-size"), "pp_size"),
                        (("--ep_size", "--expert-parallel-size"), "ep_size"),
                        (("--max_batch_size", "--max-batch-size"), "max_batch_size"),
                        (("--max_num_tokens", "--max-num-tokens"), "max_num_tokens"),
                        (("--max_seq_len", "--max-seq-len"), "max_seq_len"), (("-np",), "np")):
        p.add_argument(*flags, dest=dest, type=int)
    p.add_argument("--kv_cache_free_gpu_memory_fraction", "--free-gpu-memory-fraction", dest="free", type=float)
    p.add_argument("--override-engine-args", dest="inline")
    written = re.search(r"<<EOF\n(.*?)\nEOF", command, re.S)
    text = command[written.end():] if written else command
    a, _ = p.parse_known_args(shlex.split(text.replace("\\\n", " ")))
    options = json.loads(written.group(1)) if written else json.loads(a.inline or "{}")
    ranks = a.tp_size or 1
    dp = ranks if options.get("enable_attention_dp") else 1
    return {"tp": ranks // dp, "dp": dp, "pp": a.pp_size or 1, "ep": a.ep_size or 1,
            "moe_tp": options.get("moe_tensor_parallel_size", 1), "max_num_seqs": a.max_batch_size,
            "max_num_batched_tokens": a.max_num_tokens, "max_seq_len": a.max_seq_len, "free_fraction": a.free,
            "kv_cache_dtype": options.get("kv_cache_config", {}).get("dtype"), "options": options, "mpi_ranks": a.np}
