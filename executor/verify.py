"""`meshplan verify`: run a plan's exact layout at a reduced model size and prove it computes the training step.

What it does, in order:
1. `verify_case`: the plan's model shrunk by `scale_model` (its layer count, and so the plan's stage
   ranges, kept; heads, kv heads and experts kept divisible by the plan's tp, cp and ep), a short
   sequence, the plan's micro-batch size, data-parallel degree and micro-batch count (or fewer with
   `microbatches`), and the plan's whole layout (degrees, rank order, stages, schedule, ZeRO, recompute).
2. The reference: the same model, batches and AdamW steps in one process (`reference_run`).
3. The plan's world of ranks (`run_world`, gloo, one process per rank), each running
   `executor.plan_run.plan_rank`; every rank reports the gradients and parameters it holds by the
   reference's names, its losses, its measured memory (torch's MemTracker) and its step times.
4. The merge (`executor.compare.merge_reports`): one value per parameter; where ranks holding replicas disagree
   (> 1e-12 relative), that is a failure in itself (a missing gradient all-reduce shows up here first).
5. The comparison (`compare_to_reference`: loss, every gradient after step 1, every parameter after the
   last step) and, beside it, memory and time against the cost model's prediction for this scaled run.

Only the numerics decide pass or fail. Memory is compared as element counts (the cost model prices bf16
weights, fp32 gradients and 12-byte Adam states; the executor holds everything in its run dtype, so
predicted bytes are converted to elements and back at the run's dtype). Time on CPU ranks is not comparable
with a GPU prediction; both are printed, and the measured per-stage timeline is written as a Chrome trace
in the planner's `--trace` format so the two can be opened side by side.
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import statistics
import threading
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from meshplan.costmodels.config import InputError, ParallelConfig, Workload, resolve
from meshplan.costmodels.efficiency import EXECUTOR_RUNTIME, calibrated_cluster
from meshplan.costmodels.estimate import Simulated, simulate_config
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.ops import ACT_BYTES
from meshplan.executor.scale import SCALES, scale_model
from meshplan.hardware_db.calibration import Calibration
from meshplan.hardware_db.cluster import ClusterSpec
from meshplan.planner.plan import Plan, plan_config

__all__ = ["MAX_RANKS", "LayoutRun", "VerifyCase", "VerifyOptions", "VerifyOutcome", "VerifyReport", "measured_trace",
           "run_layout", "run_verify", "side_by_side", "verify_case"]

MAX_RANKS = 16  # ranks this machine runs by default: each is a process with its own copy of the model

# bytes per element the cost model charges per category (costmodels/memory.py model_state_bytes, ops.ACT_BYTES)
PREDICTED_BYTES_PER_ELEMENT: Mapping[str, float] = {"weights": 2, "gradients": 4, "optimizer": 12 / 2,
                                                    "activations": ACT_BYTES, "logits": ACT_BYTES + 4}
# optimizer: 12 bytes per parameter = fp32 master + two Adam moments; the executor keeps the two moments
# (no master copy, its weights are already in the run dtype), so 2 elements per parameter, 6 bytes each.


@dataclass(frozen=True)
class VerifyOptions:
    """How to shrink and run a plan. seq None: 16 tokens, raised to a multiple of 2*cp*tp (load-balanced CP
    chunks, sequence-parallel shards); microbatches None: the plan's count."""

    scale: str = "tiny"
    steps: int = 2
    seq: int | None = None
    microbatches: int | None = None
    dtype: str = "float64"
    seed: int = 0
    backend: str = "gloo"
    launcher: str = "spawn"  # "spawn": run_world here; "torchrun": this process is one rank of a torchrun world
    timeout_s: float = 300.0
    max_ranks: int = MAX_RANKS
    inject: str | None = None  # a deliberate fault (executor.plan_run.INJECTIONS), to show the check can fail
    calibration: Calibration | None = None  # this host's CPU: predict the run here instead of on the plan's GPUs
    calibration_origin: str = "the calibration"


