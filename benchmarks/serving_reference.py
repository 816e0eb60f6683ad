"""The serving reference set (issue 19): every measured deployment of benchmarks/serving_reference.yaml priced by
meshplan's serving model with its published layout, precision, request lengths and load, against what was measured.

Usage:  python benchmarks/serving_reference.py [--markdown] [--check] [FILE]

How each load is priced (costmodels/serving_load.py):
- offline (every request queued at once): the engine's best throughput over batches and budgets that fit;
- concurrency N (closed loop): with `rounds` R (a run of N x R requests started from an idle engine, as the entry's
  client ran it), one attention group per engine: that run simulated iteration by iteration
  (serving_sim.simulate_benchmark); otherwise aggregated, N users in steady state (concurrency_point);
  disaggregated, the prefill pool at the busy fraction the users' rate gives it and the decode engines at
  N / engines running sequences;
- request_rate R (open loop, Poisson): the running sequences whose rate is R (rate_point), means and p99;
- batch B (a decode engine at a fixed batch): one decode step; prompts K (a prefill engine): one prefill batch.
The token budget is the entry's `chunk` or 8,192 (the default of vLLM's online server, SGLang and TensorRT-LLM).
Errors are predicted / measured - 1; the summary is the median absolute error per metric. Targets (issue 19):
TPOT and throughput <= 15 %, TTFT <= 25 %. No parameter is fitted to these entries.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402
from pydantic import BaseModel, ConfigDict, Field, ValidationError  # noqa: E402

from meshplan.costmodels.model_io import load_model  # noqa: E402
from meshplan.costmodels.serving import (EngineLayout, EngineState, ServeWorkload, aggregated_state,  # noqa: E402
                                         decode_state, prefill_state)
from meshplan.costmodels.serving_load import (closed_loop_ttft, concurrency_point, rate_point,  # noqa: E402
                                              saturated_point)
from meshplan.costmodels.serving_sim import simulate_benchmark  # noqa: E402
from meshplan.hardware_db.cluster import Cluster, ClusterSpec, engine_cluster  # noqa: E402
from meshplan.planner.serve import BATCHES, CHUNKS  # noqa: E402

DEFAULT_FILE = ROOT / "benchmarks" / "serving_reference.yaml"
DEFAULT_CHUNK = 8192
TARGETS = {"tpot": 0.15, "throughput": 0.15, "ttft": 0.25}


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Source(_Strict):
    url: list[str] = Field(min_length=1)
    where: str | None = None
    figure: list[str] = Field(min_length=1)


class Layout(_Strict):
    tp: int = Field(ge=1)
    dp: int = Field(ge=1)
    pp: int = Field(ge=1)
    ep: int = Field(ge=1)

    def engine(self) -> EngineLayout:
        return EngineLayout(tp=self.tp, dp=self.dp, pp=self.pp, ep=self.ep)


class Load(_Strict):
    offline: bool = False
    concurrency: int | None = Field(default=None, ge=1)
    request_rate: float | None = Field(default=None, gt=0)
    batch: int | None = Field(default=None, ge=1)
    prompts: int | None = Field(default=None, ge=1)
    rounds: int | None = Field(default=None, ge=1)  # a closed-loop run from idle: concurrency x rounds requests


class Measured(_Strict):
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    ttft_p99_ms: float | None = Field(default=None, gt=0)
    tpot_p99_ms: float | None = Field(default=None, gt=0)
    output_tokens_per_s: float | None = Field(default=None, gt=0)
    output_tokens_per_s_per_node: float | None = Field(default=None, gt=0)
    input_tokens_per_s_per_node: float | None = Field(default=None, gt=0)
    statistic: str | None = None


class Entry(_Strict):
    id: str
    source: Source
    framework: str
    model: str
    gpu: str
    gpus: int = Field(ge=1)
    mode: Literal["aggregated", "disaggregated", "prefill", "decode"]
    engine: Layout
    engines: int = Field(ge=1)
    prefill_engine: Layout | None = None
    prefill_engines: int | None = Field(default=None, ge=1)
    weight_dtype: Literal["bf16", "fp8", "fp4"]
    kv_dtype: Literal["bf16", "fp8"]
    isl: int = Field(ge=1)
    osl: int = Field(ge=1)
    lengths: Literal["fixed", "dataset"]
    lengths_source: Source | None = None
    load: Load
    chunk: int | None = Field(default=None, ge=1)
    two_batch_overlap: bool = False
    measured: Measured
    assumed: list[str] = []


def load_entries(path: Path) -> list[Entry]:
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    entries = [Entry.model_validate(d) for d in data]
    ids = [e.id for e in entries]
    if len(set(ids)) != len(ids):
        raise ValueError("duplicate ids: " + ", ".join(sorted({i for i in ids if ids.count(i) > 1})))
    return entries


# ---- pricing -------------------------------------------------------------------------------------------------------

def _workload(e: Entry) -> ServeWorkload:
    spread = 1.0 if e.lengths == "dataset" else 0.0  # a dataset's spread taken as exponential (the entry says so)
    return ServeWorkload(isl=e.isl, osl=e.osl, weight_dtype=e.weight_dtype, kv_dtype=e.kv_dtype, isl_cv2=spread,
                         osl_cv2=spread, two_batch_overlap=e.two_batch_overlap)


def _curve(model, c: Cluster, lay: EngineLayout, wl: ServeWorkload, chunk: int) -> list[EngineState]:
    grid = sorted({b * lay.dp for b in BATCHES} if model.moe is not None else set(BATCHES))
    states = []
    for b in grid:
        s = aggregated_state(model, c, lay, wl, b, chunk)
        if s is None:
            break
        states.append(s)
    return states


def price(e: Entry) -> dict[str, float]:
    """The predicted figures of an entry's measured metrics (same keys); {} when it cannot be priced."""
    model = load_model(e.model)
    wl = _workload(e)
    lay = e.engine.engine()
    lay.check(model)
    whole = Cluster(ClusterSpec(gpu=e.gpu, num_gpus=e.gpus))
    c = engine_cluster(whole, lay.gpus)
    chunk = e.chunk or DEFAULT_CHUNK
    per_node = whole.gpus_per_node
    nodes = lay.gpus / per_node if lay.gpus >= per_node else 1.0
    out: dict[str, float] = {}
    if e.mode == "prefill":
        s = prefill_state(model, c, lay, wl, e.load.prompts or lay.dp, crosses_nodes=True)
        if s is not None:
            out["input_tokens_per_s_per_node"] = s.batch * wl.isl / s.step_s / nodes
        return out
    if e.mode == "decode":
        s = decode_state(model, c, lay, wl, e.load.batch or lay.dp)
        if s is not None:
            out["output_tokens_per_s_per_node"] = s.batch / s.step_s / nodes
        return out
    if e.mode == "disaggregated":
        return _disaggregated(e, model, whole, wl)
    if e.load.offline:
        best = None
        for ch in CHUNKS:
            p = saturated_point(_curve(model, c, lay, wl, ch), wl)
            if p is not None and (best is None or p.requests_per_s > best.requests_per_s):
                best = p
        if best is not None:
            out["output_tokens_per_s"] = e.engines * best.requests_per_s * wl.osl
        return out
    if e.load.concurrency is not None and e.load.rounds is not None and lay.dp == 1:
        return _benchmarked(e, model, c, lay, wl, chunk)
    if e.load.concurrency is not None:
        users = max(1, round(e.load.concurrency / e.engines))
        p = concurrency_point(model, c, lay, wl, users, chunk, None)
        if p is not None:
            out.update(ttft_ms=p.ttft_s * 1e3, tpot_ms=p.tpot_s * 1e3,
                       output_tokens_per_s=e.engines * p.requests_per_s * wl.osl)
        return out
    if e.load.request_rate is not None:
        curve = _curve(model, c, lay, wl, chunk)
        rate = e.load.request_rate / e.engines
        mean, p99 = rate_point(curve, rate, wl, None), rate_point(curve, rate, wl, 0.99)
        if mean is not None and p99 is not None:
            out.update(ttft_ms=mean.ttft_s * 1e3, tpot_ms=mean.tpot_s * 1e3, ttft_p99_ms=p99.ttft_s * 1e3,
                       tpot_p99_ms=p99.tpot_s * 1e3, output_tokens_per_s=e.load.request_rate * wl.osl)
        return out
    return out


