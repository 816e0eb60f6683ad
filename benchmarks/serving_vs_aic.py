"""meshplan beside NVIDIA AIConfigurator on AIConfigurator's own measured deployments (issue 45 item 6): for a
stratified sample of the rows, AIConfigurator's estimate of exactly the measured deployment, meshplan's figure for
it with parameters fit without its model, and the measurement; and, with --picks, AIConfigurator's price for the
deployments `meshplan serve` picks in issue 45's three cases.

Usage:  pip install 'meshplan[aic]' && python benchmarks/serving_vs_aic.py [--per-group 4] [--markdown] [--picks]

How:
- The sample: the rows meshplan priced held out (the `residuals` of the shipped engine calibrations, each with its
  row's id), grouped by engine, GPU and mode, the first --per-group of each group by the SHA-256 of the row's id (a
  fixed, content-blind order).
- meshplan's figure is the held-out one the calibration file keeps: the measurement divided by exp(residual), so
  this script prices nothing of meshplan's.
- AIConfigurator's estimate: aiconfigurator_core 0.12 ships the estimator but not the `aiconfigurator` package's
  fixed-configuration entry point (cli/api.py cli_estimate), so estimate() composes it from the core calls the same
  way: the engine's perf database for the row's system and backend at the wheel's current version (the rows'
  own versions have no kernel tables in it), the model config of the row's layout and quantisation,
  `run_agg` for an aggregated row (batch per attention-DP rank); for a disaggregated one `run_static` of each pool
  (static_ctx with a latency correction of 1.1, static_gen with 1.08) and the rate matching of upstream
  sdk/picking.py `_build_disagg_summary_dict` (prefill seq/s x workers x 0.9, decode x workers x 0.92, the smaller;
  TTFT x 1.8). Those five constants are upstream's, not in the wheel. A deployment AIConfigurator's memory check
  refuses, or that it cannot load, is counted with its reason.
- Both tools' throughput is the closed loop's (Little's law from TTFT and TPOT, aic_deployments.relative_errors),
  so the three errors are computed alike for both.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import logging
import math
import os
import statistics
import sys
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshplan.costmodels.aic_deployments import (CONFIG_OF, CSV_PATH, Deployment, Pool, aic_package,  # noqa: E402
                                                 read_deployments, relative_errors)
from meshplan.hardware_db.calibration import ServingResidual, shipped_engine_calibration  # noqa: E402

METRICS = ("ttft", "tpot", "throughput")
# upstream aiconfigurator (cli/api.py, sdk/picking.py): the disaggregated estimate's corrections, not in the wheel
PREFILL_CORRECTION, DECODE_CORRECTION = 1.1, 1.08
PREFILL_DEGRADE, DECODE_DEGRADE = 0.9, 0.92
TTFT_CORRECTION = 1.8


@dataclass(frozen=True)
class PoolInput:
    """One pool as AIConfigurator takes it: its layout, batch per attention-DP rank, quantisation, workers."""

    tp: int
    pp: int
    dp: int
    moe_tp: int
    moe_ep: int
    batch: int
    workers: int = 1


@dataclass(frozen=True)
class Estimate:
    ttft_ms: float
    tpot_ms: float
    tokens_per_s_per_gpu: float


def aic_model_name(model_path: str) -> str:
    """The name AIConfigurator ships the model's config under (a few rows name a checkpoint it stores otherwise)."""
    stem = CONFIG_OF.get(model_path)
    return stem.replace("--", "/", 1) if stem else model_path


