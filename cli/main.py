"""meshplan's command line: a thin typer layer over costmodels and hardware_db.

Every command is a few lines over a library call and a rich table. `main()` runs the app and turns bad input
(hardware_db.errors.InputError, and any pydantic / file / JSON / TOML error that slips through) and click's
usage errors into ONE line `error: <message>` on stderr with exit code 2: no traceback.
"""

import json
import os
import sys
import tomllib
import warnings
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from meshplan import api
from meshplan.costmodels.config import (DEFAULT_RANK_ORDER, DEFAULT_RUNTIME, MAX_GLOBAL_BATCH, MAX_SEQ_LEN,
                                        RECOMPUTE_MODULES, RUNTIME_OPTIONS, RUNTIMES, ParallelConfig, RankOrder,
                                        Workload)
from meshplan.costmodels.estimate import Estimate, simulate_config, stage_ranges
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import list_zoo, load_model, load_zoo, zoo_source
from meshplan.costmodels.serving import ServeTargets
from meshplan.hardware_db.calibration import load_calibration
from meshplan.hardware_db.cluster import Cluster, ClusterSpec, load_cluster_file
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import GPUSpec, Sourced, list_gpus, load_gpu
from meshplan.planner.outputs import OutputFile, check_distinct, check_target, write_all

EXIT_INPUT = 2  # bad input, the same code click uses for usage errors
MAX_VERIFY_STEPS = 1000  # verify compares parameters after a few steps; the reference draws every step's batch up front
MAX_VERIFY_TIMEOUT_S = 86_400.0  # a day
MAX_VERIFY_RANKS = 4096  # one process each, on this host

# typer >= 0.2x vendors click; find its exception classes through the public typer.BadParameter (a UsageError).
ClickException: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
NoArgsIsHelpError = getattr(sys.modules[ClickException.__module__], "NoArgsIsHelpError", None)

ExportTarget = Literal["megatron", "torchtitan", "deepspeed", "torchrun", "nemo"]  # planner.launchers.TARGETS
AnyExportTarget = Literal["megatron", "torchtitan", "deepspeed", "torchrun", "nemo", "vllm", "sglang"]  # + SERVING
ImportSource = Literal["megatron", "torchtitan"]  # planner.launchers.SOURCES

app = typer.Typer(
    name="meshplan",
    help="Parallelism planner for LLM training: search the fastest parallel plan that fits, or estimate one.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
models_app = typer.Typer(help="Built-in model zoo and model files (docs/models.md).", no_args_is_help=True)
hardware_app = typer.Typer(help="Built-in GPU specifications, every number with its source (docs/hardware.md).",
                           no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(hardware_app, name="hardware")

P_MODEL, P_CLUSTER, P_PAR, P_OUT = "Model and workload", "Cluster", "Parallelism (unset: defaults)", "Output"


def _version() -> str:
    try:
        return metadata.version("meshplan")
    except metadata.PackageNotFoundError:  # running from a checkout without `pip install`
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"] if pyproject.is_file() else "unknown"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"meshplan {_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print meshplan's version and exit.", is_eager=True,
                                          callback=_show_version)] = False,
) -> None:
    """Parallelism planner for LLM training: estimate step time, throughput, MFU and memory of a configuration."""


def _targets(directories: tuple[str, ...] = ("export_out",), **flags: Path | None) -> tuple[Path | None, ...]:
    """The command's output paths (keyword = option name), each checked before any work (planner/outputs.py; those
    named in `directories` may be a folder), and no two the same file."""
    checked = {"--" + k.replace("_", "-"): check_target(v, "--" + k.replace("_", "-"), directory_ok=k in directories)
               for k, v in flags.items()}
    check_distinct(checked)
    return tuple(checked.values())


def _console() -> Console:
    """Rich console; piped output (CI logs, `| less`, tests) gets 140 columns instead of rich's 80 unless COLUMNS says."""
    return Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=140)


# ---- estimate ------------------------------------------------------------------------------------------------------

def _cluster(cluster_file: Optional[str], gpu: Optional[str], gpus: Optional[int], gpus_per_node: Optional[int],
             nic_gbps: Optional[float], nvlink_gbs: Optional[float]) -> ClusterSpec:
    """The cluster of --cluster FILE, or of --gpu/--gpus and the link flags."""
    if cluster_file is not None:
        if any(v is not None for v in (gpu, gpus, gpus_per_node, nic_gbps, nvlink_gbs)):
            raise InputError("give either --cluster FILE or --gpu/--gpus (and link flags), not both")
        return load_cluster_file(cluster_file)
    if gpu is None or gpus is None:
        raise InputError("say which cluster: --gpu NAME --gpus N, or --cluster FILE (see `meshplan hardware list`)")
    return ClusterSpec(gpu=gpu, num_gpus=gpus, gpus_per_node=gpus_per_node, nic_gbps=nic_gbps, nvlink_gb_s=nvlink_gbs)


# Options shared by `estimate` and `plan` (type aliases: one definition, the same help in both commands).
ModelOpt = Annotated[str, typer.Option("--model", "-m", rich_help_panel=P_MODEL, help=(
    "Zoo model name (`meshplan models list`), a Hugging Face config.json, a directory holding one, "
    "or a meshplan model file (.json/.toml, docs/models.md)."))]
GbsOpt = Annotated[int, typer.Option("--gbs", min=1, rich_help_panel=P_MODEL,
                                     help="Global batch size per optimizer step, in sequences.")]
SeqOpt = Annotated[int, typer.Option("--seq", min=1, rich_help_panel=P_MODEL, help="Sequence length, in tokens.")]
DtypeOpt = Annotated[Literal["bf16", "fp16", "fp8"], typer.Option(
    "--dtype", rich_help_panel=P_MODEL, help="GEMM precision; MFU is measured against this dtype's dense peak.")]
Fp8RecipeOpt = Annotated[Literal["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"], typer.Option(
    "--fp8-recipe", metavar="RECIPE", rich_help_panel=P_MODEL, help=(
        "FP8 scaling (with --dtype fp8): delayed (TE DelayedScaling), tensorwise (current scaling), rowwise "
        "(torchao), blockwise (1x128 / 128x128), mxfp8 (Blackwell). Decides the FP8 kernel and its casts."))]
GpuOpt = Annotated[Optional[str], typer.Option("--gpu", rich_help_panel=P_CLUSTER, help=(
    "GPU name (`meshplan hardware list`, e.g. h100-sxm) or a GPU .toml file."))]
GpusOpt = Annotated[Optional[int], typer.Option("--gpus", min=1, rich_help_panel=P_CLUSTER,
                                                help="Total number of GPUs.")]
PerNodeOpt = Annotated[Optional[int], typer.Option("--gpus-per-node", min=1, rich_help_panel=P_CLUSTER, help=(
    "GPUs per node (scale-up domain); default 8, or the GPU's NVLink domain where larger."))]
NicOpt = Annotated[Optional[float], typer.Option("--nic-gbps", min=0.001, rich_help_panel=P_CLUSTER, help=(
    "Scale-out NIC line rate per GPU, in Gb/s (gigabits); default: the GPU spec's."))]
NvlinkOpt = Annotated[Optional[float], typer.Option("--nvlink-gbs", min=0.001, rich_help_panel=P_CLUSTER, help=(
    "Scale-up (NVLink) bandwidth per GPU per direction, in GB/s (gigabytes); default: the GPU spec's."))]
ClusterOpt = Annotated[Optional[str], typer.Option("--cluster", rich_help_panel=P_CLUSTER, help=(
    "Cluster file (TOML or JSON) with gpu, num_gpus and optional gpus_per_node, nic_gbps, nvlink_gb_s; "
    "instead of --gpu/--gpus. Example: examples/clusters/dgx-h100-64.toml."))]
TpOpt = Annotated[Optional[int], typer.Option("--tp", min=1, rich_help_panel=P_PAR, help="Tensor-parallel degree.")]
PpOpt = Annotated[Optional[int], typer.Option("--pp", min=1, rich_help_panel=P_PAR,
                                              help="Pipeline-parallel degree (stages).")]
VppOpt = Annotated[Optional[int], typer.Option("--vpp", min=1, rich_help_panel=P_PAR, help=(
    "Virtual pipeline stages (model chunks) per pipeline rank; > 1 means the interleaved schedule."))]
DpOpt = Annotated[Optional[int], typer.Option("--dp", min=1, rich_help_panel=P_PAR, help=(
    "Data-parallel degree (GPUs / (tp x pp x cp) when unset)."))]
CpOpt = Annotated[Optional[int], typer.Option("--cp", min=1, rich_help_panel=P_PAR,
                                              help="Context-parallel degree (splits the sequence).")]
CpCommOpt = Annotated[Optional[Literal["ring", "a2a"]], typer.Option("--cp-comm", rich_help_panel=P_PAR, help=(
    "Context-parallel communication: ring (K,V passed around a ring, overlapped with attention) or a2a "
    "(all-to-all over heads, DeepSpeed-Ulysses)."))]
EpOpt = Annotated[Optional[int], typer.Option("--ep", min=1, rich_help_panel=P_PAR,
                                              help="Expert-parallel degree, MoE models only.")]
EtpOpt = Annotated[Optional[int], typer.Option("--etp", min=1, rich_help_panel=P_PAR,
                                               help="Expert tensor-parallel degree (estimate: default --tp).")]
