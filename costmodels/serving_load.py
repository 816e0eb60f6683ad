"""An engine at a load: the requests/s it serves and the TTFT and TPOT its requests see, queueing included
(costmodels/queueing.py), built from its states with every slot full (costmodels/serving.py).

Three ways a load reaches an engine, as deployments and benchmarks drive it:
- open loop (Poisson arrivals at a rate: production traffic, MLPerf's Server scenario, a benchmark's
  --request-rate): `running_point` at a mean of n running sequences below a cap of slots, `rate_point` at a rate;
- closed loop (a benchmark's fixed concurrency of N users, each sending its next request when the last ends):
  `concurrency_point`, in steady state (the requests arrive smoothly, at the pace they finish);
- offline (every request queued at once: MLPerf's Offline scenario, trtllm-bench throughput): `saturated_point`,
  the engine full at the batch that serves the most tokens/s.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.queueing import NO_WAIT, PERCENTILES, Percentile, mgc_wait, occupancy_quantile
from meshplan.costmodels.serving import (MEM_FRACTION, EngineLayout, EngineState, PoolPoint, ServeWorkload,
                                         aggregated_state, decode_state, prefill_state)
from meshplan.hardware_db.cluster import Cluster

__all__ = ["RUNNING_SPAN", "PREFILL_LOADS", "loaded_points", "running_point", "rate_point", "concurrency_point",
           "saturated_point", "prefill_loaded", "closed_loop_ttft", "aggregated_point", "decode_point",
           "prefill_point"]

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


def _prompt_iteration(curve: list[EngineState], running: float, prompts: float, wl: ServeWorkload,
                      budget: float) -> float:
    """An iteration carrying `prompts` prompts' chunks (one to the whole budget): linear in its prompt tokens
    between the states' lone-prompt and whole-budget iterations."""
    lone, full = _at(curve, running, "prompt_s"), _at(curve, running, "full_s")
    one = min(wl.computed_isl, budget)
    if budget <= one:
        return lone
    return lone + (full - lone) * (min(prompts * one, budget) - one) / (budget - one)


def _pace(curve: list[EngineState], running: float, wl: ServeWorkload) -> tuple[float, float, float] | None:
    """(requests/s of one attention group, prompt iterations per request, seconds of a prompt iteration) with
    `running` sequences decoding. The scheduler puts the waiting prompts into the next iteration whole, as many as
    the budget its group has beside the decode tokens holds (vLLM's and SGLang's chunked prefill take all the
    budget they can): a prompt takes k = ceil(ISL / share) iterations, and one iteration carries the m prompts that
    arrived during the last (1 <= m <= share / ISL); the other iterations are decode-only. A sequence gains a token
    per iteration, so Little's law over its OSL tokens gives the rate, n / (OSL x decode_s + n k (prompt - decode_s)
    / m). Prompts spread thinly over every iteration would ride in the memory-bound decode step nearly free (the
    roofline's max); taken whole they cost their compute. None when the budget is gone or prompt iterations would
    take all the time. Decode engines: no prompts."""
    cap = curve[-1]
    lay = cap.layout
    group = running / lay.dp
    if cap.role != "aggregated":
        return group / (wl.decode_steps * _at(curve, running, "step_s")), 0.0, 0.0
    budget = cap.chunk - running * (1 + wl.spec_tokens)
    share = budget / lay.dp
    if share <= 0:
        return None
    k = math.ceil(wl.computed_isl / share)
    decode = _at(curve, running, "decode_s")
    for batch in _prompt_ladder(share, wl):
        prompt = _prompt_iteration(curve, running, batch, wl, budget)
        rate = group / (wl.decode_steps * decode + group * k * max(prompt - decode, 0.0) / batch)
        if rate * k * prompt / batch < 1.0 and _keeps_up(curve, running, rate, k / batch, prompt, batch):
            return rate, k / batch, prompt
    return None


