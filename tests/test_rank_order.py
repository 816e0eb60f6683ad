"""The rank order of the dimensions: Megatron-LM's default tp-cp-dp-pp and --use-tp-pp-dp-mapping (tp-cp-pp-dp,
pp inside dp). Group placement, the launcher rule (no EP), a prediction the order changes, the plan file,
the search space (where the second order is searched, and pins) and the CLI.
"""

from __future__ import annotations

import functools
import json

import pytest
from cli_helpers import assert_input_error, run

from meshplan.costmodels.config import (DEFAULT_RANK_ORDER, PP_INSIDE_DP, Layout, ParallelConfig, StagePolicy, Workload,
                                        resolve)
from meshplan.costmodels.context import CostContext
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.estimate import estimate, layout_dict, simulate_config
from meshplan.costmodels.model_io import load_zoo
from meshplan.costmodels.runtime import get_runtime
from meshplan.costmodels.timing import RANK_ORDER, group_ranks
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.planner.builders import build_plan
from meshplan.planner.plan import Plan, plan_config, read_plan, write_plan
from meshplan.planner.search import search
from meshplan.planner.space import check_pins, divisors, enumerate_space, rank_orders

DIMS = ("tp", "cp", "dp", "pp", "dp_cp", "etp", "ep", "edp")
WL = Workload(global_batch=32, seq_len=2048)


@functools.cache
def cluster(n: int, per_node: int | None = None) -> Cluster:
    return Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=n, gpus_per_node=per_node))


def layout(tp: int, pp: int, dp: int, order: str, cp: int = 1, ep: int = 1, etp: int | None = None) -> Layout:
    """A layout with the given degrees (the fields group placement reads; the rest are placeholders)."""
    etp = tp if etp is None else etp
    return Layout(tp=tp, pp=pp, vpp=1, dp=dp, cp=cp, cp_comm="ring", ep=ep, etp=etp, edp=tp * cp * dp // (etp * ep),
                  mbs=1, num_microbatches=1, zero=1, recompute="none", sp=False, schedule="1f1b",
                  stage_layers=(1,) * pp, stage_recompute=(StagePolicy(),) * pp, rank_order=order)


# ---- group placement -----------------------------------------------------------------------------------------------

def test_default_order_is_megatrons_and_the_default_everywhere():
    assert RANK_ORDER == ("tp", "cp", "dp", "pp") and "-".join(RANK_ORDER) == DEFAULT_RANK_ORDER
    assert ParallelConfig().rank_order is None  # unset: searched by plan, the default in estimate
    lay = resolve(load_zoo("llama3.1-8b"), 8, WL, ParallelConfig(tp=2, pp=2))
    assert lay.rank_order == DEFAULT_RANK_ORDER and layout_dict(lay)["rank_order"] == DEFAULT_RANK_ORDER


def test_group_ranks_of_both_orders():
    """tp=2, pp=2, dp=2 on 8 GPUs: pp inside dp swaps the strides of pp and dp (and of the optimizer's group)."""
    default = layout(2, 2, 2, DEFAULT_RANK_ORDER)
    assert group_ranks("tp", default) == (0, 1)
    assert group_ranks("pp", default) == (0, 4) and group_ranks("dp", default) == (0, 2)
    assert group_ranks("dp_cp", default) == (0, 2) and group_ranks("edp", default) == (0, 2)
    swapped = layout(2, 2, 2, PP_INSIDE_DP)
    assert group_ranks("tp", swapped) == (0, 1)
    assert group_ranks("pp", swapped) == (0, 2) and group_ranks("dp", swapped) == (0, 4)
    # ep = 1: the expert groups degenerate onto tp (etp) and dp (edp), in either order
    assert group_ranks("dp_cp", swapped) == group_ranks("edp", swapped) == group_ranks("dp", swapped)
    assert group_ranks("etp", swapped) == (0, 1) and group_ranks("ep", swapped) == (0,) == group_ranks("cp", swapped)


def test_expert_groups_fold_over_the_non_pp_ranks():
    """etp < tp with ep = 1: edp = tp*dp/etp folds over tp and dp, skipping the pp ranks of the swapped order."""
    swapped = layout(2, 2, 2, PP_INSIDE_DP, etp=1)  # dp stride 4: the non-pp ranks are 0, 1, 4, 5
    assert group_ranks("etp", swapped) == (0,) and group_ranks("edp", swapped) == (0, 1, 4, 5)
    assert group_ranks("edp", layout(2, 2, 2, DEFAULT_RANK_ORDER, etp=1)) == (0, 1, 2, 3)


