"""A discrete-event simulation of one aggregated engine, iteration by iteration, to check the queueing
approximations of costmodels/serving_load.py (tests/test_queueing.py), to report what they leave out, and to run a
closed-loop benchmark as its client does (simulate_benchmark): Poisson or closed-loop arrivals of requests whose
lengths are drawn around their means (gamma with the workload's spread), a cap of running sequences, chunked
prefill first come first served within the token budget beside the decode tokens (Sarathi-Serve's schedule, vLLM's
and SGLang's default), and every iteration timed from the engine's states.

An iteration's time is taken piecewise linear in its prompt tokens through the four iterations its states time at
the same running sequences (decode alone, the steady pace, a lone prompt's chunk, the whole budget), each
interpolated over the running sequences as serving_load does. Hand-written: no queueing library in the
dependencies simulates a token-budget scheduler.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from meshplan.costmodels.serving import EngineState, ServeWorkload

__all__ = ["SEND_GAP_S", "SimulatedLoad", "group_view", "simulate_benchmark", "simulate_disaggregated",
           "simulate_engine"]

# A closed loop's requests "sent together" reach the engine one after another (each its own HTTP request through
# the front end), never in one instant: the first starts an iteration alone and the rest wait for it. Any gap far
# below an iteration prices that the same (stop 54's screen: 10 us, 0.1 ms and 1 ms gave identical TTFTs), so it
# is fixed, not fit.
SEND_GAP_S = 1e-5


@dataclass(frozen=True)
class SimulatedLoad:
    """What the requests of a simulated run saw (after its warm-up): TTFT and TPOT per request, seconds, and the
    sequences an engine held on average (a decode engine's, disaggregated)."""

    ttft_s: np.ndarray
    tpot_s: np.ndarray
    requests_per_s: float
    mean_running: float

    def ttft(self, q: float | None) -> float:
        return float(self.ttft_s.mean() if q is None else np.quantile(self.ttft_s, q))

    def tpot(self, q: float | None) -> float:
        return float(self.tpot_s.mean() if q is None else np.quantile(self.tpot_s, q))


@dataclass
class _Sender:
    """The order in which requests sent at one instant reach the engine: first come first served, `gap_s` apart (a
    FIFO single server with constant service, Kleinrock, "Queueing Systems" vol. 1, sec. 1.4's D/1; hand-written as
    it is two lines)."""

    gap_s: float
    free: float = 0.0

    def passed(self, sent: float) -> float:
        """When a request sent at `sent` (sent in time order) reaches the engine."""
        self.free = max(sent, self.free) + self.gap_s
        return self.free


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
                    seed: int = 0, warmup: float = 0.2, mixed: bool = True) -> SimulatedLoad:
    """`requests` Poisson arrivals at `rate` requests/s to the engine whose states (one layout and budget, batch
    ascending) are `curve`, at most curve[-1].batch running; the first `warmup` share of requests is dropped.
    One attention group (dp 1): the simulation checks the queues, not attention DP. `mixed` as simulate_benchmark."""
    _check(curve, wl)
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, requests))
    prompts = _lengths(rng, wl.computed_isl, wl.isl_cv2, requests)
    outputs = _lengths(rng, wl.osl, wl.osl_cv2, requests)
    engine = _Engine(curve, wl, mixed)
    nxt = 0
    while len(engine.done) < requests:
        while nxt < requests and arrivals[nxt] <= engine.now:
            engine.waiting.append(_Request(float(arrivals[nxt]), int(prompts[nxt]), int(outputs[nxt]), order=nxt))
            nxt += 1
        engine.skip_decode(float(arrivals[nxt]) if nxt < requests else math.inf)
        if not engine.step():
            engine.now = float(arrivals[nxt])
    return engine.result(warmup * requests)