@dataclass(frozen=True)
class VerifyCase:
    """The scaled run of a plan: what the ranks execute and what the cost model predicts for it."""

    spec: ModelSpec
    config: ParallelConfig
    workload: Workload
    num_gpus: int
    runtime: str
    gbs: int
    seq: int
    plan_model: str

    def simulate(self, plan: Plan, calibration: Calibration | None = None,
                 origin: str = "the calibration") -> Simulated:
        """The cost model's prediction of this scaled run: on the plan's GPUs, or with a calibration of this host's
        device (its CPU over gloo, or its GPUs over NCCL) on the ranks as they run here (one host, the measured
        operator and collective costs)."""
        if calibration is None:
            _, cluster, _, _, _ = plan_config(plan)
            return simulate_config(self.spec, cluster, self.workload, self.config, self.runtime)
        gpu = "cpu" if calibration.device.kind == "cpu" else calibration.device.target
        spec = ClusterSpec(gpu=gpu, num_gpus=self.num_gpus, gpus_per_node=self.num_gpus)
        cluster, eff = calibrated_cluster(spec, calibration, origin, EXECUTOR_RUNTIME)
        return simulate_config(self.spec, cluster, self.workload, self.config, EXECUTOR_RUNTIME, eff)


def _default_seq(cfg: ParallelConfig, spec: ModelSpec, requested: int | None) -> int:
    step = 2 * cfg.cp * (cfg.tp if cfg.sp or cfg.sp is None else 1)
    seq = requested if requested is not None else max(16, step)
    if seq % step:
        raise InputError(f"--seq {seq} must be a multiple of {step} (2 x cp for load-balanced chunks, x tp with "
                         f"sequence parallelism); try --seq {step * math.ceil(seq / step)}")
    if spec.learned_positions and spec.max_seq_len is not None and seq > spec.max_seq_len:
        raise InputError(f"--seq {seq} exceeds the scaled model's {spec.max_seq_len} learned positions")
    return seq


def verify_case(plan: Plan, opts: VerifyOptions) -> VerifyCase:
    """The plan's layout at a reduced size; InputError (one line, with the fix) when it cannot run here."""
    if opts.scale not in SCALES and opts.scale != "none":
        raise InputError(f"--scale {opts.scale!r}: choose one of {', '.join(SCALES)} or none")
    if opts.steps < 1:
        raise InputError(f"--steps must be at least 1, got {opts.steps}")
    spec0, cluster, wl0, cfg, runtime = plan_config(plan)
    lay0 = resolve(spec0, cluster.num_gpus, wl0, cfg)
    if 0 in lay0.chunks:
        raise InputError(f"the plan leaves virtual stage {lay0.chunks.index(0)} (model order) without decoder layers; "
                         f"the executor runs a layer in every virtual stage: re-plan with --vpp 1 or another --pp")
    if lay0.world > opts.max_ranks and opts.launcher == "spawn":
        raise InputError(f"the plan runs {lay0.world} ranks; this machine runs at most {opts.max_ranks} "
                         f"(raise --max-ranks, or run under torchrun on the cluster with --backend nccl)")
    heads_multiple = cfg.tp * (cfg.cp if cfg.cp_comm == "a2a" else 1)
    spec = spec0 if opts.scale == "none" else scale_model(
        spec0, opts.scale, num_layers=spec0.num_layers, heads_multiple=heads_multiple, kv_multiple=cfg.tp,
        experts_multiple=cfg.ep)
    seq = _default_seq(cfg, spec, opts.seq)
    m = opts.microbatches if opts.microbatches is not None else lay0.num_microbatches
    if m < 1:
        raise InputError(f"--microbatches must be at least 1, got {m}")
    gbs = lay0.dp * lay0.mbs * m
    wl = wl0.model_copy(update={"global_batch": gbs, "seq_len": seq})
    resolve(spec, cluster.num_gpus, wl, cfg)  # the scaled run must satisfy every rule the plan did
    return VerifyCase(spec=spec, config=cfg, workload=wl, num_gpus=cluster.num_gpus, runtime=runtime, gbs=gbs,
                      seq=seq, plan_model=spec0.name)


# ---- memory and time beside the prediction ---------------------------------------------------------------------------
MEASURED_PARTS = ("parameters", "gradients", "optimizer", "activations")