def test_pp_inside_dp_with_cp_follows_megatrons_order():
    """Megatron numbers ranks tp-cp-ep-pp-dp under --use-tp-pp-dp-mapping: with tp=cp=pp=dp=2 on 16 GPUs the
    pipeline peer is tp*cp = 4 away, the DP peer tp*cp*pp = 8, and the optimizer's dp x cp group is not contiguous."""
    lay = resolve(load_zoo("llama3.1-8b"), 16, WL, ParallelConfig(tp=2, cp=2, pp=2, rank_order=PP_INSIDE_DP))
    assert (lay.cp, lay.dp) == (2, 2)
    assert group_ranks("cp", lay) == (0, 2) and group_ranks("pp", lay) == (0, 4) and group_ranks("dp", lay) == (0, 8)
    assert group_ranks("dp_cp", lay) == (0, 2, 8, 10)
    assert group_ranks("edp", lay) == (0, 2, 8, 10)  # ep = 1, etp = tp: the experts' DP is the optimizer's group


@pytest.mark.parametrize("tp,cp,pp,dp,ep,etp", [(2, 2, 2, 2, 1, 2), (2, 1, 2, 4, 2, 1), (4, 2, 1, 2, 4, 2),
                                                (1, 4, 2, 2, 2, 1), (8, 1, 2, 1, 1, 4)])
def test_default_order_places_groups_as_before(tp, cp, pp, dp, ep, etp):
    """The default order keeps the fixed placement (strides tp, tp*cp, tp*cp*dp; experts fold etp-ep-edp)."""
    lay = layout(tp, pp, dp, DEFAULT_RANK_ORDER, cp=cp, ep=ep, etp=etp)
    expected = {"tp": (1, tp), "cp": (tp, cp), "dp": (tp * cp, dp), "pp": (tp * cp * dp, pp), "dp_cp": (tp, cp * dp),
                "etp": (1, etp), "ep": (etp, ep), "edp": (etp * ep, lay.edp)}
    for dim, (stride, n) in expected.items():
        assert group_ranks(dim, lay) == tuple(i * stride for i in range(n)), dim


# ---- the launcher rule ---------------------------------------------------------------------------------------------

def test_resolve_refuses_pp_inside_dp_with_ep():
    words = ["tp-cp-pp-dp", "ep = 1", "ep=2"]
    with pytest.raises(InputError) as err:
        resolve(load_zoo("mixtral-8x7b"), 8, WL, ParallelConfig(ep=2, rank_order=PP_INSIDE_DP))
    msg = str(err.value)
    assert "\n" not in msg and "--use-tp-pp-dp-mapping" in msg, msg
    for w in words:
        assert w in msg, (w, msg)


def test_unknown_order_is_refused():
    with pytest.raises(ValueError):
        ParallelConfig(rank_order="pp-dp-cp-tp")


# ---- predictions ---------------------------------------------------------------------------------------------------

def test_order_changes_the_prediction_and_the_pp_link():
    """llama3.1-8b on 2 nodes of 8 H100s, tp=2 pp=2 dp=4: by default the pipeline's P2P crosses nodes and DP stays
    inside one; pp inside dp keeps the P2P on NVLink and sends DP over the network."""
    model, c = load_zoo("llama3.1-8b"), cluster(16)
    wl = Workload(global_batch=64, seq_len=4096)
    links, times = {}, {}
    for order in (DEFAULT_RANK_ORDER, PP_INSIDE_DP):
        cfg = ParallelConfig(tp=2, pp=2, dp=4, rank_order=order)
        lay = resolve(model, c.num_gpus, wl, cfg)
        ctx = CostContext(model, c, wl, lay, get_runtime("megatron-core"), Efficiency.from_gpu(c.gpu))
        links[order] = ctx.links
        est = estimate(model, c, wl, cfg)
        assert est.layout.rank_order == order
        times[order] = est.step_time_s
    assert links[DEFAULT_RANK_ORDER]["pp"].crosses_nodes and not links[DEFAULT_RANK_ORDER]["dp"].crosses_nodes
    assert not links[PP_INSIDE_DP]["pp"].crosses_nodes and links[PP_INSIDE_DP]["dp"].crosses_nodes
    assert links[PP_INSIDE_DP]["tp"] == links[DEFAULT_RANK_ORDER]["tp"]
    assert times[DEFAULT_RANK_ORDER] != pytest.approx(times[PP_INSIDE_DP], rel=1e-6)


