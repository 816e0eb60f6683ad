"""`meshplan serve`: the serving search (meshplan/api.py) and its tables."""

from pathlib import Path
from typing import Annotated, Any, Literal

import typer
from rich.console import Console
from rich.table import Table

from meshplan import api
from meshplan.cli.options import (GpuOpt, ModelOpt, NicOpt, NvlinkOpt, P_CLUSTER, P_MODEL, P_OUT, P_PAR, PerNodeOpt,
                                  cluster_of_flags, console, echo_export, output_targets)
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import load_model
from meshplan.costmodels.serving import ServeTargets
from meshplan.hardware_db.cluster import Cluster
from meshplan.hardware_db.errors import InputError
from meshplan.planner.outputs import OutputFile, write_all


def serve(
    model: ModelOpt,
    gpu: GpuOpt = None,
    gpus: Annotated[str | None, typer.Option("--gpus", rich_help_panel=P_CLUSTER, help=(
        "GPUs: N (at most N) or A-B (deployments using A to B)."))] = None,
    gpus_per_node: PerNodeOpt = None,
    nic_gbps: NicOpt = None,
    nvlink_gbs: NvlinkOpt = None,
    isl: Annotated[int | None, typer.Option("--isl", min=1, rich_help_panel=P_MODEL, help=(
        "Input (prompt) tokens per request."))] = None,
    osl: Annotated[int | None, typer.Option("--osl", min=1, rich_help_panel=P_MODEL, help=(
        "Output tokens per request."))] = None,
    lengths: Annotated[Path | None, typer.Option("--lengths", rich_help_panel=P_MODEL, help=(
        "CSV of request lengths (columns input_tokens,output_tokens, or isl,osl): their means are the workload."))
    ] = None,
    ttft_ms: Annotated[float | None, typer.Option("--ttft-ms", min=0.001, max=1e9, rich_help_panel=P_PAR, help=(
        "Time-to-first-token target, ms."))] = None,
    tpot_ms: Annotated[float | None, typer.Option("--tpot-ms", min=0.001, max=1e9, rich_help_panel=P_PAR, help=(
        "Time-per-output-token target, ms."))] = None,
    e2e_ms: Annotated[float | None, typer.Option("--e2e-ms", min=0.001, rich_help_panel=P_PAR, help=(
        "End-to-end latency target (TTFT + OSL x TPOT), ms."))] = None,
    objective: Annotated[Literal["throughput", "min-gpus"], typer.Option("--objective", rich_help_panel=P_PAR,
        help="throughput: most output tokens/s per GPU; min-gpus: fewest GPUs for --request-rate.")
    ] = "throughput",
    request_rate: Annotated[float | None, typer.Option("--request-rate", min=0.000001, rich_help_panel=P_PAR,
        help="Requests/s to serve (objective min-gpus).")] = None,
    weight_dtype: Annotated[Literal["bf16", "fp8"], typer.Option("--weight-dtype", rich_help_panel=P_MODEL,
        help="Weights and GEMMs in bf16 or fp8.")] = "bf16",
    kv_dtype: Annotated[Literal["bf16", "fp8"], typer.Option("--kv-dtype", rich_help_panel=P_MODEL,
        help="KV cache precision.")] = "bf16",
    mem_fraction: Annotated[float, typer.Option("--mem-fraction", min=0.05, max=1.0, rich_help_panel=P_PAR, help=(
        "Fraction of HBM an engine uses (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static)."))] = 0.9,
    disaggregation: Annotated[bool, typer.Option("--disaggregation/--no-disaggregation", rich_help_panel=P_PAR,
        help="Also search separate prefill and decode pools.")] = True,
    layout: Annotated[str | None, typer.Option("--layout", rich_help_panel=P_PAR, help=(
        "Evaluate this engine instead of searching, e.g. tp8 or tp4,dp80,ep320 (the decode pool with "
        "--prefill-layout)."))] = None,
    prefill_layout: Annotated[str | None, typer.Option("--prefill-layout", rich_help_panel=P_PAR, help=(
        "With --layout: a disaggregated deployment with this prefill engine, e.g. tp4,dp8,ep32."))] = None,
    engines: Annotated[int | None, typer.Option("--engines", min=1, rich_help_panel=P_PAR, help=(
        "With --layout: engines of it (default: fill the GPUs, or 1 decode engine)."))] = None,
    prefill_engines: Annotated[int | None, typer.Option("--prefill-engines", min=1, rich_help_panel=P_PAR, help=(
        "With --prefill-layout: prefill engines (default: as many as the decode pool needs)."))] = None,
    batch: Annotated[int | None, typer.Option("--batch", min=1, rich_help_panel=P_PAR, help=(
        "With --layout: running sequences per engine (default: the best that meets the targets)."))] = None,
    top: Annotated[int, typer.Option("--top", min=1, max=100, rich_help_panel=P_OUT,
                                     help="Deployments to rank (at most 100).")] = 5,
    time_limit: Annotated[float | None, typer.Option("--time-limit", min=0.001, rich_help_panel=P_OUT, help=(
        "Stop taking engine layouts (smallest engines first) after about this many seconds, once a deployment "
        "can be formed; the report says how many were left."))] = None,
    out: Annotated[Path | None, typer.Option("--out", rich_help_panel=P_OUT, help=(
        "Write the best deployment as a serving plan (Plan JSON, kind serving)."))] = None,
    as_json: Annotated[bool, typer.Option("--json", rich_help_panel=P_OUT, help=(
        "Print the serving plan as JSON and nothing else."))] = False,
    timing: Annotated[bool, typer.Option("--timing", rich_help_panel=P_OUT, help=(
        "Record the search's wall time in the plan JSON (search.seconds). Off by default, so the same input "
        "writes a byte-identical plan; the table shows the time either way."))] = False,
    export_to: Annotated[Literal["vllm", "sglang"] | None, typer.Option("--export", rich_help_panel=P_OUT, help=(
        "Also export the best deployment's command lines (printed, or written to --export-out)."))] = None,
    export_out: Annotated[Path | None, typer.Option("--export-out", rich_help_panel=P_OUT, help=(
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

    out, export_out = output_targets(out=out, export_out=export_out)
    if export_out is not None and export_to is None:
        raise InputError("--export-out needs --export vllm|sglang")
    if as_json and export_to is not None and export_out is None:
        raise InputError("--json prints only the plan; give --export-out for the --export files")
    if layout is None and (prefill_layout or engines or prefill_engines or batch):
        raise InputError("--prefill-layout, --engines, --prefill-engines and --batch go with --layout")
    spec = load_model(model)
    low, high = parse_gpu_range(gpus)
    cluster_spec = cluster_of_flags(None, gpu, high, gpus_per_node, nic_gbps, nvlink_gbs)
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
    con = console()
    print_serving(con, spec, cluster, wl, targets, doc, result, alternatives)
    if out is not None:
        con.print(f"serving plan written to {out}")
    if exported is not None:
        if export_out is not None:
            con.print(f"{export_to} export written to {', '.join(map(str, written))}")
        else:
            echo_export(exported)


def print_serving(con: Console, spec: ModelSpec, cluster: Cluster, wl: Any, targets: Any, doc: Any, result: Any,
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