@dataclass(frozen=True)
class MemoryRow:
    """One rank's measured peak (torch MemTracker categories) and the cost model's, in bytes at the run's dtype."""

    rank: int
    stage: int
    measured: Mapping[str, float]
    predicted: Mapping[str, float]

    @property
    def measured_total(self) -> float:
        """The tensor accounting's sum (a GPU's allocator peak, when measured, is reported beside it)."""
        return sum(v for k, v in self.measured.items() if k in MEASURED_PARTS)

    @property
    def predicted_total(self) -> float:
        return sum(self.predicted.values())


def predicted_state_bytes(sim: Simulated, stage: int, itemsize: int) -> dict[str, float]:
    """The cost model's memory of a stage as elements times the run's itemsize (see PREDICTED_BYTES_PER_ELEMENT);
    calibrated, its layers' activations already carry the profile's measured/formula ratio (Efficiency)."""
    mem = sim.estimate.stages[stage].memory
    return {
        "parameters": mem.weights / PREDICTED_BYTES_PER_ELEMENT["weights"] * itemsize,
        "gradients": mem.gradients / PREDICTED_BYTES_PER_ELEMENT["gradients"] * itemsize,
        "optimizer": mem.optimizer / PREDICTED_BYTES_PER_ELEMENT["optimizer"] * itemsize,
        "activations": (mem.activations / PREDICTED_BYTES_PER_ELEMENT["activations"]
                        + mem.logits / PREDICTED_BYTES_PER_ELEMENT["logits"]) * itemsize,
    }


@dataclass(frozen=True)
class VerifyReport:
    """Everything verify found; `ok` is the numerics verdict (loss, gradients, parameters, replicas)."""

    plan_model: str
    scaled_model: str
    layout: str
    world: int
    dtype: str
    tolerance: Any  # executor.compare.Tolerance: per quantity
    steps: int
    gbs: int
    seq: int
    loss_error: float
    grad_error: float
    param_error: float
    worst_grad: str
    worst_param: str
    failures: tuple[str, ...]
    memory: tuple[MemoryRow, ...]
    measured_step_s: tuple[float, ...]  # per rank, the median wall time of the steps after the first
    predicted_step_s: float
    losses: tuple[float, ...]
    reference_losses: tuple[float, ...]
    injected: str | None = None
    notes: tuple[str, ...] = field(default=())
    predicted_on: str = "the plan's GPUs"  # or this host's CPU, with the calibration named

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_json(self) -> str:
        data = asdict(self)
        data["ok"] = self.ok
        return json.dumps(data, indent=2, default=lambda o: dict(o) if isinstance(o, Mapping) else str(o))


# ---- running a layout ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayoutRun:
    """A layout's ranks' reports merged, held against the reference."""

    reports: tuple[Any, ...]  # executor.plan_run.RankReport, in rank order
    comparison: Any  # executor.compare.Comparison
    disagreements: tuple[str, ...]  # replicas (or losses) that differ between ranks (executor.compare.merge_reports)

    @property
    def failures(self) -> tuple[str, ...]:
        return tuple(self.comparison.failures()) + self.disagreements

    @property
    def ok(self) -> bool:
        return not self.failures


def run_layout(run: Any, lay: Any, *, inject: str | None = None, reference: Any = None, backend: str = "gloo",
               timeout_s: float = 300.0) -> LayoutRun:
    """`plan_rank` on lay.world spawned ranks, merged and compared with the single-process run (computed here
    unless `reference` is given). Raises RankFailure if a rank raises or does not finish in time."""
    from meshplan.executor.compare import compare_to_reference, merge_reports
    from meshplan.executor.launch import run_world
    from meshplan.executor.plan_run import plan_rank
    from meshplan.executor.reference import reference_run

    reports = tuple(run_world(lay.world, plan_rank, run, lay, inject, backend=backend, timeout_s=timeout_s))
    merged, disagreements = merge_reports(reports)
    reference = reference if reference is not None else reference_run(run)
    return LayoutRun(reports=reports, comparison=compare_to_reference(merged, reference), disagreements=disagreements)


