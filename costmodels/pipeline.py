"""Pipeline schedules and their event simulation.

A schedule is, per pipeline rank, the ordered list of passes it runs: F (forward), B (backward, or backward-input
only when W is split off) and W (backward-weight), each for a (micro-batch, model chunk). The simulation starts each
pass when its rank is free and its input has arrived, so bubbles, uneven stages and P2P latency all show.
Schedules: GPipe (Huang et al. 2019), 1F1B (PipeDream-Flush, Narayanan et al. 2021), interleaved 1F1B
(Narayanan et al. SC'21 sec. 2.2.2, Megatron schedules.py order), ZB-H1 (Qi et al. ICLR 2024, sec. 3).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from itertools import islice
from operator import itemgetter
from typing import Literal

from meshplan.costmodels.deadline import Deadline, check

PassKind = Literal["F", "B", "W"]
CHECK_EVERY_PASSES = 2**14  # a caller's deadline is checked this often (about 10-40 ms of simulation)
MAX_PIPELINE_PASSES = 2**18  # the most passes one step simulates (about a second at the limit; practice: < 70,000)


def pipeline_passes(schedule: str, pp: int, num_microbatches: int, vpp: int = 1) -> int:
    """How many passes one step simulates: F and B (and W with zero-bubble) per micro-batch and model stage."""
    return (3 if schedule == "zb" else 2) * num_microbatches * pp * vpp


@dataclass(frozen=True)
class Pass:
    kind: PassKind
    microbatch: int
    chunk: int  # model chunk on this rank (0..vpp-1); model stage = chunk * pp + rank


@dataclass(frozen=True)
class StageTimes:
    """Seconds per micro-batch for one model stage (rank r, chunk c): forward, backward-input, backward-weight."""

    forward: float
    backward_input: float
    backward_weight: float

    @property
    def backward(self) -> float:
        return self.backward_input + self.backward_weight


@dataclass(frozen=True)
class Timeline:
    """Simulation result: makespan, per-rank busy time and end, and every pass's (rank, pass) with its start and
    end. `events` lists them as (rank, pass, start, end) by start time; it is built only when read (the search
    reads the per-rank figures of thousands of passes and never the list)."""

    makespan: float
    busy: tuple[float, ...]
    rank_end: tuple[float, ...]  # per rank: when its last pass ends
    # per rank, per chunk: micro-batches whose activations are held at the peak
    peak_in_flight: tuple[tuple[int, ...], ...]
    passes: tuple[tuple[int, Pass], ...]  # (rank, pass) in the order simulated
    starts: tuple[float, ...] | list[float]
    ends: tuple[float, ...] | list[float]

    @property
    def events(self) -> tuple[tuple[int, Pass, float, float], ...]:
        rows = [(r, p, s, e) for (r, p), s, e in zip(self.passes, self.starts, self.ends, strict=True)]
        rows.sort(key=itemgetter(2, 0))  # by start, then rank
        return tuple(rows)

    def bubble_fraction(self) -> float:
        return 1.0 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def _virtual_order(m: int, pp: int, vpp: int, backward: bool) -> list[tuple[int, int]]:
    """Megatron's interleaved order of (micro-batch, chunk): groups of pp micro-batches sweep the chunks."""
    order = []
    for k in range(m * vpp):
        group, within = divmod(k, pp * vpp)
        chunk = within // pp
        if backward:
            chunk = vpp - 1 - chunk
        order.append((group * pp + within % pp, chunk))
    return order


def build_schedule(name: str, pp: int, m: int, vpp: int = 1) -> list[list[Pass]]:
    """Per-rank order of forward and backward passes. For 'zb' the backward is backward-input only; the
    weight passes are placed by the simulation into the gaps (ZB-H1's rule: W fills what would be bubble)."""
    ranks: list[list[Pass]] = []
    for r in range(pp):
        if name == "gpipe":
            seq = [Pass("F", i, 0) for i in range(m)] + [Pass("B", i, 0) for i in reversed(range(m))]
        elif name in ("1f1b", "zb"):
            warm = min(pp - r - 1, m)
            seq = [Pass("F", i, 0) for i in range(warm)]
            for i in range(m - warm):  # steady state: one forward, one backward
                seq += [Pass("F", warm + i, 0), Pass("B", i, 0)]
            seq += [Pass("B", i, 0) for i in range(m - warm, m)]  # cool-down
        elif name == "interleaved":
            fwd = _virtual_order(m, pp, vpp, backward=False)
            bwd = _virtual_order(m, pp, vpp, backward=True)
            total = m * vpp
            # Megatron forward_backward_pipelining_with_interleaving
            warm = min((pp - r - 1) * 2 + (vpp - 1) * pp, total)
            seq = [Pass("F", *fwd[i]) for i in range(warm)]
            for i in range(total - warm):
                seq.append(Pass("F", *fwd[warm + i]))
                seq.append(Pass("B", *bwd[i]))
            seq += [Pass("B", *bwd[i]) for i in range(total - warm, total)]
        else:
            raise ValueError(f"unknown schedule {name}")
        ranks.append(seq)
    return ranks


