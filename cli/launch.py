"""`meshplan export`, `import`, `show` and `verify`: plans into launchers and back, and checked on the executor."""

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from meshplan import api
from meshplan.cli.lines import note, one_line, print_error
from meshplan.cli.options import (MAX_VERIFY_RANKS, MAX_VERIFY_STEPS, MAX_VERIFY_TIMEOUT_S, P_CLUSTER, P_OUT, P_PAR,
                                  AnyExportTarget, CalibrationOpt, ClusterOpt, GpuOpt, ImportSource, NicOpt, NvlinkOpt,
                                  PerNodeOpt, cluster_of_flags, console, echo_export, option, output_targets, packed,
                                  working)
from meshplan.cli.serve import print_serving
from meshplan.cli.train import print_cost, print_estimate
from meshplan.costmodels.config import MAX_GLOBAL_BATCH, MAX_SEQ_LEN, Workload
from meshplan.costmodels.estimate import simulate_config
from meshplan.costmodels.model_io import load_model
from meshplan.costmodels.runtime import DEFAULT_RUNTIME
from meshplan.hardware_db.calibration import load_calibration
from meshplan.hardware_db.documents import read_text
from meshplan.hardware_db.errors import InputError
from meshplan.planner.outputs import OutputFile, write_all


def export_(
    plan_file: Annotated[Path, typer.Argument(help="A plan written by `meshplan plan --out` or `meshplan import`.")],
    to: Annotated[AnyExportTarget, typer.Option("--to", help=(
        "Training plans: megatron (pretrain_gpt.py arguments in a torchrun script), torchtitan (the TOML job "
        "config <= 0.2 and the config-registry function >= 0.3), deepspeed (ds_config.json and the "
        "Megatron-DeepSpeed script), torchrun (meshplan's executor on the plan's world), nemo (NeMo 2 "
        "MegatronStrategy and Megatron-Bridge overrides). Serving plans: vllm, sglang, trtllm (TensorRT-LLM's "
        "trtllm-serve): launch scripts per node and a Dynamo graph."))],
    out: Annotated[Path | None, typer.Option("--out", help=(
        "Write here (atomically): the file, or a directory when the export has several files. Default: print."))
    ] = None,
) -> None:
    """Turn a plan into a launcher's configuration, with the plan's predicted figures in a header comment.

    A plan the launcher cannot express (a schedule it lacks, a ZeRO stage it has not, uneven stages it cannot
    place) is refused with the reason and what to re-plan with; it is never silently changed.
    """
    from meshplan.planner.launchers import export_plan, write_export
    from meshplan.planner.launchers import EXPORT_NAMES
    from meshplan.planner.launchers.common import runtime_note
    from meshplan.planner.plan import Plan

    # export's --out is a folder when it has several files
    (out,) = output_targets(directories=("out",), contents={"out": EXPORT_NAMES[to]}, out=out)
    opened = api.open_plan(plan_file)
    for line in (opened.repriced, opened.note):
        if line:
            note(line)
    exported = export_plan(opened.plan, to)
    if isinstance(opened.plan, Plan):
        other = runtime_note(opened.plan, to)  # a plan made for another framework, priced under this one's too
        if other is not None:
            note(other)
    if out is None:
        echo_export(exported)
        return
    written = write_export(exported, out)
    console().print(f"{to} export written to {', '.join(map(str, written))}")


def _names_a_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # an argument string longer than a file name can be
        return False


@dataclass(frozen=True)
class ClusterFlags:
    """The cluster flags as given: `import` makes the cluster once it knows the launch's world size."""

    gpu: str | None = None
    gpus: int | None = None
    gpus_per_node: int | None = None
    nic_gbps: float | None = None
    nvlink_gbs: float | None = None
    cluster_file: str | None = None