def _torchrun_layout(rank: int, world: int, run: Any, lay: Any, inject: str | None) -> tuple[LayoutRun | None, bool]:
    """One torchrun rank: plan_rank, the reports gathered on rank 0, which merges and compares them; every rank
    returns the verdict (rank 0 also the LayoutRun)."""
    import torch.distributed as dist

    from meshplan.executor.compare import compare_to_reference, merge_reports
    from meshplan.executor.plan_run import plan_rank
    from meshplan.executor.reference import reference_run

    if world != lay.world:
        raise InputError(f"the plan runs {lay.world} ranks but torchrun started {world}; "
                         f"use torchrun --nproc-per-node ... so that nodes x processes = {lay.world}")
    report = plan_rank(rank, world, run, lay, inject)
    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(report, gathered, dst=0)
    result = None
    if rank == 0:
        reports = tuple(gathered or ())
        merged, disagreements = merge_reports(reports)
        result = LayoutRun(reports=reports, comparison=compare_to_reference(merged, reference_run(run)),
                           disagreements=disagreements)
    verdict = [result.ok if result is not None else None]
    dist.broadcast_object_list(verdict, src=0)
    return result, bool(verdict[0])


# ---- the whole verification ------------------------------------------------------------------------------------------
def measured_trace(reports: Sequence[Any], process_name: str = "meshplan verify (measured)") -> dict[str, Any]:
    """The ranks' measured last-step slices as a Chrome trace, one track per rank, in the planner's --trace
    format (Trace Event JSON, microseconds), so both open side by side in ui.perfetto.dev."""
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": 2, "tid": 1, "ts": 0,
                                     "args": {"name": process_name}}]
    for r in reports:
        tid = r.rank + 1
        c = r.coords
        label = (f"rank {r.rank} (pp {c['pp']} dp {c['dp']} cp {c['cp']} tp {c['tp']}; layers "
                 + ", ".join(f"{a}-{b - 1}" for a, b in r.layers) + ")")
        events.append({"ph": "M", "name": "thread_name", "pid": 2, "tid": tid, "ts": 0, "args": {"name": label}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": 2, "tid": tid, "ts": 0,
                       "args": {"sort_index": tid}})
        for e in r.events:
            events.append({"ph": "X", "name": e.name, "cat": e.category, "pid": 2, "tid": tid,
                           "ts": e.start_s * 1e6, "dur": e.duration_s * 1e6, "args": {}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


@dataclass(frozen=True)
class VerifyOutcome:
    """What run_verify hands the CLI: the report and measured trace (None / empty on torchrun ranks other than
    0, which only learn the verdict), and the verdict."""

    report: VerifyReport | None
    trace: Mapping[str, Any]
    ok: bool


def side_by_side(sim: Simulated, reports: Sequence[Any]) -> dict[str, Any]:
    """One Chrome trace with two processes: the cost model's simulated step of this scaled run on the plan's GPUs
    (the planner's --trace, process "meshplan pipeline") and the ranks' measured step (process "meshplan verify
    (measured)"), so Perfetto shows them one above the other (their time scales differ: GPU vs CPU)."""
    from meshplan.planner.trace import chrome_trace

    predicted = chrome_trace(sim)
    measured = measured_trace(reports)
    return {"traceEvents": predicted["traceEvents"] + measured["traceEvents"], "displayTimeUnit": "ms"}


def _steady_step_s(step_s: Sequence[float]) -> float:
    """A rank's step time: the median of the steps after the first (which warms up allocator and caches), or
    the only step."""
    return statistics.median(step_s[1:]) if len(step_s) > 1 else step_s[0]


@contextlib.contextmanager
def _time_limit(seconds: float, what: str):
    """--timeout for work this process does itself (the ranks have run_world's): SIGALRM raises TimeoutError naming
    `what`, between two torch operations. Main thread only (a signal handler runs there); elsewhere no limit."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise TimeoutError(f"{what} took more than --timeout {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# Bytes per parameter a run holds at its peak: weights, gradients and AdamW's two moments in the run's dtype.
STATE_COPIES = 4


def verify_memory_bytes(spec: ModelSpec, ranks: int, itemsize: int, tokens: int = 0, steps: int = 0) -> float:
    """A floor on the host memory verify needs: the single-process reference holds the whole reduced model's
    weights, gradients and moments, and each rank builds the whole model once before keeping its stage (the
    executor's build, executor/plan_run.py); the reference also runs the whole batch (`tokens` = batch x seq) at
    once, keeping at least every layer's input for the backward, and draws every step's token ids and labels
    (int64) up front (executor/reference.py reference_run). Other activations and buffers come on top."""
    states = spec.total_params(include_mtp=True) * itemsize * (STATE_COPIES + ranks)
    return states + tokens * spec.hidden * spec.num_layers * itemsize + steps * tokens * 2 * 8


def _available_bytes() -> float | None:
    """MemAvailable from /proc/meminfo (Linux), else None (no guard)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _itemsize(dtype: str) -> int:
    """Bytes per element of a run dtype (executor.reference.DTYPES; torch is imported by then)."""
    from meshplan.executor.reference import DTYPES

    return DTYPES[dtype].itemsize


def _check_memory(spec: ModelSpec, ranks: int, tokens: int, opts: VerifyOptions) -> None:
    """Refuse, with the estimate, a reduced model this machine cannot hold (`--scale none` on an 8B model would
    build 64 GB and swap or be killed)."""
    available = _available_bytes()
    itemsize = _itemsize(opts.dtype)
    need = verify_memory_bytes(spec, ranks, itemsize, tokens, opts.steps)
    if available is not None and need > available:
        gib = 2**30
        raise InputError(f"verify would need at least {need / gib:.1f} GiB for {spec.name} "
                         f"({spec.total_params(include_mtp=True) / 1e6:,.0f} M parameters in {opts.dtype}, the "
                         f"reference and {ranks} ranks, {tokens:,} tokens a step); this machine has "
                         f"{available / gib:.1f} GiB available: use a smaller --scale, --seq or --microbatches, "
                         f"fewer ranks, or --dtype float32 (or bfloat16)")


def _check_runnable(lay: Any, n_micro: int, inject: str | None) -> None:
    """What every rank would refuse, refused here first: the schedule's own rules (executor/pipeline.py) and the
    injections' preconditions (executor/plan_run.py)."""
    from meshplan.executor.pipeline import schedule_problem
    from meshplan.executor.plan_run import injection_problem

    problem = schedule_problem(lay, n_micro)
    if problem:
        raise InputError(f"{problem}; give --microbatches at least {lay.pp}, or leave it out")
    problem = injection_problem(lay, inject)
    if problem:
        raise InputError(problem)
    if lay.recompute_group > 1:  # executor/recompute.py checkpoints every layer on its own
        raise InputError(f"the executor recomputes layer by layer; the plan groups {lay.recompute_group} layers "
                         f"(--recompute-group): verify it as --recompute-group 1 (the same numerics)")


def _check_calibration(opts: VerifyOptions) -> None:
    """A calibration predicts this run only on the device it measured: a CPU's for gloo ranks, a GPU's for NCCL
    ranks; said before any rank starts."""
    cal = opts.calibration
    if cal is None:
        return
    wants = "cpu" if opts.backend == "gloo" else "cuda"
    if cal.device.kind != wants:
        profile = "--device cpu" if wants == "cpu" else "--device cuda"
        raise InputError(f"{opts.calibration_origin} is of {cal.device.target} ({cal.device.kind}); this run is "
                         f"--backend {opts.backend} on the {'CPU' if wants == 'cpu' else 'GPUs'}: give a calibration "
                         f"of that device (meshplan profile {profile})")


def run_verify(plan: Plan, opts: VerifyOptions, progress: Any = None) -> VerifyOutcome:
    """Verify a plan (see the module docstring).

    launcher "torchrun": this process is one rank of a torchrun world of the plan's size; rank 0 gathers the
    reports and gets the report, the other ranks only the verdict.
    Raises InputError for a plan this machine cannot run, RankFailure when a spawned rank raises or hangs."""
    say = progress or (lambda text: None)
    if opts.backend not in ("gloo", "nccl"):
        raise InputError(f"--backend {opts.backend!r}: choose gloo (CPU tensors) or nccl (one GPU per rank)")
    if opts.launcher not in ("spawn", "torchrun"):
        raise InputError(f"--launcher {opts.launcher!r}: choose spawn or torchrun")
    try:
        import torch  # noqa: F401 - only to say what is missing in one line
    except ImportError:
        raise InputError("meshplan verify needs PyTorch: pip install 'meshplan[torch]' (CPU: torch==2.13.0)") from None
    from meshplan.executor.plan_run import INJECTIONS
    from meshplan.executor.reference import RunSpec, reference_run

    if opts.inject is not None and opts.inject not in INJECTIONS:
        raise InputError(f"--inject {opts.inject!r}: one of {', '.join(INJECTIONS)}")
    case = verify_case(plan, opts)
    lay = resolve(case.spec, case.num_gpus, case.workload, case.config)
    _check_runnable(lay, lay.num_microbatches, opts.inject)  # before any rank starts (a rank takes seconds)
    _check_calibration(opts)
    if opts.launcher == "spawn":
        from meshplan.executor.launch import check_gpus

        check_gpus(opts.backend, lay.world)  # NCCL: one GPU per rank, here, before the reference run
    _check_memory(case.spec, lay.world if opts.launcher == "spawn" else 1, case.gbs * case.seq, opts)
    run = RunSpec(model=case.spec, gbs=case.gbs, seq=case.seq, steps=opts.steps, seed=opts.seed, dtype=opts.dtype)
    if opts.launcher == "torchrun":
        from meshplan.executor.launch import run_torchrun

        result, ok = run_torchrun(_torchrun_layout, run, lay, opts.inject, backend=opts.backend,
                                  timeout_s=opts.timeout_s)
        if result is None:  # not rank 0: rank 0 reports
            return VerifyOutcome(report=None, trace={}, ok=ok)
        with _time_limit(opts.timeout_s, "the single-process reference run"):
            reference_losses = reference_run(run).losses
    else:
        say(f"reference: {case.spec.name}, {case.gbs} x {case.seq} tokens, {opts.steps} steps, one process")
        with _time_limit(opts.timeout_s, "the single-process reference run"):
            reference = reference_run(run)
        say(f"running the plan's layout on {lay.world} ranks ({opts.backend})")
        result = run_layout(run, lay, inject=opts.inject, reference=reference, backend=opts.backend,
                            timeout_s=opts.timeout_s)
        reference_losses = reference.losses
    cal = opts.calibration
    sim = case.simulate(plan, cal, opts.calibration_origin)
    itemsize = _itemsize(opts.dtype)
    memory = tuple(MemoryRow(rank=r.rank, stage=r.coords["pp"], measured=dict(r.memory),
                             predicted=predicted_state_bytes(sim, r.coords["pp"], itemsize))
                   for r in result.reports)
    predicted_on = ("the plan's GPUs" if cal is None else
                    f"this host's {'CPU' if cal.device.kind == 'cpu' else 'GPU'} ({opts.calibration_origin}, "
                    f"{cal.device.name})")
    notes = sorted({n for r in result.reports for n in r.notes})
    if cal is not None and cal.measurements.dtype != opts.dtype:
        notes.append(f"the calibration was measured in {cal.measurements.dtype} and this run is {opts.dtype}: "
                     f"predicted times are for {cal.measurements.dtype} (use --dtype {cal.measurements.dtype})")
    cmp = result.comparison
    report = VerifyReport(
        plan_model=case.plan_model, scaled_model=case.spec.name, layout=result.reports[0].layout,
        world=lay.world, dtype=opts.dtype, tolerance=cmp.tolerance, steps=opts.steps, gbs=case.gbs,
        seq=case.seq, loss_error=cmp.loss_error, grad_error=cmp.grad_error, param_error=cmp.param_error,
        worst_grad=cmp.worst_grad, worst_param=cmp.worst_param, failures=result.failures, memory=memory,
        measured_step_s=tuple(_steady_step_s(r.step_s) for r in result.reports),
        predicted_step_s=sim.estimate.step_time_s,
        losses=result.reports[0].losses, reference_losses=reference_losses, injected=opts.inject,
        notes=tuple(notes), predicted_on=predicted_on)
    return VerifyOutcome(report=report, trace=side_by_side(sim, result.reports), ok=report.ok)