def simulate(schedule: list[list[Pass]] | PassOrder, times: list[list[StageTimes]], p2p_s: float = 0.0,
             split_weight: bool = False, deadline: Deadline | None = None) -> Timeline:
    """Discrete-event simulation in time order. times[rank][chunk]; p2p_s: activation transfer between stages.

    A forward of model stage k needs the forward of stage k-1 (same micro-batch); a backward of stage k needs the
    backward of stage k+1, and the last stage's backward its own forward. With split_weight, each backward is
    input-gradient only and its weight pass is queued: a rank runs a queued W whenever its next F/B would wait,
    or before a forward that would hold more micro-batches than 1F1B does. `schedule` may be a PassOrder already
    compiled from a fixed order (callers that simulate one order many times keep it). deadline: checked every
    CHECK_EVERY_PASSES passes (raises TimeLimitReached).
    """
    if isinstance(schedule, PassOrder):
        if split_weight:
            raise ValueError("a compiled PassOrder is a fixed order; weight passes to place need the event simulation")
        return simulate_order(schedule, times, p2p_s, deadline)
    if not split_weight:
        return simulate_order(compile_order(schedule, deadline), times, p2p_s, deadline)
    return simulate_events(schedule, times, p2p_s, split_weight, deadline)


def simulate_events(schedule: list[list[Pass]], times: list[list[StageTimes]], p2p_s: float = 0.0,
                    split_weight: bool = False, deadline: Deadline | None = None) -> Timeline:
    """The discrete-event simulation proper (a priority queue of ranks by their next start time); simulate()
    uses it where weight passes must be placed, and the fixed-order sweep elsewhere (tests check they agree)."""
    sim = _EventSimulation(schedule, times, p2p_s, split_weight)
    for r in range(sim.pp):
        sim.push(r)
    while sim.heap:
        _, r, ver = heapq.heappop(sim.heap)
        if ver != sim.version[r]:
            continue
        sim.run_next(r)
        if not len(sim.events) % CHECK_EVERY_PASSES:
            check(deadline)
        for q in {r, (r - 1) % sim.pp, (r + 1) % sim.pp}:
            sim.push(q)
    return sim.timeline()


