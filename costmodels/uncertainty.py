"""How sure a prediction is. A configuration falls in a *region*: the features the cost model's error has been seen
to depend on (issue 44: GPU, runtime, dense or MoE, EP across nodes, context parallelism, sequences of 32K tokens
or more, FP8, TP 8 or more on hidden 4,096 or less). A prediction interval comes from the held-out residuals of
measured runs in the same region, by split conformal prediction (Lei et al. 2018, "Distribution-Free Predictive
Inference for Regression", JASA 113(523), sec. 2.2): with n exchangeable residuals, the k-th smallest with
k = ceil((n + 1)(1 + level) / 2) bounds a new one from above with probability at least (1 + level) / 2, and
likewise from below. Where a region holds too few runs for that, features are dropped in REGION_BACKOFF order until
one holds enough; the interval names the region it came from.

A residual is log(predicted throughput / measured throughput): positive where the model is optimistic, and the
same for a step-time metric (its ratio inverted). The measured throughput then lies in
[predicted exp(-hi), predicted exp(-lo)].
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Literal, TypeVar

from meshplan.costmodels.config import Layout, Workload
from meshplan.costmodels.model import ModelSpec
from meshplan.hardware_db.errors import InputError

DEFAULT_LEVEL = 0.8  # the intervals estimate and plan show (issue 44: "for example 80 %")
MEMORY_LEVEL = 0.95  # the memory verdict's confidence (issue 44: "fits with 95 % confidence")
RESIDUALS_FILE = "residuals.json"  # in this package: written by benchmarks/crossval.py --write
LONG_CONTEXT = 32_768  # tokens: issue 44's long-context group (over-predicted by +67 % before calibration)
WIDE_TP, SMALL_HIDDEN = 8, 4096  # TP 8 or more on a hidden size of 4,096 or less: GEMMs too thin per GPU


@dataclass(frozen=True)
class Region:
    """The features a run's prediction error is grouped by (issue 44's groups)."""

    gpu: str  # hardware_db name
    runtime: str  # the preset, without its +options
    moe: bool
    ep_across_nodes: bool  # an expert-parallel group spans more than one scale-up domain
    context_parallel: bool  # cp > 1
    long_context: bool  # sequence >= LONG_CONTEXT
    fp8: bool
    wide_tp: bool  # tp >= WIDE_TP on hidden <= SMALL_HIDDEN

    def labels(self) -> tuple[tuple[str, str], ...]:
        """(group, value) pairs, for per-group tables."""
        def shown(name: str, value: str | bool) -> str:
            if isinstance(value, str):
                return value
            if name == "moe":
                return "moe" if value else "dense"
            return "yes" if value else "no"

        return tuple((FEATURE_LABELS[f.name], shown(f.name, getattr(self, f.name))) for f in dataclasses.fields(self))


# how each feature reads in tables and lines
FEATURE_LABELS = {"gpu": "gpu", "runtime": "runtime", "moe": "experts", "ep_across_nodes": "EP across nodes",
                  "context_parallel": "CP", "long_context": "sequence >= 32K", "fp8": "FP8",
                  "wide_tp": "TP >= 8 on hidden <= 4096"}


# Features given up first when a region holds too few runs, least telling first: the last ones are the groups
# where the uncalibrated model errs most (MoE, long context, the GPU generation: issue 44).
REGION_BACKOFF = ("wide_tp", "fp8", "context_parallel", "ep_across_nodes", "runtime", "gpu", "long_context", "moe")


RegionT = TypeVar("RegionT")  # a frozen dataclass of the features an error is grouped by


def region_of(model: ModelSpec, lay: Layout, wl: Workload, gpu: str, gpus_per_node: int, runtime: str) -> Region:
    """The region of a resolved configuration. An EP group's ranks are ep x etp apart at most (Megatron-Core's
    expert mesh tp-ep-dp inside the dense ranks, megatron/core/parallel_state.py), so it spans nodes when that
    exceeds a scale-up domain."""
    return Region(gpu=gpu, runtime=runtime.split("+")[0], moe=model.moe is not None,
                  ep_across_nodes=model.moe is not None and lay.ep * lay.etp > gpus_per_node,
                  context_parallel=lay.cp > 1, long_context=wl.seq_len >= LONG_CONTEXT, fp8=wl.dtype == "fp8",
                  wide_tp=lay.tp >= WIDE_TP and model.hidden <= SMALL_HIDDEN)


def inputs_region(model: ModelSpec, wl: Workload, gpu: str, runtime: str) -> Region:
    """The region of these inputs with every layout feature (LAYOUT_FEATURES) off: what a search's candidates share."""
    return Region(gpu=gpu, runtime=runtime.split("+")[0], moe=model.moe is not None, ep_across_nodes=False,
                  context_parallel=False, long_context=wl.seq_len >= LONG_CONTEXT, fp8=wl.dtype == "fp8",
                  wide_tp=False)


