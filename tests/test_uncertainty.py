"""Prediction intervals (costmodels/uncertainty.py): split-conformal bounds cover what they claim on exchangeable
residuals, widen with fewer runs, back off to broader regions where a region holds too few runs, and a run's
region reads the features issue 44 groups errors by. The memory interval's verdicts. Also the cross-validation's
publication keys (benchmarks/crossval.py): a page at two commits is one publication."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.costmodels.config import ParallelConfig, Workload, resolve
from meshplan.costmodels.model_io import load_zoo
from meshplan.costmodels.uncertainty import (REGION_BACKOFF, Region, conformal_bounds, min_runs, region_interval,
                                             region_of, residual)

REPO = Path(__file__).resolve().parents[1]
DENSE_H100 = Region("h100-sxm", "megatron-core", False, False, False, False, False, False)


def test_the_bounds_are_the_order_statistics_split_conformal_names():
    """n = 19 at 80 %: the ceil(20 x 0.9) = 18th smallest above and the floor(20 x 0.1) = 2nd below."""
    values = [float(v) for v in range(1, 20)]
    assert conformal_bounds(values[::-1], 0.8) == (2.0, 18.0)
    assert min_runs(0.8) == 9 and min_runs(0.9) == 19
    assert conformal_bounds(values[:8], 0.8) == (-math.inf, math.inf)  # 8 runs: too few for 80 %
    assert conformal_bounds(values[:9], 0.8) == (1.0, 9.0)
    with pytest.raises(ValueError):
        conformal_bounds(values, 1.0)


def test_intervals_cover_their_level_on_exchangeable_residuals():
    """Fresh draws from the residuals' own distribution fall inside at least `level` of the time (and not much
    more: the bounds are tight order statistics), averaged over many calibration sets."""
    rng = np.random.default_rng(7)
    for n, level in [(9, 0.8), (30, 0.8), (100, 0.8), (50, 0.9)]:
        inside = []
        for _ in range(2000):
            lo, hi = conformal_bounds(rng.normal(0.05, 0.1, n).tolist(), level)
            new = rng.normal(0.05, 0.1)
            inside.append(lo <= new <= hi)
        assert level - 0.02 <= float(np.mean(inside)) <= level + 0.1, (n, level, np.mean(inside))


def test_intervals_widen_with_fewer_runs():
    rng = np.random.default_rng(11)
    widths = {}
    for n in (9, 20, 200):
        spans = [np.subtract(*conformal_bounds(rng.normal(0, 0.1, n).tolist(), 0.8)[::-1]) for _ in range(500)]
        widths[n] = float(np.mean(spans))
    assert widths[9] > widths[20] > widths[200], widths


@settings(max_examples=50, deadline=None, derandomize=True)
@given(st.lists(st.floats(-2, 2), min_size=9, max_size=60), st.sampled_from([0.5, 0.8, 0.9]))
def test_bounds_are_members_and_ordered(values, level):
    lo, hi = conformal_bounds(values, level)
    if len(values) >= min_runs(level):
        assert lo in values and hi in values and lo <= hi
    else:
        assert (lo, hi) == (-math.inf, math.inf)


def test_a_region_with_too_few_runs_borrows_from_a_broader_one():
    """Eight runs of a wide-TP region are too few for 80 %: the interval drops that feature first and uses the
    dense H100 runs around it; with nine of its own it keeps them and says nothing was dropped."""
    wide = Region("h100-sxm", "megatron-core", False, False, False, False, False, True)
    table = [(wide, 0.3)] * 8 + [(DENSE_H100, 0.0)] * 20
    got = region_interval(wide, table, 0.8)
    assert got.dropped == ("wide_tp",) and got.runs == 28 and got.lo == 0.0 and got.hi == 0.3
    own = region_interval(wide, table + [(wide, 0.3)], 0.8)
    assert own.dropped == () and own.runs == 9 and own.lo == own.hi == 0.3
    assert region_interval(wide, [(DENSE_H100, 0.1)] * 3, 0.8).dropped == REGION_BACKOFF  # nothing left to drop
    assert math.isinf(region_interval(wide, [], 0.8).hi)


def test_an_interval_turns_into_throughput_and_step_time_ranges():
    """A residual is log(predicted / measured): an optimistic model (residual > 0) puts the measured throughput
    below the prediction and the measured step above it."""
    got = region_interval(DENSE_H100, [(DENSE_H100, r) for r in np.linspace(-0.1, 0.2, 19).tolist()], 0.8)
    slow, fast = got.throughput(1000.0)
    assert slow < 1000.0 < fast and math.isclose(slow, 1000.0 * math.exp(-got.hi))
    short, long = got.step_time(10.0)
    assert short < 10.0 < long and math.isclose(long * slow, 10.0 * 1000.0)
    assert math.isclose(residual(110.0, 100.0), math.log(1.1))


def test_a_runs_region_reads_its_features():
    """DeepSeek-V3 with EP 32 on 8-GPU nodes spans nodes, EP 8 does not; Llama-3.1-8B at TP 8 is thin (hidden
    4,096); CP, 32K sequences and FP8 are read off the layout and workload."""
    moe, dense = load_zoo("deepseek-v3"), load_zoo("llama3.1-8b")
    wl = Workload(global_batch=64, seq_len=4096)
    wide = resolve(moe, 256, wl, ParallelConfig(tp=1, pp=8, ep=32, dp=32))
    narrow = resolve(moe, 256, wl, ParallelConfig(tp=1, pp=8, ep=8, dp=32))
    assert region_of(moe, wide, wl, "h800", 8, "megatron-core+deepep").ep_across_nodes
    got = region_of(moe, narrow, wl, "h800", 8, "megatron-core+deepep")
    assert not got.ep_across_nodes and got.moe and got.runtime == "megatron-core"
    long = Workload(global_batch=8, seq_len=32768, dtype="fp8")
    lay = resolve(dense, 16, long, ParallelConfig(tp=8, cp=2, pp=1))
    got = region_of(dense, lay, long, "h100-sxm", 8, "torchtitan+compile")
    assert got.wide_tp and got.context_parallel and got.long_context and got.fp8 and not got.moe


def _crossval():
    spec = importlib.util.spec_from_file_location("crossval", REPO / "benchmarks" / "crossval.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["crossval"] = module
    spec.loader.exec_module(module)
    return module


def test_a_page_at_two_commits_is_one_publication():
    pytest.importorskip("yaml")
    cv = _crossval()
    page = "https://github.com/NVIDIA/NeMo/blob/{}/docs/source/performance/performance_long_sequence.md"
    assert cv.publication_of_url(page.format("9c5c5e9")) == cv.publication_of_url(page.format("14d427f"))
    round_ = "https://github.com/mlcommons/training_results_v5.0/blob/0fdc28f/{}/results/x/result_0.txt"
    assert cv.publication_of_url(round_.format("NVIDIA")) == cv.publication_of_url(round_.format("Nebius"))
    assert cv.publication_of_url("https://arxiv.org/abs/2201.11990") != cv.publication_of_url(
        "https://arxiv.org/abs/2402.16819")
    assert cv.publication_of_paper("Korthikanti et al., MLSys'23 (arXiv:2205.05198), text") == \
        cv.publication_of_paper("Korthikanti et al., 'Reducing Activation Recomputation', MLSys")


def test_the_residual_spread_by_exposed_communication_bins_every_run_once():
    """crossval's table of the residuals by the predicted step's exposed communication (RESULTS.md, stop 47): each
    run in the one bin its share falls in, the bin's mean and spread of exactly those runs; the share counts the
    breakdown's collectives, P2P and host copies, not compute, recompute, the bubble or the optimizer."""
    pytest.importorskip("yaml")
    from types import SimpleNamespace

    cv = _crossval()
    from reference_runs import exposed_comm_share

    breakdown = {"compute": 5.0, "recompute": 1.0, "tp_comm": 0.5, "dp_comm": 0.75, "pp_comm": 0.25,
                 "offload_comm": 0.5, "pipeline_bubble": 1.5, "optimizer": 0.5}
    assert exposed_comm_share(breakdown, 10.0) == pytest.approx(0.2)
    shares = [0.0, 0.04, 0.05, 0.12, 0.2, 0.25, 0.31, 0.9]
    residuals = [0.1, 0.3, -0.1, 0.2, 0.0, 0.4, -0.2, -0.4]
    runs = [SimpleNamespace(residual=r, row=SimpleNamespace(comm_share=s))
            for s, r in zip(shares, residuals, strict=True)]
    rows = cv.comm_spread(runs)
    assert [(label, n) for label, n, _, _ in rows] == [("0-5 %", 2), ("20-30 %", 2), (">= 30 %", 2)]
    assert rows[0][2] == pytest.approx(0.2) and rows[0][3] == pytest.approx(0.1 * math.sqrt(2))
    assert rows[2][2] == pytest.approx(-0.3)


