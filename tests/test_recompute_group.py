"""--recompute-group N: full recomputation in groups of N layers (Megatron --recompute-method uniform
--recompute-num-layers N), the knob docs/knobs.md's recipe added: its rule, its memory, its exports, its refusals."""

import math

import pytest
from launcher_helpers import make_plan

from meshplan.costmodels.config import ParallelConfig, Workload, resolve
from meshplan.costmodels.estimate import estimate
from meshplan.costmodels.memory import layer_activation_bytes
from meshplan.costmodels.model_io import load_model
from meshplan.costmodels.runtime import get_runtime
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.planner.launchers import ExportError, export_plan
from meshplan.planner.launchers.megatron import parse_megatron_args
from meshplan.planner.plan import plan_config
from meshplan.planner.search import search

MODEL = load_model("llama3.1-8b")  # 32 identical layers
CLUSTER = Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=8))
WL = Workload(global_batch=16, seq_len=4096)


def test_groups_need_full_recomputation_of_every_layer():
    with pytest.raises(InputError, match="--recompute-group 4 groups the full recomputation.*add --recompute full"):
        resolve(MODEL, 8, WL, ParallelConfig(tp=2, recompute_group=4))
    with pytest.raises(InputError, match="--recompute-group"):
        resolve(MODEL, 8, WL, ParallelConfig(tp=2, pp=2, recompute="per-stage", recompute_group=2, stage_recompute=(
            resolve(MODEL, 8, WL, ParallelConfig(tp=2, pp=2, recompute="full")).stage_recompute[0],
            resolve(MODEL, 8, WL, ParallelConfig(tp=2, pp=2)).stage_recompute[0])))
    assert resolve(MODEL, 8, WL, ParallelConfig(tp=2, recompute="full", recompute_group=4)).recompute_group == 4
    assert resolve(MODEL, 8, WL, ParallelConfig(tp=2)).recompute_group == 1


@pytest.mark.parametrize("group,pp", [(2, 1), (4, 1), (5, 1), (3, 2), (32, 1)])
def test_groups_keep_one_input_each_and_rebuild_a_group_at_once(group, pp):
    """Same step time (every layer re-run once either way); activations: ceil(L/N) kept inputs per micro-batch held
    instead of L, plus N layers' activations instead of one while a group is rebuilt."""
    one = estimate(MODEL, CLUSTER, WL, ParallelConfig(tp=2, pp=pp, recompute="full"))
    grouped = estimate(MODEL, CLUSTER, WL, ParallelConfig(tp=2, pp=pp, recompute="full", recompute_group=group))
    assert grouped.step_time_s == one.step_time_s
    rt = get_runtime("megatron-core")
    a_none = layer_activation_bytes(MODEL, 0, one.layout, WL, rt, "none")
    a_input = layer_activation_bytes(MODEL, 0, one.layout, WL, rt, "full")
    for s1, sn, layers in zip(one.stages, grouped.stages, one.layout.stage_layers, strict=True):
        kept = (layers - math.ceil(layers / group)) * s1.in_flight * a_input
        rebuilt = (min(group, layers) - 1) * a_none
        assert sn.memory.activations == pytest.approx(s1.memory.activations - kept + rebuilt, rel=1e-12)
    assert grouped.layout.recompute_group == group


def test_megatron_writes_and_reads_the_group_and_the_others_refuse():
    plan = make_plan("llama3.1-8b", "h100-sxm", 8, WL, ParallelConfig(tp=2, recompute="full", recompute_group=4))
    assert plan.memory.recompute_group == 4 and plan_config(plan)[3].recompute_group == 4
    argv = export_plan(plan, "megatron").files[0].text
    assert "--recompute-method uniform" in argv and "--recompute-num-layers 4" in argv
    assert parse_megatron_args(argv).config.recompute_group == 4
    nemo = "\n".join(f.text for f in export_plan(plan, "nemo").files)
    assert "recompute_method='uniform'" in nemo and "recompute_num_layers=4" in nemo
    for target in ("torchtitan", "deepspeed", "torchrun"):
        with pytest.raises(ExportError, match="groups of 4"):
            export_plan(plan, target)


def test_estimate_takes_the_option_and_plan_does_not(capsys):
    from cli_helpers import run

    args = ("--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "4096", "--tp", "2")
    code, out, err = run(capsys, "estimate", *args, "--recompute", "full", "--recompute-group", "4", "--json")
    assert code == 0, err
    assert '"recompute_group": 4' in out
    code, out, err = run(capsys, "plan", *args, "--recompute-group", "2")
    assert code == 2 and "No such option: --recompute-group" in err


@pytest.mark.parametrize("flags,words", [(("--recompute-group", "2"), "add --recompute full"),
                                         (("--recompute", "per-stage"), "choose none, selective or full")])
def test_estimate_refuses_what_a_command_line_cannot_say(capsys, flags, words):
    from cli_helpers import assert_input_error, run

    args = ("--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "4096")
    assert_input_error(*run(capsys, "estimate", *args, *flags), words)


def test_the_search_does_not_take_it():
    with pytest.raises(InputError, match="does not search recompute_group"):
        search(MODEL, CLUSTER, WL, ParallelConfig(recompute="full", recompute_group=2), max_mbs=2)


def test_verify_refuses_it_before_any_rank_starts():
    pytest.importorskip("torch")
    from meshplan.executor.verify import _check_runnable

    lay = resolve(MODEL, 8, WL, ParallelConfig(tp=2, recompute="full", recompute_group=4))
    with pytest.raises(InputError, match="recomputes layer by layer.*verify it as --recompute-group 1"):
        _check_runnable(lay, lay.num_microbatches, None)
    _check_runnable(resolve(MODEL, 8, WL, ParallelConfig(tp=2, recompute="full")), 1, None)
