"""meshplan's command line: a thin typer layer over costmodels and hardware_db.

Every command is a few lines over a library call and a rich table. `main()` runs the app and turns bad input
(hardware_db.errors.InputError, and any pydantic / file / JSON / TOML error that slips through) and click's
usage errors into ONE line `error: <message>` on stderr with exit code 2: no traceback.
"""

import json
import os
import sys
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.table import Table

from costmodels.config import DEFAULT_RUNTIME, RUNTIMES, ParallelConfig, Workload
from costmodels.estimate import Estimate, estimate as estimate_cost
from costmodels.model import ModelSpec
from costmodels.model_io import list_zoo, load_model, load_zoo, zoo_source
from hardware_db.cluster import Cluster, ClusterSpec, load_cluster_file
from hardware_db.errors import InputError
from hardware_db.gpu import GPUSpec, Sourced, list_gpus, load_gpu

EXIT_INPUT = 2  # bad input, the same code click uses for usage errors

# typer >= 0.2x vendors click; find its exception classes through the public typer.BadParameter (a UsageError).
ClickException: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
NoArgsIsHelpError = getattr(sys.modules[ClickException.__module__], "NoArgsIsHelpError", None)

RuntimeName = Literal[tuple(RUNTIMES)]  # type: ignore[valid-type]  # choices follow costmodels.config.RUNTIMES

app = typer.Typer(
    name="meshplan",
    help="Parallelism planner for LLM training: estimate step time, throughput, MFU and memory of a configuration.",
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


def _console() -> Console:
    """Rich console; piped output (CI logs, `| less`, tests) gets 140 columns instead of rich's 80 unless COLUMNS says."""
    return Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=140)


# ---- estimate ------------------------------------------------------------------------------------------------------

def _cluster(cluster_file: Optional[str], gpu: Optional[str], gpus: Optional[int], gpus_per_node: Optional[int],
             nic_gbps: Optional[float], nvlink_gbs: Optional[float]) -> Cluster:
    if cluster_file is not None:
        if any(v is not None for v in (gpu, gpus, gpus_per_node, nic_gbps, nvlink_gbs)):
            raise InputError("give either --cluster FILE or --gpu/--gpus (and link flags), not both")
        return Cluster(load_cluster_file(cluster_file))
    if gpu is None or gpus is None:
        raise InputError("say which cluster: --gpu NAME --gpus N, or --cluster FILE (see `meshplan hardware list`)")
    return Cluster(ClusterSpec(gpu=gpu, num_gpus=gpus, gpus_per_node=gpus_per_node, nic_gbps=nic_gbps,
                               nvlink_gb_s=nvlink_gbs))