def test_calibrating_on_other_publications_moves_each_prediction_toward_a_shared_factor():
    """Setting (d) of crossval: runs of two publications on one GPU, generated by the model with GEMM ceilings 9 %
    lower and collectives 20 % slower than the defaults; each publication's calibration comes from the other's runs
    only, and brings every one of its runs at least halfway from the defaults' error to zero. A publication alone on
    its GPU gets no calibration."""
    pytest.importorskip("yaml")
    from types import SimpleNamespace

    from meshplan.costmodels.fit import MeasuredStep, predicted_steps
    from meshplan.hardware_db.cluster import ClusterSpec
    from meshplan.hardware_db.gpu import load_gpu

    cv = _crossval()
    model = load_zoo("llama3.1-8b").model_copy(update={"num_layers": 4})
    truth = {"gemm": math.log(0.91), "network": math.log(1 / 1.2)}
    h100, wl = load_gpu("h100-sxm"), Workload(global_batch=16, seq_len=4096)

    def run(publication: str, gpu: str, cfg: ParallelConfig):
        spec = ClusterSpec(gpu=gpu, num_gpus=8, gpus_per_node=4, nic_gbps=200)
        made = MeasuredStep(model, spec, wl, cfg, "megatron-core", 1.0)
        step = float(predicted_steps([made], load_gpu(gpu), truth)[0])
        return SimpleNamespace(publication=publication, step=dataclasses.replace(made, step_time_s=step))

    layouts = [ParallelConfig(tp=tp, pp=pp, mbs=1) for tp, pp in ((1, 1), (2, 1), (8, 1), (2, 2))]
    runs = ([run("A", "h100-sxm", c) for c in layouts] + [run("B", "h100-sxm", c) for c in reversed(layouts)]
            + [run("C", "a100-80gb", layouts[0])])
    fits = cv.other_publication_fits(runs)
    assert set(fits) == {("A", "h100-sxm"), ("B", "h100-sxm"), ("", "h100-sxm")}  # "": from every run of the GPU
    assert fits[("A", "h100-sxm")]["gemm"] < -0.03 and fits[("A", "h100-sxm")]["network"] < 0
    slower = [SimpleNamespace(publication=r.publication,
                              step=dataclasses.replace(r.step, step_time_s=r.step.step_time_s * (
                                  2 if r.publication == "A" else 1))) for r in runs]
    moved = cv.other_publication_fits(slower)  # A's own runs never move A's calibration, only B's
    assert moved[("A", "h100-sxm")] == fits[("A", "h100-sxm")]
    assert moved[("B", "h100-sxm")]["gemm"] < fits[("B", "h100-sxm")]["gemm"] - 0.05
    # every run of the GPU: the same layouts twice over, so the prior pulls less and the factor lands nearer
    assert abs(fits[("", "h100-sxm")]["gemm"] - truth["gemm"]) < abs(fits[("A", "h100-sxm")]["gemm"] - truth["gemm"])
    scored = cv.other_publications(runs, fits)
    assert len(scored) == 8
    for h, error in scored:
        default = h.step.step_time_s / float(predicted_steps([h.step], h100, {})[0]) - 1
        assert abs(default) > 0.05 and abs(error) <= 0.5 * abs(default), (h.step.config, default, error)


