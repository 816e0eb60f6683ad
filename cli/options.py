"""What the commands share: the options of estimate and plan (one definition, the same help in both), the
cluster and workload they describe, output paths checked before any work, the console."""

import os
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console

from meshplan.costmodels.config import RECOMPUTE_MODULES, RUNTIME_OPTIONS, RUNTIMES, RankOrder, Workload
from meshplan.hardware_db.cluster import ClusterSpec, load_cluster_file
from meshplan.hardware_db.errors import InputError
from meshplan.planner.outputs import check_distinct, check_target


EXIT_INPUT = 2  # bad input, the same code click uses for usage errors
MAX_VERIFY_STEPS = 1000  # verify compares parameters after a few steps; the reference draws every step's batch up front
MAX_VERIFY_TIMEOUT_S = 86_400.0  # a day
MAX_VERIFY_RANKS = 4096  # one process each, on this host


ExportTarget = Literal["megatron", "torchtitan", "deepspeed", "torchrun", "nemo"]  # planner.launchers.TARGETS
AnyExportTarget = Literal["megatron", "torchtitan", "deepspeed", "torchrun", "nemo", "vllm", "sglang"]  # + SERVING
P_MODEL, P_CLUSTER, P_PAR, P_OUT = "Model and workload", "Cluster", "Parallelism (unset: defaults)", "Output"

ImportSource = Literal["megatron", "torchtitan"]  # planner.launchers.SOURCES





def output_targets(directories: tuple[str, ...] = ("export_out",), **flags: Path | None) -> tuple[Path | None, ...]:
    """The command's output paths (keyword = option name), each checked before any work (planner/outputs.py; those
    named in `directories` may be a folder), and no two the same file."""
    checked = {"--" + k.replace("_", "-"): check_target(v, "--" + k.replace("_", "-"), directory_ok=k in directories)
               for k, v in flags.items()}
    check_distinct(checked)
    return tuple(checked.values())


def console() -> Console:
    """Rich console; piped output (CI logs, `| less`, tests) gets 140 columns instead of rich's 80 unless COLUMNS
    says."""
    return Console() if sys.stdout.isatty() or "COLUMNS" in os.environ else Console(width=140)


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
TpOpt = Annotated[int | None, typer.Option("--tp", min=1, rich_help_panel=P_PAR, help="Tensor-parallel degree.")]
PpOpt = Annotated[int | None, typer.Option("--pp", min=1, rich_help_panel=P_PAR,
                                              help="Pipeline-parallel degree (stages).")]
VppOpt = Annotated[int | None, typer.Option("--vpp", min=1, rich_help_panel=P_PAR, help=(
    "Virtual pipeline stages (model chunks) per pipeline rank; > 1 means the interleaved schedule."))]
DpOpt = Annotated[int | None, typer.Option("--dp", min=1, rich_help_panel=P_PAR, help=(
    "Data-parallel degree (GPUs / (tp x pp x cp) when unset)."))]
CpOpt = Annotated[int | None, typer.Option("--cp", min=1, rich_help_panel=P_PAR,
                                              help="Context-parallel degree (splits the sequence).")]
CpCommOpt = Annotated[Literal["ring", "a2a"] | None, typer.Option("--cp-comm", rich_help_panel=P_PAR, help=(
    "Context-parallel communication: ring (K,V passed around a ring, overlapped with attention) or a2a "
    "(all-to-all over heads, DeepSpeed-Ulysses)."))]
EpOpt = Annotated[int | None, typer.Option("--ep", min=1, rich_help_panel=P_PAR,
                                              help="Expert-parallel degree, MoE models only.")]
EtpOpt = Annotated[int | None, typer.Option("--etp", min=1, rich_help_panel=P_PAR,
                                               help="Expert tensor-parallel degree (estimate: default --tp).")]