def test_order_changes_nothing_inside_one_node():
    model = load_zoo("llama3.1-8b")
    a, b = (estimate(model, cluster(8), WL, ParallelConfig(tp=2, pp=2, rank_order=o))
            for o in (DEFAULT_RANK_ORDER, PP_INSIDE_DP))
    assert a.step_time_s == b.step_time_s and a.peak_memory_gib == b.peak_memory_gib


# ---- the plan file -------------------------------------------------------------------------------------------------

def swapped_plan() -> tuple[Plan, object]:
    model, c = load_zoo("llama3.1-8b"), cluster(16)
    cfg = ParallelConfig(tp=2, pp=2, stage_layers=(15, 17), rank_order=PP_INSIDE_DP)
    sim = simulate_config(model, c, WL, cfg, "megatron-core")
    return build_plan(model, c, WL, cfg, sim, "megatron-core"), sim


def test_plan_round_trips_the_order(tmp_path):
    plan, sim = swapped_plan()
    assert plan.mesh.rank_order == ["tp", "cp", "pp", "dp"]
    assert plan.prediction.layout.rank_order == PP_INSIDE_DP
    write_plan(plan, tmp_path / "p.json")
    back = read_plan(tmp_path / "p.json")
    assert back == plan
    model, c, wl, cfg, runtime = plan_config(back)
    assert cfg.rank_order == PP_INSIDE_DP
    assert simulate_config(model, c, wl, cfg, runtime).estimate.step_time_s == sim.estimate.step_time_s


def _edited(plan: Plan, **mesh) -> dict:
    data = plan.model_dump(mode="json")
    data["mesh"].update(mesh)
    return data


@pytest.mark.parametrize("mesh,words", [
    ({"rank_order": ["pp", "dp", "cp", "tp"]}, ["rank_order must be tp-cp-dp-pp or tp-cp-pp-dp", "pp-dp-cp-tp"]),
    ({"rank_order": ["tp", "cp", "dp", "pp"]}, ["mesh.rank_order", "prediction.layout.rank_order"]),
    ({"rank_order": ["tp", "tp", "dp", "pp"]}, ["rank_order"]),
])
def test_read_plan_refuses_a_bad_order(tmp_path, mesh, words):
    plan, _ = swapped_plan()
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_edited(plan, **mesh)))
    with pytest.raises(InputError) as err:
        read_plan(path)
    msg = str(err.value)
    assert "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)


def test_plan_refuses_pp_inside_dp_with_ep():
    plan, _ = swapped_plan()
    data = _edited(plan, ep=2, etp=2, edp=2)
    with pytest.raises(ValueError, match="needs ep = 1; got ep=2"):
        Plan.model_validate(data)


def test_plan_with_pp_inside_dp_and_cp_round_trips(tmp_path):
    model, c = load_zoo("llama3.1-8b"), cluster(16)
    cfg = ParallelConfig(tp=2, cp=2, pp=2, rank_order=PP_INSIDE_DP)
    sim = simulate_config(model, c, WL, cfg, "megatron-core")
    plan = build_plan(model, c, WL, cfg, sim, "megatron-core")
    write_plan(plan, tmp_path / "p.json")
    back = read_plan(tmp_path / "p.json")
    assert back == plan and (back.mesh.cp, back.mesh.dp) == (2, 2)
    assert back.mesh.rank_order == ["tp", "cp", "pp", "dp"]


def test_plan_without_a_predicted_order_reads_as_the_default(tmp_path):
    """Plans written before the order was a knob have no prediction.layout.rank_order: the default."""
    model, c = load_zoo("llama3.1-8b"), cluster(8)
    cfg = ParallelConfig(tp=2, pp=2)
    plan = build_plan(model, c, WL, cfg, simulate_config(model, c, WL, cfg, "megatron-core"), "megatron-core")
    data = plan.model_dump(mode="json")
    del data["prediction"]["layout"]["rank_order"]
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert read_plan(tmp_path / "old.json") == plan