IMPORT_CLUSTER = [
    option("gpu", GpuOpt),
    option("gpus", Annotated[int | None, typer.Option("--gpus", min=1, rich_help_panel=P_CLUSTER, help=(
        "World size, when SOURCE does not say it (no torchrun line)."))]),
    option("gpus_per_node", PerNodeOpt), option("nic_gbps", NicOpt), option("nvlink_gbs", NvlinkOpt),
    option("cluster_file", ClusterOpt)]


@packed("flags", IMPORT_CLUSTER, ClusterFlags)
def import_(
    source_text: Annotated[str, typer.Argument(metavar="SOURCE", help=(
        "megatron: the pretrain_gpt.py arguments in one string after `--` (optionally after `torchrun ... "
        "script.py`, which gives the world size), or a file holding them (an exported megatron.sh works); "
        "torchtitan: the TOML job config file."))],
    source: Annotated[ImportSource, typer.Option("--from", help="What SOURCE is.")],
    model: Annotated[str | None, typer.Option("--model", "-m", help=(
        "The model (zoo name or config file), when the arguments do not describe it whole; model arguments that "
        "are given must agree with it."))] = None,
    flags: ClusterFlags = ClusterFlags(),  # --gpu --gpus --gpus-per-node --nic-gbps --nvlink-gbs --cluster
    runtime: Annotated[str | None, typer.Option("--runtime", metavar="PRESET[+OPTION...]", rich_help_panel=P_PAR,
                                                   help=(
        "Training framework behaviour, as for `plan`. Default: what the configuration implies (torchtitan: "
        "torchtitan with +compile, +async-tp, +cp-alltoall as its TOML turns them on; megatron: +bf16-grads with "
        f"--grad-reduce-in-bf16), else {DEFAULT_RUNTIME}."))] = None,
    calibration: CalibrationOpt = None,
    out: Annotated[Path | None, typer.Option("--out", rich_help_panel=P_OUT, help=(
        "Write the pinned plan as Plan JSON, to `meshplan show`, `export` or compare with `meshplan plan`."))] = None,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel=P_OUT, help=(
        "Print the pinned plan as Plan JSON and nothing else."))] = False,
    against_best: Annotated[bool, typer.Option("--compare/--no-compare", rich_help_panel=P_OUT, help=(
        "End with the imported configuration beside the best plan `meshplan plan` finds for the same model, "
        "cluster, batch and runtime (one more search)."))] = True,
) -> None:
    """Read the launch configuration you run today into a pinned plan and estimate it, then compare it with the
    best plan for the same model, cluster and batch. Arguments meshplan does not
    model (data, optimizer, logging) are ignored; ones it cannot represent are refused with the reason. A torchrun
    line's --nproc-per-node is the node size unless --gpus-per-node says otherwise.
    """
    from meshplan.planner.launchers import launch_model, launch_world, pinned_plan, read_launch
    from meshplan.planner.plan import write_plan

    (out,) = output_targets(out=out)

    text, origin = source_text, "the arguments"
    path = Path(source_text)
    if source == "torchtitan" or _names_a_file(path):
        text, origin = read_text(path, "a torchtitan TOML job config or a launch script"), str(path)
    named = load_model(model) if model else None
    launch = read_launch(source, text, origin, named.num_layers if named else None)
    runtime = runtime or launch.runtime or DEFAULT_RUNTIME
    f = flags
    world = launch_world(launch, f.gpus if f.cluster_file is None else None)
    per_node = f.gpus_per_node if f.gpus_per_node is not None or f.cluster_file else launch.gpus_per_node
    spec = cluster_of_flags(f.cluster_file, f.gpu, None if f.cluster_file else world, per_node, f.nic_gbps,
                            f.nvlink_gbs)
    cluster, eff = api.calibrated(spec, calibration, runtime)
    if cluster.num_gpus != world:
        raise InputError(f"the cluster has {cluster.num_gpus} GPUs but the launch configuration runs {world}")
    spec = launch_model(launch, named)
    doc, sim = pinned_plan(launch, spec, cluster, runtime, eff, eff.calibration if eff else None)
    doc = api.priced(doc)
    if out is not None:
        write_plan(doc, out)
    if as_json:
        typer.echo(doc.model_dump_json(indent=2))
        return
    con = console()
    workload = Workload(**launch.workload.model_dump())
    print_estimate(con, spec, cluster, workload, sim.estimate)
    if out is not None:
        con.print(f"pinned plan written to {out}")
    if against_best:
        _against_best(con, doc, spec, cluster.spec, workload, runtime, calibration)


