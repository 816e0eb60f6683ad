"""meshplan's Python API: the library calls the command line is a thin layer over (docs/api.md).

`plan`, `estimate`, `serve` and `load_plan` return the typed results the CLI prints: a `Plan` (the Plan JSON
document, planner/plan.py), an `Estimate` (costmodels/estimate.py) or a `ServingPlan`. `search_plans` and
`search_deployments` also return what the tables show beside the plan (the ranking, the search's account, the
simulated timeline). Bad input raises `InputError` with the one line the CLI prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from collections.abc import Callable, Sequence
from typing import TypeAlias

from meshplan.costmodels.config import ParallelConfig, Workload
from meshplan.costmodels.economics import Budget, TrainingCost, training_cost
from meshplan.costmodels.efficiency import Efficiency, calibrated_cluster, factor_cluster
from meshplan.costmodels.engine_calibration import engine_calibrated_cluster
from meshplan.costmodels.estimate import Estimate, Simulated
from meshplan.costmodels.estimate import estimate as estimate_cost
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import load_model
from meshplan.costmodels.runtime import DEFAULT_RUNTIME
from meshplan.costmodels.serving import (UNMIXED_ENGINES, EngineLayout, ServeEngine, ServeObjective, ServeTargets,
                                         ServeWorkload)
from meshplan.costmodels.uncertainty import (DEFAULT_MEMORY_RULE, DEFAULT_RANK, MemoryRule, RankKind, Ranking,
                                             ResidualTable, memory_share)
from meshplan.hardware_db.calibration import (NONE, PUBLIC, FactorCalibration, default_calibration,
                                              engine_calibration_file, load_engine_calibration,
                                              shipped_engine_calibration,
                                              load_any_calibration, public_calibration)
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import load_gpu
from meshplan.planner.builders import build_plan, build_serving_plan, priced
from meshplan.planner.launchers.common import ExportError
from meshplan.planner.plan import Plan, ServingPlan, read_any_plan, without_timing
from meshplan.planner.rederive import Rederived, rederive
from meshplan.planner.search import ProgressFn, SearchResult, search
from meshplan.planner.serve import (ServeResult, SimulationCheck, checked_by_simulation, explain_serving,
                                   pinned_deployment, search_serving, simulate_deployment)
from meshplan.planner.space import DEFAULT_MAX_MBS
from meshplan.planner.sweep import Objective, Sweep, SweepPoint

__all__ = ["PinnedDeployment", "PlanSearch", "ServingSearch", "calibrated", "estimate", "load_plan",
           "open_plan", "plan",
           "cost_of", "priced",
           "search_deployments", "search_plans", "serve", "sweep", "runnable_plan", "Runnable"]

# a zoo name, a config file (Hugging Face config.json or meshplan model file), or a spec
ModelInput: TypeAlias = str | ModelSpec


@dataclass(frozen=True)
class PlanSearch:
    """A training search's outcome: the best plan as a document, the ranking and account it came from, the best
    plan's simulated timeline (for a trace) and the cluster it was planned on (calibrated where asked)."""

    plan: Plan
    result: SearchResult
    simulated: Simulated
    cluster: Cluster
    residual_table: ResidualTable | None = None  # the shipped residuals of the model that priced it (none: own)


@dataclass(frozen=True)
class PinnedDeployment:
    """A serving deployment given instead of searched: the decode (or aggregated) engine, optionally a prefill engine
    (disaggregated); counts and batches left None are chosen to meet the targets."""

    layout: EngineLayout
    engines: int | None = None
    batch: int | None = None
    prefill_layout: EngineLayout | None = None
    prefill_engines: int | None = None


@dataclass(frozen=True)
class ServingSearch:
    """A serving search's outcome: the best deployment as a document, the search (None for a pinned deployment) and
    one line per runner-up saying why it loses."""

    plan: ServingPlan
    result: ServeResult | None
    alternatives: tuple[str, ...]
    simulated: SimulationCheck | None = None  # the best's engine simulated at its rate, where the simulation models it
    priced_with: str = ""  # which calibration priced the engines (serving_hardware)


def _model(model: ModelInput) -> ModelSpec:
    return model if isinstance(model, ModelSpec) else load_model(model)


def calibrated(cluster: ClusterSpec, calibration: str | None = None,
               runtime: str = DEFAULT_RUNTIME) -> tuple[Cluster, Efficiency | None]:
    """The cluster, and with a calibration (a file from `meshplan profile` or a name under hardware_db/calibrations;
    factors from `meshplan calibrate --runs`; or "public", the GPU's factors fit to the published runs) its device as
    measured and the efficiency model fitted to it. Without one, the GPU's public calibration where meshplan ships
    one; "none" (or no public calibration): the GPU's defaults, and None for the efficiency."""
    if calibration is None:
        calibration = default_calibration(cluster.gpu)
    if calibration is None or calibration == NONE:
        return Cluster(cluster), None
    if calibration == PUBLIC:
        calibration = public_calibration(cluster.gpu)
    cal = load_any_calibration(calibration)
    if isinstance(cal, FactorCalibration):
        return factor_cluster(cluster, cal, calibration)
    return calibrated_cluster(cluster, cal, calibration, runtime)