def min_runs(level: float) -> int:
    """The fewest residuals that give a finite interval at this level: both order statistics inside 1..n."""
    _check_level(level)
    n = 1
    while _lower_rank(n, level) < 1 or _upper_rank(n, level) > n:
        n += 1
    return n


def _upper_rank(n: int, level: float) -> int:
    return math.ceil((n + 1) * (1 + level) / 2 - 1e-9)  # the 1e-9: (n + 1) x 0.9 in floating point


def _lower_rank(n: int, level: float) -> int:
    return math.floor((n + 1) * (1 - level) / 2 + 1e-9)


def _check_level(level: float) -> None:
    if not 0 < level < 1:
        raise ValueError(f"an interval's level is a fraction between 0 and 1, not {level}")


def conformal_bounds(residuals: Sequence[float], level: float) -> tuple[float, float]:
    """(lo, hi): each a split-conformal bound on a new residual exchangeable with these, so that it falls in
    [lo, hi] with probability at least `level`; (-inf, inf) with fewer than min_runs(level) residuals. Fewer runs
    pick more extreme order statistics: the interval widens."""
    _check_level(level)
    ordered = sorted(residuals)
    n = len(ordered)
    lo_rank, hi_rank = _lower_rank(n, level), _upper_rank(n, level)
    if n == 0 or lo_rank < 1 or hi_rank > n:
        return -math.inf, math.inf
    return ordered[lo_rank - 1], ordered[hi_rank - 1]


@dataclass(frozen=True)
class Interval:
    """A prediction interval on the residual, and where it came from."""

    lo: float  # residual bounds: measured throughput in [predicted exp(-hi), predicted exp(-lo)]
    hi: float
    level: float
    runs: int  # residuals it was computed from
    dropped: tuple[str, ...]  # region features given up to reach min_runs (REGION_BACKOFF order)

    def throughput(self, predicted: float) -> tuple[float, float]:
        """The range of the measured throughput for a predicted one."""
        return predicted * math.exp(-self.hi), predicted * math.exp(-self.lo)

    def step_time(self, predicted: float) -> tuple[float, float]:
        """The range of the measured step time for a predicted one."""
        return predicted * math.exp(self.lo), predicted * math.exp(self.hi)


def region_interval(target: RegionT, table: Sequence[tuple[RegionT, float]], level: float = 0.8,
                    backoff: tuple[str, ...] = REGION_BACKOFF) -> Interval:
    """The interval of `target` from (region, residual) pairs of measured runs: those of its own region when they
    are at least min_runs(level), else those matching on the features left after dropping `backoff`'s first
    ones, one at a time. With every feature dropped, all residuals; with too few of those, an infinite interval.
    A region is any frozen dataclass of features (Region here, serving_uncertainty.ServingRegion for serving)."""
    need = min_runs(level)
    names = [f.name for f in dataclasses.fields(target)]  # type: ignore[arg-type]
    for k in range(len(backoff) + 1):
        kept = [n for n in names if n not in backoff[:k]]
        same = [r for region, r in table if all(getattr(region, f) == getattr(target, f) for f in kept)]
        if len(same) >= need or k == len(backoff):
            lo, hi = conformal_bounds(same, level)
            return Interval(lo, hi, level, len(same), backoff[:k])
    raise AssertionError("unreachable: the last step keeps every residual")


