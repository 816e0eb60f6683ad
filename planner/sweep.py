"""Plans across GPU types and counts, and which of them to rent: each point is the fastest plan on that cluster
(meshplan.api.sweep plans them), priced by its economics section; an objective picks one and the Pareto front of
time against money shows what each choice trades.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass
from typing import Literal

from meshplan.costmodels.economics import TrainingCost
from meshplan.hardware_db.cluster import MAX_GPUS
from meshplan.hardware_db.errors import InputError
from meshplan.planner.plan import Plan

__all__ = ["Objective", "OBJECTIVES", "SweepPoint", "Sweep", "gpu_counts", "halvings", "time_s", "usd", "score",
           "sweep_csv"]

# time: the shortest run (with --tokens, its expected time with failures; else the highest throughput); cost: the
# cheapest run (with --tokens, its expected total with failures; else $ per million tokens); tokens-per-dollar: the
# most tokens per dollar at steady state, failures left out (so it can prefer a larger job that cost counts less of)
Objective = Literal["time", "cost", "tokens-per-dollar"]
OBJECTIVES: tuple[Objective, ...] = ("time", "cost", "tokens-per-dollar")
MAX_POINTS = 64


@dataclass(frozen=True)
class SweepPoint:
    """One cluster of the sweep and its best plan (priced), or why nothing fits."""

    gpu: str
    gpus: int
    plan: Plan | None
    why: str | None = None

    @property
    def cost(self) -> TrainingCost:
        assert self.plan is not None and self.plan.economics is not None
        return self.plan.economics


@dataclass(frozen=True)
class Sweep:
    points: tuple[SweepPoint, ...]
    objective: Objective

    @property
    def feasible(self) -> list[SweepPoint]:
        return [p for p in self.points if p.plan is not None]

    @property
    def best(self) -> SweepPoint | None:
        return min(self.feasible, key=lambda p: (score(p.cost, self.objective), p.gpus, p.gpu), default=None)

    @property
    def pareto(self) -> list[SweepPoint]:
        """The points no other point beats on both time and money, fastest first."""
        ranked = sorted(self.feasible, key=lambda p: (time_s(p.cost), usd(p.cost), p.gpus))
        front: list[SweepPoint] = []
        for p in ranked:
            if not front or usd(p.cost) < usd(front[-1].cost):
                front.append(p)
        return front


def time_s(cost: TrainingCost) -> float:
    """The run's expected seconds with --tokens, else seconds per million tokens."""
    return cost.expected_s if cost.expected_s is not None else 1e6 / cost.tokens_per_s


def usd(cost: TrainingCost) -> float:
    """The run's expected dollars with --tokens, else dollars per million tokens."""
    return cost.total_usd if cost.total_usd is not None else cost.usd_per_million_tokens


def score(cost: TrainingCost, objective: Objective) -> float:
    """Lower is better."""
    if objective == "time":
        return time_s(cost)
    if objective == "cost":
        return usd(cost)
    return cost.usd_per_million_tokens


def gpu_counts(text: str) -> list[int]:
    """'64..4096' (doubling from 64 up to 4096), '64,128,512' or '256'."""
    try:
        if ".." in text:
            low_text, high_text = text.split("..", 1)
            low, high = int(low_text), int(high_text)
            if low < 1 or high < low:
                raise ValueError
            counts: list[int] = []
            while low <= high and len(counts) <= MAX_POINTS:
                counts.append(low)
                low *= 2
        else:
            counts = sorted({int(t) for t in text.split(",")})
            if counts[0] < 1:
                raise ValueError
    except ValueError:
        raise InputError(f"--gpus {text!r}: give A..B (doubling from A to B, e.g. 64..4096), a list (64,256,1024) "
                         "or one count, all positive") from None
    if len(counts) > MAX_POINTS:
        raise InputError(f"--gpus {text!r} makes more than {MAX_POINTS} counts; give fewer")
    if max(counts) > MAX_GPUS:  # checked before the first point is planned, not at the point it breaks
        raise InputError(f"--gpus {text!r} goes up to {max(counts):,} GPUs; a cluster has at most {MAX_GPUS:,}")
    return counts


def halvings(gpus: int, smallest: int) -> list[int]:
    """gpus, gpus/2, gpus/4, ... while whole and at least `smallest`: the counts `plan --objective cost` weighs."""
    counts = [gpus]
    while counts[-1] % 2 == 0 and counts[-1] // 2 >= smallest:
        counts.append(counts[-1] // 2)
    return counts


def sweep_csv(sw: Sweep) -> str:
    out = io.StringIO()
    w = csv.writer(out, lineterminator="\n")
    # step_s_low / step_s_high: the prediction's interval (uncertainty.py; empty under a calibration of your own)
    header = ["gpu", "gpus", "fits", "tp", "cp", "pp", "vpp", "dp", "ep", "mbs", "zero", "recompute", "step_s",
              "step_s_low", "step_s_high", "tokens_per_s", "mfu", "peak_memory_gib", "usd_per_hour",
              "usd_per_million_tokens", "gpu_hours_per_million_tokens", "expected_days", "goodput", "total_usd",
              "pareto", "chosen", "why"]
    w.writerow(header)
    best, front = sw.best, set(map(id, sw.pareto))
    for p in sw.points:
        if p.plan is None:
            w.writerow([p.gpu, p.gpus, "no"] + [""] * (len(header) - 4) + [p.why or ""])
            continue
        lay, pred, c = p.plan.prediction.layout, p.plan.prediction, p.cost
        days = "" if c.expected_s is None else f"{c.expected_s / 86400:.3f}"
        low, high = (f"{t:.6g}" for t in pred.interval.step_time_s) if pred.interval else ("", "")
        w.writerow([p.gpu, p.gpus, "yes", lay.tp, lay.cp, lay.pp, lay.vpp, lay.dp, lay.ep, lay.mbs, lay.zero,
                    lay.recompute, f"{pred.step_time_s:.6g}", low, high, f"{pred.tokens_per_s:.6g}", f"{pred.mfu:.4f}",
                    f"{pred.peak_memory_gib:.2f}", f"{c.usd_per_hour:.2f}", f"{c.usd_per_million_tokens:.5g}",
                    f"{c.gpu_hours_per_million_tokens:.5g}", days, "" if c.goodput is None else f"{c.goodput:.4f}",
                    "" if c.total_usd is None else f"{c.total_usd:.0f}", "yes" if id(p) in front else "no",
                    "yes" if p is best else "no", ""])
    return out.getvalue()