MbsOpt = Annotated[Optional[int], typer.Option("--mbs", min=1, rich_help_panel=P_PAR,
                                               help="Micro-batch size, in sequences.")]
ZeroOpt = Annotated[Optional[int], typer.Option("--zero", min=0, max=3, rich_help_panel=P_PAR, help=(
    "ZeRO stage 0-3: 1 shards optimizer state (Megatron distributed optimizer), 2 also gradients, "
    "3 also weights (FSDP)."))]
SpOpt = Annotated[Optional[bool], typer.Option("--sp/--no-sp", rich_help_panel=P_PAR, show_default=False, help=(
    "Sequence parallelism with TP (estimate: on when --tp > 1)."))]
ScheduleOpt = Annotated[Optional[Literal["1f1b", "interleaved", "gpipe", "zb"]], typer.Option(
    "--schedule", rich_help_panel=P_PAR,
    help="Pipeline schedule (zb = zero-bubble ZB-H1; interleaved needs --vpp > 1).")]
OrderOpt = Annotated[Optional[RankOrder], typer.Option("--order", rich_help_panel=P_PAR, help=(
    "rank order of the dimensions, innermost first: tp-cp-dp-pp (Megatron default) or tp-cp-pp-dp "
    "(--use-tp-pp-dp-mapping; needs ep=1); plan: pins it"))]
RecomputeModulesOpt = Annotated[Optional[str], typer.Option(
    "--recompute-modules", metavar="MODULE[,MODULE...]", rich_help_panel=P_PAR, help=(
        "What selective recomputation re-runs (Megatron-Core --recompute-modules): core_attn (default), layernorm, "
        "mla_up_proj, mlp, moe_act, moe, shared_experts, comma-separated, e.g. mla_up_proj,moe_act."))]
CalibrationOpt = Annotated[Optional[str], typer.Option("--calibration", rich_help_panel=P_CLUSTER, help=(
    "Calibration file from `meshplan profile` (or a name under hardware_db/calibrations/): the device's measured "
    "GEMM, attention, memory and collective costs replace the GPU's efficiency defaults. A CPU calibration goes "
    "with --gpu cpu."))]
RuntimeOpt = Annotated[str, typer.Option("--runtime", metavar="PRESET[+OPTION...]", rich_help_panel=P_PAR, help=(
    f"Training framework behaviour: what it fuses, which kernels and which overlap it has, which schedules, CP kinds "
    f"and ZeRO stages it runs (docs/cost_model.md): {', '.join(RUNTIMES)}, with options appended as +option "
    f"({', '.join('+' + o for o in RUNTIME_OPTIONS)}), e.g. torchtitan+compile+async-tp."))]


@app.command()
def estimate(
    model: ModelOpt,
    gbs: GbsOpt = 256,
    seq: SeqOpt = 4096,
    dtype: DtypeOpt = "bf16",
    fp8_recipe: Fp8RecipeOpt = "tensorwise",
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    gpus_per_node: PerNodeOpt = None,
    nic_gbps: NicOpt = None,
    nvlink_gbs: NvlinkOpt = None,
    cluster_file: ClusterOpt = None,
    tp: TpOpt = None,
    pp: PpOpt = None,
    vpp: VppOpt = None,
    dp: DpOpt = None,
    cp: CpOpt = None,
    cp_comm: CpCommOpt = None,
    ep: EpOpt = None,
    etp: EtpOpt = None,
    mbs: MbsOpt = None,
    zero: ZeroOpt = None,
    recompute: Annotated[Optional[Literal["none", "selective", "full"]], typer.Option(
        "--recompute", rich_help_panel=P_PAR,
        help="Activation recomputation: none, selective (attention core) or full (whole layer) (default none).")] = None,
    recompute_modules: RecomputeModulesOpt = None,
    offload_layers: Annotated[Optional[int], typer.Option(
        "--offload-layers", min=0, rich_help_panel=P_PAR, help=(
            "Keep this many decoder layers' activations in host memory between forward and backward (Megatron "
            "--cpu-offloading-num-layers): needs --pp 1, no recomputation and the GPU's host_link_gb_s."))] = None,
    sp: SpOpt = None,
    schedule: ScheduleOpt = None,
    order: OrderOpt = None,
    runtime: RuntimeOpt = DEFAULT_RUNTIME,
    calibration: CalibrationOpt = None,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel=P_OUT, help=(
        "Print the estimate as JSON (step_time_s, tokens_per_s, tokens_per_s_per_gpu, tflops_per_gpu, mfu, hfu, "
        "peak_memory_gib, fits, breakdown_s, stages, ...) and nothing else."))] = False,
) -> None:
    """Estimate one configuration: step time and its breakdown, throughput, MFU/HFU and memory per GPU.

    Unset knobs take defaults: tp, pp, vpp, cp, ep, mbs 1; dp fills the GPUs; ZeRO 1; recompute none;
    sequence parallelism on with TP; schedule interleaved when vpp > 1, else 1f1b.
    """
    spec = load_model(model)
    cluster_spec = _cluster(cluster_file, gpu, gpus, gpus_per_node, nic_gbps, nvlink_gbs)
    workload = _workload(gbs, seq, dtype, fp8_recipe)
    knobs = dict(tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, cp_comm=cp_comm, ep=ep, etp=etp, mbs=mbs, zero=zero, recompute=recompute,
                 sp=sp, schedule=schedule, rank_order=order, recompute_modules=_modules(recompute_modules),
                 offload_layers=offload_layers)
    cfg = ParallelConfig(**{k: v for k, v in knobs.items() if v is not None})
    est = api.estimate(spec, cluster_spec, workload, cfg, runtime, calibration)
    if as_json:
        typer.echo(json.dumps(est.to_dict(), indent=2))
    else:
        _print_estimate(_console(), spec, api.calibrated(cluster_spec, calibration, runtime)[0], workload, est)


def _modules(text: str | None) -> tuple[str, ...] | None:
    """--recompute-modules a,b as a tuple; an unknown name is one error line."""
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in RECOMPUTE_MODULES]
    if unknown or not names:
        raise InputError(f"--recompute-modules {text!r}: choose from {', '.join(RECOMPUTE_MODULES)}")
    return names


def _workload(gbs: int, seq: int, dtype: str, fp8_recipe: str) -> Workload:
    if fp8_recipe != "tensorwise" and dtype != "fp8":
        raise InputError(f"--fp8-recipe {fp8_recipe} needs --dtype fp8")
    return Workload(global_batch=gbs, seq_len=seq, dtype=dtype, fp8_recipe=fp8_recipe)


BREAKDOWN_LABELS = {
    "compute": "compute (forward + backward)",
    "recompute": "recompute (activation recomputation)",
    "pp_comm": "PP send/recv (exposed)",
    "pipeline_bubble": "pipeline bubble",
    "dp_comm": "DP gradient reduce / param gather (exposed)",
    "optimizer": "optimizer step",
    "offload_comm": "activation offload to host (exposed)",
}


def _print_estimate(con: Console, spec: ModelSpec, cluster: Cluster, wl: Workload, est: Estimate) -> None:
    lay = est.layout
    con.print(f"[bold]{spec.name}[/] ({spec.total_params() / 1e9:.1f} B params, {spec.active_params() / 1e9:.1f} B "
              f"active) on {cluster.num_gpus} x {cluster.gpu.display_name} ({cluster.num_nodes} node(s) of "
              f"{cluster.gpus_per_node}), runtime {est.runtime}")
    con.print(f"workload: {wl.global_batch} sequences x {wl.seq_len} tokens = {wl.tokens / 1e6:.2f} M tokens/step, "
              f"{wl.dtype}")
    con.print(f"layout: tp {lay.tp}, pp {lay.pp}, vpp {lay.vpp}, dp {lay.dp}, cp {lay.cp}, ep {lay.ep}, "
              f"etp {lay.etp}, mbs {lay.mbs}, {lay.num_microbatches} micro-batches, zero {lay.zero}, "
              f"recompute {lay.recompute}, sp {'on' if lay.sp else 'off'}, schedule {lay.schedule}, "
              f"order {lay.rank_order}")

    step = est.step_time_s
    t = Table(title="Step time breakdown (critical pipeline rank)", title_justify="left")
    t.add_column("component")
    t.add_column("seconds", justify="right")
    t.add_column("% of step", justify="right")
    for key, sec in est.breakdown_s.items():
        label = BREAKDOWN_LABELS.get(key) or f"{key.removesuffix('_comm').upper()} comm (exposed)"
        t.add_row(label, f"{sec:.3f}", f"{100 * sec / step:.1f}")
    t.add_row("[bold]step time[/]", f"[bold]{step:.3f}[/]", "100.0")
    con.print(t)

    t = Table(title="Throughput", title_justify="left")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("step time", f"{step:.3f} s")
    t.add_row("tokens/s", f"{est.tokens_per_s:,.0f}")
    t.add_row("tokens/s/GPU", f"{est.tokens_per_s_per_gpu:,.1f}")
    t.add_row("TFLOP/s/GPU (model FLOPs)", f"{est.tflops_per_gpu:.1f}")
    t.add_row(f"MFU (vs {wl.dtype} dense peak)", f"{100 * est.mfu:.1f} %"
              + (" [bold yellow](above every published run of its class)[/]" if est.realism and est.realism.exceeds
                 else ""))
    t.add_row("HFU (with recompute FLOPs)", f"{100 * est.hfu:.1f} %")
    t.add_row("pipeline bubble fraction", f"{100 * est.bubble_fraction:.1f} %")
    con.print(t)

    stages = est.to_dict()["stages"]
    peak = max(stages, key=lambda s: s["peak_memory_gib"])
    shown = {"only": stages[0]} if len(stages) == 1 else {"first": stages[0], "last": stages[-1]}
    if peak["rank"] not in (stages[0]["rank"], stages[-1]["rank"]):
        shown["peak"] = peak  # a middle stage holds the most
    t = Table(title="Memory per GPU (GiB)", title_justify="left")
    t.add_column("component")
    ranges = stage_ranges(lay)  # with virtual stages a rank holds several separate layer ranges
    for which, s in shown.items():
        spans = ", ".join(f"{a}-{a + n - 1}" for a, n in ranges[s["rank"]] if n)
        t.add_column(f"{which} stage (rank {s['rank']}, layers {spans})", justify="right")
    shown = list(shown.values())
    for key in shown[0]["memory_gib"]:
        t.add_row(key, *(f"{s['memory_gib'][key]:.2f}" for s in shown))
    t.add_row("[bold]total[/]", *(f"[bold]{s['peak_memory_gib']:.2f}[/]" for s in shown))
    t.add_row("HBM", *(f"{est.hbm_gib:.0f}" for _ in shown))
    t.add_row("fits", *("[green]yes[/]" if s["peak_memory_gib"] <= est.hbm_gib else "[bold red]NO[/]"
                        for s in shown))
    con.print(t)
    if est.realism is not None:
        con.print(("[bold yellow]realism:[/] " if est.realism.exceeds else "realism: ") + est.realism.line())
    if est.fits:
        con.print(f"[green]memory: fits[/] (peak {est.peak_memory_gib:.1f} GiB of {est.hbm_gib:.0f} GiB HBM)")
    else:
        con.print(f"[bold red]memory: does NOT fit[/] (peak {est.peak_memory_gib:.1f} GiB > {est.hbm_gib:.0f} GiB "
                  f"HBM); try more --pp/--tp, --recompute selective|full, a higher --zero or a smaller --mbs")