def residual(predicted_throughput: float, measured_throughput: float) -> float:
    """log(predicted / measured): the error an interval is made of."""
    if predicted_throughput <= 0 or measured_throughput <= 0:
        raise ValueError("throughputs must be positive")
    return math.log(predicted_throughput / measured_throughput)


@dataclass(frozen=True)
class MeasuredRun:
    """A run of the development sets as the intervals read it."""

    id: str
    publication: str  # a paper, a page at any commit, or an MLPerf round (benchmarks/crossval.py)
    region: Region
    residual: float


# Which model's errors a residual table holds: the GPU's defaults ("runs"), or --calibration public ("public_runs":
# each run predicted by the factors its GPU gets from the other publications' runs, benchmarks/crossval.py setting
# (d)), as costmodels/residuals.json keeps them.
ResidualTable = Literal["defaults", "public"]
RESIDUAL_KEYS: dict[str, str] = {"defaults": "runs", "public": "public_runs"}


@cache
def measured_runs(table: ResidualTable = "defaults") -> tuple[MeasuredRun, ...]:
    """Every run of both development sets under the default efficiencies (or, for "public", every run with other
    publications on its GPU under setting (d)'s calibration), as shipped in costmodels/residuals.json
    (benchmarks/crossval.py --write; tests/test_uncertainty.py checks it against the cost model, so it is
    regenerated whenever a change moves a prediction)."""
    data = json.loads(resources.files("meshplan.costmodels").joinpath(RESIDUALS_FILE).read_text(encoding="utf-8"))
    return tuple(MeasuredRun(run["id"], run["publication"], Region(**run["region"]), float(run["residual"]))
                 for run in data[RESIDUAL_KEYS[table]])


def measured_residuals(table: ResidualTable = "defaults") -> tuple[tuple[Region, float], ...]:
    """(region, residual) of every measured run of that table."""
    return tuple((run.region, run.residual) for run in measured_runs(table))


def lead_bound(runs: Sequence[MeasuredRun], level: float = DEFAULT_LEVEL) -> tuple[float, int]:
    """(bound, pairs): how far the model misjudges the ratio of two layouts on one cluster. Over every pair of runs
    of one publication on one GPU (one team's cluster and software, two layouts), |r_i - r_j| is the error of the
    predicted throughput ratio; the bound is the ceil((n + 1) level)-th smallest of the n pairs' (as
    conformal_bounds, one-sided; pairs sharing a run are not independent, so it is an empirical quantile more
    than a guarantee). inf with too few pairs."""
    _check_level(level)
    by_cluster: dict[tuple[str, str], list[float]] = {}
    for run in runs:
        by_cluster.setdefault((run.publication, run.region.gpu), []).append(run.residual)
    gaps = sorted(abs(a - b) for values in by_cluster.values()
                  for n, a in enumerate(values) for b in values[n + 1:])
    rank = math.ceil((len(gaps) + 1) * level - 1e-9)
    return (gaps[rank - 1] if 1 <= rank <= len(gaps) else math.inf), len(gaps)


@cache
def layout_lead_bound(level: float = DEFAULT_LEVEL, table: ResidualTable = "defaults") -> tuple[float, int]:
    """lead_bound over the shipped runs of the table of the model that predicts the two layouts."""
    return lead_bound(measured_runs(table), level)


def lead_is_significant(faster: float, slower: float, level: float = DEFAULT_LEVEL,
                        table: ResidualTable = "defaults") -> bool:
    """Whether one layout's predicted throughput leads another's on the same cluster by more than the model
    misjudges two layouts (layout_lead_bound): below it the ranking may be the model's error."""
    return math.log(faster / slower) > layout_lead_bound(level, table)[0]