@app.command()
def estimate(
    model: Annotated[str, typer.Option("--model", "-m", rich_help_panel=P_MODEL, help=(
        "Zoo model name (`meshplan models list`), a Hugging Face config.json, a directory holding one, "
        "or a meshplan model file (.json/.toml, docs/models.md)."))],
    gbs: Annotated[int, typer.Option("--gbs", min=1, rich_help_panel=P_MODEL,
                                     help="Global batch size per optimizer step, in sequences.")] = 256,
    seq: Annotated[int, typer.Option("--seq", min=1, rich_help_panel=P_MODEL,
                                     help="Sequence length, in tokens.")] = 4096,
    dtype: Annotated[Literal["bf16", "fp16", "fp8"], typer.Option(
        "--dtype", rich_help_panel=P_MODEL,
        help="GEMM precision; MFU is measured against this dtype's dense peak.")] = "bf16",
    gpu: Annotated[Optional[str], typer.Option("--gpu", rich_help_panel=P_CLUSTER, help=(
        "GPU name (`meshplan hardware list`, e.g. h100-sxm) or a GPU .toml file."))] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", min=1, rich_help_panel=P_CLUSTER,
                                                help="Total number of GPUs.")] = None,
    gpus_per_node: Annotated[Optional[int], typer.Option("--gpus-per-node", min=1, rich_help_panel=P_CLUSTER, help=(
        "GPUs per node (scale-up domain); default 8, or the GPU's NVLink domain where larger."))] = None,
    nic_gbps: Annotated[Optional[float], typer.Option("--nic-gbps", min=0.001, rich_help_panel=P_CLUSTER, help=(
        "Scale-out NIC line rate per GPU, in Gb/s (gigabits); default: the GPU spec's."))] = None,
    nvlink_gbs: Annotated[Optional[float], typer.Option("--nvlink-gbs", min=0.001, rich_help_panel=P_CLUSTER, help=(
        "Scale-up (NVLink) bandwidth per GPU per direction, in GB/s (gigabytes); default: the GPU spec's."))] = None,
    cluster_file: Annotated[Optional[str], typer.Option("--cluster", rich_help_panel=P_CLUSTER, help=(
        "Cluster file (TOML or JSON) with gpu, num_gpus and optional gpus_per_node, nic_gbps, nvlink_gb_s; "
        "instead of --gpu/--gpus. Example: examples/clusters/dgx-h100-64.toml."))] = None,
    tp: Annotated[Optional[int], typer.Option("--tp", min=1, rich_help_panel=P_PAR,
                                              help="Tensor-parallel degree (default 1).")] = None,
    pp: Annotated[Optional[int], typer.Option("--pp", min=1, rich_help_panel=P_PAR,
                                              help="Pipeline-parallel degree (stages; default 1).")] = None,
    vpp: Annotated[Optional[int], typer.Option("--vpp", min=1, rich_help_panel=P_PAR, help=(
        "Virtual pipeline stages (model chunks) per pipeline rank; > 1 means the interleaved schedule "
        "(default 1)."))] = None,
    dp: Annotated[Optional[int], typer.Option("--dp", min=1, rich_help_panel=P_PAR, help=(
        "Data-parallel degree (default: GPUs / (tp x pp x cp)).")) ] = None,
    cp: Annotated[Optional[int], typer.Option("--cp", min=1, rich_help_panel=P_PAR,
                                              help="Context-parallel degree (splits the sequence; default 1).")] = None,
    cp_comm: Annotated[Optional[Literal["ring", "a2a"]], typer.Option("--cp-comm", rich_help_panel=P_PAR, help=(
        "Context-parallel communication: ring (K,V passed around a ring, overlapped with attention) or a2a "
        "(all-to-all over heads, DeepSpeed-Ulysses) (default ring).")) ] = None,
    ep: Annotated[Optional[int], typer.Option("--ep", min=1, rich_help_panel=P_PAR,
                                              help="Expert-parallel degree, MoE models only (default 1).")] = None,
    etp: Annotated[Optional[int], typer.Option("--etp", min=1, rich_help_panel=P_PAR,
                                               help="Expert tensor-parallel degree (default: --tp).")] = None,
    mbs: Annotated[Optional[int], typer.Option("--mbs", min=1, rich_help_panel=P_PAR,
                                               help="Micro-batch size, in sequences (default 1).")] = None,
    zero: Annotated[Optional[int], typer.Option("--zero", min=0, max=3, rich_help_panel=P_PAR, help=(
        "ZeRO stage 0-3: 1 shards optimizer state (Megatron distributed optimizer), 2 also gradients, "
        "3 also weights (FSDP) (default 1)."))] = None,
    recompute: Annotated[Optional[Literal["none", "selective", "full"]], typer.Option(
        "--recompute", rich_help_panel=P_PAR,
        help="Activation recomputation: none, selective (attention core) or full (whole layer) (default none).")] = None,
    sp: Annotated[Optional[bool], typer.Option("--sp/--no-sp", rich_help_panel=P_PAR, show_default=False, help=(
        "Sequence parallelism with TP (default: on when --tp > 1)."))] = None,
    schedule: Annotated[Optional[Literal["1f1b", "interleaved", "gpipe", "zb"]], typer.Option(
        "--schedule", rich_help_panel=P_PAR,
        help="Pipeline schedule (default: interleaved when --vpp > 1, else 1f1b; zb = zero-bubble).")] = None,
    runtime: Annotated[RuntimeName, typer.Option("--runtime", rich_help_panel=P_PAR, help=(
        "Training framework behaviour: what it fuses and which communication it overlaps "
        "(docs/cost_model.md)."))] = DEFAULT_RUNTIME,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel=P_OUT, help=(
        "Print the estimate as JSON (step_time_s, tokens_per_s, tokens_per_s_per_gpu, tflops_per_gpu, mfu, hfu, "
        "peak_memory_gib, fits, breakdown_s, stages, ...) and nothing else."))] = False,
) -> None:
    """Estimate one configuration: step time and its breakdown, throughput, MFU/HFU and memory per GPU."""
    spec = load_model(model)
    cluster = _cluster(cluster_file, gpu, gpus, gpus_per_node, nic_gbps, nvlink_gbs)
    workload = Workload(global_batch=gbs, seq_len=seq, dtype=dtype)
    knobs = dict(tp=tp, pp=pp, vpp=vpp, dp=dp, cp=cp, cp_comm=cp_comm, ep=ep, etp=etp, mbs=mbs, zero=zero, recompute=recompute,
                 sp=sp, schedule=schedule)
    cfg = ParallelConfig(**{k: v for k, v in knobs.items() if v is not None})
    est = estimate_cost(spec, cluster, workload, cfg, runtime)
    if as_json:
        typer.echo(json.dumps(est.to_dict(), indent=2))
    else:
        _print_estimate(_console(), spec, cluster, workload, est)