# ---- plan ----------------------------------------------------------------------------------------------------------

@app.command()
def plan(
    model: ModelOpt,
    gbs: GbsOpt = 256,
    seq: SeqOpt = 4096,
    dtype: DtypeOpt = "bf16",
    fp8_recipe: Fp8RecipeOpt = "tensorwise",
    gpu: GpuOpt = None,
    gpus: GpusOpt = None,
    gpus_per_node: PerNodeOpt = None,
    nic_gbps: NicOpt = None,
    nvlink_gbs: NvlinkOpt = None,
    cluster_file: ClusterOpt = None,
    tp: TpOpt = None,
    pp: PpOpt = None,
    vpp: VppOpt = None,
    dp: DpOpt = None,
    cp: CpOpt = None,
    cp_comm: CpCommOpt = None,
    ep: EpOpt = None,
    etp: EtpOpt = None,
    mbs: MbsOpt = None,
    zero: ZeroOpt = None,
    recompute: Annotated[Optional[Literal["none", "selective", "full", "per-stage"]], typer.Option(
        "--recompute", rich_help_panel=P_PAR, help=(
            "Pin recomputation: none, selective, full, or per-stage (each stage none, selective or full on its "
            "first k layers, chosen by the CP-SAT partitioner)."))] = None,
    recompute_modules: RecomputeModulesOpt = None,
    sp: SpOpt = None,
    schedule: ScheduleOpt = None,
    order: OrderOpt = None,
    runtime: RuntimeOpt = DEFAULT_RUNTIME,
    calibration: CalibrationOpt = None,
    max_mbs: Annotated[int, typer.Option("--max-mbs", min=1, max=2**17, rich_help_panel=P_PAR,
                                         help="Largest micro-batch size searched.")] = 16,
    top: Annotated[int, typer.Option("--top", min=1, max=100, rich_help_panel=P_OUT,
                                     help="How many of the best plans to rank in the table (at most 100).")] = 5,
    time_limit: Annotated[Optional[float], typer.Option("--time-limit", min=0.001, rich_help_panel=P_OUT, help=(
        "Stop after about this many seconds and return the best plan found with its proven optimality gap; a "
        "quick first plan comes before the exact search, and the limit waits for it."))] = None,
    out: Annotated[Optional[Path], typer.Option("--out", rich_help_panel=P_OUT, help=(
        "Write the best plan as Plan JSON (schema v1, planner/plan.schema.json) to this file."))] = None,
    trace: Annotated[Optional[Path], typer.Option("--trace", rich_help_panel=P_OUT, help=(
        "Write the best plan's simulated pipeline timeline as a Chrome trace (open in ui.perfetto.dev)."))] = None,
    explain_: Annotated[bool, typer.Option("--explain", rich_help_panel=P_OUT, help=(
        "Say why the best plan beats the runner-up and which constraint binds."))] = False,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel=P_OUT, help=(
        "Print the best plan as Plan JSON and nothing else."))] = False,
    timing: Annotated[bool, typer.Option("--timing", rich_help_panel=P_OUT, help=(
        "Record the search's wall time in the plan JSON (search.seconds). Off by default, so the same input "
        "writes a byte-identical plan; the table shows the time either way."))] = False,
    export_to: Annotated[Optional[ExportTarget], typer.Option("--export", rich_help_panel=P_OUT, help=(
        "Also export the best plan for a launcher (as `meshplan export`): printed after the table, or written "
        "to --export-out."))] = None,
    export_out: Annotated[Optional[Path], typer.Option("--export-out", rich_help_panel=P_OUT, help=(
        "Where --export writes: the file, or a directory when the export has several files."))] = None,
) -> None:
    """Search every parallel configuration and return the fastest that fits, proven optimal under the cost model.

    Every knob flag pins that knob; the others are searched: tp (within a node), cp, pp with uneven stages or
    virtual stages, dp, ep/etp (MoE), micro-batch size, ZeRO 0-3, recomputation (also per stage), sequence
    parallelism and the schedule. The table ranks the best --top plans; the account below it says how large the
    space was, what was pruned by which bound, what was infeasible and why, and whether optimality is proven.
    """
    from meshplan.planner.explain import explain
    from meshplan.planner.launchers import export_files, export_plan
    from meshplan.planner.plan import plan_text
    from meshplan.planner.space import Pins
    from meshplan.planner.trace import chrome_trace, trace_text

    if export_out is not None and export_to is None:
        raise InputError("--export-out needs --export TARGET")
    if as_json and export_to is not None and export_out is None:
        raise InputError("--json prints only the plan; give --export-out for the --export files")
    out, trace, export_out = _targets(out=out, trace=trace, export_out=export_out)

    spec = load_model(model)
    cluster_spec = _cluster(cluster_file, gpu, gpus, gpus_per_node, nic_gbps, nvlink_gbs)
    workload = _workload(gbs, seq, dtype, fp8_recipe)
    pins = Pins(tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, cp_comm=cp_comm, ep=ep, etp=etp, mbs=mbs, zero=zero,
                recompute=recompute, sp=sp, schedule=schedule, order=order, max_mbs=max_mbs,
                **({} if recompute_modules is None else {"recompute_modules": _modules(recompute_modules)}))
    with _progress(not as_json) as bar:
        found = api.search_plans(spec, cluster_spec, workload, pins, runtime, calibration, top, time_limit, timing,
                                 progress=bar)
    doc, result, sim = found.plan, found.result, found.simulated
    cluster = api.calibrated(cluster_spec, calibration, runtime)[0]
    exported = export_plan(doc, export_to) if export_to is not None else None  # refuses before anything is written
    files = [OutputFile(out, plan_text(doc))] if out is not None else []
    written = export_files(exported, export_out) if exported is not None and export_out is not None else []
    files += written
    if trace is not None:
        files.append(OutputFile(trace, trace_text(chrome_trace(sim))))
    write_all(files)  # all or none, after every one of them is made
    written = [f.path for f in written]
    if as_json:
        typer.echo(doc.model_dump_json(indent=2))
        return
    con = _console()
    _print_ranking(con, spec, cluster, workload, result)
    if explain_:
        for line in explain(result):
            con.print(line)
    if out is not None:
        con.print(f"plan written to {out}")
    if trace is not None:
        con.print(f"trace written to {trace} (open in https://ui.perfetto.dev)")
    if exported is not None:
        if export_out is not None:
            con.print(f"{export_to} export written to {', '.join(map(str, written))}")
        else:
            _echo_export(exported)


class _progress:
    """A transient rich progress bar on stderr over the search's candidate groups (only on a terminal)."""

    def __init__(self, enabled: bool):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
        self.enabled = enabled and sys.stderr.isatty()
        self.bar = Progress(TextColumn("searching"), BarColumn(), TextColumn("{task.completed}/{task.total} groups"),
                            TimeElapsedColumn(), console=Console(stderr=True), transient=True,
                            disable=not self.enabled)
        self.task = None

    def __enter__(self):
        self.bar.__enter__()
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def __call__(self, done: int, total: int) -> None:
        if self.task is None:
            self.task = self.bar.add_task("search", total=total)
        self.bar.update(self.task, completed=done, total=total)


def _stages_text(lay) -> str:
    if lay.pp == 1:
        return str(sum(lay.stage_layers))
    text = "-".join(map(str, lay.stage_layers)) if len(set(lay.stage_layers)) > 1 else f"{lay.pp}x{lay.stage_layers[0]}"
    return text if lay.vpp == 1 else f"{text} /{lay.vpp}v"