def lead_note(faster: float, slower: float, level: float = DEFAULT_LEVEL, table: ResidualTable = "defaults") -> str:
    """The sentence `plan` and `compare` print of a lead between two layouts on one cluster: the model's error on
    such a pair (layout_lead_bound) and whether the lead exceeds it."""
    bound, pairs = layout_lead_bound(level, table)
    verdict = "a significant difference" if lead_is_significant(faster, slower, level, table) else \
        "not a significant difference"
    return (f"the model misjudges two layouts on one cluster by up to {math.exp(bound) - 1:.0%} ({100 * level:.0f} % "
            f"of {pairs} pairs of published runs): {verdict}")


@cache
def prediction_interval(region: Region, level: float = DEFAULT_LEVEL, table: ResidualTable = "defaults") -> Interval:
    """The interval of a new configuration from every measured run of its region (region_interval), in the table of
    the model that predicts it; cached, as every simulated candidate of a search asks for its region's."""
    return region_interval(region, measured_residuals(table), level)


RankKind = Literal["expected", "conservative"]
RANK_KINDS: tuple[RankKind, ...] = ("expected", "conservative")
DEFAULT_RANK: RankKind = "expected"  # benchmarks/reference_search.py --rank both (RESULTS.md) chose it
# the region features a search's candidates differ in; the others are the inputs' (GPU, runtime, model, workload)
LAYOUT_FEATURES = ("ep_across_nodes", "context_parallel", "wide_tp")


@dataclass(frozen=True)
class Ranking:
    """What a search minimises (issue 44 item 4): the predicted step time ("expected"), or the slow end of its
    interval ("conservative": the step time its region's held-out residuals say a run exceeds with probability at
    most (1 - level) / 2), so a layout whose region the model has often over-predicted pays for it."""

    kind: RankKind = DEFAULT_RANK
    level: float = DEFAULT_LEVEL
    residuals: tuple[tuple[Region, float], ...] | None = None  # None: the shipped runs' (measured_residuals)
    table: ResidualTable = "defaults"  # which shipped table, with residuals None: that of the model ranked

    def factor(self, region: Region) -> float:
        """The ranked quantity over the predicted step time: 1, or the interval's exp(hi)."""
        if self.kind == "expected":
            return 1.0
        if self.residuals is None:
            return math.exp(prediction_interval(region, self.level, self.table).hi)
        return math.exp(region_interval(region, self.residuals, self.level).hi)

    def floor(self, inputs: Region) -> float:
        """The smallest factor over every region a search with these inputs can reach (its layouts differ only in
        LAYOUT_FEATURES): a time bound times it bounds the ranked quantity, so the search's pruning stays exact."""
        return min(self.factor(dataclasses.replace(inputs, ep_across_nodes=ep, context_parallel=cp, wide_tp=wide))
                   for ep, cp, wide in itertools.product((False, True), repeat=len(LAYOUT_FEATURES)))


MemoryVerdict = Literal["fits", "fits at the estimate", "over at the estimate", "does not fit"]
MEMORY_VERDICTS: tuple[MemoryVerdict, ...] = ("fits", "fits at the estimate", "over at the estimate", "does not fit")


@dataclass(frozen=True)
class MemoryRun:
    """A measured peak memory beside its prediction, as the memory interval reads it."""

    id: str
    publication: str
    kind: Literal["reserved", "allocated"]  # the allocator's max reserved, or max allocated (fit.MemoryKind)
    residual: float  # log(measured / predicted): positive where the model under-counts


def one_sided_bounds(residuals: Sequence[float], level: float) -> tuple[float, float]:
    """(lo, hi): a new exchangeable residual is >= lo with probability at least `level`, and <= hi likewise (each
    bound one-sided: split conformal, Lei et al. 2018 sec. 2.2, the ceil((n + 1) level)-th smallest for hi and the
    floor((n + 1)(1 - level))-th for lo); -inf or inf where the residuals are too few for that bound."""
    _check_level(level)
    ordered = sorted(residuals)
    n = len(ordered)
    hi_rank = math.ceil((n + 1) * level - 1e-9)
    lo_rank = math.floor((n + 1) * (1 - level) + 1e-9)
    hi = ordered[hi_rank - 1] if 1 <= hi_rank <= n else math.inf
    lo = ordered[lo_rank - 1] if 1 <= lo_rank <= n else -math.inf
    return lo, hi


