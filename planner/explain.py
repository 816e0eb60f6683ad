"""Why the best plan wins: where its step time goes compared with the runner-up, and what constraint binds."""

from __future__ import annotations

from meshplan.planner.search import RankedPlan, SearchResult

BINDING_MEMORY_FRACTION = 0.95  # a stage above this share of HBM is "memory-bound" for the explanation


def knob_diff(a: RankedPlan, b: RankedPlan) -> list[str]:
    """The knobs in which two plans differ, as 'name a -> b'."""
    la, lb = a.estimate.layout, b.estimate.layout
    out = []
    for name in ("tp", "cp", "pp", "vpp", "dp", "ep", "etp", "mbs", "zero", "recompute", "sp", "schedule", "cp_comm",
                 "rank_order", "stage_layers"):
        va, vb = getattr(la, name), getattr(lb, name)
        if name == "etp" and la.etp == la.tp and lb.etp == lb.tp:
            continue  # expert TP that just follows TP (every dense model) is not a knob of its own
        if va != vb:
            show = (lambda v: "-".join(map(str, v))) if name == "stage_layers" else str
            out.append(f"{name} {show(va)} -> {show(vb)}")
    return out


def explain(result: SearchResult) -> list[str]:
    """Plain sentences: the best plan's margin over the runner-up by time component, and the binding constraints."""
    lines: list[str] = []
    if not result.plans:
        return [result.why_nothing_fits or "no plan"]
    best = result.plans[0]
    est = best.estimate
    if len(result.plans) > 1:
        other = result.plans[1]
        diff = other.step_time_s - best.step_time_s
        lines.append(f"The best plan is {diff:.3f} s ({100 * diff / other.step_time_s:.2f} %) faster per step than "
                     f"the runner-up, which differs in: {', '.join(knob_diff(best, other)) or 'nothing but ties'}.")
        keys = sorted(set(est.breakdown_s) | set(other.estimate.breakdown_s))
        deltas = sorted(((other.estimate.breakdown_s.get(k, 0.0) - est.breakdown_s.get(k, 0.0), k) for k in keys),
                        reverse=True)
        gains = [f"{k} {d:+.3f} s" for d, k in deltas if d > 1e-6]
        losses = [f"{k} {d:+.3f} s" for d, k in deltas if d < -1e-6]
        if gains:
            lines.append("The runner-up spends more on: " + ", ".join(gains) + ".")
        if losses:
            lines.append("The best plan spends more on: " + ", ".join(losses) + " (outweighed).")
    else:
        lines.append("Only one plan was found (the rest of the space was infeasible or pinned away).")
    # What binds: memory on a stage, the pipeline's slowest stage, exposed communication.
    peak_stage = max(est.stages, key=lambda s: s.peak_gib)
    share = peak_stage.peak_gib / est.hbm_gib
    if share >= BINDING_MEMORY_FRACTION:
        lines.append(f"Memory binds: stage {peak_stage.rank} uses {peak_stage.peak_gib:.1f} of {est.hbm_gib:.0f} GiB "
                     f"({100 * share:.0f} %); a faster plan without recomputation or with a larger micro-batch does "
                     f"not fit.")
    else:
        lines.append(f"Memory does not bind: the fullest stage ({peak_stage.rank}) uses {peak_stage.peak_gib:.1f} of "
                     f"{est.hbm_gib:.0f} GiB.")
    step = est.step_time_s
    top = sorted(((v, k) for k, v in est.breakdown_s.items() if k != "compute"), reverse=True)[:2]
    lines.append(f"Compute is {100 * est.breakdown_s.get('compute', 0.0) / step:.0f} % of the step; the largest "
                 f"overheads are " + ", ".join(f"{k} {100 * v / step:.1f} %" for v, k in top) + ".")
    lay = est.layout
    if lay.pp > 1 and len(set(lay.stage_layers)) > 1:
        lines.append(f"The stages are uneven ({'-'.join(map(str, lay.stage_layers))} layers): the embedding and "
                     f"the LM head make the edge stages heavier, and the first stages hold more micro-batches "
                     f"under 1F1B.")
    acc = result.account
    if acc.status == "optimal":
        lines.append("Optimality: proven over the stated space (every other candidate's lower bound is at least "
                     "the best time, or it does not fit).")
    else:
        lines.append(f"Optimality: {acc.status}, proven gap {100 * acc.gap:.2f} % (lower bound "
                     f"{acc.lower_bound_s:.3f} s).")
    return lines
