"""A distributed run held against the single-process reference: loss, every gradient, every parameter.

Relative error of a run's tensor a against the reference's b: max|a - b| / max(max|b|, floor), per
tensor (per step for the loss), computed in float64. One scale per tensor, not per element: a
gradient entry that is 1e-20 in a tensor whose largest entry is 1e-3 is judged on the tensor's scale,
as rounding in a sum of micro-batches or ranks is.

The floor is FLOOR (1e-6) times the largest |b| of any tensor of the same kind (all gradients, or all
parameters), and at least TINY (1e-30). It is there for gradients that are zero in exact arithmetic,
whose computed values are rounding noise with an O(1) relative error between any two summation
orders: an attention key bias's gradient is one (softmax is invariant to adding q.b_k to every score
of a query), measured at ~2e-20 against a largest gradient of 0.3 in gpt3-175b@tiny, with a relative
error of 0.25 between dp2 and the reference; AdamW turns that noise into key-bias values of ~4e-15
after 3 steps, 0.8 apart. Against the floor both are ~2e-14 and ~4e-9. A wrong layout changes whole
tensors by O(1e-2..1) of their own scale and stays visible unless a tensor is below 1e-6 of the largest.

Tolerances (issue 4): float64 1e-6, float32 1e-4. The float64 errors seen are ~1e-15 (reduction order
only); a real layout bug (a missing all-reduce, a wrong loss scale, a shifted stage) is O(1e-2..1).
Not yet solved: in float32 AdamW turns the key biases' gradient noise into parameter differences
above the floor (gpt3-175b@tiny, 0.6 relative), so float32 runs of models with q/k/v biases fail
the parameter check (docs/executor.md). This is what `meshplan verify` prints.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from meshplan.executor.reference import FrozenRecord, RunResult, RunSpec, reference_run

__all__ = ["FLOOR", "REPLICA_TOLERANCE", "TINY", "TOLERANCE", "Comparison", "compare_to_reference", "merge_reports",
           "relative_error"]

TOLERANCE: Mapping[str, float] = {"float64": 1e-6, "float32": 1e-4}
FLOOR = 1e-6  # a tensor's scale is at least this times the largest of its kind (see above)
TINY = 1e-30  # and at least this: an all-zero reference tensor (e.g. an expert no token chose) divides by it
# ranks holding the same tensor ran the same ops in the same order: on a CPU that is bitwise, so rounding only; on a
# GPU float32 attention and GEMM backwards reduce in a nondeterministic order (atomics: torch's "Reproducibility"
# notes), about 1e-7 per reduction, so replicas agree to float32 rounding accumulated, not bitwise
REPLICA_TOLERANCE: Mapping[str, float] = {"float64": 1e-12, "float32": 1e-6}


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
            what: str) -> tuple[dict[str, float], list[str]]:
    if run is None:
        raise ValueError(f"the result has no {what} (only dp rank 0's result carries them)")
    floor = FLOOR * max((float(b.abs().max()) for b in ref.values() if b.numel()), default=0.0)
    errors = {name: relative_error(run[name], b, floor) for name, b in ref.items() if name in run}
    problems = [f"{what} {name} missing" for name in ref if name not in run]
    problems += [f"{what} {name} not in the reference" for name in run if name not in ref]
    problems += [f"{what} {name} shape {tuple(run[name].shape)} != {tuple(ref[name].shape)}"
                 for name in errors if run[name].shape != ref[name].shape]
    return errors, problems


@dataclass(frozen=True)
class Comparison(FrozenRecord):
    """Relative errors of one run against the reference (see the module docstring for the definition).

    loss_errors: per step; grad_errors: after step 1, by parameter name; param_errors: after the last
    step; problems: names missing on either side or shapes that differ (each fails the check).
    """

    layout: str
    dtype: str
    tolerance: float
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
        return not self.problems and max(self.loss_error, self.grad_error, self.param_error) <= self.tolerance

    def failures(self) -> list[str]:
        """One line per quantity above tolerance (and every problem); empty when ok."""
        out = list(self.problems)
        for i, e in enumerate(self.loss_errors):
            if not e <= self.tolerance:
                out.append(f"loss at step {i + 1}: relative error {e:.3g}")
        for kind, errors in (("gradient", self.grad_errors), ("parameter", self.param_errors)):
            out += [f"{kind} {name}: relative error {e:.3g}" for name, e in errors.items() if not e <= self.tolerance]
        return out

    def summary(self) -> str:
        verdict = "OK" if self.ok else "FAIL"
        return (f"{self.layout}: {verdict} (tolerance {self.tolerance:g}, {self.dtype}): loss {self.loss_error:.2e}, "
                f"gradients {self.grad_error:.2e} (worst {self.worst_grad}), "
                f"parameters after {len(self.loss_errors)} steps {self.param_error:.2e} (worst {self.worst_param})")


def compare_to_reference(result: _Result, reference: RunResult | None = None,
                         tolerance: float | None = None) -> Comparison:
    """Hold `result` (dp rank 0's, which carries the full gradients and parameters) against the reference.

    reference: `reference_run(result.run)`, computed here if not given (pass it to compare many layouts of
    one run). tolerance: default TOLERANCE[run.dtype].
    """
    run = result.run
    if reference is None:
        reference = reference_run(run)
    elif reference.run != run:
        raise ValueError("the reference was computed for a different run")
    if tolerance is None:
        tolerance = TOLERANCE[run.dtype]
    if len(result.losses) != len(reference.losses):
        raise ValueError(f"{len(result.losses)} losses but the reference ran {len(reference.losses)} steps")
    loss_errors = tuple(relative_error(a, b) for a, b in zip(result.losses, reference.losses, strict=True))
    grad_errors, grad_problems = _errors(result.grads, reference.grads, "gradient")
    param_errors, param_problems = _errors(result.params, reference.params, "parameter")
    return Comparison(layout=result.layout, dtype=run.dtype, tolerance=tolerance, loss_errors=loss_errors,
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
