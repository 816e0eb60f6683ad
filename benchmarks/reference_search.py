"""The search against published configurations: for every run in benchmarks/training_dev.yaml,
the best plan `meshplan plan` finds for the run's model, GPUs and global batch, versus the published
configuration estimated under the same cost model (and found again by a search with every knob pinned); then the
same free search for every run of the second set (benchmarks/published_runs.yaml), against the run's measured
step time.

Usage:  python benchmarks/reference_search.py [--markdown] [--time-limit S] [--only ID] [--only-second]
                                              [--rank expected|conservative|both] [--uncalibrated]

Expectations (issues 3 and 16): the search's best is predicted at least as fast as the published configuration,
the pinned search returns the published configuration itself (its layout, with the partitioner's stage split),
the published configuration fits wherever it ran, and for runs from tuned recipes the search's best is predicted
at most 1.10x faster than what the team measured (a larger factor is a cost-model gap, not a discovery).

`--rank` (issue 44 item 4) runs the second set's searches under a ranking: by predicted step time (expected), by the
slow end of each plan's 80 % interval (conservative), or both, and prints for each how the winner's predicted step
compares with what the team measured. The intervals a run's search ranks by come from the other publications' runs
only (its own page or paper left out, as in benchmarks/crossval.py), so no run is ranked with its own error.

The second set is predicted, searched, ranked and covered as `plan` does without --calibration, held out: each run
under its GPU's calibration from the other publications' runs (crossval.py setting (d); the public calibration
`plan` uses is the same fit to all of them), or the defaults where its GPU has too few runs elsewhere.
`--uncalibrated` uses the GPUs' default efficiencies instead (--calibration none). The first set compares the
search with the published configuration under one model, the defaults.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from crossval import publication_of_url
from published_runs import DEFAULT_FILE, load_runs
from reference_runs import (DEFAULT_YAML, configure, evaluate_run, megatron_gpt, run_cluster, run_config, run_model,
                            run_runtime, run_workload)

from meshplan.costmodels.config import ParallelConfig
from meshplan.costmodels.efficiency import Efficiency, scaled
from meshplan.costmodels.estimate import estimate
from meshplan.costmodels.uncertainty import (RANK_KINDS, Ranking, ResidualTable, measured_runs, region_interval,
                                             region_of)
from meshplan.hardware_db.cluster import Cluster
from meshplan.hardware_db.gpu import load_gpu
from meshplan.planner.search import search


def describe(lay) -> str:
    stages = "" if lay.pp == 1 or len(set(lay.stage_layers)) == 1 else f" [{'-'.join(map(str, lay.stage_layers))}]"
    experts = f" ep{lay.ep} etp{lay.etp}" if lay.ep > 1 or lay.etp != lay.tp else ""
    return (f"tp{lay.tp} cp{lay.cp} pp{lay.pp}{'' if lay.vpp == 1 else f'x{lay.vpp}'} dp{lay.dp}{experts} mbs{lay.mbs} "
            f"z{lay.zero} {lay.recompute} {lay.schedule}{' sp' if lay.sp else ''}{stages}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--yaml", type=Path, default=DEFAULT_YAML)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--time-limit", type=float, default=60.0, help="per search, seconds")
    ap.add_argument("--only", default=None)
    ap.add_argument("--runs", type=Path, default=DEFAULT_FILE, help="the second set")
    ap.add_argument("--only-second", action="store_true")
    ap.add_argument("--uncalibrated", action="store_true",
                    help="the second set under the GPUs' default efficiencies (--calibration none) instead of the "
                         "default: each GPU's calibration from the other publications' runs (crossval.py setting (d))")
    ap.add_argument("--rank", choices=(*RANK_KINDS, "both"), default="expected",
                    help="the second set's ranking (both: each, and a comparison)")
    args = ap.parse_args()
    entries = [] if args.only_second else yaml.safe_load(args.yaml.read_text())
    rows = []
    for e in entries:
        if args.only and e["id"] != args.only:
            continue
        model = megatron_gpt(e)
        cluster, wl, cfg, runtime = configure(e)
        published = estimate(model, cluster, wl, cfg, runtime=runtime)
        lay = published.layout
        pins = ParallelConfig(tp=lay.tp, pp=lay.pp, vpp=lay.vpp, dp=lay.dp, cp=lay.cp, mbs=lay.mbs, zero=lay.zero,
                              recompute=lay.recompute, sp=lay.sp, schedule=lay.schedule)
        t0 = time.perf_counter()
        pinned = search(model, cluster, wl, pins, runtime, top_k=1, time_limit_s=args.time_limit,
                        max_mbs=max(16, lay.mbs))
        t1 = time.perf_counter()
        free = search(model, cluster, wl, ParallelConfig(), runtime, top_k=1, time_limit_s=args.time_limit,
                      max_mbs=max(16, lay.mbs))
        t2 = time.perf_counter()
        found = pinned.plans[0].estimate if pinned.plans else None
        best = free.plans[0].estimate if free.plans else None
        rows.append((e["id"], published, found, best, free.account, t1 - t0, t2 - t1))
        if not args.markdown:
            print(f"{e['id']}: published {describe(lay)} {published.step_time_s:.3f} s "
                  f"(fits: {published.fits}) | pinned search {found.step_time_s if found else float('nan'):.3f} s | "
                  f"best {describe(best.layout) if best else 'none'} {best.step_time_s if best else float('nan'):.3f} s"
                  f" [{free.account.status}, gap {100 * free.account.gap:.2f}%, {t2 - t1:.1f} s]", flush=True)
    if args.markdown:
        print("| run | published config | published s | fits | pinned search s | best plan found | best s | "
              "speed-up | search status | search s |")
        print("| --- | --- | ---: | --- | ---: | --- | ---: | ---: | --- | ---: |")
        for rid, pub, found, best, acc, _, tf in rows:
            print(f"| {rid} | {describe(pub.layout)} | {pub.step_time_s:.3f} | {'yes' if pub.fits else 'NO'} | "
                  f"{found.step_time_s if found else float('nan'):.3f} | {describe(best.layout) if best else 'none'} | "
                  f"{best.step_time_s if best else float('nan'):.3f} | "
                  f"{pub.step_time_s / best.step_time_s if best else float('nan'):.2f}x | {acc.status} "
                  f"({100 * acc.gap:.2f}%) | {tf:.1f} |")
    ok = all(best is not None and best.step_time_s <= pub.step_time_s * (1 + 1e-9)
             for _, pub, _, best, _, _, _ in rows if pub.fits)
    if rows:
        print(f"\nbest plan at least as fast as every published configuration that fits: {ok}")
    second_set(args)
    return 0


def held_out_ranking(kind: str, run_id: str, table: ResidualTable = "defaults") -> Ranking:
    """The ranking of one run's search, its intervals from the other publications' runs only (in the residual table
    of the model that predicts it: setting (d)'s, or the defaults' where the run has no setting (d) calibration or
    under --uncalibrated)."""
    shipped = measured_runs(table)
    own = {r.publication for r in measured_runs() if r.id == run_id}
    return Ranking(kind, residuals=tuple((r.region, r.residual) for r in shipped if r.publication not in own))


def second_set(args) -> None:
    """Free search per run of the second set; the best plan's predicted step against the measured one."""
    kinds = RANK_KINDS if args.rank == "both" else (args.rank,)
    summary = {kind: second_set_ranked(args, kind) for kind in kinds}
    if len(summary) > 1 and all(ratios for ratios, _ in summary.values()):
        print("\n| ranking | tuned runs | best > 1.10x measured | median best vs measured | median |log| | "
              "measured inside the winner's 80 % range |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for kind, (ratios, inside) in summary.items():
            logs = sorted(abs(math.log(r)) for r in ratios)
            print(f"| {kind} | {len(ratios)} | {sum(r > 1.10 for r in ratios)} | "
                  f"{statistics.median(ratios):.3f}x | {statistics.median(logs):.3f} | {inside}/{len(ratios)} |")


def second_set_ranked(args, kind: str) -> tuple[list[float], int]:
    """second_set under one ranking: (measured / best predicted step of each tuned run, how many of those
    measured steps fall inside the winner's interval). Each run is predicted and searched under its GPU's
    calibration from the other publications' runs (crossval.py setting (d)), where it has one, and ranked
    and covered by setting (d)'s residuals of the other publications (residuals.json public_runs); with
    --uncalibrated, under the defaults and their residuals."""
    fits = None
    if not args.uncalibrated:
        from crossval import first_set, held_out, other_publication_fits
        from crossval import second_set as crossval_second_set

        fits = other_publication_fits(held_out(first_set() + crossval_second_set(), 0.8))
    rows = []
    inside = 0
    for run in load_runs(args.runs):
        if args.only and run.id != args.only:
            continue
        model, cluster, wl = run_model(run), run_cluster(run), run_workload(run)
        runtime = run_runtime(run)
        eff = None
        if fits is not None:  # setting (d): the GPU's factors fit to the other publications' runs, where it has them
            factors = fits.get((publication_of_url(run.source.url), run.gpu))
            if factors is not None:
                gpu, eff = scaled(load_gpu(run.gpu), Efficiency.from_gpu(load_gpu(run.gpu)), factors)
                cluster = Cluster(cluster.spec, gpu=gpu)
        published = estimate(model, cluster, wl, run_config(run, model), runtime=runtime, efficiency=eff)
        measured_s = evaluate_run(run).measured_step_s
        t0 = time.perf_counter()
        ranking = held_out_ranking(kind, run.id, "defaults" if eff is None else "public")
        free = search(model, cluster, wl, ParallelConfig(), runtime, eff, top_k=1, time_limit_s=args.time_limit,
                      max_mbs=max(16, published.layout.mbs), ranking=ranking)
        elapsed = time.perf_counter() - t0
        best = free.plans[0].estimate if free.plans else None
        rows.append((run, published, best, measured_s, free.account, elapsed))
        if best is not None and run.tuned:
            low, high = _interval(ranking, held_region(best, model, wl, cluster, runtime)).step_time(best.step_time_s)
            inside += low <= measured_s <= high
        if not args.markdown:
            print(f"{run.id}: published {describe(published.layout)} predicted {published.step_time_s:.3f} s, "
                  f"measured {measured_s:.3f} s (fits: {published.fits}) | best "
                  f"{describe(best.layout) if best else 'none'} {best.step_time_s if best else float('nan'):.3f} s "
                  f"= {measured_s / best.step_time_s if best else float('nan'):.2f}x measured "
                  f"[{free.account.status}, {elapsed:.1f} s]", flush=True)
    if not rows:
        return [], 0
    print(f"\nranking: {kind} (intervals from the other publications' runs)")
    if args.markdown:
        print("| run | tuned | published config | fits | predicted s | measured s | best plan found | best s | "
              "best vs measured | search s |")
        print("| --- | --- | --- | --- | ---: | ---: | --- | ---: | ---: | ---: |")
        for run, pub, best, measured_s, _, elapsed in rows:
            print(f"| {run.id} | {'yes' if run.tuned else 'no'} | {describe(pub.layout)} | "
                  f"{'yes' if pub.fits else 'NO'} | {pub.step_time_s:.3f} | {measured_s:.3f} | "
                  f"{describe(best.layout) if best else 'none'} | {best.step_time_s if best else float('nan'):.3f} | "
                  f"{measured_s / best.step_time_s if best else float('nan'):.2f}x | {elapsed:.1f} |")
    ratios = [measured_s / best.step_time_s for run, _, best, measured_s, _, _ in rows if run.tuned and best]
    over = sum(r > 1.10 for r in ratios)
    at_least = sum(1 for _, pub, best, _, _, _ in rows if best and best.step_time_s <= pub.step_time_s * (1 + 1e-9))
    print(f"\nsecond set, {len(rows)} runs: published configuration predicted to fit in "
          f"{sum(pub.fits for _, pub, _, _, _, _ in rows)}; search's best at least as fast as the published "
          f"configuration in {at_least}; "
          f"tuned runs: {len(ratios)}, best predicted > 1.10x the measured step in {over} "
          f"(median {sorted(ratios)[len(ratios) // 2] if ratios else float('nan'):.2f}x, max "
          f"{max(ratios) if ratios else float('nan'):.2f}x); measured inside the winner's 80 % range in {inside}")
    return ratios, inside


def held_region(best, model, wl, cluster, runtime: str):
    return region_of(model, best.layout, wl, cluster.spec.gpu, cluster.gpus_per_node, runtime)


def _interval(ranking: Ranking, region):
    assert ranking.residuals is not None
    return region_interval(region, ranking.residuals, ranking.level)


if __name__ == "__main__":
    raise SystemExit(main())