MbsOpt = Annotated[int | None, typer.Option("--mbs", min=1, rich_help_panel=P_PAR,
                                               help="Micro-batch size, in sequences.")]
ZeroOpt = Annotated[int | None, typer.Option("--zero", min=0, max=3, rich_help_panel=P_PAR, help=(
    "ZeRO stage 0-3: 1 shards optimizer state (Megatron distributed optimizer), 2 also gradients, "
    "3 also weights (FSDP)."))]
SpOpt = Annotated[bool | None, typer.Option("--sp/--no-sp", rich_help_panel=P_PAR, show_default=False, help=(
    "Sequence parallelism with TP (estimate: on when --tp > 1)."))]
ScheduleOpt = Annotated[Literal["1f1b", "interleaved", "gpipe", "zb"] | None, typer.Option(
    "--schedule", rich_help_panel=P_PAR,
    help="Pipeline schedule (zb = zero-bubble ZB-H1; interleaved needs --vpp > 1).")]
OrderOpt = Annotated[RankOrder | None, typer.Option("--order", rich_help_panel=P_PAR, help=(
    "rank order of the dimensions, innermost first: tp-cp-dp-pp (Megatron default) or tp-cp-pp-dp "
    "(--use-tp-pp-dp-mapping; needs ep=1); plan: pins it"))]
RecomputeModulesOpt = Annotated[str | None, typer.Option(
    "--recompute-modules", metavar="MODULE[,MODULE...]", rich_help_panel=P_PAR, help=(
        "What selective recomputation re-runs (Megatron-Core --recompute-modules): core_attn (default), layernorm, "
        "mla_up_proj, mlp, moe_act, moe, shared_experts, comma-separated, e.g. mla_up_proj,moe_act."))]
CalibrationOpt = Annotated[str | None, typer.Option("--calibration", rich_help_panel=P_CLUSTER, help=(
    "Calibration file from `meshplan profile` (or a name under hardware_db/calibrations/): the device's measured "
    "GEMM, attention, memory and collective costs replace the GPU's efficiency defaults. A CPU calibration goes "
    "with --gpu cpu."))]
RuntimeOpt = Annotated[str, typer.Option("--runtime", metavar="PRESET[+OPTION...]", rich_help_panel=P_PAR, help=(
    f"Training framework behaviour: what it fuses, which kernels and which overlap it has, which schedules, CP kinds "
    f"and ZeRO stages it runs (docs/cost_model.md): {', '.join(RUNTIMES)}, with options appended as +option "
    f"({', '.join('+' + o for o in RUNTIME_OPTIONS)}), e.g. torchtitan+compile+async-tp."))]


def recompute_modules_arg(text: str | None) -> tuple[str, ...] | None:
    """--recompute-modules a,b as a tuple; an unknown name is one error line."""
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in RECOMPUTE_MODULES]
    if unknown or not names:
        raise InputError(f"--recompute-modules {text!r}: choose from {', '.join(RECOMPUTE_MODULES)}")
    return names


def workload_arg(gbs: int, seq: int, dtype: str, fp8_recipe: str) -> Workload:
    if fp8_recipe != "tensorwise" and dtype != "fp8":
        raise InputError(f"--fp8-recipe {fp8_recipe} needs --dtype fp8")
    return Workload(global_batch=gbs, seq_len=seq, dtype=dtype, fp8_recipe=fp8_recipe)


def one_line(text: object) -> str:
    return " ".join(str(text).split()).replace("Value error, ", "")


def echo_export(exported: Any) -> None:
    """Print exported files to stdout: one as is, several each under a `==> name <==` line (as head does)."""
    for f in exported.files:
        if len(exported.files) > 1:
            typer.echo(f"==> {f.name} <==")
        typer.echo(f.text, nl=False)


def print_error(message: str) -> None:
    """The one `error:` line, in a single write: ranks under torchrun share stderr, unbuffered (print writes the
    text and the newline apart, and two ranks' lines then interleave)."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
