"""`meshplan estimate` and `meshplan plan`: a library call each (meshplan/api.py) and their tables."""

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from meshplan import api
from meshplan.cli.options import (P_COST, P_OUT, P_SEARCHED, BeyondContextOpt, CalibrationOpt, ExportTarget, ModelOpt,
                                  ProgressBar, RuntimeOpt, check_context, console, option, output_targets, packed,
                                  print_table, report_export, with_budget, with_cluster, with_knobs, with_workload,
                                  working)
from meshplan.costmodels.config import DEFAULT_RANK_ORDER, ParallelConfig, Workload
from meshplan.costmodels.context import stage_ranges
from meshplan.costmodels.economics import Budget, TrainingCost
from meshplan.costmodels.estimate import Estimate
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import load_model
from meshplan.costmodels.runtime import DEFAULT_RUNTIME
from meshplan.costmodels.uncertainty import (DEFAULT_MEMORY_RULE, DEFAULT_RANK, FEATURE_LABELS, MemoryRule, RankKind,
                                             ResidualTable, lead_note)
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.planner.launchers.common import ExportError
from meshplan.planner.outputs import OutputFile, write_all
from meshplan.planner.space import DEFAULT_MAX_MBS
from meshplan.planner.sweep import Objective, Sweep, SweepPoint, halvings, usd


@with_workload
@with_cluster
@with_knobs(searching=False)
@with_budget
def estimate(
    model: ModelOpt,
    workload: Workload,  # --gbs --seq --dtype --fp8-recipe (cli/options.py with_workload)
    cluster: ClusterSpec,  # --gpu --gpus and the link flags, or --cluster (with_cluster)
    config: ParallelConfig,  # one option per knob (with_knobs)
    budget: Budget,  # --price-per-gpu-hour --tokens and the failure flags (with_budget)
    runtime: RuntimeOpt = DEFAULT_RUNTIME,
    calibration: CalibrationOpt = None,
    beyond_context: BeyondContextOpt = False,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel=P_OUT, help=(
        "Print the estimate as JSON (step_time_s, tokens_per_s, tokens_per_s_per_gpu, tflops_per_gpu, mfu, hfu, "
        "peak_memory_gib, fits, breakdown_s, stages, ...) and nothing else."))] = False,
) -> None:
    """Estimate one configuration: step time and its breakdown, throughput, MFU/HFU and memory per GPU.

    Unset knobs take defaults: tp, pp, vpp, cp, ep, mbs 1; dp fills the GPUs; ZeRO 1; recompute none;
    sequence parallelism on with TP; schedule interleaved when vpp > 1, else 1f1b.
    """
    spec = load_model(model)
    check_context(spec, workload.seq_len, "--seq", beyond_context)
    est = api.estimate(spec, cluster, workload, config, runtime, calibration)
    if as_json:
        typer.echo(json.dumps(est.to_dict(), indent=2))
    else:
        con = console()
        hardware, eff = api.calibrated(cluster, calibration, runtime)
        print_estimate(con, spec, hardware, workload, est)
        con.print(calibration_line(eff.calibration if eff else None))
        print_cost(con, api.cost_of(spec, cluster, est.tokens_per_s, budget, calibration))


BREAKDOWN_LABELS = {
    "compute": "compute (forward + backward)",
    "recompute": "recompute (activation recomputation)",
    "pp_comm": "PP send/recv (exposed)",
    "pipeline_bubble": "pipeline bubble",
    "dp_comm": "DP gradient reduce / param gather (exposed)",
    "optimizer": "optimizer step",
    "offload_comm": "activation offload to host (exposed)",
}


