"""The serving search: engine layouts (TP, attention DP, PP, EP), batch and chunk sizes, aggregated or
disaggregated prefill and decode pools, under TTFT and TPOT targets. What one engine costs in steady state is the
serving cost model's (costmodels/serving.py: its states; costmodels/serving_load.py: at a load).

Aggregated engines batch decode and chunked prefill in every iteration (Sarathi-Serve, Agrawal et al. OSDI'24): an
iteration holds B decode tokens and the prefill that keeps pace with them, and the token budget
(max_num_batched_tokens) must hold both; a new request gets the budget left by the decode tokens until its prompt
is in. Disaggregated deployments
(DistServe, Zhong et al. OSDI'24; DeepSeek-V3 report sec. 3.4) run prefill engines (batches of prompts, TTFT = the
batch's prefill + the KV transfer) and decode engines (TPOT = one decode iteration), x of one for y of the other so
that the request rates balance. Every engine runs below its cap of running sequences, at a load whose queueing
delays (costmodels/queueing.py) the targets bound at their percentile.
"""

from __future__ import annotations

import functools
import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

import numpy as np

from meshplan.costmodels.deadline import cpu_now
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.queueing import Percentile
from meshplan.costmodels.serving import (MEM_FRACTION, EngineGeometry, EngineLayout, EngineState, PoolPoint,
                                         ServeDtype, ServeEngine, ServeObjective, ServeTargets, ServeWorkload,
                                         WeightDtype, aggregated_state, decode_state, engine_geometry, prefill_state,
                                         redundant_experts)
from meshplan.costmodels.serving_load import loaded_points
from meshplan.hardware_db.cluster import Cluster, engine_cluster
from meshplan.hardware_db.errors import InputError

__all__ = ["Deployment", "ServeResult", "engine_layouts", "search_serving", "pareto_front", "CHUNKS"]

CHUNKS = (2048, 4096, 8192, 16384, 32768)  # max_num_batched_tokens tried (vLLM's default is 8192 for online serving)
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


@dataclass(frozen=True)
class Deployment:
    """Engines of one or two pools and what they deliver together."""

    mode: Literal["aggregated", "disaggregated"]
    pools: tuple[tuple[PoolPoint, int], ...]  # (engine configuration, engines)
    ttft_s: float
    tpot_s: float
    requests_per_s: float
    output_tokens_per_s: float
    gpus: int

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.output_tokens_per_s / self.gpus

    @property
    def tokens_per_s_per_user(self) -> float:
        return 1.0 / self.tpot_s

    def e2e_s(self, osl: int) -> float:
        return self.ttft_s + osl * self.tpot_s

    def label(self) -> str:
        """Names the deployment and its load: one engine configuration runs at several loads (serving_load
        loaded_points), each with its own figures, so the label says which (rN: N sequences running on average;
        N% busy: a prefill engine's share of time at work)."""
        parts = []
        for p, n in self.pools:
            role = {"aggregated": "", "prefill": "prefill ", "decode": "decode "}[p.role]
            chunk = f" c{p.chunk}" if p.role == "aggregated" else ""
            load = f" {p.load:.0%} busy" if p.role == "prefill" else f" r{p.load * p.batch:.0f}"
            parts.append(f"{n}x {role}{p.layout.label()} b{p.batch}{load}{chunk}")
        return " + ".join(parts)


@dataclass(frozen=True)
class ServeResult:
    best: Deployment | None
    pareto: tuple[Deployment, ...]  # tokens/s/GPU vs tokens/s/user, over every deployment evaluated
    ranked: tuple[Deployment, ...]  # meeting the targets, best first
    nearest_miss: Deployment | None  # when nothing meets the targets: the one that misses least
    why_nothing: str | None
    evaluated: int
    seconds: float
    layouts_skipped: int = 0  # engine layouts a time limit left unevaluated (the largest engines: sizes ascend)


# ---- engine layouts ------------------------------------------------------------------------------------------------

def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def trtllm_refusal(model: ModelSpec, tp: int, dp: int, ep: int) -> Literal["tp inside dp", "redundant experts"] | None:
    """Why TensorRT-LLM does not run an engine of these degrees as its export writes it, or None where it does: its
    attention DP makes every rank its own attention group (enable_attention_dp: attention TP 1,
    tensorrt_llm/mapping.py), and the export writes no redundant experts (planner/launchers/trtllm.py)."""
    if dp > 1 and tp > 1:
        return "tp inside dp"
    if model.moe is not None and redundant_experts(model.moe.num_experts, ep):
        return "redundant experts"
    return None