def simulate_benchmark(curve: list[EngineState], wl: ServeWorkload, users: int, rounds: int = 20,
                       seed: int = 0, mixed: bool = True, gap_s: float = SEND_GAP_S) -> SimulatedLoad:
    """A closed-loop benchmark as its clients run it (aiperf's --concurrency, vLLM's and SGLang's bench_serving
    --max-concurrency): `users` requests sent together into an idle engine (a drained warm-up leaves it so; aiperf
    waits for every warm-up response before profiling, its docs/tutorials/warmup.md), then each user sends its next
    request the moment its last one ends, until users x rounds have been sent; every request is measured. Requests
    sent at one instant reach the engine `gap_s` apart (SEND_GAP_S), so an idle engine starts on the first alone. With
    fixed lengths the first wave's prompts, sliced by the token budget, keep finishing together, so later waves come
    in cohorts too: a TTFT the steady smooth-arrival model of serving_load.concurrency_point does not see.
    `mixed` False: the engine never puts prompt chunks and decode tokens in one iteration, and prompts go first
    (SGLang's default: ServerArgs.enable_mixed_chunk False, the scheduler running a prefill batch whenever one can
    be formed), so every running sequence waits while a wave is prefilled and the cohorts never spread."""
    _check(curve, wl)
    rng = np.random.default_rng(seed)
    total = users * rounds
    prompts = _lengths(rng, wl.computed_isl, wl.isl_cv2, total)
    outputs = _lengths(rng, wl.osl, wl.osl_cv2, total)
    engine = _Engine(curve, wl, mixed)
    sender = _Sender(gap_s)
    passing: deque[tuple[float, _Request]] = deque()  # (when it reaches the engine, the request), in that order
    sent = 0

    def send(now: float) -> None:
        nonlocal sent
        passing.append((sender.passed(now), _Request(now, int(prompts[sent]), int(outputs[sent]), order=sent)))
        sent += 1

    for _ in range(min(users, total)):
        send(0.0)
    while len(engine.done) < total:
        while passing and passing[0][0] <= engine.now:
            engine.waiting.append(passing.popleft()[1])
        finished = len(engine.done)
        # exact: a closed loop's requests reach the engine only as others finish, a gap after they are sent
        engine.skip_decode(passing[0][0] if passing else math.inf)
        if not engine.step():  # idle until the next one arrives
            engine.now = passing[0][0]
            continue
        for _ in engine.done[finished:]:
            if sent < total:
                send(engine.now)
    return engine.result(0)


