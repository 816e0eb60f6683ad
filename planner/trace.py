"""A simulated step as a Chrome Trace Event / Perfetto JSON file: see where the bubbles and exposed waits are.

One process ("meshplan pipeline") with, per pipeline stage, a compute track ("stage r (layers a-b)") holding its
F / B / W passes, and a communication track ("stage r comm") holding the P2P sends: each forward's activations to
the next stage and each backward's gradients to the previous one, p2p_s long from the pass's end. One comm track
is one stream: a send that would start while the previous one still runs waits for it (passes outlast a P2P
transfer in practice, so real traces show no such wait).

The DP gradient reduce / parameter gather (the exposed part) and the optimizer step are shown only for the
critical rank (the one whose finish sets the step time): Simulated carries them only as Estimate.breakdown_s,
which is that rank's; they sit on its compute track after its last pass, where the rank waits for them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshplan.costmodels.estimate import Simulated
from meshplan.planner.plan import write_text_atomic

__all__ = ["PROCESS_NAME", "chrome_trace", "write_trace"]

PROCESS_NAME = "meshplan pipeline"
PID = 1
US = 1e6  # trace times are microseconds
CATEGORY = {"F": "forward", "B": "backward", "W": "weight-grad"}


def compute_tid(rank: int) -> int:
    """Track ids interleave so each stage's comm track sits under its compute track (1-based: tid 0 is odd in
    some viewers)."""
    return 2 * rank + 1


def comm_tid(rank: int) -> int:
    return 2 * rank + 2


def _layer_label(chunks: list[tuple[int, int]]) -> str:
    return ", ".join(f"{first}-{first + n - 1}" for first, n in chunks)


def _meta(name: str, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "M", "name": name, "pid": PID, "tid": tid, "ts": 0, "args": args}


def _slice(name: str, cat: str, tid: int, start_s: float, dur_s: float, args: dict[str, Any]) -> dict[str, Any]:
    return {"ph": "X", "name": name, "cat": cat, "pid": PID, "tid": tid, "ts": start_s * US, "dur": dur_s * US,
            "args": args}


def chrome_trace(simulated: Simulated, names: Sequence[str] | None = None) -> dict[str, Any]:
    """The trace of one simulated step. `names` (one per pipeline stage) replaces the default compute-track
    names "stage r (layers a-b)"; their comm tracks are then named "<name> comm"."""
    est = simulated.estimate
    lay = est.layout
    pp, vpp = lay.pp, lay.vpp
    chunks = lay.chunk_layers()
    if names is None:
        names = [f"stage {r} (layers {_layer_label([chunks[c * pp + r] for c in range(vpp)])})" for r in range(pp)]
        comm_names = [f"stage {r} comm" for r in range(pp)]
    else:
        names = list(names)
        if len(names) != pp:
            raise ValueError(f"names needs one entry per pipeline stage ({pp}), got {len(names)}")
        comm_names = [f"{n} comm" for n in names]

    events: list[dict[str, Any]] = [_meta("process_name", compute_tid(0), {"name": PROCESS_NAME})]
    for r in range(pp):
        for tid, name in ((compute_tid(r), names[r]), (comm_tid(r), comm_names[r])):
            events.append(_meta("thread_name", tid, {"name": name}))
            events.append(_meta("thread_sort_index", tid, {"sort_index": tid}))

    last_stage = pp * vpp - 1
    p2p = simulated.p2p_s
    comm_free = [0.0] * pp
    rank_end = [0.0] * pp
    passes = sorted(simulated.timeline.events, key=lambda e: (e[0], e[2], e[3]))
    for r, p, start, end in passes:
        suffix = f" v{p.chunk}" if vpp > 1 else ""
        label = f"mb{p.microbatch}{suffix}"
        events.append(_slice(f"{p.kind} {label}", CATEGORY[p.kind], compute_tid(r), start, end - start,
                             {"microbatch": p.microbatch, "chunk": p.chunk}))
        rank_end[r] = max(rank_end[r], end)
        stage = p.chunk * pp + r
        send = None
        if p.kind == "F" and stage < last_stage:
            send = (f"send act {label}", {"microbatch": p.microbatch, "chunk": p.chunk, "to_stage": stage + 1})
        elif p.kind == "B" and stage > 0:
            send = (f"send grad {label}", {"microbatch": p.microbatch, "chunk": p.chunk, "to_stage": stage - 1})
        if send is not None and p2p > 0:
            at = max(end, comm_free[r])
            events.append(_slice(send[0], "p2p", comm_tid(r), at, p2p, send[1]))
            comm_free[r] = at + p2p

    # The critical rank: its last pass end + exposed DP sync + optimizer is the step time.
    dp_s = est.breakdown_s.get("dp_comm", 0.0)
    optim_s = est.breakdown_s.get("optimizer", 0.0)
    crit = min(range(pp), key=lambda r: (abs(rank_end[r] + dp_s + optim_s - est.step_time_s), r))
    at = rank_end[crit]
    if dp_s > 0:
        events.append(_slice("DP grad reduce + param gather (exposed)", "dp-comm", compute_tid(crit), at, dp_s,
                             {"zero": lay.zero}))
        at += dp_s
    if optim_s > 0:
        events.append(_slice("optimizer step", "optimizer", compute_tid(crit), at, optim_s, {}))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(trace: dict[str, Any], path: str | Path) -> None:
    """Write a trace as JSON, atomically (open it at ui.perfetto.dev or chrome://tracing)."""
    write_text_atomic(path, trace_text(trace))


def trace_text(trace: dict[str, Any]) -> str:
    return json.dumps(trace, allow_nan=False) + "\n"
