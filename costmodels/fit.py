"""Calibration from measured runs (issue 44, item 1): a few physical parameters of the cost model, each a factor on
its sourced default, fit to measured step times; and, where the runs give their peak memory, one factor on the
layers' activations fit to it (fit_memory). Never a per-run factor: every run shares the same few.

Each parameter is the log of a factor on defaults the hardware database states (hardware_db/gpus/*.toml):
- gemm: every GEMM kernel ceiling (BF16, FP8, grouped);
- attention: every attention kernel ceiling (forward and backward, each kernel);
- memory: the memory-bound kernels' share of HBM bandwidth;
- network: the collectives' share of the link rates (scale-up ring and all-to-all, scale-out);
- overhead: the launch cost per operator.
Ceilings and shares stay at 1 or below.

The fit is regularised least squares in log space (maximum a posteriori with a Gaussian prior on each log factor,
centred on the default: ridge regression), solved by Gauss-Newton with Levenberg-Marquardt damping (Nocedal and
Wright, "Numerical Optimization", 2nd ed. 2006, sec. 10.3) over the residuals log(predicted / measured step time);
the Jacobian by forward differences. The posterior spread of each parameter is the square root of the diagonal of
(J^T J / noise^2 + prior^-2)^-1 at the optimum (the Laplace approximation).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from meshplan.costmodels.config import ParallelConfig, Workload
from meshplan.costmodels.efficiency import Efficiency, scaled
from meshplan.costmodels.estimate import estimate
from meshplan.costmodels.memory import GIB
from meshplan.costmodels.model import ModelSpec
from meshplan.hardware_db.calibration import (CALIBRATION_SCHEMA_VERSION, FactorCalibration, FittedFactor,
                                              default_calibration, public_log_factors)
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import GPUSpec, load_gpu

PARAMETERS = ("gemm", "attention", "memory", "network", "overhead")
MemoryKind = Literal["peak", "allocated", "reserved"]
# Prior spread of each log factor: how far a default may plausibly be off. Stated assumptions, not measured spreads
# (issue 44 wants them from AIConfigurator's kernel tables next): kernel ceilings and HBM share about 10 %; attention
# more, as its kernels differ between versions (FA2, FA3, cuDNN); the network's achieved share depends on the fabric
# and NCCL's tuning, tens of percent between clusters of one GPU; the launch cost (4 us) is a rough assumption.
PRIOR_SD = {"gemm": 0.1, "attention": 0.15, "memory": 0.1, "network": 0.3, "overhead": 0.7}
# Memory: one factor on the layers' activations (the term the memory model derives, where frameworks differ most:
# what each saves for the backward; the model states are exact counts). Its prior spread and a measured peak's
# noise, log: stated assumptions. The development sets' peaks sit within -9..+9 % of the defaults but for
# torchtitan's pipelined 405B runs (benchmarks/RESULTS.md), so 0.2 lets a framework's own saving habits show.
ACTIVATION_PRIOR_SD = 0.2
MEMORY_NOISE_SD = 0.05
NOISE_SD = 0.1  # a measured step against the model's, log: the development sets' cross-validated error (~10 %)
STEP = 0.01  # forward-difference step, in log factor
FOLDS = 5  # the held-out error's folds (fewer runs: leave one out)


@dataclass(frozen=True)
class MeasuredStep:
    """A run as measured: its configuration and step time."""

    model: ModelSpec
    cluster: ClusterSpec
    workload: Workload
    config: ParallelConfig
    runtime: str
    step_time_s: float
    peak_memory_gib: float | None = None  # where the run reports it
    # what that counts: "allocated" (Megatron's log), "reserved" (torchtitan's, the allocator's cache included)
    memory_kind: MemoryKind = "peak"


@dataclass(frozen=True)
class Fit:
    """The fitted log factors with their posterior spread, and each run's residual before and after."""

    parameters: tuple[str, ...]
    log_factors: tuple[float, ...]
    log_sd: tuple[float, ...]
    before: tuple[float, ...]  # log(predicted / measured) with the defaults
    after: tuple[float, ...]  # with the fitted factors
    centred: tuple[float, ...] = ()  # with the factors the priors centre on (prior_mean), where not the defaults
    held: tuple[tuple[str, float], ...] = ()  # factors not fit, held at their prior's centre (name, log factor)

    def factor(self, name: str) -> float:
        return math.exp(self.log_factors[self.parameters.index(name)])

    def all_log_factors(self) -> dict[str, float]:
        """Every factor the predictions used: the fitted ones and those held at their prior's centre."""
        return {**dict(self.held), **dict(zip(self.parameters, self.log_factors, strict=True))}


