"""The executor's groups are the cost model's groups; the DeviceMeshes hold exactly those groups."""

from __future__ import annotations

import itertools

import pytest

torch = pytest.importorskip("torch")

from executor_helpers import layout

from meshplan.costmodels.config import ParallelConfig, Workload, resolve
from meshplan.costmodels.timing import group_ranks
from meshplan.costmodels.model_io import load_model
from meshplan.executor.launch import run_world
from meshplan.executor.mesh import DENSE_DIMS, EXPERT_DIMS, build_meshes, group_of, rank_coords


def _layouts():
    moe = load_model("mixtral-8x7b")
    orders = ("tp-cp-dp-pp", "tp-cp-pp-dp")
    for tp, cp, pp, ep, etp, order in itertools.product((1, 2), (1, 2), (1, 2), (1, 2, 4), (1, 2), orders):
        if order == "tp-cp-pp-dp" and ep > 1:
            continue
        gpus = 16
        dp = gpus // (tp * cp * pp)
        if (tp * cp * dp) % (etp * ep):
            continue
        wl = Workload(global_batch=64, seq_len=64)
        cfg = ParallelConfig(tp=tp, cp=cp, pp=pp, ep=ep, etp=etp, rank_order=order)
        yield resolve(moe, gpus, wl, cfg)


@pytest.mark.parametrize("lay", list(_layouts()),
                         ids=lambda x: f"tp{x.tp}cp{x.cp}pp{x.pp}ep{x.ep}etp{x.etp}-{x.rank_order}")
def test_groups_match_the_cost_model(lay):
    ex = lay  # the executor takes the cost model's Layout itself
    for dim in DENSE_DIMS + ("dp_cp",) + EXPERT_DIMS:
        assert group_of(0, dim, ex) == group_ranks(dim, lay), dim
    # every rank is in exactly one group of each dim, and its coordinate is its index in that group
    for dim in DENSE_DIMS + EXPERT_DIMS:
        seen = set()
        for r in range(ex.world):
            g = group_of(r, dim, ex)
            assert g.index(r) == rank_coords(r, ex)[dim]
            assert len(g) == ex.size(dim)
            seen.add(g)
        assert sorted(itertools.chain(*seen)) == list(range(ex.world)), dim


def _mesh_groups(rank, world, layouts):
    """Every layout's meshes, built one after another in one world of 8 ranks (one spawn instead of four)."""
    out = []
    for ex in layouts:
        meshes = build_meshes(ex)
        out.append({dim: tuple(int(r) for r in meshes[dim].mesh.flatten().tolist()) if dim in ("dp_cp",) else
                    tuple(torch.distributed.get_process_group_ranks(meshes[dim].get_group())) for dim in
                    DENSE_DIMS + ("dp_cp",) + EXPERT_DIMS})
    return out


MESH_LAYOUTS = {
    "tp2dp2pp2": layout(tp=2, dp=2, pp=2, stage_layers=(1, 1), stage_recompute=(("none", 0),) * 2),
    "tp2pp2dp2-order": layout(tp=2, dp=2, pp=2, stage_layers=(1, 1), stage_recompute=(("none", 0),) * 2,
                              rank_order="tp-cp-pp-dp"),
    "tp2cp2dp2-ep2etp2": layout(tp=2, cp=2, dp=2, ep=2, etp=2, stage_layers=(1,)),
    "cp2pp2dp2-order": layout(cp=2, dp=2, pp=2, stage_layers=(1, 1), stage_recompute=(("none", 0),) * 2,
                              rank_order="tp-cp-pp-dp"),
}


def test_device_meshes_hold_those_groups():
    assert {ex.world for ex in MESH_LAYOUTS.values()} == {8}
    got = run_world(8, _mesh_groups, tuple(MESH_LAYOUTS.values()), timeout_s=120)
    for rank, per_layout in enumerate(got):
        for (name, ex), groups in zip(MESH_LAYOUTS.items(), per_layout, strict=True):
            for dim, ranks in groups.items():
                if dim == "dp_cp":
                    assert rank in ranks and len(ranks) == ex.dp * ex.cp
                    assert tuple(sorted(ranks)) == tuple(sorted(group_of(rank, dim, ex))), (name, rank, dim)
                else:
                    assert ranks == group_of(rank, dim, ex), (name, rank, dim)
