"""Serving intervals checked one model out (issue 45 item 3): do the ranges `serve` prints hold for a model whose
rows never made them?

Usage:  python benchmarks/serving_intervals.py [--level 0.8] [--markdown]

How: each shipped engine calibration keeps the held-out residual of every row it was checked on
(hardware_db/calibrations/engine-*.json, `residuals`: the row priced with parameters fit without its model). Each
row gets the interval serve would give its region (costmodels/serving_uncertainty.py) from the other models'
residuals only (its own architecture's set aside), and counts as covered when its own residual falls inside. Printed
per engine and metric: the rows, the share covered (the interval's level is the aim), the share above (measured
worse than the slow end: optimistic beyond the range) and below, and the median width of the range as a factor
(exp(hi - lo)). Reads the shipped files only: no pricing, seconds.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshplan.costmodels.serving_uncertainty import METRICS, region_of, serving_interval  # noqa: E402
from meshplan.hardware_db.calibration import shipped_engine_calibration  # noqa: E402


def coverage(engine: str, level: float) -> dict[str, tuple[int, float, float, float, float]]:
    """metric -> (rows, covered, above, below, median width factor) over the engine's rows, each model's rows
    with intervals from the other models' residuals."""
    cal = shipped_engine_calibration(engine)
    if cal is None:
        raise SystemExit(f"no shipped calibration of {engine}")
    seen: dict[str, list[tuple[int, float]]] = {m: [] for m in METRICS}  # (-1 below, 0 in, 1 above; width)
    for r in cal.residuals:
        found = serving_interval(cal, region_of(r), level, leave_out=r.architecture)
        if found is None:
            raise SystemExit(f"{engine}: too few models besides {r.architecture} for an interval")
        for metric in METRICS:
            value = getattr(r, metric)
            if value is None:
                continue
            interval = getattr(found, metric).interval
            side = 1 if value > interval.hi else -1 if value < interval.lo else 0
            seen[metric].append((side, math.exp(interval.hi - interval.lo)))
    out = {}
    for metric, sides in seen.items():
        n = len(sides)
        out[metric] = (n, sum(s == 0 for s, _ in sides) / n, sum(s == 1 for s, _ in sides) / n,
                       sum(s == -1 for s, _ in sides) / n, statistics.median(w for _, w in sides))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--level", type=float, default=0.8, help="the intervals' level (serve's: 0.8)")
    ap.add_argument("--markdown", action="store_true", help="a markdown table (RESULTS.md)")
    args = ap.parse_args()
    head = ("engine", "metric", "rows", "covered", "above the range", "below the range", "median width")
    rows = []
    for engine in ("vllm", "sglang", "trtllm"):
        for metric, (n, inside, above, below, width) in coverage(engine, args.level).items():
            rows.append((engine, metric, str(n), f"{inside:.1%}", f"{above:.1%}", f"{below:.1%}", f"x{width:.2f}"))
    if args.markdown:
        print("| " + " | ".join(head) + " |")
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
        for row in rows:
            print("| " + " | ".join(row) + " |")
    else:
        print("  ".join(f"{h:>15}" for h in head))
        for row in rows:
            print("  ".join(f"{c:>15}" for c in row))
    print(f"intervals at {args.level:.0%}; each model's rows covered by intervals from the other models' residuals")


if __name__ == "__main__":
    main()
