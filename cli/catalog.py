"""`meshplan profile`, `models` and `hardware`: the calibration, the model zoo and the GPU database."""

from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from meshplan.cli.options import ProgressBar, console, output_targets, print_table
from meshplan.costmodels.model_io import list_zoo, load_model, load_zoo, zoo_source
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import GPUSpec, Sourced, list_gpus, load_gpu


def profile(
    device: Annotated[Literal["cpu", "cuda"], typer.Option("--device", help=(
        "What to profile: cpu (this host, one thread per rank, collectives on gloo) or cuda (GPU 0; NCCL "
        "collectives when more than one GPU is visible)."))] = "cpu",
    quick: Annotated[bool, typer.Option("--quick", help=(
        "Fewer sizes and repetitions: under 2 minutes on a 2-core CPU."))] = False,
    out: Annotated[Path | None, typer.Option("--out", help=(
        "Calibration file to write (atomically). Default: hardware_db/calibrations/<device>.json in meshplan's "
        "install, so --calibration <device> finds it by name."))] = None,
    model: Annotated[str | None, typer.Option("--model", "-m", help=(
        "Model whose layer GEMMs, attention heads and widths are profiled (zoo name or config file). Default: "
        "Llama-3.1-8B on a GPU; on a CPU a hidden-256 model of the same structure."))] = None,
    gpu: Annotated[str | None, typer.Option("--gpu", help=(
        "hardware_db GPU this device is (default: read from the device's name)."))] = None,
    dtype: Annotated[Literal["float64", "float32", "bfloat16", "float16"] | None, typer.Option("--dtype", help=(
        "Operator dtype (default: float64 on a CPU, verify's default there; bfloat16 on a GPU)."))] = None,
    ranks: Annotated[list[int] | None, typer.Option("--ranks", help=(
        "Group sizes to time collectives on (repeatable; default 2 on a CPU, every GPU on a GPU host)."))] = None,
    tp: Annotated[list[int] | None, typer.Option("--tp", help=(
        "TP degrees whose sharded GEMM and attention shapes are profiled (repeatable; default 1 2)."))] = None,
    statistic: Annotated[Literal["median", "min"], typer.Option("--statistic", help=(
        "Which repetition each measurement keeps: the median, or the fastest (for a shared host whose speed "
        "drifts; then also compare with the fastest measured runs)."))] = "median",
) -> None:
    """Measure this device (GEMMs, attention, memory-bound operators, collectives, a layer's activation memory) and
    write a calibration that `estimate`, `plan` and `verify --calibration` use instead of the efficiency defaults."""
    from meshplan.executor.profiler import ProfileOptions, default_grid
    from meshplan.executor.profiler import profile as run_profile
    from meshplan.hardware_db.calibration import calibration_dir
    from meshplan.planner.plan import write_text_atomic

    (out,) = output_targets(out=out)  # before the minutes of measuring
    grid = default_grid(device, quick)  # the shapes and collective groups for this device
    opts = ProfileOptions(device=device, quick=quick, model=load_model(model) if model else None, target=gpu,
                          dtype=dtype or ("float64" if device == "cpu" else "bfloat16"),
                          statistic=statistic,
                          **(grid | ({"ranks": tuple(ranks)} if ranks else {}) | ({"tp": tuple(tp)} if tp else {})))
    with ProgressBar(True, "profiling", "measurements") as bar:
        cal = run_profile(opts, lambda what, done, total: bar(done, total, what))
    target = out if out is not None else calibration_dir() / f"{cal.device.target}.json"
    try:
        write_text_atomic(target, cal.model_dump_json(indent=1) + "\n")
    except OSError as exc:
        raise InputError(f"cannot write {target}: {exc.strerror}; choose a writable --out") from None
    _print_calibration(console(), cal, target)


def _print_calibration(con: Console, cal: Any, path: Path) -> None:
    f, m = cal.fitted, cal.measurements
    con.print(Text.assemble((cal.device.name, "bold"), f" ({cal.device.target}, {cal.device.threads} thread(s)), "
                            f"torch {cal.software.torch}, {cal.software.backend}; {m.dtype}"))
    t = Table(title="fitted efficiency model", title_justify="left")
    t.add_column("what", overflow="fold")
    t.add_column("value", justify="right", overflow="fold")
    t.add_column("from", overflow="fold")
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


# ---- models --------------------------------------------------------------------------------------------------------

def models_list() -> None:
    """The built-in models: layers, hidden size, heads, total and active parameters (billions)."""
    rows = []
    for name in list_zoo():
        m = load_zoo(name)
        experts = f"{m.moe.num_experts} ({m.moe.top_k})" if m.moe else "-"
        rows.append((name, str(m.num_layers), str(m.hidden), str(m.num_heads), str(m.kv_heads), experts,
                     f"{m.total_params() / 1e9:.2f}", f"{m.active_params() / 1e9:.2f}"))
    print_table(console(), "Zoo models (meshplan models show NAME)",
                ("name", "layers", "hidden", "heads", "kv", "experts (k)", "total B", "active B"), rows, left=("name",))


