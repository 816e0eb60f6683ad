"""What the commands share: the options of estimate and plan (one definition, the same help in both), the
cluster and workload they describe, output paths checked before any work, the console."""

import contextlib
import functools
import inspect
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

import typer
from rich.console import Console
from rich.table import Table

from meshplan.cli.lines import stderr_line
from meshplan.costmodels.config import ParallelConfig, Workload, knob_help
from meshplan.costmodels.economics import LLAMA3_FAILURES_PER_GPU_HOUR, Budget, Reliability
from meshplan.costmodels.runtime import RUNTIMES, RUNTIME_OPTIONS
from meshplan.hardware_db.cluster import ClusterSpec, load_cluster_file
from meshplan.hardware_db.errors import InputError
from meshplan.planner.outputs import check_distinct, check_folder_contents, check_target
from meshplan.planner.sweep import Objective


MAX_VERIFY_STEPS = 1000  # verify compares parameters after a few steps; the reference draws every step's batch up front
MAX_VERIFY_TIMEOUT_S = 86_400.0  # a day
MAX_VERIFY_RANKS = 4096  # one process each, on this host


ExportTarget = Literal["megatron", "torchtitan", "deepspeed", "torchrun", "nemo"]  # planner.launchers.TARGETS
# the training targets, then the serving ones (planner/launchers/registry.py TARGETS, SERVING_TARGETS)
AnyExportTarget = Literal["megatron", "torchtitan", "deepspeed", "torchrun", "nemo", "vllm", "sglang", "trtllm"]
P_MODEL, P_CLUSTER, P_PAR, P_OUT = "Model and workload", "Cluster", "Parallelism (unset: defaults)", "Output"
P_SEARCHED = "Parallelism (unset: searched)"  # plan's knobs
P_COST = "Cost and time to train"

ImportSource = Literal["megatron", "torchtitan"]  # planner.launchers.SOURCES





def output_targets(directories: tuple[str, ...] = ("export_out",), folders: tuple[str, ...] = (),
                   contents: dict[str, tuple[str, ...]] | None = None,
                   **flags: Path | None) -> tuple[Path | None, ...]:
    """The command's output paths (keyword = option name), each checked before any work (planner/outputs.py; those
    named in `directories` may be a folder, those in `folders` must be one: a report's), no two the same file, and
    none of them one that a folder flag writes by its real name (`contents`: option name -> the file names, fnmatch
    patterns, of an export or a report)."""
    def flag(k: str) -> str:
        return "--" + k.replace("_", "-")

    checked = {flag(k): check_target(v, flag(k), directory_ok=k in directories or k in folders)
               for k, v in flags.items()}
    for k in folders:
        path = flags.get(k)
        if path is not None and path.exists() and not path.is_dir():
            raise InputError(f"--{k.replace('_', '-')} {path} is a file; give a directory for the report")
    check_distinct(checked)
    check_folder_contents(checked, {flag(k): (checked[flag(k)], names) for k, names in (contents or {}).items()})
    return tuple(checked.values())


def print_table(con: Console, title: str, headers: Sequence[str], rows: Sequence[Sequence[str]],
                left: Sequence[str] = ()) -> None:
    """A table, or where its natural width exceeds the terminal, one line per row of `header value` pairs, wrapped at
    the pairs: every cell readable at 80 columns (rich would otherwise fold numbers or cut cells with an ellipsis)."""
    from rich.measure import Measurement
    from rich.text import Text

    table = Table(title=title, title_justify="left")
    for h in headers:
        table.add_column(h, justify="left" if h in left else "right", overflow="fold")
    for row in rows:
        table.add_row(*row)
    if Measurement.get(con, con.options.update(max_width=100_000), table).maximum <= con.width:
        con.print(table)
        return
    con.print(Text(title, style="italic"))
    for row in rows:  # packed by hand: rich would wrap inside a pair
        line = "  "
        for pair in (f"{h} {c}".strip() for h, c in zip(headers, row, strict=True) if c):
            if line.strip() and len(line) + 2 + len(pair) > con.width:
                con.print(Text(line + ";", no_wrap=True, overflow="fold"))
                line = "   "
            line += ("; " if line.strip() else "") + pair
        con.print(Text(line, no_wrap=True, overflow="fold"))


