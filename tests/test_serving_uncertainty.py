"""Serving intervals (costmodels/serving_uncertainty.py; issue 45 item 3): each metric's interval is the split-
conformal one of the held-out residuals of its region, backing off as stated; a row's residual has the sign the
training intervals use; the shipped calibrations keep the residuals their held-out medians were taken over; and
serve carries the intervals into its plan and output under a shipped engine calibration only."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.costmodels.serving_uncertainty import (LOAD_BANDS, ServingRegion, load_band, metric_interval,
                                                     residuals_of, serving_interval, t_quantile)
from meshplan.costmodels.uncertainty import conformal_bounds, min_runs
from meshplan.hardware_db.calibration import ServingResidual, shipped_engine_calibration


def _residual(arch: str = "a", mode: str = "aggregated", sequences: int = 8, ttft: float = 0.0, tpot: float = 0.0,
              throughput: float | None = 0.0) -> ServingResidual:
    return ServingResidual(id="row", model=arch, architecture=arch, gpu="h100-sxm", mode=mode, moe=False,  # type: ignore[arg-type]
                           sequences=sequences, ttft=ttft, tpot=tpot, throughput=throughput)


def _calibration(residuals: list[ServingResidual]):
    cal = shipped_engine_calibration("vllm")
    assert cal is not None
    return cal.model_copy(update={"residuals": residuals})


def test_load_bands_part_where_stated():
    low, high = LOAD_BANDS
    assert load_band(1) == load_band(low - 1) == f"under {low}"
    assert load_band(low) == load_band(high - 1) == f"{low}-{high - 1}"
    assert load_band(high) == load_band(10 * high) == f"{high}+"


def test_a_rows_residual_is_positive_where_the_prediction_was_optimistic():
    ttft, tpot, throughput = residuals_of(0.5, 0.02, 200.0, 1.0, 0.01, 100.0)
    assert ttft == pytest.approx(math.log(2)) and tpot == pytest.approx(-math.log(2))
    assert throughput == pytest.approx(math.log(2))
    assert residuals_of(1.0, 1.0, None, 1.0, 1.0, 5.0)[2] is None


@pytest.mark.parametrize(("p", "dof", "table"), [(0.9, 1, 3.077684), (0.9, 2, 1.885618), (0.9, 3, 1.637744),
                                                (0.9, 4, 1.533206), (0.95, 10, 1.812461), (0.5, 5, 0.0)])
def test_t_quantiles_match_the_tables(p, dof, table):
    assert t_quantile(p, dof) == pytest.approx(table, abs=1e-5)


def _expected(rows: list[tuple[str, ServingRegion, float]], region: ServingRegion, level: float = 0.8):
    """The module docstring's interval, computed here from its parts."""
    models = sorted({a for a, _, _ in rows})
    offsets = {a: statistics.median(v for b, _, v in rows if b == a) for a in models}
    k = len(models)
    half = t_quantile((1 + level) / 2, k - 1) * statistics.stdev(offsets.values()) * math.sqrt(1 + 1 / k)
    same = [v - offsets[a] for a, g, v in rows if g == region]
    if len(same) < min_runs(level):
        same = [v - offsets[a] for a, g, v in rows if g.mode == region.mode]
    if len(same) < min_runs(level):
        same = [v - offsets[a] for a, _, v in rows]
    lo, hi = conformal_bounds(same, level)
    mean = statistics.fmean(offsets.values())
    return mean - math.hypot(half, max(0, -lo)), mean + math.hypot(half, max(0, hi))


LIGHT, HEAVY = ServingRegion("aggregated", load_band(8)), ServingRegion("aggregated", load_band(300))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("abcd"), st.sampled_from([LIGHT, HEAVY]), st.floats(-2.0, 2.0)),
                min_size=0, max_size=60), st.floats(-1.0, 1.0))
def test_an_interval_is_a_new_models_offset_and_a_rows_spread(rows, shift):
    """The interval is the model part (t over the models' median residuals) and the row part (conformal bounds of
    the deviations from those medians, of the row's load band while it holds enough) in quadrature; it holds the
    models' mean offset, and moving every residual moves it by as much. Fewer than two models: none."""
    found = metric_interval(rows, HEAVY)
    if len({a for a, _, _ in rows}) < 2:
        assert found is None
        return
    assert found is not None and found.models == len({a for a, _, _ in rows})
    lo, hi = _expected(rows, HEAVY)
    assert (found.interval.lo, found.interval.hi) == pytest.approx((lo, hi), abs=1e-9)
    mean = statistics.fmean(statistics.median(v for b, _, v in rows if b == a) for a in {a for a, _, _ in rows})
    assert found.interval.lo <= mean + 1e-12 and mean - 1e-12 <= found.interval.hi
    moved = metric_interval([(a, g, v + shift) for a, g, v in rows], HEAVY)
    assert moved is not None
    assert (moved.interval.lo, moved.interval.hi) == pytest.approx((lo + shift, hi + shift), abs=1e-9)


