"""Fitting a serving engine's parameters (costmodels/engine_calibration.py) to measured deployments, and the
held-out error: leave one model out (issue 45, item 2).

Pricing a deployment runs its benchmark iteration by iteration (aic_deployments.price), too slow to repeat inside a
fit. So each deployment is priced once at a centre and once with each parameter moved from it (secant slopes), and
the fit works on the resulting local model of log TTFT and log TPOT:
    prediction = base x exp(sum_j slope_j x (log factor_j - centre_j)) + slope_iteration x (iteration_s - centre)
                 (+ request_s - centre, for TTFT),
the factors entering multiplicatively (a kernel's rate scales its time) and the two times additively. The rows are
linearised twice (calibration_rows): at the prior's centre, then again at their engine's fit, and fit once more: one
outer Gauss-Newton step, so the local model is exact where the fit lands rather than where it started (Nocedal and
Wright, "Numerical Optimization", 2nd ed., sec. 10.3). Each fold of the held-out check takes the same step at its own
fit (leave_one_model_out). The fitted parameters are then checked by pricing the held-out
deployments in full with them, not with the local model.

The fit is maximum a posteriori under independent Gaussian priors (costmodels/fit.py's, for the factors), with a
robust loss on the residuals log(predicted / measured): Huber's (Huber 1964, "Robust Estimation of a Location
Parameter"), solved by iteratively reweighted Gauss-Newton (Holland and Welsch 1977) and projected onto the
parameters' physical bounds. A measured TTFT may hold queueing that no engine model sees (a cap on running sequences
the row does not state), so a far-off row must not drag the rest; a disaggregated row's TTFT is not fit at all
(_residuals). Posterior spreads: the Laplace approximation, as fit.py's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import numpy as np

from meshplan.costmodels.aic_deployments import (Deployment, Priced, deployment_model, little_throughput, price,
                                                 relative_errors)
from meshplan.costmodels.engine_calibration import ADDITIVE, BOUNDS, FACTORS, EngineParameters, parameters_of
from meshplan.costmodels.fit import PRIOR_SD
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.serving_uncertainty import residuals_of
from meshplan.hardware_db.calibration import (CALIBRATION_SCHEMA_VERSION, EngineCalibration, FittedFactor,
                                              ServingResidual)
from meshplan.hardware_db.errors import InputError

__all__ = ["Sensitivity", "EngineFit", "sensitivity", "sensitivities", "relinearized", "calibration_rows",
           "fit_engine", "fit_engines", "leave_one_model_out", "architecture", "engine_calibration", "parameters_of",
           "median_errors", "NOISE_SD"]

NAMES = FACTORS + ADDITIVE
# Priors of the two additive times (centre, spread; seconds): stated assumptions, wide against what the rows show:
# no host time at the centre, a few ms per iteration and tens of ms per request plausible.
ADDITIVE_PRIOR = {"iteration_s": (0.0, 0.005), "request_s": (0.0, 0.1)}
FACTOR_STEP = 0.1  # secant step of a log factor (10 %: the benchmark's discrete waves make small steps noisy)
ITERATION_STEP = 0.002  # secant step of the iteration time, seconds
# The residuals' noise (log): a measured TPOT against the model's, and TTFT, which queueing makes noisier. Stated
# assumptions: AIConfigurator's own estimates of these rows miss by a median 24 % (TPOT) and 50 % (TTFT) (issue 45).
NOISE_SD = {"ttft": 0.3, "tpot": 0.1}
HUBER = 1.5  # residuals beyond 1.5 noise spreads count linearly, not squared


@dataclass(frozen=True)
class Sensitivity:
    """A deployment priced at `centre` (default: the prior's centre), and the slopes there of log TTFT and log
    TPOT in each factor's log (FACTORS order) and of TTFT and TPOT (seconds per second) in the iteration time."""

    deployment: Deployment
    ttft_s: float
    tpot_s: float
    log_slopes: tuple[tuple[float, float], ...]  # (d log TTFT, d log TPOT) per factor
    iteration_slopes: tuple[float, float]
    centre: EngineParameters = EngineParameters()
    uncalibrated: tuple[float, float] | None = None  # (TTFT, TPOT) seconds at the prior's centre, if not the centre

    def uncalibrated_s(self) -> tuple[float, float]:
        """(TTFT, TPOT) seconds with the defaults: the error every calibrated figure is set beside."""
        if self.uncalibrated is not None:
            return self.uncalibrated
        if self.centre != EngineParameters():
            raise ValueError(f"{self.deployment.id} was linearised off the defaults without their figures")
        return self.ttft_s, self.tpot_s

    def predict(self, p: EngineParameters) -> tuple[float, float]:
        """(TTFT, TPOT) seconds under `p` by the local model (module docstring)."""
        logs, at = dict(p.log_factors), dict(self.centre.log_factors)
        moved = [logs.get(n, 0.0) - at.get(n, 0.0) for n in FACTORS]
        a = sum(s[0] * x for s, x in zip(self.log_slopes, moved, strict=True))
        b = sum(s[1] * x for s, x in zip(self.log_slopes, moved, strict=True))
        iteration = p.iteration_s - self.centre.iteration_s
        ttft = (self.ttft_s * math.exp(a) + self.iteration_slopes[0] * iteration
                + p.request_s - self.centre.request_s)
        tpot = self.tpot_s * math.exp(b) + self.iteration_slopes[1] * iteration
        return ttft, tpot


def sensitivity(d: Deployment, centre: EngineParameters | None = None) -> Sensitivity:
    """A deployment's Sensitivity at `centre` (default the prior's; 1 + FACTORS + 1 pricings); InputError where it
    cannot be priced."""
    centre = centre or EngineParameters()
    def run(p: EngineParameters) -> Priced:
        return price(d, engine=p)

    base = run(centre)
    ttft, tpot = base.ttft_ms / 1e3, base.tpot_ms / 1e3
    logs = dict(centre.log_factors)
    slopes = []
    for name in FACTORS:
        step = FACTOR_STEP if logs.get(name, 0.0) + FACTOR_STEP <= BOUNDS[name][1] else -FACTOR_STEP
        moved = run(dataclasses.replace(centre, log_factors=tuple(
            (n, logs.get(n, 0.0) + (step if n == name else 0.0)) for n in FACTORS)))
        slopes.append((math.log(moved.ttft_ms / 1e3 / ttft) / step, math.log(moved.tpot_ms / 1e3 / tpot) / step))
    it = run(dataclasses.replace(centre, iteration_s=centre.iteration_s + ITERATION_STEP))
    # longer iterations never make a request faster: a negative secant is the benchmark's waves shifting, so 0
    return Sensitivity(d, ttft, tpot, tuple(slopes), (max(0.0, (it.ttft_ms / 1e3 - ttft) / ITERATION_STEP),
                                                      max(0.0, (it.tpot_ms / 1e3 - tpot) / ITERATION_STEP)),
                       centre)


@dataclass(frozen=True)
class EngineFit:
    """Fitted parameters with their posterior spreads (FACTORS then ADDITIVE order), and the rows' residuals
    log(predicted / measured) of TTFT and TPOT under the local model, at the prior's centre and fitted."""

    parameters: EngineParameters
    spread: tuple[float, ...]
    rows: int
    before: tuple[tuple[float, float], ...]
    after: tuple[tuple[float, float], ...]


def _residuals(rows: Sequence[Sensitivity], p: EngineParameters) -> np.ndarray:
    """log(predicted / measured) of each row's TTFT and TPOT under `p`; a disaggregated row's TTFT is left out of
    the fit (0): its measured TTFTs hold seconds at a few dozen users where a prefill takes tens of milliseconds
    (docs/serving.md), a cost none of the parameters stands for, which would pull on those that set every
    aggregated TTFT. Its TPOT stays, and the held-out figures score both."""
    out = np.empty((len(rows), 2))
    for i, s in enumerate(rows):
        ttft, tpot = s.predict(p)
        d = s.deployment
        out[i] = (0.0 if d.prefill is not None else math.log(ttft * 1e3 / d.ttft_ms),
                  math.log(tpot * 1e3 / d.tpot_ms))
    return out


def _prior(centre: EngineParameters | None, scale: float) -> tuple[np.ndarray, np.ndarray]:
    mean = np.array(centre.vector() if centre is not None else
                    [0.0] * len(FACTORS) + [ADDITIVE_PRIOR[n][0] for n in ADDITIVE])
    sd = np.array([PRIOR_SD[n] for n in FACTORS] + [ADDITIVE_PRIOR[n][1] for n in ADDITIVE]) * scale
    return mean, sd


def fit_engine(rows: Sequence[Sensitivity], centre: EngineParameters | None = None, prior_scale: float = 1.0,
               iterations: int = 30, held: frozenset[str] = frozenset()) -> EngineFit:
    """The engine's parameters that best explain these rows' TTFT and TPOT under the priors (module docstring):
    centred on the defaults, or on `centre` (the fit one level up: to every engine's rows), with the spreads times
    `prior_scale`; the parameters named in `held` stay at the centre (their spread: the prior's, which no row
    informs)."""
    if not rows:
        raise InputError("no measured deployments to calibrate the engine on")
    mean, sd = _prior(centre, prior_scale)
    lo = np.array([BOUNDS[n][0] for n in NAMES])
    hi = np.array([BOUNDS[n][1] for n in NAMES])
    noise = np.array([NOISE_SD["ttft"], NOISE_SD["tpot"]])
    theta = np.clip(mean.copy(), lo, hi)

    def params(t: np.ndarray) -> EngineParameters:
        return EngineParameters.of_vector(tuple(t.tolist()))

    def weighted(r: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        z = r / noise  # Huber's weights: 1 within the threshold, threshold / |z| beyond
        w = np.where(np.abs(z) <= HUBER, 1.0, HUBER / np.maximum(np.abs(z), 1e-12))
        return (z * np.sqrt(w)).ravel(), np.sqrt(w).ravel() / np.tile(noise, len(r))

    def objective(t: np.ndarray) -> float:
        z = _residuals(rows, params(t)) / noise
        a = np.abs(z)
        loss = np.where(a <= HUBER, 0.5 * z * z, HUBER * a - 0.5 * HUBER ** 2)
        return float(loss.sum() + 0.5 * np.sum(((t - mean) / sd) ** 2))

    steps = np.maximum(sd * 0.05, 1e-6)

    def jacobian(t: np.ndarray, r: np.ndarray) -> np.ndarray:
        """Of the weighted residuals, by forward differences (the weights held)."""
        _, scale = weighted(r)
        jac = np.zeros((2 * len(rows), len(NAMES)))
        for j in range(len(NAMES)):
            if NAMES[j] in held:  # no column: the step leaves it at the centre
                continue
            moved = t.copy()
            moved[j] += steps[j]
            jac[:, j] = (_residuals(rows, params(moved)) - r).ravel() / steps[j] * scale
        return jac

    r = _residuals(rows, params(theta))
    before = r.copy()
    for _ in range(iterations):
        jac = jacobian(theta, r)
        z, _ = weighted(r)
        normal = jac.T @ jac + np.diag(1 / sd ** 2)
        gradient = jac.T @ z + (theta - mean) / sd ** 2
        current = objective(theta)
        step = -np.linalg.solve(normal, gradient)
        for _ in range(20):  # halve the step until it lowers the objective (projected onto the bounds)
            trial = np.clip(theta + step, lo, hi)
            if objective(trial) < current:
                break
            step /= 2
        else:
            break
        moved_by = float(np.max(np.abs(trial - theta) / sd))
        theta = trial
        r = _residuals(rows, params(theta))
        if moved_by < 1e-4:
            break
    jac = jacobian(theta, r)
    posterior = np.linalg.inv(jac.T @ jac + np.diag(1 / sd ** 2))
    return EngineFit(params(theta), tuple(np.sqrt(np.diag(posterior)).tolist()), len(rows),
                     tuple(map(tuple, before.tolist())), tuple(map(tuple, r.tolist())))


def architecture(d: Deployment) -> str:
    """The model a row's checkpoint is an instance of, for leaving one model out: checkpoints of one architecture
    (DeepSeek-R1 and V3, a model and its FP8 or NVFP4 quantisation) are one model, since they share every shape the
    engine times. Named by those shapes: hidden size, layers, heads, FFN width and experts."""
    return model_architecture(deployment_model(d.model_path))


def model_architecture(m: ModelSpec) -> str:
    """architecture's name of a model's shapes."""
    moe = f" E{m.moe.num_experts}k{m.moe.top_k}" if m.moe is not None else ""
    return f"h{m.hidden} L{m.num_layers} H{m.num_heads} F{m.ffn_hidden}{moe}"


# An engine's parameters are fit with their priors centred on the fit to every engine's rows (the same GPUs'
# kernels under every engine), spreads a third of the defaults' priors: partial pooling (Gelman et al., "Bayesian
# Data Analysis", 3rd ed., ch. 5), so an engine with few models' rows keeps near what all of them show. A third
# level per GPU was tried and left out: with two to four models per engine and GPU it fit each model's own errors
# (held-out TPOT 20.8 % against 18.1 %, benchmarks/RESULTS.md "Engine calibration").
ENGINE_PRIOR_SCALE = 1 / 3
# The kernels' factors are held at the GPU's defaults and only the engine's host times (iteration_s, request_s) are
# fit: decode's GEMMs and attention now come from the engines' measured kernel tables (hardware_db/decode_kernels.toml),
# and factors fit to whole deployments chased each model's own errors, which held out made TPOT worse than none: 20.0
# against 15.0 % uncalibrated over 2,116 rows (benchmarks/RESULTS.md, stop 56).
ENGINE_HELD = frozenset(FACTORS)


def fit_engines(rows: Sequence[Sensitivity], held: frozenset[str] = ENGINE_HELD) -> dict[str, EngineFit]:
    """Each engine's fit (by Deployment.engine), its priors centred on the fit to all rows; `held` stays at the
    defaults."""
    pooled = fit_engine(rows, held=held).parameters
    return {engine: fit_engine([s for s in rows if s.deployment.engine == engine], pooled, ENGINE_PRIOR_SCALE,
                               held=held)
            for engine in sorted({s.deployment.engine for s in rows})}


def leave_one_model_out(rows: Sequence[Sensitivity], jobs: int = 1, engines: Sequence[str] | None = None,
                        progress: Callable[[str], None] | None = None) -> dict[tuple[str, str], EngineParameters]:
    """(engine, architecture) -> the parameters that engine's rows of that model are predicted with, for `engines`
    (default all): fit_engines on the rows of every other model (of every engine), so neither level saw the model,
    with the fold's own outer step (the module docstring): that engine's rows linearised again at the fold's fit,
    and fit once more. A fold lands far from the fit to all rows (DeepSeek left out moves SGLang's launch cost
    x0.45 -> x1.3), where slopes taken at the latter mislead (benchmarks/RESULTS.md "Stop 52"). The fold's first
    fit starts from the rows' slopes as given (at the fit to all rows, after calibration_rows): a point of expansion
    only; no residual of the left-out model enters the fold's objective. `progress` hears of each fold."""
    out = {}
    archs = sorted({architecture(s.deployment) for s in rows})
    for n, arch in enumerate(archs, 1):
        others = [s for s in rows if architecture(s.deployment) != arch]
        fits = fit_engines(others)
        wanted = sorted({s.deployment.engine for s in rows if architecture(s.deployment) == arch} & set(fits)
                        & set(engines if engines is not None else fits))
        if not wanted:
            continue
        fits = fit_engines(_relinearized_at(others, {e: fits[e].parameters for e in wanted}, jobs))
        for engine in wanted:
            out[(engine, arch)] = fits[engine].parameters
        if progress is not None:
            progress(f"model {n} of {len(archs)} left out ({arch}): fit, linearised again there, fit again")
    return out


def _sensitivity_or_none(job: tuple[Deployment, EngineParameters]) -> Sensitivity | None:
    try:
        return sensitivity(*job)
    except InputError:
        return None


def _priced(jobs: Sequence[tuple[Deployment, EngineParameters]], workers: int) -> list[Sensitivity | None]:
    if workers <= 1:
        return [_sensitivity_or_none(j) for j in jobs]
    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_sensitivity_or_none, jobs, chunksize=8))