# piped output (CI logs, `| tee`): a plain `progress:` line on stderr once a step has run this many CPU seconds,
# then every PROGRESS_EVERY_S; CPU time, so a command that is short on an idle machine prints none on a busy one
PROGRESS_FIRST_S = 10.0
PROGRESS_EVERY_S = 10.0
PROGRESS_POLL_S = 1.0  # how often working()'s watcher looks at the clock


def progress_line(text: str) -> None:
    stderr_line("progress", text)


class ProgressBar:
    """A long command's steps on stderr: on a terminal a transient rich bar; piped, a plain `progress:` line now
    and then (PROGRESS_FIRST_S). `bar(done, total)` (or `bar(done, total, what)`) is the progress callback the
    search (groups), the sweep (clusters) and the profiler (measurements) take."""

    def __init__(self, enabled: bool, label: str, unit: str):
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        terminal = sys.stderr.isatty()
        self.bar = Progress(TextColumn("{task.description}"), BarColumn(),
                            TextColumn(f"{{task.completed}}/{{task.total}} {unit}"), TimeElapsedColumn(),
                            console=Console(stderr=True), transient=True, disable=not (enabled and terminal))
        self.plain = enabled and not terminal
        self.task: Any = None
        self.label, self.unit = label, unit
        self.start_wall, self.start_cpu, self.next_cpu = time.perf_counter(), time.process_time(), PROGRESS_FIRST_S

    def __enter__(self) -> "ProgressBar":
        self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.bar.__exit__(*exc)

    def __call__(self, done: int, total: int | None, what: str | None = None) -> None:
        if self.task is None:
            self.task = self.bar.add_task(self.label, total=total)
        self.bar.update(self.task, completed=done, total=total, description=(what or self.label)[:60])
        used = time.process_time() - self.start_cpu
        if self.plain and used >= self.next_cpu:
            self.next_cpu = used + PROGRESS_EVERY_S
            of = f"/{total:,}" if total else ""
            progress_line(f"{what or self.label}: {done:,}{of} {self.unit}, "
                          f"{time.perf_counter() - self.start_wall:.0f} s")


@contextlib.contextmanager
def working(message: str) -> Iterator[None]:
    """A transient spinner on stderr while a search without its own bar runs on a terminal; piped, a plain
    `progress:` line from a watcher thread once it has run PROGRESS_FIRST_S CPU seconds, then every
    PROGRESS_EVERY_S."""
    if sys.stderr.isatty():
        with Console(stderr=True).status(message):
            yield
        return
    done = threading.Event()
    start_wall, start_cpu = time.perf_counter(), time.process_time()

    def watch() -> None:
        due = PROGRESS_FIRST_S
        while not done.wait(PROGRESS_POLL_S):
            if time.process_time() - start_cpu >= due:
                due += PROGRESS_EVERY_S
                progress_line(f"{message}, {time.perf_counter() - start_wall:.0f} s")

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()


def console() -> Console:
    """Rich console; piped output (CI logs, `| less`, tests) gets 140 columns instead of rich's 80 unless COLUMNS
    says. Markup is off: paths and names the user gave ('[/].json') are printed as they are; styles are rich Text."""
    if sys.stdout.isatty() or "COLUMNS" in os.environ:
        return Console(markup=False)
    return Console(width=140, markup=False)


# ---- estimate ------------------------------------------------------------------------------------------------------

def cluster_of_flags(cluster_file: str | None, gpu: str | None, gpus: int | None, gpus_per_node: int | None,
             nic_gbps: float | None, nvlink_gbs: float | None) -> ClusterSpec:
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
BeyondContextOpt = Annotated[bool, typer.Option("--beyond-context", rich_help_panel=P_MODEL, help=(
    "Allow sequences longer than the model's context (its max_seq_len), for a model run with its RoPE scaled "
    "past it."))]


def check_context(spec: Any, tokens: int, what: str, beyond: bool) -> None:
    """Refuse a sequence past the model's context (`models show` gives it) unless --beyond-context says so."""
    limit = spec.max_seq_len
    if limit is not None and tokens > limit and not beyond:
        raise InputError(f"{what} is {tokens:,} tokens, past {spec.name}'s context of {limit:,}; shorten it, or add "
                         f"--beyond-context for a model whose RoPE is scaled past it")


GbsOpt = Annotated[int, typer.Option("--gbs", min=1, rich_help_panel=P_MODEL,
                                     help="Global batch size per optimizer step, in sequences.")]
SeqOpt = Annotated[int, typer.Option("--seq", min=1, rich_help_panel=P_MODEL, help="Sequence length, in tokens.")]
DtypeOpt = Annotated[Literal["bf16", "fp16", "fp8"], typer.Option(
    "--dtype", rich_help_panel=P_MODEL, help="GEMM precision; MFU is measured against this dtype's dense peak.")]
