"""Plans side by side: the knobs that differ, the predicted time and its terms, memory per stage and cost, and why
the fastest wins (the breakdown terms that differ most). Training plans only; each plan is read as it was written
(its own prediction), so plans from different inputs compare as their files say."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from meshplan.costmodels.uncertainty import DEFAULT_LEVEL, MEMORY_LEVEL, ResidualTable, lead_is_significant, lead_note

from meshplan.hardware_db.errors import InputError
from meshplan.planner.plan import Plan
from meshplan.planner.rederive import plan_residual_table

__all__ = ["Comparison", "compare_plans"]

# the knobs a reader changes, in the order they read (Layout fields, then the plan's inputs)
LAYOUT_KNOBS = ("tp", "cp", "cp_comm", "pp", "vpp", "dp", "ep", "etp", "mbs", "num_microbatches", "zero", "sp",
                "recompute", "offload_layers", "schedule", "stage_layers")


@dataclass(frozen=True)
class Row:
    label: str
    values: tuple[str, ...]


@dataclass(frozen=True)
class Comparison:
    names: tuple[str, ...]
    knobs: tuple[Row, ...]  # only the knobs whose values differ
    metrics: tuple[Row, ...]
    verdict: tuple[str, ...]


def _knob_value(doc: Plan, knob: str) -> str:
    value = getattr(doc.prediction.layout, knob)
    if isinstance(value, tuple):
        return "-".join(map(str, value))
    return str(value).lower() if isinstance(value, bool) else str(value)


def _inputs(doc: Plan) -> dict[str, str]:
    wl, cl = doc.inputs.workload, doc.inputs.cluster
    return {"model": doc.inputs.model_spec().name, "gpu": cl.gpu, "gpus": str(cl.num_gpus),
            "global batch": str(wl.global_batch), "seq": str(wl.seq_len), "dtype": wl.dtype,
            "runtime": doc.prediction.runtime, "calibration": doc.inputs.calibration or "none"}


def _differing(docs: Sequence[Plan]) -> tuple[Row, ...]:
    rows = []
    keys = list(_inputs(docs[0]))
    for key in keys:
        values = tuple(_inputs(d)[key] for d in docs)
        if len(set(values)) > 1:
            rows.append(Row(key, values))
    moe = any(d.prediction.layout.ep > 1 or d.inputs.model_spec().moe is not None for d in docs)
    for knob in LAYOUT_KNOBS:
        if knob == "etp" and not moe:
            continue
        values = tuple(_knob_value(d, knob) for d in docs)
        if len(set(values)) > 1:
            rows.append(Row(knob, values))
    return tuple(rows)


def _metrics(docs: Sequence[Plan]) -> tuple[Row, ...]:
    def row(label: str, fmt: str, values: Sequence[float | None]) -> Row:
        return Row(label, tuple("-" if v is None else format(v, fmt) for v in values))

    preds = [d.prediction for d in docs]
    ranges = Row(f"  {100 * DEFAULT_LEVEL:.0f} % range, s", tuple("-" if p.interval is None else
                                          "-".join(f"{t:.3f}" for t in p.interval.step_time_s) for p in preds))
    rows = [row("step time, s", ".3f", [p.step_time_s for p in preds]), ranges,
            row("tokens/s", ",.0f", [p.tokens_per_s for p in preds]),
            row("tokens/s/GPU", ",.0f", [p.tokens_per_s_per_gpu for p in preds]),
            row("MFU, %", ".1f", [100 * p.mfu for p in preds]),
            row("bubble, %", ".1f", [100 * p.bubble_fraction for p in preds]),
            Row("fits", tuple("yes" if p.fits else "NO" for p in preds))]
    terms = list(dict.fromkeys(k for p in preds for k in p.breakdown_s))
    rows += [row(f"  {t}, s", ".3f", [p.breakdown_s.get(t, 0.0) for p in preds]) for t in terms]
    rows.append(row("peak memory, GiB", ".1f", [p.peak_memory_gib for p in preds]))
    if any(p.memory_range is not None for p in preds):  # plans written before the memory range have none
        rows.append(Row(f"  {100 * MEMORY_LEVEL:.0f} % range, GiB", tuple("-" if p.memory_range is None else
                                                     "-".join(f"{g:.1f}" for g in p.memory_range.peak_gib)
                                                     for p in preds)))
        rows.append(Row("  memory verdict", tuple("-" if p.memory_range is None else p.memory_range.verdict
                                                  for p in preds)))
    stages = max(len(d.memory.stages) for d in docs)
    rows += [row(f"  stage {i}, GiB", ".1f", [d.memory.stages[i].peak_gib if i < len(d.memory.stages) else None
                                               for d in docs]) for i in range(stages)]
    costs = [d.economics for d in docs]
    rows.append(row("$/hour", ",.2f", [c.usd_per_hour if c else None for c in costs]))
    rows.append(row("$/M tokens", ".3f", [c.usd_per_million_tokens if c else None for c in costs]))
    if any(c is not None and c.expected_s is not None for c in costs):
        rows.append(row("days to train", ",.1f", [c.expected_s / 86400 if c and c.expected_s else None
                                                   for c in costs]))
        rows.append(row("total $", ",.0f", [c.total_usd if c else None for c in costs]))
    return tuple(rows)


def _verdict(docs: Sequence[Plan], names: Sequence[str]) -> tuple[str, ...]:
    """The fastest plan that fits (by tokens/s: plans of different batches compare per token), and per other plan
    how much slower it is and the terms that make most of the difference."""
    fitting = [i for i, d in enumerate(docs) if d.prediction.fits]
    if not fitting:
        return ("none of the plans fits in memory",)
    win = max(fitting, key=lambda i: docs[i].prediction.tokens_per_s)
    best = docs[win].prediction
    lines = []
    for i, d in enumerate(docs):
        if i == win:
            continue
        p = d.prediction
        if not p.fits:
            lines.append(f"{names[i]} does not fit ({p.peak_memory_gib:.1f} of {p.hbm_gib:.0f} GiB)")
            continue
        slower = best.tokens_per_s / p.tokens_per_s - 1
        terms = set(best.breakdown_s) | set(p.breakdown_s)
        diff = sorted(((p.breakdown_s.get(t, 0.0) - best.breakdown_s.get(t, 0.0), t) for t in terms),
                      key=lambda x: -abs(x[0]))
        why = ", ".join(f"{t} {'+' if dt >= 0 else '-'}{abs(dt):.3f} s" for dt, t in diff[:3] if abs(dt) > 1e-9)
        same = _inputs(d) == _inputs(docs[win])
        lines.append(f"{names[win]} makes {slower:.1%} more tokens/s than {names[i]}"
                     + (f"; per step {names[i]} spends {why}" if why and same else "")
                     + ("" if same else " (their inputs differ: see the rows above)")
                     + (_noise(best.tokens_per_s, p.tokens_per_s, plan_residual_table(docs[win])) if same else ""))
    return (f"fastest: {names[win]}",) + tuple(lines)


def _noise(faster: float, slower: float, table: ResidualTable | None) -> str:
    """Where a lead between two layouts of the same inputs is within the model's error on such a pair
    (costmodels/uncertainty.py lead_note), in the residuals of the model that priced them; nothing under a
    calibration whose errors no shipped table describes."""
    if table is None or lead_is_significant(faster, slower, table=table):
        return ""
    return f"; {lead_note(faster, slower, table=table)}"


def compare_plans(docs: Sequence[Plan], names: Sequence[str]) -> Comparison:
    if len(docs) < 2:
        raise InputError("compare needs two plans or more")
    return Comparison(tuple(names), _differing(docs), _metrics(docs), _verdict(docs, names))
