"""`plan --export` that the launcher refuses: the plan is still written and shown, then the best plan that launcher
runs is searched (the refusal's alternatives as pins) and named with the flags that ask for it."""

from __future__ import annotations

import json

import pytest
from cli_helpers import run

from meshplan import api
from meshplan.costmodels.config import ParallelConfig, Workload
from meshplan.hardware_db.cluster import ClusterSpec
from meshplan.planner.launchers import export_plan
from meshplan.planner.launchers.common import ExportError

CLUSTER = ClusterSpec(gpu="h100-sxm", num_gpus=64)
WORKLOAD = Workload(global_batch=256, seq_len=8192)
ARGS = ("plan", "--model", "llama3.1-70b", "--gpu", "h100-sxm", "--gpus", "64", "--gbs", "256", "--seq", "8192")


@pytest.fixture(scope="module")
def refused():
    """The best Llama-3.1-70B plan here recomputes per stage, which Megatron refuses (one policy for every stage)."""
    best = api.plan("llama3.1-70b", CLUSTER, WORKLOAD)
    with pytest.raises(ExportError) as info:
        export_plan(best, "megatron")
    assert info.value.pins  # the refusal says which pins would avoid it
    return best, info.value


def test_runnable_plan_is_exportable_and_no_faster_than_the_best(refused):
    best, refusal = refused
    runnable = api.runnable_plan("llama3.1-70b", CLUSTER, WORKLOAD, "megatron", refused=refusal)
    assert runnable is not None and runnable.pins
    export_plan(runnable.found.plan, "megatron")  # does not raise
    assert runnable.found.plan.prediction.step_time_s >= best.prediction.step_time_s
    # it is the fastest of the alternatives the refusal named, each searched on its own
    times = []
    for pins in refusal.pins:
        doc = api.plan("llama3.1-70b", CLUSTER, WORKLOAD, ParallelConfig(**pins))
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
    assert code == 2 and err.strip().startswith("error: cannot export to megatron")
    assert json.loads(path.read_text())["prediction"]["step_time_s"] == pytest.approx(best.prediction.step_time_s)
    assert not script.exists()  # the export that was refused is not written
    assert "best plan megatron runs:" in out
    flags = next(x for x in out.splitlines() if x.startswith("to plan it, add: ")).removeprefix("to plan it, add: ")
    assert "--recompute" in flags
    # the flags it names give a plan megatron takes
    code, out, err = run(capsys, *ARGS, *flags.split(), "--export", "megatron", "--export-out", str(script))
    assert code == 0, err
    assert script.exists()
