"""Serving search speed and the DeepSeek-V3 deployment its authors describe (issue 7).

Usage:  python benchmarks/serving.py [--markdown] [--repeat N]

Target (benchmarks/RESULTS.md): every search <= 5 s wall on a 2-core machine. Cases: Llama-3.1-70B on 8-64 H100 and
DeepSeek-V3 on 16-320 H800 and H100, ISL 4,000 / OSL 500, TTFT 300 ms, TPOT 10, 20 and 50 ms. The wall time is the
median of --repeat runs of planner.serve.search_serving() in one process (imports and the model load excluded).
Then the DeepSeek-V3 report's deployment (sec. 3.4: prefill attention TP4 + DP8 with EP32 on 32 GPUs; decode
attention TP4 x DP80 with EP320 on 320 GPUs) evaluated as given, with the prefill engines that keep its decode
engine busy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshplan.costmodels.model_io import load_model
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.costmodels.serving import ServeTargets, ServeWorkload
from meshplan.planner.serve import parse_engine_layout, pinned_deployment, search_serving

CASES = [  # (label, model, gpu, min gpus, max gpus, weight dtype)
    ("Llama-3.1-70B, 8-64 H100", "llama3.1-70b", "h100-sxm", 8, 64, "bf16"),
    ("DeepSeek-V3, 16-320 H800", "deepseek-v3", "h800", 16, 320, "fp8"),
    ("DeepSeek-V3, 16-320 H100", "deepseek-v3", "h100-sxm", 16, 320, "fp8"),
]
TPOTS = (10.0, 20.0, 50.0)
TTFT = 300.0
TARGET_S = 5.0


def run_case(model: str, gpu: str, low: int, high: int, dtype: str, tpot: float, repeat: int):
    spec = load_model(model)
    wl = ServeWorkload(isl=4000, osl=500, weight_dtype=dtype)
    targets = ServeTargets(ttft_ms=TTFT, tpot_ms=tpot)
    times, result = [], None
    for _ in range(repeat):
        cluster = Cluster(ClusterSpec(gpu=gpu, num_gpus=high))
        t0 = time.perf_counter()
        result = search_serving(spec, cluster, wl, targets, min_gpus=low)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def authors_deployment():
    spec = load_model("deepseek-v3")
    wl = ServeWorkload(isl=4000, osl=500, weight_dtype="fp8")
    cluster = Cluster(ClusterSpec(gpu="h800", num_gpus=4096))
    return pinned_deployment(spec, cluster, wl, ServeTargets(ttft_ms=TTFT, tpot_ms=50.0),
                             parse_engine_layout("tp4,dp80,ep320"), engines=1,
                             prefill_layout=parse_engine_layout("tp4,dp8,ep32"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for label, model, gpu, low, high, dtype in CASES:
        for tpot in TPOTS:
            wall, res = run_case(model, gpu, low, high, dtype, tpot, args.repeat)
            best = res.best
            what = (f"{best.label()}: {best.tokens_per_s_per_gpu:,.0f} tok/s/GPU, TTFT {best.ttft_s * 1e3:.0f} ms, "
                    f"TPOT {best.tpot_s * 1e3:.1f} ms, {best.gpus} GPUs" if best else
                    f"none meets; nearest {res.nearest_miss.label()}" if res.nearest_miss else "nothing fits")
            rows.append((label, tpot, wall, res.evaluated, len(res.pareto), what))
    d = authors_deployment()
    ok = all(r[2] <= TARGET_S for r in rows)
    if args.markdown:
        print("| case | TPOT target | search s | engine configurations | Pareto points | best under TTFT 300 ms |")
        print("| --- | --- | --- | --- | --- | --- |")
        for label, tpot, wall, n, front, what in rows:
            print(f"| {label} | {tpot:g} ms | {wall:.2f} | {n:,} | {front} | {what} |")
        print()
        print(f"DeepSeek-V3 authors' deployment on H800 (ISL 4,000, OSL 500, fp8 weights): {d.label()}, "
              f"{d.gpus} GPUs: TTFT {d.ttft_s * 1e3:.0f} ms, TPOT {d.tpot_s * 1e3:.1f} ms, "
              f"{d.tokens_per_s_per_gpu:,.0f} output tokens/s/GPU, {d.requests_per_s:.1f} requests/s")
    else:
        for label, tpot, wall, n, front, what in rows:
            print(f"{label:28s} TPOT {tpot:4g} ms  {wall:6.2f} s  {n:7,} configs  {front:3d} Pareto  {what}")
        print(f"authors' deployment: {d.label()}: {d.gpus} GPUs, TTFT {d.ttft_s * 1e3:.0f} ms, "
              f"TPOT {d.tpot_s * 1e3:.1f} ms, {d.tokens_per_s_per_gpu:,.0f} tok/s/GPU")
    print(f"\n{'all searches within' if ok else 'SOME SEARCH OVER'} {TARGET_S:g} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