def print_estimate(con: Console, spec: ModelSpec, cluster: Cluster, wl: Workload, est: Estimate) -> None:
    lay = est.layout
    con.print(Text.assemble((spec.name, "bold"), f" ({spec.total_params() / 1e9:.1f} B params, "
                            f"{spec.active_params() / 1e9:.1f} B active) on {cluster.num_gpus} x "
                            f"{cluster.gpu.display_name} ({cluster.num_nodes} node(s) of {cluster.gpus_per_node}), "
                            f"runtime {est.runtime}"))
    con.print(f"workload: {wl.global_batch} sequences x {wl.seq_len} tokens = {wl.tokens / 1e6:.2f} M tokens/step, "
              f"{wl.dtype}")
    con.print(f"layout: tp {lay.tp}, pp {lay.pp}, vpp {lay.vpp}, dp {lay.dp}, cp {lay.cp}, ep {lay.ep}, "
              f"etp {lay.etp}, mbs {lay.mbs}, {lay.num_microbatches} micro-batches, zero {lay.zero}, "
              f"recompute {lay.recompute}, sp {'on' if lay.sp else 'off'}, schedule {lay.schedule}, "
              f"order {lay.rank_order}")

    step = est.step_time_s
    t = Table(title="Step time breakdown (critical pipeline rank)", title_justify="left")
    t.add_column("component", overflow="fold")
    t.add_column("seconds", justify="right", overflow="fold")
    t.add_column("% of step", justify="right", overflow="fold")
    for key, sec in est.breakdown_s.items():
        label = BREAKDOWN_LABELS.get(key) or f"{key.removesuffix('_comm').upper()} comm (exposed)"
        t.add_row(label, f"{sec:.3f}", f"{100 * sec / step:.1f}")
    t.add_row(Text("step time", "bold"), Text(f"{step:.3f}", "bold"), "100.0")
    con.print(t)

    t = Table(title="Throughput", title_justify="left")
    t.add_column("metric", overflow="fold")
    t.add_column("value", justify="right", overflow="fold")
    t.add_row("step time", f"{step:.3f} s" + _range(est, step_time=True))
    t.add_row("tokens/s", f"{est.tokens_per_s:,.0f}")
    t.add_row("tokens/s/GPU", f"{est.tokens_per_s_per_gpu:,.1f}" + _range(est))
    t.add_row("TFLOP/s/GPU (model FLOPs)", f"{est.tflops_per_gpu:.1f}")
    t.add_row(f"MFU (vs {wl.dtype} dense peak)", Text.assemble(
        f"{100 * est.mfu:.1f} %", (" (above every published run of its class)", "bold yellow")
        if est.realism and est.realism.exceeds else ""))
    t.add_row("HFU (with recompute FLOPs)", f"{100 * est.hfu:.1f} %")
    t.add_row("pipeline bubble fraction", f"{100 * est.bubble_fraction:.1f} %")
    con.print(t)

    stages = est.to_dict()["stages"]
    peak = max(stages, key=lambda s: s["peak_memory_gib"])
    shown = {"only": stages[0]} if len(stages) == 1 else {"first": stages[0], "last": stages[-1]}
    if peak["rank"] not in (stages[0]["rank"], stages[-1]["rank"]):
        shown["peak"] = peak  # a middle stage holds the most
    t = Table(title="Memory per GPU (GiB)", title_justify="left")
    t.add_column("component", overflow="fold")
    ranges = stage_ranges(lay)  # with virtual stages a rank holds several separate layer ranges
    for which, s in shown.items():
        spans = ", ".join(f"{a}-{a + n - 1}" for a, n in ranges[s["rank"]] if n)
        t.add_column(f"{which} stage (rank {s['rank']}, layers {spans})", justify="right", overflow="fold")
    shown = list(shown.values())
    for key in shown[0]["memory_gib"]:
        t.add_row(key, *(f"{s['memory_gib'][key]:.2f}" for s in shown))
    t.add_row(Text("total", "bold"), *(Text(f"{s['peak_memory_gib']:.2f}", "bold") for s in shown))
    t.add_row("HBM", *(f"{est.hbm_gib:.0f}" for _ in shown))
    t.add_row("fits", *(Text("yes", "green") if s["peak_memory_gib"] <= est.hbm_gib else Text("NO", "bold red")
                        for s in shown))
    con.print(t)
    if est.realism is not None:
        con.print(Text.assemble(("realism:", "bold yellow" if est.realism.exceeds else ""), " ", est.realism.line()))
    if est.interval is not None:
        con.print(f"uncertainty: {interval_line(est)}")
    print_memory_verdict(con, est)


def print_memory_verdict(con: Console, est: Estimate) -> None:
    """The memory line: at the estimate, and how sure (costmodels/uncertainty.py memory_interval)."""
    advice = "; try more --pp/--tp, --recompute selective|full, a higher --zero or a smaller --mbs"
    verdict = est.memory_verdict
    if verdict is None or est.memory_interval is None:
        con.print(Text.assemble(("memory: fits", "green") if est.fits else ("memory: does NOT fit", "bold red"),
                                f" (peak {est.peak_memory_gib:.1f} GiB of {est.hbm_gib:.0f} GiB HBM)"
                                + ("" if est.fits else advice)))
        return
    style = {"fits": "green", "fits at the estimate": "yellow", "over at the estimate": "yellow",
             "does not fit": "bold red"}[verdict]
    con.print(Text.assemble(("memory: ", style), (est.memory_interval.line(est.peak_memory_gib, est.hbm_gib), style),
                            advice if verdict in ("over at the estimate", "does not fit") else ""))