def test_an_interval_keeps_to_its_load_band_and_leaves_a_model_out():
    """A heavy row's spread is that of heavy rows while they are enough; leave_out sets a model's rows aside, and a
    calibration of one model gives none."""
    rows = [_residual(arch=a, sequences=8, ttft=0.1 * ((i % 3) - 1)) for a in "ab" for i in range(20)]
    rows += [_residual(arch=a, sequences=300, ttft=2.0 * ((i % 3) - 1)) for a in "ab" for i in range(20)]
    rows += [_residual(arch="c", sequences=8, ttft=5.0)]
    cal = _calibration(rows)
    light, heavy = (serving_interval(cal, region, leave_out="c") for region in (LIGHT, HEAVY))
    assert light is not None and heavy is not None and light.ttft.models == 2
    assert heavy.ttft.interval.runs == 40 and light.ttft.interval.runs == 40
    assert heavy.ttft.interval.hi - heavy.ttft.interval.lo > light.ttft.interval.hi - light.ttft.interval.lo
    assert serving_interval(cal, LIGHT) is not None and serving_interval(cal, LIGHT).ttft.models == 3
    assert serving_interval(_calibration([_residual(arch="a")] * 20), LIGHT) is None


def test_the_shipped_calibrations_keep_the_residuals_of_their_held_out_medians():
    """Each file's residuals are the rows its held-out medians were taken over: the median |error| they give is the
    file's own (to the residuals' four decimals)."""
    for engine in ("vllm", "sglang", "trtllm"):
        cal = shipped_engine_calibration(engine)
        assert cal is not None and len(cal.residuals) >= 100
        ttft = sorted(abs(math.exp(-r.ttft) - 1) for r in cal.residuals)
        tpot = sorted(abs(math.exp(-r.tpot) - 1) for r in cal.residuals)
        throughput = sorted(abs(math.exp(r.throughput) - 1) for r in cal.residuals if r.throughput is not None)
        for metric, errors in (("ttft", ttft), ("tpot", tpot), ("throughput", throughput)):
            n = len(errors)
            median = (errors[n // 2] + errors[(n - 1) // 2]) / 2
            assert median == pytest.approx(cal.held_out[metric], abs=2e-3), (engine, metric)
        assert {r.gpu for r in cal.residuals} <= set(cal.gpus)
        assert len({r.architecture for r in cal.residuals}) >= 4


def test_serve_carries_the_intervals_of_its_engine_calibration(capsys, tmp_path):
    """Under vLLM's shipped calibration, the plan's intervals are serving_interval's for the best deployment's
    region, applied to its figures, and the output prints them; the plan re-derives with them. Under the defaults
    there are none."""
    from cli_helpers import run

    from meshplan import api

    args = ("serve", "--model", "llama3.1-8b", "--gpus", "8", "--gpu", "h100-sxm", "--isl", "1000", "--osl", "200",
            "--tpot-ms", "40", "--no-disaggregation")
    code, out, _ = run(capsys, *args, "--out", str(tmp_path / "serve.json"))
    assert code == 0
    plan = api.open_plan(tmp_path / "serve.json")
    assert plan.note is None and plan.repriced is None
    doc = plan.plan
    p = doc.prediction
    assert p.intervals is not None
    engine = doc.engines[-1]
    region = ServingRegion(doc.mode, load_band(engine.load * engine.max_num_seqs))
    cal = shipped_engine_calibration("vllm")
    assert cal is not None
    want = serving_interval(cal, region)
    assert want is not None
    assert (p.intervals.ttft_ms.low, p.intervals.ttft_ms.high) == pytest.approx(want.ttft.interval.step_time(p.ttft_ms))
    assert (p.intervals.tpot_ms.low, p.intervals.tpot_ms.high) == pytest.approx(want.tpot.interval.step_time(p.tpot_ms))
    assert (p.intervals.tokens_per_s_per_gpu.low, p.intervals.tokens_per_s_per_gpu.high) == pytest.approx(
        want.throughput.interval.throughput(p.tokens_per_s_per_gpu))
    text = " ".join(out.split())
    r = p.intervals.tokens_per_s_per_gpu
    assert f"{p.tokens_per_s_per_gpu:,.0f} tokens/s/GPU ({r.low:,.0f}-{r.high:,.0f})" in text
    assert "uncertainty: 80 % ranges in brackets for a model the engine calibration never saw" in text
    code, out, _ = run(capsys, *args, "--calibration", "none", "--json")
    assert code == 0 and '"intervals": null' in out and "uncertainty:" not in out


def test_an_edited_interval_is_refused(tmp_path):
    """An interval is a figure like any other: a plan whose interval was edited does not re-derive."""
    from meshplan import api
    from meshplan.costmodels.serving import ServeTargets, ServeWorkload
    from meshplan.hardware_db.cluster import ClusterSpec
    from meshplan.hardware_db.errors import InputError
    from meshplan.planner.plan import plan_text

    found = api.search_deployments("llama3.1-8b", ClusterSpec(gpu="h100-sxm", num_gpus=8),
                                   ServeWorkload(isl=1000, osl=200), ServeTargets(tpot_ms=40), disaggregation=False)
    doc = found.plan
    assert doc.prediction.intervals is not None
    ranges = doc.prediction.intervals
    wider = ranges.model_copy(update={"ttft_ms": ranges.ttft_ms.model_copy(update={"high": ranges.ttft_ms.high * 2})})
    edited = doc.model_copy(update={"prediction": doc.prediction.model_copy(update={"intervals": wider})})
    path = tmp_path / "edited.json"
    path.write_text(plan_text(edited))
    with pytest.raises(InputError, match="intervals"):
        api.open_plan(path)