def predicted_steps(steps: Sequence[MeasuredStep], gpu: GPUSpec, log_factors: dict[str, float]) -> np.ndarray:
    """Each run's predicted step time under these factors."""
    g, eff = scaled(gpu, Efficiency.from_gpu(gpu), log_factors)
    return np.array([estimate(s.model, Cluster(s.cluster, gpu=g), s.workload, s.config, s.runtime, eff).step_time_s
                     for s in steps])


@dataclass(frozen=True)
class MemoryFit:
    """The fitted log factor on activation memory with its posterior spread, and each run's residual
    log(predicted / measured peak) before and after."""

    log_factor: float
    log_sd: float
    before: tuple[float, ...]
    after: tuple[float, ...]


def predicted_peaks(steps: Sequence[MeasuredStep], log_activation: float) -> np.ndarray:
    """Each run's predicted peak memory (GiB) in what its measurement counts, with the activations scaled: the
    fullest stage's total with its fragmentation allowance for a reserved or unspecified peak, without it for
    Megatron's max allocated (the allocator's blocks, not its cache)."""
    out = []
    for s in steps:
        gpu = load_gpu(s.cluster.gpu)
        eff = dataclasses.replace(Efficiency.from_gpu(gpu), activation_factor=math.exp(log_activation))
        est = estimate(s.model, Cluster(s.cluster, gpu=gpu), s.workload, s.config, s.runtime, eff)
        top = max(est.stages, key=lambda stage: stage.peak_gib)
        out.append(top.peak_gib - (top.memory.fragmentation / GIB if s.memory_kind == "allocated" else 0.0))
    return np.array(out)


def fit_memory(steps: Sequence[MeasuredStep], prior_sd: float = ACTIVATION_PRIOR_SD,
               noise_sd: float = MEMORY_NOISE_SD, iterations: int = 12) -> MemoryFit | None:
    """The activation factor that best explains the runs' measured peaks under its prior (centred on 1), as fit()
    does for step times: Gauss-Newton in log space, one parameter. None without a measured peak."""
    measured_runs = [s for s in steps if s.peak_memory_gib is not None]
    if not measured_runs:
        return None
    measured = np.log([s.peak_memory_gib or 0.0 for s in measured_runs])

    def residuals(theta: float) -> np.ndarray:
        return np.log(predicted_peaks(measured_runs, theta)) - measured

    theta, r = 0.0, residuals(0.0)
    before = r
    slope = np.zeros(len(measured_runs))
    for _ in range(iterations):
        slope = (residuals(theta + STEP) - r) / STEP
        normal = float(slope @ slope) / noise_sd ** 2 + 1 / prior_sd ** 2
        delta = -(float(slope @ r) / noise_sd ** 2 + theta / prior_sd ** 2) / normal
        theta += delta
        r = residuals(theta)
        if abs(delta) < 1e-4:
            break
    spread = (float(slope @ slope) / noise_sd ** 2 + 1 / prior_sd ** 2) ** -0.5
    return MemoryFit(theta, spread, tuple(before.tolist()), tuple(r.tolist()))


def memory_errors(steps: Sequence[MeasuredStep]) -> list[tuple[MeasuredStep, float]]:
    """(run, predicted / measured - 1) of peak memory with the defaults, for the runs that report it (fit_memory
    fits the activation factor; the time factors move time only)."""
    out = []
    for s in steps:
        if s.peak_memory_gib is not None:
            predicted = estimate(s.model, Cluster(s.cluster), s.workload, s.config, s.runtime).peak_memory_gib
            out.append((s, predicted / s.peak_memory_gib - 1))
    return out