def estimate(model_path: str, system: str, backend: str, isl: int, osl: int, pools: list[PoolInput],
             gemm_quant: str | None = None, moe_quant: str | None = None) -> Estimate | str:
    """AIConfigurator's estimate of one deployment (one pool: aggregated; prefill then decode: disaggregated), or
    why it has none."""
    from aiconfigurator_core.sdk.backends.factory import get_backend
    from aiconfigurator_core.sdk.config import RuntimeConfig
    from aiconfigurator_core.sdk.config_builders import build_model_config
    from aiconfigurator_core.sdk.models import (get_model, resolve_context_fmha_by_data, resolve_dsv4_moe_arch,
                                                resolve_nvfp4_for_system)
    from aiconfigurator_core.sdk.perf_database import get_database_view, get_latest_database_version

    name = aic_model_name(model_path)
    try:
        version = get_latest_database_version(system, backend)
        db = get_database_view(system, backend, version, database_mode="SILICON")
        if db is None:
            return f"no kernel tables for {system} {backend}"
        engine = get_backend(backend)

        def model(pool: PoolInput, context: bool):  # type: ignore[no-untyped-def]
            mc = build_model_config(pool.tp, pool.pp, pool.dp, pool.moe_tp, pool.moe_ep, gemm_quant_mode=gemm_quant,
                                    moe_quant_mode=moe_quant)
            resolve_context_fmha_by_data(mc, name, db, backend, is_context_role=context)
            resolve_dsv4_moe_arch(mc, name, system_name=system, backend_name=backend)
            resolve_nvfp4_for_system(mc, system, name)
            return get_model(name, mc, backend)

        if len(pools) == 1:
            (pool,) = pools
            summary = engine.run_agg(model(pool, True), db, RuntimeConfig(isl=isl, osl=osl, batch_size=pool.batch),
                                     ctx_tokens=isl)
            if summary.check_oom() or summary.check_kv_cache_oom():
                return "refused by its memory check"
            r = summary.get_result_dict()
            return Estimate(float(r["ttft"]), float(r["tpot"]), float(r["tokens/s/gpu"]))
        rows = []
        for pool, mode, correction, context in ((pools[0], "static_ctx", PREFILL_CORRECTION, True),
                                                (pools[1], "static_gen", DECODE_CORRECTION, False)):
            summary = engine.run_static(model(pool, context), db, RuntimeConfig(isl=isl, osl=osl,
                                                                                batch_size=pool.batch),
                                        mode, latency_correction_scale=correction)
            if summary.check_oom() or summary.check_kv_cache_oom():
                return "refused by its memory check"
            rows.append(summary.get_summary_df().iloc[0].to_dict())
        pre, dec = rows
        seq_s = min(pre["seq/s"] * pools[0].workers * PREFILL_DEGRADE, dec["seq/s"] * pools[1].workers * DECODE_DEGRADE)
        gpus = pre["num_total_gpus"] * pools[0].workers + dec["num_total_gpus"] * pools[1].workers
        return Estimate(float(pre["ttft"]) * TTFT_CORRECTION, float(dec["tpot"]), seq_s * osl / gpus)
    except Exception as exc:  # AIConfigurator's own errors: a missing model, kernel or shape
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}"


def _pool(p: Pool, workers: int | None, batch: int | None) -> PoolInput:
    lay = p.layout
    return PoolInput(tp=lay.tp, pp=lay.pp, dp=lay.dp, moe_tp=p.moe_tp, moe_ep=lay.ep, batch=batch or 1,
                     workers=workers or 1)


def row_pools(d: Deployment) -> list[PoolInput]:
    if d.prefill is None:
        return [_pool(d.pool, 1, d.pool.batch)]
    return [_pool(d.prefill, d.prefill.workers, d.prefill.batch), _pool(d.pool, d.pool.workers, d.pool.batch)]


