"""An engine at a load: the requests/s it serves and the TTFT and TPOT its requests see, queueing included
(costmodels/queueing.py), built from its states with every slot full (costmodels/serving.py).

Three ways a load reaches an engine, as deployments and benchmarks drive it:
- open loop (Poisson arrivals at a rate: production traffic, MLPerf's Server scenario, a benchmark's
  --request-rate): `running_point` at a mean of n running sequences below a cap of slots, `rate_point` at a rate;
- closed loop (a benchmark's fixed concurrency of N users, each sending its next request when the last ends):
  `concurrency_point`; with every request alike the users move in waves (see there);
- offline (every request queued at once: MLPerf's Offline scenario, trtllm-bench throughput): `saturated_point`,
  the engine full at the batch that serves the most tokens/s.
"""

from __future__ import annotations

import math

import numpy as np

from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.queueing import NO_WAIT, PERCENTILES, Percentile, mgc_wait, occupancy_quantile
from meshplan.costmodels.serving import (MEM_FRACTION, EngineLayout, EngineState, PoolPoint, ServeWorkload,
                                         aggregated_state, decode_state, prefill_state)
from meshplan.hardware_db.cluster import Cluster

__all__ = ["RUNNING_SPAN", "PREFILL_LOADS", "loaded_points", "running_point", "rate_point", "concurrency_point",
           "saturated_point", "prefill_loaded", "aggregated_point", "decode_point", "prefill_point"]

RUNNING_SPAN = 4  # an engine of max_num_seqs B runs at the 4 grid batches below B (at least about B / 4) on average
PREFILL_LOADS = (0.5, 0.7, 0.85, 0.95)  # busy fraction of a prefill engine


def _at(curve: list[EngineState], running: float, field: str) -> float:
    """A state's time at `running` sequences: linear between the states of the grid (same layout and budget)."""
    return float(np.interp(running, [s.batch for s in curve], [getattr(s, field) for s in curve]))


def loaded_points(curve: list[EngineState], wl: ServeWorkload, percentile: Percentile) -> list[PoolPoint]:
    """The points of one engine layout and budget (its states, batch ascending): each state's batch as the cap of
    running sequences (max_num_seqs), run at each smaller state's batch of the last RUNNING_SPAN as the mean (a new
    request waits for a slot while all are taken). Prefill states: each at every one of PREFILL_LOADS."""
    q = PERCENTILES[percentile]
    out: list[PoolPoint] = []
    for i, cap in enumerate(curve):
        if cap.role == "prefill":
            out += [prefill_loaded(cap, busy, wl, q) for busy in PREFILL_LOADS]
            continue
        for running in curve[max(0, i - RUNNING_SPAN):i]:
            p = running_point(curve[:i + 1], running.batch, wl, q)
            if p is not None:
                out.append(p)
    return out


