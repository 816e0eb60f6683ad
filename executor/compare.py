"""A distributed run held against the single-process reference: loss, every gradient, every parameter.

Relative error of a run's tensor a against the reference's b: max|a - b| / max(max|b|, floor), per
tensor (per step for the loss), computed in float64. One scale per tensor, not per element: a
gradient entry that is 1e-20 in a tensor whose largest entry is 1e-3 is judged on the tensor's scale,
as rounding in a sum of micro-batches or ranks is.

The floor is FLOOR (1e-6; float32 1e-5, bfloat16 1e-4: Tolerance.floor) times the largest |b| of any
tensor of the same kind (all gradients, or all parameters), and at least TINY (1e-30). It is there for
gradients that are zero in exact arithmetic, whose computed values are rounding noise with an O(1)
relative error between any two summation orders: an attention key bias's gradient is one (softmax is
invariant to adding q.b_k to every score of a query), measured at ~2e-20 against a largest gradient of
0.3 in gpt3-175b@tiny, with a relative error of 0.25 between dp2 and the reference; AdamW turns that
noise into key-bias values of ~4e-15 after 3 steps, 0.8 apart. Against the floor both are ~2e-14 and
~4e-9. A wrong layout changes whole tensors by O(1e-2..1) of their own scale and stays visible unless a
tensor is below 1e-6 of the largest.

Tolerances (TOLERANCES, per dtype and quantity). float64 (issue 4): 1e-6 for everything; the errors seen
are ~1e-15 (reduction order only), and a real layout bug (a missing all-reduce, a wrong loss scale, a
shifted stage) is O(1e-2..1). In every dtype a dense tensor whose reference gradient is below the floor
(zero in exact arithmetic at every step, the invariance being structural) is judged by its gradient only
(`noise_gradients`): its parameter is that noise's image through AdamW. Routed experts are kept (one no
token chose in step 1 may be chosen in step 2).

In lower precision AdamW amplifies rounding: it steps an entry by about lr whatever its gradient's size
(Kingma & Ba 2015, sec. 2.1), so an entry whose gradient is rounding-sized steps +-lr with a sign of its
own in each run, and entry by entry two correct runs end up to 2 lr x steps apart. float32 and bfloat16
therefore judge each parameter by its update p - p0, norm-wise (||d_run - d_ref|| / ||d_ref||; a missing
update is 1.0). The figures seen are the worst of the 11 composed layouts of tests/test_verify.py (2 AdamW
steps, CPU, gloo).

float32 (u = 2^-24): loss and gradients 1e-4, on a floor of 1e-5 of the largest gradient (the key biases'
zero gradients come out ~2e-10 of the largest: 1.6e-4 against float64's 1e-6 floor); updates 1e-2. Seen:
loss 1e-7, gradients 1.6e-5, updates 2.2e-4. Compared entry by entry, 2 of the 11 layouts had failed
(parameters 2.1e-3 and 2.0e-4 apart; key biases 0.2-0.6 apart).

bfloat16 (issue 21: the dtype a GPU trains in and its calibration is measured in) keeps 8 bits of
significand (u = 2^-8 = 3.9e-3):
- loss per step: 3e-2 (8u); seen 6.5e-3.
- each gradient: 1e-1 on a floor of 1e-4 of the largest; seen 3.5e-2. The key biases' exactly-zero
  gradients come out ~2e-6 of the largest in bf16 (~2e-19 in float64), below that floor.
- each parameter's update: 0.5; seen 0.20.
- routers and routed experts, together, norm-wise: gradients 3e-1, updates 0.5. A token whose top-k
  scores tie within rounding picks another expert in the other run and moves its gradient from one expert
  to another: deepseek-v3@tiny, 0.58 on one expert's gradient, 0.09 over all of them (updates 0.20); a
  missing expert gradient sync is 3.0 over all of them, a wrong expert placement 1.4 (ep4, mixtral-8x7b@tiny).
Six injected faults fail with worst errors of 0.66-19 (benchmarks/bf16_numerics.py, RESULTS.md). So a bf16 run
finds a layout bug of O(1), not one of 1e-2: float64 is the exact check. This is what `meshplan verify` prints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from meshplan.executor.reference import FrozenRecord, RunResult, RunSpec, reference_run

__all__ = ["FLOOR", "REPLICA_TOLERANCE", "ROUTING_GROUP", "TINY", "TOLERANCE", "TOLERANCES", "Comparison",
           "Tolerance", "noise_gradients", "norm_error", "routing_dependent", "compare_to_reference", "merge_reports",
           "relative_error"]

FLOOR = 1e-6  # a tensor's scale is at least this times the largest of its kind (see above); bf16: Tolerance.floor
TINY = 1e-30  # and at least this: an all-zero reference tensor (e.g. an expert no token chose) divides by it


@dataclass(frozen=True)
class Tolerance:
    """What a run in one dtype is held to, per quantity (relative errors, defined in the module docstring).

    by_update: parameters are judged by their update p - p0, norm-wise, instead of entry by entry;
    routing_norm: routers and routed experts are judged together, norm-wise, at this tolerance (None: each
    tensor on its own, as every other). replica: how far ranks holding the same tensor may differ."""

    loss: float
    grad: float
    param: float
    replica: float
    floor: float = FLOOR
    by_update: bool = False
    routing_norm: float | None = None

    def limit(self, kind: str, name: str) -> float:
        """The tolerance of one entry of Comparison.grad_errors ("gradient") or param_errors ("parameter")."""
        if kind == "gradient":
            return self.routing_norm if name == ROUTING_GROUP and self.routing_norm is not None else self.grad
        return self.param


# replica: ranks holding the same tensor ran the same ops in the same order: on a CPU that is bitwise, so rounding
# only; on a GPU float32 attention and GEMM backwards reduce in a nondeterministic order (atomics: torch's
# "Reproducibility" notes), about 1e-7 per reduction, so replicas agree to rounding accumulated, not bitwise; bf16
# replicas that round a gradient differently can step +-lr apart (AdamW, above): 2 lr x steps = 4e-3 at the defaults,
# against a largest entry of ~0.07 in a tensor drawn at INIT_STD 0.02, ~6e-2
TOLERANCES: Mapping[str, Tolerance] = {
    "float64": Tolerance(loss=1e-6, grad=1e-6, param=1e-6, replica=1e-12),
    "float32": Tolerance(loss=1e-4, grad=1e-4, param=1e-2, replica=1e-6, floor=1e-5, by_update=True),
    "bfloat16": Tolerance(loss=3e-2, grad=1e-1, param=0.5, replica=1e-1, floor=1e-4, by_update=True,
                          routing_norm=3e-1),
}
TOLERANCE: Mapping[str, float] = {dtype: t.loss for dtype, t in TOLERANCES.items()}  # one figure per dtype
REPLICA_TOLERANCE: Mapping[str, float] = {dtype: t.replica for dtype, t in TOLERANCES.items()}
ROUTING_GROUP = "routers and routed experts (together)"


class _Result(Protocol):
    """Anything shaped like executor.reference.RunResult (RankReport is)."""

    run: RunSpec
    losses: tuple[float, ...]
    grads: Mapping[str, torch.Tensor] | None
    params: Mapping[str, torch.Tensor] | None
    layout: str


def relative_error(a: torch.Tensor | float, b: torch.Tensor | float, floor: float = TINY) -> float:
    """max|a - b| / max(max|b|, floor, TINY) in float64; inf if the shapes differ or a is not finite."""
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    if a.shape != b.shape:
        return math.inf
    if not bool(torch.isfinite(a).all()):
        return math.inf
    if a.numel() == 0:
        return 0.0
    return float((a - b).abs().max()) / max(float(b.abs().max()), floor, TINY)


def _errors(run: Mapping[str, torch.Tensor] | None, ref: Mapping[str, torch.Tensor],
            what: str, floor_ratio: float) -> tuple[dict[str, float], list[str]]:
    if run is None:
        raise ValueError(f"the result has no {what} (only dp rank 0's result carries them)")
    floor = floor_ratio * _largest(ref)
    errors = {name: relative_error(run[name], b, floor) for name, b in ref.items() if name in run}
    problems = [f"{what} {name} missing" for name in ref if name not in run]
    problems += [f"{what} {name} not in the reference" for name in run if name not in ref]
    problems += [f"{what} {name} shape {tuple(run[name].shape)} != {tuple(ref[name].shape)}"
                 for name in errors if run[name].shape != ref[name].shape]
    return errors, problems


def _largest(tensors: Mapping[str, torch.Tensor]) -> float:
    return max((float(t.abs().max()) for t in tensors.values() if t.numel()), default=0.0)


def norm_error(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    """||a - b|| / ||b|| over the tensors concatenated, in float64; inf if a shape differs or a is not finite."""
    if any(x.shape != y.shape for x, y in zip(a, b, strict=True)) or not all(bool(torch.isfinite(x).all()) for x in a):
        return math.inf
    diff = math.sqrt(sum(float((x.double() - y.double()).square().sum()) for x, y in zip(a, b, strict=True)))
    scale = math.sqrt(sum(float(y.double().square().sum()) for y in b))
    return diff / max(scale, TINY)


def routing_dependent(name: str) -> bool:
    """A router or a routed expert (executor/model.py's names; shared experts see every token)."""
    return ".router." in name or ".experts." in name


def noise_gradients(reference: RunResult, floor_ratio: float) -> set[str]:
    """Dense tensors whose reference gradient is below the floor: rounding noise of a gradient that is zero in exact
    arithmetic (an attention key bias's), judged by that gradient only (module docstring)."""
    floor = floor_ratio * _largest(reference.grads)
    return {n for n, g in reference.grads.items() if not routing_dependent(n) and _largest({n: g}) < floor}


def _update_errors(grads: Mapping[str, torch.Tensor], params: Mapping[str, torch.Tensor], run: RunSpec,
                   reference: RunResult, tol: Tolerance) -> tuple[dict[str, float], dict[str, float]]:
    """Gradients (each on the floor) and updates (norm-wise) as the module docstring's bfloat16 list says; with
    tol.routing_norm, the routing-dependent tensors as one entry, ROUTING_GROUP."""
    init = {name: p.detach() for name, p in run.build().named_parameters()}
    floor = tol.floor * _largest(reference.grads)
    grouped = {n for n in reference.grads if tol.routing_norm is not None and routing_dependent(n) and n in grads}
    grad_errors = {n: relative_error(grads[n], b, floor) for n, b in reference.grads.items()
                   if n in grads and n not in grouped}
    noise = noise_gradients(reference, tol.floor)
    judged = [n for n in reference.params if n in params and n in init and n not in noise and n not in grouped]
    param_errors = {n: norm_error([params[n] - init[n]], [reference.params[n] - init[n]]) for n in judged}
    if grouped:
        names = sorted(grouped)
        grad_errors[ROUTING_GROUP] = norm_error([grads[n] for n in names], [reference.grads[n] for n in names])
        moved = [n for n in names if n in params and n in init]
        param_errors[ROUTING_GROUP] = norm_error([params[n] - init[n] for n in moved],
                                                 [reference.params[n] - init[n] for n in moved])
    return grad_errors, param_errors


@dataclass(frozen=True)
class Comparison(FrozenRecord):
    """Relative errors of one run against the reference (see the module docstring for the definition).

    loss_errors: per step; grad_errors: after step 1, by parameter name; param_errors: after the last
    step (bfloat16: of the update, and ROUTING_GROUP for the routing-dependent tensors together); problems:
    names missing on either side or shapes that differ (each fails the check).
    """

    layout: str
    dtype: str
    tolerance: Tolerance
    loss_errors: tuple[float, ...]
    grad_errors: Mapping[str, float]
    param_errors: Mapping[str, float]
    problems: tuple[str, ...]

    @property
    def loss_error(self) -> float:
        return max(self.loss_errors)

    @property
    def grad_error(self) -> float:
        return max(self.grad_errors.values(), default=0.0)

    @property
    def param_error(self) -> float:
        return max(self.param_errors.values(), default=0.0)

    @property
    def worst_grad(self) -> str:
        return max(self.grad_errors, key=self.grad_errors.__getitem__, default="")

    @property
    def worst_param(self) -> str:
        return max(self.param_errors, key=self.param_errors.__getitem__, default="")

    @property
    def ok(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        """One line per quantity above tolerance (and every problem); empty when ok."""
        out = list(self.problems)
        for i, e in enumerate(self.loss_errors):
            if not e <= self.tolerance.loss:
                out.append(f"loss at step {i + 1}: relative error {e:.3g} (tolerance {self.tolerance.loss:g})")
        for kind, errors in (("gradient", self.grad_errors), ("parameter", self.param_errors)):
            out += [f"{kind} {name}: relative error {e:.3g} (tolerance {self.tolerance.limit(kind, name):g})"
                    for name, e in errors.items() if not e <= self.tolerance.limit(kind, name)]
        return out

    def summary(self) -> str:
        verdict = "OK" if self.ok else "FAIL"
        t = self.tolerance
        limits = f"{t.loss:g}" if t.loss == t.grad == t.param else f"loss {t.loss:g}, gradients {t.grad:g}, " \
                 f"parameter updates {t.param:g}"
        return (f"{self.layout}: {verdict} (tolerance {limits}, {self.dtype}): loss {self.loss_error:.2e}, "
                f"gradients {self.grad_error:.2e} (worst {self.worst_grad}), "
                f"parameters after {len(self.loss_errors)} steps {self.param_error:.2e} (worst {self.worst_param})")


def compare_to_reference(result: _Result, reference: RunResult | None = None,
                         tolerance: Tolerance | None = None) -> Comparison:
    """Hold `result` (dp rank 0's, which carries the full gradients and parameters) against the reference.

    reference: `reference_run(result.run)`, computed here if not given (pass it to compare many layouts of
    one run). tolerance: default TOLERANCES[run.dtype].
    """
    run = result.run
    if reference is None:
        reference = reference_run(run)
    elif reference.run != run:
        raise ValueError("the reference was computed for a different run")
    tol = tolerance if tolerance is not None else TOLERANCES[run.dtype]
    if len(result.losses) != len(reference.losses):
        raise ValueError(f"{len(result.losses)} losses but the reference ran {len(reference.losses)} steps")
    loss_errors = tuple(relative_error(a, b) for a, b in zip(result.losses, reference.losses, strict=True))
    grad_errors, grad_problems = _errors(result.grads, reference.grads, "gradient", tol.floor)
    param_errors, param_problems = _errors(result.params, reference.params, "parameter", tol.floor)
    if tol.by_update and not grad_problems + param_problems:
        grad_errors, param_errors = _update_errors(result.grads or {}, result.params or {}, run, reference, tol)
    else:
        noise = noise_gradients(reference, tol.floor)
        param_errors = {n: e for n, e in param_errors.items() if n not in noise}
    return Comparison(layout=result.layout, dtype=run.dtype, tolerance=tol, loss_errors=loss_errors,
                      grad_errors=grad_errors, param_errors=param_errors,
                      problems=tuple(grad_problems + param_problems))


def merge_reports(results: Sequence[_Result],
                  tolerance: float | None = None) -> tuple[RunResult, tuple[str, ...]]:
    """The ranks' reports as one RunResult, and one line per disagreement between them.

    Each gradient and parameter is taken from the lowest rank that reports it; every other rank holding the same
    name (a replica: dp copies, tp-gathered tensors) must agree within `tolerance` (relative; default
    REPLICA_TOLERANCE of the run's dtype), and so must every
    rank's losses. A disagreement is a layout bug by itself (a missing all-reduce shows here before the comparison
    with the reference does). Ranks are named by their position in `results` (their rank under run_world)."""
    first = results[0]
    if tolerance is None:
        tolerance = REPLICA_TOLERANCE[first.run.dtype]
    problems: list[str] = []
    for r, res in enumerate(results[1:], start=1):
        for i, (a, b) in enumerate(zip(res.losses, first.losses, strict=True)):
            if not relative_error(a, b) <= tolerance:
                problems.append(f"loss at step {i + 1}: rank {r} has {a!r}, rank 0 {b!r}")
    merged: dict[str, dict[str, torch.Tensor]] = {"gradient": {}, "parameter": {}}
    owner: dict[tuple[str, str], int] = {}
    for r, res in enumerate(results):
        for kind, tensors in (("gradient", res.grads), ("parameter", res.params)):
            for name, t in (tensors or {}).items():
                have = merged[kind].get(name)
                if have is None:
                    merged[kind][name], owner[(kind, name)] = t, r
                elif not (err := relative_error(t, have)) <= tolerance:
                    problems.append(f"{kind} {name}: rank {r} differs from rank {owner[(kind, name)]} "
                                    f"(relative {err:.3g}): the replicas disagree")
    result = RunResult(run=first.run, losses=first.losses, grads=merged["gradient"], params=merged["parameter"],
                       layout=first.layout)
    return result, tuple(problems)