def _against_best(con: Console, doc: Any, spec: Any, cluster: Any, workload: Workload, runtime: str,
                  calibration: str | None) -> None:
    """The imported plan beside the search's best on the same inputs; a search that finds nothing says why."""
    from meshplan.cli.compare import print_comparison
    from meshplan.planner.compare import compare_plans

    try:
        with working("searching the best plan to compare with"):
            best = api.search_plans(spec, cluster, workload, runtime=runtime, calibration=calibration, top=1).plan
    except InputError as exc:
        con.print(f"no plan to compare with: {exc}")
        return
    print_comparison(con, compare_plans([doc, best], ["imported", "best plan"]))


def show(
    plan_file: Annotated[Path, typer.Argument(help="A plan written by `meshplan plan`, `serve` or `import`.")],
    trace: Annotated[Path | None, typer.Option("--trace", help=(
        "Also write the plan's simulated pipeline timeline as a Chrome trace (open in ui.perfetto.dev)."))] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the validated plan as JSON.")] = False,
) -> None:
    """Print a plan file readably, every figure re-derived from its inputs and layout: an edited figure is refused,
    a plan of another cost model is re-priced and the difference said. Refuses plans of another schema version."""
    from meshplan.planner.plan import ServingPlan, plan_config
    from meshplan.planner.trace import chrome_trace, write_trace

    (trace,) = output_targets(trace=trace)
    opened = api.open_plan(plan_file)
    doc = opened.plan
    if isinstance(doc, ServingPlan) and trace is not None:
        raise InputError("--trace draws a training plan's pipeline; this is a serving plan")
    con = console()
    if as_json:
        typer.echo(doc.model_dump_json(indent=2))
    else:
        kind = "serving plan" if isinstance(doc, ServingPlan) else "plan"
        con.print(f"{kind} {plan_file} (schema v{doc.schema_version}, meshplan {doc.meshplan_version}, "
                  f"cost model {doc.cost_model or 'not recorded'})")
    for line in (opened.repriced, opened.note):
        if line:
            note(line) if as_json else con.print(Text(line, "yellow"), soft_wrap=True)  # beside the JSON, not in it
    if isinstance(doc, ServingPlan):
        if not as_json:
            print_serving(con, doc.inputs.model_spec(), doc.inputs.cluster.cluster(), doc.inputs.workload,
                          doc.inputs.targets, doc, None, doc.search.alternatives if doc.search else [])
        return
    spec, cluster, wl, cfg, runtime = plan_config(doc)
    # a calibrated plan's curves are not in the file: its tables and trace use the GPU's default efficiency
    sim = opened.simulated or simulate_config(spec, cluster, wl, cfg, runtime)
    if not as_json:
        if opened.simulated is None:
            con.print(f"the plan's prediction: step {doc.prediction.step_time_s:.3f} s, "
                      f"{doc.prediction.tokens_per_s_per_gpu:,.1f} tokens/s/GPU; the tables below are simulated with "
                      f"the GPU's default efficiency")
        print_estimate(con, spec, cluster, wl, sim.estimate)
        if doc.search is not None:
            s = doc.search
            con.print(f"search: rank {s.rank}, {s.status} (gap {100 * s.gap:.2f} %), {s.space_size:,} candidates, "
                      f"{s.evaluated:,} simulated" + ("" if s.seconds is None else f", {s.seconds:.2f} s"))
        if doc.economics is not None:
            print_cost(con, doc.economics)
    if trace is not None:
        write_trace(chrome_trace(sim), trace)
        if not as_json:
            con.print(f"trace written to {trace}")


