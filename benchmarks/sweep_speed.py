"""Sweep speed (issue 20): `meshplan sweep` over 3 GPU types x 4 counts, the planning and the report timed apart.

Usage:  python benchmarks/sweep_speed.py [--markdown]

Target (benchmarks/RESULTS.md): the 12 points of Llama-3.1-8B (8..64 GPUs) <= 30 s on a 2-core machine, report
included; Llama-3.1-70B (64, 256, 1,024, 4,096 GPUs) is timed beside it. One process, imports excluded.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshplan import api
from meshplan.costmodels.config import Workload
from meshplan.costmodels.economics import Budget
from meshplan.planner.outputs import write_all
from meshplan.planner.report import sweep_report

GPUS = ["h100-sxm", "h200", "b200"]
CASES = [  # (model, counts, global batch, seq, tokens)
    ("llama3.1-8b", [8, 16, 32, 64], 256, 4096, 1e12),
    ("llama3.1-70b", [64, 256, 1024, 4096], 1024, 8192, 15e12),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    rows = []
    for model, counts, gbs, seq, tokens in CASES:
        start = time.perf_counter()
        sw = api.sweep(model, GPUS, counts, Workload(global_batch=gbs, seq_len=seq), budget=Budget(tokens=tokens))
        planned = time.perf_counter() - start
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            write_all(sweep_report(sw, Path(tmp), model, []))
            drawn = time.perf_counter() - start
        best = sw.best
        chosen = "none" if best is None else f"{best.gpus} x {best.gpu}"
        rows.append((model, f"{len(GPUS)} x {len(counts)}", f"{planned:.1f}", f"{drawn:.1f}",
                     f"{planned + drawn:.1f}", chosen))
    header = ("model", "points", "plan s", "report s", "total s", "fastest")
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    else:
        for r in rows:
            print("  ".join(f"{h}={v}" for h, v in zip(header, r, strict=True)))


if __name__ == "__main__":
    main()