class _EventSimulation:
    """simulate_events' state: per rank its place in the schedule, when it is free, its busy time, the weight
    passes it has yet to place and the micro-batches it holds; the passes done and when they ended."""

    def __init__(self, schedule: list[list[Pass]], times: list[list[StageTimes]], p2p_s: float, split_weight: bool):
        self.schedule, self.times, self.p2p_s, self.split_weight = schedule, times, p2p_s, split_weight
        self.pp = pp = len(schedule)
        self.vpp = vpp = len(times[0])
        self.last_stage = pp * vpp - 1
        self.done: dict[tuple[str, int, int], float] = {}
        self.cursor = [0] * pp
        self.free_at = [0.0] * pp
        self.busy = [0.0] * pp
        self.pending_w: list[list[Pass]] = [[] for _ in range(pp)]
        self.events: list[tuple[int, Pass, float, float]] = []
        self.in_flight = [[0] * vpp for _ in range(pp)]
        self.peak = [[0] * vpp for _ in range(pp)]
        self.peak_total = [0] * pp
        self.heap: list[tuple[float, int, int]] = []
        self.version = [0] * pp

    def dependency(self, r: int, p: Pass) -> tuple[str, int, int] | None:
        stage = p.chunk * self.pp + r
        if p.kind == "F":
            return None if stage == 0 else ("F", p.microbatch, stage - 1)
        return ("F", p.microbatch, stage) if stage == self.last_stage else ("B", p.microbatch, stage + 1)

    def candidate(self, r: int) -> tuple[float, Pass] | None:
        """Rank r's next pass and its earliest start, or None while its inputs are not done."""
        nxt = None
        if self.cursor[r] < len(self.schedule[r]):
            p = self.schedule[r][self.cursor[r]]
            dep = self.dependency(r, p)
            if dep is None:
                nxt = (self.free_at[r], p)
            elif dep in self.done:
                hop = self.p2p_s if dep[2] != p.chunk * self.pp + r else 0.0
                nxt = (max(self.free_at[r], self.done[dep] + hop), p)
        if self.pending_w[r]:
            # ZB-H1 keeps 1F1B's activation memory: at most pp - r micro-batches held (Qi et al. 2024, sec. 3.1).
            full = nxt is not None and nxt[1].kind == "F" and sum(self.in_flight[r]) >= self.pp - r
            if nxt is None or nxt[0] > self.free_at[r] or full:
                return self.free_at[r], self.pending_w[r][0]
        return nxt

    def push(self, r: int) -> None:
        self.version[r] += 1
        c = self.candidate(r)
        if c is not None:
            heapq.heappush(self.heap, (c[0], r, self.version[r]))

    def run_next(self, r: int) -> None:
        """Run rank r's next pass: its cost from its kind, then what it holds and what it may place next."""
        c = self.candidate(r)
        assert c is not None
        start, p = c
        stage = p.chunk * self.pp + r
        t = self.times[r][p.chunk]
        if p.kind == "F":
            cost = t.forward
        elif p.kind == "B":
            cost = t.backward_input if self.split_weight else t.backward
        else:
            cost = t.backward_weight
        end = start + cost
        self.free_at[r] = end
        self.busy[r] += cost
        self.done[(p.kind, p.microbatch, stage)] = end
        self.events.append((r, p, start, end))
        in_flight = self.in_flight[r]
        if p.kind == "W":
            self.pending_w[r].pop(0)
            in_flight[p.chunk] -= 1
        else:
            self.cursor[r] += 1
            if p.kind == "F":
                in_flight[p.chunk] += 1
                if sum(in_flight) > self.peak_total[r]:
                    self.peak_total[r] = sum(in_flight)
                    self.peak[r] = list(in_flight)
            elif self.split_weight:
                self.pending_w[r].append(Pass("W", p.microbatch, p.chunk))
            else:
                in_flight[p.chunk] -= 1

    def timeline(self) -> Timeline:
        if any(self.cursor[r] < len(self.schedule[r]) or self.pending_w[r] for r in range(self.pp)):
            raise RuntimeError("pipeline schedule deadlocked (a pass waits on one that never runs)")
        events = self.events
        return Timeline(max(self.free_at), tuple(self.busy), tuple(self.free_at), tuple(tuple(x) for x in self.peak),
                        tuple((r, p) for r, p, _, _ in events), tuple(e[2] for e in events),
                        tuple(e[3] for e in events))


@dataclass(frozen=True)
class PassOrder:
    """A fixed per-rank order (no weight passes to place) compiled once: every pass in an order where its inputs
    come first, with the index of its rank's previous pass and of the pass whose output it needs. Which passes
    wait on which, and so how many micro-batches each rank holds at its peak, do not depend on the times; only the
    times do, so the search simulates one order under many stage times with one pass over flat lists."""

    pp: int
    vpp: int
    passes: tuple[tuple[int, Pass], ...]
    previous: tuple[int, ...]  # the same rank's previous pass; len(passes) (a 0.0 sentinel) for a rank's first
    needs: tuple[int, ...]  # the pass whose output this one needs; the sentinel where none
    remote: tuple[float, ...]  # 1.0 where that output comes from another stage (it pays the P2P hop), else 0.0
    slot: tuple[int, ...]  # (rank * vpp + chunk) * 2 + (0 forward, 1 backward): where its time is in a flat table
    rank_slots: tuple[tuple[int, ...], ...]  # per rank, its passes' slots in its own order (busy time sums)
    last: tuple[int, ...]  # per rank, its last pass
    peak_in_flight: tuple[tuple[int, ...], ...]