BREAKDOWN_LABELS = {
    "compute": "compute (forward + backward)",
    "recompute": "recompute (activation recomputation)",
    "pp_comm": "PP send/recv (exposed)",
    "pipeline_bubble": "pipeline bubble",
    "dp_comm": "DP gradient reduce / param gather (exposed)",
    "optimizer": "optimizer step",
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
              f"recompute {lay.recompute}, sp {'on' if lay.sp else 'off'}, schedule {lay.schedule}")

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
    t.add_row(f"MFU (vs {wl.dtype} dense peak)", f"{100 * est.mfu:.1f} %")
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
    for which, s in shown.items():
        t.add_column(f"{which} stage (rank {s['rank']}, layers {s['first_layer']}-"
                     f"{s['first_layer'] + s['num_layers'] - 1})", justify="right")
    shown = list(shown.values())
    for key in shown[0]["memory_gib"]:
        t.add_row(key, *(f"{s['memory_gib'][key]:.2f}" for s in shown))
    t.add_row("[bold]total[/]", *(f"[bold]{s['peak_memory_gib']:.2f}[/]" for s in shown))
    t.add_row("HBM", *(f"{est.hbm_gib:.0f}" for _ in shown))
    t.add_row("fits", *("[green]yes[/]" if s["peak_memory_gib"] <= est.hbm_gib else "[bold red]NO[/]"
                        for s in shown))
    con.print(t)
    if est.fits:
        con.print(f"[green]memory: fits[/] (peak {est.peak_memory_gib:.1f} GiB of {est.hbm_gib:.0f} GiB HBM)")
    else:
        con.print(f"[bold red]memory: does NOT fit[/] (peak {est.peak_memory_gib:.1f} GiB > {est.hbm_gib:.0f} GiB "
                  f"HBM); try more --pp/--tp, --recompute selective|full, a higher --zero or a smaller --mbs")


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
        if field != "source":
            eff.add_row(field, f"{value:g}")
    con.print(eff)
    con.print(f"efficiency source: {g.efficiency.source}")


# ---- entry point ---------------------------------------------------------------------------------------------------

def _one_line(text: object) -> str:
    return " ".join(str(text).split()).replace("Value error, ", "")


def _validation_message(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return f"{exc.title}: field '{where}': {first['msg']}" if where else f"{exc.title}: {first['msg']}"


def main(argv: Optional[list[str]] = None) -> int:
    """Run the CLI; return the exit code. Bad input prints one line `error: ...` on stderr and returns 2."""
    try:
        rv = app(args=argv, prog_name="meshplan", standalone_mode=False)
    except ClickException as exc:  # usage errors: unknown option, bad value, missing option
        if NoArgsIsHelpError is not None and isinstance(exc, NoArgsIsHelpError):
            return 0  # a bare `meshplan` / `meshplan models`: typer has printed the help
        print(f"error: {_one_line(exc.format_message())}", file=sys.stderr)  # type: ignore[attr-defined]
        return exc.exit_code  # type: ignore[attr-defined]
    except typer.Abort:
        print("error: aborted", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `meshplan ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except ValidationError as exc:
        print(f"error: {_one_line(_validation_message(exc))}", file=sys.stderr)
        return EXIT_INPUT
    except (InputError, OSError, json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_INPUT
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