def _range(est: Estimate, step_time: bool = False) -> str:
    """' (lo-hi)' of the estimate's interval (costmodels/uncertainty.py), or nothing without one."""
    if est.interval is None:
        return ""
    if step_time:
        lo, hi = est.interval.step_time(est.step_time_s)
        return f" ({lo:.3g}-{hi:.3g})"
    lo, hi = est.interval.throughput(est.tokens_per_s_per_gpu)
    return f" ({lo:,.0f}-{hi:,.0f})"


def interval_line(est: Estimate) -> str:
    """Where the ranges in brackets come from."""
    interval = est.interval
    assert interval is not None
    level = f"{100 * interval.level:.0f} %"
    if not interval.dropped:
        return (f"{level} ranges in brackets: how {interval.runs} published runs of its region measured against "
                f"their predictions (docs/cost_model.md)")
    dropped = ", ".join(FEATURE_LABELS[d] for d in interval.dropped)
    return (f"{level} ranges in brackets: how {interval.runs} published runs measured against their predictions, "
            f"runs like it in all but {dropped} (too few match it in everything; docs/cost_model.md)")


def calibration_line(label: str | None) -> str:
    """Which efficiencies priced the predictions (Efficiency.calibration's label, None: the GPU's defaults)."""
    if label is None:
        return "calibration: none, the GPU's efficiency defaults (meshplan ships public calibrations for some GPUs)"
    name = label.split(" sha256:")[0]
    if name.startswith("public-"):
        return (f"calibration: {name}, the GPU's factors fit to its published runs (the default; --calibration none: "
                f"the uncalibrated defaults)")
    return f"calibration: {label}"


def lead_line(faster: float, slower: float, first: str, second: str, table: ResidualTable) -> str:
    """Whether a lead in predicted throughput between two layouts on one cluster is more than the model's error on
    such a pair (costmodels/uncertainty.py lead_note), in the residuals of the model that priced them."""
    return (f"lead of {first} over {second}: {faster / slower - 1:.1%} in tokens/s; "
            f"{lead_note(faster, slower, table=table)}")


def print_cost(con: Console, cost: TrainingCost) -> None:
    """The money and time lines under a plan or an estimate."""
    con.print(f"cost: ${cost.usd_per_hour:,.2f}/hour at ${cost.usd_per_gpu_hour:g} per GPU-hour, "
              f"${cost.usd_per_million_tokens:,.3f} and {cost.gpu_hours_per_million_tokens:,.3f} GPU-hours per "
              f"million training tokens")
    if cost.tokens is None or cost.ideal_s is None or cost.expected_s is None:
        return
    assert cost.mtbf_s is not None and cost.checkpoint_interval_s is not None and cost.checkpoint_s is not None
    assert cost.total_usd is not None and cost.gpu_hours is not None and cost.goodput is not None
    con.print(f"time to train {cost.tokens:.3g} tokens: {cost.ideal_s / 86400:,.1f} days without failures, "
              f"{cost.expected_s / 86400:,.1f} days expected ({cost.goodput:.1%} goodput): a failure every "
              f"{cost.mtbf_s / 3600:,.1f} h, a checkpoint every {cost.checkpoint_interval_s / 60:,.1f} min "
              f"({cost.checkpoint_s:,.1f} s to write; Daly's optimum); ${cost.total_usd:,.0f}, "
              f"{cost.gpu_hours:,.0f} GPU-hours")


# ---- plan ----------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PlanOutputs:
    """What `plan` writes and prints besides its table."""

    out: Path | None = None
    trace: Path | None = None
    explain: bool = False
    as_json: bool = False
    timing: bool = False
    export_to: ExportTarget | None = None
    export_out: Path | None = None