def _recompute_text(lay) -> str:
    if lay.recompute != "per-stage":
        return lay.recompute
    return ",".join(p.label(n) for p, n in zip(lay.stage_recompute, lay.stage_layers))


def _print_ranking(con: Console, spec: ModelSpec, cluster: Cluster, wl: Workload, result) -> None:
    acc = result.account
    moe = spec.moe is not None
    con.print(f"[bold]{spec.name}[/] on {cluster.num_gpus} x {cluster.gpu.display_name} ({cluster.num_nodes} node(s) "
              f"of {cluster.gpus_per_node}); {wl.global_batch} x {wl.seq_len} tokens per step, {wl.dtype}")
    t = Table(title=f"Best {len(result.plans)} plans (predicted)", title_justify="left")
    orders = any(p.estimate.layout.rank_order != DEFAULT_RANK_ORDER for p in result.plans)  # column only if used
    cols = ["#", "tp", "cp", "pp", "dp"] + (["ep", "etp"] if moe else []) + (["order"] if orders else []) + [
        "mbs", "zero", "sp", "recompute", "schedule", "layers/stage", "step s", "tok/s/GPU", "MFU %", "peak GiB"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("order", "recompute", "schedule", "layers/stage") else "right")
    for n, p in enumerate(result.plans, 1):
        e, lay = p.estimate, p.estimate.layout
        row = [str(n), str(lay.tp), str(lay.cp) + ("" if lay.cp == 1 else f" {lay.cp_comm}"), str(lay.pp), str(lay.dp)]
        if moe:
            row += [str(lay.ep), str(lay.etp)]
        if orders:
            row.append(lay.rank_order)
        row += [str(lay.mbs), str(lay.zero), "on" if lay.sp else "off", _recompute_text(lay), lay.schedule,
                _stages_text(lay), f"{e.step_time_s:.3f}", f"{e.tokens_per_s_per_gpu:,.0f}", f"{100 * e.mfu:.1f}",
                f"{e.peak_memory_gib:.1f}"]
        t.add_row(*row)
    con.print(t)
    pruned = ", ".join(f"{v:,} by {k}" for k, v in sorted(acc.pruned.items(), key=lambda x: -x[1])) or "none"
    infeasible = ", ".join(f"{v:,} {k}" for k, v in sorted(acc.infeasible.items(), key=lambda x: -x[1])) or "none"
    con.print(f"search: {acc.space_size:,} candidates in the space; {acc.evaluated:,} simulated, {acc.bounded:,} "
              f"partition bounds solved ({acc.cpsat_calls} with CP-SAT); {acc.seconds:.2f} s")
    con.print(f"  pruned: {pruned}")
    con.print(f"  infeasible: {infeasible}")
    best = result.plans[0].estimate.realism
    if best is not None:
        con.print(("[bold yellow]realism of plan #1:[/] " if best.exceeds else "realism of plan #1: ") + best.line())
    if acc.status == "optimal":
        con.print("[green]optimal[/]: no candidate in the space is predicted faster (proven by the bounds above)")
    else:
        con.print(f"[yellow]{acc.status}[/]: the best plan is within {100 * acc.gap:.2f} % of optimal "
                  f"(no candidate can beat {acc.lower_bound_s:.3f} s)")


@app.command()
def serve(
    model: ModelOpt,
    gpu: GpuOpt = None,
    gpus: Annotated[Optional[str], typer.Option("--gpus", rich_help_panel=P_CLUSTER, help=(
        "GPUs: N (at most N) or A-B (deployments using A to B)."))] = None,
    gpus_per_node: PerNodeOpt = None,
    nic_gbps: NicOpt = None,
    nvlink_gbs: NvlinkOpt = None,
    isl: Annotated[Optional[int], typer.Option("--isl", min=1, rich_help_panel=P_MODEL, help=(
        "Input (prompt) tokens per request."))] = None,
    osl: Annotated[Optional[int], typer.Option("--osl", min=1, rich_help_panel=P_MODEL, help=(
        "Output tokens per request."))] = None,
    lengths: Annotated[Optional[Path], typer.Option("--lengths", rich_help_panel=P_MODEL, help=(
        "CSV of request lengths (columns input_tokens,output_tokens, or isl,osl): their means are the workload."))
    ] = None,
    ttft_ms: Annotated[Optional[float], typer.Option("--ttft-ms", min=0.001, max=1e9, rich_help_panel=P_PAR, help=(
        "Time-to-first-token target, ms."))] = None,
    tpot_ms: Annotated[Optional[float], typer.Option("--tpot-ms", min=0.001, max=1e9, rich_help_panel=P_PAR, help=(
        "Time-per-output-token target, ms."))] = None,
    e2e_ms: Annotated[Optional[float], typer.Option("--e2e-ms", min=0.001, rich_help_panel=P_PAR, help=(
        "End-to-end latency target (TTFT + OSL x TPOT), ms."))] = None,
    objective: Annotated[Literal["throughput", "min-gpus"], typer.Option("--objective", rich_help_panel=P_PAR,
        help="throughput: most output tokens/s per GPU; min-gpus: fewest GPUs for --request-rate.")
    ] = "throughput",
    request_rate: Annotated[Optional[float], typer.Option("--request-rate", min=0.000001, rich_help_panel=P_PAR,
        help="Requests/s to serve (objective min-gpus).")] = None,
    weight_dtype: Annotated[Literal["bf16", "fp8"], typer.Option("--weight-dtype", rich_help_panel=P_MODEL,
        help="Weights and GEMMs in bf16 or fp8.")] = "bf16",
    kv_dtype: Annotated[Literal["bf16", "fp8"], typer.Option("--kv-dtype", rich_help_panel=P_MODEL,
        help="KV cache precision.")] = "bf16",
    mem_fraction: Annotated[float, typer.Option("--mem-fraction", min=0.05, max=1.0, rich_help_panel=P_PAR, help=(
        "Fraction of HBM an engine uses (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static)."))] = 0.9,
    disaggregation: Annotated[bool, typer.Option("--disaggregation/--no-disaggregation", rich_help_panel=P_PAR,
        help="Also search separate prefill and decode pools.")] = True,
    layout: Annotated[Optional[str], typer.Option("--layout", rich_help_panel=P_PAR, help=(
        "Evaluate this engine instead of searching, e.g. tp8 or tp4,dp80,ep320 (the decode pool with "
        "--prefill-layout)."))] = None,
    prefill_layout: Annotated[Optional[str], typer.Option("--prefill-layout", rich_help_panel=P_PAR, help=(
        "With --layout: a disaggregated deployment with this prefill engine, e.g. tp4,dp8,ep32."))] = None,
    engines: Annotated[Optional[int], typer.Option("--engines", min=1, rich_help_panel=P_PAR, help=(
        "With --layout: engines of it (default: fill the GPUs, or 1 decode engine)."))] = None,
    prefill_engines: Annotated[Optional[int], typer.Option("--prefill-engines", min=1, rich_help_panel=P_PAR, help=(
        "With --prefill-layout: prefill engines (default: as many as the decode pool needs)."))] = None,
    batch: Annotated[Optional[int], typer.Option("--batch", min=1, rich_help_panel=P_PAR, help=(
        "With --layout: running sequences per engine (default: the best that meets the targets)."))] = None,
    top: Annotated[int, typer.Option("--top", min=1, max=100, rich_help_panel=P_OUT,
                                     help="Deployments to rank (at most 100).")] = 5,
    time_limit: Annotated[Optional[float], typer.Option("--time-limit", min=0.001, rich_help_panel=P_OUT, help=(
        "Stop taking engine layouts (smallest engines first) after about this many seconds, once a deployment "
        "can be formed; the report says how many were left."))] = None,
    out: Annotated[Optional[Path], typer.Option("--out", rich_help_panel=P_OUT, help=(
        "Write the best deployment as a serving plan (Plan JSON, kind serving)."))] = None,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel=P_OUT, help=(
        "Print the serving plan as JSON and nothing else."))] = False,
    timing: Annotated[bool, typer.Option("--timing", rich_help_panel=P_OUT, help=(
        "Record the search's wall time in the plan JSON (search.seconds). Off by default, so the same input "
        "writes a byte-identical plan; the table shows the time either way."))] = False,
    export_to: Annotated[Optional[Literal["vllm", "sglang"]], typer.Option("--export", rich_help_panel=P_OUT, help=(
        "Also export the best deployment's command lines (printed, or written to --export-out)."))] = None,
    export_out: Annotated[Optional[Path], typer.Option("--export-out", rich_help_panel=P_OUT, help=(
        "Where --export writes."))] = None,
) -> None:
    """Search serving deployments: TP, attention DP, PP and EP per engine, batch and chunk sizes, aggregated or
    disaggregated prefill and decode pools, under TTFT and TPOT targets.

    Reports the deployments that meet the targets ranked by output tokens/s per GPU (or fewest GPUs for
    --request-rate), the Pareto front of tokens/s/GPU vs tokens/s/user, and why the runners-up lose; when
    nothing meets the targets, the nearest miss and what it misses.
    """
    from meshplan.planner.launchers import export_files, export_plan
    from meshplan.planner.plan import plan_text
    from meshplan.planner.serve import load_lengths, parse_engine_layout, parse_gpu_range, workload_from

    out, export_out = _targets(out=out, export_out=export_out)
    if export_out is not None and export_to is None:
        raise InputError("--export-out needs --export vllm|sglang")
    if as_json and export_to is not None and export_out is None:
        raise InputError("--json prints only the plan; give --export-out for the --export files")
    if layout is None and (prefill_layout or engines or prefill_engines or batch):
        raise InputError("--prefill-layout, --engines, --prefill-engines and --batch go with --layout")
    spec = load_model(model)
    low, high = parse_gpu_range(gpus)
    cluster_spec = _cluster(None, gpu, high, gpus_per_node, nic_gbps, nvlink_gbs)
    wl = workload_from(isl, osl, load_lengths(lengths) if lengths else None, weight_dtype, kv_dtype)
    targets = ServeTargets(ttft_ms=ttft_ms, tpot_ms=tpot_ms, e2e_ms=e2e_ms, request_rate=request_rate)
    pinned = None if layout is None else api.PinnedDeployment(
        parse_engine_layout(layout), engines, batch, parse_engine_layout(prefill_layout) if prefill_layout else None,
        prefill_engines)
    found = api.search_deployments(spec, cluster_spec, wl, targets, low, objective, disaggregation, top,
                                   mem_fraction, time_limit, pinned, timing)
    doc, result, alternatives = found.plan, found.result, list(found.alternatives)
    cluster = Cluster(cluster_spec)
    exported = export_plan(doc, export_to) if export_to is not None else None
    written = export_files(exported, export_out) if exported is not None and export_out is not None else []
    write_all(([OutputFile(out, plan_text(doc))] if out is not None else []) + written)
    written = [f.path for f in written]
    if as_json:
        typer.echo(doc.model_dump_json(indent=2))
        return
    con = _console()
    _print_serving(con, spec, cluster, wl, targets, doc, result, alternatives)
    if out is not None:
        con.print(f"serving plan written to {out}")
    if exported is not None:
        if export_out is not None:
            con.print(f"{export_to} export written to {', '.join(map(str, written))}")
        else:
            _echo_export(exported)