def _flatten(prefix: str, data: dict[str, Any]) -> list[tuple[str, Any]]:
    rows = []
    for k, v in data.items():
        rows.extend(_flatten(f"{prefix}{k}.", v) if isinstance(v, dict) else [(f"{prefix}{k}", v)])
    return rows


def models_show(
    name: Annotated[str, typer.Argument(help="Zoo model name, a Hugging Face config.json or a meshplan model file.")],
) -> None:
    """Every field of one model and its parameter counts."""
    m = load_model(name)
    t = Table(title=f"Model {m.name}", title_justify="left")
    t.add_column("field", overflow="fold")
    t.add_column("value", justify="right", overflow="fold")
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
    t.add_row(Text("total params (B)", "bold"), Text(f"{m.total_params() / 1e9:.3f}", "bold"))
    t.add_row(Text("active params (B)", "bold"), Text(f"{m.active_params() / 1e9:.3f}", "bold"))
    if m.num_mtp_layers:
        t.add_row("total params incl. MTP (B)", f"{m.total_params(include_mtp=True) / 1e9:.3f}")
    con = console()
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


def hardware_list() -> None:
    """The built-in GPUs: dense peaks, HBM, bandwidths and an indicative price."""
    con = console()
    wide = con.width >= 120  # the display names only where they fit beside the numbers
    rows = []
    for name in list_gpus():
        g = load_gpu(name)
        rows.append((g.name, *([g.display_name] if wide else []), _peak(g, "bf16"), _peak(g, "fp8"),
                     f"{g.hbm_gib.value:g}", f"{g.hbm_tb_s.value:g}", f"{g.scaleup_gb_s.value:g}",
                     f"{g.scaleup_domain.value:g}", f"{g.nic_gb_s.value:g}", f"{g.price_usd_per_hour.value:g}"))
    headers = ("name", *(["display name"] if wide else []), "BF16 TF/s", "FP8 TF/s", "HBM GiB", "HBM TB/s",
               "NVLink GB/s", "domain", "NIC Gb/s", "$/GPU-h")
    print_table(con, "GPUs (meshplan hardware show NAME)", headers, rows, left=("name", "display name"))


def hardware_show(
    name: Annotated[str, typer.Argument(help="GPU name (e.g. h100-sxm) or a GPU .toml file.")],
) -> None:
    """Every number of one GPU with its source."""
    g = load_gpu(name)
    t = Table(title=f"{g.display_name} ({g.name}, {g.vendor})", title_justify="left")
    t.add_column("quantity", overflow="fold")
    t.add_column("value", justify="right", overflow="fold")
    t.add_column("unit", overflow="fold")
    t.add_column("source", overflow="fold")
    for dtype, s in g.peak_tflops.items():
        t.add_row(f"peak {dtype} (dense)", f"{s.value:g}", "TFLOP/s", s.source)
    for field, value in g:
        if isinstance(value, Sourced):
            label, unit = GPU_FIELDS.get(field, (field, ""))
            t.add_row(label, f"{value.value:g}", unit, value.source)
    con = console()
    con.print(t)
    eff = Table(title="Efficiency defaults (achieved fractions of peak)", title_justify="left")
    eff.add_column("parameter", overflow="fold")
    eff.add_column("value", justify="right", overflow="fold")
    for field, value in g.efficiency:
        if field != "source":  # a field left unset takes its derived default (docs/hardware.md)
            eff.add_row(field, "derived default" if value is None else _efficiency_value(value))
    con.print(eff)
    con.print(f"efficiency source: {g.efficiency.source}")
    con.print(public_line(name))  # as plan --gpu NAME resolves it: a .toml file gets no public calibration


def public_line(gpu: str) -> str:
    """What plan uses for this GPU without --calibration: its public calibration's factors on the defaults above."""
    from meshplan.hardware_db.calibration import FactorCalibration, default_calibration, load_any_calibration

    name = default_calibration(gpu)
    if name is None:
        return "without --calibration, meshplan plans it with these defaults (it ships no public calibration for it)"
    cal = load_any_calibration(name)
    assert isinstance(cal, FactorCalibration)
    factors = ", ".join(f"{key} x {f.factor:.3f}" for key, f in cal.factors.items())
    return (f"without --calibration, meshplan plans it under {name}: {factors} on these defaults, fit to {cal.runs} "
            f"published runs (docs/calibration.md; --calibration none: the defaults alone)")


def _efficiency_value(value: float | bool | list[list[float]]) -> str:
    """A number, or a table of (tokens per expert, fraction) pairs as `256: 0.437, 512: 0.489, ...`."""
    if isinstance(value, list):
        return ", ".join(f"{m:g}: {f:g}" for m, f in value)
    return f"{value:g}"


models_app = typer.Typer(help="Built-in model zoo and model files (docs/models.md).", no_args_is_help=True,
                         rich_markup_mode=None)
models_app.command("list")(models_list)
models_app.command("show")(models_show)
hardware_app = typer.Typer(help="Built-in GPU specifications, every number with its source (docs/hardware.md).",
                           no_args_is_help=True, rich_markup_mode=None)
hardware_app.command("list")(hardware_list)
hardware_app.command("show")(hardware_show)