# ---- the search space ----------------------------------------------------------------------------------------------

def _meshes(model: str, n: int, pins: ParallelConfig = ParallelConfig()) -> set:
    c = cluster(n)
    return {g.mesh for g in enumerate_space(load_zoo(model), n, c.gpus_per_node, WL, pins, max_mbs=1).groups}


def _moves(n: int, per_node: int, m) -> bool:
    return m.tp * m.cp < per_node < n and m.pp > 1 and m.dp > 1 and m.ep == 1


@pytest.mark.parametrize("model,n", [("llama3.1-8b", 8), ("llama3.1-8b", 16), ("llama3.1-8b", 32),
                                     ("mixtral-8x7b", 16)])
def test_space_searches_pp_inside_dp_only_where_it_moves_a_group(model, n):
    meshes = _meshes(model, n)
    per_node = cluster(n).gpus_per_node
    swapped = {m for m in meshes if m.order == PP_INSIDE_DP}
    assert all(_moves(n, per_node, m) for m in swapped)
    # every default mesh under the rule has its twin in the other order
    twins = {m._replace(order=PP_INSIDE_DP) for m in meshes
             if m.order == DEFAULT_RANK_ORDER and _moves(n, per_node, m)}
    assert twins == swapped
    assert bool(swapped) == (n > per_node)
    if n >= 32:  # CP meshes too (Megatron's tp-cp-ep-pp-dp)
        assert any(m.cp > 1 for m in swapped)


