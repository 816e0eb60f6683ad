"""`meshplan sweep`: the best plan on every GPU type x count, priced, with the one an objective picks, the Pareto
front of time against money, and a report (CSV, PNG, HTML). A library call (meshplan.api.sweep) and its table."""

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from meshplan import api
from meshplan.cli.options import (P_CLUSTER, P_OUT, BeyondContextOpt, CalibrationOpt, ModelOpt, NicOpt, NvlinkOpt,
                                  ObjectiveOpt, PerNodeOpt, ProgressBar, RuntimeOpt, check_context, console,
                                  output_targets, print_table, with_budget, with_workload)
from meshplan.costmodels.config import Workload
from meshplan.costmodels.economics import Budget
from meshplan.costmodels.model_io import load_model
from meshplan.costmodels.runtime import DEFAULT_RUNTIME
from meshplan.hardware_db.cluster import ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.planner.outputs import write_all
from meshplan.planner.report import sweep_report
from meshplan.planner.sweep import Sweep, gpu_counts, time_s, usd

@with_workload
@with_budget
def sweep(
    model: ModelOpt,
    gpu: Annotated[str, typer.Option("--gpu", rich_help_panel=P_CLUSTER, help=(
        "GPU types, comma-separated (e.g. h100-sxm,h200,b200; `meshplan hardware list`)."))],
    gpus: Annotated[str, typer.Option("--gpus", rich_help_panel=P_CLUSTER, help=(
        "GPU counts: A..B doubles from A to B (64..4096), or a list (64,256,1024)."))],
    workload: Workload,  # --gbs --seq --dtype --fp8-recipe
    budget: Budget,  # --price-per-gpu-hour --tokens and the failure flags
    gpus_per_node: PerNodeOpt = None,
    nic_gbps: NicOpt = None,
    nvlink_gbs: NvlinkOpt = None,
    objective: ObjectiveOpt = "time",
    runtime: RuntimeOpt = DEFAULT_RUNTIME,
    calibration: CalibrationOpt = None,
    beyond_context: BeyondContextOpt = False,
    out: Annotated[Path | None, typer.Option("--out", rich_help_panel=P_OUT, help=(
        "Directory for the report: sweep.csv, sweep-scaling.png (throughput and MFU against GPUs), sweep-cost.png "
        "(time against money, the Pareto front), sweep-plan.png (the chosen plan's step and memory) and sweep.html "
        "(all of it on one self-contained page)."))] = None,
) -> None:
    """Plan every GPU type x count and say which to rent: the fastest plan of each (searched as `plan` does),
    its throughput, MFU and cost (with --tokens, time to train with failures), the point the objective picks and
    the Pareto front of time against money."""
    names = [g.strip() for g in gpu.split(",") if g.strip()]
    if not names:
        raise InputError("--gpu is empty; give GPU types, e.g. --gpu h100-sxm,h200")
    counts = gpu_counts(gpus)
    from meshplan.planner.report import SWEEP_FILES

    (out,) = output_targets(folders=("out",), contents={"out": SWEEP_FILES}, out=out)
    links = ClusterSpec(gpu=names[0], num_gpus=counts[0], gpus_per_node=gpus_per_node, nic_gbps=nic_gbps,
                        nvlink_gb_s=nvlink_gbs)
    spec = load_model(model)
    check_context(spec, workload.seq_len, "--seq", beyond_context)
    with ProgressBar(True, "planning", "clusters") as bar:
        sw = api.sweep(spec, names, counts, workload, links, budget, objective, runtime=runtime,
                       calibration=calibration, progress=bar)
    if sw.best is None:
        last = sw.points[-1]
        raise InputError(f"no plan fits at any point of the sweep; at {last.gpus} x {last.gpu}: {last.why}")
    con = console()
    title = f"{spec.name}: {workload.global_batch} x {workload.seq_len} tokens a step, {workload.dtype}"
    con.print(title)
    print_sweep(con, sw)
    if out is not None:
        lines = [title] + sweep_lines(sw)
        written = write_all(sweep_report(sw, out, f"meshplan sweep: {spec.name}", lines))
        con.print(f"report written to {out}: " + ", ".join(p.name for p in written))


def sweep_lines(sw: Sweep) -> list[str]:
    """The chosen point and the Pareto front, in words."""
    best = sw.best
    if best is None:
        return ["nothing fits at any point; see each point's reason"]
    c = best.cost
    what = (f"{c.expected_s / 86400:,.1f} days, ${c.total_usd:,.0f}" if c.expected_s is not None and c.total_usd
            else f"{c.tokens_per_s:,.0f} tokens/s, ${c.usd_per_million_tokens:.3f} per million tokens")
    front = ", ".join(f"{p.gpus} x {p.gpu}" for p in sw.pareto)
    return [f"chosen by {sw.objective}: {best.gpus} x {best.gpu} ({what})",
            f"Pareto front (fastest first; each is cheaper than every faster one): {front}"]


def print_sweep(con: Console, sw: Sweep) -> None:
    with_tokens = any(p.cost.expected_s is not None for p in sw.feasible)
    best, front = sw.best, {id(p) for p in sw.pareto}
    rows = []
    for p in sw.points:
        if p.plan is None:
            rows.append((p.gpu, str(p.gpus), f"no plan: {(p.why or '').split(';')[0]}", "", "", "", "", ""))
            continue
        lay, c = p.plan.prediction.layout, p.cost
        t = time_s(c) / 86400 if with_tokens else time_s(c)
        mark = ("chosen " if p is best else "") + ("pareto" if id(p) in front else "")
        rows.append((p.gpu, str(p.gpus), f"TP{lay.tp} CP{lay.cp} PP{lay.pp} DP{lay.dp} EP{lay.ep}",
                     f"{c.tokens_per_s:,.0f}", f"{p.plan.prediction.mfu:.1%}", f"{t:,.1f}",
                     f"{usd(c):,.0f}" if with_tokens else f"{usd(c):.3f}", mark.strip()))
    headers = ("GPU", "GPUs", "plan", "tok/s", "MFU", "days" if with_tokens else "s/Mtok",
               "$" if with_tokens else "$/Mtok", "")
    print_table(con, "best plan per cluster", headers, rows, left=("GPU", "plan"))
    for line in sweep_lines(sw):
        con.print(line)