@dataclass(frozen=True)
class MemoryInterval:
    """How far measured peak memory was from the prediction: the measured peak is at most predicted x exp(hi) with
    probability `level`, and at least predicted x exp(lo) likewise."""

    lo: float
    hi: float
    level: float
    runs: int

    def peak_gib(self, predicted_gib: float) -> tuple[float, float]:
        """The (low, high) ends of the measured peak for a predicted one."""
        return predicted_gib * math.exp(self.lo), predicted_gib * math.exp(self.hi)

    def verdict(self, predicted_gib: float, hbm_gib: float) -> MemoryVerdict:
        """'fits' only when the high end fits; 'does not fit' only when the low end does not; in between, which
        side of the HBM the estimate itself is on."""
        low, high = self.peak_gib(predicted_gib)
        if high <= hbm_gib:
            return "fits"
        if low > hbm_gib:
            return "does not fit"
        return "fits at the estimate" if predicted_gib <= hbm_gib else "over at the estimate"

    def line(self, predicted_gib: float, hbm_gib: float) -> str:
        """The sentence `estimate` and `plan` print."""
        low, high = self.peak_gib(predicted_gib)
        verdict = self.verdict(predicted_gib, hbm_gib)
        confidence = f"{100 * self.level:.0f} %"
        span = (f"peak {predicted_gib:.1f} GiB of {hbm_gib:.0f} GiB HBM; the model's error on {self.runs} measured "
                f"peaks puts it at {low:.1f}-{high:.1f} GiB")
        if verdict == "fits":
            return f"fits with {confidence} confidence ({span})"
        if verdict == "does not fit":
            return f"does not fit with {confidence} confidence ({span})"
        if verdict == "fits at the estimate":
            return f"fits at the estimate, not with {confidence} confidence ({span})"
        return f"over at the estimate, but inside the memory model's error: it may fit ({span})"


@cache
def measured_memory_runs() -> tuple[MemoryRun, ...]:
    """Every measured peak memory beside the default model's prediction, as shipped in costmodels/residuals.json
    (benchmarks/crossval.py --write)."""
    data = json.loads(resources.files("meshplan.costmodels").joinpath(RESIDUALS_FILE).read_text(encoding="utf-8"))
    return tuple(MemoryRun(run["id"], run["publication"], run["kind"], float(run["residual"]))
                 for run in data.get("memory", []))


def memory_interval_of(runs: Sequence[MemoryRun], level: float = MEMORY_LEVEL) -> MemoryInterval:
    """The memory interval from these runs' residuals, pooled: too few runs measure memory to split them by region."""
    lo, hi = one_sided_bounds([r.residual for r in runs], level)
    return MemoryInterval(lo, hi, level, len(runs))


@cache
def memory_interval(level: float = MEMORY_LEVEL) -> MemoryInterval:
    """memory_interval_of the shipped runs."""
    return memory_interval_of(measured_memory_runs(), level)


MemoryRule = Literal["estimate", "sure"]
DEFAULT_MEMORY_RULE: MemoryRule = "estimate"


def memory_share(rule: MemoryRule) -> float:
    """The share of the HBM a plan's predicted peak may take: all of it ("estimate"), or so much that the high end
    of the memory interval still fits ("sure": the verdict 'fits', exp(-hi))."""
    if rule == "estimate":
        return 1.0
    hi = memory_interval().hi
    if not math.isfinite(hi):
        raise InputError(f"--memory sure needs a {100 * MEMORY_LEVEL:.0f} % bound on the memory model's error, and "
                         f"the shipped measured peaks are too few for one; use --memory estimate")
    return math.exp(-hi)