Fp8RecipeOpt = Annotated[Literal["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"], typer.Option(
    "--fp8-recipe", metavar="RECIPE", rich_help_panel=P_MODEL, help=(
        "FP8 scaling (with --dtype fp8): delayed (TE DelayedScaling), tensorwise (current scaling), rowwise "
        "(torchao), blockwise (1x128 / 128x128), mxfp8 (Blackwell). Decides the FP8 kernel and its casts."))]
GpuOpt = Annotated[str | None, typer.Option("--gpu", rich_help_panel=P_CLUSTER, help=(
    "GPU name (`meshplan hardware list`, e.g. h100-sxm) or a GPU .toml file."))]
GpusOpt = Annotated[int | None, typer.Option("--gpus", min=1, rich_help_panel=P_CLUSTER,
                                                help="Total number of GPUs.")]
PerNodeOpt = Annotated[int | None, typer.Option("--gpus-per-node", min=1, rich_help_panel=P_CLUSTER, help=(
    "GPUs per node (scale-up domain); default 8, or the GPU's NVLink domain where larger."))]
NicOpt = Annotated[float | None, typer.Option("--nic-gbps", min=0.001, rich_help_panel=P_CLUSTER, help=(
    "Scale-out NIC line rate per GPU, in Gb/s (gigabits); default: the GPU spec's."))]
NvlinkOpt = Annotated[float | None, typer.Option("--nvlink-gbs", min=0.001, rich_help_panel=P_CLUSTER, help=(
    "Scale-up (NVLink) bandwidth per GPU per direction, in GB/s (gigabytes); default: the GPU spec's."))]
ClusterOpt = Annotated[str | None, typer.Option("--cluster", rich_help_panel=P_CLUSTER, help=(
    "Cluster file (TOML or JSON) with gpu, num_gpus and optional gpus_per_node, nic_gbps, nvlink_gb_s; "
    "instead of --gpu/--gpus. Example: examples/clusters/dgx-h100-64.toml."))]
CalibrationOpt = Annotated[str | None, typer.Option("--calibration", rich_help_panel=P_CLUSTER, help=(
    "Default: the GPU's public calibration where meshplan ships one (its factors fit to every published run on that "
    "GPU in meshplan's development sets, its ranges from their held-out errors; `public` asks for it and fails "
    "where there is none), else the GPU's efficiency defaults; `none`: the defaults, uncalibrated. Or a file from "
    "`meshplan calibrate` (factors fit to your runs, for the GPU type they ran on, centred on the public ones), or "
    "from `meshplan profile` (or a name under hardware_db/calibrations/): the device's measured GEMM, attention, "
    "memory and collective costs replace the defaults. A CPU calibration goes with --gpu cpu."))]
ObjectiveOpt = Annotated[Objective, typer.Option("--objective", rich_help_panel=P_COST, help=(
    "Which plan is best. time: the shortest run (with --tokens, expected time with failures; else the highest "
    "throughput); cost: the cheapest run (with --tokens, expected dollars with failures; else $ per million "
    "tokens); tokens-per-dollar: the most tokens per dollar at steady state, failures left out."))]

RuntimeOpt = Annotated[str, typer.Option("--runtime", metavar="PRESET[+OPTION...]", rich_help_panel=P_PAR, help=(
    f"Training framework behaviour: what it fuses, which kernels and which overlap it has, which schedules, CP kinds "
    f"and ZeRO stages it runs (docs/cost_model.md): {', '.join(RUNTIMES)}, with options appended as +option "
    f"({', '.join('+' + o for o in RUNTIME_OPTIONS)}), e.g. torchtitan+compile+async-tp."))]


# ---- the knobs: one option per ParallelConfig field that has a KnobHelp ---------------------------------------------

