"""`plan --export` that the launcher refuses: the plan is still written and shown, then the best plan that launcher
runs is searched (the refusal's alternatives as pins) and named with the flags that ask for it."""

from __future__ import annotations

import functools
import json

import pytest
from cli_helpers import run

from meshplan import api
from meshplan.costmodels.config import ParallelConfig, Workload
from meshplan.hardware_db.cluster import ClusterSpec
from meshplan.planner.launchers import export_plan
from meshplan.costmodels.runtime import RUNTIMES
from meshplan.planner.launchers.common import RUNTIME_LAUNCHER, ExportError

CLUSTER = ClusterSpec(gpu="h100-sxm", num_gpus=64)
WORKLOAD = Workload(global_batch=256, seq_len=8192)
# planned for meshplan's executor, which recomputes each stage its own way; Megatron cannot
EXECUTOR = "meshplan-executor"
ARGS = ("plan", "--model", "llama3.1-70b", "--gpu", "h100-sxm", "--gpus", "64", "--gbs", "256", "--seq", "8192",
        "--runtime", EXECUTOR)


@functools.cache
def best_plan(model: str, cluster: ClusterSpec, workload: Workload, runtime: str):
    """One search per (model, cluster, workload, runtime) for the whole module."""
    return api.plan(model, cluster, workload, runtime=runtime)


@pytest.fixture(scope="module")
def refused():
    """The best Llama-3.1-70B plan for the executor recomputes per stage, which Megatron refuses (one policy for every
    stage)."""
    best = best_plan("llama3.1-70b", CLUSTER, WORKLOAD, EXECUTOR)
    with pytest.raises(ExportError) as info:
        export_plan(best, "megatron")
    assert info.value.pins  # the refusal says which pins would avoid it
    return best, info.value


def test_runnable_plan_is_exportable_and_no_faster_than_the_best(refused):
    best, refusal = refused
    runnable = api.runnable_plan("llama3.1-70b", CLUSTER, WORKLOAD, "megatron", runtime=EXECUTOR, refused=refusal)
    assert runnable is not None and runnable.pins
    export_plan(runnable.found.plan, "megatron")  # does not raise
    assert runnable.found.plan.prediction.step_time_s >= best.prediction.step_time_s
    # it is the fastest of the alternatives the refusal named, each searched on its own
    times = []
    for pins in refusal.pins:
        doc = api.plan("llama3.1-70b", CLUSTER, WORKLOAD, ParallelConfig(**pins), runtime=EXECUTOR)
        try:
            export_plan(doc, "megatron")
        except ExportError:
            continue
        times.append(doc.prediction.step_time_s)
    assert runnable.found.plan.prediction.step_time_s == pytest.approx(min(times), rel=1e-12)


def test_refused_export_still_writes_the_plan_and_names_the_runnable_one(refused, capsys, tmp_path):
    best, _ = refused
    path, script = tmp_path / "plan.json", tmp_path / "megatron.sh"
    code, out, err = run(capsys, *ARGS, "--out", str(path), "--export", "megatron", "--export-out", str(script))
    lines = [x for x in err.splitlines() if not x.startswith("progress: ")]  # a long search's, piped
    assert code == 2 and lines[0].startswith("error: cannot export to megatron")
    assert json.loads(path.read_text())["prediction"]["step_time_s"] == pytest.approx(best.prediction.step_time_s)
    assert not script.exists()  # the export that was refused is not written
    assert "best plan megatron runs:" in out
    flags = next(x for x in out.splitlines() if x.startswith("to plan it, add: ")).removeprefix("to plan it, add: ")
    assert "--recompute" in flags
    # the flags it names give a plan megatron takes
    code, out, err = run(capsys, *ARGS, *flags.split(), "--export", "megatron", "--export-out", str(script))
    assert code == 0, err
    assert script.exists()


# the Quickstart's workload and a MoE one (a model torchtitan defines, so every launcher has it)
RUNTIME_WORKLOADS = [("llama3.1-70b", CLUSTER, WORKLOAD),
                     ("qwen3-30b-a3b", ClusterSpec(gpu="h100-sxm", num_gpus=16), Workload(global_batch=64,
                                                                                          seq_len=4096))]


@pytest.mark.parametrize("runtime", sorted(RUNTIMES))
@pytest.mark.parametrize("model,cluster,workload", RUNTIME_WORKLOADS, ids=["quickstart-70b", "moe-qwen3-30b"])
def test_a_plan_made_for_a_runtime_exports_to_its_launcher(runtime, model, cluster, workload):
    """The runtime preset bounds the search to what its framework runs (Runtime.recomputes, schedules, ZeRO stages,
    CP kinds): the best plan for each preset exports to that preset's launcher without a refusal. The Quickstart's
    plan used to recompute per stage under megatron-core, which Megatron-LM refuses."""
    assert set(RUNTIME_LAUNCHER) == set(RUNTIMES)
    doc = best_plan(model, cluster, workload, runtime)
    exported = export_plan(doc, RUNTIME_LAUNCHER[runtime])
    assert exported.files
    if runtime != "meshplan-executor":
        assert {s.recompute.granularity for s in doc.pipeline.stages} and len(
            {(s.recompute.granularity, s.recompute.full_layers) for s in doc.pipeline.stages}) == 1


def test_an_export_for_another_framework_prints_both_predictions(capsys, tmp_path):
    """A megatron-core plan exported to torchtitan is priced again under torchtitan: the header and the command say
    both figures (the torchtitan header used to carry Megatron-Core's alone)."""
    plan = tmp_path / "p.json"
    assert run(capsys, "plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq",
               "2048", "--zero", "3", "--out", str(plan))[0] == 0
    code, out, err = run(capsys, "export", str(plan), "--to", "torchtitan", "--out", str(tmp_path / "t"))
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("note: under torchtitan"))
    assert "megatron-core prediction" in line
    header = (tmp_path / "t" / "torchtitan.toml").read_text()
    assert line.removeprefix("note: ") in header
    code, out, err = run(capsys, "export", str(plan), "--to", "megatron")
    assert code == 0 and "note: under" not in err  # the same framework: one prediction
