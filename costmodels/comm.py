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
    a2a_bytes_per_s: float = 0.0  # all-to-all inside a node (0: the ring's bus bandwidth)
    nic_bytes_per_s: float = 0.0  # one GPU's achieved NIC rate (groups across nodes)
    ranks_per_node: int = 0  # the group's members on each node (groups across nodes)


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


def all_to_all(bytes_: float, n: int, link: Link, dedup_top_k: int = 0, at_once: bool = False) -> float:
    """Each rank sends (n-1)/n of its buffer to the others. Inside a node at the all-to-all bus bandwidth (NCCL
    reaches about 0.71 of NVLink with it, against 0.8 for rings: NVIDIA GTC25 S72583, slides 12-13). Across nodes
    it cannot be reduced hierarchically as a ring can: the (n-k)/n for the other nodes leaves through the GPU's own
    NIC while the (k-1)/n for its node's k-1 peers crosses NVLink (48 GB/s all-to-all busbw against 370 for
    all-reduce on 32 DGX H100 GPUs, 8 x 400G NICs; same slides). A token dispatch deduplicated per node (DeepEP,
    `dedup_top_k` copies per token) sends each token once to every other node holding one of its experts and
    forwards it there over NVLink (DeepSeek-V3 report sec. 3.2.2): node_dedup_share of the off-node bytes.
    `at_once`: every rank sends to all its peers together (DeepEP's low-latency kernels), one latency instead of
    the n-1 pairwise steps."""
    if n <= 1 or bytes_ <= 0:
        return 0.0
    steps, share = ring_shape("all_to_all", n)
    steps = 1 if at_once else steps
    up = link.a2a_bytes_per_s or link.bus_bytes_per_s
    if not link.crosses_nodes or not link.nic_bytes_per_s:
        return steps * link.latency_s + share * bytes_ / up
    k = max(1, link.ranks_per_node)
    off_node = bytes_ * (n - k) / n
    inside = bytes_ * (k - 1) / n
    if dedup_top_k > 1:
        inside += off_node * (k - 1) / k  # what arrives once per node is forwarded to its experts' GPUs
        off_node *= node_dedup_share(dedup_top_k, max(1, n // k))
    return steps * link.latency_s + max(inside / up, off_node / link.nic_bytes_per_s)


def node_dedup_share(top_k: int, nodes: int) -> float:
    """Off-node bytes of a per-node deduplicated dispatch over a plain one, with the top_k experts of a token on
    uniformly random nodes among `nodes`: E[other nodes hit] = (N-1)(1-(1-1/N)^k) single copies instead of
    k (N-1)/N (balanced routing; node-limited routing, DeepSeek-V3 sec. 2.1.2, would cap it further: not assumed)."""
    if nodes <= 1 or top_k <= 1:
        return 1.0
    hit = (nodes - 1) * (1 - (1 - 1 / nodes) ** top_k)
    return hit / (top_k * (nodes - 1) / nodes)


def p2p(bytes_: float, link: Link) -> float:
    return _ring("p2p", bytes_, 2, link)
