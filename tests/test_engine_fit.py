"""Serving engine calibration (costmodels/engine_calibration.py, engine_fit.py; issue 45 item 2): the parameters act
on the iterations as stated, the fit recovers parameters that generated the measurements, and whatever the
measurements say, the fitted parameters stay within their stated physical bounds."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.costmodels import aic_deployments as aic
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.engine_calibration import BOUNDS, FACTORS, EngineParameters
from meshplan.costmodels.engine_fit import ENGINE_HELD, Sensitivity, fit_engine, fit_engines
from meshplan.costmodels.fit import PRIOR_SD
from meshplan.hardware_db.decode_kernels import decode_kernels
from meshplan.hardware_db.gpu import load_gpu

from test_aic_deployments import AGG, DENSE, table


def _rows(truth: EngineParameters, n: int = 400) -> list[Sensitivity]:
    """Synthetic rows whose measurements are what the local model gives under `truth`, with slopes drawn apart so
    that every parameter shows (a seeded generator: the same rows every run)."""
    base = aic.read_deployments(table(DENSE)).deployments[0]
    rng = np.random.default_rng(7)
    rows = []
    for _ in range(n):
        slopes = tuple((float(a), float(b)) for a, b in rng.uniform(-1.0, 0.0, (5, 2)))
        s = Sensitivity(base, float(rng.uniform(0.05, 2.0)), float(rng.uniform(0.003, 0.05)), slopes,
                        (float(rng.uniform(1.0, 50.0)), 1.0))
        ttft, tpot = s.predict(truth)
        rows.append(dataclasses.replace(s, deployment=dataclasses.replace(base, ttft_ms=ttft * 1e3,
                                                                          tpot_ms=tpot * 1e3)))
    return rows


def test_parameters_act_as_stated():
    gpu = load_gpu("h100-sxm")
    spec, eff = EngineParameters((("memory", math.log(0.9)),), iteration_s=0.002).apply(gpu)
    assert eff.memory_bandwidth == pytest.approx(0.9 * gpu.efficiency.memory_bandwidth)
    assert eff.head_overhead is not None and eff.head_overhead.forward_s == 0.002
    assert spec.efficiency.scaleup_bandwidth == gpu.efficiency.scaleup_bandwidth
    p = EngineParameters((("gemm", -0.2), ("network", 0.1)), 0.001, 0.03)
    assert EngineParameters.of_vector(p.vector()).vector() == p.vector()


def test_the_fit_recovers_the_parameters_that_made_the_measurements():
    truth = EngineParameters((("gemm", -0.15), ("memory", -0.2)), iteration_s=0.003, request_s=0.04)
    fitted = fit_engine(_rows(truth))
    got = fitted.parameters
    assert got.iteration_s == pytest.approx(0.003, abs=3e-4)
    assert got.request_s == pytest.approx(0.04, abs=5e-3)
    assert dict(got.log_factors)["memory"] == pytest.approx(-0.2, abs=0.03)
    assert dict(got.log_factors)["gemm"] == pytest.approx(-0.15, abs=0.03)
    # the priors (centred on the defaults) hold back a little: 400 rows make that little
    assert max(abs(r) for pair in fitted.after for r in pair) < 0.01 < 0.1 < max(abs(r) for pair in fitted.before
                                                                                for r in pair)


def test_held_parameters_stay_at_the_centre_and_the_rest_fit():
    """With the factors held (the engines' default: ENGINE_HELD), rows made with only host times are fit back to
    them, every factor at 1 and its spread the prior's; made with a slower memory too, the held fit cannot take it
    and the host times absorb what they can, while the free fit recovers it."""
    truth = EngineParameters(iteration_s=0.003, request_s=0.04)
    got = fit_engine(_rows(truth), held=ENGINE_HELD)
    assert all(v == 0.0 for _, v in got.parameters.log_factors)
    assert got.parameters.iteration_s == pytest.approx(0.003, abs=3e-4)
    assert got.parameters.request_s == pytest.approx(0.04, abs=5e-3)
    assert got.spread[:len(FACTORS)] == pytest.approx([PRIOR_SD[n] for n in FACTORS], rel=1e-9)
    assert frozenset(FACTORS) == ENGINE_HELD
    slower = EngineParameters((("memory", -0.2),), iteration_s=0.003, request_s=0.04)
    held = fit_engine(_rows(slower), held=ENGINE_HELD)
    free = fit_engine(_rows(slower))
    assert dict(held.parameters.log_factors)["memory"] == 0.0
    assert dict(free.parameters.log_factors)["memory"] == pytest.approx(-0.2, abs=0.03)
    assert max(abs(r) for pair in free.after for r in pair) < max(abs(r) for pair in held.after for r in pair)
    by_engine = fit_engines(_rows(truth, 100))
    assert all(v == 0.0 for f in by_engine.values() for _, v in f.parameters.log_factors)


@settings(max_examples=25, deadline=None)
@given(st.floats(-3.0, 3.0), st.floats(-3.0, 3.0))
def test_fitted_parameters_stay_within_their_physical_bounds(log_ttft, log_tpot):
    """However far off the measurements are (here up to 20x either way), the parameters stay within BOUNDS."""
    rows = []
    for s in _rows(EngineParameters(), 40):
        d = s.deployment
        rows.append(dataclasses.replace(s, deployment=dataclasses.replace(
            d, ttft_ms=d.ttft_ms * math.exp(log_ttft), tpot_ms=d.tpot_ms * math.exp(log_tpot))))
    got = fit_engine(rows).parameters
    assert got.within_bounds()
    values = dict(zip(("iteration_s", "request_s"), (got.iteration_s, got.request_s), strict=True))
    assert all(BOUNDS[n][0] <= v <= BOUNDS[n][1] for n, v in values.items())


def test_a_priced_row_takes_the_engine_times():
    """Neutral parameters price as the GPU's defaults with the row's engine's measured decode kernels; the request
    time adds to TTFT alone; the iteration time lengthens every iteration, so TPOT by about as much; a slower HBM
    share slows the decode."""
    pytest.importorskip("aiconfigurator_core")
    row = aic.read_deployments(table(AGG.replace("silicon_concurrency=64", "silicon_concurrency=4"))).deployments[0]
    base = aic.price(row, engine=EngineParameters())
    kernels = {"decode_attention": decode_kernels(row.gpu, "attention", row.engine),
               "decode_gemm": decode_kernels(row.gpu, "gemm", row.engine)}
    assert aic.price(row, eff=dataclasses.replace(Efficiency.from_gpu(load_gpu(row.gpu)), **kernels)) == base
    later = aic.price(row, engine=EngineParameters(request_s=0.05))
    assert later.ttft_ms == pytest.approx(base.ttft_ms + 50.0) and later.tpot_ms == base.tpot_ms
    slower = aic.price(row, engine=EngineParameters(iteration_s=0.002))
    assert slower.tpot_ms == pytest.approx(base.tpot_ms + 2.0, rel=0.05)
    assert aic.price(row, engine=EngineParameters((("memory", -0.3),))).tpot_ms > base.tpot_ms


def test_a_row_linearised_elsewhere_predicts_its_own_pricing_there():
    """sensitivity at a centre off the prior's: the local model gives the full pricing at the centre exactly, and
    near it within a few per cent; a factor at its upper bound takes its secant downward (slopes stay finite)."""
    pytest.importorskip("aiconfigurator_core")
    row = aic.read_deployments(table(AGG.replace("silicon_concurrency=64", "silicon_concurrency=4"))).deployments[0]
    from meshplan.costmodels.engine_fit import sensitivity

    centre = EngineParameters((("memory", -0.3), ("gemm", BOUNDS["gemm"][1])), iteration_s=0.001, request_s=0.02)
    s = sensitivity(row, centre)
    at = aic.price(row, engine=centre)
    assert s.predict(centre) == pytest.approx((at.ttft_ms / 1e3, at.tpot_ms / 1e3), rel=1e-12)
    near = EngineParameters((("memory", -0.25), ("gemm", BOUNDS["gemm"][1])), iteration_s=0.0015, request_s=0.03)
    full = aic.price(row, engine=near)
    assert s.predict(near) == pytest.approx((full.ttft_ms / 1e3, full.tpot_ms / 1e3), rel=0.03)
    assert all(math.isfinite(x) for pair in s.log_slopes for x in pair)
    with pytest.raises(ValueError, match="without their figures"):  # the defaults' figures were not kept
        s.uncalibrated_s()
    # a slower HBM share at the centre still slows decode: the memory slope of log TPOT is negative
    assert dict(zip(("gemm", "attention", "memory"), s.log_slopes, strict=False))["memory"][1] < 0


def test_relinearised_rows_keep_the_uncalibrated_figures():
    """relinearized moves each row's slopes to its engine's fit and keeps what the defaults gave, which the
    held-out error is set beside."""
    pytest.importorskip("aiconfigurator_core")
    from meshplan.costmodels.engine_fit import relinearized, sensitivities

    rows = sensitivities(aic.read_deployments(table(DENSE, QWEN)).deployments)
    again = relinearized(rows)
    fits = fit_engines(rows)
    for old, new in zip(rows, again, strict=True):
        assert new.centre == fits[new.deployment.engine].parameters != EngineParameters()
        assert new.uncalibrated_s() == (old.ttft_s, old.tpot_s) == old.uncalibrated_s()
        assert new.predict(new.centre) == pytest.approx((new.ttft_s, new.tpot_s), rel=1e-12)


QWEN = ("qwen_agg,src; silicon_concurrency=2,vllm,0.12.0,Qwen/Qwen3-32B,h100_sxm,,agg,1024,128,,,2,2,1,,1,1,,,,,,,,,"
        ",,,,,,90.0,12.5")


def test_an_engine_calibration_file_from_two_models(tmp_path):
    """engine_calibration on two models' rows: parameters within their bounds, each model's rows checked by a
    fit to the other's (the held-out error is there and finite), the file read back as written; plan's
    --calibration refuses it with one line, and load_engine_calibration refuses a file of another kind."""
    pytest.importorskip("aiconfigurator_core")
    from meshplan.costmodels.engine_fit import engine_calibration, parameters_of, sensitivities
    from meshplan.hardware_db.calibration import load_any_calibration, load_engine_calibration
    from meshplan.hardware_db.errors import InputError

    rows = sensitivities(aic.read_deployments(table(DENSE, QWEN)).deployments)
    assert len(rows) == 2
    cal = engine_calibration(rows, "vllm", "test rows", "2026-12-07")
    assert cal.rows == 2 and cal.models == ["Qwen/Qwen3-32B", "meta-llama/Llama-3.1-8B-Instruct"]
    assert parameters_of(cal).within_bounds()
    assert set(cal.held_out) == {"ttft", "tpot", "throughput"} and all(math.isfinite(v) for v in cal.held_out.values())
    path = tmp_path / "vllm.json"
    path.write_text(cal.model_dump_json(indent=1))
    assert load_engine_calibration(path) == cal
    with pytest.raises(InputError, match="serving engine's parameters"):
        load_any_calibration(path)
    other = tmp_path / "other.json"
    other.write_text('{"kind": "factors", "schema_version": 1}')
    with pytest.raises(InputError, match="not a serving engine calibration"):
        load_engine_calibration(other)
    with pytest.raises(InputError, match="no priceable deployment of engine 'sglang'"):
        engine_calibration(rows, "sglang", "test rows", "2026-12-07")


def test_calibrate_deployments_reports_each_step_and_writes_the_file(capsys, tmp_path, monkeypatch):
    """`calibrate --deployments aic` on two models' rows (the wheel's file replaced by them): it says what it
    prices, reports each step as it goes (a run on the whole file takes half an hour), and writes a file that
    reads back."""
    pytest.importorskip("aiconfigurator_core")
    from cli_helpers import run

    from meshplan.hardware_db.calibration import load_engine_calibration

    rows = aic.read_deployments(table(DENSE, QWEN))
    monkeypatch.setattr(aic, "read_deployments", lambda: rows)
    out = tmp_path / "vllm.json"
    code, text, err = run(capsys, "calibrate", "--deployments", "aic", "--engine", "vllm", "--out", str(out))
    assert code == 0, err
    said = " ".join(text.split())
    for step in ("2 of 2 rows priced with slopes at the defaults", "priced again with slopes at each engine's fit",
                 "model 1 of 2 left out", "model 2 of 2 left out", f"engine calibration written to {out}"):
        assert step in said, step
    assert load_engine_calibration(out).rows == 2


@pytest.mark.parametrize(("args", "words"), [
    ((), ("--runs", "--deployments")),
    (("--deployments", "aic"), ("--engine",)),
    (("--deployments", "aic", "--engine", "vllm", "--runs", "r.toml"), ("--runs", "--deployments", "one")),
])
def test_calibrate_says_what_to_give(capsys, tmp_path, args, words):
    from cli_helpers import assert_input_error, run

    assert_input_error(*run(capsys, "calibrate", "--out", str(tmp_path / "c.json"), *args), *words)
    assert not (tmp_path / "c.json").exists()


def test_the_front_end_time_adds_to_ttft_alone():
    """An engine calibration's request time is on every aggregated and prefill TTFT once, and on nothing else."""
    from meshplan.costmodels.model_io import load_model
    from meshplan.costmodels.serving import EngineLayout, ServeWorkload
    from meshplan.costmodels.serving_load import aggregated_point, decode_point, prefill_point
    from meshplan.hardware_db.cluster import Cluster, ClusterSpec

    model, cluster = load_model("llama3.1-8b"), Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=1))
    wl, lay = ServeWorkload(isl=1000, osl=200), EngineLayout()
    spec, eff = EngineParameters().apply(cluster.gpu)
    slow = dataclasses.replace(eff, request_s=0.07)
    a, b = (aggregated_point(model, cluster, lay, wl, 32, 8192, 16, e) for e in (eff, slow))
    assert a is not None and b is not None and b.tpot_s == a.tpot_s
    assert b.ttft_s == pytest.approx(a.ttft_s + 0.07, abs=1e-12)
    a, b = (decode_point(model, cluster, lay, wl, 32, 16, e) for e in (eff, slow))
    assert a is not None and b is not None and (b.ttft_s, b.tpot_s) == (a.ttft_s, a.tpot_s)
    a, b = (prefill_point(model, cluster, lay, wl, 1, 0.5, e) for e in (eff, slow))
    assert a is not None and b is not None and b.ttft_s == pytest.approx(a.ttft_s + 0.07, abs=1e-12)


