"""`meshplan calibrate`: fit the cost model's few physical factors to step times a team measured."""

import math
import time
from datetime import date
from pathlib import Path
from typing import Annotated, Literal

import typer
from rich.text import Text

from meshplan.cli.options import console, output_targets, print_table
from meshplan.hardware_db.errors import InputError

PARAMETER_HELP = {"gemm": "every GEMM kernel ceiling", "attention": "every attention kernel ceiling",
                  "memory": "memory-bound kernels' share of HBM bandwidth",
                  "network": "the collectives' share of the link rates", "overhead": "the launch cost per operator"}


def calibrate(
    out: Annotated[Path, typer.Option("--out", help=(
        "Calibration file to write (atomically); plan, estimate and sweep take a GPU's with --calibration."))],
    runs: Annotated[list[Path] | None, typer.Option("--runs", help=(
        "Runs file (TOML or JSON, one [[run]] per measured run: model, gpu, gpus, global_batch, seq_len, runtime, "
        "step_time_s or tokens_per_s_per_gpu, and a [run.layout] of the knobs; or log = FILE with format = megatron "
        "or torchtitan (and config = its TOML), gpu, and what else the log does not say; docs/calibration.md). "
        "Repeatable; every run on one GPU type."))] = None,
    parameters: Annotated[str, typer.Option("--parameters", help=(
        "Factors to fit, comma-separated: gemm, attention, memory, network, overhead (default: all five; each "
        "keeps its prior where the runs cannot tell it)."))] = "gemm,attention,memory,network,overhead",
    kernels: Annotated[Literal["none", "aiconfigurator"], typer.Option("--kernels", help=(
        "aiconfigurator: centre the GEMM factor's prior on NVIDIA AIConfigurator's measured GEMMs of the runs' GPU "
        "and precision (the extra meshplan[aic]; docs/calibration.md) instead of on the default."))] = "none",
    prior: Annotated[Literal["public", "defaults"], typer.Option("--prior", help=(
        "Where each factor's prior is centred. public: on the GPU's public calibration (the factors fit to every "
        "published run on it, what plan uses without --calibration), where meshplan ships one, else the defaults; "
        "defaults: on the GPU's efficiency defaults."))] = "public",
    deployments: Annotated[Literal["aic"] | None, typer.Option("--deployments", help=(
        "Instead of --runs, fit a serving engine's host time per iteration and front-end time per request (its "
        "kernels' factors held at the GPU's defaults) to measured deployments. aic: NVIDIA AIConfigurator's "
        "silicon_sample.csv from the installed wheel (the extra meshplan[aic]; docs/serving.md). Prices every row 7 "
        "times at the defaults, 7 at the fit, and the engine's rows 7 more per model left out: about an hour on 2 "
        "processes (--jobs)."))]
    = None,
    engine: Annotated[Literal["vllm", "sglang", "trtllm"] | None, typer.Option("--engine", help=(
        "With --deployments: the engine to calibrate."))] = None,
    jobs: Annotated[int, typer.Option("--jobs", min=1, help=(
        "With --deployments: processes pricing the rows."))] = 1,
) -> None:
    """Fit the cost model's physical factors (GEMM and attention ceilings, memory and network efficiency, launch cost)
    to measured step times, each held near its default by a prior; never a factor per run.

    Prints each factor as fitted with its spread, the error on the runs before and after, and the error on runs
    left out of the fit (5 folds, or one run at a time when there are fewer). Where the runs report their peak
    memory, a factor on the layers' activations is fit to it the same way.
    """
    from meshplan.costmodels.fit import calibration_from_runs, memory_errors, prior_centre
    from meshplan.planner.measured_runs import read_runs
    from meshplan.planner.plan import write_text_atomic

    (out,) = output_targets(out=out)
    if deployments is not None:
        if runs:
            raise InputError("--runs and --deployments fit different things (a GPU's factors, a serving engine's "
                             "parameters): give one")
        if engine is None:
            raise InputError("--deployments needs --engine vllm, sglang or trtllm")
        _engine_calibration(engine, out, jobs)
        return
    if not runs:
        raise InputError("nothing to calibrate on: give --runs FILE (measured training runs) or --deployments aic "
                         "--engine ENGINE (measured serving deployments)")
    names = tuple(p.strip() for p in parameters.split(",") if p.strip())
    steps = [step for path in runs for step in read_runs(path)]
    centre, label = prior_centre(steps, prior)
    table = None
    if kernels == "aiconfigurator" and steps:
        from meshplan.costmodels.kernel_tables import gemm_prior

        table = gemm_prior(steps[0].cluster.gpu, [s.workload.dtype for s in steps])
        centre, label = {**centre, "gemm": table.log_factor}, f"{label}; GEMM: {table.source}"
    cal = calibration_from_runs(steps, [str(p) for p in runs], names, created=date.today().isoformat(),
                                prior_mean=centre or None, prior=label)
    try:
        write_text_atomic(out, cal.model_dump_json(indent=1) + "\n")
    except OSError as exc:
        raise InputError(f"cannot write {out}: {exc.strerror}; choose a writable --out") from None
    con = console()
    con.print(Text.assemble((f"{cal.runs} run(s)", "bold"), f" on {cal.gpu} ({', '.join(cal.runtimes)})"))
    if table is not None:
        con.print(f"GEMM prior centred on {table.source}: x {math.exp(table.log_factor):.3f} on the default "
                  f"({table.rows:,} {table.dtype} GEMMs, 1 sd {100 * table.log_sd:.0f} %)")
    rows = [[name, PARAMETER_HELP[name], f"x {f.factor:.3f}", f"{100 * f.log_sd:.0f} %"]
            for name, f in cal.factors.items()]
    print_table(con, "factors on the GPU's defaults", ["factor", "what it scales", "fitted", "spread (1 sd)"], rows,
                left=("factor", "what it scales"))
    if cal.error_prior is not None and cal.prior.startswith("public"):
        con.print(f"priors centred on {cal.prior.split(';')[0]} (each factor's spread as with the defaults)")
    centred = "" if cal.error_prior is None else f", {100 * cal.error_prior:.1f} % at the priors' centre"
    con.print(f"error on these runs: {100 * cal.error_before:.1f} % with the defaults{centred}, "
              f"{100 * cal.error_after:.1f} % calibrated (mean absolute, throughput)")
    if cal.held_out_before is not None and cal.held_out_after is not None:
        con.print(f"error on runs left out of the fit: {100 * cal.held_out_before:.1f} % with the defaults, "
                  f"{100 * cal.held_out_after:.1f} % calibrated")
    else:
        con.print("one run: no run is left to check the fit on; measure more layouts")
    memory = memory_errors(steps)
    if memory and cal.activations is not None and cal.memory_error_before is not None:
        kinds = ", ".join(sorted({s.memory_kind for s, _ in memory}))
        con.print(f"peak memory ({cal.memory_runs} run(s), {kinds}): activations x {cal.activations.factor:.3f} "
                  f"(1 sd {100 * cal.activations.log_sd:.0f} %); error {100 * cal.memory_error_before:.1f} % with the "
                  f"defaults, {100 * (cal.memory_error_after or 0.0):.1f} % calibrated")
        if cal.memory_held_out_before is not None and cal.memory_held_out_after is not None:
            con.print(f"peak memory left out of the fit: {100 * cal.memory_held_out_before:.1f} % with the defaults, "
                      f"{100 * cal.memory_held_out_after:.1f} % calibrated")
    con.print(f"calibration written to {out}; use it with --calibration {out}")