def sensitivities(deployments: Sequence[Deployment], jobs: int = 1) -> list[Sensitivity]:
    """Every deployment that can be priced, with its slopes at the prior's centre (rows that cannot are left out:
    serving_aic.py counts them with their reasons), over `jobs` processes."""
    found = _priced([(d, EngineParameters()) for d in deployments], jobs)
    return [s for s in found if s is not None]


def _relinearized_at(rows: Sequence[Sensitivity], centres: dict[str, EngineParameters],
                     jobs: int) -> list[Sensitivity]:
    """The rows of the engines in `centres` linearised again at their engine's centre (kept where that cannot be
    priced); the other rows as they were."""
    moved = [i for i, s in enumerate(rows) if s.deployment.engine in centres]
    found = _priced([(rows[i].deployment, centres[rows[i].deployment.engine]) for i in moved], jobs)
    out = list(rows)
    for i, new in zip(moved, found, strict=True):
        if new is not None:
            out[i] = dataclasses.replace(new, uncalibrated=rows[i].uncalibrated_s())
    return out


def relinearized(rows: Sequence[Sensitivity], jobs: int = 1,
                 fits: dict[str, EngineFit] | None = None) -> list[Sensitivity]:
    """The rows linearised again at their engine's fit to them (`fits` where already made, else fit_engines): the
    outer step of the module docstring. A row that cannot be priced there keeps its slopes."""
    fits = fits if fits is not None else fit_engines(rows)
    return _relinearized_at(rows, {e: f.parameters for e, f in fits.items()}, jobs)


