"""`meshplan serve`: the serving search (meshplan/api.py) and its tables."""

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console

from meshplan.costmodels.economics import Budget, ServingCost
from meshplan import api
from meshplan.cli.options import (P_CLUSTER, P_COST, P_MODEL, P_OUT, P_PAR, BeyondContextOpt, GpuOpt, ModelOpt, NicOpt,
                                  NvlinkOpt, PerNodeOpt, check_budget, check_context, cluster_of_flags, console, option,
                                  output_targets, packed, print_table, report_export, working)
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import load_model
from meshplan.costmodels.serving import ServeTargets, ServeWorkload
from meshplan.costmodels.serving_uncertainty import SERVING_BACKOFF, SERVING_FEATURE_LABELS
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.planner.report import serving_report
from meshplan.planner.outputs import OutputFile, write_all
from meshplan.planner.plan import ServingRange, ServingRanges
from meshplan.planner.serve import SimulationCheck


@dataclass(frozen=True)
class ServeGpus:
    """The GPUs a serving search may use: at most cluster.num_gpus, at least `low`."""

    cluster: ClusterSpec
    low: int


def _serve_gpus(gpu: str | None, gpus: str | None, gpus_per_node: int | None, nic_gbps: float | None,
                nvlink_gbs: float | None) -> ServeGpus:
    from meshplan.planner.serve import parse_gpu_range

    low, high = parse_gpu_range(gpus)
    return ServeGpus(cluster_of_flags(None, gpu, high, gpus_per_node, nic_gbps, nvlink_gbs), low)


@dataclass(frozen=True)
class WorkloadFlags:
    """The serving workload as the flags give it; `weight_dtype_given` False: the model's published dtype applies."""

    workload: ServeWorkload
    weight_dtype_given: bool
    beyond_context: bool = False

    def for_model(self, spec: ModelSpec) -> ServeWorkload:
        """The workload for `spec`: its published weights unless --weight-dtype says, its requests within its
        context unless --beyond-context."""
        check_context(spec, self.workload.isl + self.workload.osl, "a request (--isl + --osl)", self.beyond_context)
        if self.weight_dtype_given or spec.weight_dtype in (None, self.workload.weight_dtype):
            return self.workload
        return self.workload.model_copy(update={"weight_dtype": spec.weight_dtype})


def _serve_workload(isl: int | None, osl: int | None, lengths: Path | None, weight_dtype: str | None,
                    kv_dtype: str, prefix_hit: float, spec_tokens: int, accept_rate: float | None,
                    two_batch_overlap: bool, beyond_context: bool) -> WorkloadFlags:
    from meshplan.planner.serve import Reuse, load_lengths, workload_from

    workload = workload_from(isl, osl, load_lengths(lengths) if lengths else None, weight_dtype or "bf16", kv_dtype,
                             Reuse(prefix_hit, spec_tokens, accept_rate), two_batch_overlap)
    return WorkloadFlags(workload, weight_dtype is not None, beyond_context)


def _pinned(layout: str | None, prefill_layout: str | None, engines: int | None, prefill_engines: int | None,
            batch: int | None) -> api.PinnedDeployment | None:
    from meshplan.planner.serve import parse_engine_layout

    if layout is None:
        if prefill_layout or engines or prefill_engines or batch:
            raise InputError("--prefill-layout, --engines, --prefill-engines and --batch go with --layout")
        return None
    return api.PinnedDeployment(parse_engine_layout(layout), engines, batch,
                                parse_engine_layout(prefill_layout) if prefill_layout else None, prefill_engines)


@dataclass(frozen=True)
class ServeOutputs:
    """What `serve` writes and prints besides its tables."""

    out: Path | None = None
    as_json: bool = False
    timing: bool = False
    export_to: Literal["vllm", "sglang", "trtllm"] | None = None
    export_out: Path | None = None
    report: Path | None = None