def _engine_calibration(engine: str, out: Path, jobs: int) -> None:
    """`calibrate --deployments aic`: a serving engine's parameters from AIConfigurator's measured deployments."""
    from meshplan.costmodels.aic_deployments import read_deployments
    from meshplan.costmodels.engine_fit import calibration_rows, engine_calibration
    from meshplan.planner.plan import write_text_atomic

    data = read_deployments()
    con = console()
    con.print(f"{data.source}: pricing {len(data.deployments):,} rows with slopes at the defaults, again at the "
              f"fit, and {engine}'s again for each model left out ({jobs} process(es); about half an hour on 2)")
    start = time.perf_counter()

    def progress(step: str) -> None:
        con.print(f"  {time.perf_counter() - start:5.0f} s  {step}")

    cal = engine_calibration(calibration_rows(data.deployments, jobs, progress), engine, data.source,
                             date.today().isoformat(), jobs, progress=progress)
    try:
        write_text_atomic(out, cal.model_dump_json(indent=1) + "\n")
    except OSError as exc:
        raise InputError(f"cannot write {out}: {exc.strerror}; choose a writable --out") from None
    con.print(Text.assemble((f"{engine}", "bold"), f": {cal.rows} rows of {len(cal.models)} checkpoints on "
                            f"{', '.join(cal.gpus)}"))
    rows = [[name, PARAMETER_HELP[name], f"x {f.factor:.3f}", f"{100 * f.log_sd:.0f} %"]
            for name, f in cal.factors.items()]
    rows += [["iteration", "host time per engine iteration", f"{1e3 * cal.iteration_s:.2f} ms",
              f"{1e3 * cal.iteration_sd_s:.2f} ms"],
             ["request", "front-end time per request (TTFT)", f"{1e3 * cal.request_s:.1f} ms",
              f"{1e3 * cal.request_sd_s:.1f} ms"]]
    print_table(con, "engine parameters", ["parameter", "what it is", "fitted", "spread (1 sd)"], rows,
                left=("parameter", "what it is"))
    con.print("each model left out of the fit (median absolute error, calibrated / uncalibrated): " + ", ".join(
        f"{m.upper() if m != 'throughput' else m} {100 * cal.held_out[m]:.1f} / {100 * cal.uncalibrated[m]:.1f} %"
        for m in cal.held_out if m in cal.uncalibrated))
    con.print(f"engine calibration written to {out}")