def _plan_outputs(**given: Any) -> PlanOutputs:
    """The output options, checked before any work: paths writable and distinct, --export-out with --export."""
    outputs = PlanOutputs(**given)
    if outputs.export_out is not None and outputs.export_to is None:
        raise InputError("--export-out needs --export TARGET")
    if outputs.as_json and outputs.export_to is not None and outputs.export_out is None:
        raise InputError("--json prints only the plan; give --export-out for the --export files")
    contents = {}
    if outputs.export_to:
        from meshplan.planner.launchers import EXPORT_NAMES  # every launcher: only when exporting

        contents = {"export_out": EXPORT_NAMES[outputs.export_to]}
    out, trace, export_out = output_targets(contents=contents, out=outputs.out, trace=outputs.trace,
                                            export_out=outputs.export_out)
    return replace(outputs, out=out, trace=trace, export_out=export_out)


PLAN_OUTPUTS = [
    option("out", Annotated[Path | None, typer.Option("--out", rich_help_panel=P_OUT, help=(
        "Write the best plan as Plan JSON (schema v1, planner/plan.schema.json) to this file."))]),
    option("trace", Annotated[Path | None, typer.Option("--trace", rich_help_panel=P_OUT, help=(
        "Write the best plan's simulated pipeline timeline as a Chrome trace (open in ui.perfetto.dev)."))]),
    option("explain", Annotated[bool, typer.Option("--explain", rich_help_panel=P_OUT, help=(
        "Say why the best plan beats the runner-up and which constraint binds."))], False),
    option("as_json", Annotated[bool, typer.Option("--json", rich_help_panel=P_OUT, help=(
        "Print the best plan as Plan JSON and nothing else."))], False),
    option("timing", Annotated[bool, typer.Option("--timing", rich_help_panel=P_OUT, help=(
        "Record the search's wall time in the plan JSON (search.seconds). Off by default, so the same input "
        "writes a byte-identical plan; the table shows the time either way."))], False),
    option("export_to", Annotated[ExportTarget | None, typer.Option("--export", rich_help_panel=P_OUT, help=(
        "Also export the best plan for a launcher (as `meshplan export`): printed after the table, or written "
        "to --export-out."))]),
    option("export_out", Annotated[Path | None, typer.Option("--export-out", rich_help_panel=P_OUT, help=(
        "Where --export writes: the file, or a directory when the export has several files."))]),
]


