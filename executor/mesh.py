"""Which ranks work together: a plan's degrees and rank order as torch DeviceMeshes, the same groups the
cost model prices (`costmodels.timing.group_ranks`).

Dense dims (tp, cp, dp, pp) are laid out by the plan's rank order, innermost (fastest-varying) first:
"tp-cp-dp-pp" (Megatron-LM's default) or "tp-cp-pp-dp" (`--use-tp-pp-dp-mapping`). Experts fold onto the
same ranks (Megatron's MoE parallel folding): within each pipeline stage the tp*cp*dp ranks, taken in
tp-cp-dp order, are split into etp (innermost), then ep, then edp.

`ExecLayout` is the picklable part of a `costmodels.config.Layout` that a rank needs; `rank_coords`
and `group_of` are pure (no torch.distributed) so tests check them against the cost model's groups;
`build_meshes` makes the DeviceMeshes, collectively, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh

from meshplan.costmodels.config import Layout, even_chunks

__all__ = ["DENSE_DIMS", "EXPERT_DIMS", "ExecLayout", "Meshes", "build_meshes", "group_of", "rank_coords"]

DENSE_DIMS = ("tp", "cp", "dp", "pp")
EXPERT_DIMS = ("etp", "ep", "edp")


@dataclass(frozen=True)
class ExecLayout:
    """A plan's layout as the executor runs it (degrees, micro-batching, stages, schedule, recompute).

    stage_layers: decoder layers per pipeline stage; stage_recompute: per stage (granularity, full_layers),
    granularity "none" | "selective" | "full", full_layers = how many of the stage's first layers are
    recomputed in full (only with "full").
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    dp: int = 1
    cp: int = 1
    cp_comm: str = "ring"  # "ring" (P2P ring attention) or "a2a" (all-to-all over heads), as the planner
    ep: int = 1
    etp: int = 1
    mbs: int = 1
    num_microbatches: int = 1
    zero: int = 0
    sp: bool = False
    schedule: str = "1f1b"
    stage_layers: tuple[int, ...] = (1,)
    stage_recompute: tuple[tuple[str, int], ...] = (("none", 0),)
    rank_order: str = "tp-cp-dp-pp"
    chunk_layers: tuple[int, ...] = ()  # decoder layers per model chunk, model order; () = each stage split evenly

    def __post_init__(self) -> None:
        if self.rank_order not in ("tp-cp-dp-pp", "tp-cp-pp-dp"):
            raise ValueError(f"unknown rank order {self.rank_order!r}")
        if len(self.stage_layers) != self.pp or len(self.stage_recompute) != self.pp:
            raise ValueError(f"stage_layers and stage_recompute need pp={self.pp} entries")
        if (self.tp * self.cp * self.dp) % (self.etp * self.ep):
            raise ValueError(f"etp*ep = {self.etp * self.ep} does not divide tp*cp*dp = {self.tp * self.cp * self.dp}")

    @classmethod
    def from_layout(cls, lay: Layout) -> ExecLayout:
        return cls(tp=lay.tp, pp=lay.pp, vpp=lay.vpp, dp=lay.dp, cp=lay.cp, cp_comm=lay.cp_comm, ep=lay.ep,
                   etp=lay.etp, mbs=lay.mbs, num_microbatches=lay.num_microbatches, zero=lay.zero, sp=lay.sp,
                   schedule=lay.schedule, stage_layers=tuple(lay.stage_layers),
                   stage_recompute=tuple((p.granularity, p.full_layers) for p in lay.stage_recompute),
                   rank_order=lay.rank_order, chunk_layers=tuple(lay.chunks))

    def label(self, inject: str | None = None) -> str:
        """One line naming the layout (every degree, micro-batching, stages, recompute), for reports; `inject`
        names a deliberate fault, appended in brackets."""
        parts = [f"tp{self.tp}" + (" sp" if self.sp else ""),
                 f"cp{self.cp}" + (f" {self.cp_comm}" if self.cp > 1 else ""),
                 f"pp{self.pp}" + (f" vpp{self.vpp}" if self.vpp > 1 else ""), f"dp{self.dp}"]
        if self.ep > 1 or self.etp != self.tp:
            parts.append(f"ep{self.ep} etp{self.etp} edp{self.edp}")
        parts += [f"zero{self.zero}", f"mbs{self.mbs} x{self.num_microbatches}"]
        if self.pp > 1:
            parts += [self.schedule, f"stages{list(self.stage_layers)}"]
        parts.append("recompute[" + ",".join(g if g != "full" else f"full:{k}" for g, k in self.stage_recompute) + "]")
        if self.rank_order != "tp-cp-dp-pp":
            parts.append(self.rank_order)
        return " ".join(parts) + (f" [{inject}]" if inject else "")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def edp(self) -> int:
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    def size(self, dim: str) -> int:
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp, "etp": self.etp, "ep": self.ep,
                "edp": self.edp, "dp_cp": self.dp * self.cp}[dim]

    def chunk_ranges(self) -> tuple[tuple[int, int], ...]:
        """[start, stop) of every model chunk in model order; chunk c * pp + s runs on pipeline rank s
        (Megatron's interleaving), each stage's layers split as evenly as possible over its vpp chunks,
        the larger shares first, unless chunk_layers gives every chunk (as costmodels.config.Layout.chunk_layers)."""
        counts = self.chunk_layers or even_chunks(self.stage_layers, self.vpp)
        out, start = [], 0
        for n in counts:
            out.append((start, start + n))
            start += n
        return tuple(out)