def fit(steps: Sequence[MeasuredStep], parameters: Sequence[str] = PARAMETERS,
        prior_sd: dict[str, float] | None = None, noise_sd: float = NOISE_SD, iterations: int = 12,
        prior_mean: dict[str, float] | None = None) -> Fit:
    """The factors that best explain the measured step times under their priors (module docstring), each prior
    centred on the default (log factor 0) or on `prior_mean` (a measured centre: costmodels/kernel_tables.py). All
    runs on one GPU type (a calibration is of one device)."""
    if not steps:
        raise InputError("no measured runs to calibrate on")
    kinds = {s.cluster.gpu for s in steps}
    if len(kinds) > 1:
        raise InputError(f"the runs are on {len(kinds)} GPU types ({', '.join(sorted(kinds))}); calibrate one at a "
                         f"time")
    unknown = sorted(set(parameters) - set(PARAMETERS))
    if unknown:
        raise InputError(f"unknown parameter {unknown[0]!r}; choose from {', '.join(PARAMETERS)}")
    sd = np.array([(prior_sd or PRIOR_SD)[p] for p in parameters])
    mu = np.array([(prior_mean or {}).get(p, 0.0) for p in parameters])
    gpu = load_gpu(steps[0].cluster.gpu)
    measured = np.log([s.step_time_s for s in steps])

    held = {name: value for name, value in (prior_mean or {}).items() if name not in parameters}

    def residuals(theta: np.ndarray) -> np.ndarray:
        factors = {**held, **dict(zip(parameters, theta.tolist(), strict=True))}
        return np.log(predicted_steps(steps, gpu, factors)) - measured

    def objective(theta: np.ndarray, r: np.ndarray) -> float:
        return float(np.sum((r / noise_sd) ** 2) + np.sum(((theta - mu) / sd) ** 2))

    theta = mu.copy()
    r = residuals(theta)
    centred = tuple(r.tolist()) if prior_mean else ()
    before = r if not prior_mean else (  # the defaults' residuals
        np.log(predicted_steps(steps, gpu, {})) - measured)
    damping = 1e-3
    jacobian = np.zeros((len(steps), len(parameters)))
    for _ in range(iterations):
        for j in range(len(parameters)):
            step = theta.copy()
            step[j] += STEP
            jacobian[:, j] = (residuals(step) - r) / STEP
        normal = jacobian.T @ jacobian / noise_sd ** 2 + np.diag(1 / sd ** 2)
        gradient = jacobian.T @ r / noise_sd ** 2 + (theta - mu) / sd ** 2
        moved = 0.0
        while damping < 1e6:  # a step that lowers the objective, shortened (damped) until one does
            delta = np.linalg.solve(normal + damping * np.diag(np.diag(normal)), -gradient)
            trial = residuals(theta + delta)
            if objective(theta + delta, trial) < objective(theta, r):
                theta, r, damping, moved = theta + delta, trial, damping / 10, float(np.max(np.abs(delta)))
                break
            damping *= 10
        if moved < 1e-4:  # converged, or no step lowers the objective
            break
    posterior = np.linalg.inv(jacobian.T @ jacobian / noise_sd ** 2 + np.diag(1 / sd ** 2))
    return Fit(tuple(parameters), tuple(theta.tolist()), tuple(np.sqrt(np.diag(posterior)).tolist()),
               tuple(before.tolist()), tuple(r.tolist()), centred, tuple(sorted(held.items())))


def prior_centre(steps: Sequence[MeasuredStep], prior: Literal["public", "defaults"]) -> tuple[dict[str, float], str]:
    """The log factors a calibration's priors centre on, and their name: with "public", the runs' GPU's public
    calibration where meshplan ships one (what plan uses without --calibration), so a few runs refine it rather
    than start from the defaults again; else the defaults (empty)."""
    gpu = steps[0].cluster.gpu if steps else ""
    found = public_log_factors(gpu) if prior == "public" and steps else None
    return (found, str(default_calibration(gpu))) if found else ({}, "defaults")