def _serve_outputs(**given: Any) -> ServeOutputs:
    """The output options, checked before any work."""
    from meshplan.planner.launchers import EXPORT_NAMES
    from meshplan.planner.report import SERVE_FILES

    outputs = ServeOutputs(**given)
    contents = {"report": SERVE_FILES} | ({"export_out": EXPORT_NAMES[outputs.export_to]} if outputs.export_to else {})
    out, export_out, report = output_targets(folders=("report",), contents=contents, out=outputs.out,
                                             export_out=outputs.export_out, report=outputs.report)
    if export_out is not None and outputs.export_to is None:
        raise InputError("--export-out needs --export vllm|sglang|trtllm")
    if outputs.as_json and outputs.export_to is not None and export_out is None:
        raise InputError("--json prints only the plan; give --export-out for the --export files")
    return replace(outputs, out=out, export_out=export_out, report=report)


GPU_OPTIONS = [
    option("gpu", GpuOpt),
    option("gpus", Annotated[str | None, typer.Option("--gpus", rich_help_panel=P_CLUSTER, help=(
        "GPUs: N (at most N) or A-B (deployments using A to B)."))]),
    option("gpus_per_node", PerNodeOpt), option("nic_gbps", NicOpt), option("nvlink_gbs", NvlinkOpt)]
WORKLOAD_OPTIONS = [
    option("isl", Annotated[int | None, typer.Option("--isl", min=1, rich_help_panel=P_MODEL, help=(
        "Input (prompt) tokens per request."))]),
    option("osl", Annotated[int | None, typer.Option("--osl", min=1, rich_help_panel=P_MODEL, help=(
        "Output tokens per request."))]),
    option("lengths", Annotated[Path | None, typer.Option("--lengths", rich_help_panel=P_MODEL, help=(
        "CSV of request lengths (columns input_tokens,output_tokens, or isl,osl): their means are the "
        "workload."))]),
    option("weight_dtype", Annotated[Literal["bf16", "fp8", "fp4"] | None, typer.Option(
        "--weight-dtype", rich_help_panel=P_MODEL,
        help=("Weights and GEMMs in bf16, fp8 or fp4 (NVFP4, from an NVFP4 checkpoint; Blackwell GPUs); default "
              "the model's published weights (fp8 for DeepSeek-V3), else bf16."))]),
    option("kv_dtype", Annotated[Literal["bf16", "fp8"], typer.Option("--kv-dtype", rich_help_panel=P_MODEL,
                                                                     help="KV cache precision.")], "bf16"),
    option("prefix_hit", Annotated[float, typer.Option("--prefix-hit", min=0.0, max=0.99, rich_help_panel=P_MODEL,
                                                       help=("Fraction of prompt tokens found in the prefix cache: "
                                                             "not computed, still attended to and cached."))], 0.0),
    option("spec_tokens", Annotated[int, typer.Option("--spec-tokens", min=0, max=16, rich_help_panel=P_MODEL, help=(
        "Speculative decoding: draft tokens per decode step (DeepSeek-V3's MTP, EAGLE); each step verifies them "
        "and keeps (1 - a^(k+1)) / (1 - a) tokens on average."))], 0),
    option("accept_rate", Annotated[float | None, typer.Option("--accept-rate", min=0.01, max=1.0,
                                                               rich_help_panel=P_MODEL, help=(
        "With --spec-tokens: the probability that a draft token is accepted."))]),
    option("two_batch_overlap", Annotated[bool, typer.Option("--two-batch-overlap", rich_help_panel=P_MODEL, help=(
        "Engines with expert and attention-DP parallelism run each iteration as two micro-batches, one's "
        "all-to-all under the other's compute (SGLang --enable-two-batch-overlap, vLLM --enable-dbo), where it "
        "pays."))], False),
    option("beyond_context", BeyondContextOpt, False)]
