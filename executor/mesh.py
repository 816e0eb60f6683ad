"""Which ranks work together: a plan's degrees and rank order as torch DeviceMeshes, the same groups the
cost model prices (`costmodels.timing.group_ranks`).

Dense dims (tp, cp, dp, pp) are laid out by the plan's rank order, innermost (fastest-varying) first:
"tp-cp-dp-pp" (Megatron-LM's default) or "tp-cp-pp-dp" (`--use-tp-pp-dp-mapping`). Experts fold onto the
same ranks (Megatron's MoE parallel folding): within each pipeline stage the tp*cp*dp ranks, taken in
tp-cp-dp order, are split into etp (innermost), then ep, then edp.

The executor takes the cost model's own `costmodels.config.Layout` (what resolve() makes of a plan's knobs);
`rank_coords` and `group_of` are pure (no torch.distributed) so tests check them against the cost model's groups;
`build_meshes` makes the DeviceMeshes, collectively, on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from meshplan.costmodels.config import Layout

__all__ = ["DENSE_DIMS", "EXPERT_DIMS", "Meshes", "build_meshes", "group_of", "rank_coords", "rank_device", "wait_for",
           "allocator_peak", "reset_allocator_peak"]

DENSE_DIMS = ("tp", "cp", "dp", "pp")
EXPERT_DIMS = ("etp", "ep", "edp")


def _strides(lay: Layout) -> dict[str, int]:
    strides, stride = {}, 1
    for d in lay.rank_order.split("-"):
        strides[d] = stride
        stride *= lay.size(d)
    return strides


def rank_coords(rank: int, lay: Layout) -> dict[str, int]:
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


def _rank(coords: dict[str, int], lay: Layout) -> int:
    strides = _strides(lay)
    return sum(coords[d] * strides[d] for d in DENSE_DIMS)


def _from_folded(k: int, pp_index: int, lay: Layout) -> int:
    tp_i, rest = k % lay.tp, k // lay.tp
    return _rank({"tp": tp_i, "cp": rest % lay.cp, "dp": rest // lay.cp, "pp": pp_index}, lay)


def group_of(rank: int, dim: str, lay: Layout) -> tuple[int, ...]:
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


def rank_device() -> torch.device:
    """This rank's device, from its process group's backend: NCCL's current GPU (launch.bind_device set it before
    the group), gloo's CPU. Called once per rank; the rest of the rank takes it from here."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wait_for(device: torch.device) -> None:
    """Wait until the device has run what was queued on it, so a wall-clock reading after it counts that work (CUDA
    runs kernels asynchronously; the CPU has nothing queued)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_allocator_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def allocator_peak(device: torch.device) -> float | None:
    """The caching allocator's peak bytes since the last reset (CUDA keeps it; the CPU allocator keeps no stats)."""
    return float(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def build_meshes(lay: Layout, device_type: str = "cpu") -> Meshes:
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