def engine_runs(engine: ServeEngine | None, model: ModelSpec, lay: EngineLayout) -> bool:
    """Whether `engine` runs the layout as its export writes it (None: any engine; trtllm_refusal)."""
    return engine != "trtllm" or trtllm_refusal(model, lay.tp, lay.dp, lay.ep) is None


def engine_layouts(model: ModelSpec, max_gpus: int, per_node: int,
                   engine: ServeEngine | None = None) -> list[EngineLayout]:
    """Every engine of at most `max_gpus` GPUs that fits in a node or fills whole nodes (`_engine_sizes`): TP a power
    of two dividing the heads, at most two nodes; pipeline stages of whole nodes (TP and attention DP inside a node,
    PP across nodes: how vLLM and SGLang deploy a model larger than a node; the cost model's PP has no bubble, so a
    single-node PP engine would only look better); for MoE models attention DP filling the stage and EP over every
    rank of it (expert TP 1) or off (experts tensor-parallel over the stage), EP beyond the experts meaning
    redundant experts (DeepSeek-V3's decode). `engine`: only the layouts it runs (engine_runs)."""
    out: list[EngineLayout] = []
    sizes = _engine_sizes(max_gpus, per_node)
    for size in sizes:
        for tp in (1, 2, 4, 8, 16, 32):
            if tp > size or size % tp or model.num_heads % tp or tp > 2 * per_node:
                continue
            for pp in (1, 2, 4, 8):
                if (size // tp) % pp or pp > model.num_layers or (pp > 1 and size // pp != per_node):
                    continue
                dp = size // (tp * pp)
                if model.moe is None:
                    if dp == 1:
                        out.append(EngineLayout(tp=tp, pp=pp))
                    continue
                for ep in sorted({1, tp * dp}):
                    lay = EngineLayout(tp=tp, dp=dp, pp=pp, ep=ep)
                    if _ep_ok(model, lay) and engine_runs(engine, model, lay):
                        out.append(lay)
    return out


# One engine (one model replica) spans at most this many nodes: the widest published deployments are DeepSeek-V3's
# decode engine of 18 nodes (144 H800, EP 144; DeepSeek, "Day 6: One More Thing, DeepSeek-V3/R1 Inference System
# Overview", 2025) and GB200 NVL72 wide-EP engines of one 72-GPU rack; 128 nodes is seven times the former.
MAX_ENGINE_NODES = 128


def _engine_sizes(max_gpus: int, per_node: int) -> list[int]:
    """GPUs per engine: the divisors of a node, every node count up to 16 nodes, every 8th to 64, then the powers
    of two and their halfway points (96, 128) up to MAX_ENGINE_NODES nodes (a deployment of 38 or 40 nodes per
    engine differs little). The sizes no longer grow with the cluster: 65,536 GPUs search as fast as 1,024."""
    small = [g for g in range(1, min(per_node, max_gpus) + 1) if per_node % g == 0]
    most = min(max_gpus // per_node, MAX_ENGINE_NODES)
    nodes = [k for k in range(1, most + 1)
             if k <= 16 or (k <= 64 and k % 8 == 0) or k in (96, 128)]
    return sorted(set(small + [k * per_node for k in nodes]))


def _ep_ok(model: ModelSpec, lay: EngineLayout) -> bool:
    moe = model.moe
    assert moe is not None
    if lay.ep == 1:
        return True
    return moe.num_experts % lay.ep == 0 or lay.ep >= moe.num_experts  # beyond E: redundant experts


# ---- deployments ---------------------------------------------------------------------------------------------------

def _aggregated(point: PoolPoint, engines: int, wl: ServeWorkload) -> Deployment:
    rate = engines * point.requests_per_s
    return Deployment("aggregated", ((point, engines),), point.ttft_s, point.tpot_s, rate, rate * wl.osl,
                      engines * point.layout.gpus)


def _disaggregated(pre: PoolPoint, x: int, dec: PoolPoint, y: int, wl: ServeWorkload) -> Deployment:
    rate = min(x * pre.requests_per_s, y * dec.requests_per_s)
    return Deployment("disaggregated", ((pre, x), (dec, y)), pre.ttft_s + dec.ttft_s, dec.tpot_s, rate, rate * wl.osl,
                      x * pre.layout.gpus + y * dec.layout.gpus)


def meets(d: Deployment, targets: ServeTargets, wl: ServeWorkload) -> bool:
    return _excess(d, targets, wl) <= 1.0


def _excess(d: Deployment, targets: ServeTargets, wl: ServeWorkload) -> float:
    """The largest measured / target ratio (<= 1: every target met)."""
    ratios = [0.0]
    if targets.ttft_ms is not None:
        ratios.append(d.ttft_s * 1e3 / targets.ttft_ms)
    if targets.tpot_ms is not None:
        ratios.append(d.tpot_s * 1e3 / targets.tpot_ms)
    if targets.e2e_ms is not None:
        ratios.append(d.e2e_s(wl.osl) * 1e3 / targets.e2e_ms)
    return max(ratios)


def misses(d: Deployment, targets: ServeTargets, wl: ServeWorkload) -> str:
    """What a deployment misses, in words ("" when it meets every target)."""
    out = []
    if targets.ttft_ms is not None and d.ttft_s * 1e3 > targets.ttft_ms:
        out.append(f"TTFT {d.ttft_s * 1e3:.0f} ms > {targets.ttft_ms:g}")
    if targets.tpot_ms is not None and d.tpot_s * 1e3 > targets.tpot_ms:
        out.append(f"TPOT {d.tpot_s * 1e3:.1f} ms > {targets.tpot_ms:g}")
    if targets.e2e_ms is not None and d.e2e_s(wl.osl) * 1e3 > targets.e2e_ms:
        out.append(f"end-to-end {d.e2e_s(wl.osl) * 1e3:.0f} ms > {targets.e2e_ms:g}")
    return ", ".join(out)


def pareto_front(deployments: list[Deployment]) -> tuple[Deployment, ...]:
    """The deployments no other beats on both tokens/s/GPU and tokens/s/user, by tokens/s/user."""
    front: list[Deployment] = []
    best_gpu = -1.0
    for d in sorted(deployments, key=lambda d: (-d.tokens_per_s_per_user, -d.tokens_per_s_per_gpu)):
        if d.tokens_per_s_per_gpu > best_gpu:
            front.append(d)
            best_gpu = d.tokens_per_s_per_gpu
    return tuple(front)


RATIO_ENGINES = 1024  # x or y engines at most in the smaller pool of an x:y ratio searched (see _ratio)


def _ratio(pre: PoolPoint, dec: PoolPoint, gpus: int) -> tuple[int, int] | None:
    """The x prefill : y decode engines within `gpus` with the most requests/s per GPU (rates balanced; ties to
    the fewest engines).

    For each count of one pool the other is its balanced count rounded down or up, and only these pairs can be
    best. Either pool's count is walked up to RATIO_ENGINES (not up to the budget, which made 65,536 GPUs take
    minutes): the rounding then costs at most 1/(2 x 1,024) of the per-GPU rate, and a larger deployment of the
    same ratio has the same per-GPU rate. One vectorised pass over all the pairs."""
    p_gpus, d_gpus, a, b = pre.layout.gpus, dec.layout.gpus, pre.requests_per_s, dec.requests_per_s
    ys = np.arange(1, min(gpus // d_gpus, RATIO_ENGINES) + 1, dtype=np.int64)
    xs = np.arange(1, min(gpus // p_gpus, RATIO_ENGINES) + 1, dtype=np.int64)
    need_x, need_y = ys * (b / a), xs * (a / b)
    x = np.concatenate([np.floor(need_x), np.ceil(need_x), xs, xs]).clip(min=1)
    y = np.concatenate([ys, ys, np.floor(need_y), np.ceil(need_y)]).clip(min=1)
    used = x * p_gpus + y * d_gpus
    ok = (used <= gpus) & (x <= gpus) & (y <= gpus)
    if not ok.any():
        return None
    x, y, used = x[ok], y[ok], used[ok]
    per_gpu = np.minimum(x * a, y * b) / used
    top = per_gpu >= per_gpu.max() * (1 - 1e-12)
    k = np.lexsort((y[top], x[top]))[0]  # the fewest prefill, then decode engines among the best
    return int(x[top][k]), int(y[top][k])


@dataclass(frozen=True)
class _LayoutPoints:
    aggregated: list[PoolPoint]
    prefill: list[PoolPoint]
    decode: list[PoolPoint]
    states: int  # engine states evaluated (an aggregated one times four iterations, the others one)


def _layout_points(model: ModelSpec, c: Cluster, lay: EngineLayout, wl: ServeWorkload, percentile: Percentile,
                   eff: Efficiency | None, mem_fraction: float, disaggregation: bool,
                   crosses_nodes: bool) -> _LayoutPoints:
    """One engine layout's states at every batch and budget that fit, and its points at the loads
    (serving_load.loaded_points): aggregated by budget, decode, and prefill by prompts per iteration."""
    by_chunk: dict[int, list[EngineState]] = {}
    dec: list[EngineState] = []
    pre: list[EngineState] = []
    geo = engine_geometry(model, c, lay, eff)  # the links and layers every state of the layout shares
    step = lay.dp if model.moe is not None else 1
    failed: dict[int, int] = {}  # chunk -> the first grid batch that did not fit
    dec_failed = None
    for batch in BATCHES:
        b = batch * step
        for chunk in (ch for ch in CHUNKS if ch - b * (1 + wl.spec_tokens) >= b * wl.computed_isl / wl.decode_steps):
            if chunk in failed:
                continue
            s = aggregated_state(model, c, lay, wl, b, chunk, eff, mem_fraction, geo)  # larger chunks: shorter TTFT
            if s is None:
                failed[chunk] = b
                continue
            by_chunk.setdefault(chunk, []).append(s)
        if disaggregation and dec_failed is None:
            d = decode_state(model, c, lay, wl, b, eff, mem_fraction, geo)
            if d is not None:
                dec.append(d)
            elif b > lay.dp:
                dec_failed = b  # a larger batch needs more memory still
    # the largest batch that fits is a candidate too, not only the grid's batch below it
    for chunk, curve in by_chunk.items():
        if chunk in failed:
            at = functools.partial(_aggregated_at, model, c, lay, wl, chunk, eff, mem_fraction, geo)
            curve += largest_between(curve[-1].batch, failed[chunk], step, at)
    if dec and dec_failed is not None:
        dec += largest_between(dec[-1].batch, dec_failed, step,
                               lambda b: decode_state(model, c, lay, wl, b, eff, mem_fraction, geo))
    if disaggregation:
        for prompts in (1, 2, 4, 8, 16, 32, 64):
            p = prefill_state(model, c, lay, wl, prompts * lay.dp, eff, crosses_nodes, mem_fraction, geo)
            if p is None:
                break
            pre.append(p)
    agg = [p for curve in by_chunk.values() for p in loaded_points(curve, wl, percentile)]
    states = sum(map(len, by_chunk.values())) + len(dec) + len(pre)
    return _LayoutPoints(agg, loaded_points(pre, wl, percentile), loaded_points(dec, wl, percentile), states)


def search_serving(model: ModelSpec, cluster: Cluster, wl: ServeWorkload, targets: ServeTargets,
                   min_gpus: int = 1, objective: ServeObjective = "throughput",
                   disaggregation: bool = True, eff: Efficiency | None = None, top: int = 5,
                   mem_fraction: float = MEM_FRACTION, time_limit_s: float | None = None,
                   engine: ServeEngine | None = None) -> ServeResult:
    """Every engine layout, batch and chunk within `cluster.num_gpus` GPUs (deployments using at least
    `min_gpus`), aggregated and disaggregated; the best under the targets by tokens/s/GPU (objective
    throughput) or by fewest GPUs for targets.request_rate (objective min-gpus). time_limit_s: stop taking engine
    layouts (smallest first) once it has passed (in CPU seconds: costmodels/deadline.py) and a deployment can be
    formed; layouts_skipped says how many. `engine`: only the engine layouts it runs (engine_runs)."""
    start, cpu_start = time.perf_counter(), cpu_now()
    if objective == "min-gpus" and targets.request_rate is None:
        raise InputError("objective min-gpus needs a request rate (--request-rate)")
    budget, per_node = cluster.num_gpus, cluster.gpus_per_node
    layouts = engine_layouts(model, budget, per_node, engine)
    if not layouts:
        raise InputError(f"no engine of at most {budget} GPUs can hold {model.name}'s heads and layers")
    evaluated = 0
    agg_points: list[PoolPoint] = []
    pre_points: list[PoolPoint] = []
    dec_points: list[PoolPoint] = []
    clusters: dict[int, Cluster] = {}
    skipped = 0
    for n, lay in enumerate(layouts):
        if (time_limit_s is not None and cpu_now() - cpu_start > time_limit_s
                and (agg_points or (pre_points and dec_points))):
            skipped = len(layouts) - n
            break
        if lay.gpus not in clusters:  # one cluster (and its link cache) per engine size
            clusters[lay.gpus] = engine_cluster(cluster, lay.gpus)
        c = clusters[lay.gpus]
        points = _layout_points(model, c, lay, wl, targets.percentile, eff, mem_fraction,
                                disaggregation, budget > per_node)
        evaluated += points.states
        agg_points += points.aggregated
        pre_points += points.prefill
        dec_points += points.decode
    deployments: list[Deployment] = []
    for p in agg_points:
        engines = budget // p.layout.gpus
        if engines * p.layout.gpus >= min_gpus:
            deployments.append(_aggregated(p, engines, wl))
    if disaggregation and pre_points and dec_points:
        deployments += _disaggregated_deployments(pre_points, dec_points, wl, targets, budget, min_gpus)
    if objective == "min-gpus":
        deployments = [_scaled_to_rate(d, targets.request_rate, wl) for d in deployments]  # type: ignore[arg-type]
        deployments = [d for d in deployments if min_gpus <= d.gpus <= budget]
    ok = [d for d in deployments if meets(d, targets, wl)]
    if objective == "min-gpus":
        ok.sort(key=lambda d: (d.gpus, -d.tokens_per_s_per_gpu))
    else:
        ok.sort(key=lambda d: -d.tokens_per_s_per_gpu)
    nearest = None if ok or not deployments else min(deployments, key=lambda d: _excess(d, targets, wl))
    why = None
    if not deployments:
        why = (f"no engine of at most {budget} GPUs holds {model.name} with a batch of ISL {wl.isl} + OSL "
               f"{wl.osl} tokens in {mem_fraction:.0%} of HBM; give more GPUs or shorter requests")
    elif not ok and nearest is not None:
        why = f"no deployment meets the targets; the nearest, {nearest.label()}, misses {misses(nearest, targets, wl)}"
    return ServeResult(ok[0] if ok else None, pareto_front(deployments), tuple(ok[:top]), nearest, why, evaluated,
                       time.perf_counter() - start, skipped)


def _disaggregated_deployments(pre: list[PoolPoint], dec: list[PoolPoint], wl: ServeWorkload,
                               targets: ServeTargets, budget: int, min_gpus: int) -> list[Deployment]:
    """Pairs of the prefill points that meet the TTFT target (the best few per GPU) and, for every decode engine
    size, the decode points on that size's front (requests/s/GPU vs TPOT), each at its best x:y ratio."""
    def ttft_ok(p: PoolPoint) -> bool:
        return targets.ttft_ms is None or p.ttft_s * 1e3 <= targets.ttft_ms

    pre_ok = sorted((p for p in pre if ttft_ok(p)), key=lambda p: -p.requests_per_s / p.layout.gpus)[:6]
    if not pre_ok:
        pre_ok = sorted(pre, key=lambda p: p.ttft_s)[:2]  # keep the nearest misses for the account
    by_size: dict[int, list[PoolPoint]] = {}
    for d in dec:
        by_size.setdefault(d.layout.gpus, []).append(d)
    front: list[PoolPoint] = []
    for points in by_size.values():
        best = -1.0
        for d in sorted(points, key=lambda d: (d.tpot_s, -d.requests_per_s)):
            if d.requests_per_s > best:
                front.append(d)
                best = d.requests_per_s
    out = []
    for p in pre_ok:
        for d in front:
            if p.layout.gpus + d.layout.gpus > budget:
                continue
            ratio = _ratio(p, d, budget)
            if ratio is None:
                continue
            dep = _disaggregated(p, ratio[0], d, ratio[1], wl)
            if dep.gpus >= min_gpus:
                out.append(dep)
    return out


def _scaled_to_rate(d: Deployment, rate: float, wl: ServeWorkload) -> Deployment:
    """The same engines, as many of each as serve `rate` requests/s."""
    if d.mode == "aggregated":
        (p, _), = d.pools
        return _aggregated(p, max(1, math.ceil(rate / p.requests_per_s)), wl)
    (p, _), (q, _) = d.pools
    return _disaggregated(p, max(1, math.ceil(rate / p.requests_per_s)), q,
                          max(1, math.ceil(rate / q.requests_per_s)), wl)


# ---- a deployment given by hand, and the account of a search -------------------------------------------------------

def parse_engine_layout(text: str) -> EngineLayout:
    """"tp4,dp8,ep32" (any order; pp too; missing degrees are 1) -> EngineLayout; InputError on anything else."""
    degrees = {"tp": 1, "dp": 1, "pp": 1, "ep": 1}
    for part in text.replace(" ", "").lower().split(","):
        name, value = part[:2], part[2:]
        if name not in degrees or not re.fullmatch(r"[0-9]{1,7}", value) or int(value) < 1:  # ASCII digits only
            raise InputError(f"engine layout {text!r}: write degrees like tp4,dp8,ep32 (tp, dp, pp, ep; each >= 1)")
        degrees[name] = int(value)
    return EngineLayout(**degrees)


def pinned_deployment(model: ModelSpec, cluster: Cluster, wl: ServeWorkload, targets: ServeTargets,
                      layout: EngineLayout, engines: int | None = None, batch: int | None = None,
                      prefill_layout: EngineLayout | None = None, prefill_engines: int | None = None,
                      prefill_batch: int | None = None, eff: Efficiency | None = None,
                      mem_fraction: float = MEM_FRACTION, chunk: int | None = None) -> Deployment:
    """The deployment of the given engine layouts (aggregated, or disaggregated with `prefill_layout`): batches not
    given are the largest that meet the targets (else the one nearest to them); engine counts not given fill the
    GPUs (aggregated) or balance the pools; an aggregated engine's `chunk` (max_num_batched_tokens) likewise. InputError
    when a layout breaks a rule or nothing fits."""
    layout.check(model)
    per_node = cluster.gpus_per_node
    for lay in (layout, prefill_layout):
        if lay is not None and lay.gpus > per_node and lay.gpus % per_node:
            raise InputError(f"an engine of {lay.gpus} GPUs does not fill whole nodes of {per_node}")
    c = engine_cluster(cluster, layout.gpus)
    step = layout.dp if model.moe is not None else 1
    grid = sorted(b for b in {b * step for b in BATCHES} | ({batch} if batch is not None else set())
                  if batch is None or b <= batch)  # a given cap: no state above it

    def pick(candidates: list[Deployment]) -> Deployment:
        if not candidates:
            raise InputError(f"no batch of {layout.label()} fits its memory with ISL {wl.isl} + OSL {wl.osl}")
        ok = [d for d in candidates if meets(d, targets, wl)]
        return max(ok, key=lambda d: d.tokens_per_s_per_gpu) if ok else min(
            candidates, key=lambda d: _excess(d, targets, wl))

    if prefill_layout is None:
        curves = [_fitting(grid, step, functools.partial(_aggregated_at, model, c, layout, wl, ch, eff, mem_fraction,
                                                         None))
                  for ch in ((chunk,) if chunk is not None else CHUNKS)]
        points = [p for curve in curves for p in loaded_points(curve, wl, targets.percentile)
                  if batch is None or p.batch == batch]
        n = engines or max(1, cluster.num_gpus // layout.gpus)
        return pick([_aggregated(p, n, wl) for p in points])
    prefill_layout.check(model)
    pc = engine_cluster(cluster, prefill_layout.gpus)
    dec = [p for p in loaded_points(_fitting(grid, step, lambda b: decode_state(model, c, layout, wl, b, eff,
                                                                                  mem_fraction)),
                                    wl, targets.percentile) if batch is None or p.batch == batch]
    prompts = [prefill_batch] if prefill_batch is not None else [k * prefill_layout.dp for k in (1, 2, 4, 8, 16)]
    pre = loaded_points([s for k in prompts for s in [prefill_state(model, pc, prefill_layout, wl, k, eff,
                                                                    cluster.num_gpus > per_node, mem_fraction)]
                         if s is not None], wl, targets.percentile)
    if not pre:
        raise InputError(f"no prompt batch of prefill {prefill_layout.label()} fits its memory with ISL {wl.isl}")
    candidates = []
    for p in pre:
        for d in dec:
            if prefill_engines and engines:
                x, y = prefill_engines, engines
            else:
                y = engines or 1
                x = prefill_engines or max(1, math.ceil(y * d.requests_per_s / p.requests_per_s))
            candidates.append(_disaggregated(p, x, d, y, wl))
    return pick(candidates)


def _aggregated_at(model: ModelSpec, c: Cluster, lay: EngineLayout, wl: ServeWorkload, chunk: int,
                   eff: Efficiency | None, mem_fraction: float, geo: EngineGeometry | None,
                   batch: int) -> EngineState | None:
    """aggregated_state with the batch last, for a search over batches."""
    return aggregated_state(model, c, lay, wl, batch, chunk, eff, mem_fraction, geo)


def largest_between(fits: int, fails: int, step: int,
                    state: Callable[[int], EngineState | None]) -> list[EngineState]:
    """The state of the largest batch between `fits` and `fails` (a batch that fits and a larger one that does not,
    multiples of `step`) that fits, by bisection ([] when none lies between): a grid of batches jumps, 32 to 64,
    and the deployment with the most sequences the memory holds may be the best one."""
    best = None
    lo, hi = fits // step, fails // step  # in multiples of step: lo fits, hi does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        s = state(mid * step)
        if s is None:
            hi = mid
        else:
            lo, best = mid, s
    return [best] if best is not None else []


def _fitting(grid: list[int], step: int, state: Callable[[int], EngineState | None]) -> list[EngineState]:
    """The states of the grid's batches (ascending) that fit, and of the largest batch that fits below the first
    that does not (largest_between)."""
    fits: list[EngineState] = []
    for b in grid:
        s = state(b)
        if s is None:
            return fits + (largest_between(fits[-1].batch, b, step, state) if fits else [])
        fits.append(s)
    return fits


def explain_serving(result: ServeResult, targets: ServeTargets, wl: ServeWorkload, most: int = 4) -> list[str]:
    """Why the runners-up lose to the best: the best of the other mode and of other engine layouts, each with
    what it misses or how much less it delivers per GPU."""
    best = result.best
    if best is None:
        return []
    seen = {best.label()}
    out: list[str] = []
    pool = sorted(set(result.pareto) | set(result.ranked), key=lambda d: -d.tokens_per_s_per_gpu)
    other_mode = next((d for d in pool if d.mode != best.mode and not misses(d, targets, wl)), None) or next(
        (d for d in pool if d.mode != best.mode), None)
    candidates = ([other_mode] if other_mode else []) + pool
    for d in candidates:
        if d.label() in seen or len(out) >= most:
            continue
        seen.add(d.label())
        why = misses(d, targets, wl)
        if not why:
            gap = 1 - d.tokens_per_s_per_gpu / best.tokens_per_s_per_gpu
            if gap >= 0.0005:
                why = f"{gap:.1%} fewer tokens/s/GPU"
            elif d.gpus > best.gpus:
                why = "as fast per GPU, with more GPUs"
            else:  # within 0.05 %: the ranking keeps the first of equals
                why = "as fast per GPU on as many GPUs (a tie)"
        out.append(f"{d.label()} ({d.mode}, {d.gpus} GPUs): {why}")
    return out


# ---- a check of the best by simulation ------------------------------------------------------------------------------

@dataclass(frozen=True)
class SimulationCheck:
    """The best deployment's engine simulated iteration by iteration at its rate (costmodels/serving_sim.py) beside
    the analytic figures the search used, at the targets' percentile."""

    rate: float  # requests/s of one engine
    ttft_s: float
    tpot_s: float
    model_ttft_s: float
    model_tpot_s: float
    misses: str  # the targets the simulated figures miss, in words; "" when none
    mixed: bool = True  # prompt chunks share iterations with decode (False: prompts first, on their own: SGLang)


def simulate_deployment(model: ModelSpec, cluster: Cluster, wl: ServeWorkload, targets: ServeTargets,
                        d: Deployment, requests: int = 1000, eff: Efficiency | None = None,
                        mixed: bool = True) -> SimulationCheck | None:
    """An aggregated deployment of one-attention-group engines without speculative decoding, its engine simulated
    at its rate (Poisson, the lengths' spread, FCFS chunked prefill, `mixed` with decode or, as SGLang by default,
    prompts first on their own: serving_sim.simulate_engine); None for what the simulation does not model."""
    from meshplan.costmodels.queueing import PERCENTILES
    from meshplan.costmodels.serving_sim import simulate_engine

    if d.mode != "aggregated" or wl.spec_tokens:
        return None
    (p, _), = d.pools
    if p.layout.dp != 1:
        return None
    c = engine_cluster(cluster, p.layout.gpus)
    curve = [s for s in (aggregated_state(model, c, p.layout, wl, b, p.chunk, eff, p.mem_fraction)
                         for b in sorted({b for b in BATCHES if b < p.batch} | {p.batch})) if s is not None]
    if not curve or curve[-1].batch != p.batch:
        return None
    sim = simulate_engine(curve, wl, p.requests_per_s, requests=requests, mixed=mixed)
    q = PERCENTILES[targets.percentile]
    ttft, tpot = sim.ttft(q), sim.tpot(q)
    out = []
    if targets.ttft_ms is not None and ttft * 1e3 > targets.ttft_ms:
        out.append(f"TTFT {ttft * 1e3:.0f} ms > {targets.ttft_ms:g}")
    if targets.tpot_ms is not None and tpot * 1e3 > targets.tpot_ms:
        out.append(f"TPOT {tpot * 1e3:.1f} ms > {targets.tpot_ms:g}")
    return SimulationCheck(p.requests_per_s, ttft, tpot, p.ttft_s, p.tpot_s, ", ".join(out), mixed)


def checked_by_simulation(model: ModelSpec, cluster: Cluster, wl: ServeWorkload, targets: ServeTargets,
                          result: ServeResult, most: int = 12, eff: Efficiency | None = None,
                          mixed: bool = True) -> ServeResult:
    """The search's best, unless the simulation of its engine misses the targets: then the first of the ranked
    deployments and the Pareto front's others that meet them (in the ranking's order, at most `most` simulated)
    that the simulation does not contradict or cannot check (disaggregated, attention DP, speculation). The
    analytic queues are optimistic near capacity (docs/serving.md), so a deployment chosen at the edge of a p90
    target may miss it. When every candidate misses, the ranking stays as it was. `mixed` as simulate_deployment."""
    if result.best is None:
        return result
    front = [d for d in result.pareto if meets(d, targets, wl) and d not in result.ranked]
    order = list(result.ranked) + sorted(front, key=lambda d: -d.tokens_per_s_per_gpu)
    for d in order[:most]:
        check = simulate_deployment(model, cluster, wl, targets, d, eff=eff, mixed=mixed)
        if check is None or not check.misses:
            if d is result.best:
                return result
            rest = tuple(x for x in result.ranked if x is not d)
            return replace(result, best=d, ranked=(d,) + rest)
    return result


# ---- inputs from the command line ----------------------------------------------------------------------------------

def parse_gpu_range(text: str | None) -> tuple[int, int]:
    """"64" -> (1, 64); "16-320" -> (16, 320); InputError otherwise."""
    if text is None:
        raise InputError("say how many GPUs: --gpus N (at most N) or --gpus A-B")
    low, _, high = text.strip().partition("-")
    try:
        a, b = (int(low), int(high)) if high else (1, int(low))
    except ValueError:
        raise InputError(f"--gpus {text!r}: give a number N or a range A-B") from None
    if a < 1 or b < a:
        raise InputError(f"--gpus {text!r}: need 1 <= A <= B")
    return a, b


@dataclass(frozen=True)
class RequestLengths:
    """A lengths file's requests: the means and squared coefficients of variation (variance / mean^2) of their
    input and output tokens; the queueing model takes the spread, the engine model the means."""

    isl: float
    osl: float
    isl_cv2: float
    osl_cv2: float
    requests: int


def _cv2(values: list[int]) -> float:
    mean = sum(values) / len(values)
    return sum((v - mean) ** 2 for v in values) / len(values) / mean**2


def load_lengths(path: str | Path) -> RequestLengths:
    """The lengths of a CSV with a header naming input_tokens and output_tokens (or isl and osl) columns."""
    import csv

    path = Path(path)
    try:
        with path.open(newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError, csv.Error) as exc:
        raise InputError(f"{path}: cannot read it as CSV ({exc})") from None
    if not rows:
        raise InputError(f"{path}: no requests (a header line, then one line per request)")
    cols = {c.strip().lower(): c for c in rows[0] if c}
    pick = next(((cols[i], cols[o]) for i, o in (("input_tokens", "output_tokens"), ("isl", "osl"))
                 if i in cols and o in cols), None)
    if pick is None:
        raise InputError(f"{path}: needs columns input_tokens and output_tokens (or isl and osl); found "
                         f"{', '.join(cols) or 'none'}")
    ins, outs = [], []
    for n, row in enumerate(rows, start=2):
        try:
            i, o = int(row[pick[0]]), int(row[pick[1]])
        except (TypeError, ValueError):
            raise InputError(f"{path} line {n}: token counts must be whole numbers") from None
        if i < 1 or o < 1:
            raise InputError(f"{path} line {n}: token counts must be at least 1 (got {i}, {o})")
        ins.append(i)
        outs.append(o)
    return RequestLengths(sum(ins) / len(ins), sum(outs) / len(outs), _cv2(ins), _cv2(outs), len(ins))


@dataclass(frozen=True)
class Reuse:
    """What an engine need not compute: prompt tokens in the prefix cache, output tokens a drafter proposes."""

    prefix_hit: float = 0.0
    spec_tokens: int = 0
    accept_rate: float | None = None


def workload_from(isl: int | None, osl: int | None, lengths: RequestLengths | None,
                  weight_dtype: WeightDtype, kv_dtype: ServeDtype, reuse: Reuse = Reuse(),
                  two_batch_overlap: bool = False) -> ServeWorkload:
    """The workload of --isl/--osl (every request alike) or of a lengths file (its means and spread)."""
    if reuse.spec_tokens and reuse.accept_rate is None:
        raise InputError("--spec-tokens needs --accept-rate, the probability that a draft token is accepted "
                         "(DeepSeek-V3 reports 0.85-0.9 for its MTP token, report sec. 5.4.3)")
    if reuse.accept_rate is not None and not reuse.spec_tokens:
        raise InputError("--accept-rate goes with --spec-tokens K (draft tokens per decode step)")
    spread, source = (0.0, 0.0), None
    if lengths is not None:
        if isl is not None or osl is not None:
            raise InputError("give --isl/--osl or --lengths, not both")
        isl, osl = max(1, round(lengths.isl)), max(1, round(lengths.osl))
        spread, source = (lengths.isl_cv2, lengths.osl_cv2), f"means of {lengths.requests} requests"
    if isl is None or osl is None:
        raise InputError("say the request lengths: --isl N --osl M, or --lengths requests.csv")
    return ServeWorkload(isl=isl, osl=osl, weight_dtype=weight_dtype, kv_dtype=kv_dtype, isl_cv2=spread[0],
                         osl_cv2=spread[1], prefix_hit=reuse.prefix_hit, spec_tokens=reuse.spec_tokens,
                         accept_rate=reuse.accept_rate or 0.0, two_batch_overlap=two_batch_overlap, source=source)
