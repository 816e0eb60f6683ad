"""A discrete-event simulation of one aggregated engine, iteration by iteration, to check the queueing
approximations of costmodels/serving_load.py (tests/test_queueing.py) and to report what they leave out: Poisson
arrivals of requests whose lengths are drawn around their means (gamma with the workload's spread), a cap of running
sequences, chunked prefill first come first served within the token budget beside the decode tokens
(Sarathi-Serve's schedule, vLLM's and SGLang's default), and every iteration timed from the engine's states.

An iteration's time is taken piecewise linear in its prompt tokens through the four iterations its states time at
the same running sequences (decode alone, the steady pace, a lone prompt's chunk, the whole budget), each
interpolated over the running sequences as serving_load does. Hand-written: no queueing library in the
dependencies simulates a token-budget scheduler.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from meshplan.costmodels.serving import EngineState, ServeWorkload

__all__ = ["SimulatedLoad", "simulate_engine"]


@dataclass(frozen=True)
class SimulatedLoad:
    """What the requests of a simulated run saw (after its warm-up): TTFT and TPOT per request, seconds."""

    ttft_s: np.ndarray
    tpot_s: np.ndarray
    requests_per_s: float
    mean_running: float

    def ttft(self, q: float | None) -> float:
        return float(self.ttft_s.mean() if q is None else np.quantile(self.ttft_s, q))

    def tpot(self, q: float | None) -> float:
        return float(self.tpot_s.mean() if q is None else np.quantile(self.tpot_s, q))


@dataclass
class _Request:
    arrival: float
    prompt: int  # prompt tokens left to prefill
    output: int  # output tokens in all
    first_token: float = math.nan
    made: int = 0  # output tokens made
    order: int = field(default=0)


def _lengths(rng: np.random.Generator, mean: float, cv2: float, n: int) -> np.ndarray:
    if cv2 <= 0:
        return np.full(n, max(1, round(mean)), dtype=np.int64)
    shape = 1.0 / cv2  # gamma: mean k theta, variance k theta^2, so cs^2 = 1 / k
    return np.maximum(1, np.rint(rng.gamma(shape, mean / shape, n))).astype(np.int64)


def simulate_engine(curve: list[EngineState], wl: ServeWorkload, rate: float, requests: int = 3000,
                    seed: int = 0, warmup: float = 0.2) -> SimulatedLoad:
    """`requests` Poisson arrivals at `rate` requests/s to the engine whose states (one layout and budget, batch
    ascending) are `curve`, at most curve[-1].batch running; the first `warmup` share of requests is dropped.
    One attention group (dp 1): the simulation checks the queues, not attention DP."""
    if curve[-1].layout.dp != 1 or wl.spec_tokens:
        raise ValueError("simulate_engine models one attention group (dp 1) without speculative decoding")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, requests))
    prompts = _lengths(rng, wl.computed_isl, wl.isl_cv2, requests)
    outputs = _lengths(rng, wl.osl, wl.osl_cv2, requests)
    batches = np.array([s.batch for s in curve], dtype=float)
    times = {name: np.array([getattr(s, name) for s in curve]) for name in ("decode_s", "step_s", "prompt_s",
                                                                            "full_s")}
    cap, chunk = curve[-1].batch, curve[-1].chunk

    def iteration(decoding: int, prompt_tokens: int) -> float:
        """Piecewise linear in the prompt tokens through the four iterations the states time at these running
        sequences: none, the steady pace, one prompt's chunk, the whole budget."""
        n = max(decoding, 1)
        budget = chunk - n
        at = {name: float(np.interp(n, batches, values)) for name, values in times.items()}
        points = sorted({0.0: at["decode_s"], min(n * wl.computed_isl / wl.decode_steps, budget): at["step_s"],
                         min(wl.computed_isl, budget): at["prompt_s"], float(budget): at["full_s"]}.items())
        xs, ys = zip(*points, strict=True)
        return float(np.interp(prompt_tokens, xs, ys, right=ys[-1] * prompt_tokens / max(xs[-1], 1.0)))

    waiting: deque[_Request] = deque()
    running: list[_Request] = []
    done: list[tuple[_Request, float]] = []
    now, nxt, area = 0.0, 0, 0.0
    while len(done) < requests:
        while nxt < requests and arrivals[nxt] <= now:
            waiting.append(_Request(float(arrivals[nxt]), int(prompts[nxt]), int(outputs[nxt]), order=nxt))
            nxt += 1
        while waiting and len(running) < cap:
            running.append(waiting.popleft())
        if not running:
            now = float(arrivals[nxt])
            continue
        decoding = [r for r in running if r.prompt == 0]
        budget = chunk - len(decoding)
        chunks: list[tuple[_Request, int]] = []
        for r in running:  # first come first served: the running list keeps admission order
            if r.prompt and budget > 0:
                take = min(r.prompt, budget)
                chunks.append((r, take))
                budget -= take
        dt = iteration(len(decoding), sum(take for _, take in chunks))
        now += dt
        area += len(running) * dt
        for r in decoding:
            r.made += 1
        for r, take in chunks:
            r.prompt -= take
            if r.prompt == 0:  # its last chunk makes its first token
                r.first_token, r.made = now, 1
        for r in [r for r in running if r.made >= r.output]:
            running.remove(r)
            r.made = r.output
            done.append((r, now))
    kept = [(r, end) for r, end in done if r.order >= warmup * requests]
    ttft = np.array([r.first_token - r.arrival for r, _ in kept])
    tpot = np.array([(end - r.first_token) / max(r.output - 1, 1) for r, end in kept])
    return SimulatedLoad(ttft, tpot, len(done) / now, area / now)