def simulate_disaggregated(prefill: EngineState, prefill_engines: int, decode: list[EngineState],
                           decode_engines: int, wl: ServeWorkload, users: int, rounds: int = 20,
                           gap_s: float = SEND_GAP_S) -> SimulatedLoad:
    """A closed-loop benchmark of a disaggregated deployment as its client runs it (simulate_benchmark's: all users'
    first requests together into idle engines, each user's next request the moment its last one ends, users x
    rounds requests, every one measured), request by request:
    - requests sent at one instant reach the prefill engines `gap_s` apart (simulate_benchmark's);
    - each of `prefill_engines` engines takes up to prefill.batch waiting prompts (first come first served) per
      iteration of prefill.step_s; a prompt's first token comes transfer_s + request_s after (its KV cache sent on,
      the front end);
    - the sequence then joins the decode engine holding the fewest, at the first of its steps that starts after the
      KV cache arrived, and makes the other OSL - 1 tokens one per step; a step takes the decode time at the
      engine's running sequences (`decode`: its states, batch ascending, interpolated as simulate_engine does).
    The lengths are the workload's means (the measured rows' are fixed). A decode engine's steps between joins and
    finishes are one event. Where steady state (serving_load.closed_loop_ttft) sees a smooth stream, this sees the
    start-up wave: users prompts waiting for prefill together, and the cohorts it leaves."""
    total, decode_tokens = users * rounds, round(wl.osl) - 1
    if wl.spec_tokens or decode_tokens < 1:
        raise ValueError("the disaggregated simulation models decode tokens (OSL >= 2), without speculative decoding")
    batches = np.array([st.batch for st in decode], dtype=float)
    steps = np.array([st.step_s for st in decode])
    first_token_delay = prefill.transfer_s + prefill.request_s
    waiting: deque[int] = deque()  # request numbers waiting for prefill
    arrival = np.zeros(total)
    first = np.full(total, math.nan)
    finish = np.full(total, math.nan)
    events: list[tuple[float, int, str, int, int]] = []  # (time, tie-break, kind, engine, version)
    counter = 0
    sent = 0

    def push(t: float, kind: str, engine: int, version: int = 0) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, engine, version))

    pre_busy = [False] * prefill_engines
    prefill_batches: list[list[int]] = [[] for _ in range(prefill_engines)]  # the prompts each engine is running

    @dataclass
    class _Decode:
        running: int = 0  # sequences in its steps
        step: int = 0  # steps done
        start: float = 0.0  # when the current run of equal steps began (at `step`)
        dt: float = 0.0  # the duration of each of them (0: idle)
        version: int = 0  # invalidates a scheduled event when a join moves it earlier
        due: float = math.inf  # when its next event is scheduled
        finishes: list[tuple[int, int]] = field(default_factory=list)  # heap of (step it finishes at, request)
        joining: list[tuple[float, int]] = field(default_factory=list)  # heap of (KV ready, request)

    dec = [_Decode() for _ in range(decode_engines)]
    sender = _Sender(gap_s)

    def send(t: float) -> None:
        nonlocal sent
        arrival[sent] = t
        push(sender.passed(t), "arrive", 0, sent)  # `version` carries the request
        sent += 1

    def start_prefill(t: float) -> None:
        for i in range(prefill_engines):
            if not pre_busy[i] and waiting:
                batch = [waiting.popleft() for _ in range(min(prefill.batch, len(waiting)))]
                pre_busy[i] = True
                push(t + prefill.step_s, "prefill", i, 0)
                prefill_batches[i] = batch

    def plan_run(j: int, t: float) -> None:
        """Engine j at a step boundary t: admit the ready joiners, then schedule the end of its next run of equal
        steps (the next finish, or the boundary a pending join needs)."""
        e = dec[j]
        while e.joining and e.joining[0][0] <= t:
            _, r = heapq.heappop(e.joining)
            heapq.heappush(e.finishes, (e.step + decode_tokens, r))
            e.running += 1
        e.start, e.due = t, math.inf
        if not e.running:
            e.dt = 0.0
            if e.joining:
                schedule(j, e.joining[0][0])
            return
        e.dt = float(np.interp(e.running, batches, steps))
        k = e.finishes[0][0] - e.step
        if e.joining:
            k = min(k, max(1, math.ceil((e.joining[0][0] - t) / e.dt)))
        schedule(j, t + k * e.dt)

    def schedule(j: int, t: float) -> None:
        """Engine j's next event at t, unless one is due sooner (the older one is then void)."""
        e = dec[j]
        if t < e.due:
            e.due, e.version = t, e.version + 1
            push(t, "decode", j, e.version)

    def retire(r: int, t: float) -> None:
        finish[r] = t
        if sent < total:
            send(t)

    for _ in range(min(users, total)):
        send(0.0)
    while events:
        t, _, kind, i, version = heapq.heappop(events)
        if kind == "arrive":
            waiting.append(version)
        elif kind == "prefill":
            pre_busy[i] = False
            for r in prefill_batches[i]:
                first[r] = t + first_token_delay
                j = min(range(decode_engines), key=lambda j: dec[j].running + len(dec[j].joining))
                e = dec[j]
                heapq.heappush(e.joining, (first[r], r))
                # idle: wake at the KV cache's arrival; stepping: end the run at the first boundary after it
                schedule(j, first[r] if e.dt == 0.0 else e.start + max(1, math.ceil((first[r] - e.start) / e.dt))
                         * e.dt)
        elif version == dec[i].version:  # else moved earlier since, and void
            e = dec[i]
            if e.dt:
                e.step += round((t - e.start) / e.dt)
            while e.finishes and e.finishes[0][0] <= e.step:
                _, r = heapq.heappop(e.finishes)
                e.running -= 1
                retire(r, t)
            plan_run(i, t)
        if not events or events[0][0] > t:  # every request sent at t is queued before a prefill engine takes some
            start_prefill(t)
    ttft = first - arrival
    tpot = (finish - first) / decode_tokens  # at least 1 (checked above)
    span = float(np.nanmax(finish))
    # Little's law: the sequences a decode engine holds on average are the time all requests spent there (from the
    # first token, which includes the wait for the step that takes them in) over the run, per engine
    held = float(np.sum(finish - first)) / span / decode_engines if span > 0 else 0.0
    return SimulatedLoad(ttft, tpot, total / span if span > 0 else math.inf, held)


