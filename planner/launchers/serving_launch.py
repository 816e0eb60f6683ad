"""A serving plan as scripts that start it: one per node, each starting the engines (or the engine parts) placed on
that node in the background on their own GPUs and ports, then waiting for their health; and a router script that
waits for every engine and puts the engine's router in front (vLLM's vllm-router, SGLang's sglang_router,
TensorRT-LLM's disaggregated proxy).

Placement: engines in the plan's order, each one of a node's GPUs in a contiguous slice of the first node with
room, an engine of more than a node on whole nodes of its own (the plan's engines fill whole nodes or fit in one).
The scripts take the nodes' addresses from HOSTS (space-separated, in node order) and MODEL from the environment.
Hand-written: neither engine ships a multi-engine launcher for bare nodes (their Kubernetes and Dynamo recipes
need a cluster manager).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from meshplan.planner.launchers.common import ExportedFile, serving_header_lines, shell_lines
from meshplan.planner.plan import ServingEngine, ServingPlan

__all__ = ["Placement", "place", "max_model_len", "launch_files", "engine_url", "router_argv", "FIRST_PORT",
           "ROUTER_PORT"]

FIRST_PORT = 8100  # engine i listens on FIRST_PORT + i
ROUTER_PORT = 8000
HEALTH_TIMEOUT_S = 1800  # large checkpoints take minutes to load


@dataclass(frozen=True)
class Placement:
    """One engine (a model replica) and where it runs."""

    engine: ServingEngine  # its pool
    index: int  # over every engine of the deployment: its port is FIRST_PORT + index
    nodes: tuple[int, ...]  # the nodes it spans, the first its head
    gpus: tuple[int, ...]  # the GPUs it uses on each of them

    @property
    def port(self) -> int:
        return FIRST_PORT + self.index

    @property
    def name(self) -> str:
        return f"{self.engine.role}-{self.index}"


def place(plan: ServingPlan) -> list[Placement]:
    """Every engine of the plan on nodes and GPUs (see the module's docstring)."""
    per_node = plan.inputs.cluster.gpus_per_node
    free: list[int] = []  # free GPUs of each node used so far
    out: list[Placement] = []
    for engine in plan.engines:
        size = engine.gpus_per_engine
        for _ in range(engine.engines):
            if size > per_node:
                first = len(free)
                count = size // per_node
                free += [0] * count
                out.append(Placement(engine, len(out), tuple(range(first, first + count)), tuple(range(per_node))))
                continue
            node = next((n for n, left in enumerate(free) if left >= size), None)
            if node is None:
                free.append(per_node)
                node = len(free) - 1
            start = per_node - free[node]
            free[node] -= size
            out.append(Placement(engine, len(out), (node,), tuple(range(start, start + size))))
    return out


KV_HEADROOM = 0.9  # of the predicted KV capacity a sequence may take: the engine measures its own at start-up


def max_model_len(plan: ServingPlan, engine: ServingEngine) -> int:
    """The longest sequence an engine is started for: 90 % of what one attention group's KV cache is predicted to
    hold, at most the model's context, and at least the workload's ISL + OSL. vLLM refuses to start when one
    sequence of --max-model-len does not fit the cache it profiles at start-up (the model's default is its whole
    context, 131,072 for Llama 3.1), and the prediction is an estimate: the exact capacity as the length would
    leave the engine no room for an error of a few hundred MiB."""
    group_tokens = engine.kv_tokens // max(engine.dp, 1)
    wl = plan.inputs.workload
    length = max(min(wl.isl + wl.osl, group_tokens), int(KV_HEADROOM * group_tokens))
    context = plan.inputs.model_spec().max_seq_len
    return max(1, length if context is None else min(context, length))


EngineCommand = Callable[[Placement, int, int], list[str]]  # (placement, rank of this node in it, nodes) -> argv


def launch_files(plan: ServingPlan, target: str, command: EngineCommand, router: list[str] | None,
                 node_setup: Callable[[Placement, int], list[str]] | None = None,
                 head: int = 1, env: Callable[[Placement], list[str]] | None = None,
                 router_setup: list[str] | None = None) -> tuple[ExportedFile, ...]:
    """node-<k>.sh for every node and router.sh when the deployment has more than one engine. `command` gives an
    engine's argv on one of its nodes (its program the first `head` words); `node_setup` the lines an engine needs
    on a node before it (a Ray start, a file it reads); `env` the NAME=value settings its processes need beside
    their GPUs; `router` the router's argv (None: no router), `router_setup` the lines before it (its file)."""
    placements = place(plan)
    nodes = 1 + max(n for p in placements for n in p.nodes)
    files = [ExportedFile(f"node-{k}.sh", _node_script(plan, target, placements, k, nodes, command, node_setup, head,
                                                       env))
             for k in range(nodes)]
    if router is not None and len(placements) > 1:
        files.append(ExportedFile("router.sh", _router_script(plan, target, placements, nodes, router, head,
                                                              router_setup or [])))
    return tuple(files)


def _preamble(plan: ServingPlan, target: str, nodes: int, what: str) -> list[str]:
    lines = ["#!/usr/bin/env bash", "set -euo pipefail"]
    lines += ["# " + line for line in serving_header_lines(plan, target)]
    lines += [f"# {what}",
              'MODEL="${MODEL:?set MODEL to the checkpoint of ' + plan.inputs.model_spec().name + '}"']
    if plan.inputs.workload.spec_tokens and not plan.inputs.model_spec().num_mtp_layers:
        lines.append('DRAFT_MODEL="${DRAFT_MODEL:?set DRAFT_MODEL to the speculative draft model (EAGLE) of '
                     + plan.inputs.model_spec().name + '}"')
    lines += [
              f'read -r -a HOSTS <<< "${{HOSTS:?set HOSTS to the addresses of the {nodes} nodes, space-separated, '
              'in order}"',
              f'[ "${{#HOSTS[@]}}" -ge {nodes} ] || {{ echo "HOSTS names ${{#HOSTS[@]}} nodes; the plan needs {nodes}" '
              '>&2; exit 2; }',
              'LOG_DIR="${LOG_DIR:-./logs}"', 'mkdir -p "$LOG_DIR"', "",
              "wait_healthy() {  # wait_healthy HOST PORT NAME: until GET /health answers 200, or give up",
              f"  local deadline=$((SECONDS + {HEALTH_TIMEOUT_S}))",
              '  until curl -sf -o /dev/null "http://$1:$2/health"; do',
              '    [ "$SECONDS" -lt "$deadline" ] || { echo "$3 on $1:$2 not healthy; see $LOG_DIR" >&2; return 1; }',
              "    sleep 5", "  done", '  echo "$3 healthy on $1:$2"', "}", ""]
    return lines


def _node_script(plan: ServingPlan, target: str, placements: list[Placement], node: int, nodes: int,
                 command: EngineCommand, node_setup: Callable[[Placement, int], list[str]] | None, head: int,
                 env: Callable[[Placement], list[str]] | None) -> str:
    here = [p for p in placements if node in p.nodes]
    lines = _preamble(plan, target, nodes, f"node {node} of {nodes}: run this on it")
    for p in here:
        rank = p.nodes.index(node)
        e = p.engine
        where = f"node {rank} of its {len(p.nodes)}" if len(p.nodes) > 1 else f"GPUs {p.gpus[0]}-{p.gpus[-1]}"
        lines.append(f"# {p.name}: {e.role} engine TP{e.tp} DP{e.dp} PP{e.pp} EP{e.ep}, {where}, port {p.port}")
        if node_setup is not None:
            lines += node_setup(p, rank)
        argv = command(p, rank, len(p.nodes))
        if argv:
            settings = " ".join(["CUDA_VISIBLE_DEVICES=" + ",".join(map(str, p.gpus))] + (env(p) if env else []))
            log = f' \\\n    > "$LOG_DIR/{p.name}.log" 2>&1 &'
            lines.append(f"{settings} nohup \\\n    " + shell_lines(argv, head) + log)
        lines.append("")
    heads = [p for p in here if p.nodes[0] == node]
    for p in heads:
        lines.append(f'wait_healthy "${{HOSTS[{node}]}}" {p.port} {p.name}')
    if not heads:
        lines.append(f"echo 'node {node}: engine parts started; their head nodes report health'")
    lines.append("wait")
    return "\n".join(lines) + "\n"


def _router_script(plan: ServingPlan, target: str, placements: list[Placement], nodes: int,
                   router: list[str], head: int, setup: list[str]) -> str:
    lines = _preamble(plan, target, nodes, f"the router: run it on any host that reaches the nodes, after them; it "
                                           f"serves on port {ROUTER_PORT}")
    for p in placements:
        lines.append(f'wait_healthy "${{HOSTS[{p.nodes[0]}]}}" {p.port} {p.name}')
    lines += ["", *setup, "nohup \\\n    " + shell_lines(router, head) + ' \\\n    > "$LOG_DIR/router.log" 2>&1 &',
              f'wait_healthy 127.0.0.1 {ROUTER_PORT} router', "wait"]
    return "\n".join(lines) + "\n"


def engine_url(p: Placement) -> str:
    return f"http://${{HOSTS[{p.nodes[0]}]}}:{p.port}"


def router_argv(plan: ServingPlan, program: list[str], pd_flag: str,
                prefill: Callable[[Placement], list[str]]) -> list[str]:
    """A router over every engine on ROUTER_PORT: --worker-urls, or `pd_flag` with each prefill engine (`prefill`:
    its URL and what the router needs besides) and each decode engine."""
    argv = list(program)
    placements = place(plan)
    if plan.mode == "disaggregated":
        argv.append(pd_flag)
        for p in placements:
            argv += ["--prefill", *prefill(p)] if p.engine.role == "prefill" else ["--decode", engine_url(p)]
    else:
        argv += ["--worker-urls"] + [engine_url(p) for p in placements]
    return argv + ["--host", "0.0.0.0", "--port", str(ROUTER_PORT)]