TARGET_OPTIONS = [
    option("ttft_ms", Annotated[float | None, typer.Option("--ttft-ms", min=0.001, max=1e9, rich_help_panel=P_PAR,
                                                           help="Time-to-first-token target, ms.")]),
    option("tpot_ms", Annotated[float | None, typer.Option("--tpot-ms", min=0.001, max=1e9, rich_help_panel=P_PAR,
                                                           help="Time-per-output-token target, ms.")]),
    option("e2e_ms", Annotated[float | None, typer.Option("--e2e-ms", min=0.001, rich_help_panel=P_PAR, help=(
        "End-to-end latency target (TTFT + OSL x TPOT), ms."))]),
    option("request_rate", Annotated[float | None, typer.Option("--request-rate", min=0.000001, rich_help_panel=P_PAR,
                                                                help="Requests/s to serve (objective min-gpus).")]),
    option("percentile", Annotated[Literal["mean", "p50", "p90", "p99"], typer.Option(
        "--percentile", rich_help_panel=P_PAR, help=(
            "The statistic --ttft-ms, --tpot-ms and --e2e-ms bound, over requests at the load the deployment "
            "runs (queueing included)."))], "p50")]
PINNED_OPTIONS = [
    option("layout", Annotated[str | None, typer.Option("--layout", rich_help_panel=P_PAR, help=(
        "Evaluate this engine instead of searching, e.g. tp8 or tp4,dp80,ep320 (the decode pool with "
        "--prefill-layout)."))]),
    option("prefill_layout", Annotated[str | None, typer.Option("--prefill-layout", rich_help_panel=P_PAR, help=(
        "With --layout: a disaggregated deployment with this prefill engine, e.g. tp4,dp8,ep32."))]),
    option("engines", Annotated[int | None, typer.Option("--engines", min=1, rich_help_panel=P_PAR, help=(
        "With --layout: engines of it (default: fill the GPUs, or 1 decode engine)."))]),
    option("prefill_engines", Annotated[int | None, typer.Option("--prefill-engines", min=1, rich_help_panel=P_PAR,
                                                                 help=("With --prefill-layout: prefill engines "
                                                                       "(default: as many as the decode pool "
                                                                       "needs)."))]),
    option("batch", Annotated[int | None, typer.Option("--batch", min=1, rich_help_panel=P_PAR, help=(
        "With --layout: running sequences per engine (default: the best that meets the targets)."))])]
OUTPUT_OPTIONS = [
    option("out", Annotated[Path | None, typer.Option("--out", rich_help_panel=P_OUT, help=(
        "Write the best deployment as a serving plan (Plan JSON, kind serving)."))]),
    option("as_json", Annotated[bool, typer.Option("--json", rich_help_panel=P_OUT, help=(
        "Print the serving plan as JSON and nothing else."))], False),
    option("timing", Annotated[bool, typer.Option("--timing", rich_help_panel=P_OUT, help=(
        "Record the search's wall time in the plan JSON (search.seconds). Off by default, so the same input "
        "writes a byte-identical plan; the table shows the time either way."))], False),
    option("export_to", Annotated[Literal["vllm", "sglang", "trtllm"] | None, typer.Option(
        "--export", rich_help_panel=P_OUT, help=(
            "Also export the best deployment's launch scripts and Dynamo graph (printed, or written to "
            "--export-out); trtllm: TensorRT-LLM's trtllm-serve."))]),
    option("export_out", Annotated[Path | None, typer.Option("--export-out", rich_help_panel=P_OUT,
                                                             help="Where --export writes.")]),
    option("report", Annotated[Path | None, typer.Option("--report", rich_help_panel=P_OUT, help=(
        "Directory for the Pareto front's report: serve-pareto.csv, serve-pareto.png and serve.html (one "
        "self-contained page)."))])]