@dataclass(frozen=True)
class RunShape:
    """What `verify` runs of the plan: its model at a size, for some steps, sequences and micro-batches, in a dtype."""

    scale: Literal["tiny", "small", "none"] = "tiny"
    steps: int = 2
    seq: int | None = None
    microbatches: int | None = None
    dtype: Literal["float64", "float32", "bfloat16"] = "float64"


RUN_SHAPE = [
    option("scale", Annotated[Literal["tiny", "small", "none"], typer.Option("--scale", help=(
        "Model size to run: the plan's model with its layer count, structure and divisibility kept, widths "
        "shrunk (docs/executor.md); none runs the plan's model as it is (a small model only)."))], "tiny"),
    option("steps", Annotated[int, typer.Option("--steps", min=1, max=MAX_VERIFY_STEPS, help=(
        "AdamW steps; parameters are compared after the last."))], 2),
    option("seq", Annotated[int | None, typer.Option("--seq", min=1, max=MAX_SEQ_LEN, help=(
        "Tokens per sequence (default 16, raised to a multiple of 2 x cp x tp)."))]),
    option("microbatches", Annotated[int | None, typer.Option("--microbatches", min=1, max=MAX_GLOBAL_BATCH, help=(
        "Micro-batches per step (default: the plan's); fewer keeps a big plan's run short."))]),
    option("dtype", Annotated[Literal["float64", "float32", "bfloat16"], typer.Option("--dtype", help=(
        "float64 checks everything to 1e-6 (relative); float32 loss and gradients to 1e-4, parameter updates to 1e-2 "
        "norm-wise; bfloat16 (what a GPU trains in, and the dtype of its calibration) loss 3e-2, gradients 1e-1, "
        "updates 0.5, so it finds only O(1) layout bugs (docs/executor.md)."))], "float64")]


