"""How the per-GPU default efficiencies in hardware_db/gpus/*.toml were chosen: a coarse grid over two parameters
(best GEMM efficiency, GEMM size at half efficiency) per GPU type, scored by the mean absolute percentage error on
that GPU's runs in the reference set. Everything else (attention, bandwidth and latency fractions) stays at the
schema defaults. One set per GPU type, never per run. This is fitting on a development set: the held-out check is
a set this script never sees.

Usage:  python benchmarks/fit_efficiency.py [--yaml PATH]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from dataclasses import replace
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_runs import DEFAULT_YAML, configure, evaluate

from meshplan.costmodels.efficiency import Efficiency


def score(entries: list[dict], eff_for) -> float:
    """Mean absolute percentage error of the runs, each in its own metric, under eff_for(cluster)."""
    return statistics.mean(abs(evaluate(e, eff_for(configure(e)[0])).error) for e in entries)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--yaml", type=Path, default=DEFAULT_YAML)
    args = ap.parse_args()
    entries = yaml.safe_load(args.yaml.read_text())
    by_gpu: dict[str, list[dict]] = {}
    for e in entries:
        by_gpu.setdefault(configure(e)[0].gpu.name, []).append(e)
    for gpu, runs in sorted(by_gpu.items()):
        results = []
        for gmax, half in itertools.product([0.60, 0.65, 0.70, 0.75, 0.80, 0.85], [1e9, 2e9, 4e9, 8e9, 16e9, 32e9]):
            def eff_for(cluster, gmax=gmax, half=half):
                return replace(Efficiency.from_gpu(cluster.gpu), gemm_max=gmax, gemm_half_flops=half)
            results.append((score(runs, eff_for), gmax, half))
        results.sort()
        print(f"{gpu} ({len(runs)} runs): best five (MAPE, gemm_max, gemm_half_flops):")
        for s, gmax, half in results[:5]:
            print(f"  {100 * s:5.2f}%  {gmax:.2f}  {half:.0e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