@packed("gpus", GPU_OPTIONS, _serve_gpus)
@packed("flags", WORKLOAD_OPTIONS, _serve_workload)
@packed("targets", TARGET_OPTIONS, ServeTargets)
@packed("pinned", PINNED_OPTIONS, _pinned)
@packed("outputs", OUTPUT_OPTIONS, _serve_outputs)
def serve(
    model: ModelOpt,
    gpus: ServeGpus,  # --gpu --gpus N|A-B and the link flags
    flags: WorkloadFlags,  # --isl --osl --lengths --weight-dtype --kv-dtype --prefix-hit --spec-tokens ...
    targets: ServeTargets,  # --ttft-ms --tpot-ms --e2e-ms --request-rate --percentile
    objective: Annotated[Literal["throughput", "min-gpus"], typer.Option("--objective", rich_help_panel=P_PAR,
        help="throughput: most output tokens/s per GPU; min-gpus: fewest GPUs for --request-rate.")
    ] = "throughput",
    mem_fraction: Annotated[float, typer.Option("--mem-fraction", min=0.05, max=1.0, rich_help_panel=P_PAR, help=(
        "Fraction of HBM an engine uses (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static)."))] = 0.9,
    disaggregation: Annotated[bool, typer.Option("--disaggregation/--no-disaggregation", rich_help_panel=P_PAR,
        help="Also search separate prefill and decode pools.")] = True,
    pinned: api.PinnedDeployment | None = None,  # --layout --prefill-layout --engines --prefill-engines --batch
    top: Annotated[int, typer.Option("--top", min=1, max=100, rich_help_panel=P_OUT,
                                     help="Deployments to rank (at most 100).")] = 5,
    time_limit: Annotated[float | None, typer.Option("--time-limit", min=0.001, rich_help_panel=P_OUT, help=(
        "Stop taking engine layouts (smallest engines first) after about this many seconds of CPU time (the same "
        "work on a busy machine), once a deployment can be formed; the report says how many were left."))] = None,
    outputs: ServeOutputs = ServeOutputs(),  # --out --json --timing --export --export-out
    price: Annotated[float | None, typer.Option("--price-per-gpu-hour", min=0.0, rich_help_panel=P_COST, help=(
        "USD per GPU-hour for the cost lines and the plan's economics; default the hardware database's indicative "
        "price (hardware show)."))] = None,
    calibration: Annotated[str | None, typer.Option("--calibration", rich_help_panel=P_CLUSTER, help=(
        "What prices the engine's iterations. Default: the calibration meshplan ships for --engine, fit to "
        "AIConfigurator's measured deployments, where they ran on this GPU type, else the GPU's efficiency "
        "defaults (the output says which; docs/serving.md 'Engine calibration'). Or: none (the defaults), an "
        "engine calibration file (`meshplan calibrate --deployments`), a GPU calibration (`meshplan calibrate "
        "--runs`, `meshplan profile`) or public (the factors fit to published training runs)."))] = None,
    engine: Annotated[Literal["vllm", "sglang", "trtllm"], typer.Option("--engine", rich_help_panel=P_CLUSTER, help=(
        "The serving engine whose calibration prices the deployment."))] = "vllm",
) -> None:
    """Search serving deployments: TP, attention DP, PP and EP per engine, batch and chunk sizes, aggregated or
    disaggregated prefill and decode pools, under TTFT and TPOT targets.

    Reports the deployments that meet the targets ranked by output tokens/s per GPU (or fewest GPUs for
    --request-rate), the Pareto front of tokens/s/GPU vs tokens/s/user, and why the runners-up lose; when
    nothing meets the targets, the nearest miss and what it misses.
    """
    check_budget("--price-per-gpu-hour", price)  # before the search, as the training commands
    from meshplan.planner.launchers import export_files, export_plan
    from meshplan.planner.plan import plan_text

    spec = load_model(model)
    workload = flags.for_model(spec)
    if outputs.report is not None and pinned is not None:
        raise InputError("--report draws the search's Pareto front; a pinned --layout has none (drop one of them)")
    with working(f"searching deployments of {spec.name} on up to {gpus.cluster.num_gpus} GPUs"):
        found = api.search_deployments(spec, gpus.cluster, workload, targets, gpus.low, objective, disaggregation,
                                       top, mem_fraction, time_limit, pinned, outputs.timing, calibration, engine)
    doc, result, alternatives = found.plan, found.result, list(found.alternatives)
    if price is not None:
        doc = api.priced(doc, Budget(usd_per_gpu_hour=price))
    cluster = Cluster(gpus.cluster)
    exported = export_plan(doc, outputs.export_to) if outputs.export_to is not None else None
    written = export_files(exported, outputs.export_out) if exported and outputs.export_out is not None else []
    report = serving_report(doc, outputs.report, f"meshplan serve: {spec.name}") if outputs.report else []
    write_all(([OutputFile(outputs.out, plan_text(doc))] if outputs.out is not None else []) + written + report)
    if outputs.as_json:
        typer.echo(doc.model_dump_json(indent=2))
        return
    con = console()
    print_serving(con, spec, cluster, workload, targets, doc, result, alternatives)
    con.print(f"engines priced with {found.priced_with}")
    print_simulated(con, found.simulated, targets.percentile)
    if outputs.out is not None:
        con.print(f"serving plan written to {outputs.out}")
    report_export(con, exported, outputs.export_to, written if outputs.export_out is not None else None)
    if report:
        con.print(f"report written to {outputs.report}: " + ", ".join(f.path.name for f in report))