def test_the_shipped_public_calibrations_are_the_development_sets_own():
    """hardware_db/calibrations/public-<gpu>.json is what crossval.py --write-public fits to the sets' runs of that
    GPU (checked on the two GPUs with the fewest runs, whose fits use no other GPU's runs), with setting (d)'s
    held-out error; every shipped one is for a GPU of the sets."""
    pytest.importorskip("yaml")
    from meshplan.hardware_db.calibration import calibration_dir, load_any_calibration

    cv = _crossval()
    runs = cv.first_set() + cv.second_set()
    shipped = {p.stem.removeprefix("public-") for p in calibration_dir().glob("public-*.json")}
    assert shipped and shipped <= {h.step.cluster.gpu for h in runs}
    now = cv.public_calibrations([h for h in runs if h.step.cluster.gpu in ("h200", "b300")], "today")
    assert set(now) == {"h200", "b300"}
    for gpu, cal in now.items():
        stored = load_any_calibration(f"public-{gpu}")
        assert stored.runs == cal.runs and stored.sources == cal.sources, "regenerate: crossval.py --write-public"
        for name, factor in cal.factors.items():
            assert math.isclose(stored.factors[name].factor, factor.factor, rel_tol=1e-9), (
                f"{gpu} {name}: regenerate with python benchmarks/crossval.py --write-public hardware_db/calibrations")
        assert stored.held_out_after == pytest.approx(cal.held_out_after, rel=1e-9)
    # the residuals --calibration public's intervals are made of: setting (d)'s, for every run whose GPU has at
    # least three runs of other publications (recomputed on the same two GPUs)
    from meshplan.costmodels.uncertainty import measured_runs

    public = {r.id: r for r in measured_runs("public")}
    assert set(public) == {h.row.id for h in runs if sum(o.step.cluster.gpu == h.step.cluster.gpu
                                                         and o.publication != h.publication for o in runs) >= 3}
    few = [h for h in runs if h.step.cluster.gpu in ("h200", "b300")]
    for h, error in cv.other_publications(few, cv.other_publication_fits(few)):
        assert public[h.row.id].residual == pytest.approx(residual(1 + error, 1.0), rel=1e-9, abs=1e-12), h.row.id


