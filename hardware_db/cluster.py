"""ClusterSpec and its topology graph: which link a group of ranks must cross follows from where they sit.

The fabric is two levels (a scale-up switch per node, a network across them). A group's link is read off those
levels (Cluster.group_link, for thousands of groups per search); the networkx graph of the same fabric
(Cluster.graph, networkx imported on first use: 140 ms a command does not pay when it reads no path) gives the
paths, and tests/test_costmodel.py checks that the two agree on which levels every group crosses."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field, ValidationError, model_validator

from meshplan.hardware_db.documents import STRICT, read_document
from meshplan.hardware_db.errors import InputError, field_error
from meshplan.hardware_db.gpu import GPUSpec, load_gpu

if TYPE_CHECKING:
    import networkx as nx

MAX_GPUS = 2**18  # 262,144: above the largest clusters built (about 200,000 GPUs); the search's work grows with it


class ClusterSpec(BaseModel):
    """GPU type and count, GPUs per node, and optional link overrides (NIC in Gb/s, scale-up in GB/s per direction)."""

    model_config = STRICT
    gpu: str
    num_gpus: int = Field(gt=0, le=MAX_GPUS)
    # default: 8, or the scale-up domain where it is larger
    gpus_per_node: int | None = Field(default=None, gt=0, le=MAX_GPUS)
    nic_gbps: float | None = Field(default=None, gt=0, le=1e6)  # Gb/s; the fastest NICs are 800
    nvlink_gb_s: float | None = Field(default=None, gt=0, le=1e6)  # GB/s per direction; NVLink 5 is 900

    @model_validator(mode="after")
    def _check(self) -> ClusterSpec:
        if self.gpus_per_node and self.num_gpus > self.gpus_per_node and self.num_gpus % self.gpus_per_node:
            raise ValueError(
                f"num_gpus ({self.num_gpus}) is not a multiple of gpus_per_node ({self.gpus_per_node}); use whole nodes"
            )
        return self


@dataclass(frozen=True)
class LinkLevel:
    """One level of the fabric a collective may cross."""

    name: str  # "scale-up" or "scale-out"
    bytes_per_s: float  # per GPU, per direction, line rate
    latency_s: float


class Cluster:
    """A resolved cluster: the GPU spec, node layout and a networkx graph of GPUs, node switches and the network.

    Ranks are numbered node-major (rank r sits on node r // gpus_per_node), as torchrun assigns them.
    """

    def __init__(self, spec: ClusterSpec, gpu: GPUSpec | None = None):
        self.spec = spec
        self.gpu = gpu or load_gpu(spec.gpu)
        domain = int(self.gpu.scaleup_domain.value)
        per_node = spec.gpus_per_node or (domain if domain > 8 else 8)  # 8-GPU servers unless a larger NVLink domain
        self.gpus_per_node = min(per_node, spec.num_gpus)  # fewer GPUs than a node: one partial node
        if spec.num_gpus > self.gpus_per_node and spec.num_gpus % self.gpus_per_node:
            raise InputError(
                f"{spec.num_gpus} GPUs do not fill whole nodes of {self.gpus_per_node}; "
                f"use a multiple of {self.gpus_per_node} or set --gpus-per-node"
            )
        self._link_cache: dict[tuple, tuple[float, float, bool]] = {}
        eff = self.gpu.efficiency
        self.scaleup = LinkLevel(
            "scale-up",
            (spec.nvlink_gb_s * 1e9) if spec.nvlink_gb_s else self.gpu.scaleup_bytes_per_s,
            eff.scaleup_latency_us * 1e-6,
        )
        self.scaleout = LinkLevel(
            "scale-out",
            (spec.nic_gbps * 1e9 / 8) if spec.nic_gbps else self.gpu.nic_bytes_per_s,
            eff.scaleout_latency_us * 1e-6,
        )

    @property
    def num_gpus(self) -> int:
        return self.spec.num_gpus

    @property
    def num_nodes(self) -> int:
        return max(1, self.num_gpus // self.gpus_per_node)

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    @cached_property
    def graph(self) -> nx.Graph:
        """GPUs hang off their node's scale-up switch (NVSwitch) and, through their own NIC, off the network switch."""
        import networkx as nx

        g = nx.Graph()
        g.add_node("network", kind="switch")
        for node in range(self.num_nodes):
            g.add_node(f"node{node}", kind="scale-up switch")
        for rank in range(self.num_gpus):
            gpu = f"gpu{rank}"
            g.add_node(gpu, kind="gpu", node=self.node_of(rank))
            g.add_edge(gpu, f"node{self.node_of(rank)}", level="scale-up",
                       bytes_per_s=self.scaleup.bytes_per_s, latency_s=self.scaleup.latency_s)
            if self.num_nodes > 1:
                g.add_edge(gpu, "network", level="scale-out",
                           bytes_per_s=self.scaleout.bytes_per_s, latency_s=self.scaleout.latency_s)
        return g

    def group_link(self, ranks: tuple[int, ...], scaleup_fraction: float = 1.0,
                   scaleout_fraction: float = 1.0) -> tuple[float, float, bool]:
        key = (ranks, scaleup_fraction, scaleout_fraction)
        if key not in self._link_cache:  # the planner asks for the same groups across thousands of candidates
            self._link_cache[key] = self._group_link(ranks, scaleup_fraction, scaleout_fraction)
        return self._link_cache[key]

    def _group_link(self, ranks: tuple[int, ...], scaleup_fraction: float,
                    scaleout_fraction: float) -> tuple[float, float, bool]:
        """(bus bandwidth per rank in bytes/s, per-step latency in s, crosses nodes) for a ring over `ranks`, from
        where each rank sits (node_of) and the two levels' links (the graph's edges: `graph`).

        Inside one node the ring runs on the scale-up fabric. Across nodes NCCL runs one ring per NIC rail, so the
        k members a node holds share k NICs: bus bandwidth = min(scale-up, k x NIC) (NCCL docs, "Performance":
        inter-node bandwidth is the sum of the NICs the ranks of a node use). The fractions turn line rates into
        achieved rates (the GPU's efficiency defaults or a calibration).
        """
        per_node: dict[int, int] = {}
        for r in ranks:
            node = self.node_of(r)
            per_node[node] = per_node.get(node, 0) + 1
        scaleup = self.scaleup.bytes_per_s * scaleup_fraction
        if len(per_node) <= 1:
            return scaleup, self.scaleup.latency_s, False
        k = min(per_node.values())
        return (min(scaleup, k * self.scaleout.bytes_per_s * scaleout_fraction), self.scaleout.latency_s, True)

    def shortest_path_levels(self, a: int, b: int) -> list[str]:
        """The link levels a message from rank a to rank b crosses (from the graph)."""
        import networkx as nx

        path = nx.shortest_path(self.graph, f"gpu{a}", f"gpu{b}")
        return [self.graph.edges[u, v]["level"] for u, v in pairwise(path)]


def engine_cluster(gpu_cluster: Cluster, gpus: int) -> Cluster:
    """`gpus` of the cluster's GPUs on its node size: the GPUs one serving engine runs on."""
    spec = gpu_cluster.spec.model_copy(update={"num_gpus": gpus, "gpus_per_node": gpu_cluster.gpus_per_node})
    return Cluster(ClusterSpec(**spec.model_dump()), gpu=gpu_cluster.gpu)


def load_cluster_file(path: str | Path) -> ClusterSpec:
    """A cluster file (TOML or JSON) with the ClusterSpec fields."""
    p = Path(path)
    data, _ = read_document(p, "a cluster file")
    try:
        return ClusterSpec.model_validate(data)
    except ValidationError as exc:
        raise InputError(f"{p}: {field_error(exc)}") from None