def compile_order(schedule: list[list[Pass]], deadline: Deadline | None = None) -> PassOrder:
    """Sweep the ranks in turn, taking every pass whose input has been taken (the order the sweep takes them in
    is one where inputs come first); raises on a deadlocked order (and TimeLimitReached past the deadline)."""
    pp = len(schedule)
    vpp = 1 + max((p.chunk for row in schedule for p in row), default=0)
    stages = pp * vpp
    last_stage = stages - 1
    sentinel = sum(len(row) for row in schedule)
    index: dict[int, int] = {}  # (micro-batch, model stage, pass kind) keyed as one int -> position in the order
    passes: list[tuple[int, Pass]] = []
    previous: list[int] = []
    needs: list[int] = []
    remote: list[float] = []
    slot: list[int] = []
    rank_slots: list[list[int]] = [[] for _ in range(pp)]
    cursor = [0] * pp
    last = [sentinel] * pp
    in_flight = [[0] * vpp for _ in range(pp)]
    total = [0] * pp
    peak = [[0] * vpp for _ in range(pp)]
    peak_total = [0] * pp
    next_check = CHECK_EVERY_PASSES
    while len(passes) < sentinel:
        if len(passes) >= next_check:
            check(deadline)
            next_check = len(passes) + CHECK_EVERY_PASSES
        progressed = False
        for r in range(pp):
            row = schedule[r]
            while cursor[r] < len(row):
                p = row[cursor[r]]
                stage = p.chunk * pp + r
                key = 2 * (p.microbatch * stages + stage)
                if p.kind == "F":
                    dep, own = (-1 if stage == 0 else key - 2), key
                elif stage == last_stage:  # its own forward, already taken in this rank's order
                    dep, own = key, key + 1
                else:  # the next stage's backward
                    dep, own = key + 3, key + 1
                if dep >= 0 and dep not in index:
                    break
                index[own] = len(passes)
                previous.append(last[r])
                needs.append(index[dep] if dep >= 0 else sentinel)
                remote.append(1.0 if dep >= 0 and dep != key else 0.0)
                slot.append((r * vpp + p.chunk) * 2 + (0 if p.kind == "F" else 1))
                rank_slots[r].append(slot[-1])  # a rank's passes are taken in its own order
                last[r] = len(passes)
                passes.append((r, p))
                cursor[r] += 1
                progressed = True
                if p.kind == "F":
                    in_flight[r][p.chunk] += 1
                    total[r] += 1
                    if total[r] > peak_total[r]:
                        peak_total[r] = total[r]
                        peak[r] = list(in_flight[r])
                else:
                    in_flight[r][p.chunk] -= 1
                    total[r] -= 1
        if not progressed:
            raise RuntimeError("pipeline schedule deadlocked (a pass waits on one that never runs)")
    return PassOrder(pp, vpp, tuple(passes), tuple(previous), tuple(needs), tuple(remote), tuple(slot),
                     tuple(tuple(x) for x in rank_slots), tuple(last), tuple(tuple(x) for x in peak))


def simulate_order(order: PassOrder, times: list[list[StageTimes]], p2p_s: float = 0.0,
                   deadline: Deadline | None = None) -> Timeline:
    """Each pass starts at max(its rank's previous pass ended, its input arrived): the event simulation's times
    exactly (same operations in the same order), in one pass over the compiled order."""
    if len(times) != order.pp or any(len(row) != order.vpp for row in times):
        raise ValueError(f"stage times for {len(times)} ranks x {len(times[0]) if times else 0} chunks; the order "
                         f"has {order.pp} x {order.vpp}")
    table = [x for row in times for t in row for x in (t.forward, t.backward)]
    ends = [0.0] * (len(order.passes) + 1)  # the last entry is the sentinel: "ended" at time 0
    starts = [0.0] * len(order.passes)
    i = 0
    rows = zip(order.previous, order.needs, order.remote, order.slot, strict=True)
    for _ in range(0, len(order.passes), CHECK_EVERY_PASSES):  # the deadline between chunks, not in the hot loop
        check(deadline)
        for prev, need, rem, at in islice(rows, CHECK_EVERY_PASSES):
            start = ends[prev]
            ready = ends[need] + rem * p2p_s
            if ready > start:
                start = ready
            starts[i] = start
            ends[i] = start + table[at]
            i += 1
    ends.pop()
    rank_end = tuple(ends[k] if k < len(ends) else 0.0 for k in order.last)
    busy = tuple(float(sum(table[at] for at in slots)) for slots in order.rank_slots)
    return Timeline(max(rank_end), busy, rank_end, order.peak_in_flight, order.passes, starts, ends)


def bubble_closed_form(pp: int, m: int, vpp: int = 1) -> float:
    """Bubble time / ideal time = (p-1)/(v*m) for uniform stages (Narayanan et al. SC'21, sec. 2.2)."""
    return (pp - 1) / (vpp * m)
