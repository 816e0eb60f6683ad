"""Plans are re-derived on read, not trusted: every figure of a plan file (prediction, memory, economics; a serving
plan's engines and prediction) is computed again from the plan's own inputs and layout before a command uses it.

Two outcomes when a stored figure disagrees beyond rounding:
- the plan was made by this very cost model (its `cost_model` digest is this meshplan's): the figure was edited, so
  the plan is refused in one line naming the field and the value its inputs give;
- another cost model made it (an older meshplan, or a plan without the digest): it is re-priced, and the caller
  says so beside both figures.
A calibrated training plan's efficiency curves are not in the file, so its prediction is not re-simulated, unless
the calibration is the GPU's public one this meshplan ships (what `plan` uses by default); what holds whatever the
cost model (throughput from the step, peak memory from the stages, fits) is still checked, by
the schema (planner/plan.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from meshplan.costmodels.economics import Budget
from meshplan.costmodels.efficiency import Efficiency, factor_cluster
from meshplan.costmodels.estimate import Simulated, simulate_config
from meshplan.costmodels.serving import EngineLayout
from meshplan.costmodels.uncertainty import ResidualTable
from meshplan.costmodels.engine_calibration import engine_calibrated_cluster
from meshplan.hardware_db.calibration import engine_calibration_named, shipped_calibration
from meshplan.hardware_db.cluster import Cluster
from meshplan.hardware_db.errors import InputError
from meshplan.planner.builders import build_plan, build_serving_plan, priced
from meshplan.planner.plan import Plan, ServingEngine, ServingPlan, cost_model_digest, first_difference, plan_config
from meshplan.planner.serve import pinned_deployment

__all__ = ["Rederived", "plan_residual_table", "planned_hardware", "rederive"]

RELATIVE = 1e-6  # beyond the rounding of a float written to JSON and read back


@dataclass(frozen=True)
class Rederived:
    """A plan as read, with figures this cost model computed; `repriced` says what changed (None: nothing did, or
    not re-simulated: see `note`); `simulated` is the training plan's timeline, for tables and traces."""

    plan: Plan | ServingPlan
    simulated: Simulated | None = None
    repriced: str | None = None
    note: str | None = None


def rederive(plan: Plan | ServingPlan, origin: str) -> Rederived:
    """The plan with every figure recomputed from its inputs and layout; InputError (one line naming `origin`, the
    field and the recomputed value) when this cost model made the plan and a figure disagrees."""
    fresh: Plan | ServingPlan
    simulated: Simulated | None = None
    hardware = planned_hardware(plan)
    if hardware is None:
        return Rederived(plan, note=f"made with calibration {plan.inputs.calibration}, which the file does not hold: "
                                    f"its prediction is shown as stored, not re-simulated")
    if isinstance(plan, ServingPlan):
        fresh = _serving(plan, origin, *hardware)
    else:
        fresh, simulated = _training(plan, *hardware)
    difference = first_difference(_figures(fresh), _figures(plan), rel_tol=RELATIVE)
    if difference is None:
        return Rederived(plan, simulated)
    where, stored, now = difference
    if plan.cost_model == cost_model_digest():
        command = "serve" if isinstance(plan, ServingPlan) else "plan"
        raise InputError(f"{origin}: invalid plan: '{where}' is {_shown(stored)}, but the plan's own inputs and "
                         f"layout give {_shown(now)}; re-run `meshplan {command}` instead of editing a plan")
    made_by = f"cost model {plan.cost_model}" if plan.cost_model else "a meshplan that did not record its cost model"
    return Rederived(fresh, simulated, repriced=(
        f"re-priced: {origin} was made by {made_by}; this one ({cost_model_digest()}) gives {where} {_shown(now)} "
        f"where the file has {_shown(stored)}"))


