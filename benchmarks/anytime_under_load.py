"""`plan --time-limit` beside CPU-bound jobs (issue 43): the time to a plan and the gap it reports, idle and with
--hogs busy processes beside it, as whole commands and as the search alone.

Usage:  python benchmarks/anytime_under_load.py [--hogs 2] [--limit 0.5] [--repeat 3]

The case is DeepSeek-V3 on 2,048 H800 (global batch 15,360 x 4,096), the largest of benchmarks/search_speed.py. A hog
is `python -c "while True: pass"`. The limit counts the search's CPU seconds (costmodels/deadline.py), so the
search does the same work whatever runs beside it and only its wall time stretches; the gap it reports is the same.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASE = ["--model", "deepseek-v3", "--gpu", "h800", "--gpus", "2048", "--gbs", "15360", "--seq", "4096"]


def one_run(limit: float) -> tuple[float, float, float, str]:
    """(whole command's wall seconds, the search's wall seconds as the table says, the reported gap %, status)."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "meshplan.cli.main", "plan", *CASE, "--time-limit", str(limit)],
                          cwd=ROOT, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    text = " ".join(done.stdout.split())
    search = float(re.search(r"with CP-SAT\); ([0-9.]+) s", text).group(1))
    found = re.search(r"(optimal|time-limit|gap): the best plan is within ([0-9.]+) %", text)
    if found is None:
        return wall, search, 0.0, "optimal"
    return wall, search, float(found.group(2)), found.group(1)


def measure(limit: float, repeat: int) -> list[tuple[float, float, float, str]]:
    return [one_run(limit) for _ in range(repeat)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--limit", type=float, default=0.5)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    rows = []
    for hogs in (0, args.hogs):
        procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
        try:
            time.sleep(0.5 if hogs else 0)
            runs = measure(args.limit, args.repeat)
        finally:
            for p in procs:
                p.kill()
                p.wait()
        walls, searches, gaps = ([r[i] for r in runs] for i in range(3))
        rows.append((hogs, statistics.median(walls), max(walls), statistics.median(searches), max(searches),
                     sorted(set(gaps)), sorted({r[3] for r in runs})))
    print(f"DeepSeek-V3, 2,048 H800, plan --time-limit {args.limit}, {args.repeat} runs each")
    print("| hogs beside it | command wall s (median / max) | search wall s (median / max) | gap % reported | status |")
    print("| ---: | ---: | ---: | --- | --- |")
    for hogs, wall, wall_max, search, search_max, gaps, status in rows:
        print(f"| {hogs} | {wall:.2f} / {wall_max:.2f} | {search:.2f} / {search_max:.2f} | "
              f"{', '.join(f'{g:.2f}' for g in gaps)} | {', '.join(status)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