def _range(r: ServingRange | None, fmt: str) -> str:
    """' (lo-hi)' of one metric's interval, or nothing without one."""
    return "" if r is None else f" ({r.low:{fmt}}-{r.high:{fmt}})"


def serving_interval_line(ranges: ServingRanges) -> str:
    """Where the serving ranges in brackets come from (costmodels/serving_uncertainty.py)."""
    r = ranges.ttft_ms
    dropped = {d for m in (ranges.ttft_ms, ranges.tpot_ms, ranges.tokens_per_s_per_gpu) for d in m.dropped}
    given_up = ", ".join(SERVING_FEATURE_LABELS[d] for d in SERVING_BACKOFF if d in dropped)
    return (f"{100 * r.level:.0f} % ranges in brackets for a model the engine calibration never saw: the spread of "
            f"{r.models} models' errors, each measured with a fit that never saw it, and of {r.runs} measured "
            f"deployments about their model's"
            + (f" (rows of every {given_up}: too few share the plan's)" if dropped
               else " (of the plan's mode and users per engine)")
            + "; docs/serving.md")


def print_serving_cost(con: Console, cost: ServingCost) -> None:
    con.print(f"cost: ${cost.usd_per_hour:,.2f}/hour at ${cost.usd_per_gpu_hour:g} per GPU-hour, "
              f"${cost.usd_per_million_output_tokens:,.3f} and {cost.gpu_hours_per_million_output_tokens:,.3f} "
              "GPU-hours per million output tokens")


def print_simulated(con: Console, sim: SimulationCheck | None, percentile: str) -> None:
    """The best's engine simulated iteration by iteration beside the analytic figures (planner.serve)."""
    if sim is None:
        return
    verdict = f"misses {sim.misses}" if sim.misses else "meets the targets"
    scheduling = "" if sim.mixed else ", prompts first and unmixed as SGLang schedules by default"
    con.print(f"checked by simulation (one engine, Poisson arrivals at {sim.rate:.2f} requests/s, iteration by "
              f"iteration{scheduling}): TTFT {percentile} {sim.ttft_s * 1e3:.0f} ms "
              f"(model {sim.model_ttft_s * 1e3:.0f}), TPOT {percentile} {sim.tpot_s * 1e3:.1f} ms "
              f"(model {sim.model_tpot_s * 1e3:.1f}): {verdict}")