def running_point(curve: list[EngineState], running: float, wl: ServeWorkload, q: float | None) -> PoolPoint | None:
    """An engine of max_num_seqs curve[-1].batch with `running` sequences running on average, arrivals Poisson;
    its rate is Little's law, running / (OSL x step). A new request waits for the iteration in progress to end
    (uniform), for a slot (M/G/c over its attention group's slots), and, aggregated, for the prefill budget its group
    has beside its decode tokens (M/G/1), then takes ceil(ISL / share) iterations carrying its chunk. TPOT: the step
    at the percentile of the running sequences. None where a queue is unstable (q: a quantile, None the mean)."""
    cap = curve[-1]
    lay = cap.layout
    step = _at(curve, running, "step_s")
    rate = running / (wl.decode_steps * step) / lay.dp  # requests/s of one attention group
    alone = 0.0
    prefill_wait = NO_WAIT
    if cap.role == "aggregated":
        share = (cap.chunk - running * (1 + wl.spec_tokens)) / lay.dp
        if share <= 0:
            return None
        alone = math.ceil(wl.computed_isl / share) * _at(curve, running, "prompt_s")
        # the budget serves queued prompts together: each holds the server ISL / share of a full-budget iteration
        prefill_wait = mgc_wait(1, rate, wl.computed_isl / share * _at(curve, running, "full_s"), wl.isl_cv2)
    slot_wait = mgc_wait(max(1, cap.batch // lay.dp), rate, wl.decode_steps * step + alone, wl.osl_cv2)
    wait = prefill_wait.quantile(q) + slot_wait.quantile(q)  # a sum of quantiles: at least the sum's quantile
    if not math.isfinite(wait):
        return None
    residual = step * (0.5 if q is None else q)  # the iteration in progress when the request arrives
    tpot = _at(curve, occupancy_quantile(running, q, cap.batch), "step_s") / wl.tokens_per_step
    return PoolPoint(cap.role, lay, cap.batch, cap.chunk, residual + alone + wait, tpot, rate * lay.dp, cap.memory,
                     cap.mem_fraction, running / cap.batch)


def rate_point(curve: list[EngineState], rate: float, wl: ServeWorkload, q: float | None) -> PoolPoint | None:
    """The engine at `rate` requests/s (open loop): the mean running sequences n whose Little's-law rate
    n / (OSL x step(n)) equals it, found by bisection (the rate grows with n); None beyond what the cap serves."""
    def served(n: float) -> float:
        return n / (wl.decode_steps * _at(curve, n, "step_s"))

    lo, hi = 0.0, float(curve[-1].batch)
    if served(hi * (1 - 1e-9)) <= rate:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if served(mid) < rate else (lo, mid)
    return running_point(curve, max(hi, 1e-9), wl, q)


def prefill_loaded(state: EngineState, busy: float, wl: ServeWorkload, q: float | None) -> PoolPoint:
    """A prefill engine busy a fraction `busy` of the time: prompts arrive at busy x batch / step and wait for the
    batch in progress and those queued before them, a batch at a time (M/G/1 of batches, whose time varies with
    their prompts' lengths: cs^2 = ISL's / batch); TTFT = the wait + its batch + the KV transfer."""
    k, step = state.batch, state.step_s
    rate = busy * k / step
    wait = mgc_wait(1, rate / k, step, wl.isl_cv2 / k)
    return PoolPoint("prefill", state.layout, k, state.chunk, wait.quantile(q) + step + state.transfer_s, 0.0, rate,
                     state.memory, state.mem_fraction, busy)


def concurrency_point(model: ModelSpec, cluster: Cluster, lay: EngineLayout, wl: ServeWorkload, users: int,
                      chunk: int, q: float | None, eff: Efficiency | None = None,
                      mem_fraction: float = MEM_FRACTION) -> PoolPoint | None:
    """An aggregated engine driven by `users` closed-loop users (a benchmark's --concurrency: each user sends its
    next request when its last one ends), in steady state. The requests come at the pace they finish, N / (TTFT +
    OSL x step), and smoothly (interarrival cs^2 0: no burst of a Poisson stream), so the engine runs its steady
    iteration of N sequences (serving.aggregated_state) and a new prompt waits only for the iteration in progress
    and while the prefill budget is busy (Kingman's G/G/1 with ca^2 = 0). Users beyond the sequences the KV cache
    holds wait for a slot: the B that fit run and each completion admits the next user (the closed queue of B
    servers; each user's cycle is N / the rate). Not modelled: the start-up wave of N prompts arriving together,
    which a benchmark's first requests see. None when no batch fits or prefill cannot keep pace."""
    fit = next((b for b in _descending(users) if aggregated_state(model, cluster, lay, wl, b, chunk, eff,
                                                                    mem_fraction) is not None), None)
    if fit is None:
        return None
    state = aggregated_state(model, cluster, lay, wl, fit, chunk, eff, mem_fraction)
    assert state is not None
    share = (chunk - fit * (1 + wl.spec_tokens)) / lay.dp
    alone = math.ceil(wl.computed_isl / share) * state.prompt_s
    residual = state.step_s * (0.5 if q is None else q)
    hold = wl.decode_steps * state.step_s  # a slot's time after its first token
    ttft = residual + alone
    for _ in range(30):  # the users' rate and their TTFT set each other: a fixed point (it contracts fast)
        rate = fit / (ttft + hold) / lay.dp  # requests/s of one attention group
        wait = mgc_wait(1, rate, wl.computed_isl / share * state.full_s, wl.isl_cv2, arrival_cv2=0.0).quantile(q)
        ttft = residual + alone + wait
    cycle = ttft + hold
    if fit < users:  # the closed queue: every user cycles through the `fit` slots in turn
        ttft += (users / fit - 1.0) * cycle
        cycle = users / fit * cycle
    return PoolPoint("aggregated", lay, fit, chunk, ttft, state.step_s / wl.tokens_per_step, users / cycle,
                     state.memory, mem_fraction, 1.0)


def _descending(users: int) -> list[int]:
    """`users`, then fewer in steps of about 3 %: the largest batch that fits is found within that."""
    out, b = [], users
    while b >= 1:
        out.append(b)
        b = min(b - 1, int(b * 0.97))
    return out


def saturated_point(curve: list[EngineState], wl: ServeWorkload) -> PoolPoint | None:
    """Every request queued at once (offline): the state of the curve that serves the most requests/s, full."""
    if not curve:
        return None
    best = max(curve, key=lambda s: s.batch / s.step_s)
    share = (best.chunk - best.batch * (1 + wl.spec_tokens)) / best.layout.dp
    ttft = (math.ceil(wl.computed_isl / share) * best.full_s if best.role == "aggregated" and share > 0
            else best.step_s)
    return PoolPoint(best.role, best.layout, best.batch, best.chunk, ttft, best.step_s / wl.tokens_per_step,
                     best.batch / (wl.decode_steps * best.step_s), best.memory, best.mem_fraction, 1.0)


def aggregated_point(model: ModelSpec, cluster: Cluster, lay: EngineLayout, wl: ServeWorkload, batch: int,
                     chunk: int, running: int, eff: Efficiency | None = None, mem_fraction: float = MEM_FRACTION,
                     percentile: Percentile = "p50") -> PoolPoint | None:
    """One aggregated engine of max_num_seqs `batch` with `running` sequences running on average."""
    low, cap = (aggregated_state(model, cluster, lay, wl, b, chunk, eff, mem_fraction) for b in (running, batch))
    if low is None or cap is None or running >= batch:
        return None
    return running_point([low, cap], running, wl, PERCENTILES[percentile])


def decode_point(model: ModelSpec, cluster: Cluster, lay: EngineLayout, wl: ServeWorkload, batch: int,
                 running: int, eff: Efficiency | None = None, mem_fraction: float = MEM_FRACTION,
                 percentile: Percentile = "p50") -> PoolPoint | None:
    """One decode engine of max_num_seqs `batch` with `running` sequences running on average."""
    low, cap = (decode_state(model, cluster, lay, wl, b, eff, mem_fraction) for b in (running, batch))
    if low is None or cap is None or running >= batch:
        return None
    return running_point([low, cap], running, wl, PERCENTILES[percentile])


def prefill_point(model: ModelSpec, cluster: Cluster, lay: EngineLayout, wl: ServeWorkload, prompts: int,
                  busy: float, eff: Efficiency | None = None, crosses_nodes: bool = True,
                  mem_fraction: float = MEM_FRACTION, percentile: Percentile = "p50") -> PoolPoint | None:
    """One prefill engine of `prompts` prompts per iteration, busy a fraction `busy` of the time."""
    state = prefill_state(model, cluster, lay, wl, prompts, eff, crosses_nodes, mem_fraction)
    return None if state is None else prefill_loaded(state, busy, wl, PERCENTILES[percentile])