def test_serve_prices_with_the_engines_shipped_calibration(capsys, tmp_path):
    """serve says which calibration priced the engines: vLLM's shipped one on a GPU its rows ran on (recorded in
    the plan, which re-derives from it), the defaults where its rows never ran or with --calibration none; an engine
    file of another engine than --engine is refused with one line."""
    from cli_helpers import assert_input_error, run

    from meshplan import api
    from meshplan.hardware_db.calibration import calibration_dir, shipped_engine_calibration

    vllm = shipped_engine_calibration("vllm")
    assert vllm is not None and "h100-sxm" in vllm.gpus and "a100-80gb" not in vllm.gpus
    args = ("serve", "--model", "llama3.1-8b", "--gpus", "8", "--isl", "1000", "--osl", "200", "--tpot-ms", "40",
            "--no-disaggregation")
    code, out, _ = run(capsys, *args, "--gpu", "h100-sxm", "--out", str(tmp_path / "serve.json"))
    assert code == 0 and "engines priced with vllm's engine calibration (engine-vllm" in " ".join(out.split())
    plan = api.open_plan(tmp_path / "serve.json")
    assert plan.note is None and plan.repriced is None
    assert plan.plan.inputs.calibration is not None and plan.plan.inputs.calibration.startswith("engine-vllm sha256:")
    code, out, _ = run(capsys, *args, "--gpu", "a100-80gb")
    assert code == 0 and "the GPU's efficiency defaults (vllm: its calibration has no rows on a100-80gb)" in " ".join(
        out.split())
    code, out, _ = run(capsys, *args, "--gpu", "h100-sxm", "--calibration", "none")
    assert code == 0 and "engines priced with the GPU's efficiency defaults" in " ".join(out.split())
    assert_input_error(*run(capsys, *args, "--gpu", "h100-sxm", "--engine", "sglang", "--calibration",
                            str(calibration_dir() / "engine-vllm.json")), "calibrates vllm", "--engine vllm")
    # by name, as --calibration takes the shipped files; a training command refuses it
    code, out, _ = run(capsys, *args, "--gpu", "h100-sxm", "--calibration", "engine-vllm")
    assert code == 0 and "engines priced with engine calibration engine-vllm (vllm" in " ".join(out.split())
    assert_input_error(*run(capsys, "plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8",
                            "--calibration", "engine-vllm"),
                       "engine-vllm", "only meshplan serve")


def test_the_shipped_engine_calibrations_are_within_their_bounds():
    """Every engine calibration meshplan ships: parameters within their physical bounds, its held-out error
    recorded beside the uncalibrated one."""
    from meshplan.costmodels.engine_calibration import parameters_of
    from meshplan.hardware_db.calibration import shipped_engine_calibration

    for engine in ("vllm", "sglang", "trtllm"):
        cal = shipped_engine_calibration(engine)
        assert cal is not None and cal.engine == engine and cal.rows >= 100
        assert parameters_of(cal).within_bounds()
        assert set(cal.held_out) == set(cal.uncalibrated) == {"ttft", "tpot", "throughput"}