def test_plan_takes_the_gpus_public_calibration_by_name(tmp_path, capsys):
    """--calibration public: the GPU's public calibration, with a range from setting (d)'s held-out residuals, and
    --rank conservative takes it; a GPU the sets hold too few runs on is one error line naming the ones there
    are."""
    from cli_helpers import assert_input_error, run

    args = ["estimate", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "4096",
            "--json"]
    code, out, err = run(capsys, *args, "--calibration", "none")
    assert code == 0, err
    default = json.loads(out)
    code, out, err = run(capsys, *args, "--calibration", "public")
    assert code == 0, err
    public = json.loads(out)
    assert public["step_time_s"] > default["step_time_s"]  # the published H100 runs are slower than the defaults say
    # its range comes from setting (d)'s held-out residuals, not the defaults'
    assert public["interval"]["runs"] >= min_runs(0.8) and public["interval"] != default["interval"]
    lo, hi = public["interval"]["step_time_s"]
    assert lo < public["step_time_s"] < hi
    code, out, err = run(capsys, *args, "--calibration", "public-h100-sxm")  # the same file by its name
    assert code == 0, err
    assert json.loads(out)["interval"] == public["interval"]
    # recognised by content: a copy elsewhere is the public calibration, an edited copy is someone's own (no range)
    from meshplan.hardware_db.calibration import calibration_dir

    shipped = (calibration_dir() / "public-h100-sxm.json").read_text()
    (tmp_path / "copy.json").write_text(shipped)
    code, out, err = run(capsys, *args, "--calibration", str(tmp_path / "copy.json"))
    assert code == 0, err
    assert json.loads(out)["interval"] == public["interval"]
    edited = json.loads(shipped)
    edited["factors"]["gemm"]["factor"] *= 0.99
    (tmp_path / "mine.json").write_text(json.dumps(edited))
    code, out, err = run(capsys, *args, "--calibration", str(tmp_path / "mine.json"))
    assert code == 0, err
    assert json.loads(out)["interval"] is None
    code, out, err = run(capsys, "plan", *args[1:-1], "--calibration", "public", "--rank", "conservative", "--top", "2")
    assert code == 0, err
    assert "ranked by the slow end" in " ".join(out.split())
    assert_input_error(*run(capsys, "estimate", "-m", "llama3.1-8b", "--gpu", "l4", "--gpus", "8", "--gbs", "16",
                            "--seq", "4096", "--calibration", "public"), "no public calibration for l4", "h100-sxm")