def estimate(model: ModelInput, cluster: ClusterSpec, workload: Workload, config: ParallelConfig = ParallelConfig(),
             runtime: str = DEFAULT_RUNTIME, calibration: str | None = None) -> Estimate:
    """The predicted step time, its breakdown, throughput, MFU and memory of one configuration (knobs left None take
    their defaults: KnobHelp.default in costmodels/config.py)."""
    hardware, eff = calibrated(cluster, calibration, runtime)
    return estimate_cost(_model(model), hardware, workload, config, runtime, eff)


def cost_of(model: ModelInput, cluster: ClusterSpec, tokens_per_s: float, budget: Budget = Budget(),
            calibration: str | None = None) -> TrainingCost:
    """Dollars, GPU-hours and, with budget.tokens, the time to train with failures of a plan or estimate making
    `tokens_per_s` on `cluster` (a calibrated one: `--gpu cpu` is a device of the calibration); the price is the
    hardware database's unless the budget gives one."""
    price = budget.usd_per_gpu_hour
    if price is None:
        price = calibrated(cluster, calibration)[0].gpu.price_usd_per_hour.value
    return training_cost(cluster.num_gpus, price, tokens_per_s, _model(model).total_params(), budget.tokens,
                         budget.reliability)


def search_plans(model: ModelInput, cluster: ClusterSpec, workload: Workload, config: ParallelConfig = ParallelConfig(),
                 runtime: str = DEFAULT_RUNTIME, calibration: str | None = None, top: int = 5,
                 time_limit_s: float | None = None, timing: bool = False, progress: ProgressFn | None = None,
                 max_mbs: int = DEFAULT_MAX_MBS, budget: Budget = Budget(),
                 rank: RankKind = DEFAULT_RANK, memory: MemoryRule = DEFAULT_MEMORY_RULE) -> PlanSearch:
    """Search every configuration `config` leaves open (each knob left None is searched, the others are pinned); the
    best plan (its search time recorded only with `timing`, so the same input makes the same document), priced with
    `budget` (its economics section). `rank`: what "best" means, the predicted step time or the slow end of its
    interval (costmodels/uncertainty.py Ranking). `memory`: what fits, the predicted peak in the HBM or, "sure", the
    high end of its memory interval. InputError when nothing fits, saying why."""
    spec = _model(model)
    hardware, eff = calibrated(cluster, calibration, runtime)
    table = "defaults" if eff is None else eff.residual_table
    if rank != "expected" and table is None:
        raise InputError(f"--rank {rank} ranks by the intervals of the uncalibrated model or of --calibration public "
                         f"(their cross-validated errors), and {calibration} has none; use --rank expected with it")
    if memory == "sure" and eff is not None and (eff.activation_factor != 1.0 or eff.activation_ratios):
        raise InputError(f"--memory sure reads the default memory model's error on measured peaks, and {calibration} "
                         f"moves the activations; use --memory estimate with it")
    ranking = Ranking(rank) if table is None else Ranking(rank, table=table)  # table None: expected, no interval read
    result = search(spec, hardware, workload, config, runtime, efficiency=eff, top_k=top, time_limit_s=time_limit_s,
                    progress=progress, max_mbs=max_mbs, ranking=ranking, memory_share=memory_share(memory))
    if not result.plans:
        raise InputError(result.why_nothing_fits or "no plan fits")
    best = result.plans[0]
    sim = best.simulated  # the search's own simulation (tests/test_search.py: every plan re-estimates exactly)
    doc = build_plan(spec, hardware, workload, best.config, sim, runtime, account=result.account, rank=1,
                     bound_s=best.bound_s, partition_status=best.partition_status,
                     calibration=eff.calibration if eff else None)
    doc = priced(doc, budget)
    return PlanSearch(plan=doc if timing else without_timing(doc), result=result, simulated=sim, cluster=hardware,
                      residual_table=table)