@pytest.mark.parametrize("per_node", [4, 8])
def test_the_rule_is_where_some_group_changes_links(per_node):
    """Without EP, pp inside dp puts some group on other links exactly where `rank_orders` searches it."""
    for n in (per_node, 2 * per_node, 4 * per_node):
        c = cluster(n, per_node)
        for tp in [t for t in divisors(n) if t <= c.gpus_per_node]:
            for cp in divisors(n // tp):
                for pp in divisors(n // (tp * cp)):
                    dp = n // (tp * cp * pp)
                    for etp in divisors(tp):
                        links = [tuple(c.group_link(group_ranks(d, layout(tp, pp, dp, o, cp=cp, etp=etp)))
                                       for d in DIMS) for o in (DEFAULT_RANK_ORDER, PP_INSIDE_DP)]
                        searched = rank_orders(n, c.gpus_per_node, tp, cp, pp, dp, 1, None)
                        assert (links[0] != links[1]) == (PP_INSIDE_DP in searched), (n, tp, cp, pp, dp, etp)


def test_pinned_order_is_the_only_one_and_is_searched_everywhere():
    swapped = _meshes("llama3.1-8b", 8, ParallelConfig(rank_order=PP_INSIDE_DP))
    assert swapped and all(m.order == PP_INSIDE_DP for m in swapped)
    assert any(m.cp > 1 for m in swapped)
    assert any(m.pp == 1 or m.dp == 1 for m in swapped)  # even where it moves nothing
    default = _meshes("llama3.1-8b", 16, ParallelConfig(rank_order=DEFAULT_RANK_ORDER))
    assert default and all(m.order == DEFAULT_RANK_ORDER for m in default)


def test_pinned_order_account_adds_up():
    """EP meshes are rejected by the launcher rule under a pinned tp-cp-pp-dp; every candidate lands once."""
    model, c = load_zoo("mixtral-8x7b"), cluster(16)
    pins = ParallelConfig(tp=2, rank_order=PP_INSIDE_DP)
    enum = enumerate_space(model, c.num_gpus, c.gpus_per_node, WL, pins, max_mbs=1)
    assert enum.infeasible.get(f"rank order {PP_INSIDE_DP} needs ep = 1", 0) > 0
    assert enum.space_size == sum(g.size() for g in enum.groups) + sum(enum.infeasible.values())
    assert enum.domains["order"] == f"pinned {PP_INSIDE_DP}"
    result = search(model, c, WL, pins, top_k=3, max_mbs=1)
    acc = result.account
    assert result.plans and all(p.estimate.layout.rank_order == PP_INSIDE_DP for p in result.plans)
    assert acc.evaluated + sum(acc.pruned.values()) + sum(acc.infeasible.values()) == acc.space_size
    for p in result.plans:  # the plan re-estimates exactly from its config
        assert estimate(model, c, WL, p.config).step_time_s == pytest.approx(p.step_time_s, rel=1e-9)


@pytest.mark.parametrize("pins,words", [
    (ParallelConfig(rank_order=PP_INSIDE_DP, ep=2), ["rank order tp-cp-pp-dp", "needs ep = 1; got ep=2"]),
])
def test_check_pins_refuses_pp_inside_dp_with_ep(pins, words):
    with pytest.raises(InputError) as err:
        check_pins(load_zoo("mixtral-8x7b"), 16, WL, pins)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


# ---- the CLI -------------------------------------------------------------------------------------------------------

PLAN = ["plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "16", "--gbs", "32", "--seq", "2048",
        "--max-mbs", "1", "--tp", "2", "--pp", "2"]
ESTIMATE = ["estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "16", "--gbs", "32", "--seq",
            "2048", "--tp", "2", "--pp", "2"]


def test_cli_plan_pins_the_order(capsys, tmp_path):
    out_file = tmp_path / "plan.json"
    code, out, err = run(capsys, *PLAN, "--order", PP_INSIDE_DP, "--out", str(out_file))
    assert code == 0, err
    assert PP_INSIDE_DP in out  # the ranking shows the order column when a plan uses it
    plan = read_plan(out_file)
    assert plan.mesh.rank_order == ["tp", "cp", "pp", "dp"]
    assert plan.search is not None and plan.search.domains["order"] == f"pinned {PP_INSIDE_DP}"
    code, out, err = run(capsys, "show", str(out_file))
    assert code == 0, err
    assert f"order {PP_INSIDE_DP}" in " ".join(out.split())


def test_cli_estimate_takes_the_order(capsys):
    code, out, err = run(capsys, *ESTIMATE, "--order", PP_INSIDE_DP, "--json")
    assert code == 0, err
    assert json.loads(out)["layout"]["rank_order"] == PP_INSIDE_DP
    code, out, err = run(capsys, *ESTIMATE)
    assert code == 0, err
    assert f"order {DEFAULT_RANK_ORDER}" in " ".join(out.split())


@pytest.mark.parametrize("command", [PLAN, ESTIMATE])
def test_cli_refuses_pp_inside_dp_with_ep(capsys, command):
    command = [("mixtral-8x7b" if a == "llama3.1-8b" else a) for a in command]
    code, out, err = run(capsys, *command, "--order", PP_INSIDE_DP, "--ep", "2")
    assert code != 0
    assert_input_error(code, out, err, "tp-cp-pp-dp", "ep = 1", "ep=2")


def test_cli_estimate_takes_pp_inside_dp_with_cp(capsys):
    code, out, err = run(capsys, *ESTIMATE, "--order", PP_INSIDE_DP, "--cp", "2", "--json")
    assert code == 0, err
    lay = json.loads(out)["layout"]
    assert (lay["rank_order"], lay["cp"]) == (PP_INSIDE_DP, 2)


def test_cli_refuses_an_unknown_order(capsys):
    code, out, err = run(capsys, *ESTIMATE, "--order", "pp-dp-tp-cp")
    assert_input_error(code, out, err, "--order")


@pytest.mark.parametrize("name", ["llama3.1-8b", "mixtral-8x7b"])
def test_layer_costs_do_not_depend_on_the_rank_order(name):
    """The planner shares per-layer costs across rank orders (planner/space.py LayerKey): every block's pass times
    and activations are the same in both orders, because the layer's own groups (tp, cp, and etp = tp with ep = 1)
    sit on the same ranks."""
    model = load_zoo(name)
    cl = cluster(32)
    rt = get_runtime("megatron-core")
    contexts = []
    for order in (DEFAULT_RANK_ORDER, PP_INSIDE_DP):
        lay = resolve(model, 32, WL, ParallelConfig(tp=2, pp=2, dp=8, rank_order=order))
        contexts.append(CostContext(model, cl, WL, lay, rt, Efficiency.from_gpu(cl.gpu)))
    a, b = contexts
    assert a.links["pp"] != b.links["pp"] or a.links["dp"] != b.links["dp"]  # the orders do place groups apart
    for i in range(model.num_layers):
        for mode in ("none", "selective", "full"):
            assert a.layer_times(i, mode) == b.layer_times(i, mode)
            assert a.layer_activation(i, mode) == b.layer_activation(i, mode)
    assert (a.embedding, a.head) == (b.embedding, b.head)