def calibration_from_runs(steps: Sequence[MeasuredStep], sources: Sequence[str],
                          parameters: Sequence[str] = PARAMETERS, created: str = "",
                          prior_mean: dict[str, float] | None = None, prior: str = "defaults") -> FactorCalibration:
    """The calibration file's content: the factors fit to every run, their error on the runs before and after, and
    the held-out error: each of up to FOLDS folds of the runs predicted by a fit to the others (None with one
    run). `prior` names where `prior_mean` comes from (the public calibration, a kernel table), for the record."""
    fitted = fit(steps, parameters, prior_mean=prior_mean)
    folds = min(len(steps), FOLDS)
    held_before: list[float] = []
    held_after: list[float] = []
    for k in range(folds if folds > 1 else 0):
        test = list(steps[k::folds])
        train = [s for n, s in enumerate(steps) if n % folds != k]
        part = fit(train, parameters, prior_mean=prior_mean)
        predicted = predicted_steps(test, load_gpu(test[0].cluster.gpu),
                                    part.all_log_factors())
        defaults = predicted_steps(test, load_gpu(test[0].cluster.gpu), {})
        held_after += [abs(s.step_time_s / p - 1) for s, p in zip(test, predicted.tolist(), strict=True)]
        held_before += [abs(s.step_time_s / p - 1) for s, p in zip(test, defaults.tolist(), strict=True)]
    return FactorCalibration(
        kind="factors", schema_version=CALIBRATION_SCHEMA_VERSION, created=created, gpu=steps[0].cluster.gpu,
        runtimes=sorted({s.runtime for s in steps}), runs=len(steps), sources=list(sources),
        factors={**{name: FittedFactor(factor=math.exp(value), log_sd=PRIOR_SD[name])  # type: ignore[misc]
                    for name, value in fitted.held},  # held at the prior's centre, with the prior's spread
                 **{name: FittedFactor(factor=math.exp(value), log_sd=sd)  # type: ignore[misc]
                    for name, value, sd in zip(fitted.parameters, fitted.log_factors, fitted.log_sd, strict=True)}},
        error_before=float(np.mean([abs(math.exp(-r) - 1) for r in fitted.before])),
        error_after=float(np.mean([abs(math.exp(-r) - 1) for r in fitted.after])),
        prior=prior,
        error_prior=float(np.mean([abs(math.exp(-r) - 1) for r in fitted.centred])) if fitted.centred else None,
        held_out_before=float(np.mean(held_before)) if held_before else None,
        held_out_after=float(np.mean(held_after)) if held_after else None,
        **memory_calibration(steps))


def memory_calibration(steps: Sequence[MeasuredStep]) -> dict:
    """The calibration's memory fields: the activation factor fit to every run with a measured peak, its error on
    them before and after, and held out (each of up to FOLDS folds predicted by a fit to the others); nothing
    without a measured peak."""
    measured = [s for s in steps if s.peak_memory_gib is not None]
    fitted = fit_memory(measured)
    if fitted is None:
        return {}
    folds = min(len(measured), FOLDS)
    held_before: list[float] = []
    held_after: list[float] = []
    for k in range(folds if folds > 1 else 0):
        test = measured[k::folds]
        part = fit_memory([s for n, s in enumerate(measured) if n % folds != k])
        assert part is not None
        for s, defaults, after in zip(test, predicted_peaks(test, 0.0).tolist(),
                                      predicted_peaks(test, part.log_factor).tolist(), strict=True):
            assert s.peak_memory_gib is not None
            held_before.append(abs(defaults / s.peak_memory_gib - 1))
            held_after.append(abs(after / s.peak_memory_gib - 1))
    return {"activations": FittedFactor(factor=math.exp(fitted.log_factor), log_sd=fitted.log_sd),
            "memory_runs": len(measured),
            "memory_error_before": float(np.mean([abs(math.exp(r) - 1) for r in fitted.before])),
            "memory_error_after": float(np.mean([abs(math.exp(r) - 1) for r in fitted.after])),
            "memory_held_out_before": float(np.mean(held_before)) if held_before else None,
            "memory_held_out_after": float(np.mean(held_after)) if held_after else None}