def test_without_calibration_a_gpu_gets_its_public_one_and_none_gets_the_defaults(tmp_path, capsys):
    """The default is the GPU's public calibration where one ships (estimate, plan and its plan file say so, and a
    reader re-simulates that plan under it), the defaults where none ships; `--calibration none` is the defaults."""
    from cli_helpers import run

    args = ["estimate", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "4096",
            "--json"]
    default, public, none = (json.loads(run(capsys, *args, *extra)[1])
                             for extra in ((), ("--calibration", "public"), ("--calibration", "none")))
    assert default["step_time_s"] == public["step_time_s"] != none["step_time_s"]
    assert default["interval"] == public["interval"] != none["interval"]
    l4 = ["estimate", "-m", "llama3.1-8b", "--gpu", "l4", "--gpus", "8", "--gbs", "8", "--seq", "1024", "--tp", "8",
          "--json"]
    assert json.loads(run(capsys, *l4)[1]) == json.loads(run(capsys, *l4, "--calibration", "none")[1])
    path = tmp_path / "p.json"
    code, _, err = run(capsys, "plan", *args[1:-1], "--top", "1", "--out", str(path))
    assert code == 0, err
    assert json.loads(path.read_text())["inputs"]["calibration"].startswith("public-h100-sxm sha256:")
    code, out, err = run(capsys, "show", str(path))
    assert code == 0 and "not re-simulated" not in out, err  # the shipped calibration is re-applied, not trusted
    doc = json.loads(path.read_text())
    doc["prediction"]["breakdown_s"]["compute"] *= 0.9
    path.write_text(json.dumps(doc))
    assert run(capsys, "show", str(path))[0] == 2  # and so an edited figure is caught


def test_the_shipped_residuals_are_the_cost_models_own():
    """costmodels/residuals.json is what benchmarks/crossval.py --write makes from this cost model: a change that
    moves any prediction of the development sets must ship new residuals (else every interval would describe
    another model)."""
    pytest.importorskip("yaml")
    from meshplan.costmodels.uncertainty import measured_residuals

    cv = _crossval()
    runs = cv.first_set() + cv.second_set()
    shipped = json.loads((REPO / "costmodels" / "residuals.json").read_text())["runs"]
    assert [r["id"] for r in shipped] == [h.row.id for h in runs], "regenerate: python benchmarks/crossval.py --write"
    for h, (region, value), stored in zip(runs, measured_residuals(), shipped, strict=True):
        assert region == h.region and stored["publication"] == h.publication, h.row.id
        assert math.isclose(value, h.residual, rel_tol=1e-9, abs_tol=1e-12), (
            f"{h.row.id}: shipped residual {value}, the cost model now gives {h.residual}; regenerate with "
            f"python benchmarks/crossval.py --write costmodels/residuals.json")
    from meshplan.costmodels.uncertainty import measured_memory_runs

    now = cv.memory_runs(runs)
    assert [m.id for m in measured_memory_runs()] == [m.id for m in now], "regenerate the memory residuals"
    for shipped_run, run in zip(measured_memory_runs(), now, strict=True):
        assert shipped_run.kind == run.kind and math.isclose(shipped_run.residual, run.residual, rel_tol=1e-9), (
            f"{run.id}: shipped memory residual {shipped_run.residual}, the cost model now gives {run.residual}; "
            f"regenerate with python benchmarks/crossval.py --write costmodels/residuals.json")


def test_an_estimate_carries_its_interval_and_a_calibrated_one_none():
    """The default model's estimate has the interval of its region (the measured step time's range around the
    prediction); one made under a calibration has none: the shipped residuals describe the defaults."""
    from meshplan.costmodels.efficiency import Efficiency
    from meshplan.costmodels.estimate import estimate
    from meshplan.hardware_db.cluster import Cluster, ClusterSpec

    model, cluster = load_zoo("llama3.1-8b"), Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=8))
    wl, cfg = Workload(global_batch=16, seq_len=4096), ParallelConfig(tp=2)
    est = estimate(model, cluster, wl, cfg)
    assert est.interval is not None and est.interval.runs >= min_runs(0.8)
    lo, hi = est.interval.step_time(est.step_time_s)
    assert lo < est.step_time_s < hi
    assert est.to_dict()["interval"]["step_time_s"] == [lo, hi]
    calibrated = dataclasses.replace(Efficiency.from_gpu(cluster.gpu), calibration="test.json sha256:0")
    assert estimate(model, cluster, wl, cfg, efficiency=calibrated).interval is None


