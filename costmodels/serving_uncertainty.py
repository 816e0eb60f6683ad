"""How sure a serving prediction is (issue 45 item 3). The residuals are the engine calibration's own: every
measured deployment of AIConfigurator's rows priced with parameters fit without its model (costmodels/engine_fit.py
engine_calibration), so they say how far a model the fit never saw lands from its measurement.

That error is mostly one offset per model, with the rows of a model spread about it: each engine's rows hold four
or five models (architectures), whose median residuals lie up to 0.7 apart in log (a factor of two), while the rows
of one model scatter less. Split conformal intervals over the rows (costmodels/uncertainty.py, the training
intervals' machinery) treat the rows as exchangeable, which rows of an unseen model are not: checked one model out,
they covered 35-77 % of its rows at 80 % (benchmarks/serving_intervals.py, benchmarks/RESULTS.md). No distribution-
free interval can do better at the level of models: a new model's offset falls between the smallest and largest of
K others' with probability (K - 1) / (K + 1), 60 % for K = 4. So an interval here has two parts:
- the new model's offset: a normal prediction interval from the K models' median residuals, mean +- t(K - 1) x sd x
  sqrt(1 + 1 / K) (the interval for one more draw from a normal sample, e.g. Hahn & Meeker, "Statistical
  Intervals", Wiley 1991);
- the row's place about its model's offset: the split-conformal bounds (uncertainty.region_interval) of every row's
  residual less its model's median, over rows of the same mode and load (the users per engine in bands, since
  TTFT's error changes sign with load: +24 to +33 % at 4-63 users, -23 % and -71 % at 128-255 and 256+), backing off
  to the rows of the same mode, then to all;
added in quadrature, as the quantiles of independent normal parts add (an approximation for the empirical row part).
The GPU and dense-or-MoE are not region features: with four or five models per engine, a GPU's or MoE's rows hold
one or two models, and the coverage fell further with them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from meshplan.costmodels.uncertainty import DEFAULT_LEVEL, Interval, region_interval
from meshplan.hardware_db.calibration import EngineCalibration, ServeMetric, ServingResidual

# Users per engine where the load bands part: AIConfigurator's concurrency sweeps step in powers of two, and the
# calibrated TTFT error is of one sign below 64 and of the other from 128 (see the module docstring).
LOAD_BANDS = (64, 256)

# The row part's features given up first when a region holds too few rows: the load, then the mode.
SERVING_BACKOFF = ("load", "mode")
SERVING_FEATURE_LABELS = {"mode": "aggregated or disaggregated", "load": "users per engine"}
METRICS: tuple[ServeMetric, ...] = ("ttft", "tpot", "throughput")


@dataclass(frozen=True)
class ServingRegion:
    """The features a row's spread about its model's offset is grouped by."""

    mode: str  # aggregated, disaggregated
    load: str  # the band of users per engine (load_band)


def load_band(sequences: float) -> str:
    """The band of a load of `sequences` users (running sequences) per engine."""
    low, high = LOAD_BANDS
    if sequences < low:
        return f"under {low}"
    return f"{low}-{high - 1}" if sequences < high else f"{high}+"


def region_of(r: ServingResidual) -> ServingRegion:
    return ServingRegion(r.mode, load_band(r.sequences))


@cache
def t_quantile(p: float, dof: int) -> float:
    """Student's t quantile by bisection on its CDF, integrated by Simpson's rule (hand-written: scipy is not a
    dependency); exact to about 1e-6, which tests check against tabulated values."""
    if not 0.5 <= p < 1 or dof < 1:
        raise ValueError(f"t quantile of p={p}, dof={dof}: p in [0.5, 1), dof >= 1")
    norm = math.gamma((dof + 1) / 2) / (math.sqrt(dof * math.pi) * math.gamma(dof / 2))

    def cdf(x: float, steps: int = 2000) -> float:
        h = x / steps
        f = [norm * (1 + (i * h) ** 2 / dof) ** (-(dof + 1) / 2) for i in range(steps + 1)]
        return 0.5 + h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))

    lo, hi = 0.0, 1.0
    while cdf(hi) < p:
        lo, hi = hi, 2 * hi
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class MetricInterval:
    """One metric's interval (Interval's conventions: residual bounds) and what it rests on."""

    interval: Interval
    models: int  # models whose offsets the new model's is drawn beside


@dataclass(frozen=True)
class ServingInterval:
    """Each metric's interval (TTFT and TPOT as step times, tokens/s/GPU as a throughput)."""

    ttft: MetricInterval
    tpot: MetricInterval
    throughput: MetricInterval


def metric_interval(rows: Sequence[tuple[str, ServingRegion, float]], region: ServingRegion,
                    level: float = DEFAULT_LEVEL) -> MetricInterval | None:
    """The interval of a new model's row of `region` from (architecture, region, residual) rows of other models
    (the module docstring); None with fewer than two models."""
    by_model: dict[str, list[float]] = {}
    for arch, _, value in rows:
        by_model.setdefault(arch, []).append(value)
    offsets = {arch: statistics.median(values) for arch, values in by_model.items()}
    k = len(offsets)
    if k < 2:
        return None
    mean, sd = statistics.fmean(offsets.values()), statistics.stdev(offsets.values())
    half = t_quantile((1 + level) / 2, k - 1) * sd * math.sqrt(1 + 1 / k)
    spread = region_interval(region, [(g, value - offsets[arch]) for arch, g, value in rows], level,
                             SERVING_BACKOFF)
    lo = mean - math.hypot(half, max(0.0, -spread.lo))
    hi = mean + math.hypot(half, max(0.0, spread.hi))
    return MetricInterval(Interval(lo, hi, level, spread.runs, spread.dropped), k)


def serving_interval(cal: EngineCalibration, region: ServingRegion,
                     level: float = DEFAULT_LEVEL, leave_out: str | None = None) -> ServingInterval | None:
    """The interval of a deployment of `region` priced under `cal` for a model it never saw, from its held-out
    residuals (those of architecture `leave_out` set aside: benchmarks/serving_intervals.py); None where the
    calibration holds too few models' residuals."""
    found = {}
    for metric in METRICS:
        rows = [(r.architecture, region_of(r), value) for r in cal.residuals
                if r.architecture != leave_out and (value := getattr(r, metric)) is not None]
        found[metric] = metric_interval(rows, region, level)
    if any(v is None for v in found.values()):
        return None
    return ServingInterval(*found.values())  # type: ignore[arg-type]


def residuals_of(predicted_ttft_s: float, predicted_tpot_s: float, predicted_throughput: float | None,
                 measured_ttft_s: float, measured_tpot_s: float,
                 measured_throughput: float | None) -> tuple[float, float, float | None]:
    """(TTFT, TPOT, throughput) residuals of one row: log(measured / predicted) of a time, log(predicted /
    measured) of a throughput; positive where the prediction is optimistic."""
    throughput = (math.log(predicted_throughput / measured_throughput)
                  if predicted_throughput is not None and measured_throughput is not None else None)
    return (math.log(measured_ttft_s / predicted_ttft_s), math.log(measured_tpot_s / predicted_tpot_s), throughput)