def knob_parameters(searching: bool) -> list[inspect.Parameter]:
    """A typer option per knob of ParallelConfig, from its field: type, bounds, flag, help and unit (KnobHelp). For
    `plan` (`searching`) only the knobs the search takes pinned, and an unset one is searched; for `estimate` every
    knob, and an unset one takes its default."""
    params = []
    for name, field in ParallelConfig.model_fields.items():
        doc = knob_help(name)
        if doc is None or (searching and not doc.searched):
            continue
        kind, bounds = _option_type(field.annotation, field.metadata)
        unset = "Searched when unset." if searching else f"Default: {doc.default}."
        text = f"{doc.help}" + (f", in {doc.unit}" if doc.unit else "") + f". {unset}"
        flag = doc.flag_name(name)
        if kind is bool:
            flag = f"{flag}/--no-{flag.removeprefix('--')}"
        flag_option = typer.Option(flag, rich_help_panel=P_SEARCHED if searching else P_PAR, help=text,
                                   metavar=doc.metavar or None, show_default=False, **bounds)
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[kind | None, flag_option]))
    return params


def _option_type(annotation: Any, metadata: list[Any]) -> tuple[Any, dict[str, int]]:
    """(the option's value type, its min/max) for a knob's field type: an int, bool or string Literal (or None); a
    Literal of ints (the ZeRO stage) is an int between its first and last; a tuple is a comma-separated string."""
    if get_origin(annotation) is tuple:
        return str, {}
    unset = get_origin(annotation) in (Union, UnionType)  # `X | None`
    kind = next(a for a in get_args(annotation) if a is not type(None)) if unset else annotation
    bounds = {}
    for m in metadata:  # pydantic's Field(gt=...) / Field(ge=...) constraints
        if getattr(m, "gt", None) is not None:
            bounds["min"] = m.gt + 1
        if getattr(m, "ge", None) is not None:
            bounds["min"] = m.ge
    if get_origin(kind) is Literal and all(isinstance(v, int) for v in get_args(kind)):
        return int, {"min": min(get_args(kind)), "max": max(get_args(kind))}
    return kind, bounds


def config_of_flags(given: dict[str, Any]) -> ParallelConfig:
    """The knobs the command line set as one ParallelConfig (those not given stay None); a comma list becomes a
    tuple, and a name outside its field's choices is one error line."""
    values = {}
    for name, value in given.items():
        if value is None:
            continue
        annotation = ParallelConfig.model_fields[name].annotation
        if get_origin(annotation) is tuple:
            value = _comma_list(value, get_args(get_args(annotation)[0]), knob_help(name).flag_name(name))
        values[name] = value
    return ParallelConfig(**values)


def _comma_list(text: str, choices: tuple[str, ...], flag: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or any(n not in choices for n in names):
        raise InputError(f"{flag} {text!r}: choose from {', '.join(choices)}, comma-separated")
    return names


Command = TypeVar("Command", bound=Callable[..., Any])


def packed(name: str, params: Sequence[inspect.Parameter], build: Callable[..., Any]) -> Callable[[Command], Command]:
    """Give a command the options `params` in place of its parameter `name`, and call it with `build(**their values)`
    there: typer reads the generated signature, the command gets one value (a ParallelConfig, a ClusterSpec, ...)."""
    def wrap(command: Command) -> Command:
        signature = inspect.signature(command)
        names = [q.name for q in params]
        new: list[inspect.Parameter] = []
        for p in signature.parameters.values():
            new += [q.replace(kind=p.kind) for q in params] if p.name == name else [p]

        def run(**kwargs: Any) -> Any:
            return command(**{name: build(**{n: kwargs.pop(n) for n in names})}, **kwargs)

        wrapped: Any = functools.wraps(command)(run)  # typer reads the two attributes below
        wrapped.__signature__ = signature.replace(parameters=new)
        wrapped.__annotations__ = {p.name: p.annotation for p in new} | {"return": signature.return_annotation}
        return wrapped
    return wrap


def with_knobs(searching: bool) -> Callable[[Command], Command]:
    """One option per knob in place of the command's `config: ParallelConfig` (`knob_parameters`)."""
    return packed("config", knob_parameters(searching), lambda **given: config_of_flags(given))


def option(name: str, annotation: Any, default: Any = None) -> inspect.Parameter:
    """A typer option (`annotation`: Annotated[type, typer.Option(...)]) as a parameter for `packed`."""
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)


def with_cluster(command: Command) -> Command:
    """--gpu, --gpus and the link flags, or --cluster FILE, in place of the command's `cluster: ClusterSpec`."""
    options = [option("gpu", GpuOpt), option("gpus", GpusOpt), option("gpus_per_node", PerNodeOpt),
               option("nic_gbps", NicOpt), option("nvlink_gbs", NvlinkOpt), option("cluster_file", ClusterOpt)]
    return packed("cluster", options, cluster_of_flags)(command)


