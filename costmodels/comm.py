"""Collective times with the alpha-beta (latency-bandwidth) model of ring algorithms.

Thakur, Rabenseifner & Gropp, "Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005), and
NCCL's PERFORMANCE.md "bus bandwidth": a ring all-reduce moves 2(n-1)/n of the buffer over each link,
all-gather and reduce-scatter (n-1)/n, all-to-all (n-1)/n of each rank's send buffer.
`bytes_` is always the full logical buffer (the all-reduced tensor, the gathered tensor, a rank's send buffer).
"""

from __future__ import annotations

from typing import NamedTuple


class Link(NamedTuple):
    """Achieved bus bandwidth (bytes/s) and per-step latency (s) of a ring over one process group. A NamedTuple:
    immutable, and hashed in C (a planner keys its cost caches by links hundreds of thousands of times)."""

    bus_bytes_per_s: float
    latency_s: float
    crosses_nodes: bool


def ring_shape(kind: str, n: int) -> tuple[float, float]:
    """(latency steps, share of the buffer over each link) of a ring collective over n ranks (the formulas below)."""
    if kind == "all_reduce":
        return 2 * (n - 1), 2 * (n - 1) / n  # ring: reduce-scatter then all-gather
    if kind == "p2p":
        return 1, 1.0
    return n - 1, (n - 1) / n  # all-gather; reduce-scatter (the same traffic in reverse, Thakur et al. 2005 sec. 4);
    # all-to-all: each rank sends (n-1)/n of its buffer to the others, pairwise exchange in n-1 steps


def _ring(kind: str, bytes_: float, n: int, link: Link) -> float:
    if n <= 1 or bytes_ <= 0:
        return 0.0
    steps, share = ring_shape(kind, n)
    return steps * link.latency_s + share * bytes_ / link.bus_bytes_per_s


def all_reduce(bytes_: float, n: int, link: Link) -> float:
    return _ring("all_reduce", bytes_, n, link)


def all_gather(bytes_: float, n: int, link: Link) -> float:
    return _ring("all_gather", bytes_, n, link)


def reduce_scatter(bytes_: float, n: int, link: Link) -> float:
    return _ring("reduce_scatter", bytes_, n, link)


def all_to_all(bytes_: float, n: int, link: Link) -> float:
    return _ring("all_to_all", bytes_, n, link)


def p2p(bytes_: float, link: Link) -> float:
    return _ring("p2p", bytes_, 2, link)