def sweep(model: ModelInput, gpus: Sequence[str], counts: Sequence[int], workload: Workload,
          links: ClusterSpec | None = None, budget: Budget = Budget(), objective: Objective = "time",
          config: ParallelConfig = ParallelConfig(), runtime: str = DEFAULT_RUNTIME, calibration: str | None = None,
          progress: Callable[[int, int], None] | None = None, rank: RankKind = DEFAULT_RANK,
          memory: MemoryRule = DEFAULT_MEMORY_RULE) -> Sweep:
    """The best plan on every GPU type x count (the link settings of `links`, when given, on each), priced with
    `budget`, "best" and "fits" as search_plans' `rank` and `memory` say; a count where nothing fits, or that does
    not fill whole nodes, is kept with why. Unknown GPU names fail before any search."""
    spec = _model(model)
    for name in gpus:
        load_gpu(name)
    template = links.model_dump(exclude={"gpu", "num_gpus"}) if links is not None else {}
    points: list[SweepPoint] = []
    total = len(gpus) * len(counts)
    for gpu in gpus:
        for n in counts:
            try:
                found = search_plans(spec, ClusterSpec(gpu=gpu, num_gpus=n, **template), workload, config, runtime,
                                     calibration, top=1, budget=budget, rank=rank, memory=memory)
            except InputError as exc:
                points.append(SweepPoint(gpu, n, None, str(exc)))
            else:
                points.append(SweepPoint(gpu, n, found.plan))
            if progress is not None:
                progress(len(points), total)
    return Sweep(tuple(points), objective)


@dataclass(frozen=True)
class Runnable:
    """The best plan a launcher runs, with the pins that made the search keep to the launcher's rules."""

    found: PlanSearch
    pins: tuple[tuple[str, object], ...]


def runnable_plan(model: ModelInput, cluster: ClusterSpec, workload: Workload, target: str,
                  config: ParallelConfig = ParallelConfig(), runtime: str = DEFAULT_RUNTIME,
                  calibration: str | None = None, budget: Budget = Budget(), refused: ExportError | None = None,
                  max_searches: int = 12) -> Runnable | None:
    """The fastest plan `target` can launch: search, export, and where the launcher refuses, search again with each
    alternative its refusal names (ExportError.pins) added to the pins, breadth first, up to `max_searches`
    searches; None when no search within them gives an exportable plan. `refused`: the unpinned search's refusal,
    when the caller has it (its search is not repeated)."""
    from meshplan.planner.launchers import export_plan

    spec = _model(model)
    queue: list[tuple[tuple[str, object], ...]] = [()]
    seen: set[tuple[tuple[str, object], ...]] = set()
    if refused is not None:
        queue, seen = [tuple(sorted(pins.items())) for pins in refused.pins], {()}
    best: Runnable | None = None
    while queue and len(seen) < max_searches:
        pins = queue.pop(0)
        if pins in seen:
            continue
        seen.add(pins)
        try:
            found = search_plans(spec, cluster, workload, config.model_copy(update=dict(pins)), runtime, calibration,
                                 top=1, budget=budget)
            export_plan(found.plan, target)
        except ExportError as refusal:
            queue += [tuple(sorted((dict(pins) | alternative).items())) for alternative in refusal.pins]
            continue
        except InputError:  # nothing fits under these pins
            continue
        if best is None or found.plan.prediction.step_time_s < best.found.plan.prediction.step_time_s:
            best = Runnable(found, pins)
    return best


def plan(model: ModelInput, cluster: ClusterSpec, workload: Workload, config: ParallelConfig = ParallelConfig(),
         runtime: str = DEFAULT_RUNTIME, calibration: str | None = None, time_limit_s: float | None = None,
         rank: RankKind = DEFAULT_RANK, memory: MemoryRule = DEFAULT_MEMORY_RULE) -> Plan:
    """The fastest configuration that fits (the knobs set in `config` pinned; `rank`: or the one whose slow end is
    the least; `memory`: fits at the estimate, or surely), as the Plan document `meshplan plan --out` writes."""
    return search_plans(model, cluster, workload, config, runtime, calibration, time_limit_s=time_limit_s,
                        rank=rank, memory=memory).plan


