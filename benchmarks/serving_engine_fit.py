"""Engine calibration checked by leaving one model out (issue 45, item 2): the serving engines' parameters
(costmodels/engine_calibration.py) fit per engine and GPU to AIConfigurator's measured deployments
(costmodels/aic_deployments.py), each model's rows predicted with parameters fit to the other models' rows only.

Usage:  pip install 'meshplan[aic]' && python benchmarks/serving_engine_fit.py [--jobs 2] [--markdown]
            [--slopes FILE] [--write DIR]
(about 55 minutes on 2 processes at stop 56; from a --slopes file already written, about 38)

How: every priceable row is priced at the prior's centre and with each parameter moved (costmodels/engine_fit.py,
about 7 x serving_aic.py's time, split over --jobs processes), and again at its engine's fit to those slopes (the
outer step: the slopes the fit uses are then those where it lands). For each model (an architecture: DeepSeek-R1
and V3 are one), every engine's parameters are fit to the other models' rows (engine_fit.leave_one_model_out: a fit
to all engines' rows, then each engine's centred on it; that engine's rows linearised again at the fold's fit and
fit once more), and the model's rows are priced in full with them. Printed:
the held-out median absolute and signed error of TTFT, TPOT and throughput (Little's law, as serving_aic.py),
beside the uncalibrated error on the same rows, by GPU, engine, model, mode and users; and each engine's parameters
fit to all its rows, with their posterior spreads (the kernel factors held at x1: engine_fit.ENGINE_HELD). Issue
45's targets: TPOT <= 12 %, TTFT <= 20 %, throughput <= 12 %.
"""

from __future__ import annotations

import argparse
from datetime import date
import pickle
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshplan.costmodels.aic_deployments import (Deployment, Priced, price, read_deployments,  # noqa: E402
                                                 relative_errors)
from meshplan.costmodels.engine_calibration import ADDITIVE, FACTORS, EngineParameters  # noqa: E402
from meshplan.costmodels.engine_fit import (architecture, engine_calibration, fit_engines,  # noqa: E402
                                            leave_one_model_out, relinearized, sensitivities)
from meshplan.planner.plan import write_text_atomic  # noqa: E402
from meshplan.hardware_db.errors import InputError  # noqa: E402

TARGETS = {"ttft": 0.20, "tpot": 0.12, "throughput": 0.12}
METRICS = ("ttft", "tpot", "throughput")


def _held_out(job: tuple[Deployment, EngineParameters]) -> tuple[str, Priced | None]:
    d, p = job
    try:
        return d.id, price(d, engine=p)
    except InputError:
        return d.id, None


def _parameters(p: EngineParameters) -> str:
    logs = dict(p.log_factors)
    return " ".join([f"{n} x{2.718281828 ** logs.get(n, 0.0):.2f}" for n in FACTORS]
                    + [f"iteration {p.iteration_s * 1e3:.2f} ms", f"request {p.request_s * 1e3:.0f} ms"])


def _users_band(users: int) -> str:
    """The closed loop's users in bands of powers of two (the load the TTFT error follows)."""
    low = 1 << (min(users, 256).bit_length() - 1)
    return f"{low:>3d}+" if low == 256 else f"{low:>3d}-{2 * low - 1}"