@with_workload
@with_cluster
@with_knobs(searching=True)
@with_budget
@packed("outputs", PLAN_OUTPUTS, _plan_outputs)
def plan(
    model: ModelOpt,
    workload: Workload,  # --gbs --seq --dtype --fp8-recipe (cli/options.py with_workload)
    cluster: ClusterSpec,  # --gpu --gpus and the link flags, or --cluster (with_cluster)
    config: ParallelConfig,  # one option per knob the search takes pinned (with_knobs)
    budget: Budget,  # --price-per-gpu-hour --tokens and the failure flags (with_budget)
    runtime: RuntimeOpt = DEFAULT_RUNTIME,
    calibration: CalibrationOpt = None,
    objective: Annotated[Objective, typer.Option("--objective", rich_help_panel=P_COST, help=(
        "time: the fastest plan on --gpus GPUs. cost and tokens-per-dollar take --gpus as the most to use and weigh "
        "it and its halvings (a smaller job can be cheaper: better MFU, fewer failures): cost picks the cheapest run "
        "(with --tokens, expected dollars with failures; else $ per million tokens), tokens-per-dollar the most "
        "tokens per dollar at steady state."))] = "time",
    max_mbs: Annotated[int, typer.Option("--max-mbs", min=1, max=2**17, rich_help_panel=P_SEARCHED,
                                         help="Largest micro-batch size searched.")] = DEFAULT_MAX_MBS,
    top: Annotated[int, typer.Option("--top", min=1, max=100, rich_help_panel=P_OUT,
                                     help="How many of the best plans to rank in the table (at most 100).")] = 5,
    time_limit: Annotated[float | None, typer.Option("--time-limit", min=0.001, rich_help_panel=P_OUT, help=(
        "Stop after about this many seconds of CPU time (the same work on a busy machine) and return the best plan "
        "found with its proven optimality gap; a quick first plan comes before the exact search, and the limit "
        "waits for it."))] = None,
    rank: Annotated[RankKind, typer.Option("--rank", rich_help_panel=P_OUT, help=(
        "What 'best' means. expected: the shortest predicted step. conservative: the shortest slow end of the "
        "plan's 80 % range (the step its region's cross-validated errors say is exceeded one time in ten), so a "
        "layout the model has often over-predicted pays for it. With the default calibration or --calibration none, "
        "not with your own (its predictions carry no range)."))] = DEFAULT_RANK,
    memory: Annotated[MemoryRule, typer.Option("--memory", rich_help_panel=P_OUT, help=(
        "What fits. estimate: the predicted peak memory within the HBM. sure: the high end of its 95 % range "
        "(from the model's error on measured peaks, docs/cost_model.md) within the HBM, so the plan fits with "
        "95 % confidence; it leaves part of the HBM unused."))] = DEFAULT_MEMORY_RULE,
    beyond_context: BeyondContextOpt = False,
    outputs: PlanOutputs = PlanOutputs(),  # --out --trace --explain --json --timing --export --export-out
) -> None:
    """Search every parallel configuration and return the fastest that fits, proven optimal under the cost model.

    Every knob flag pins that knob; the others are searched: tp (within a node), cp, pp with uneven stages or
    virtual stages, dp, ep/etp (MoE), micro-batch size, ZeRO 0-3, recomputation (also per stage), sequence
    parallelism and the schedule. The table ranks the best --top plans; the account below it says how large the
    space was, what was pruned by which bound, what was infeasible and why, and whether optimality is proven.
    """
    from meshplan.planner.explain import explain
    from meshplan.planner.plan import plan_text
    from meshplan.planner.trace import chrome_trace, trace_text

    spec = load_model(model)
    check_context(spec, workload.seq_len, "--seq", beyond_context)
    weighed = None
    if objective != "time":
        weighed = _rightsized(spec, cluster, workload, config, runtime, calibration, budget, objective,
                              not outputs.as_json, rank, memory)
        cluster = cluster.model_copy(update={"num_gpus": weighed.best.gpus})
    with ProgressBar(not outputs.as_json, "searching", "groups") as bar:
        found = api.search_plans(spec, cluster, workload, config, runtime, calibration, top, time_limit,
                                 outputs.timing, progress=bar, max_mbs=max_mbs, budget=budget, rank=rank,
                                 memory=memory)
    doc, result, sim = found.plan, found.result, found.simulated
    exported, refused, written = None, None, []
    if outputs.export_to is not None:
        from meshplan.planner.launchers import export_files, export_plan  # every launcher: only when exporting

        try:
            exported = export_plan(doc, outputs.export_to)
        except ExportError as exc:  # the plan and its table still come; the best plan the launcher runs follows
            refused = exc
        if exported is not None and outputs.export_out is not None:
            written = export_files(exported, outputs.export_out)
    files = [OutputFile(outputs.out, plan_text(doc))] if outputs.out is not None else []
    files += written
    if outputs.trace is not None:
        files.append(OutputFile(outputs.trace, trace_text(chrome_trace(sim))))
    write_all(files)  # all or none, after every one of them is made
    if outputs.as_json:
        typer.echo(doc.model_dump_json(indent=2))
        if refused is not None:
            raise refused
        return
    con = console()
    _print_ranking(con, spec, found.cluster, workload, result, found.residual_table)
    con.print(calibration_line(doc.inputs.calibration))
    assert doc.economics is not None
    print_cost(con, doc.economics)
    if weighed is not None:
        print_weighed(con, weighed)
    if outputs.explain:
        for line in explain(result):
            con.print(line)
    if outputs.out is not None:
        con.print(f"plan written to {outputs.out}")
    if outputs.trace is not None:
        con.print(f"trace written to {outputs.trace} (open in https://ui.perfetto.dev)")
    report_export(con, exported, outputs.export_to, written if outputs.export_out is not None else None)
    if exported is not None and outputs.export_to is not None:
        from meshplan.planner.launchers.common import runtime_note

        other = runtime_note(doc, outputs.export_to)  # planned for another framework: priced under this one's too
        if other is not None:
            con.print(other)
    if refused is not None:
        _name_runnable(con, spec, cluster, workload, config, runtime, calibration, budget, refused, doc)
        raise refused


