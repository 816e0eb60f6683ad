"""`meshplan compare` and the comparison `import` ends with."""

from __future__ import annotations

import json

import pytest
from cli_helpers import assert_input_error, run

from meshplan import api
from meshplan.costmodels.config import ParallelConfig, Workload
from meshplan.hardware_db.cluster import ClusterSpec
from meshplan.planner.compare import compare_plans
from meshplan.planner.plan import write_plan

CLUSTER = ClusterSpec(gpu="h100-sxm", num_gpus=16)
WORKLOAD = Workload(global_batch=64, seq_len=4096)


@pytest.fixture(scope="module")
def two_plans(tmp_path_factory):
    """The best plan of Llama-3.1-8B on 16 H100s and the same search with TP pinned to 8."""
    folder = tmp_path_factory.mktemp("compare")
    best = api.priced(api.plan("llama3.1-8b", CLUSTER, WORKLOAD))
    tp8 = api.priced(api.plan("llama3.1-8b", CLUSTER, WORKLOAD, ParallelConfig(tp=8)))
    write_plan(best, folder / "best.json")
    write_plan(tp8, folder / "tp8.json")
    return best, tp8, folder


def test_comparison_lists_the_differing_knobs_and_names_the_faster(two_plans):
    best, tp8, _ = two_plans
    assert best.prediction.layout.tp != 8
    c = compare_plans([tp8, best], ["tp8", "best"])
    knobs = {r.label: r.values for r in c.knobs}
    assert knobs["tp"] == ("8", str(best.prediction.layout.tp))
    assert "gpu" not in knobs and "model" not in knobs  # the same in both: not listed
    metrics = {r.label: r.values for r in c.metrics}
    assert metrics["step time, s"] == (f"{tp8.prediction.step_time_s:.3f}", f"{best.prediction.step_time_s:.3f}")
    # each plan's 80 % range (costmodels/uncertainty.py), as its file records it
    assert metrics["  80 % range, s"] == tuple("-".join(f"{t:.3f}" for t in d.prediction.interval.step_time_s)
                                               for d in (tp8, best))
    assert metrics["$/hour"] == (f"{16 * tp8.economics.usd_per_gpu_hour:,.2f}",) * 2
    faster = best.prediction.tokens_per_s / tp8.prediction.tokens_per_s - 1
    assert c.verdict[0] == "fastest: best"
    assert c.verdict[1].startswith(f"best makes {faster:.1%} more tokens/s than tp8; per step tp8 spends ")
    # the terms named are those that differ most between the two breakdowns
    diffs = {t: tp8.prediction.breakdown_s.get(t, 0) - best.prediction.breakdown_s.get(t, 0)
             for t in set(best.prediction.breakdown_s) | set(tp8.prediction.breakdown_s)}
    top = max(diffs, key=lambda t: abs(diffs[t]))
    assert c.verdict[1].split("spends ")[1].startswith(top)


def test_compare_command_prints_both_and_refuses_what_it_cannot_read(two_plans, capsys, tmp_path):
    _, _, folder = two_plans
    code, out, err = run(capsys, "compare", str(folder / "best.json"), str(folder / "tp8.json"))
    assert code == 0, err
    assert "fastest: best" in out and "│ tp " in out
    assert_input_error(*run(capsys, "compare", str(folder / "best.json")), "two plans")
    serving = tmp_path / "serve.json"
    code, _, err = run(capsys, "serve", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--isl", "512",
                       "--osl", "64", "--out", str(serving))
    assert code == 0, err
    assert_input_error(*run(capsys, "compare", str(folder / "best.json"), str(serving)), "serving plan")
    assert_input_error(*run(capsys, "compare", str(folder / "best.json"), str(tmp_path / "none.json")), "none.json")


def test_import_ends_with_the_best_plan_beside_it(two_plans, capsys, tmp_path):
    """A Megatron launch of the TP8 plan, imported: its estimate, then the table with the search's best on the same
    inputs, whose step time is the plan command's."""
    best, _, folder = two_plans
    script = tmp_path / "megatron.sh"
    code, _, err = run(capsys, "export", str(folder / "tp8.json"), "--to", "megatron", "--out", str(script))
    assert code == 0, err
    code, out, err = run(capsys, "import", "--from", "megatron", str(script), "--gpu", "h100-sxm", "--model",
                         "llama3.1-8b")
    assert code == 0, err
    assert "imported" in out and "best plan" in out
    step_row = next(line for line in out.splitlines() if "step time, s" in line)
    assert f"{best.prediction.step_time_s:.3f}" in step_row
    code, out, err = run(capsys, "import", "--from", "megatron", str(script), "--gpu", "h100-sxm", "--model",
                         "llama3.1-8b", "--no-compare")
    assert code == 0 and "best plan" not in out
    code, out, err = run(capsys, "import", "--from", "megatron", str(script), "--gpu", "h100-sxm", "--model",
                         "llama3.1-8b", "--json")
    assert code == 0 and json.loads(out)["economics"]["gpus"] == 16