def group_view(curve: list[EngineState]) -> list[EngineState]:
    """An attention-DP engine's states as one of its dp attention groups sees them, for the simulation of one group:
    the groups take the requests in turn (SGLang's round-robin DP assignment), so with all users alike each holds
    1 / dp of the running sequences and of the token budget, and they step in lockstep, every iteration the
    engine's (its MoE layers gather every group's tokens). A state at the engine's batch B is the group's at B / dp."""
    out = []
    for s in curve:
        dp = s.layout.dp
        if s.batch % dp:
            continue
        one = dataclasses.replace(s.layout, dp=1, ep=1)  # the group's own layout, as the simulation checks it
        out.append(dataclasses.replace(s, layout=one, batch=s.batch // dp, chunk=s.chunk // dp))
    return out


def _check(curve: list[EngineState], wl: ServeWorkload) -> None:
    if curve[-1].layout.dp != 1 or wl.spec_tokens:
        raise ValueError("the engine simulation models one attention group (dp 1) without speculative decoding")


class _Engine:
    """One engine's scheduler and clock: each step() runs one iteration over the running sequences."""

    def __init__(self, curve: list[EngineState], wl: ServeWorkload, mixed: bool = True) -> None:
        self.wl = wl
        self.mixed = mixed  # prompt chunks ride with the decode tokens (else prefill-only iterations go first)
        self.batches = np.array([s.batch for s in curve], dtype=float)
        self.times = {name: np.array([getattr(s, name) for s in curve])
                      for name in ("decode_s", "step_s", "prompt_s", "full_s")}
        self.cap, self.chunk = curve[-1].batch, curve[-1].chunk
        self.front = curve[-1].request_s  # the front end's time, added to every TTFT (the engine sees it at once)
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.done: list[tuple[_Request, float]] = []
        self.now = self.area = 0.0

    def iteration(self, decoding: int, prompt_tokens: int) -> float:
        """Piecewise linear in the prompt tokens through the four iterations the states time at these running
        sequences: none, the steady pace, one prompt's chunk, the whole budget."""
        wl, n = self.wl, max(decoding, 1)
        budget = self.chunk - n
        at = {name: float(np.interp(n, self.batches, values)) for name, values in self.times.items()}
        points = sorted({0.0: at["decode_s"], min(n * wl.computed_isl / wl.decode_steps, budget): at["step_s"],
                         min(wl.computed_isl, budget): at["prompt_s"], float(budget): at["full_s"]}.items())
        xs, ys = zip(*points, strict=True)
        return float(np.interp(prompt_tokens, xs, ys, right=ys[-1] * prompt_tokens / max(xs[-1], 1.0)))

    def skip_decode(self, until: float = math.inf) -> None:
        """Run at once the decode-only iterations before the next finish, when nothing can change until then: no
        prompt being prefilled, none waiting to be admitted, and no arrival before the last of them starts
        (`until`: the next arrival's time; a closed loop's requests arrive only as others finish). Each is the same
        iteration, and the clock adds them one by one, so every figure is that of stepping them."""
        if not self.running or (self.waiting and len(self.running) < self.cap) or any(r.prompt for r in self.running):
            return
        most = min(r.output - r.made for r in self.running) - 1  # the next finish is left to step()
        if most <= 0:
            return
        dt = self.iteration(len(self.running), 0)
        running, skipped = len(self.running), 0
        # the clock adds them one by one as step() does, to the last bit; each must end before the next arrival,
        # which the caller admits before the iteration after it
        while skipped < most and self.now + dt < until:
            self.now += dt
            self.area += running * dt
            skipped += 1
        for r in self.running:
            r.made += skipped

    def step(self) -> bool:
        """Admit, run one iteration, retire; False (the clock unmoved) when nothing is running or waiting."""
        while self.waiting and len(self.running) < self.cap:
            self.running.append(self.waiting.popleft())
        if not self.running:
            return False
        decoding = [r for r in self.running if r.prompt == 0]
        if not self.mixed and len(decoding) < len(self.running):
            decoding = []  # a prefill-only iteration: the decoding sequences wait for it
        budget = self.chunk - len(decoding)
        chunks: list[tuple[_Request, int]] = []
        for r in self.running:  # first come first served: the running list keeps admission order
            if r.prompt and budget > 0:
                take = min(r.prompt, budget)
                chunks.append((r, take))
                budget -= take
        dt = self.iteration(len(decoding), sum(take for _, take in chunks))
        self.now += dt
        self.area += len(self.running) * dt
        for r in decoding:
            r.made += 1
        for r, take in chunks:
            r.prompt -= take
            if r.prompt == 0:  # its last chunk makes its first token
                r.first_token, r.made = self.now, 1
        for r in [r for r in self.running if r.made >= r.output]:
            self.running.remove(r)
            r.made = r.output
            self.done.append((r, self.now))
        return True

    def result(self, first_kept: float) -> SimulatedLoad:
        kept = [(r, end) for r, end in self.done if r.order >= first_kept]
        ttft = np.array([r.first_token - r.arrival + self.front for r, _ in kept])
        tpot = np.array([(end - r.first_token) / max(r.output - 1, 1) for r, end in kept])
        return SimulatedLoad(ttft, tpot, len(self.done) / self.now, self.area / self.now)
