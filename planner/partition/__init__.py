"""Pipeline stage partitioning: which contiguous decoder layers each pipeline rank runs, and what it recomputes.

The objective J is a lower bound on the event-simulated step time (costmodels/pipeline.py) that is tight when no
stage stalls (meshplan docs/cost_model.md, pipeline bounds). Two solvers minimise it over the same feasible set:
solve_dp (exact, one recomputation policy on every stage) and solve_cpsat (OR-Tools CP-SAT, also per-stage
policies); tests/partition_oracle.py enumerates it (the test oracle). All results come out of one float evaluation,
evaluate().

One file per concern: problem.py (the inputs and the result), terms.py (the per-stage terms and evaluate),
dynamic.py (the exact DPs and memory feasibility), cpsat.py (the CP-SAT model), bounds.py (the 1F1B sync-path bounds
and the partitions below a threshold).
"""

from typing import Any

from meshplan.planner.partition.bounds import (pair_terms, partitions_below, per_stage_partitions_below,
                                               per_stage_tight_bound, rank0_path_sync_bound, solve_dp_pairs,
                                               solve_rank0_path_sync, solve_stage0_sync, stage0_sync_bound)
from meshplan.planner.partition.dynamic import dp_bound, may_fit, per_stage_bound, solve_dp
from meshplan.planner.partition.problem import (CP_POLICIES, GRANULARITIES, SCHEDULES, TIE_RTOL, CpPolicies,
                                                Granularity, PartitionProblem, PartitionResult, Schedule, SyncModel)
from meshplan.planner.partition.terms import evaluate, policy_options

__all__ = ["CP_POLICIES", "GRANULARITIES", "SCHEDULES", "TIE_RTOL", "CpPolicies", "Granularity", "PartitionProblem",
           "PartitionResult", "Schedule", "SyncModel", "cpsat_tolerance_s", "dp_bound", "evaluate", "may_fit",
           "pair_terms", "partitions_below", "per_stage_bound", "per_stage_partitions_below", "per_stage_tight_bound",
           "policy_options", "rank0_path_sync_bound", "solve_cpsat", "solve_dp", "solve_dp_pairs",
           "solve_rank0_path_sync", "solve_stage0_sync", "stage0_sync_bound"]


def __getattr__(name: str) -> Any:
    """solve_cpsat and cpsat_tolerance_s load OR-Tools (cpsat.py) when first asked for: estimate, profile and verify
    never need it (a GPU image carrying only the runtime's wheels runs them without ortools)."""
    if name in ("solve_cpsat", "cpsat_tolerance_s"):
        from meshplan.planner.partition import cpsat

        return getattr(cpsat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
