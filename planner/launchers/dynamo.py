"""NVIDIA Dynamo: a serving plan as one DynamoGraphDeployment (Kubernetes) that the Dynamo operator runs: a frontend
and one worker service per pool, each worker an engine of the plan with its engine arguments.

The resource as Dynamo documents it (nvidia.com/v1alpha1, docs/kubernetes/deployment/multinode-deployment.md):
`spec.services` maps a name to a component; `componentType` frontend or worker, `subComponentType` prefill or
decode for a disaggregated pool, `replicas` the pool's engines, `resources.limits.gpu` the GPUs of one pod (one
node), `multinode.nodeCount` the nodes of an engine that spans several (its GPUs = nodeCount x gpu; the operator then
adds the cross-node flags itself: Ray or data-parallel addresses for vLLM, --dist-init-addr/--nnodes/--node-rank
for SGLang, MPI for TensorRT-LLM). Workers run `python3 -m dynamo.vllm`, `dynamo.sglang` or `dynamo.trtllm`
(examples/backends/trtllm/deploy: TRTLLMWorker, TRTLLMPrefillWorker, TRTLLMDecodeWorker) with the engine's arguments and
`--disaggregation-mode prefill|decode` in a disaggregated pool (Dynamo >= 1.0); the frontend runs
`python3 -m dynamo.frontend`. MODEL and IMAGE are the container's environment and image, set before applying.

Written by hand as YAML text: PyYAML is not a runtime dependency, and the document is a small fixed shape.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

from meshplan.planner.launchers.common import ExportedFile, refuse, serving_header_lines
from meshplan.planner.plan import ServingEngine, ServingPlan

__all__ = ["DYNAMO_FILE", "dynamo_graph"]

DYNAMO_FILE = "dynamo-graph.yaml"
API_VERSION = "nvidia.com/v1alpha1"
SERVICE_NAMES = {("vllm", "aggregated"): "VllmWorker", ("vllm", "prefill"): "VllmPrefillWorker",
                 ("vllm", "decode"): "VllmDecodeWorker", ("sglang", "aggregated"): "SGLangWorker",
                 ("sglang", "prefill"): "SGLangPrefillWorker", ("sglang", "decode"): "SGLangDecodeWorker",
                 ("trtllm", "aggregated"): "TRTLLMWorker", ("trtllm", "prefill"): "TRTLLMPrefillWorker",
                 ("trtllm", "decode"): "TRTLLMDecodeWorker"}  # the names of Dynamo's own examples

Node = dict[str, "Node"] | list["Node"] | str | int


def dynamo_graph(plan: ServingPlan, backend: str, engine_args: Callable[[ServingEngine], list[str]]) -> ExportedFile:
    """The DynamoGraphDeployment of `plan` for `backend` (vllm, sglang or trtllm); `engine_args` gives a pool's engine
    arguments after the program (the launch scripts' ${MODEL} becomes $(MODEL), Kubernetes' expansion of the
    container's environment)."""
    per_node = plan.inputs.cluster.gpus_per_node
    services: dict[str, Node] = {"Frontend": {
        "componentType": "frontend", "replicas": 1,
        "extraPodSpec": {"mainContainer": {"image": "IMAGE", "command": ["python3", "-m", "dynamo.frontend"]}}}}
    for engine in plan.engines:
        # the launch scripts' shell variables become Kubernetes' $(VAR), expanded from the container's environment
        args = [re.sub(r"\$\{(\w+)\}", r"$(\1)", a) for a in engine_args(engine)]
        if engine.role != "aggregated" and "--disaggregation-mode" not in args:
            args += ["--disaggregation-mode", engine.role]
        services[SERVICE_NAMES[(backend, engine.role)]] = _worker(backend, engine, args, per_node)
    name = re.sub(r"[^a-z0-9-]+", "-", f"meshplan-{plan.inputs.model_spec().name}".lower()).strip("-")[:63]
    doc: Node = {"apiVersion": API_VERSION, "kind": "DynamoGraphDeployment", "metadata": {"name": name},
                 "spec": {"services": services}}
    header = ["# " + line for line in serving_header_lines(plan, f"Dynamo ({backend})")]
    header += ["# kubectl apply -f dynamo-graph.yaml, after setting IMAGE (a Dynamo runtime image with "
               f"{backend}) and MODEL (the checkpoint of {plan.inputs.model_spec().name}; DRAFT_MODEL where a "
               "worker names it)"]
    return ExportedFile(DYNAMO_FILE, "\n".join(header) + "\n" + "\n".join(_yaml(doc, 0)) + "\n")


def _worker(backend: str, engine: ServingEngine, args: list[str], per_node: int) -> Node:
    nodes = math.ceil(engine.gpus_per_engine / per_node)
    if engine.gpus_per_engine % nodes:
        raise refuse("dynamo", f"an engine of {engine.gpus_per_engine} GPUs does not split evenly over {nodes} nodes "
                     "(Dynamo gives every pod of an engine the same GPUs)", "re-plan with whole nodes per engine")
    worker: dict[str, Node] = {"componentType": "worker"}
    if engine.role != "aggregated":
        worker["subComponentType"] = engine.role
    worker["replicas"] = engine.engines
    worker["resources"] = {"limits": {"gpu": str(engine.gpus_per_engine // nodes)}}
    if nodes > 1:
        worker["multinode"] = {"nodeCount": nodes}
    env: list[Node] = [{"name": v, "value": v} for v in ("MODEL", "DRAFT_MODEL") if any(f"$({v})" in a for a in args)]
    worker["extraPodSpec"] = {"mainContainer": {
        "image": "IMAGE", "env": env,
        "command": ["python3", "-m", f"dynamo.{backend}"], "args": list[Node](args)}}
    return worker


def _yaml(node: Node, indent: int) -> list[str]:
    """Block-style YAML of mappings, sequences and scalars; every string quoted as JSON (a YAML subset), so no
    value is read as a number, a boolean or a null."""
    pad = "  " * indent
    out: list[str] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if isinstance(value, dict | list) and value:
                out.append(f"{pad}{key}:")
                out += _yaml(value, indent + 1)
            else:
                out.append(f"{pad}{key}: {_scalar(value)}")
    elif isinstance(node, list):
        for item in node:
            lines = _yaml(item, indent + 1) if isinstance(item, dict | list) else [f"{pad}  {_scalar(item)}"]
            first = lines[0].lstrip()
            out.append(f"{pad}- {first}")
            out += lines[1:]
    return out


def _scalar(value: Node) -> str:
    if isinstance(value, bool | int):
        return json.dumps(value)
    if isinstance(value, str):
        return json.dumps(value)
    return "{}" if isinstance(value, dict) else "[]"