def table(by: dict[str, list[tuple[dict[str, float], dict[str, float]]]], markdown: bool) -> list[str]:
    head = ("group", "rows", "TTFT held out / uncal.", "TPOT held out / uncal.", "throughput held out / uncal.")
    lines = []
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "| --- | ---: | ---: | ---: | ---: |"]
    else:
        lines.append(f"{head[0]:40s} {head[1]:>5s}   {head[2]:>28s}   {head[3]:>28s}   {head[4]:>28s}")
    for g in sorted(by, key=lambda k: (k != "all", k)):
        pairs = by[g]
        cells = []
        for m in METRICS:
            after = [a[m] for a, b in pairs if m in a and m in b]
            before = [b[m] for a, b in pairs if m in a and m in b]
            if not after:
                cells.append("-")
                continue
            cells.append(f"{statistics.median(map(abs, after)):.1%} ({statistics.median(after):+.0%}) / "
                         f"{statistics.median(map(abs, before)):.1%}")
        if markdown:
            lines.append(f"| {g} | {len(pairs)} | " + " | ".join(cells) + " |")
        else:
            lines.append(f"{g:40s} {len(pairs):5d}   " + "   ".join(f"{c:>28s}" for c in cells))
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="processes pricing the rows (default 2)")
    ap.add_argument("--markdown", action="store_true", help="print the tables in markdown for RESULTS.md")
    ap.add_argument("--write", type=Path, metavar="DIR", help="also write each engine's calibration file there "
                    "(engine-ENGINE.json; hardware_db/calibrations/ holds the ones meshplan ships)")
    ap.add_argument("--slopes", type=Path, help="a file to keep the priced rows and slopes in (pickle): written "
                    "when absent, read when present (the same wheel's rows), so the fit reruns without pricing")
    args = ap.parse_args()
    start = time.perf_counter()
    try:
        data = read_deployments()
    except InputError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = None
    if args.slopes and args.slopes.exists():
        source, rows = pickle.loads(args.slopes.read_bytes())
        if source != data.source:
            print(f"error: {args.slopes} holds {source}'s rows, not {data.source}'s: delete it", file=sys.stderr)
            return 2
        read = {d.id for d in data.deployments}
        rows = [s for s in rows if s.deployment.id in read]  # a file written before the reader counted copies once
    if rows is None:
        rows = sensitivities(data.deployments, args.jobs)
    if all(s.centre == EngineParameters() for s in rows):  # not yet linearised where the fit lands
        first = fit_engines(rows)
        rows = relinearized(rows, args.jobs, first)
        print("linearised again at each engine's fit to all rows: " + "; ".join(
            f"{e} {_parameters(f.parameters)}" for e, f in first.items()))
        if args.slopes:
            args.slopes.write_bytes(pickle.dumps((data.source, rows)))
    print(f"{data.source}: {len(data.deployments)} rows read, {len(rows)} priced with slopes at their engine's fit "
          f"({time.perf_counter() - start:.0f} s)")
    fits = leave_one_model_out(rows, args.jobs)
    rows = [s for s in rows if (s.deployment.engine, architecture(s.deployment)) in fits]
    jobs = [(s.deployment, fits[(s.deployment.engine, architecture(s.deployment))]) for s in rows]
    with ProcessPoolExecutor(args.jobs) as pool:
        held = dict(pool.map(_held_out, jobs, chunksize=8))
    by: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {}
    local: list[float] = []
    lost = 0
    for s, (d, p) in zip(rows, jobs, strict=True):
        priced = held[d.id]
        if priced is None:
            lost += 1
            continue
        after = relative_errors(d, priced.ttft_ms / 1e3, priced.tpot_ms / 1e3)
        before = relative_errors(d, *s.uncalibrated_s())
        approx = s.predict(p)
        local.append(abs(approx[1] * 1e3 / priced.tpot_ms - 1))
        for g in ("all", f"gpu: {d.gpu}", f"engine: {d.engine}", f"model: {d.model_path}", f"mode: {d.mode}",
                  f"users: {_users_band(d.users)}"):
            by.setdefault(g, []).append((after, before))
    print(f"held out, each model predicted with parameters fit to the others' rows (error held out (median signed) "
          f"/ uncalibrated, median absolute); {lost} rows not priceable under their fold's parameters")
    print("\n".join(table(by, args.markdown)))
    if local:
        print(f"local model against the full pricing of the held-out rows, TPOT: median {statistics.median(local):.1%}")
    everything = by.get("all", [])
    verdicts = []
    for m, bound in TARGETS.items():
        xs = [abs(a[m]) for a, _ in everything if m in a]
        if xs:
            value = statistics.median(xs)
            verdicts.append(f"{m} {value:.1%} <= {bound:.0%}: {'met' if value <= bound else 'not met'}")
    print("targets (issue 45, leave one model out): " + "; ".join(verdicts))
    print("\nparameters fit to all of each engine's rows (posterior spread):")
    for engine, f in fit_engines(rows).items():
        logs = dict(f.parameters.log_factors)
        cells = [f"{n} x{2.718281828 ** logs[n]:.2f}±{sd:.2f}" for n, sd in zip(FACTORS, f.spread, strict=False)]
        cells += [f"{n} {v * 1e3:.2f}±{sd * 1e3:.2f} ms" for n, v, sd in
                  zip(ADDITIVE, (f.parameters.iteration_s, f.parameters.request_s), f.spread[len(FACTORS):],
                      strict=True)]
        print(f"  {engine:7s} {f.rows:4d} rows: " + ", ".join(cells))
    for engine in sorted({s.deployment.engine for s in rows}) if args.write else []:
        cal = engine_calibration(rows, engine, data.source, date.today().isoformat(), folds=fits)
        path = args.write / f"engine-{engine}.json"
        write_text_atomic(path, cal.model_dump_json(indent=1) + "\n")
        print(f"wrote {path}: held out " + ", ".join(f"{m} {v:.1%}" for m, v in cal.held_out.items()))
    print(f"({time.perf_counter() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