def print_serving(con: Console, spec: ModelSpec, cluster: Cluster, wl: Any, targets: Any, doc: Any, result: Any,
                   alternatives: list[str]) -> None:
    src = f" ({wl.source})" if wl.source else ""
    aims = ", ".join(f"{k} {v:g} ms" for k, v in (("TTFT", targets.ttft_ms), ("TPOT", targets.tpot_ms),
                                                    ("end-to-end", targets.e2e_ms)) if v is not None) or "none"
    aims += f" (latencies: {targets.percentile} over requests, queueing included)"
    con.print(f"{spec.name} on up to {cluster.num_gpus} x {cluster.gpu.name}; ISL {wl.isl}, OSL {wl.osl}{src}; "
              f"weights {wl.weight_dtype}, KV {wl.kv_dtype}; targets: {aims}")
    if result is not None:
        rows = [(str(i), d.label(), str(d.gpus), f"{d.tokens_per_s_per_gpu:,.0f}", f"{d.tokens_per_s_per_user:.1f}",
                 f"{d.ttft_s * 1e3:.0f}", f"{d.tpot_s * 1e3:.1f}", f"{d.requests_per_s:.2f}")
                for i, d in enumerate(result.ranked, 1)]
        print_table(con, "deployments that meet the targets",
                    ("#", "deployment", "GPUs", "tok/s/GPU", "tok/s/user", "TTFT ms", "TPOT ms", "req/s"), rows,
                    left=("deployment",))
    if doc.search is not None:
        rows = [(d.deployment, str(d.gpus), f"{d.tokens_per_s_per_gpu:,.0f}", f"{d.tokens_per_s_per_user:.1f}",
                 f"{d.ttft_ms:.0f}", f"{d.tpot_ms:.1f}", "yes" if d.meets_targets else "no")
                for d in doc.search.pareto]
        print_table(con, "Pareto front: tokens/s/GPU vs tokens/s/user (every deployment evaluated)",
                    ("deployment", "GPUs", "tok/s/GPU", "tok/s/user", "TTFT ms", "TPOT ms", "meets"), rows,
                    left=("deployment",))
        seconds = result.seconds if result is not None else doc.search.seconds  # a plan shown: only with --timing
        con.print(f"search: {doc.search.evaluated:,} engine configurations"
                  + ("" if seconds is None else f" in {seconds:.2f} s"))
        if doc.search.layouts_skipped:
            con.print(f"time-limit: {doc.search.layouts_skipped:,} engine layouts (the largest) not evaluated; "
                      f"raise --time-limit to search them")
    p = doc.prediction
    ranges = p.intervals
    con.print(f"best: {doc.mode}, {p.gpus} GPUs: {p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"
              f"{_range(ranges.tokens_per_s_per_gpu if ranges else None, ',.0f')}, "
              f"{p.tokens_per_s_per_user:.1f} tokens/s/user, TTFT {p.ttft_ms:.0f} ms"
              f"{_range(ranges.ttft_ms if ranges else None, ',.0f')}, TPOT {p.tpot_ms:.1f} ms"
              f"{_range(ranges.tpot_ms if ranges else None, '.1f')}, "
              f"{p.requests_per_s:.2f} requests/s" + ("" if p.meets_targets else f" (misses {p.misses})"))
    if ranges is not None:
        con.print(f"uncertainty: {serving_interval_line(ranges)}")
    if doc.economics is not None:
        print_serving_cost(con, doc.economics)
    for e in doc.engines:
        load = f"busy {e.load:.0%}" if e.role == "prefill" else f"{e.load * e.max_num_seqs:,.0f} running on average"
        con.print(f"  {e.engines} x {e.role} engine TP{e.tp} DP{e.dp} PP{e.pp} EP{e.ep} ({e.gpus_per_engine} GPUs): "
                  f"max {e.max_num_seqs} seqs, {e.max_num_batched_tokens} tokens/iteration, {load}, weights "
                  f"{e.weights_gib:.1f} GiB + KV {e.kv_cache_gib:.1f} GiB per GPU ({e.kv_tokens:,} tokens)")
    for line in alternatives:
        con.print(f"  vs {line}")