def with_workload(command: Command) -> Command:
    """--gbs, --seq, --dtype and --fp8-recipe in place of the command's `workload: Workload`."""
    options = [option("gbs", GbsOpt, 256), option("seq", SeqOpt, 4096), option("dtype", DtypeOpt, "bf16"),
               option("fp8_recipe", Fp8RecipeOpt, "tensorwise")]
    return packed("workload", options, workload_arg)(command)


def workload_arg(gbs: int, seq: int, dtype: str, fp8_recipe: str) -> Workload:
    if fp8_recipe != "tensorwise" and dtype != "fp8":
        raise InputError(f"--fp8-recipe {fp8_recipe} needs --dtype fp8")
    return Workload(global_batch=gbs, seq_len=seq, dtype=dtype, fp8_recipe=fp8_recipe)


def report_export(con: Console, exported: Any, target: str | None, written: list[Any] | None) -> None:
    """After a command's tables: where --export wrote (`written`: the files, or None without --export-out), or the
    exported files themselves."""
    if exported is None:
        return
    if written is not None:
        con.print(f"{target} export written to {', '.join(str(f.path) for f in written)}")
    else:
        echo_export(exported)


def echo_export(exported: Any) -> None:
    """Print exported files to stdout: one as is, several each under a `==> name <==` line (as head does)."""
    for f in exported.files:
        if len(exported.files) > 1:
            typer.echo(f"==> {f.name} <==")
        typer.echo(f.text, nl=False)


def with_budget(command: Command) -> Command:
    """--price-per-gpu-hour, --tokens and the failure flags in place of the command's `budget: Budget`."""
    options = [
        option("price", Annotated[float | None, typer.Option("--price-per-gpu-hour", min=0.0, rich_help_panel=P_COST,
                                                             help=("USD per GPU-hour; default the hardware "
                                                                   "database's indicative price (hardware show)."))]),
        option("tokens", Annotated[float | None, typer.Option("--tokens", min=1.0, rich_help_panel=P_COST, help=(
            "Tokens to train on (e.g. 15e12): time to train and total cost, with failures, checkpoints and "
            "restarts (Daly's optimum checkpoint interval)."))]),
        option("failure_rate", Annotated[float, typer.Option(
            "--failure-rate", min=1e-12, max=1.0, rich_help_panel=P_COST,
            help="Job interruptions per GPU-hour; default Llama 3's 419 in 54 days on 16,384 GPUs (1.97e-5).")],
               LLAMA3_FAILURES_PER_GPU_HOUR),
        option("ckpt_gbps", Annotated[float | None, typer.Option("--ckpt-gbps", min=0.001, rich_help_panel=P_COST,
                                                                 help=("Checkpoint write bandwidth of the whole "
                                                                       "job, GB/s; default Llama 3's 2 TB/s for "
                                                                       "16,384 GPUs, pro rata."))]),
        option("restart_min", Annotated[float, typer.Option("--restart-min", min=0.0, rich_help_panel=P_COST, help=(
            "Minutes from an interruption to training again (reschedule, reload, warm up); an assumption."))], 10.0),
    ]
    return packed("budget", options, budget_of_flags)(command)


# the budget flags' ranges: beyond these no figure means anything (and the arithmetic overflows to inf)
BUDGET_BOUNDS = {"--price-per-gpu-hour": (0.0, 1e4), "--tokens": (1.0, 1e18), "--failure-rate": (1e-12, 1.0),
                 "--ckpt-gbps": (1e-3, 1e6), "--restart-min": (0.0, 7 * 24 * 60.0)}


def check_budget(flag: str, value: float | None) -> None:
    """A budget flag (BUDGET_BOUNDS) finite and in its range, the error naming the flag; None: not given."""
    low, high = BUDGET_BOUNDS[flag]
    if value is not None and not (math.isfinite(value) and low <= value <= high):
        raise InputError(f"{flag} {value:g}: give a finite number from {low:g} to {high:g}")


def budget_of_flags(price: float | None, tokens: float | None, failure_rate: float, ckpt_gbps: float | None,
                    restart_min: float) -> Budget:
    given = {"--price-per-gpu-hour": price, "--tokens": tokens, "--failure-rate": failure_rate,
             "--ckpt-gbps": ckpt_gbps, "--restart-min": restart_min}
    for flag, value in given.items():
        check_budget(flag, value)
    reliability = Reliability(failure_rate, None if ckpt_gbps is None else ckpt_gbps * 1e9, restart_min * 60.0)
    return Budget(price, tokens, reliability)