def _benchmarked(e: Entry, model, c: Cluster, lay: EngineLayout, wl: ServeWorkload, chunk: int) -> dict[str, float]:
    """A closed-loop run from idle as its client measured it (serving_sim.simulate_benchmark): every engine gets
    its share of the users; the engine holds the largest batch up to that share that fits, the rest wait."""
    assert e.load.concurrency is not None and e.load.rounds is not None
    users = max(1, round(e.load.concurrency / e.engines))
    curve = []
    for b in sorted({b for b in BATCHES if b < users} | {users}):
        s = aggregated_state(model, c, lay, wl, b, chunk)
        if s is None:
            break
        curve.append(s)
    if not curve:
        return {}
    run = simulate_benchmark(curve, wl, users, e.load.rounds)
    return {"ttft_ms": run.ttft(None) * 1e3, "tpot_ms": run.tpot(None) * 1e3,
            "output_tokens_per_s": e.engines * run.requests_per_s * wl.osl}


def _disaggregated(e: Entry, model, whole: Cluster, wl: ServeWorkload) -> dict[str, float]:
    """Closed-loop users over x prefill and y decode engines (serving_load.closed_loop_ttft); TPOT is the decode
    step at N / y sequences."""
    assert e.prefill_engine is not None and e.load.concurrency is not None
    pre_lay, dec_lay = e.prefill_engine.engine(), e.engine.engine()
    pre = prefill_state(model, engine_cluster(whole, pre_lay.gpus), pre_lay, wl, pre_lay.dp, crosses_nodes=True)
    dec = decode_state(model, engine_cluster(whole, dec_lay.gpus), dec_lay, wl,
                       max(dec_lay.dp, round(e.load.concurrency / e.engines)))
    if pre is None or dec is None:
        return {}
    ttft = closed_loop_ttft(pre, dec, e.load.concurrency, e.prefill_engines or 1, wl)
    if ttft is None:  # the prefill pool cannot keep up: TTFT unpriced
        return {"tpot_ms": dec.step_s * 1e3}
    return {"ttft_ms": ttft * 1e3, "tpot_ms": dec.step_s * 1e3}


