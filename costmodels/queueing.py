"""Waiting in line: the delays a serving engine adds at a request rate, and the percentiles users set targets on.

A request waits for a running slot (max_num_seqs: c slots, each held for a request's generation: M/G/c) and for
its prompt's turn at the prefill budget (one server per attention group: M/G/1). Arrivals are Poisson. The mean
wait of M/G/c is Allen and Cunneen's: the M/M/c wait (Erlang C) times (1 + cs^2) / 2, cs^2 the squared coefficient
of variation of the service time (Allen, "Probability, Statistics and Queueing Theory", 2nd ed. 1990, eq. 6.50;
for c = 1 it is Pollaczek-Khinchine's exactly). A wait, given that there is one, is taken as exponential (exact for
M/M/c; Kingman's heavy-traffic limit for M/G/1, Kingman 1961), so its percentiles follow from its mean and the
probability of waiting at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

__all__ = ["Percentile", "PERCENTILES", "erlang_c", "Wait", "mgc_wait", "occupancy_quantile"]

Percentile = Literal["mean", "p50", "p90", "p99"]
PERCENTILES: dict[str, float | None] = {"mean": None, "p50": 0.5, "p90": 0.9, "p99": 0.99}
_EXACT_SERVERS = 512  # Erlang B's recursion up to this many servers, Halfin-Whitt's limit above


def erlang_c(servers: int, offered: float) -> float:
    """P(an arrival waits) in M/M/c with `offered` = arrival rate x mean service time (Erlangs).

    Up to 512 servers by Erlang B's recursion B(k) = a B(k-1) / (k + a B(k-1)) and C = B / (1 - rho (1 - B))
    (Cooper, "Introduction to Queueing Theory", 2nd ed. 1981, sec. 3.4); above, the Halfin-Whitt limit
    C = 1 / (1 + beta Phi(beta) / phi(beta)), beta = (c - a) / sqrt(c) (Halfin and Whitt, Oper. Res. 1981)."""
    if offered <= 0:
        return 0.0
    if offered >= servers:
        return 1.0
    if servers <= _EXACT_SERVERS:
        b = 1.0
        for k in range(1, servers + 1):
            b = offered * b / (k + offered * b)
        rho = offered / servers
        return b / (1.0 - rho * (1.0 - b))
    beta = (servers - offered) / math.sqrt(servers)
    if beta > 30.0:  # phi(beta) underflows; C is below 1e-190
        return 0.0
    unit = NormalDist()
    return 1.0 / (1.0 + beta * unit.cdf(beta) / unit.pdf(beta))


@dataclass(frozen=True)
class Wait:
    """A queue's waiting time: the probability of waiting at all and the mean wait of those who do (exponential)."""

    p_wait: float
    conditional_mean_s: float

    def mean(self) -> float:
        return self.p_wait * self.conditional_mean_s if self.p_wait > 0 else 0.0

    def quantile(self, q: float | None) -> float:
        """The q-quantile of the wait (None: the mean)."""
        if q is None:
            return self.mean()
        if self.p_wait <= 1.0 - q:
            return 0.0
        return self.conditional_mean_s * math.log(self.p_wait / (1.0 - q))


NO_WAIT = Wait(0.0, 0.0)


def mgc_wait(servers: int, arrival_rate: float, service_s: float, service_cv2: float = 1.0,
             arrival_cv2: float = 1.0) -> Wait:
    """The wait of G/G/c (Allen-Cunneen): P(wait) = Erlang C, and a wait given one has mean
    service / (c - a) x (ca^2 + cs^2) / 2 (for M/M/c exactly 1 / (c mu - lambda); Poisson arrivals have ca^2 = 1,
    and for c = 1 this is Kingman's G/G/1 formula, Kingman 1961). Unstable (a >= c): an infinite wait."""
    if arrival_rate <= 0 or service_s <= 0:
        return NO_WAIT
    offered = arrival_rate * service_s
    if offered >= servers:
        return Wait(1.0, math.inf)
    spread = (arrival_cv2 + service_cv2) / 2.0
    if spread <= 0:
        return NO_WAIT  # D/D/c below capacity: nobody waits
    return Wait(erlang_c(servers, offered), service_s / (servers - offered) * spread)


def occupancy_quantile(mean: float, q: float | None, cap: float) -> float:
    """The q-quantile of the running sequences of an engine whose mean is `mean`: Poisson (M/G/infinity, whose
    occupancy is Poisson whatever the service distribution; Kleinrock, "Queueing Systems" vol. 1, 1975, sec. 4.7)
    by its normal approximation, at most the `cap` of slots."""
    if q is None or mean <= 0:
        return min(mean, cap)
    return min(cap, mean + NormalDist().inv_cdf(q) * math.sqrt(mean))
