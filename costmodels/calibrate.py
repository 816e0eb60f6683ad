"""Fitting a calibration: raw microbenchmark times -> the efficiency model the cost model reads. Pure math, no torch.

- GEMM and attention: seconds as a non-decreasing function of FLOPs (a bigger operator never takes less time),
  by isotonic regression (pool adjacent violators; Barlow et al., "Statistical Inference under Order
  Restrictions", 1972) of the measured times sorted by FLOPs, then log-log interpolation between the points.
- Memory-bound operators: t = alpha + bytes / bandwidth by least squares (the roofline's memory roof, Williams et
  al. CACM 2009, plus a launch cost), over the bytes the cost model counts for each operator.
- Collectives: t = alpha + bytes / beta per kind and group size (Hockney's model; Thakur et al. IJHPCA 2005), and
  one ring fit over all of them (t = steps x latency + share x bytes / bus bandwidth, the shares of comm.py) for
  group sizes that were not measured.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

import numpy as np

from meshplan.costmodels.comm import ring_shape
from meshplan.hardware_db.calibration import (CollectiveFit, CollectiveKind, CollectivePoint, Curve, FittedModel,
                                              LinearFit, Measurements, MemoryClassFit, OptimizerFit)

__all__ = ["fit_curve", "fit_linear", "fit_model", "fit_ring", "interpolate", "isotonic"]


def isotonic(values: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """The non-decreasing sequence closest to `values` in weighted least squares (pool adjacent violators)."""
    w = list(weights) if weights is not None else [1.0] * len(values)
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, wi in zip(values, w, strict=True):
        blocks.append([float(v), float(wi), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2])
    out: list[float] = []
    for mean, _, count in blocks:
        out += [mean] * int(count)
    return out


def fit_curve(flops: Sequence[float], seconds: Sequence[float]) -> Curve:
    """Seconds vs FLOPs, non-decreasing: equal FLOPs pooled (median), then isotonic in log time."""
    by_flops: dict[float, list[float]] = {}
    for f, t in zip(flops, seconds, strict=True):
        by_flops.setdefault(float(f), []).append(float(t))
    xs = sorted(by_flops)
    logs = [math.log(float(np.median(by_flops[x]))) for x in xs]
    fitted = isotonic(logs, [len(by_flops[x]) for x in xs])
    return Curve(flops=tuple(xs), seconds=tuple(math.exp(v) for v in fitted))


def interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """A Curve's seconds at FLOPs x: log-log linear between points; below the first point the first time (a
    smaller operator is launch-bound); above the last the last point's rate (work scales linearly)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1] * x / xs[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    a = math.log(x / x0) / math.log(x1 / x0)
    return math.exp(math.log(y0) + a * (math.log(y1) - math.log(y0)))


def fit_linear(sizes: Sequence[float], seconds: Sequence[float]) -> LinearFit:
    """t = alpha + size / rate, least squares with alpha >= 0 and rate > 0 (relative errors weighted equally)."""
    x = np.asarray(sizes, dtype=float)
    t = np.asarray(seconds, dtype=float)
    w = 1.0 / t  # minimise relative error: small and large sizes count alike
    a = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (alpha, slope), *_ = np.linalg.lstsq(a, t * w, rcond=None)
    if slope <= 0:  # sizes too small to see the bandwidth: charge it all to the largest
        slope = float(t.max() / x.max())
        alpha = 0.0
    if alpha < 0:  # no negative launch cost: the slope through the origin (weighted)
        alpha = 0.0
        slope = float(np.sum(w * w * x * t) / np.sum(w * w * x * x))
    return LinearFit(alpha_s=float(alpha), bytes_per_s=float(1.0 / slope))


def fit_ring(points: Sequence[CollectivePoint]) -> LinearFit:
    """One (per-step latency, bus bandwidth) for every measured collective: t = steps*lat + share*bytes/bw."""
    steps = np.array([ring_shape(p.kind, p.ranks)[0] for p in points])
    share = np.array([ring_shape(p.kind, p.ranks)[1] * p.bytes for p in points])
    t = np.array([p.seconds for p in points])
    w = 1.0 / t
    (lat, inv_bw), *_ = np.linalg.lstsq(np.stack([steps, share], axis=1) * w[:, None], t * w, rcond=None)
    if inv_bw <= 0:
        inv_bw, lat = float(np.max(t / share)), 0.0
    return LinearFit(alpha_s=max(0.0, float(lat)), bytes_per_s=float(1.0 / inv_bw))


def fit_model(m: Measurements) -> FittedModel:
    """The efficiency model of a profile's measurements."""
    fwd = [p for p in m.gemms if p.direction == "forward"]
    bwd = [p for p in m.gemms if p.direction == "backward"]
    gemm = fit_curve([p.flops for p in fwd], [p.seconds for p in fwd])
    gemm_backward = fit_curve([p.flops for p in bwd], [p.seconds for p in bwd]) if len(bwd) >= 2 else None
    attention = fit_curve([p.fwd_flops for p in m.attention], [p.fwd_seconds for p in m.attention])
    attention_backward = fit_curve([2.5 * p.fwd_flops for p in m.attention],  # ops.py: backward = 2.5x forward
                                   [p.bwd_seconds for p in m.attention])
    memory = fit_linear([p.model_bytes for p in m.memory_ops], [p.seconds for p in m.memory_ops])
    classes = []
    for name in sorted({p.name for p in m.memory_ops}):
        pts = [p for p in m.memory_ops if p.name == name]
        if len({p.model_bytes for p in pts}) >= 2:
            f = fit_linear([p.model_bytes for p in pts], [p.seconds for p in pts])
            classes.append(MemoryClassFit(name=name, alpha_s=f.alpha_s, bytes_per_s=f.bytes_per_s))
    optimizer = None
    if len({p.params for p in m.optimizer}) >= 2:
        f = fit_linear([p.params for p in m.optimizer], [p.seconds for p in m.optimizer])
        optimizer = OptimizerFit(alpha_s=f.alpha_s, params_per_s=f.bytes_per_s)
    groups: dict[tuple[CollectiveKind, int], list[CollectivePoint]] = {}
    for c in m.collectives:
        groups.setdefault((c.kind, c.ranks), []).append(c)
    fits = []
    for (kind, ranks), points in sorted(groups.items()):
        f = fit_linear([p.bytes for p in points], [p.seconds for p in points])
        fits.append(CollectiveFit(kind=kind, ranks=ranks, alpha_s=f.alpha_s, bytes_per_s=f.bytes_per_s))
    ratios = {mode: float(np.median([a.measured_bytes / a.predicted_bytes for a in m.activations
                                     if a.recompute == mode]))
              for mode in sorted({a.recompute for a in m.activations})}
    peak = max(p.flops / p.seconds for p in m.gemms)
    return FittedModel(gemm=gemm, attention=attention, gemm_backward=gemm_backward,
                       attention_backward=attention_backward, memory=memory, memory_classes=tuple(classes),
                       optimizer=optimizer, peak_flops=peak, collectives=tuple(fits),
                       ring=fit_ring(m.collectives) if m.collectives else None,
                       activation_ratio=ratios.get("none"), activation_ratios=ratios)
