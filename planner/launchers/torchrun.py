"""torchrun: the launch of meshplan's own executor on the plan's world, one process per GPU on each node.

The command runs `meshplan verify PLAN --launcher torchrun`: every rank joins the torchrun world (executor/launch.py
reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT), runs its part of the plan's exact layout on the
scaled model and rank 0 reports. torchrun's flags are those of torch/distributed/run.py (c10d rendezvous across
nodes, --standalone on one).
"""

from __future__ import annotations

from meshplan.planner.launchers.common import (Exported, ExportedFile, header_lines, node_geometry, shell_lines,
                                               torchrun_args)
from meshplan.planner.plan import Plan

__all__ = ["TARGET", "executor_env", "torchrun_command", "export_torchrun"]

TARGET = "torchrun"


def executor_env(plan: Plan) -> list[tuple[str, str, str]]:
    """(variable, value, why) the executor's ranks need; values may expand other variables."""
    nodes, _ = node_geometry(plan)
    env = [("OMP_NUM_THREADS", "1", "the executor runs one torch thread per rank (executor/launch.py)")]
    if nodes > 1:
        env += [("MASTER_ADDR", "${MASTER_ADDR:?set MASTER_ADDR to the address of node 0}", "the rendezvous host"),
                ("MASTER_PORT", "${MASTER_PORT:-29500}", "the rendezvous port, free on node 0"),
                ("GLOO_SOCKET_IFNAME", "${GLOO_SOCKET_IFNAME:-}", "the network interface gloo uses between nodes "
                 "(empty: the one the host name resolves to)")]
    return env


def torchrun_command(plan: Plan, plan_path: str = "${PLAN}") -> list[str]:
    return torchrun_args(plan) + ["-m", "meshplan.cli.main", "verify", plan_path, "--launcher", "torchrun"]


def export_torchrun(plan: Plan) -> Exported:
    nodes, per_node = node_geometry(plan)
    header = "\n".join("# " + line for line in header_lines(plan, "torchrun (meshplan executor)", TARGET))
    env = "\n".join(f'export {name}="{value}"  # {why}' for name, value, why in executor_env(plan))
    usage = (f"# Run on each of the {nodes} node(s), {per_node} processes each: bash torchrun.sh plan.json "
             f"[verify options]\n# The executor runs over gloo on CPU tensors until its NCCL backend lands "
             f"(docs/executor.md).")
    command = shell_lines(torchrun_command(plan))
    text = (f"#!/usr/bin/env bash\n{header}\n{usage}\nset -euo pipefail\nPLAN=\"${{1:?pass the plan.json}}\"\n"
            f"shift\n{env}\n{command} \\\n    \"$@\"\n")
    return Exported(TARGET, (ExportedFile("torchrun.sh", text),))