def _strides(lay: ExecLayout) -> dict[str, int]:
    strides, stride = {}, 1
    for d in lay.rank_order.split("-"):
        strides[d] = stride
        stride *= lay.size(d)
    return strides


def rank_coords(rank: int, lay: ExecLayout) -> dict[str, int]:
    """This rank's index along every dim: tp, cp, dp, pp by the rank order; etp, ep, edp by the folding."""
    if not 0 <= rank < lay.world:
        raise ValueError(f"rank {rank} outside a world of {lay.world}")
    strides = _strides(lay)
    c = {d: rank // strides[d] % lay.size(d) for d in DENSE_DIMS}
    k = c["tp"] + lay.tp * (c["cp"] + lay.cp * c["dp"])  # index among the stage's ranks, tp-cp-dp order
    c["etp"] = k % lay.etp
    c["ep"] = k // lay.etp % lay.ep
    c["edp"] = k // (lay.etp * lay.ep)
    return c


def _rank(coords: dict[str, int], lay: ExecLayout) -> int:
    strides = _strides(lay)
    return sum(coords[d] * strides[d] for d in DENSE_DIMS)


def _from_folded(k: int, pp_index: int, lay: ExecLayout) -> int:
    tp_i, rest = k % lay.tp, k // lay.tp
    return _rank({"tp": tp_i, "cp": rest % lay.cp, "dp": rest // lay.cp, "pp": pp_index}, lay)


def group_of(rank: int, dim: str, lay: ExecLayout) -> tuple[int, ...]:
    """The ranks of `rank`'s group along `dim` (tp, cp, dp, pp, dp_cp, etp, ep, edp), in group-rank order."""
    c = rank_coords(rank, lay)
    if dim in DENSE_DIMS:
        return tuple(_rank({**c, dim: i}, lay) for i in range(lay.size(dim)))
    if dim == "dp_cp":  # the distributed optimizer's group: cp innermost, then dp
        return tuple(_rank({**c, "cp": ci, "dp": di}, lay) for di in range(lay.dp) for ci in range(lay.cp))
    if dim in EXPERT_DIMS:
        fold = {"etp": c["etp"], "ep": c["ep"], "edp": c["edp"]}
        out = []
        for i in range(lay.size(dim)):
            f = {**fold, dim: i}
            k = f["etp"] + lay.etp * (f["ep"] + lay.ep * f["edp"])
            out.append(_from_folded(k, c["pp"], lay))
        return tuple(out)
    raise ValueError(f"unknown dim {dim!r}; one of {', '.join(DENSE_DIMS + ('dp_cp',) + EXPERT_DIMS)}")


@dataclass(frozen=True)
class Meshes:
    """The DeviceMeshes of one rank. dense: dims ("pp", "dp", "cp", "tp") or ("dp", "pp", "cp", "tp") by the
    rank order (outermost first), so dense["tp"], dense["cp"], dense["dp"], dense["pp"] are this rank's
    groups; dp_cp: dp x cp flattened (gradient sync of dense parameters); expert: ("pp", "edp", "ep", "etp")."""

    dense: DeviceMesh
    dp_cp: DeviceMesh
    expert: DeviceMesh

    def __getitem__(self, dim: str) -> DeviceMesh:
        if dim in DENSE_DIMS:
            return self.dense[dim]
        if dim == "dp_cp":
            return self.dp_cp
        if dim in EXPERT_DIMS:
            return self.expert[dim]
        raise KeyError(dim)


def build_meshes(lay: ExecLayout, device_type: str = "cpu") -> Meshes:
    """The dense and expert DeviceMeshes over the whole world; every rank must call it, in the same order."""
    outer_first = tuple(reversed(lay.rank_order.split("-")))  # e.g. ("pp", "dp", "cp", "tp")
    ranks = torch.arange(lay.world).reshape(tuple(lay.size(d) for d in outer_first))
    dense = DeviceMesh(device_type, ranks, mesh_dim_names=outer_first)
    dp_cp = dense["dp", "cp"]._flatten("dp_cp")  # noqa: SLF001 - torch's documented way to merge mesh dims
    expert_ranks = torch.tensor(
        [[_from_folded(k, p, lay) for k in range(lay.tp * lay.cp * lay.dp)] for p in range(lay.pp)]
    ).reshape(lay.pp, lay.edp, lay.ep, lay.etp)
    expert = DeviceMesh(device_type, expert_ranks, mesh_dim_names=("pp", "edp", "ep", "etp"))
    return Meshes(dense=dense, dp_cp=dp_cp, expert=expert)