def test_one_sided_memory_bounds_are_the_order_statistics_they_name():
    """n = 19 at 95 %: the ceil(20 x 0.95) = 19th smallest above and the floor(20 x 0.05) = 1st below; 18 runs give
    neither bound."""
    from meshplan.costmodels.uncertainty import one_sided_bounds

    values = [float(v) for v in range(19)]
    assert one_sided_bounds(values[::-1], 0.95) == (0.0, 18.0)
    assert one_sided_bounds(values[:18], 0.95) == (-math.inf, math.inf)
    assert one_sided_bounds(values, 0.8) == (3.0, 15.0)  # floor(20 x 0.2) = 4th, ceil(20 x 0.8) = 16th smallest


def test_the_memory_verdict_needs_the_whole_range_on_one_side():
    """Measured peaks 10 % under to 20 % over the prediction: on 80 GiB, 60 GiB fits surely (72 at the high end),
    70 fits only at the estimate (84), 85 is over at the estimate but may fit (76.5 at the low end), 90 does not
    (81). Too few runs for the level: never sure either way."""
    from meshplan.costmodels.uncertainty import MemoryInterval

    interval = MemoryInterval(math.log(0.9), math.log(1.2), 0.95, 25)
    assert [interval.verdict(p, 80.0) for p in (60.0, 70.0, 85.0, 90.0)] == [
        "fits", "fits at the estimate", "over at the estimate", "does not fit"]
    assert "fits with 95 % confidence" in interval.line(60.0, 80.0)
    assert "it may fit" in interval.line(85.0, 80.0)
    unsure = MemoryInterval(-math.inf, math.inf, 0.95, 3)
    assert [unsure.verdict(p, 80.0) for p in (1.0, 80.0, 81.0, 1e6)] == [
        "fits at the estimate", "fits at the estimate", "over at the estimate", "over at the estimate"]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(-0.5, 0.5), min_size=1, max_size=40), st.floats(1.0, 200.0), st.floats(1.0, 200.0))
def test_the_memory_verdict_only_worsens_as_the_peak_grows(residuals, peak, hbm):
    """A larger predicted peak never gets a surer 'fits' (the verdicts in MEMORY_VERDICTS order)."""
    from meshplan.costmodels.uncertainty import MEMORY_VERDICTS, MemoryRun, memory_interval_of

    interval = memory_interval_of([MemoryRun(str(n), "p", "reserved", r) for n, r in enumerate(residuals)])
    order = [MEMORY_VERDICTS.index(interval.verdict(peak * k, hbm)) for k in (0.5, 0.9, 1.0, 1.1, 2.0)]
    assert order == sorted(order)
    assert (interval.verdict(peak, hbm) in ("fits", "fits at the estimate")) == (peak <= hbm)