def _print_serving(con: Console, spec: ModelSpec, cluster: Cluster, wl: Any, targets: Any, doc: Any, result: Any,
                   alternatives: list[str]) -> None:
    src = f" ({wl.source})" if wl.source else ""
    aims = ", ".join(f"{k} {v:g} ms" for k, v in (("TTFT", targets.ttft_ms), ("TPOT", targets.tpot_ms),
                                                    ("end-to-end", targets.e2e_ms)) if v is not None) or "none"
    con.print(f"{spec.name} on up to {cluster.num_gpus} x {cluster.gpu.name}; ISL {wl.isl}, OSL {wl.osl}{src}; "
              f"weights {wl.weight_dtype}, KV {wl.kv_dtype}; targets: {aims}")
    if result is not None:
        table = Table(title="deployments that meet the targets")
        for col in ("#", "deployment", "GPUs", "tok/s/GPU", "tok/s/user", "TTFT ms", "TPOT ms", "req/s"):
            table.add_column(col, justify="left" if col == "deployment" else "right")
        for i, d in enumerate(result.ranked, 1):
            table.add_row(str(i), d.label(), str(d.gpus), f"{d.tokens_per_s_per_gpu:,.0f}",
                          f"{d.tokens_per_s_per_user:.1f}", f"{d.ttft_s * 1e3:.0f}", f"{d.tpot_s * 1e3:.1f}",
                          f"{d.requests_per_s:.2f}")
        con.print(table)
    if doc.search is not None:
        front = Table(title="Pareto front: tokens/s/GPU vs tokens/s/user (every deployment evaluated)")
        for col in ("deployment", "GPUs", "tok/s/GPU", "tok/s/user", "TTFT ms", "TPOT ms", "meets"):
            front.add_column(col, justify="left" if col == "deployment" else "right")
        for d in doc.search.pareto:
            front.add_row(d.deployment, str(d.gpus), f"{d.tokens_per_s_per_gpu:,.0f}",
                          f"{d.tokens_per_s_per_user:.1f}", f"{d.ttft_ms:.0f}", f"{d.tpot_ms:.1f}",
                          "yes" if d.meets_targets else "no")
        con.print(front)
        seconds = result.seconds if result is not None else doc.search.seconds  # a plan shown: only with --timing
        con.print(f"search: {doc.search.evaluated:,} engine configurations"
                  + ("" if seconds is None else f" in {seconds:.2f} s"))
        if doc.search.layouts_skipped:
            con.print(f"time-limit: {doc.search.layouts_skipped:,} engine layouts (the largest) not evaluated; "
                      f"raise --time-limit to search them")
    p = doc.prediction
    con.print(f"best: {doc.mode}, {p.gpus} GPUs: {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU, "
              f"{p.tokens_per_s_per_user:.1f} tokens/s/user, TTFT {p.ttft_ms:.0f} ms, TPOT {p.tpot_ms:.1f} ms, "
              f"{p.requests_per_s:.2f} requests/s" + ("" if p.meets_targets else f" (misses {p.misses})"))
    for e in doc.engines:
        con.print(f"  {e.engines} x {e.role} engine TP{e.tp} DP{e.dp} PP{e.pp} EP{e.ep} ({e.gpus_per_engine} GPUs): "
                  f"max {e.max_num_seqs} seqs, {e.max_num_batched_tokens} tokens/iteration, weights "
                  f"{e.weights_gib:.1f} GiB + KV {e.kv_cache_gib:.1f} GiB per GPU ({e.kv_tokens:,} tokens)")
    for line in alternatives:
        con.print(f"  vs {line}")


