"""The test oracle of the partition solvers (planner/partition/): every composition of L layers into p stages, with
every stage policy, evaluated by the same float evaluation the solvers' results come out of."""

from __future__ import annotations

import itertools

from meshplan.planner.partition import (GRANULARITIES, TIE_RTOL, Granularity, PartitionProblem, PartitionResult,
                                        policy_options)
from meshplan.planner.partition.terms import _evaluate, _tables


def brute_force(problem: PartitionProblem, per_stage: bool = False,
                policy: Granularity = "none") -> PartitionResult | None:
    """Best partition by enumerating every composition of L into p parts and, with per_stage, every stage's policy
    (none, selective, full k = 1..n); without per_stage, `policy` on every stage ("full": all its layers). Small
    instances only (L <= 12). Ties within TIE_RTOL go to the lexicographically smallest boundaries (then policies in
    the order none, selective, full k = 1, 2, ...)."""
    num_layers, stages = problem.num_layers, problem.num_stages
    assert num_layers <= 12, "brute force is for small instances"
    if policy not in GRANULARITIES:
        raise ValueError(f"policy must be one of {GRANULARITIES}, got {policy!r}")
    tables = _tables(problem)
    found = []
    for cuts in itertools.combinations(range(1, num_layers), stages - 1):
        bounds = (0, *cuts, num_layers)
        options = [policy_options(bounds[r + 1] - bounds[r], per_stage, policy) for r in range(stages)]
        for pols in itertools.product(*options):
            res = _evaluate(problem, tables, bounds, pols, relaxed=False)
            if res is not None:
                found.append(res)
    if not found:
        return None
    best = min(res.objective for res in found)
    return next(res for res in found if res.objective <= best + TIE_RTOL * abs(best))
