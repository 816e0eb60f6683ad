"""The plan file (schema v1) and the Chrome trace: round trips, the published schema, refusals, atomic writes."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from itertools import pairwise
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshplan.costmodels.config import ParallelConfig, StagePolicy, Workload
from meshplan.costmodels.timing import RANK_ORDER
from meshplan.costmodels.estimate import simulate_config
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import load_zoo
from meshplan.costmodels.pipeline import StageTimes, build_schedule, simulate
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import load_gpu
from meshplan.planner.builders import build_plan
from meshplan.planner.plan import (SCHEMA_PATH, Plan, plan_config, plan_json_schema, read_plan, write_plan,
                                   write_schema_file)
from meshplan.planner.search import SearchAccount
from meshplan.planner.trace import PROCESS_NAME, chrome_trace, write_trace

WL = Workload(global_batch=32, seq_len=4096)
LLAMA_CFG = ParallelConfig(tp=2, pp=2, stage_layers=(15, 17),
                           stage_recompute=(StagePolicy(granularity="full", full_layers=3), StagePolicy()))
ACCOUNT = SearchAccount(space_size=1200, evaluated=40, bounded=300, pruned={"work bound": 800},
                        infeasible={"memory: no stage partition fits": 60}, seconds=1.5, status="optimal", gap=0.0,
                        lower_bound_s=0.8, domains={"tp": "1, 2, 4, 8"}, cpsat_calls=2)


def cluster(n: int = 16) -> Cluster:
    return Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=n))


def make(model: str | ModelSpec = "llama3.1-8b", cfg: ParallelConfig = LLAMA_CFG, n: int = 16,
         runtime: str = "megatron-core", **extra):
    spec = load_zoo(model) if isinstance(model, str) else model
    c = cluster(n)
    sim = simulate_config(spec, c, WL, cfg, runtime)
    return build_plan(spec, c, WL, cfg, sim, runtime, **extra), sim


def assert_close(a, b, rel: float = 1e-12, where: str = "") -> None:
    """Equal structure; floats equal within `rel` (relative)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a, b)
        for k in a:
            assert_close(a[k], b[k], rel, f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close(x, y, rel, f"{where}[{i}]")
    elif isinstance(a, float) or isinstance(b, float):
        assert math.isclose(a, b, rel_tol=rel, abs_tol=1e-300), (where, a, b)
    else:
        assert a == b, (where, a, b)


def resimulate(plan: Plan):
    model, c, wl, cfg, runtime = plan_config(plan)
    return simulate_config(model, c, wl, cfg, runtime)


def write_raw(path: Path, data) -> Path:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


# ---- round trip ----------------------------------------------------------------------------------------------------

def test_llama_plan_round_trips_and_resimulates(tmp_path):
    plan, sim = make(account=ACCOUNT, rank=1, bound_s=0.8, partition_status="optimal")
    path = tmp_path / "plan.json"
    write_plan(plan, path)
    back = read_plan(path)
    assert back == plan
    assert_close(resimulate(back).estimate.to_dict(), back.prediction.model_dump(exclude={"stage_time_s"}))

    # What an exporter reads.
    assert plan.mesh.model_dump() == {"tp": 2, "cp": 1, "pp": 2, "dp": 4, "ep": 1, "etp": 2, "edp": 4, "sp": True,
                                      "cp_comm": "ring", "rank_order": list(RANK_ORDER), "world_size": 16}
    s0, s1 = plan.pipeline.stages
    assert (s0.first_layer, s0.num_layers, s0.embedding, s0.head) == (0, 15, True, False)
    assert (s1.first_layer, s1.num_layers, s1.embedding, s1.head) == (15, 17, False, True)
    assert [c.model_dump() for c in s1.chunks] == [{"first_layer": 15, "num_layers": 17}]
    assert s0.recompute == StagePolicy(granularity="full", full_layers=3) and s1.recompute == StagePolicy()
    assert plan.pipeline.num_microbatches == 8 and plan.pipeline.schedule == "1f1b"
    assert plan.memory.recompute == "per-stage" and plan.memory.zero == 1
    assert plan.inputs.cluster.gpus_per_node == 8
    assert "datasheet" in plan.inputs.cluster.gpu_spec.hbm_gib.source
    assert plan.search is not None and plan.search.rank == 1 and plan.search.pruned == {"work bound": 800}
    # per-stage pass times are the timeline's
    for st_ in plan.prediction.stage_time_s:
        assert st_.busy_s == sim.timeline.busy[st_.rank]
        assert st_.busy_s == pytest.approx(8 * (st_.forward_s + st_.backward_s), rel=1e-9)


def test_prediction_has_exactly_the_estimates_keys():
    plan, sim = make()
    dumped = plan.prediction.model_dump()
    assert set(dumped) == set(sim.estimate.to_dict()) | {"stage_time_s"}
    assert_close(dumped["stages"], sim.estimate.to_dict()["stages"], rel=0)
    assert [m.breakdown_gib.model_dump() for m in plan.memory.stages] == [s["memory_gib"] for s in dumped["stages"]]


def test_moe_plan_round_trips(tmp_path):
    plan, _ = make("mixtral-8x7b", ParallelConfig(tp=2, pp=2, ep=2, zero=3, recompute="full"))
    assert plan.mesh.ep == 2 and plan.inputs.model["moe"]["experts"] == 8
    write_plan(plan, tmp_path / "moe.json")
    back = read_plan(tmp_path / "moe.json")
    assert back == plan
    assert_close(resimulate(back).estimate.to_dict(), back.prediction.model_dump(exclude={"stage_time_s"}))


def test_interleaved_plan_lists_chunks(tmp_path):
    plan, _ = make(cfg=ParallelConfig(tp=2, pp=2, vpp=2, recompute="selective"))
    s0, s1 = plan.pipeline.stages
    assert [(c.first_layer, c.num_layers) for c in s0.chunks] == [(0, 8), (16, 8)]
    assert [(c.first_layer, c.num_layers) for c in s1.chunks] == [(8, 8), (24, 8)]
    write_plan(plan, tmp_path / "p.json")
    assert_close(resimulate(read_plan(tmp_path / "p.json")).estimate.to_dict(),
                 plan.prediction.model_dump(exclude={"stage_time_s"}))


def test_plan_needs_no_zoo_or_hardware_db(tmp_path, monkeypatch):
    """A custom GPU and a custom model: the plan alone re-simulates with every lookup disabled."""
    gpu = load_gpu("h100-sxm").model_copy(update={"name": "my-gpu", "display_name": "My GPU"})
    model = ModelSpec(name="tiny", num_layers=4, hidden=512, num_heads=8, ffn_hidden=1536, vocab=1000)
    c = Cluster(ClusterSpec(gpu="my-gpu", num_gpus=4), gpu=gpu)
    cfg = ParallelConfig(pp=2)
    sim = simulate_config(model, c, WL, cfg)
    write_plan(build_plan(model, c, WL, cfg, sim, "megatron-core"), tmp_path / "p.json")

    def no_lookup(*_a, **_k):
        raise AssertionError("a plan must not need a lookup")

    monkeypatch.setattr("meshplan.hardware_db.cluster.load_gpu", no_lookup)
    monkeypatch.setattr("meshplan.costmodels.model_io.load_zoo", no_lookup)
    plan = read_plan(tmp_path / "p.json")
    assert plan.search is None and plan.inputs.calibration is None
    assert_close(resimulate(plan).estimate.to_dict(), plan.prediction.model_dump(exclude={"stage_time_s"}))


def test_build_plan_refuses_a_foreign_simulation():
    spec, c = load_zoo("llama3.1-8b"), cluster()
    sim = simulate_config(spec, c, WL, ParallelConfig(tp=2, pp=2))
    with pytest.raises(ValueError, match="not made from"):
        build_plan(spec, c, WL, ParallelConfig(tp=4, pp=2), sim, "megatron-core")
    with pytest.raises(ValueError, match="runtime"):
        build_plan(spec, c, WL, ParallelConfig(tp=2, pp=2), sim, "torchtitan")


# ---- schema --------------------------------------------------------------------------------------------------------

def test_published_schema_is_current(tmp_path):
    assert json.loads(SCHEMA_PATH.read_text()) == plan_json_schema(), "run `python -m planner.plan`"
    assert json.loads(write_schema_file(tmp_path / "s.json").read_text()) == plan_json_schema()
    schema = plan_json_schema()
    assert schema["$schema"].endswith("2020-12/schema") and schema["$id"] and "v1" in schema["title"]


def test_written_plan_validates_against_the_schema(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    plan, _ = make(account=ACCOUNT)
    write_plan(plan, tmp_path / "p.json")
    jsonschema.validate(json.loads((tmp_path / "p.json").read_text()), plan_json_schema())


# ---- refusals ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def plan_data() -> dict:
    plan, _ = make()
    return plan.model_dump(mode="json")


def _edit(data: dict, dotted: str, value) -> dict:
    out = json.loads(json.dumps(data))
    *parents, last = dotted.split(".")
    node = out
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node[p]
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return out


_DELETE = object()


@pytest.mark.parametrize("dotted, value, words", [
    ("schema_version", 2, ["schema v2", "reads v1", "upgrade meshplan"]),
    ("schema_version", 0, ["schema v0", "re-run meshplan plan"]),
    ("schema_version", _DELETE, ["is not a meshplan plan (no schema_version)"]),
    ("schema_version", "1", ["schema_version must be an integer"]),
    ("kind", "serving", ["kind \"serving\"", "training plans"]),
    ("prediction.step_time_s", "fast", ["prediction.step_time_s", "number"]),
    ("mesh.tp", 2.5, ["mesh.tp", "integer"]),
    ("pipeline.stages.0.recompute.granularity", "some", ["pipeline.stages.0.recompute.granularity"]),
    ("inputs.workload.extra", 1, ["inputs.workload.extra", "not permitted"]),
    ("inputs.model.heads", _DELETE, ["inputs.model", "heads"]),
    ("inputs.runtime", "deepspeed", ["inputs.runtime", "unknown runtime"]),
    ("mesh.world_size", 32, ["world_size"]),
])
def test_read_plan_refuses_bad_plans(tmp_path, plan_data, dotted, value, words):
    path = write_raw(tmp_path / "plan.json", _edit(plan_data, dotted, value))
    with pytest.raises(InputError) as err:
        read_plan(path)
    msg = str(err.value)
    assert "\n" not in msg and str(path) in msg, msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("content, words", [
    ("{not json", ["not valid JSON"]),
    ("[1, 2]", ["is not a meshplan plan (no schema_version)"]),
    (None, ["no such file"]),
])
def test_read_plan_refuses_non_plans(tmp_path, content, words):
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(InputError) as err:
        read_plan(path)
    assert "\n" not in str(err.value) and all(w in str(err.value) for w in words), str(err.value)


# ---- atomic write --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("target", ["json.dumps", "os.replace", "os.fsync"])
def test_write_plan_is_atomic(tmp_path, monkeypatch, target):
    old, _ = make()
    new, _ = make(cfg=ParallelConfig(tp=2, pp=2, recompute="full"))
    path = tmp_path / "plan.json"
    write_plan(old, path)
    before = path.read_bytes()

    def boom(*_a, **_k):
        raise OSError("disk full")

    module, name = target.split(".")
    monkeypatch.setattr(f"meshplan.planner.plan.{module}.{name}", boom)
    with pytest.raises((OSError, InputError)):
        write_plan(new, path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["plan.json"]  # no temporary file left
    write_plan(new, path)
    assert read_plan(path) == new


def test_write_plan_to_a_missing_directory_is_an_input_error(tmp_path):
    plan, _ = make()
    with pytest.raises(InputError, match="cannot write the plan"):
        write_plan(plan, tmp_path / "no" / "plan.json")


# ---- trace ---------------------------------------------------------------------------------------------------------

PASS_CATS = {"forward", "backward", "weight-grad"}


def _tracks(trace: dict) -> dict[int, list[dict]]:
    out: dict[int, list[dict]] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            out.setdefault(e["tid"], []).append(e)
    return out


def _check_well_formed(trace: dict) -> None:
    json.loads(json.dumps(trace, allow_nan=False))
    assert trace["displayTimeUnit"] == "ms"
    for e in trace["traceEvents"]:
        assert {"ph", "ts", "pid", "tid", "name"} <= e.keys(), e
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0, e
    for tid, slices in _tracks(trace).items():
        slices = sorted(slices, key=lambda e: e["ts"])
        for a, b in pairwise(slices):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6 * max(1.0, b["ts"]), (tid, a, b)


@pytest.mark.parametrize("schedule, per_mb", [("1f1b", 2), ("zb", 3)])
def test_trace_matches_the_timeline(tmp_path, schedule, per_mb):
    cfg = ParallelConfig(tp=2, pp=4, schedule=schedule)
    _, sim = make(cfg=cfg)
    trace = chrome_trace(sim)
    _check_well_formed(trace)
    m, pp = sim.estimate.layout.num_microbatches, 4
    meta = [e for e in trace["traceEvents"] if e["ph"] == "M"]
    assert [e["args"]["name"] for e in meta if e["name"] == "process_name"] == [PROCESS_NAME]
    names = [e["args"]["name"] for e in meta if e["name"] == "thread_name"]
    assert names[:2] == ["stage 0 (layers 0-7)", "stage 0 comm"] and len(names) == 2 * pp
    passes = [e for e in trace["traceEvents"] if e.get("cat") in PASS_CATS]
    by_tid: dict[int, int] = {}
    for e in passes:
        by_tid[e["tid"]] = by_tid.get(e["tid"], 0) + 1
    assert sorted(by_tid.values()) == [per_mb * m] * pp
    want = sorted((f"{p.kind} mb{p.microbatch}", s * 1e6, (e - s) * 1e6) for _, p, s, e in sim.timeline.events)
    got = sorted((e["name"], e["ts"], e["dur"]) for e in passes)
    for (wn, wts, wdur), (gn, gts, gdur) in zip(want, got, strict=True):
        assert wn == gn and gts == pytest.approx(wts, abs=1e-6) and gdur == pytest.approx(wdur, abs=1e-6)
    sends = [e for e in trace["traceEvents"] if e.get("cat") == "p2p"]
    assert len(sends) == 2 * m * (pp - 1)  # every forward but the last stage's, every backward but the first's
    assert all(e["dur"] == pytest.approx(sim.p2p_s * 1e6) for e in sends)
    # the critical rank's tail ends at the step time
    tail = [e for e in trace["traceEvents"] if e.get("cat") in ("dp-comm", "optimizer")]
    assert tail and max(e["ts"] + e["dur"] for e in tail) == pytest.approx(sim.estimate.step_time_s * 1e6)
    write_trace(trace, tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == trace


def test_trace_interleaved_names_chunks_and_custom_names():
    _, sim = make(cfg=ParallelConfig(tp=2, pp=2, vpp=2))
    trace = chrome_trace(sim, names=["first", "second"])
    _check_well_formed(trace)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert names == ["first", "first comm", "second", "second comm"]
    assert "F mb0 v1" in {e["name"] for e in trace["traceEvents"]}
    default = [e["args"]["name"] for e in chrome_trace(sim)["traceEvents"] if e["name"] == "thread_name"]
    assert default[0] == "stage 0 (layers 0-7, 16-23)"
    with pytest.raises(ValueError):
        chrome_trace(sim, names=["only one"])


TINY = ModelSpec(name="tiny", num_layers=8, hidden=256, num_heads=4, ffn_hidden=512, vocab=1000)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), pp=st.integers(1, 4), schedule=st.sampled_from(["1f1b", "zb", "gpipe", "interleaved"]),
       k=st.integers(1, 3), p2p=st.floats(0.0, 0.5), dp_s=st.floats(0.0, 1.0), opt_s=st.floats(0.0, 1.0))
def test_trace_slices_never_overlap(data, pp, schedule, k, p2p, dp_s, opt_s):
    """Random small pipelines with random pass times (passes shorter than a P2P transfer included)."""
    vpp = 2 if schedule == "interleaved" and pp > 1 else 1
    if schedule == "interleaved" and pp == 1:
        schedule = "1f1b"
    m = pp * k
    cfg = ParallelConfig(pp=pp, vpp=vpp, schedule=schedule)
    sim = simulate_config(TINY, cluster(pp), Workload(global_batch=m, seq_len=256), cfg)
    dur = st.floats(0.0, 1.0)
    times = [[StageTimes(data.draw(dur), data.draw(dur), data.draw(dur)) for _ in range(vpp)] for _ in range(pp)]
    timeline = simulate(build_schedule(schedule, pp, m, vpp), times, p2p, split_weight=schedule == "zb")
    step = max(e[3] for e in timeline.events) + dp_s + opt_s
    est = dataclasses.replace(sim.estimate, step_time_s=step,
                              breakdown_s={**sim.estimate.breakdown_s, "dp_comm": dp_s, "optimizer": opt_s})
    trace = chrome_trace(dataclasses.replace(sim, estimate=est, timeline=timeline, p2p_s=p2p))
    _check_well_formed(trace)
    passes = [e for e in trace["traceEvents"] if e.get("cat") in PASS_CATS]
    assert len(passes) == len(timeline.events)