def test_an_estimate_and_a_plan_carry_the_memory_verdict(tmp_path, capsys):
    """Every estimate has the memory interval, a calibrated one too (calibration moves time, not memory); the plan
    JSON records the range and verdict; `estimate` prints the verdict line."""
    from meshplan.cli.main import main
    from meshplan.costmodels.efficiency import Efficiency
    from meshplan.costmodels.estimate import estimate
    from meshplan.costmodels.uncertainty import MEMORY_LEVEL, memory_interval
    from meshplan.hardware_db.cluster import Cluster, ClusterSpec

    model, cluster = load_zoo("llama3.1-8b"), Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=8))
    wl, cfg = Workload(global_batch=16, seq_len=4096), ParallelConfig(tp=2)
    est = estimate(model, cluster, wl, cfg)
    shipped = memory_interval()
    assert est.memory_interval == shipped and shipped.level == MEMORY_LEVEL and shipped.runs >= 19
    assert math.isfinite(shipped.lo) and math.isfinite(shipped.hi) and shipped.lo < 0 < shipped.hi
    low, high = shipped.peak_gib(est.peak_memory_gib)
    assert est.to_dict()["memory_range"] == {"level": MEMORY_LEVEL, "runs": shipped.runs, "peak_gib": [low, high],
                                                "verdict": est.memory_verdict}
    calibrated = dataclasses.replace(Efficiency.from_gpu(cluster.gpu), calibration="test.json sha256:0")
    assert estimate(model, cluster, wl, cfg, efficiency=calibrated).memory_interval == shipped
    args = ["-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "4096", "--tp", "2"]
    assert main(["plan", *args, "--out", str(tmp_path / "p.json")]) in (0, None)
    record = json.loads((tmp_path / "p.json").read_text())["prediction"]
    assert record["memory_range"]["verdict"] == shipped.verdict(record["peak_memory_gib"], record["hbm_gib"])
    assert "memory of plan #1: " in " ".join(capsys.readouterr().out.split())
    assert main(["compare", str(tmp_path / "p.json"), str(tmp_path / "p.json")]) in (0, None)
    compared = " ".join(capsys.readouterr().out.split())
    assert "memory verdict" in compared and record["memory_range"]["verdict"] in compared
    wide = ["plan", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "64", "--seq", "8192"]
    assert main([*wide, "--memory", "sure", "--out", str(tmp_path / "sure.json")]) in (0, None)
    sure = json.loads((tmp_path / "sure.json").read_text())
    assert sure["prediction"]["memory_range"]["verdict"] == "fits"
    assert sure["search"]["memory_share"] == pytest.approx(math.exp(-shipped.hi))
    assert "memory of plan #1: fits with 95 % confidence" in " ".join(capsys.readouterr().out.split())
    from meshplan import api  # the sweep under --objective cost keeps the same rule

    swept = api.sweep("llama3.1-8b", ["h100-sxm"], [8], Workload(global_batch=64, seq_len=8192), memory="sure")
    point = swept.points[0].plan
    assert point is not None and point.search is not None
    assert point.search.memory_share == pytest.approx(math.exp(-shipped.hi))
    assert point.prediction.memory_range is not None and point.prediction.memory_range.verdict == "fits"
    assert main(["estimate", *args, "--recompute", "full", "--mbs", "1"]) in (0, None)
    out = " ".join(capsys.readouterr().out.split())
    assert "memory: fits with 95 % confidence" in out, out[-400:]


def test_the_lead_bound_reads_pairs_of_one_cluster_only():
    """Two layouts' error ratio is read off runs of one publication on one GPU: runs of another page or GPU never
    pair up. Ten pairs at 80 %: the ceil(11 x 0.8) = 9th smallest gap."""
    from meshplan.costmodels.uncertainty import MeasuredRun, lead_bound

    def run(pub: str, gpu: str, r: float) -> MeasuredRun:
        return MeasuredRun(f"{pub}-{r}", pub, dataclasses.replace(DENSE_H100, gpu=gpu), r)

    # page a on h100: five runs with residuals 0 .. 0.4: ten pairs, gaps 0.1 (x4), 0.2 (x3), 0.3 (x2), 0.4
    runs = [run("a", "h100-sxm", r / 10) for r in range(5)] + [run("b", "h100-sxm", 5.0), run("a", "b200", -5.0)]
    bound, pairs = lead_bound(runs, 0.8)
    assert pairs == 10 and math.isclose(bound, 0.3)
    assert lead_bound(runs[:2], 0.8) == (math.inf, 1)  # one pair: too few for 80 %


def test_a_lead_inside_the_models_error_is_called_so(tmp_path, capsys):
    """plan prints whether plan #1's lead over #2 is more than the model's error on two layouts of one cluster;
    compare says so of two plans of the same inputs whose throughputs are close."""
    from meshplan.cli.main import main
    from meshplan.costmodels.uncertainty import layout_lead_bound

    bound, pairs = layout_lead_bound(table="public")  # the plans below are priced under the public calibration
    assert pairs > 100 and 0 < bound < 1
    args = ["plan", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "4096"]
    assert main([*args, "--top", "2", "--out", str(tmp_path / "a.json")]) in (0, None)
    out = " ".join(capsys.readouterr().out.split())
    assert "lead of plan #1 over #2:" in out and "not a significant difference" in out  # #2 is within 1 %
    assert main([*args, "--tp", "2", "--out", str(tmp_path / "b.json")]) in (0, None)
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) in (0, None)
    verdict = " ".join(capsys.readouterr().out.split())
    a, b = (json.loads((tmp_path / f"{n}.json").read_text())["prediction"]["tokens_per_s"] for n in "ab")
    assert ("not a significant difference" in verdict) == (math.log(max(a, b) / min(a, b)) <= bound), verdict
    # a plan of the same layout priced uncalibrated is another input, not a lead inside the model's error
    assert main([*args, "--tp", "2", "--calibration", "none", "--out", str(tmp_path / "c.json")]) in (0, None)
    capsys.readouterr()
    assert main(["compare", str(tmp_path / "b.json"), str(tmp_path / "c.json")]) in (0, None)
    verdict = " ".join(capsys.readouterr().out.split())
    assert "their inputs differ" in verdict and "significant difference" not in verdict, verdict