def _name_runnable(con: Console, spec: ModelSpec, cluster: ClusterSpec, workload: Workload, config: ParallelConfig,
                   runtime: str, calibration: str | None, budget: Budget, refused: ExportError, best: Any) -> None:
    """After a launcher refused the best plan: the best plan it runs, found by searching with its refusals' pins,
    and the flags that ask `plan` for it."""
    target = refused.target
    con.print(f"{target} cannot run this plan ({refused.why}); searching the best plan {target} runs")
    with working(f"searching the best plan {target} runs"):
        runnable = api.runnable_plan(spec, cluster, workload, target, config, runtime, calibration, budget, refused)
    if runnable is None:
        con.print(f"no plan within the searches {target} takes; {refused.fix}")
        return
    doc = runnable.found.plan
    lay, p = doc.prediction.layout, doc.prediction
    slower = p.step_time_s / best.prediction.step_time_s - 1
    flags = " ".join(_pin_flag(k, v) for k, v in runnable.pins)
    con.print(f"best plan {target} runs: TP{lay.tp} CP{lay.cp} PP{lay.pp} VPP{lay.vpp} DP{lay.dp} EP{lay.ep} mbs "
              f"{lay.mbs} ZeRO-{lay.zero} recompute {lay.recompute} {lay.schedule}: step {p.step_time_s:.3f} s, "
              f"{slower:+.1%} against the best")
    con.print(f"to plan it, add: {flags}", soft_wrap=True)


def _pin_flag(field: str, value: object) -> str:
    from meshplan.costmodels.config import knob_help

    knob = knob_help(field)
    if knob is None:  # a knob with no command-line flag (the stage split): the Python API's ParallelConfig takes it
        return f"[ParallelConfig {field}={value!r}, no flag]"
    flag = knob.flag_name(field)
    if value is None:
        return f"(without {flag})"
    if isinstance(value, bool):
        return flag if value else f"--no-{flag.removeprefix('--')}"
    return f"{flag} {','.join(map(str, value)) if isinstance(value, tuple) else value}"


@dataclass(frozen=True)
class Weighed:
    """The GPU counts `plan --objective cost|tokens-per-dollar` weighed, and the one it chose."""

    sweep: Sweep
    best: SweepPoint


def _rightsized(spec: ModelSpec, cluster: ClusterSpec, workload: Workload, config: ParallelConfig, runtime: str,
                calibration: str | None, budget: Budget, objective: Objective, show: bool,
                rank: RankKind = DEFAULT_RANK, memory: MemoryRule = DEFAULT_MEMORY_RULE) -> Weighed:
    """The best plan on --gpus and each halving (by --rank, fitting as --memory says), priced; the one the objective
    picks."""
    counts = halvings(cluster.num_gpus, 1)
    with ProgressBar(show, "planning", "clusters") as bar:
        sw = api.sweep(spec, [cluster.gpu], counts, workload, cluster, budget, objective, config, runtime, calibration,
                       progress=bar, rank=rank, memory=memory)
    if sw.best is None:
        reasons = "; ".join(f"{p.gpus} GPUs: {p.why}" for p in sw.points[:1])
        raise InputError(f"no plan fits on {cluster.num_gpus} GPUs or fewer ({reasons})")
    return Weighed(sw, sw.best)


def print_weighed(con: Console, weighed: Weighed) -> None:
    sw = weighed.sweep
    parts = []
    for p in sw.points:
        parts.append(f"{p.gpus}: does not fit" if p.plan is None else
                     f"{p.gpus}: {fmt_days(p.cost)}, ${usd(p.cost):,.{0 if p.cost.total_usd else 3}f}"
                     + ("" if p.cost.total_usd else "/M tokens"))
    con.print(f"objective {sw.objective}: chose {weighed.best.gpus} of up to {sw.points[0].gpus} GPUs; weighed "
              + "; ".join(parts))


def fmt_days(cost: TrainingCost) -> str:
    return (f"{cost.expected_s / 86400:,.1f} days" if cost.expected_s is not None
            else f"{cost.tokens_per_s:,.0f} tokens/s")


def _stages_text(lay) -> str:
    if lay.pp == 1:
        return str(sum(lay.stage_layers))
    text = "-".join(map(str, lay.stage_layers)) if len(set(lay.stage_layers)) > 1 else f"{lay.pp}x{lay.stage_layers[0]}"
    return text if lay.vpp == 1 else f"{text} /{lay.vpp}v"


def _recompute_text(lay) -> str:
    if lay.recompute != "per-stage":
        return lay.recompute
    return ",".join(p.label(n) for p, n in zip(lay.stage_recompute, lay.stage_layers, strict=True))