@app.command()
def profile(
    device: Annotated[Literal["cpu", "cuda"], typer.Option("--device", help=(
        "What to profile: cpu (this host, one thread per rank, collectives on gloo) or cuda (GPU 0; NCCL "
        "collectives when more than one GPU is visible)."))] = "cpu",
    quick: Annotated[bool, typer.Option("--quick", help=(
        "Fewer sizes and repetitions: under 2 minutes on a 2-core CPU."))] = False,
    out: Annotated[Optional[Path], typer.Option("--out", help=(
        "Calibration file to write (atomically). Default: hardware_db/calibrations/<device>.json in meshplan's "
        "install, so --calibration <device> finds it by name."))] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=(
        "Model whose layer GEMMs, attention heads and widths are profiled (zoo name or config file). Default: "
        "Llama-3.1-8B on a GPU; on a CPU a hidden-256 model of the same structure."))] = None,
    gpu: Annotated[Optional[str], typer.Option("--gpu", help=(
        "hardware_db GPU this device is (default: read from the device's name)."))] = None,
    dtype: Annotated[Optional[Literal["float64", "float32", "bfloat16", "float16"]], typer.Option("--dtype", help=(
        "Operator dtype (default: float64 on a CPU, verify's default there; bfloat16 on a GPU)."))] = None,
    ranks: Annotated[Optional[list[int]], typer.Option("--ranks", help=(
        "Group sizes to time collectives on (repeatable; default 2 on a CPU, every GPU on a GPU host)."))] = None,
    tp: Annotated[Optional[list[int]], typer.Option("--tp", help=(
        "TP degrees whose sharded GEMM and attention shapes are profiled (repeatable; default 1 2)."))] = None,
    statistic: Annotated[Literal["median", "min"], typer.Option("--statistic", help=(
        "Which repetition each measurement keeps: the median, or the fastest (for a shared host whose speed "
        "drifts; then also compare with the fastest measured runs)."))] = "median",
) -> None:
    """Measure this device (GEMMs, attention, memory-bound operators, collectives, a layer's activation memory) and
    write a calibration that `estimate`, `plan` and `verify --calibration` use instead of the efficiency defaults."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from meshplan.executor.profiler import ProfileOptions
    from meshplan.executor.profiler import profile as run_profile
    from meshplan.hardware_db.calibration import calibration_dir
    from meshplan.planner.plan import write_text_atomic

    (out,) = _targets(out=out)  # before the minutes of measuring
    quick_opts = dict(repeats=3, warmup=1, seq=(128, 256), tokens=(128, 512, 2048)) if quick else {}
    opts = ProfileOptions(device=device, quick=quick, model=load_model(model) if model else None, target=gpu,
                          dtype=dtype or ("float64" if device == "cpu" else "bfloat16"),
                          ranks=tuple(ranks) if ranks else ((2,) if device == "cpu" else ()), statistic=statistic,
                          **({"tp": tuple(tp)} if tp else {}), **quick_opts)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("profiling", total=None)
        cal = run_profile(opts, lambda what, done, total: bar.update(task, description=what[:60], completed=done,
                                                                     total=total))
    target = out if out is not None else calibration_dir() / f"{cal.device.target}.json"
    try:
        write_text_atomic(target, cal.model_dump_json(indent=1) + "\n")
    except OSError as exc:
        raise InputError(f"cannot write {target}: {exc.strerror}; choose a writable --out") from None
    _print_calibration(_console(), cal, target)


def _print_calibration(con: Console, cal: Any, path: Path) -> None:
    f, m = cal.fitted, cal.measurements
    con.print(f"[bold]{cal.device.name}[/] ({cal.device.target}, {cal.device.threads} thread(s)), torch "
              f"{cal.software.torch}, {cal.software.backend}; {m.dtype}")
    t = Table(title="fitted efficiency model", title_justify="left")
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_column("from")
    t.add_row("fastest GEMM", f"{f.peak_flops / 1e9:,.1f} GFLOP/s", f"{len(m.gemms)} GEMMs")
    t.add_row("GEMM curve", f"{len(f.gemm.flops)} points", "time vs FLOPs, non-decreasing")
    t.add_row("attention curve", f"{len(f.attention.flops)} points", f"{len(m.attention)} SDPA shapes, fwd + bwd")
    t.add_row("memory-bound", f"{f.memory.bytes_per_s / 1e9:,.1f} GB/s + {f.memory.alpha_s * 1e6:.1f} us",
              f"{len(m.memory_ops)} operator runs")
    for c in f.collectives:
        t.add_row(f"{c.kind} x{c.ranks}", f"{c.bytes_per_s / 1e9:,.2f} GB/s + {c.alpha_s * 1e6:.0f} us",
                  cal.software.backend)
    if f.activation_ratio is not None:
        t.add_row("layer activations", f"{f.activation_ratio:.2f} x the formula", "saved-tensor bytes")
    con.print(t)
    con.print(f"calibration written to {path}")


def _echo_export(exported: Any) -> None:
    """Print exported files to stdout: one as is, several each under a `==> name <==` line (as head does)."""
    for f in exported.files:
        if len(exported.files) > 1:
            typer.echo(f"==> {f.name} <==")
        typer.echo(f.text, nl=False)


@app.command("export")
def export_(
    plan_file: Annotated[Path, typer.Argument(help="A plan written by `meshplan plan --out` or `meshplan import`.")],
    to: Annotated[AnyExportTarget, typer.Option("--to", help=(
        "Training plans: megatron (pretrain_gpt.py arguments in a torchrun script), torchtitan (the TOML job "
        "config <= 0.2 and the config-registry function >= 0.3), deepspeed (ds_config.json and the "
        "Megatron-DeepSpeed script), torchrun (meshplan's executor on the plan's world), nemo (NeMo 2 "
        "MegatronStrategy and Megatron-Bridge overrides). Serving plans: vllm, sglang (a command line per pool)."))],
    out: Annotated[Optional[Path], typer.Option("--out", help=(
        "Write here (atomically): the file, or a directory when the export has several files. Default: print."))
    ] = None,
) -> None:
    """Turn a plan into a launcher's configuration, with the plan's predicted figures in a header comment.

    A plan the launcher cannot express (a schedule it lacks, a ZeRO stage it has not, uneven stages it cannot
    place) is refused with the reason and what to re-plan with; it is never silently changed.
    """
    from meshplan.planner.launchers import export_plan, write_export
    from meshplan.planner.plan import read_any_plan

    (out,) = _targets(directories=("out",), out=out)  # export's --out is a folder when it has several files
    exported = export_plan(read_any_plan(plan_file), to)
    if out is None:
        _echo_export(exported)
        return
    written = write_export(exported, out)
    _console().print(f"{to} export written to {', '.join(map(str, written))}")


def _names_a_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # an argument string longer than a file name can be
        return False


@app.command("import")
def import_(
    source_text: Annotated[str, typer.Argument(metavar="SOURCE", help=(
        "megatron: the pretrain_gpt.py arguments in one string after `--` (optionally after `torchrun ... "
        "script.py`, which gives the world size), or a file holding them (an exported megatron.sh works); "
        "torchtitan: the TOML job config file."))],
    source: Annotated[ImportSource, typer.Option("--from", help="What SOURCE is.")],
    model: Annotated[Optional[str], typer.Option("--model", "-m", help=(
        "The model (zoo name or config file), when the arguments do not describe it whole; model arguments that "
        "are given must agree with it."))] = None,
    gpu: GpuOpt = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", min=1, rich_help_panel=P_CLUSTER, help=(
        "World size, when SOURCE does not say it (no torchrun line)."))] = None,
    gpus_per_node: PerNodeOpt = None,
    nic_gbps: NicOpt = None,
    nvlink_gbs: NvlinkOpt = None,
    cluster_file: ClusterOpt = None,
    runtime: Annotated[Optional[str], typer.Option("--runtime", metavar="PRESET[+OPTION...]", rich_help_panel=P_PAR,
                                                   help=(
        "Training framework behaviour, as for `plan`. Default: what the configuration implies (torchtitan: "
        "torchtitan with +compile, +async-tp, +cp-alltoall as its TOML turns them on), else "
        f"{DEFAULT_RUNTIME}."))] = None,
    calibration: CalibrationOpt = None,
    out: Annotated[Optional[Path], typer.Option("--out", rich_help_panel=P_OUT, help=(
        "Write the pinned plan as Plan JSON, to `meshplan show`, `export` or compare with `meshplan plan`."))] = None,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel=P_OUT, help=(
        "Print the pinned plan as Plan JSON and nothing else."))] = False,
) -> None:
    """Read the launch configuration you run today into a pinned plan and estimate it.

    Compare its step time with `meshplan plan` on the same model, cluster and batch. Arguments meshplan does not
    model (data, optimizer, logging) are ignored; ones it cannot represent are refused with the reason. A torchrun
    line's --nproc-per-node is the node size unless --gpus-per-node says otherwise.
    """
    from meshplan.planner.launchers import launch_model, launch_world, pinned_plan, read_launch
    from meshplan.planner.plan import write_plan

    (out,) = _targets(out=out)

    text, origin = source_text, "the arguments"
    path = Path(source_text)
    if source == "torchtitan" or _names_a_file(path):
        try:
            text, origin = path.read_text(encoding="utf-8"), str(path)
        except FileNotFoundError:
            raise InputError(f"{path}: no such file; pass the torchtitan TOML job config") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise InputError(f"{path}: cannot read the file ({_one_line(exc)})") from None
    named = load_model(model) if model else None
    launch = read_launch(source, text, origin, named.num_layers if named else None)
    runtime = runtime or launch.runtime or DEFAULT_RUNTIME
    world = launch_world(launch, gpus if cluster_file is None else None)
    per_node = gpus_per_node if gpus_per_node is not None or cluster_file else launch.gpus_per_node
    cluster, eff = api.calibrated(_cluster(cluster_file, gpu, None if cluster_file else world, per_node, nic_gbps,
                                           nvlink_gbs), calibration, runtime)
    if cluster.num_gpus != world:
        raise InputError(f"the cluster has {cluster.num_gpus} GPUs but the launch configuration runs {world}")
    spec = launch_model(launch, named)
    doc, sim = pinned_plan(launch, spec, cluster, runtime, eff, eff.calibration if eff else None)
    if out is not None:
        write_plan(doc, out)
    if as_json:
        typer.echo(doc.model_dump_json(indent=2))
        return
    con = _console()
    _print_estimate(con, spec, cluster, Workload(**launch.workload.model_dump()), sim.estimate)
    if out is not None:
        con.print(f"pinned plan written to {out}")


@app.command()
def show(
    plan_file: Annotated[Path, typer.Argument(help="A plan written by `meshplan plan`, `serve` or `import`.")],
    trace: Annotated[Optional[Path], typer.Option("--trace", help=(
        "Also write the plan's simulated pipeline timeline as a Chrome trace (open in ui.perfetto.dev)."))] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the validated plan as JSON.")] = False,
) -> None:
    """Print a plan file readably (and re-simulate a training plan for --trace); refuses plans of another schema
    version."""
    from meshplan.planner.plan import ServingPlan, plan_config, read_any_plan
    from meshplan.planner.trace import chrome_trace, write_trace

    (trace,) = _targets(trace=trace)
    doc = read_any_plan(plan_file)
    if isinstance(doc, ServingPlan):
        if trace is not None:
            raise InputError("--trace draws a training plan's pipeline; this is a serving plan")
        if as_json:
            typer.echo(doc.model_dump_json(indent=2))
            return
        con = _console()
        con.print(f"serving plan {plan_file} (schema v{doc.schema_version}, meshplan {doc.meshplan_version})")
        _print_serving(con, doc.inputs.model_spec(), doc.inputs.cluster.cluster(), doc.inputs.workload,
                       doc.inputs.targets, doc, None, doc.search.alternatives if doc.search else [])
        return
    if as_json:
        typer.echo(doc.model_dump_json(indent=2))
    else:
        spec, cluster, wl, cfg, runtime = plan_config(doc)
        con = _console()
        con.print(f"plan {plan_file} (schema v{doc.schema_version}, meshplan {doc.meshplan_version})")
        if doc.inputs.calibration:
            con.print(f"calibration: {doc.inputs.calibration} (the prediction in the file; the tables below are "
                      f"re-simulated with the device's efficiency as the plan stores it)")
        sim = simulate_config(spec, cluster, wl, cfg, runtime)
        _print_estimate(con, spec, cluster, wl, sim.estimate)
        if doc.search is not None:
            s = doc.search
            con.print(f"search: rank {s.rank}, {s.status} (gap {100 * s.gap:.2f} %), {s.space_size:,} candidates, "
                      f"{s.evaluated:,} simulated" + ("" if s.seconds is None else f", {s.seconds:.2f} s"))
    if trace is not None:
        spec, cluster, wl, cfg, runtime = plan_config(doc)
        write_trace(chrome_trace(simulate_config(spec, cluster, wl, cfg, runtime)), trace)
        if not as_json:
            _console().print(f"trace written to {trace}")


@app.command()
def verify(
    plan_file: Annotated[Path, typer.Argument(help="A plan written by `meshplan plan --out`.")],
    scale: Annotated[Literal["tiny", "small", "none"], typer.Option("--scale", help=(
        "Model size to run: the plan's model with its layer count, structure and divisibility kept, widths "
        "shrunk (docs/executor.md); none runs the plan's model as it is (a small model only)."))] = "tiny",
    steps: Annotated[int, typer.Option("--steps", min=1, max=MAX_VERIFY_STEPS, help=(
        "AdamW steps; parameters are compared after the last."))] = 2,
    seq: Annotated[Optional[int], typer.Option("--seq", min=1, max=MAX_SEQ_LEN, help=(
        "Tokens per sequence (default 16, raised to a multiple of 2 x cp x tp)."))] = None,
    microbatches: Annotated[Optional[int], typer.Option("--microbatches", min=1, max=MAX_GLOBAL_BATCH, help=(
        "Micro-batches per step (default: the plan's); fewer keeps a big plan's run short."))] = None,
    dtype: Annotated[Literal["float64", "float32"], typer.Option("--dtype", help=(
        "float64 checks to 1e-6 (relative), float32 to 1e-4."))] = "float64",
    backend: Annotated[Literal["gloo", "nccl"], typer.Option("--backend", help=(
        "Process-group backend. gloo: CPU tensors (the executor's only one so far); nccl: GPUs (not yet)."))] = "gloo",
    launcher: Annotated[Optional[Literal["spawn", "torchrun"]], typer.Option("--launcher", help=(
        "spawn: start the plan's ranks here, one process each. torchrun: this process is one rank of a torchrun "
        "world of the plan's size (rank 0 prints the report). Default: torchrun when RANK is set, else spawn."))] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=1, max=MAX_VERIFY_TIMEOUT_S, help=(
        "Seconds before a rank that has not finished ends the run (with that rank's name)."))] = 300.0,
    max_ranks: Annotated[int, typer.Option("--max-ranks", min=1, max=MAX_VERIFY_RANKS, help=(
        "Refuse plans with more ranks than this on gloo (each rank is a process holding a model copy)."))] = 16,
    out: Annotated[Optional[Path], typer.Option("--out", help="Write the report as JSON (atomically).")] = None,
    trace: Annotated[Optional[Path], typer.Option("--trace", help=(
        "Write a Chrome trace (open in ui.perfetto.dev): the cost model's simulated step of this run above the ranks' "
        "measured last step, one track per stage / rank."))] = None,
    calibration: Annotated[Optional[str], typer.Option("--calibration", help=(
        "A calibration of this host's CPU (meshplan profile --device cpu): the prediction beside the measurement is "
        "then for this run on this host, not on the plan's GPUs."))] = None,
    inject: Annotated[Optional[str], typer.Option("--inject", hidden=True, help=(
        "Run a deliberately broken layout (see executor.plan_run.INJECTIONS) to see the check fail."))] = None,
) -> None:
    """Run the plan's exact layout (every degree, rank order, stage split, schedule, ZeRO stage, recomputation) on
    torch.distributed at a reduced model size, and check that loss, every gradient and the parameters after N
    steps match a single-process run; measured memory and time are shown beside the cost model's prediction.
    Exit code 0: the numerics match; 1: they do not (the report says where); 2: bad input."""
    from meshplan.executor.verify import VerifyOptions, run_verify
    from meshplan.planner.plan import ServingPlan, read_any_plan
    from meshplan.planner.trace import trace_text

    out, trace = _targets(out=out, trace=trace)
    doc = read_any_plan(plan_file)
    if isinstance(doc, ServingPlan):
        try:
            _verify_serving(doc, scale, steps, seq, max_ranks, timeout, calibration, inject, out)
        except RuntimeError as exc:  # a rank that raised or hung (executor.launch.RankFailure): one line, exit 1
            if type(exc).__name__ != "RankFailure":
                raise
            _error(_one_line(exc))
            raise typer.Exit(1) from None
        return
    if launcher is None:
        launcher = "torchrun" if "RANK" in os.environ else "spawn"
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if launcher == "torchrun" and missing:
        raise InputError(f"--launcher torchrun runs under torchrun, but {', '.join(missing)} are not set; start "
                         f"it as `torchrun --nproc-per-node N $(which meshplan) verify ...`, or use --launcher spawn")
    opts = VerifyOptions(scale=scale, steps=steps, seq=seq, microbatches=microbatches, dtype=dtype, backend=backend,
                         launcher=launcher, timeout_s=timeout, max_ranks=max_ranks, inject=inject,
                         calibration=load_calibration(calibration) if calibration is not None else None,
                         calibration_origin=calibration or "the calibration")
    con = _console()
    try:
        outcome = run_verify(doc, opts, progress=lambda text: con.print(f"[dim]{text}[/]"))
    except RuntimeError as exc:  # executor.launch.RankFailure: one line naming the rank that failed or hung
        if type(exc).__name__ != "RankFailure":
            raise
        _error(_one_line(exc))
        raise typer.Exit(1) from None
    except TimeoutError as exc:  # --timeout on the single-process reference run (executor/verify.py)
        _error(_one_line(exc))
        raise typer.Exit(1) from None
    report = outcome.report
    if report is None:  # a torchrun rank other than 0: rank 0 prints and writes; exit as it does
        raise typer.Exit(0 if outcome.ok else 1)
    _print_verify(con, report)
    write_all(([OutputFile(out, report.to_json())] if out is not None else [])
              + ([OutputFile(trace, trace_text(dict(outcome.trace)))] if trace is not None else []))
    if not report.ok:
        raise typer.Exit(1)


def _verify_serving(doc: Any, scale: str, steps: int, seq: Optional[int], max_ranks: int, timeout: float,
                    calibration: Optional[str], inject: Optional[str], out: Optional[Path]) -> None:
    """verify for a serving plan: each engine's prefill and decode steps with a KV cache against the reference."""
    import dataclasses

    from meshplan.executor.serving import run_serve_check

    report = run_serve_check(doc, scale=scale, prompt=seq, steps=steps, max_ranks=max_ranks, timeout_s=timeout,
                             calibration=load_calibration(calibration) if calibration is not None else None,
                             calibration_origin=calibration or "the calibration", inject=inject)
    con = _console()
    table = Table(title=f"serving check: {report.scaled} (of {report.model}), float64, KV cache vs one forward")
    for col in ("engine", "ranks", "batch x (prompt + steps)", "max rel. error", "prefill s (pred.)",
                "decode step s (pred.)", "KV bytes/rank (pred.)"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for e in report.engines:
        kv = f"{e.cache_bytes:,}" + (f" ({e.predicted_cache_bytes:,.0f})" if e.predicted_cache_bytes is not None
                                     else " (MLA: latent not held)")
        table.add_row(f"{e.role} {e.layout}", str(e.ranks), f"{e.batch} x ({e.prompt} + {e.steps})",
                      f"{e.max_relative_error:.1e}", f"{e.prefill_s:.4f} ({e.predicted_prefill_s:.4f})",
                      f"{e.decode_s:.4f} ({e.predicted_decode_s:.4f})", kv)
    con.print(table)
    where = report.engines[0].predicted_on if report.engines else ""
    con.print(f"predicted times on {where}" + ("" if "calibrated" in where else
              ": not comparable with this CPU's; give --calibration with a profile of this host"))
    con.print(("OK" if report.ok else "FAILED") + f": every logit of the prefill and each decode step "
              f"{'matches' if report.ok else 'does not match'} the reference (tolerance {report.tolerance:g})")
    if out is not None:
        write_all([OutputFile(out, json.dumps({"ok": report.ok, **dataclasses.asdict(report)}, indent=2) + "\n")])
    if not report.ok:
        raise typer.Exit(1)


def _print_verify(con: Console, report: Any) -> None:
    from rich.markup import escape

    con.print(f"[bold]{escape(report.plan_model)}[/] as {escape(report.scaled_model)}: {escape(report.layout)}, "
              f"{report.world} ranks, gbs {report.gbs} x seq {report.seq}, {report.steps} steps, {report.dtype}")
    t = Table(title="numerics vs the single-process run", show_header=True)
    for col in ("quantity", "max relative error", "worst", "tolerance"):
        t.add_column(col)
    t.add_row("loss (every step)", f"{report.loss_error:.2e}", "", f"{report.tolerance:g}")
    t.add_row("gradients (step 1)", f"{report.grad_error:.2e}", report.worst_grad, f"{report.tolerance:g}")
    t.add_row(f"parameters (after step {report.steps})", f"{report.param_error:.2e}", report.worst_param,
              f"{report.tolerance:g}")
    con.print(t)
    calibrated = report.predicted_on != "the plan's GPUs"
    m = Table(title="per rank, measured vs predicted (memory: tensor accounting of the last step, activations at "
                    f"their peak, vs the cost model's elements at the run's dtype; predicted on {report.predicted_on})")
    for col in ("rank", "stage", "params MiB", "grads MiB", "optimizer MiB", "activations MiB", "memory MiB",
                "predicted MiB", "error", "step s", "predicted s", "error"):
        m.add_column(col, justify="right")
    mib = 2.0 ** 20
    for row, step_s in zip(report.memory, report.measured_step_s):
        meas = row.measured
        m.add_row(str(row.rank), str(row.stage), *(f"{meas.get(k, 0.0) / mib:.3f}" for k in
                  ("parameters", "gradients", "optimizer", "activations")),
                  f"{row.measured_total / mib:.3f}", f"{row.predicted_total / mib:.3f}",
                  f"{100 * (row.predicted_total / row.measured_total - 1):+.1f} %" if row.measured_total else "-",
                  f"{step_s:.4f}", f"{report.predicted_step_s:.4f}",
                  f"{100 * (report.predicted_step_s / step_s - 1):+.1f} %" if calibrated and step_s else "-")
    con.print(m)
    slowest = max(report.measured_step_s, default=0.0)
    if calibrated:
        con.print(f"step time: measured {slowest:.4f} s (slowest rank) vs predicted {report.predicted_step_s:.4f} s "
                  f"on {report.predicted_on}: {100 * (report.predicted_step_s / slowest - 1):+.1f} %")
    else:
        con.print(f"step time: measured {slowest:.3f} s (slowest rank, CPU) vs predicted "
                  f"{report.predicted_step_s:.4f} s "
                  f"on the plan's GPUs: not comparable in absolute terms; compare the timelines (--trace), or give "
                  f"--calibration with a profile of this CPU")
    for note in report.notes:
        con.print(f"[dim]note: {escape(note)}[/]")
    if report.ok:
        con.print(f"[green]OK[/]: the layout computes the same training step (within {report.tolerance:g})")
    else:
        con.print(f"[red]FAIL[/]: {len(report.failures)} problem(s)")
        for line in report.failures[:20]:
            con.print(f"  {escape(line)}")


# ---- models --------------------------------------------------------------------------------------------------------

@models_app.command("list")
def models_list() -> None:
    """The built-in models: layers, hidden size, heads, total and active parameters (billions)."""
    t = Table(title="Zoo models (meshplan models show NAME)", title_justify="left")
    for col in ("name", "layers", "hidden", "heads", "kv heads", "experts (top-k)", "total B", "active B"):
        t.add_column(col, justify="left" if col == "name" else "right", no_wrap=col == "name")
    for name in list_zoo():
        m = load_zoo(name)
        experts = f"{m.moe.num_experts} ({m.moe.top_k})" if m.moe else "-"
        t.add_row(name, str(m.num_layers), str(m.hidden), str(m.num_heads), str(m.kv_heads), experts,
                  f"{m.total_params() / 1e9:.2f}", f"{m.active_params() / 1e9:.2f}")
    _console().print(t)


def _flatten(prefix: str, data: dict[str, Any]) -> list[tuple[str, Any]]:
    rows = []
    for k, v in data.items():
        rows.extend(_flatten(f"{prefix}{k}.", v) if isinstance(v, dict) else [(f"{prefix}{k}", v)])
    return rows


@models_app.command("show")
def models_show(
    name: Annotated[str, typer.Argument(help="Zoo model name, a Hugging Face config.json or a meshplan model file.")],
) -> None:
    """Every field of one model and its parameter counts."""
    m = load_model(name)
    t = Table(title=f"Model {m.name}", title_justify="left")
    t.add_column("field")
    t.add_column("value", justify="right")
    for key, value in _flatten("", m.model_dump()):
        t.add_row(key, "-" if value is None else str(value))
    t.add_row("kv heads (effective)", str(m.kv_heads))
    if m.mla is None:
        t.add_row("head size (effective)", str(m.head_size))
    else:
        t.add_row("MLA q/k head size, v head size", f"{m.mla.qk_head_dim}, {m.mla.v_head_dim}")
    if m.moe:
        t.add_row("MoE layers", str(m.num_moe_layers))
    t.add_row("embedding params (B)", f"{m.embedding_params() / 1e9:.3f}")
    t.add_row("[bold]total params (B)[/]", f"[bold]{m.total_params() / 1e9:.3f}[/]")
    t.add_row("[bold]active params (B)[/]", f"[bold]{m.active_params() / 1e9:.3f}[/]")
    if m.num_mtp_layers:
        t.add_row("total params incl. MTP (B)", f"{m.total_params(include_mtp=True) / 1e9:.3f}")
    con = _console()
    con.print(t)
    from_zoo = not Path(name).exists() and name.strip().lower() in list_zoo()
    con.print(f"source: {zoo_source(name) if from_zoo else name}")


# ---- hardware ------------------------------------------------------------------------------------------------------

GPU_FIELDS = {  # GPUSpec field -> (label, unit)
    "hbm_gib": ("HBM capacity", "GiB"),
    "hbm_tb_s": ("HBM bandwidth", "TB/s"),
    "scaleup_gb_s": ("scale-up (NVLink/IF) bandwidth", "GB/s per GPU per direction"),
    "scaleup_domain": ("scale-up domain", "GPUs"),
    "nic_gb_s": ("scale-out NIC line rate", "Gb/s per GPU"),
    "price_usd_per_hour": ("price (indicative)", "USD per GPU-hour"),
}


def _peak(g: GPUSpec, dtype: str) -> str:
    return f"{g.peak_tflops[dtype].value:g}" if dtype in g.peak_tflops else "-"


@hardware_app.command("list")
def hardware_list() -> None:
    """The built-in GPUs: dense peaks, HBM, bandwidths and an indicative price."""
    t = Table(title="GPUs (meshplan hardware show NAME)", title_justify="left")
    for col in ("name", "display name", "BF16 TFLOP/s", "FP8 TFLOP/s", "HBM GiB", "HBM TB/s", "scale-up GB/s",
                "domain", "NIC Gb/s", "$/GPU-h"):
        t.add_column(col, justify="left" if "name" in col else "right", no_wrap=col == "name")
    for name in list_gpus():
        g = load_gpu(name)
        t.add_row(g.name, g.display_name, _peak(g, "bf16"), _peak(g, "fp8"), f"{g.hbm_gib.value:g}",
                  f"{g.hbm_tb_s.value:g}", f"{g.scaleup_gb_s.value:g}", f"{g.scaleup_domain.value:g}",
                  f"{g.nic_gb_s.value:g}", f"{g.price_usd_per_hour.value:g}")
    _console().print(t)


@hardware_app.command("show")
def hardware_show(
    name: Annotated[str, typer.Argument(help="GPU name (e.g. h100-sxm) or a GPU .toml file.")],
) -> None:
    """Every number of one GPU with its source."""
    g = load_gpu(name)
    t = Table(title=f"{g.display_name} ({g.name}, {g.vendor})", title_justify="left")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("unit")
    t.add_column("source")
    for dtype, s in g.peak_tflops.items():
        t.add_row(f"peak {dtype} (dense)", f"{s.value:g}", "TFLOP/s", s.source)
    for field, value in g:
        if isinstance(value, Sourced):
            label, unit = GPU_FIELDS.get(field, (field, ""))
            t.add_row(label, f"{value.value:g}", unit, value.source)
    con = _console()
    con.print(t)
    eff = Table(title="Efficiency defaults (achieved fractions of peak)", title_justify="left")
    eff.add_column("parameter")
    eff.add_column("value", justify="right")
    for field, value in g.efficiency:
        if field != "source":  # a field left unset takes its derived default (docs/hardware.md)
            eff.add_row(field, "derived default" if value is None else f"{value:g}")
    con.print(eff)
    con.print(f"efficiency source: {g.efficiency.source}")


# ---- entry point ---------------------------------------------------------------------------------------------------

def _one_line(text: object) -> str:
    return " ".join(str(text).split()).replace("Value error, ", "")


# the option a value of these types comes from, to name it in the error line
_FLAGS = {"ClusterSpec": {"num_gpus": "--gpus", "gpus_per_node": "--gpus-per-node", "nic_gbps": "--nic-gbps",
                          "nvlink_gb_s": "--nvlink-gbs"},
          "Workload": {"global_batch": "--gbs", "seq_len": "--seq"}}


def _validation_message(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    flag = _FLAGS.get(exc.title, {}).get(where)
    if flag is not None:
        return f"{flag} {first.get('input')!s:.24}: {first['msg']}"
    return f"{exc.title}: field '{where}': {first['msg']}" if where else f"{exc.title}: {first['msg']}"


def _error(message: str) -> None:
    """The one `error:` line, in a single write: ranks under torchrun share stderr, unbuffered (print writes the
    text and the newline apart, and two ranks' lines then interleave)."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def main(argv: Optional[list[str]] = None) -> int:
    """Run the CLI; return the exit code. Bad input prints one line `error: ...` on stderr and returns 2.

    Warnings raised on the way (numpy's overflow or invalid-value notes on an input that is then refused) are
    held back: a failing command prints its one line only; a command that succeeds shows them after its output."""
    with warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("default")
        code = _main(argv)
    if code == 0:
        for w in held:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return code


def _main(argv: Optional[list[str]]) -> int:
    try:
        rv = app(args=argv, prog_name="meshplan", standalone_mode=False)
    except ClickException as exc:  # usage errors: unknown option, bad value, missing option
        if NoArgsIsHelpError is not None and isinstance(exc, NoArgsIsHelpError):
            return 0  # a bare `meshplan` / `meshplan models`: typer has printed the help
        message = _one_line(exc.format_message())  # type: ignore[attr-defined]
        if "import" in (argv if argv is not None else sys.argv[1:]) and message.startswith("No such option: --"):
            message += ("; arguments that start with a dash go after `--`: meshplan import --from megatron -- "
                        "\"--tensor-model-parallel-size 8 ...\"")
        _error(message)
        return exc.exit_code  # type: ignore[attr-defined]
    except typer.Abort:
        _error("aborted")
        return 1
    except BrokenPipeError:  # `meshplan ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except ValidationError as exc:
        _error(_one_line(_validation_message(exc)))
        return EXIT_INPUT
    except (InputError, OSError, json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        _error(_one_line(exc))
        return EXIT_INPUT
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