def test_plan_ranks_by_the_slow_end_on_request(tmp_path, capsys):
    """plan --rank conservative: the JSON says what was ranked, the table says it is ranked by the slow end (its
    order is tests/test_search.py's), plan #1's slow end is no later than the expected winner's, and a calibration
    (no range) is refused."""
    from cli_helpers import assert_input_error, run

    args = ["plan", "-m", "llama3.1-70b", "--gpu", "h100-sxm", "--gpus", "64", "--gbs", "128", "--seq", "8192"]
    docs = {}
    for rank in ("expected", "conservative"):
        code, out, err = run(capsys, *args, "--rank", rank, "--json")
        assert code == 0, err
        docs[rank] = json.loads(out)
        assert docs[rank]["search"]["ranking"] == rank
    slow = {rank: doc["prediction"]["interval"]["step_time_s"][1] for rank, doc in docs.items()}
    assert slow["conservative"] <= slow["expected"] * (1 + 1e-9)
    assert docs["conservative"]["prediction"]["step_time_s"] >= docs["expected"]["prediction"]["step_time_s"] * (
        1 - 1e-9)
    code, out, err = run(capsys, *args, "--rank", "conservative", "--top", "4")
    assert code == 0, err
    text = " ".join(out.split())
    assert "ranked by the slow end of their range" in text and "no candidate in the space has a lower slow end" in text
    (tmp_path / "runs.toml").write_text(
        '[[run]]\nmodel = "llama3.1-8b"\ngpu = "h100-sxm"\ngpus = 8\nglobal_batch = 16\nseq_len = 4096\n'
        'step_time_s = 1.5\n')
    assert run(capsys, "calibrate", "--runs", str(tmp_path / "runs.toml"), "--out", str(tmp_path / "c.json"))[0] == 0
    assert_input_error(*run(capsys, *args, "--rank", "conservative", "--calibration", str(tmp_path / "c.json")),
                       "--rank conservative", "--rank expected")


def test_the_realism_line_reads_the_interval():
    """A predicted MFU above the best published for its class is called a likely model gap only when even the slow
    end of its interval is above it; where the interval reaches down to it, the plan is within the model's error
    (issue 44: the realism line becomes part of the interval); without an interval the line is as before."""
    from meshplan.costmodels.estimate import estimate
    from meshplan.costmodels.realism import check
    from meshplan.hardware_db.cluster import Cluster, ClusterSpec

    best = 0.471  # H100/H200, dense, bf16
    assert check("h100-sxm", False, "bf16", 0.45, 0.40).within_error is None
    assert "within what has been published" in check("h100-sxm", False, "bf16", 0.45, 0.40).line()
    inside = check("h100-sxm", False, "bf16", 0.52, 0.45)
    assert inside.exceeds and inside.within_error and "within the model's error" in inside.line()
    beyond = check("h100-sxm", False, "bf16", 0.60, best + 0.01)
    assert beyond.exceeds and beyond.within_error is False and "more likely a gap" in beyond.line()
    assert "and so is the slow end" in beyond.line()
    bare = check("h100-sxm", False, "bf16", 0.52)
    assert bare.within_error is None and "more likely a gap" in bare.line()
    est = estimate(load_zoo("llama3.1-70b"), Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=64)),
                   Workload(global_batch=128, seq_len=8192), ParallelConfig(tp=4, pp=4, cp=2, vpp=5, mbs=1,
                                                                            schedule="interleaved"))
    assert est.interval is not None and est.realism is not None
    assert est.realism.slow_end_mfu == pytest.approx(est.mfu * math.exp(-est.interval.hi))
    assert est.realism.exceeds and est.realism.within_error  # 70B on 64 H100: above 47.1 %, its range reaches down
