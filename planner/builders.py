"""Plans built from what the planner computed: a simulated training configuration (and the search's account), or a
serving deployment (and the serving search's result). Apart from planner/plan.py, which holds the schema and its
reading and writing only, so that what reads plans (the exporters, the executor) does not import the searches."""

from __future__ import annotations

import dataclasses
import math
from typing import TypeVar

from meshplan.costmodels.config import ParallelConfig, Workload, resolve
from meshplan.costmodels.economics import Budget, ServingCost, TrainingCost, serving_cost, training_cost
from meshplan.costmodels.estimate import Simulated, interval_dict, memory_interval_dict
from meshplan.costmodels.memory import FRAGMENTATION, GIB, MemoryBreakdown
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import to_model_file
from meshplan.costmodels.serving import ServeObjective, ServeTargets, ServeWorkload
from meshplan.costmodels.serving_uncertainty import MetricInterval, ServingRegion, load_band, serving_interval
from meshplan.hardware_db.calibration import engine_calibration_named
from meshplan.hardware_db.cluster import Cluster
from meshplan.planner.plan import (ClusterInput, Inputs, Memory, MemoryGiB, MemoryRange, MemoryStage, ParetoPoint,
                                   PartitionStatus, Plan, PredictedStage, Prediction, PredictionInterval, RealismRecord,
                                   SearchInfo, ServingEngine, ServingInputs, ServingPlan, ServingPrediction,
                                   ServingRange, ServingRanges, ServingSearch, StageTime, cost_model_digest,
                                   layout_sections, meshplan_version)
from meshplan.planner.search import SearchAccount
from meshplan.planner.serve import Deployment, ServeResult, meets, misses

__all__ = ["build_plan", "build_serving_plan", "priced"]

PlanT = TypeVar("PlanT", Plan, ServingPlan)


def _stage_times(sim: Simulated) -> list[StageTime]:
    lay = sim.estimate.layout
    fwd = [0.0] * lay.pp
    bwd = [0.0] * lay.pp
    for rank, p, start, end in sim.timeline.events:
        if p.kind == "F":
            fwd[rank] += end - start
        else:
            bwd[rank] += end - start
    m = lay.num_microbatches
    return [StageTime(rank=r, forward_s=fwd[r] / m, backward_s=bwd[r] / m, busy_s=sim.timeline.busy[r])
            for r in range(lay.pp)]


def _gib(memory: MemoryBreakdown) -> MemoryGiB:
    return MemoryGiB(**{k: v / GIB for k, v in dataclasses.asdict(memory).items()})


def _prediction(simulated: Simulated) -> Prediction:
    est = simulated.estimate
    realism = est.realism
    return Prediction(
        step_time_s=est.step_time_s, tokens_per_s=est.tokens_per_s, tokens_per_s_per_gpu=est.tokens_per_s_per_gpu,
        tflops_per_gpu=est.tflops_per_gpu, mfu=est.mfu, hfu=est.hfu, peak_memory_gib=est.peak_memory_gib,
        hbm_gib=est.hbm_gib, fits=est.fits, bubble_fraction=est.bubble_fraction, breakdown_s=est.breakdown_s,
        layout=est.layout, runtime=est.runtime,
        stages=[PredictedStage(rank=s.rank, first_layer=s.layers[0], num_layers=s.layers[1],
                               in_flight_microbatches=s.in_flight, peak_memory_gib=s.peak_gib,
                               memory_gib=_gib(s.memory)) for s in est.stages],
        stage_time_s=_stage_times(simulated),
        realism=None if realism is None else RealismRecord(published_mfu=realism.published_mfu, run=realism.run,
                                                           source=realism.source, exceeds=realism.exceeds,
                                                           within_error=realism.within_error),
        interval=None if est.interval is None else PredictionInterval(**interval_dict(
            est.interval, est.step_time_s, est.tokens_per_s_per_gpu)),
        memory_range=None if est.memory_interval is None else MemoryRange(**memory_interval_dict(
            est.memory_interval, est.peak_memory_gib, est.hbm_gib)))


def _search_info(account: SearchAccount, rank: int | None, bound_s: float | None,
                 partition_status: PartitionStatus | None) -> SearchInfo:
    return SearchInfo(**dataclasses.asdict(account), rank=1 if rank is None else rank, bound_s=bound_s,
                      partition_status=partition_status)


def build_plan(model: ModelSpec, cluster: Cluster, workload: Workload, config: ParallelConfig, simulated: Simulated,
               runtime: str, account: SearchAccount | None = None, rank: int | None = None,
               bound_s: float | None = None, partition_status: PartitionStatus | None = None,
               calibration: str | None = None) -> Plan:
    """The plan for one simulated configuration; `account` (and this plan's rank, bound and partition status)
    when a search produced it. Raises ValueError when `simulated` was not made from these inputs."""
    est = simulated.estimate
    lay = est.layout
    if resolve(model, cluster.num_gpus, workload, config) != lay:
        raise ValueError("simulated was not made from this model, cluster, workload and config")
    if est.runtime != runtime:
        raise ValueError(f"simulated was made with runtime '{est.runtime}', not '{runtime}'")
    mesh, pipeline = layout_sections(lay, workload)
    memory_stages = [MemoryStage(rank=s.rank, peak_gib=s.peak_gib, in_flight_microbatches=s.in_flight,
                                 breakdown_gib=_gib(s.memory)) for s in est.stages]
    spec_fields = cluster.spec.model_dump() | {"gpus_per_node": cluster.gpus_per_node}
    return Plan(
        meshplan_version=meshplan_version(), cost_model=cost_model_digest(),
        inputs=Inputs(model=to_model_file(model), cluster=ClusterInput(**spec_fields, gpu_spec=cluster.gpu),
                      workload=workload, runtime=runtime, calibration=calibration),
        mesh=mesh,
        pipeline=pipeline,
        memory=Memory(zero=lay.zero, recompute=lay.recompute, recompute_modules=list(lay.recompute_modules),
                      offload_layers=lay.offload_layers, recompute_group=lay.recompute_group,
                      fragmentation=FRAGMENTATION, stages=memory_stages),
        prediction=_prediction(simulated),
        search=None if account is None else _search_info(account, rank, bound_s, partition_status),
    )