def _prompt_ladder(share: float, wl: ServeWorkload) -> list[float]:
    """The prompts a prompt iteration may carry, fewest first: 1, 2, 4, ... up to what the group's share of the
    budget holds (one, when a prompt needs more than one iteration)."""
    most = max(1.0, math.floor(share / wl.computed_isl)) if wl.computed_isl <= share else 1.0
    return sorted({min(most, 2.0 ** i) for i in range(int(math.log2(most)) + 2)})


def _keeps_up(curve: list[EngineState], running: float, rate: float, per_request: float, prompt: float,
              batch: float) -> bool:
    """Prompt iterations of `batch` prompts keep up when no more than that arrive in an iteration."""
    return rate * _token_interval(curve, running, rate, per_request, prompt) <= batch


def _token_interval(curve: list[EngineState], running: float, rate: float, per_request: float,
                    prompt: float) -> float:
    """Mean seconds between a sequence's tokens: 1 / (decode-only iterations + prompt iterations per second);
    `per_request` prompt iterations of `prompt` seconds each request."""
    if curve[-1].role != "aggregated":
        return _at(curve, running, "step_s")
    decode = _at(curve, running, "decode_s")
    busy = min(rate * per_request * prompt, 1.0)
    return 1.0 / ((1.0 - busy) / decode + rate * per_request)


def _tpot(curve: list[EngineState], running: float, rate: float, per_request: float, prompt: float,
          wl: ServeWorkload, q: float | None, interval: float) -> float:
    """A request's TPOT at the percentile q of requests: its OSL tokens come from that many iterations, each a
    prompt iteration with the probability phi that a random one is (the rest decode-only), so the share of prompt
    iterations in its life is binomial, phi +- z sqrt(phi (1 - phi) / OSL) (normal approximation), at the running
    sequences' own percentile (Poisson). The mean: the mean `interval`."""
    if q is None:
        return interval / wl.tokens_per_step
    busy_n = occupancy_quantile(running, q, curve[-1].batch)
    mean = _token_interval(curve, busy_n, rate, per_request, prompt)
    if curve[-1].role != "aggregated" or not per_request:
        return mean / wl.tokens_per_step
    decode = _at(curve, busy_n, "decode_s")
    phi = min(1.0, rate * per_request * mean)  # prompt iterations per second x seconds per iteration
    z = NormalDist().inv_cdf(q)
    share = min(1.0, max(0.0, phi + z * math.sqrt(phi * (1.0 - phi) / max(wl.decode_steps, 1.0))))
    return (decode + (prompt - decode) * share) / wl.tokens_per_step