def serving_hardware(cluster: ClusterSpec, calibration: str | None = None,
                     engine: ServeEngine = "vllm") -> tuple[Cluster, Efficiency | None, str]:
    """The cluster and efficiency model a serving search prices `engine`'s iterations with, and a line saying which.
    None: the engine calibration meshplan ships for `engine`, where its rows ran on the cluster's GPU type
    (benchmarks/serving_engine_fit.py), else the GPU's defaults (the public calibration is fit to training runs and
    unchecked on serving); "none": the defaults; a file: an engine calibration (`meshplan calibrate --deployments`),
    which must be `engine`'s, or a GPU calibration as `calibrated` takes it."""
    if calibration is None:
        cal = shipped_engine_calibration(engine)
        if cal is not None and cluster.gpu in cal.gpus:
            hardware, eff = engine_calibrated_cluster(cluster, cal, f"engine-{engine}")
            return hardware, eff, (f"{engine}'s engine calibration (engine-{engine}, fit to {cal.rows:,} measured "
                                   f"deployments of {len(cal.models)} checkpoints; each model left out, median error "
                                   f"TTFT {cal.held_out['ttft']:.0%}, TPOT {cal.held_out['tpot']:.0%})")
        why = "meshplan ships no calibration of it" if cal is None else f"its calibration has no rows on {cluster.gpu}"
        return Cluster(cluster), None, f"the GPU's efficiency defaults ({engine}: {why})"
    engine_file = engine_calibration_file(calibration) if calibration != NONE else None
    if engine_file is not None:
        cal = load_engine_calibration(engine_file)
        if cal.engine != engine:
            raise InputError(f"{calibration} calibrates {cal.engine}, not {engine}: pass --engine {cal.engine} or "
                             f"a calibration of {engine}")
        hardware, engine_eff = engine_calibrated_cluster(cluster, cal, calibration)
        return hardware, engine_eff, f"engine calibration {calibration} ({cal.engine}, {cal.rows:,} deployments)"
    hardware, gpu_eff = calibrated(cluster, calibration)
    return hardware, gpu_eff, "the GPU's efficiency defaults" if gpu_eff is None else f"calibration {calibration}"


def search_deployments(model: ModelInput, cluster: ClusterSpec, workload: ServeWorkload, targets: ServeTargets,
                       min_gpus: int = 1, objective: ServeObjective = "throughput", disaggregation: bool = True,
                       top: int = 5,
                       mem_fraction: float = 0.9, time_limit_s: float | None = None,
                       pinned: PinnedDeployment | None = None, timing: bool = False,
                       calibration: str | None = None, engine: ServeEngine = "vllm") -> ServingSearch:
    """The best serving deployment on at most `cluster.num_gpus` GPUs (and at least `min_gpus`) under the targets,
    or the `pinned` one priced. InputError when nothing fits. `calibration` and `engine` as serving_hardware takes
    them."""
    spec = _model(model)
    hardware, eff, priced_with = serving_hardware(cluster, calibration, engine)
    mixed = engine not in UNMIXED_ENGINES  # the simulation check schedules as the engine does by default
    if workload.weight_dtype not in hardware.gpu.peak_tflops:
        have = ", ".join(d for d in ("bf16", "fp8", "fp4") if d in hardware.gpu.peak_tflops)
        raise InputError(f"{hardware.gpu.name} has no {workload.weight_dtype} tensor cores; choose --weight-dtype "
                         f"from {have}")
    result: ServeResult | None = None
    alternatives: tuple[str, ...] = ()
    if pinned is not None:
        best = pinned_deployment(spec, hardware, workload, targets, pinned.layout, pinned.engines, pinned.batch,
                                 pinned.prefill_layout, pinned.prefill_engines, eff=eff, mem_fraction=mem_fraction)
        if best.gpus > hardware.num_gpus:
            raise InputError(f"the deployment needs {best.gpus} GPUs; --gpus gives {hardware.num_gpus}")
    else:
        result = search_serving(spec, hardware, workload, targets, min_gpus, objective, disaggregation, eff=eff,
                                top=top, mem_fraction=mem_fraction, time_limit_s=time_limit_s, engine=engine)
        if result.best is None:
            raise InputError(result.why_nothing or "no deployment fits")
        result = checked_by_simulation(spec, hardware, workload, targets, result, eff=eff, mixed=mixed)
        assert result.best is not None
        best, alternatives = result.best, tuple(explain_serving(result, targets, workload))
    doc = priced(build_serving_plan(spec, hardware, workload, targets, best, result, objective, list(alternatives),
                                    calibration=eff.calibration if eff else None))
    return ServingSearch(plan=doc if timing else without_timing(doc), result=result, alternatives=alternatives,
                         simulated=simulate_deployment(spec, hardware, workload, targets, best, eff=eff, mixed=mixed),
                         priced_with=priced_with)


def serve(model: ModelInput, cluster: ClusterSpec, workload: ServeWorkload, targets: ServeTargets = ServeTargets(),
          objective: ServeObjective = "throughput", disaggregation: bool = True) -> ServingPlan:
    """The best serving deployment, as the document `meshplan serve --out` writes."""
    return search_deployments(model, cluster, workload, targets, objective=objective,
                              disaggregation=disaggregation).plan


def open_plan(path: str | Path, kinds: tuple[str, ...] = ("training", "serving")) -> Rederived:
    """A plan file of one of `kinds`, validated against this version's schema and re-derived from its own inputs
    and layout (planner/rederive.py): an edited figure is refused, another cost model's figures are re-priced and
    the result says so. InputError says what is wrong."""
    return rederive(read_any_plan(path, kinds), str(path))


def load_plan(path: str | Path) -> Plan | ServingPlan:
    """A plan file (training or serving), validated and re-derived (open_plan); InputError says what is wrong."""
    return open_plan(path).plan
