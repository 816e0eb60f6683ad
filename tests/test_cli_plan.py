"""`meshplan plan` and `meshplan show`: the Plan JSON, plan files and traces, the ranking table, the explanation,
and one-line errors (exit 2) for contradicting pins and foreign plan files.

Like tests/test_cli.py, these call cli.main.main(argv) in-process and read stdout and stderr apart with capsys.
A small search (llama3.1-8b on 8 H100s, 16 x 2048 tokens, micro-batches up to 2) keeps each call well under a second.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from cli_helpers import assert_input_error, run

from meshplan.cli.main import main
from meshplan.costmodels.config import Workload
from meshplan.costmodels.model_io import load_zoo
from meshplan.api import calibrated
from meshplan.hardware_db.cluster import ClusterSpec
from meshplan.planner.explain import explain
from meshplan.planner.plan import SCHEMA_VERSION, Plan, read_plan
from meshplan.planner.search import SearchResult, search

PLAN = ["plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "2048",
        "--max-mbs", "2"]
ROW = re.compile(r"^\s*[│|]\s*(\d+)\s*[│|]")  # a ranking row: "│ 1 │ ..."


def default_search() -> SearchResult:
    """The library search PLAN runs, under what plan uses without --calibration (the GPU's public calibration)."""
    hardware, eff = calibrated(ClusterSpec(gpu="h100-sxm", num_gpus=8))
    return search(load_zoo("llama3.1-8b"), hardware, Workload(global_batch=16, seq_len=2048), efficiency=eff,
                  top_k=5, max_mbs=2)


def flat(text: str) -> str:
    """Whitespace collapsed (rich wraps long lines)."""
    return " ".join(text.split())


def ranking_rows(out: str) -> list[int]:
    return [int(m.group(1)) for line in out.splitlines() if (m := ROW.match(line))]


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> Path:
    """A plan written by `plan --out` (one search shared by several tests)."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert main([*PLAN, "--out", str(path)]) == 0
    return path


# ---- plan --json / --out / show ------------------------------------------------------------------------------------

def test_plan_json_is_one_valid_plan_document(capsys):
    code, out, err = run(capsys, *PLAN, "--json")
    assert code == 0, err
    data = json.loads(out)  # the whole of stdout is one JSON document
    assert data["schema_version"] == SCHEMA_VERSION == 1
    assert data["kind"] == "training"
    plan = Plan.model_validate(data)
    assert plan.inputs.cluster.num_gpus == 8 and plan.inputs.workload.global_batch == 16
    assert plan.inputs.workload.seq_len == 2048
    assert plan.mesh.world_size == 8
    assert plan.prediction.fits and plan.prediction.step_time_s > 0
    s = plan.search
    assert s is not None and s.rank == 1
    assert s.status in ("optimal", "gap") and s.gap >= 0
    assert s.space_size > 0 and s.evaluated >= 1
    assert s.lower_bound_s <= plan.prediction.step_time_s * (1 + 1e-9)


def test_plan_json_is_the_searchs_best_plan(capsys):
    code, out, err = run(capsys, *PLAN, "--json")
    assert code == 0, err
    plan = Plan.model_validate_json(out)
    result = default_search()
    best = result.plans[0]
    assert plan.prediction.step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    lay = best.estimate.layout
    assert (plan.mesh.tp, plan.mesh.pp, plan.mesh.dp, plan.mesh.cp) == (lay.tp, lay.pp, lay.dp, lay.cp)
    assert [s.num_layers for s in plan.pipeline.stages] == list(lay.stage_layers)
    assert plan.memory.zero == lay.zero and plan.pipeline.micro_batch_size == lay.mbs
    assert plan.search.space_size == result.account.space_size


def test_out_writes_the_printed_plan_and_show_prints_it(capsys, tmp_path):
    path = tmp_path / "plan.json"
    code, out, err = run(capsys, *PLAN, "--json", "--out", str(path))
    assert code == 0, err
    assert json.loads(path.read_text()) == json.loads(out)
    assert read_plan(path) == Plan.model_validate_json(out)

    code, shown, err = run(capsys, "show", str(path))
    assert code == 0, err
    plan = read_plan(path)
    text = flat(shown)
    assert f"schema v{SCHEMA_VERSION}" in text and "llama3.1-8b" in text
    m = plan.mesh
    assert f"layout: tp {m.tp}, pp {m.pp}, vpp {plan.pipeline.vpp}, dp {m.dp}, cp {m.cp}" in text
    assert f"{plan.prediction.step_time_s:.3f}" in text
    assert "search: rank 1" in text and plan.search.status in text

    code, again, err = run(capsys, "show", "--json", str(path))
    assert code == 0, err
    assert Plan.model_validate_json(again) == plan
    assert json.loads(again) == json.loads(path.read_text())


def test_out_without_json_prints_the_table_and_says_where(capsys, tmp_path):
    path = tmp_path / "p.json"
    code, out, err = run(capsys, *PLAN, "--out", str(path))
    assert code == 0, err
    assert path.is_file() and read_plan(path).search.rank == 1
    assert f"plan written to {path}" in flat(out)


def test_trace_writes_a_chrome_trace(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    code, out, err = run(capsys, *PLAN, "--pp", "2", "--trace", str(trace))
    assert code == 0, err
    data = json.loads(trace.read_text())
    events = data["traceEvents"]
    assert isinstance(events, list) and events
    spans = [e for e in events if e.get("ph") == "X"]
    assert spans and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert {"forward", "backward"} <= {e.get("cat") for e in spans}
    tracks = [e["args"]["name"] for e in events if e.get("ph") == "M" and e["name"] == "thread_name"]
    assert any(t.startswith("stage 0") for t in tracks) and any(t.startswith("stage 1") for t in tracks), tracks
    # every micro-batch passes forward and backward through both stages
    passes = {(e["tid"], e.get("cat")) for e in spans}
    assert len({tid for tid, cat in passes if cat == "forward"}) == 2
    assert "trace written to" in flat(out)


def test_show_trace_rewrites_the_same_timeline(capsys, tmp_path):
    path, trace, again = tmp_path / "p.json", tmp_path / "t1.json", tmp_path / "t2.json"
    code, _, err = run(capsys, *PLAN, "--pp", "2", "--out", str(path), "--trace", str(trace))
    assert code == 0, err
    code, _, err = run(capsys, "show", str(path), "--trace", str(again))
    assert code == 0, err
    assert json.loads(again.read_text()) == json.loads(trace.read_text())


def test_explain_prints_the_explanation(capsys):
    code, out, err = run(capsys, *PLAN, "--explain")
    assert code == 0, err
    result = default_search()
    lines = explain(result)
    assert len(lines) >= 3
    text = flat(out)
    for line in lines:
        assert flat(line) in text, line
    assert "Optimality:" in text and "Memory" in text


def test_without_explain_there_is_no_explanation(capsys):
    code, out, err = run(capsys, *PLAN)
    assert code == 0, err
    assert "Optimality:" not in out and "runner-up" not in out


@pytest.mark.parametrize("top", [1, 3])
def test_top_limits_the_ranking(capsys, top):
    code, out, err = run(capsys, *PLAN, "--top", str(top))
    assert code == 0, err
    rows = ranking_rows(out)
    assert 1 <= len(rows) <= top, out
    assert rows == list(range(1, len(rows) + 1))
    assert f"Best {len(rows)} plans" in out
    # the table's step times are sorted
    times = [float(re.findall(r"│\s*([0-9.]+)\s*│", line)[-4]) for line in out.splitlines() if ROW.match(line)]
    assert times == sorted(times)


def test_default_ranking_shows_at_most_five(capsys):
    code, out, err = run(capsys, *PLAN)
    assert code == 0, err
    assert 1 <= len(ranking_rows(out)) <= 5
    text = flat(out)
    assert "candidates in the space" in text and "pruned:" in text and "infeasible:" in text


def test_pins_reach_the_plan(capsys):
    code, out, err = run(capsys, *PLAN, "--tp", "2", "--pp", "2", "--zero", "1", "--mbs", "1",
                         "--recompute", "selective", "--json")
    assert code == 0, err
    plan = Plan.model_validate_json(out)
    assert (plan.mesh.tp, plan.mesh.pp, plan.memory.zero, plan.pipeline.micro_batch_size) == (2, 2, 1, 1)
    assert plan.memory.recompute == "selective"
    assert "pinned 2" in plan.search.domains["tp"] and "pinned 2" in plan.search.domains["pp"]


def test_moe_plan_with_pinned_ep(capsys):
    code, out, err = run(capsys, "plan", "--model", "mixtral-8x7b", "--gpu", "h100-sxm", "--gpus", "16",
                         "--gbs", "32", "--seq", "2048", "--max-mbs", "1", "--ep", "4", "--json")
    assert code == 0, err
    plan = Plan.model_validate_json(out)
    assert plan.mesh.ep == 4
    assert plan.mesh.tp * plan.mesh.cp * plan.mesh.dp == plan.mesh.ep * plan.mesh.etp * plan.mesh.edp


# ---- errors: one line, exit 2 --------------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,words", [
    (["--tp", "3"], ["3", "8 GPUs"]),  # does not divide the GPUs
    (["--tp", "4", "--pp", "4"], ["16", "8 GPUs"]),
    (["--dp", "3"], ["3"]),
    (["--ep", "2"], ["--ep", "experts"]),  # dense model
    (["--vpp", "2", "--schedule", "1f1b"], ["--vpp 2", "interleaved"]),
    (["--vpp", "2", "--schedule", "gpipe"], ["--vpp 2", "interleaved"]),
    (["--schedule", "interleaved", "--vpp", "1"], ["interleaved", "--vpp"]),
    (["--zero", "4"], ["--zero"]),
    (["--schedule", "2f2b"], ["--schedule"]),
    (["--recompute", "some"], ["--recompute"]),
    (["--top", "0"], ["--top"]),
    (["--max-mbs", "0"], ["--max-mbs"]),
])
def test_contradicting_or_bad_pins_are_one_line_errors(capsys, extra, words):
    assert_input_error(*run(capsys, *PLAN, *extra), *words)


def test_tp_not_dividing_the_heads_is_an_error_not_an_empty_plan(capsys):
    # 24 GPUs: tp 3 divides them but not the 32 heads of llama3.1-8b
    code, out, err = run(capsys, "plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "24", "--gbs",
                         "48", "--seq", "2048", "--max-mbs", "1", "--tp", "3")
    line = assert_input_error(code, out, err)
    assert "head" in line.lower() or "divis" in line.lower(), line


def test_show_refuses_a_newer_schema(capsys, tmp_path, plan_file):
    path = plan_file
    data = json.loads(path.read_text())
    data["schema_version"] = 2
    newer = tmp_path / "v2.json"
    newer.write_text(json.dumps(data))
    line = assert_input_error(*run(capsys, "show", str(newer)), "schema", "v2")
    assert "upgrade" in line.lower()
    assert_input_error(*run(capsys, "show", "--json", str(newer)), "schema", "v2")


def test_show_refuses_an_older_schema_and_other_kinds(capsys, tmp_path, plan_file):
    path = plan_file
    data = json.loads(path.read_text())
    older = tmp_path / "v0.json"
    older.write_text(json.dumps({**data, "schema_version": 0}))
    assert_input_error(*run(capsys, "show", str(older)), "schema", "v0")
    serving = tmp_path / "serving.json"
    serving.write_text(json.dumps({**data, "kind": "serving"}))
    assert_input_error(*run(capsys, "show", str(serving)), "serving")


@pytest.mark.parametrize("content", ["", "{not json", "[]", '{"kind": "training"}'])
def test_show_refuses_what_is_not_a_plan(capsys, tmp_path, content):
    f = tmp_path / "x.json"
    f.write_text(content)
    assert_input_error(*run(capsys, "show", str(f)), str(f))


def test_show_missing_file(capsys, tmp_path):
    assert_input_error(*run(capsys, "show", str(tmp_path / "nope.json")), "nope.json")


def test_show_refuses_an_edited_inconsistent_plan(capsys, tmp_path, plan_file):
    path = plan_file
    data = json.loads(path.read_text())
    data["mesh"]["world_size"] = 16
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    assert_input_error(*run(capsys, "show", str(bad)), "world_size")


def test_out_to_a_missing_directory_is_one_line(capsys, tmp_path):
    assert_input_error(*run(capsys, *PLAN, "--out", str(tmp_path / "no" / "such" / "plan.json")), "plan.json")


def test_tiny_time_limit_does_not_claim_nothing_fits(capsys):
    """llama3.1-8b fits 8 H100s; a search stopped by its time limit before finding a plan must say that it ran
    out of time, not that nothing fits."""
    code, out, err = run(capsys, *PLAN, "--time-limit", "0.001")
    if code == 0:
        assert ranking_rows(out) and "time-limit" in out
    else:
        line = assert_input_error(code, out, err)
        assert "time" in line.lower() and "nothing fits" not in line, line


# ---- help ----------------------------------------------------------------------------------------------------------

def test_plan_help_says_flags_pin_and_the_rest_is_searched(capsys):
    code, out, _ = run(capsys, "plan", "--help")
    assert code == 0
    text = flat(out)
    assert "Every knob flag pins that knob" in text
    assert "the others are searched" in text
    for flag in ("--tp", "--pp", "--vpp", "--cp-comm", "--ep", "--etp", "--mbs", "--zero", "--recompute",
                 "--schedule", "--max-mbs", "--top", "--time-limit", "--out", "--trace", "--explain", "--json"):
        assert flag in out, flag
    assert "per-stage" in text


def test_show_help(capsys):
    code, out, _ = run(capsys, "show", "--help")
    assert code == 0
    assert "--trace" in out and "--json" in out and "schema" in flat(out)