@packed("shape", RUN_SHAPE, RunShape)
def verify(
    plan_file: Annotated[Path, typer.Argument(help="A plan written by `meshplan plan --out`.")],
    shape: RunShape = RunShape(),  # --scale --steps --seq --microbatches --dtype
    backend: Annotated[Literal["gloo", "nccl"], typer.Option("--backend", help=(
        "Process-group backend. gloo: CPU tensors; nccl: one GPU per rank (local rank i on cuda:i), the same code "
        "on another device (training plans; the serving check runs on gloo)."))] = "gloo",
    launcher: Annotated[Literal["spawn", "torchrun"] | None, typer.Option("--launcher", help=(
        "spawn: start the plan's ranks here, one process each. torchrun: this process is one rank of a torchrun "
        "world of the plan's size (rank 0 prints the report). Default: torchrun when RANK is set, else spawn."))
    ] = None,
    timeout: Annotated[float, typer.Option("--timeout", min=1, max=MAX_VERIFY_TIMEOUT_S, help=(
        "Seconds before a rank that has not finished ends the run (with that rank's name)."))] = 300.0,
    max_ranks: Annotated[int, typer.Option("--max-ranks", min=1, max=MAX_VERIFY_RANKS, help=(
        "Refuse plans with more ranks than this on gloo (each rank is a process holding a model copy)."))] = 16,
    out: Annotated[Path | None, typer.Option("--out", help="Write the report as JSON (atomically).")] = None,
    trace: Annotated[Path | None, typer.Option("--trace", help=(
        "Write a Chrome trace (open in ui.perfetto.dev): the cost model's simulated step of this run above the ranks' "
        "measured last step, one track per stage / rank."))] = None,
    calibration: Annotated[str | None, typer.Option("--calibration", help=(
        "A calibration of this host's CPU (meshplan profile --device cpu): the prediction beside the measurement is "
        "then for this run on this host, not on the plan's GPUs."))] = None,
    inject: Annotated[str | None, typer.Option("--inject", hidden=True, help=(
        "Run a deliberately broken layout (see executor.plan_run.INJECTIONS) to see the check fail."))] = None,
) -> None:
    """Run the plan's exact layout (every degree, rank order, stage split, schedule, ZeRO stage, recomputation) on
    torch.distributed at a reduced model size, and check that loss, every gradient and the parameters after N
    steps match a single-process run; measured memory and time are shown beside the cost model's prediction.
    Exit code 0: the numerics match; 1: they do not (the report says where); 2: bad input."""
    from meshplan.executor.verify import VerifyOptions, run_verify
    from meshplan.planner.plan import ServingPlan
    from meshplan.planner.trace import trace_text

    out, trace = output_targets(out=out, trace=trace)
    doc = api.open_plan(plan_file).plan
    if isinstance(doc, ServingPlan):
        if backend != "gloo" or launcher == "torchrun":
            raise InputError("the serving check spawns its engines' ranks on gloo here; drop --backend nccl and "
                             "--launcher torchrun (training plans take them)")
        try:
            _verify_serving(doc, shape.scale, shape.steps, shape.seq, max_ranks, timeout, calibration, inject, out)
        except RuntimeError as exc:  # a rank that raised or hung (executor.launch.RankFailure): one line, exit 1
            if type(exc).__name__ != "RankFailure":
                raise
            print_error(one_line(exc))
            raise typer.Exit(1) from None
        return
    if launcher is None:
        launcher = "torchrun" if "RANK" in os.environ else "spawn"
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if launcher == "torchrun" and missing:
        raise InputError(f"--launcher torchrun runs under torchrun, but {', '.join(missing)} are not set; start "
                         f"it as `torchrun --nproc-per-node N $(which meshplan) verify ...`, or use --launcher spawn")
    opts = VerifyOptions(scale=shape.scale, steps=shape.steps, seq=shape.seq, microbatches=shape.microbatches,
                         dtype=shape.dtype, backend=backend,
                         launcher=launcher, timeout_s=timeout, max_ranks=max_ranks, inject=inject,
                         calibration=load_calibration(calibration) if calibration is not None else None,
                         calibration_origin=calibration or "the calibration")
    con = console()
    try:
        outcome = run_verify(doc, opts, progress=lambda text: con.print(Text(text, "dim")))
    except RuntimeError as exc:  # executor.launch.RankFailure: one line naming the rank that failed or hung
        if type(exc).__name__ != "RankFailure":
            raise
        print_error(one_line(exc))
        raise typer.Exit(1) from None
    except TimeoutError as exc:  # --timeout on the single-process reference run (executor/verify.py)
        print_error(one_line(exc))
        raise typer.Exit(1) from None
    report = outcome.report
    if report is None:  # a torchrun rank other than 0: rank 0 prints and writes; exit as it does
        raise typer.Exit(0 if outcome.ok else 1)
    _print_verify(con, report)
    write_all(([OutputFile(out, report.to_json())] if out is not None else [])
              + ([OutputFile(trace, trace_text(dict(outcome.trace)))] if trace is not None else []))
    if not report.ok:
        raise typer.Exit(1)