# ---- report ----------------------------------------------------------------------------------------------------------

def _kind(metric: str) -> str:
    return "ttft" if metric.startswith("ttft") else "tpot" if metric.startswith("tpot") else "throughput"


def rows(entries: list[Entry]) -> list[tuple[str, str, float, float | None]]:
    """(entry id, metric, measured, predicted or None)."""
    out = []
    for e in entries:
        predicted = price(e)
        for metric, value in e.measured.model_dump(exclude_none=True).items():
            if metric == "statistic":
                continue
            out.append((e.id, metric, float(value), predicted.get(metric)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", nargs="?", type=Path, default=DEFAULT_FILE)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--check", action="store_true", help="only validate the data file")
    args = ap.parse_args()
    try:
        entries = load_entries(args.file)
    except (OSError, ValueError, ValidationError, yaml.YAMLError) as exc:
        print(f"error: {args.file}: {exc}".splitlines()[0], file=sys.stderr)
        return 2
    if args.check:
        print(f"{args.file}: {len(entries)} entries, valid")
        return 0
    table = rows(entries)
    errors: dict[str, list[float]] = {"ttft": [], "tpot": [], "throughput": []}
    if args.markdown:
        print("| entry | metric | measured | predicted | error |")
        print("| --- | --- | ---: | ---: | ---: |")
    for eid, metric, measured, predicted in table:
        err = None if predicted is None or not math.isfinite(predicted) else predicted / measured - 1
        if err is not None and not metric.endswith("p99_ms"):
            errors[_kind(metric)].append(err)
        shown = "not priced" if predicted is None else f"{predicted:,.4g}"
        e_txt = "" if err is None else f"{err:+.0%}"
        if args.markdown:
            print(f"| {eid} | {metric} | {measured:,.4g} | {shown} | {e_txt} |")
        else:
            print(f"{eid:62s} {metric:30s} {measured:>12,.4g} {shown:>12s} {e_txt:>7s}")
    priced = {eid for eid, _, _, p in table if p is not None}
    print(f"\n{len(entries)} entries, {len(priced)} priced; median absolute error (means, p99 rows excluded), and "
          "the median signed error (< 0: the model is optimistic for TTFT and TPOT, pessimistic for throughput):")
    ok = True
    for kind, errs in errors.items():
        if errs:
            med = statistics.median(abs(x) for x in errs)
            ok &= med <= TARGETS[kind]
            print(f"  {kind}: {med:.1%} over {len(errs)} figures (target <= {TARGETS[kind]:.0%}); signed "
                  f"{statistics.median(errs):+.1%}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