def calibration_rows(deployments: Sequence[Deployment], jobs: int = 1,
                     progress: Callable[[str], None] | None = None) -> list[Sensitivity]:
    """The priceable deployments with their slopes where the fit lands (sensitivities, then relinearized)."""
    rows = sensitivities(deployments, jobs)
    if progress is not None:
        progress(f"{len(rows):,} of {len(deployments):,} rows priced with slopes at the defaults")
    rows = relinearized(rows, jobs)
    if progress is not None:
        progress("priced again with slopes at each engine's fit")
    return rows


def median_errors(pairs: Sequence[tuple[Deployment, tuple[float, float]]]) -> dict[str, float]:
    """Median |predicted / measured - 1| of each metric (aic_deployments.relative_errors) over (row, (TTFT, TPOT) s)."""
    errs: dict[str, list[float]] = {"ttft": [], "tpot": [], "throughput": []}
    for d, (ttft, tpot) in pairs:
        for metric, value in relative_errors(d, ttft, tpot).items():
            errs[metric].append(abs(value))
    return {m: float(np.median(v)) for m, v in errs.items() if v}


RESIDUAL_DIGITS = 4  # a residual's decimals in the file: 1e-4 in log is 0.01 %, far below any interval's width


def serving_residual(d: Deployment, ttft_s: float, tpot_s: float) -> ServingResidual:
    """A row's held-out error as the serving intervals read it (costmodels/serving_uncertainty.py); its load is the
    users per engine (per decode engine where disaggregated, all of them where the row lacks the engine count)."""
    engines = d.pool.workers if d.prefill is not None and d.pool.workers else 1
    ttft, tpot, throughput = residuals_of(ttft_s, tpot_s, little_throughput(d.users, d.osl, ttft_s, tpot_s, d.gpus),
                                          d.ttft_ms / 1e3, d.tpot_ms / 1e3, d.tokens_per_s_per_gpu)
    m = deployment_model(d.model_path)
    return ServingResidual(id=d.id, model=d.model_path, architecture=model_architecture(m), gpu=d.gpu, mode=d.mode,
                           moe=m.moe is not None,
                           sequences=max(1, round(d.users / engines)), ttft=round(ttft, RESIDUAL_DIGITS),
                           tpot=round(tpot, RESIDUAL_DIGITS),
                           throughput=None if throughput is None else round(throughput, RESIDUAL_DIGITS))