def _verify_serving(doc: Any, scale: str, steps: int, seq: int | None, max_ranks: int, timeout: float,
                    calibration: str | None, inject: str | None, out: Path | None) -> None:
    """verify for a serving plan: each engine's prefill and decode steps with a KV cache against the reference."""
    import dataclasses

    from meshplan.executor.serving import run_serve_check

    report = run_serve_check(doc, scale=scale, prompt=seq, steps=steps, max_ranks=max_ranks, timeout_s=timeout,
                             calibration=load_calibration(calibration) if calibration is not None else None,
                             calibration_origin=calibration or "the calibration", inject=inject)
    con = console()
    table = Table(title=f"serving check: {report.scaled} (of {report.model}), float64, KV cache vs one forward")
    for col in ("engine", "ranks", "batch x (prompt + steps)", "max rel. error", "prefill s (pred.)",
                "decode step s (pred.)", "KV bytes/rank (pred.)"):
        table.add_column(col, justify="left" if col == "engine" else "right", overflow="fold")
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
    con.print(Text.assemble((report.plan_model, "bold"), f" as {report.scaled_model}: {report.layout}, "
                            f"{report.world} ranks, gbs {report.gbs} x seq {report.seq}, {report.steps} steps, "
                            f"{report.dtype}"))
    t = Table(title="numerics vs the single-process run", show_header=True)
    for col in ("quantity", "max relative error", "worst", "tolerance"):
        t.add_column(col, overflow="fold")
    tol = report.tolerance
    t.add_row("loss (every step)", f"{report.loss_error:.2e}", "", f"{tol.loss:g}")
    t.add_row("gradients (step 1)", f"{report.grad_error:.2e}", report.worst_grad,
              f"{tol.limit('gradient', report.worst_grad):g}")
    t.add_row(f"parameter{' updates, norm-wise' if tol.by_update else 's'} (after step {report.steps})",
              f"{report.param_error:.2e}", report.worst_param, f"{tol.param:g}")
    con.print(t)
    calibrated = report.predicted_on != "the plan's GPUs"
    m = Table(title="per rank, measured vs predicted (memory: tensor accounting of the last step, activations at "
                    f"their peak, vs the cost model's elements at the run's dtype; predicted on {report.predicted_on})")
    for col in ("rank", "stage", "params MiB", "grads MiB", "optimizer MiB", "activations MiB", "memory MiB",
                "predicted MiB", "error", "step s", "predicted s", "error"):
        m.add_column(col, justify="right", overflow="fold")
    mib = 2.0 ** 20
    for row, step_s in zip(report.memory, report.measured_step_s, strict=True):
        meas = row.measured
        m.add_row(str(row.rank), str(row.stage), *(f"{meas.get(k, 0.0) / mib:.3f}" for k in
                  ("parameters", "gradients", "optimizer", "activations")),
                  f"{row.measured_total / mib:.3f}", f"{row.predicted_total / mib:.3f}",
                  f"{100 * (row.predicted_total / row.measured_total - 1):+.1f} %" if row.measured_total else "-",
                  f"{step_s:.4f}", f"{report.predicted_step_s:.4f}",
                  f"{100 * (report.predicted_step_s / step_s - 1):+.1f} %" if calibrated and step_s else "-")
    con.print(m)
    peaks = [f"rank {row.rank} {row.measured['allocator_peak'] / mib:,.1f}" for row in report.memory
             if "allocator_peak" in row.measured]
    if peaks:
        con.print("allocator peak (torch.cuda.max_memory_allocated, last step), MiB: " + ", ".join(peaks))
    slowest = max(report.measured_step_s, default=0.0)
    if calibrated:
        con.print(f"step time: measured {slowest:.4f} s (slowest rank) vs predicted {report.predicted_step_s:.4f} s "
                  f"on {report.predicted_on}: {100 * (report.predicted_step_s / slowest - 1):+.1f} %")
    else:
        con.print(f"step time: measured {slowest:.3f} s (slowest rank, CPU) vs predicted "
                  f"{report.predicted_step_s:.4f} s "
                  f"on the plan's GPUs: not comparable in absolute terms; compare the timelines (--trace), or give "
                  f"--calibration with a profile of this CPU")
    for line in report.notes:
        con.print(Text(f"note: {line}", "dim"))
    if report.ok:
        within = "the tolerances above" if tol.by_update else f"{tol.loss:g}"
        con.print(Text.assemble(("OK", "green"), f": the layout computes the same training step (within {within})"))
    else:
        con.print(Text.assemble(("FAIL", "red"), f": {len(report.failures)} problem(s)"))
        for line in report.failures[:20]:
            con.print(f"  {line}")