def build_serving_plan(model: ModelSpec, cluster: Cluster, workload: ServeWorkload, targets: ServeTargets,
                       deployment: Deployment, result: ServeResult | None = None,
                       objective: ServeObjective = "throughput",
                       alternatives: list[str] | None = None, calibration: str | None = None) -> ServingPlan:
    """The plan of one deployment; `result` when a search made it."""
    engines = [ServingEngine(
        role=p.role, engines=n, tp=p.layout.tp, dp=p.layout.dp, pp=p.layout.pp, ep=p.layout.ep,
        gpus_per_engine=p.layout.gpus, max_num_seqs=p.batch, max_num_batched_tokens=p.chunk,
        gpu_memory_utilization=p.mem_fraction, ttft_ms=p.ttft_s * 1e3, tpot_ms=p.tpot_s * 1e3,
        requests_per_s=p.requests_per_s, load=p.load, weights_gib=p.memory.weights_gib, kv_cache_gib=p.memory.kv_gib,
        kv_tokens=p.memory.tokens) for p, n in deployment.pools]
    d = deployment
    prediction = ServingPrediction(
        percentile=targets.percentile, ttft_ms=d.ttft_s * 1e3, tpot_ms=d.tpot_s * 1e3,
        e2e_ms=d.e2e_s(workload.osl) * 1e3,
        requests_per_s=d.requests_per_s, output_tokens_per_s=d.output_tokens_per_s,
        tokens_per_s_per_gpu=d.tokens_per_s_per_gpu, tokens_per_s_per_user=d.tokens_per_s_per_user, gpus=d.gpus,
        meets_targets=meets(d, targets, workload), misses=misses(d, targets, workload),
        intervals=serving_ranges(deployment, calibration))
    search = None
    if result is not None:
        pareto = [ParetoPoint(deployment=p.label(), gpus=p.gpus, tokens_per_s_per_gpu=p.tokens_per_s_per_gpu,
                              tokens_per_s_per_user=p.tokens_per_s_per_user, ttft_ms=p.ttft_s * 1e3,
                              tpot_ms=p.tpot_s * 1e3, meets_targets=meets(p, targets, workload))
                  for p in result.pareto]
        search = ServingSearch(objective=objective, evaluated=result.evaluated, seconds=result.seconds,
                               layouts_skipped=result.layouts_skipped,
                               pareto=pareto, alternatives=alternatives or [])
    spec_fields = cluster.spec.model_dump() | {"gpus_per_node": cluster.gpus_per_node}
    return ServingPlan(
        meshplan_version=meshplan_version(), cost_model=cost_model_digest(),
        inputs=ServingInputs(model=to_model_file(model), cluster=ClusterInput(**spec_fields, gpu_spec=cluster.gpu),
                             workload=workload, targets=targets, calibration=calibration),
        mode=d.mode, engines=engines, prediction=prediction, search=search)


def serving_ranges(d: Deployment, calibration: str | None) -> ServingRanges | None:
    """The deployment's intervals (costmodels/serving_uncertainty.py) under the shipped engine calibration the plan
    records; None under any other (the residuals describe that calibration's predictions only) or where an end is
    unbounded."""
    cal = engine_calibration_named(calibration) if calibration is not None else None
    if cal is None:
        return None
    decode, _ = d.pools[-1]  # the aggregated or decode pool: where the closed loop's users run
    found = serving_interval(cal, ServingRegion(d.mode, load_band(decode.load * decode.batch)))
    if found is None:
        return None

    def of(m: MetricInterval, ends: tuple[float, float]) -> ServingRange:
        i = m.interval
        return ServingRange(level=i.level, models=m.models, runs=i.runs, dropped=list(i.dropped), low=ends[0],
                            high=ends[1])

    ranges = ServingRanges(ttft_ms=of(found.ttft, found.ttft.interval.step_time(d.ttft_s * 1e3)),
                           tpot_ms=of(found.tpot, found.tpot.interval.step_time(d.tpot_s * 1e3)),
                           tokens_per_s_per_gpu=of(found.throughput,
                                                   found.throughput.interval.throughput(d.tokens_per_s_per_gpu)))
    ends = [e for r in (ranges.ttft_ms, ranges.tpot_ms, ranges.tokens_per_s_per_gpu) for e in (r.low, r.high)]
    return ranges if all(math.isfinite(e) for e in ends) else None  # too few rows for a bounded range


def priced(doc: PlanT, budget: Budget = Budget()) -> PlanT:
    """The plan with its economics section: a training plan's cost (with budget.tokens, its run's time with
    failures), a serving plan's cost per hour and per million output tokens. The price is the hardware database's
    unless the budget gives one."""
    cluster = doc.inputs.cluster
    price = cluster.gpu_spec.price_usd_per_hour.value if budget.usd_per_gpu_hour is None else budget.usd_per_gpu_hour
    cost: TrainingCost | ServingCost
    if isinstance(doc, ServingPlan):
        p = doc.prediction
        cost = serving_cost(p.gpus, price, p.output_tokens_per_s)
    else:
        cost = training_cost(cluster.num_gpus, price, doc.prediction.tokens_per_s,
                             doc.inputs.model_spec().total_params(), budget.tokens, budget.reliability)
    return doc.model_copy(update={"economics": cost})