def planned_hardware(plan: Plan | ServingPlan) -> tuple[Cluster, Efficiency | None] | None:
    """The plan's cluster and efficiency model as it was planned: the GPU's defaults, or the public calibration or
    (a serving plan) the engine calibration it records (shipped with meshplan, so not in the file); None under any
    other calibration, which the file does not hold."""
    cluster = plan.inputs.cluster.cluster()
    if plan.inputs.calibration is None:
        return cluster, None
    engine = engine_calibration_named(plan.inputs.calibration) if isinstance(plan, ServingPlan) else None
    if engine is not None:
        return engine_calibrated_cluster(cluster.spec, engine, f"engine-{engine.engine}")
    shipped = shipped_calibration(plan.inputs.calibration)
    return None if shipped is None else factor_cluster(cluster.spec, shipped, f"public-{shipped.gpu}")


def plan_residual_table(plan: Plan | ServingPlan) -> ResidualTable | None:
    """The shipped residuals that describe the model a plan was priced with (Efficiency.residual_table): the
    defaults', the public calibration's, or None under a calibration of the user's own."""
    hardware = planned_hardware(plan)
    if hardware is None:
        return None
    return "defaults" if hardware[1] is None else hardware[1].residual_table


def _training(plan: Plan, cluster: Cluster, eff: Efficiency | None) -> tuple[Plan, Simulated]:
    """The plan simulated again on `cluster` with `eff` (planned_hardware)."""
    model, _, workload, config, runtime = plan_config(plan)
    sim = simulate_config(model, cluster, workload, config, runtime, eff)
    built = build_plan(model, cluster, workload, config, sim, runtime, calibration=eff.calibration if eff else None)
    fresh = plan.model_copy(update={"memory": built.memory, "prediction": built.prediction,
                                    "cost_model": cost_model_digest(), "economics": None})
    if plan.economics is not None:
        fresh = priced(fresh, plan.economics.budget(model.total_params()))
    return fresh, sim


def _serving(plan: ServingPlan, origin: str, cluster: Cluster, eff: Efficiency | None) -> ServingPlan:
    """The deployment of the plan's engines (layouts, counts, batches, memory fraction) priced again on `cluster`
    with `eff` (planned_hardware); a layout the model cannot take (ep on a dense model, tp that does not divide the
    heads) is refused as a training layout is."""
    inputs = plan.inputs
    model = inputs.model_spec()
    decode = plan.engines[-1]
    prefill: ServingEngine | None = plan.engines[0] if plan.mode == "disaggregated" else None
    try:
        best = pinned_deployment(
            model, cluster, inputs.workload, inputs.targets, _layout(decode), decode.engines, decode.max_num_seqs,
            _layout(prefill) if prefill else None, prefill.engines if prefill else None,
            prefill.max_num_seqs if prefill else None, eff=eff, mem_fraction=decode.gpu_memory_utilization,
            chunk=decode.max_num_batched_tokens)
    except InputError as exc:
        raise InputError(f"{origin}: invalid plan: engines: {exc}") from None
    built = build_serving_plan(model, cluster, inputs.workload, inputs.targets, best,
                               calibration=eff.calibration if eff else None)
    fresh = plan.model_copy(update={"engines": built.engines, "prediction": built.prediction,
                                    "cost_model": cost_model_digest(), "economics": None})
    if plan.economics is not None:
        fresh = priced(fresh, Budget(plan.economics.usd_per_gpu_hour))
    return fresh


def _layout(engine: ServingEngine) -> EngineLayout:
    return EngineLayout(tp=engine.tp, dp=engine.dp, pp=engine.pp, ep=engine.ep)


def _figures(plan: Plan | ServingPlan) -> dict[str, Any]:
    """The sections re-derivation recomputes, as JSON values."""
    names = ("prediction", "engines", "economics") if isinstance(plan, ServingPlan) else (
        "prediction", "memory", "economics")
    dumped = plan.model_dump(mode="json", include=set(names))
    return {name: dumped.get(name) for name in names}


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    text = " ".join(str(value).split()) if not isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."