def sample(residuals: list[ServingResidual], deployments: dict[str, Deployment], per_group: int) -> list[str]:
    """Row ids: the first `per_group` of each engine, GPU and mode by the SHA-256 of the id."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for r in residuals:
        d = deployments[r.id]
        if d.prefill is not None and (d.prefill.workers is None or d.pool.workers is None):
            continue  # AIConfigurator needs both pools' worker counts
        groups.setdefault((d.engine, d.gpu, d.mode), []).append(r.id)
    return [i for key in sorted(groups)
            for i in sorted(groups[key], key=lambda i: hashlib.sha256(i.encode()).hexdigest())[:per_group]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--per-group", type=int, default=4, help="rows per engine, GPU and mode (default 4)")
    ap.add_argument("--markdown", action="store_true", help="markdown tables (RESULTS.md)")
    ap.add_argument("--picks", action="store_true", help="also price issue 45's three picks with AIConfigurator")
    args = ap.parse_args()
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    logging.disable(logging.WARNING)  # AIConfigurator's model dumps and fallback notes
    warnings.filterwarnings("ignore")

    data = read_deployments()
    deployments = {d.id: d for d in data.deployments}
    raw = {row["id"]: row for row in csv.DictReader(io.StringIO(aic_package().joinpath(*CSV_PATH).read_text()))}
    residuals = {}
    for engine in ("vllm", "sglang", "trtllm"):
        cal = shipped_engine_calibration(engine)
        assert cal is not None
        residuals.update({r.id: r for r in cal.residuals})
    ids = sample(list(residuals.values()), deployments, args.per_group)
    errors: dict[tuple[str, str], list[dict[str, float]]] = {}
    failed: Counter[str] = Counter()
    for n, i in enumerate(ids, 1):
        d, r, row = deployments[i], residuals[i], raw[i]
        got = estimate(d.model_path, row["system"], d.engine, d.isl, d.osl, row_pools(d),
                       row["gemm_quant_mode"] or None, row["moe_quant_mode"] or None)
        print(f"[{n}/{len(ids)}] {i}: " + (got if isinstance(got, str) else
                                           f"AIC TTFT {got.ttft_ms:.0f} ms TPOT {got.tpot_ms:.1f} ms"),
              file=sys.stderr)
        if isinstance(got, str):
            failed[f"{d.engine}: {got.split(':')[0]}"] += 1
            continue
        ours = relative_errors(d, d.ttft_ms / 1e3 / math.exp(r.ttft), d.tpot_ms / 1e3 / math.exp(r.tpot))
        theirs = relative_errors(d, got.ttft_ms / 1e3, got.tpot_ms / 1e3)
        errors.setdefault((d.engine, "meshplan"), []).append(ours)
        errors.setdefault((d.engine, "AIConfigurator"), []).append(theirs)
    print(f"{data.source}: {len(ids)} rows sampled ({args.per_group} per engine, GPU and mode), "
          f"{len(ids) - sum(failed.values())} estimated by AIConfigurator")
    head = ("engine", "tool", "rows", "TTFT |err| (signed)", "TPOT |err| (signed)", "throughput |err| (signed)")
    lines = []
    for engine in ("vllm", "sglang", "trtllm", "all"):
        for tool in ("AIConfigurator", "meshplan"):
            rows = [e for (eng, t), v in errors.items() if t == tool and engine in (eng, "all") for e in v]
            if not rows:
                continue
            cells = []
            for m in METRICS:
                values = [e[m] for e in rows if m in e]
                cells.append(f"{statistics.median(abs(v) for v in values):.1%} ({statistics.median(values):+.0%})"
                             if values else "-")
            lines.append((engine, tool, str(len(rows)), *cells))
    if args.markdown:
        print("| " + " | ".join(head) + " |\n| --- | --- | ---: | ---: | ---: | ---: |")
        for line in lines:
            print("| " + " | ".join(line) + " |")
    else:
        for line in [head, *lines]:
            print("  ".join(f"{c:>24}" for c in line))
    for why, count in failed.most_common():
        print(f"not estimated by AIConfigurator: {count} x {why}")
    if args.picks:
        picks()


# Issue 45's three cases: model, meshplan zoo name, AIConfigurator's name, GPUs, TTFT and TPOT targets, weights
CASES = (("Qwen3-32B", "qwen3-32b", "Qwen/Qwen3-32B", 32, 300, 10, "bf16"),
         ("Llama-3.1-70B", "llama3.1-70b", "meta-llama/Meta-Llama-3.1-70B", 64, 600, 20, "bf16"),
         ("DeepSeek-V3", "deepseek-v3", "deepseek-ai/DeepSeek-V3", 64, 1000, 50, "fp8"))


def picks() -> None:
    """Each case's pick under vLLM's engine calibration (serve's default), priced by AIConfigurator on h200_sxm
    with vLLM's kernels: does it meet the targets there?"""
    from meshplan import api
    from meshplan.costmodels.serving import ServeTargets, ServeWorkload
    from meshplan.hardware_db.cluster import ClusterSpec

    print("\n| case | meshplan's pick | meshplan: TTFT / TPOT / tok/s/GPU | AIConfigurator: TTFT / TPOT / tok/s/GPU "
          "| AIConfigurator says |\n| --- | --- | --- | --- | --- |")
    for name, zoo, aic_name, gpus, ttft, tpot, dtype in CASES:
        found = api.search_deployments(zoo, ClusterSpec(gpu="h200", num_gpus=gpus),
                                       ServeWorkload(isl=4000, osl=500, weight_dtype=dtype),  # type: ignore[arg-type]
                                       ServeTargets(ttft_ms=ttft, tpot_ms=tpot))
        plan = found.plan
        # AIConfigurator's batch is per attention-DP rank and pipeline micro-batch (its concurrency is batch x dp x
        # pp): a prefill engine's prompts per iteration, else the sequences meshplan predicts running on average
        # (its TPOT is at that load)
        pools = [PoolInput(tp=e.tp, pp=e.pp, dp=e.dp, moe_tp=e.tp * e.dp // e.ep, moe_ep=e.ep,
                           batch=max(1, round((e.max_num_seqs if e.role == "prefill" else e.load * e.max_num_seqs)
                                              / (e.dp * e.pp))), workers=e.engines) for e in plan.engines]
        # the quantisation AIConfigurator reads from the checkpoint: DeepSeek-V3's own FP8 is block-scaled
        # (fp8_block; per-tensor fp8 prices its MLA block three times slower on vLLM's kernels)
        got = estimate(aic_name, "h200_sxm", "vllm", 4000, 500, pools)
        p = plan.prediction
        label = " + ".join(f"{e.engines}x {e.role} TP{e.tp} DP{e.dp} PP{e.pp} EP{e.ep} b{e.max_num_seqs}"
                           for e in plan.engines)
        ours = f"{p.ttft_ms:.0f} / {p.tpot_ms:.1f} / {p.tokens_per_s_per_gpu:.0f}"
        if isinstance(got, str):
            print(f"| {name} | {label} | {ours} | - | not estimated: {got} |")
            continue
        missed = []
        if got.ttft_ms > ttft:
            missed.append(f"TTFT {got.ttft_ms:.0f} > {ttft}")
        if got.tpot_ms > tpot:
            missed.append(f"TPOT {got.tpot_ms:.1f} > {tpot}")
        print(f"| {name} | {label} | {ours} | {got.ttft_ms:.0f} / {got.tpot_ms:.1f} / {got.tokens_per_s_per_gpu:.0f} "
              f"| {'misses ' + ', '.join(missed) if missed else 'meets both'} |")


if __name__ == "__main__":
    main()
