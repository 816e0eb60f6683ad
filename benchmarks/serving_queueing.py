"""The analytic engine at a load (costmodels/serving_load.py) against the iteration-level simulation of the same
engine (costmodels/serving_sim.py): mean and p90 TTFT and TPOT at 30, 60 and 85 % of the engine's capacity.

Usage:  python benchmarks/serving_queueing.py [--markdown]

Llama-3.1-8B on one H100, a 8,192-token budget, Poisson arrivals; lengths fixed (cv^2 0) or gamma-spread (cv^2 0.5);
2,000 requests per simulation, the first 20 % dropped. Deterministic (seeded).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshplan.costmodels.model_io import load_zoo  # noqa: E402
from meshplan.costmodels.serving import EngineLayout, ServeWorkload, aggregated_state  # noqa: E402
from meshplan.costmodels.serving_load import _pace, rate_point  # noqa: E402
from meshplan.costmodels.serving_sim import simulate_engine  # noqa: E402
from meshplan.hardware_db.cluster import Cluster, ClusterSpec, engine_cluster  # noqa: E402

SHAPES = ((2000, 200), (500, 500), (1000, 25))
SPREADS = (0.0, 0.5)
LOADS = (0.3, 0.6, 0.85)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--markdown", action="store_true")
    ap.parse_args()
    model = load_zoo("llama3.1-8b")
    c = engine_cluster(Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=1)), 1)
    print("| ISL / OSL | cv^2 | load | TTFT mean ms: model / sim | TPOT mean ms | TTFT p90 ms | TPOT p90 ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for isl, osl in SHAPES:
        for cv2 in SPREADS:
            wl = ServeWorkload(isl=isl, osl=osl, isl_cv2=cv2, osl_cv2=cv2)
            curve = [s for s in (aggregated_state(model, c, EngineLayout(tp=1), wl, b, 8192)
                                 for b in (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)) if s is not None]
            capacity = max((_pace(curve[:i + 1], s.batch, wl) or (0.0,))[0] for i, s in enumerate(curve))
            for load in LOADS:
                rate = load * capacity
                mean, p90 = rate_point(curve, rate, wl, None), rate_point(curve, rate, wl, 0.9)
                sim = simulate_engine(curve, wl, rate, requests=2000)
                assert mean is not None and p90 is not None
                cells = [(mean.ttft_s, sim.ttft(None)), (mean.tpot_s, sim.tpot(None)), (p90.ttft_s, sim.ttft(0.9)),
                         (p90.tpot_s, sim.tpot(0.9))]
                print(f"| {isl} / {osl} | {cv2:g} | {load:.0%} | " + " | ".join(
                    f"{a * 1e3:.1f} / {b * 1e3:.1f} ({a / b - 1:+.0%})" for a, b in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