def engine_calibration(rows: Sequence[Sensitivity], engine: str, source: str, created: str, jobs: int = 1,
                       folds: dict[tuple[str, str], EngineParameters] | None = None,
                       progress: Callable[[str], None] | None = None) -> EngineCalibration:
    """The calibration file of one engine: its parameters fit to all rows (fit_engines), and its rows' error
    left one model out (leave_one_model_out, or `folds` where already fit), each model's rows priced in full
    (aic_deployments.price) with parameters that never saw it, beside the uncalibrated error on the same rows."""
    own = [s for s in rows if s.deployment.engine == engine]
    if not own:
        engines = ", ".join(sorted({s.deployment.engine for s in rows}))
        raise InputError(f"no priceable deployment of engine {engine!r}; the rows hold {engines}")
    fitted = fit_engines(rows)[engine]
    folds = folds if folds is not None else leave_one_model_out(rows, jobs, [engine], progress)
    held, same = [], []
    for s in own:
        p = folds.get((engine, architecture(s.deployment)))
        if p is None:
            continue
        try:
            priced = price(s.deployment, engine=p)
        except InputError:
            continue
        held.append((s.deployment, (priced.ttft_ms / 1e3, priced.tpot_ms / 1e3)))
        same.append((s.deployment, s.uncalibrated_s()))
    p = fitted.parameters
    logs = dict(p.log_factors)
    spread = dict(zip(NAMES, fitted.spread, strict=True))
    return EngineCalibration(
        kind="engine", schema_version=CALIBRATION_SCHEMA_VERSION, created=created, engine=engine, source=source,
        rows=len(own), models=sorted({s.deployment.model_path for s in own}),
        gpus=sorted({s.deployment.gpu for s in own}),
        factors={n: FittedFactor(factor=math.exp(logs[n]), log_sd=spread[n]) for n in FACTORS},  # type: ignore[misc]
        iteration_s=p.iteration_s, iteration_sd_s=spread["iteration_s"], request_s=p.request_s,
        request_sd_s=spread["request_s"], held_out=median_errors(held),  # type: ignore[arg-type]
        uncalibrated=median_errors(same),  # type: ignore[arg-type]
        residuals=[serving_residual(d, ttft, tpot) for d, (ttft, tpot) in held])