def _print_ranking(con: Console, spec: ModelSpec, cluster: Cluster, wl: Workload, result,
                   table: ResidualTable | None) -> None:
    acc = result.account
    moe = spec.moe is not None
    con.print(Text.assemble((spec.name, "bold"), f" on {cluster.num_gpus} x {cluster.gpu.display_name} "
                            f"({cluster.num_nodes} node(s) of {cluster.gpus_per_node}); {wl.global_batch} x "
                            f"{wl.seq_len} tokens per step, {wl.dtype}"))
    orders = any(p.estimate.layout.rank_order != DEFAULT_RANK_ORDER for p in result.plans)  # column only if used
    cols = ["#", "tp", "cp", "pp", "dp"] + (["ep", "etp"] if moe else []) + (["order"] if orders else []) + [
        "mbs", "zero", "sp", "recompute", "schedule", "layers/stage", "step s", "tok/s/GPU", "MFU %", "peak GiB"]
    rows = []
    for n, p in enumerate(result.plans, 1):
        e, lay = p.estimate, p.estimate.layout
        row = [str(n), str(lay.tp), str(lay.cp) + ("" if lay.cp == 1 else f" {lay.cp_comm}"), str(lay.pp), str(lay.dp)]
        if moe:
            row += [str(lay.ep), str(lay.etp)]
        if orders:
            row.append(lay.rank_order)
        row += [str(lay.mbs), str(lay.zero), "on" if lay.sp else "off", _recompute_text(lay), lay.schedule,
                _stages_text(lay), f"{e.step_time_s:.3f}", f"{e.tokens_per_s_per_gpu:,.0f}" + _range(e),
                f"{100 * e.mfu:.1f}",
                f"{e.peak_memory_gib:.1f}"]
        rows.append(row)
    ranked = ", ranked by the slow end of their range" if acc.ranking == "conservative" else ""
    print_table(con, f"Best {len(result.plans)} plans (predicted{ranked})", cols, rows,
                left=("order", "recompute", "schedule", "layers/stage"))
    pruned = ", ".join(f"{v:,} by {k}" for k, v in sorted(acc.pruned.items(), key=lambda x: -x[1])) or "none"
    infeasible = ", ".join(f"{v:,} {k}" for k, v in sorted(acc.infeasible.items(), key=lambda x: -x[1])) or "none"
    con.print(f"search: {acc.space_size:,} candidates in the space; {acc.evaluated:,} simulated, {acc.bounded:,} "
              f"partition bounds solved ({acc.cpsat_calls} with CP-SAT); {acc.seconds:.2f} s")
    con.print(f"  pruned: {pruned}")
    con.print(f"  infeasible: {infeasible}")
    best = result.plans[0].estimate.realism
    if best is not None:
        con.print(Text.assemble(("realism of plan #1:", "bold yellow" if best.exceeds else ""), " ", best.line()))
    first = result.plans[0]
    if first.estimate.interval is not None:
        con.print(f"uncertainty of plan #1: {interval_line(first.estimate)}")
        if (table is not None and len(result.plans) > 1
                and first.estimate.tokens_per_s >= result.plans[1].estimate.tokens_per_s):
            con.print(lead_line(first.estimate.tokens_per_s, result.plans[1].estimate.tokens_per_s, "plan #1", "#2",
                                table))
    memory = first.estimate.memory_interval
    if memory is not None:
        con.print(f"memory of plan #1: {memory.line(first.estimate.peak_memory_gib, first.estimate.hbm_gib)}")
        unsure = [f"#{n}" for n, p in enumerate(result.plans[1:], 2) if p.estimate.memory_verdict != "fits"]
        if unsure:
            con.print(f"  plans {', '.join(unsure)} fit at the estimate, not with "
                      f"{100 * memory.level:.0f} % confidence")
    conservative = acc.ranking == "conservative"
    if conservative:
        con.print(f"ranked by the slow end of each plan's range (--rank conservative): plan #1's is "
                  f"{first.ranked_s:.3f} s a step (predicted {first.step_time_s:.3f} s)")
    if acc.status == "optimal":
        con.print(Text.assemble(("optimal", "green"), ": no candidate in the space " + (
            "has a lower slow end" if conservative else "is predicted faster") + " (proven by the bounds above)"))
    else:
        con.print(Text.assemble((acc.status, "yellow"), f": the best plan is within {100 * acc.gap:.2f} % of optimal "
                                f"(no candidate can beat {acc.lower_bound_s:.3f} s"
                                f"{' at its slow end' if conservative else ''})"))