def running_point(curve: list[EngineState], running: float, wl: ServeWorkload, q: float | None) -> PoolPoint | None:
    """An engine of max_num_seqs curve[-1].batch with `running` sequences running on average, arrivals Poisson, at
    the rate of _pace. A new request waits for the iteration in progress to end (uniform), for a slot (M/G/c over
    its attention group's slots), and, aggregated, for the prefill budget its group has beside its decode tokens
    (M/G/1), then takes ceil(ISL / share) iterations carrying its chunk. TPOT: _tpot. None where a queue is
    unstable (q: a quantile, None the mean)."""
    cap = curve[-1]
    lay = cap.layout
    pace = _pace(curve, running, wl)
    if pace is None:
        return None
    rate, per_request, prompt = pace
    interval = _token_interval(curve, running, rate, per_request, prompt)
    alone = 0.0
    prefill_wait = NO_WAIT
    if cap.role == "aggregated":
        share = (cap.chunk - running * (1 + wl.spec_tokens)) / lay.dp
        alone = math.ceil(wl.computed_isl / share) * _at(curve, running, "prompt_s")
        # the budget serves queued prompts together: each holds the server ISL / share of a full-budget iteration
        prefill_wait = mgc_wait(1, rate, wl.computed_isl / share * _at(curve, running, "full_s"), wl.isl_cv2)
    slot_wait = mgc_wait(max(1, cap.batch // lay.dp), rate, wl.decode_steps * interval + alone, wl.osl_cv2)
    wait = prefill_wait.quantile(q) + slot_wait.quantile(q)  # a sum of quantiles: at least the sum's quantile
    if not math.isfinite(wait):
        return None
    residual = interval * (0.5 if q is None else q)  # the iteration in progress when the request arrives
    tpot = _tpot(curve, running, rate, per_request, prompt, wl, q, interval)
    front = cap.request_s if cap.role == "aggregated" else 0.0  # a decode engine's requests came through prefill's
    return PoolPoint(cap.role, lay, cap.batch, cap.chunk, residual + alone + wait + front, tpot, rate * lay.dp,
                     cap.memory, cap.mem_fraction, running / cap.batch)


def rate_point(curve: list[EngineState], rate: float, wl: ServeWorkload, q: float | None) -> PoolPoint | None:
    """The engine at `rate` requests/s (open loop): the mean running sequences n whose rate (_pace) equals it, found
    by bisection (the rate grows with n); None beyond what the cap serves."""
    dp = curve[-1].layout.dp

    def served(n: float) -> float | None:
        pace = _pace(curve, n, wl)
        return None if pace is None else pace[0] * dp

    # the largest running count whose prompts still leave decode-only iterations (the rate grows with n up to it)
    hi = next((float(s.batch) for s in reversed(curve) if served(s.batch) is not None), 0.0)
    top = served(hi) if hi else None
    if top is None or top <= rate:
        return None
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        got = served(mid)
        lo, hi = (mid, hi) if got is not None and got < rate else (lo, mid)
    return running_point(curve, max(hi, 1e-9), wl, q)


def prefill_loaded(state: EngineState, busy: float, wl: ServeWorkload, q: float | None) -> PoolPoint:
    """A prefill engine busy a fraction `busy` of the time: prompts arrive at busy x batch / step and wait for the
    batch in progress and those queued before them, a batch at a time (M/G/1 of batches, whose time varies with
    their prompts' lengths: cs^2 = ISL's / batch); TTFT = the wait + its batch + the KV transfer."""
    k, step = state.batch, state.step_s
    rate = busy * k / step
    wait = mgc_wait(1, rate / k, step, wl.isl_cv2 / k)
    return PoolPoint("prefill", state.layout, k, state.chunk,
                     wait.quantile(q) + step + state.transfer_s + state.request_s, 0.0, rate, state.memory,
                     state.mem_fraction, busy)


def closed_loop_ttft(pre: EngineState, dec: EngineState, users: float, prefill_engines: int,
                     wl: ServeWorkload) -> float | None:
    """The mean TTFT of `users` closed-loop users over `prefill_engines` engines of state `pre` and decode engines
    stepping at dec.step_s: the users' rate N / (TTFT + OSL x TPOT) sets the prefill pool's busy fraction, and that
    its TTFT (prefill_loaded), solved by iterating. None when the prefill pool cannot keep up with that rate."""
    ttft = pre.step_s + pre.transfer_s
    for _ in range(50):
        rate = users / (ttft + wl.osl * dec.step_s)
        busy = rate / prefill_engines / (pre.batch / pre.step_s)
        if busy >= 1:
            return None
        ttft = prefill_loaded(pre, busy, wl, None).ttft_s
    return ttft


def concurrency_point(model: ModelSpec, cluster: Cluster, lay: EngineLayout, wl: ServeWorkload, users: int,
                      chunk: int, q: float | None, eff: Efficiency | None = None,
                      mem_fraction: float = MEM_FRACTION) -> PoolPoint | None:
    """An aggregated engine driven by `users` closed-loop users (a benchmark's --concurrency: each user sends its
    next request when its last one ends), in steady state. The requests come at the pace they finish, N / (TTFT +
    OSL x TPOT), and smoothly (interarrival cs^2 0: no burst of a Poisson stream), so a prompt iteration carries the
    prompts that arrived during the last one (_pace's two kinds of iteration; at one prompt per iteration the
    steady iteration of serving.aggregated_state), and a new prompt waits only for the iteration in progress and
    while the prefill budget is busy (Kingman's G/G/1 with ca^2 = 0). Users beyond the sequences the KV cache
    holds wait for a slot: the B that fit run and each completion admits the next user (the closed queue of B
    servers; each user's cycle is N / the rate). Not modelled: the start-up wave of N prompts arriving together, and
    the cohorts it leaves when lengths are fixed (serving_sim.simulate_benchmark runs those). None when no batch
    fits or prefill cannot keep pace."""
    fit, state = next(((b, st) for b in _descending(users)
                       for st in [aggregated_state(model, cluster, lay, wl, b, chunk, eff, mem_fraction)]
                       if st is not None), (0, None))
    if state is None:
        return None
    budget = chunk - fit * (1 + wl.spec_tokens)
    share = budget / lay.dp
    k = math.ceil(wl.computed_isl / share)
    alone = k * state.prompt_s
    group = fit / lay.dp
    curve = [state]

    def interval_at(rate: float) -> float:
        """The fewest prompts per prompt iteration that keep up with the users' rate (as _pace)."""
        interval = state.decode_s
        for batch in _prompt_ladder(share, wl):
            prompt = _prompt_iteration(curve, fit, batch, wl, budget)
            interval = _token_interval(curve, fit, rate, k / batch, prompt)
            if rate * interval <= batch:
                break
        return interval

    def ttft(rate: float) -> float:
        wait = mgc_wait(1, rate, wl.computed_isl / share * state.full_s, wl.isl_cv2, arrival_cv2=0.0).quantile(q)
        return interval_at(rate) * (0.5 if q is None else q) + alone + wait + state.request_s

    # the group's users' rate r solves r (TTFT(r) + OSL x interval(r)) = users, both growing with r, below the
    # limit of prompts the budget takes, share / ISL per iteration; beyond it the prompts queue and the users wait
    # that out in TTFT
    limit = (1.0 - 1e-9) * max(1.0, share / wl.computed_isl) / (k * state.full_s if k == 1 else k * state.prompt_s)
    lo, hi = 0.0, limit
    for _ in range(50):
        mid = (lo + hi) / 2
        demand = mid * (ttft(mid) + wl.decode_steps * interval_at(mid))
        lo, hi = (mid, hi) if demand < group else (lo, mid)
    rate = lo
    interval = interval_at(rate)
    first = max(ttft(rate), group / rate - wl.decode_steps * interval) if rate > 0 else math.inf
    cycle = first + wl.decode_steps * interval
    if fit < users:  # the closed queue: every user cycles through the `fit` slots in turn
        first += (users / fit - 1.0) * cycle
        cycle = users / fit * cycle
    return PoolPoint("aggregated", lay, fit, chunk, first, interval / wl.tokens_per_step, users / cycle, state.memory,
                     mem_fraction, 1.0)


def _descending(users: int) -> list[int]:
    """`users`, then fewer in steps of about 3 %: the largest batch that fits is found within that."""
    out, b = [], users
    while b >= 1:
        out.append(b)
        b = min(b - 1, int(b * 0.97))
    return out


def saturated_point(curve: list[EngineState], wl: ServeWorkload) -> PoolPoint | None:
    """Every request queued at once (offline): the state of the curve whose pace (_pace) serves the most
    requests/s, every slot taken."""
    best: PoolPoint | None = None
    for s in curve:
        pace = _pace(curve[:curve.index(s) + 1], s.batch, wl)
        if pace is None:
            continue
        rate, per_request, prompt = pace
        interval = _token_interval([s], s.batch, rate, per_request, prompt)
        share = (s.chunk - s.batch * (1 + wl.spec_tokens)) / s.layout.dp
        ttft = (math.ceil(wl.computed_isl / share) * s.prompt_s if s.role == "aggregated" else s.step_s) + s.request_s
        p = PoolPoint(s.role, s.layout, s.batch, s.chunk, ttft, interval / wl.tokens_per_step, rate * s.layout.dp,
                      s.memory, s.mem_fraction, 1.0)
        if best is None or p.requests_per_s > best.requests_per_s:
            best = p
    return best


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
