"""Calibration from measured runs (costmodels/fit.py): runs the model itself generated with known factors give those
factors back; the prior holds what the runs cannot tell; ceilings stay at 1 or below; bad input is one line."""

from __future__ import annotations

import math

import pytest

from meshplan.costmodels.config import ParallelConfig, Workload
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.efficiency import scaled
from meshplan.costmodels.fit import MeasuredStep, fit, predicted_steps
from meshplan.costmodels.model_io import load_zoo
from meshplan.hardware_db.cluster import ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import load_gpu

WIDE = {"gemm": 3.0, "attention": 3.0, "memory": 3.0, "network": 3.0, "overhead": 3.0}  # priors that hold nothing


def _runs(true: dict[str, float]) -> list[MeasuredStep]:
    """Eight H100 runs whose times lean on different parameters: compute-bound DP, TP 8 (scale-up collectives),
    ZeRO-3 across 8 nodes at short sequences (scale-out), tiny steps (launch cost), CP, a 70B pipeline; their
    "measured" times are the model's own under `true`."""
    m8, m70 = load_zoo("llama3.1-8b"), load_zoo("llama3.1-70b")
    wl = Workload(global_batch=64, seq_len=4096)
    cases = [(m8, 8, wl, ParallelConfig(tp=1)), (m8, 8, wl, ParallelConfig(tp=8)),
             (m8, 64, wl, ParallelConfig(tp=1, zero=3)),
             (m8, 64, Workload(global_batch=64, seq_len=1024), ParallelConfig(tp=1, zero=3)),
             (m70, 64, wl, ParallelConfig(tp=8, pp=4)),
             (m8, 8, Workload(global_batch=64, seq_len=512), ParallelConfig(tp=8, mbs=1)),
             (m8, 8, Workload(global_batch=8, seq_len=256), ParallelConfig(tp=8, mbs=1)),
             (m8, 16, wl, ParallelConfig(tp=4, cp=2))]
    runs = [MeasuredStep(m, ClusterSpec(gpu="h100-sxm", num_gpus=n), w, c, "megatron-core", 1.0)
            for m, n, w, c in cases]
    times = predicted_steps(runs, load_gpu("h100-sxm"), true)
    return [MeasuredStep(r.model, r.cluster, r.workload, r.config, r.runtime, float(t))
            for r, t in zip(runs, times, strict=True)]


def test_runs_made_with_known_factors_give_them_back():
    true = {"gemm": -0.1, "network": -0.3, "overhead": 0.5}
    got = fit(_runs(true), tuple(true), prior_sd=WIDE)
    assert abs(got.factor("gemm") / math.exp(true["gemm"]) - 1) < 0.02
    assert abs(got.factor("network") / math.exp(true["network"]) - 1) < 0.05
    assert abs(got.factor("overhead") / math.exp(true["overhead"]) - 1) < 0.15  # the least visible in step times
    assert max(abs(r) for r in got.after) < 0.005 < max(abs(r) for r in got.before)
    # the best-determined parameter is the one every run leans on
    assert got.log_sd[got.parameters.index("gemm")] < got.log_sd[got.parameters.index("overhead")]


def test_the_prior_holds_what_the_runs_cannot_tell():
    """One compute-bound run and five parameters: the fit moves what explains it within the priors' spreads and
    leaves the rest near the defaults; with the default priors nothing runs off."""
    runs = _runs({"gemm": -0.2})[:1]
    got = fit(runs)
    assert abs(got.after[0]) < abs(got.before[0])  # it explains part of the error
    for name, value in zip(got.parameters, got.log_factors, strict=True):
        assert abs(value) < 0.25, (name, value)
    assert abs(got.log_factors[got.parameters.index("gemm")]) > abs(got.log_factors[got.parameters.index("network")])


def test_ceilings_and_shares_stay_at_most_one():
    gpu = load_gpu("h100-sxm")
    g, eff = scaled(gpu, Efficiency.from_gpu(gpu), {"gemm": 2.0, "network": 2.0, "memory": 2.0, "overhead": 1.0})
    assert eff.gemm_max == eff.grouped_gemm_max == eff.memory_bandwidth == 1.0
    assert g.efficiency.scaleup_bandwidth == g.efficiency.scaleout_bandwidth == 1.0
    assert eff.kernel_overhead_s == pytest.approx(Efficiency.from_gpu(gpu).kernel_overhead_s * math.e)


def test_bad_runs_are_one_line():
    runs = _runs({})
    with pytest.raises(InputError, match="no measured runs"):
        fit([])
    other = MeasuredStep(runs[0].model, ClusterSpec(gpu="a100-80gb", num_gpus=8), runs[0].workload, runs[0].config,
                         runs[0].runtime, 1.0)
    with pytest.raises(InputError, match="2 GPU types"):
        fit([runs[0], other])
    with pytest.raises(InputError, match="unknown parameter 'gemmm'"):
        fit(runs, ("gemmm",))


def _runs_toml(runs: list[MeasuredStep]) -> str:
    """The runs in the runs-file format (planner/measured_runs.py)."""
    out = []
    for r in runs:
        out += ["[[run]]", f'model = "{r.model.name}"', f'gpu = "{r.cluster.gpu}"', f"gpus = {r.cluster.num_gpus}",
                f"global_batch = {r.workload.global_batch}", f"seq_len = {r.workload.seq_len}",
                f'runtime = "{r.runtime}"', f"step_time_s = {r.step_time_s!r}", "[run.layout]"]
        out += [f"{k} = {v}" for k, v in r.config.model_dump(exclude_defaults=True).items()]
    return "\n".join(out) + "\n"


def test_calibrate_writes_a_calibration_that_estimate_takes(tmp_path, capsys):
    """`meshplan calibrate --runs` on runs the model made with known factors writes a factors file; `estimate
    --calibration` with it predicts what those factors predict, with no interval (the shipped residuals describe
    the defaults); the held-out error is printed."""
    import json

    from cli_helpers import run

    true = {"gemm": -0.1, "network": -0.3}
    runs = _runs(true)
    (tmp_path / "runs.toml").write_text(_runs_toml(runs))
    code, out, err = run(capsys, "calibrate", "--runs", str(tmp_path / "runs.toml"), "--out", str(tmp_path / "c.json"),
                         "--parameters", "gemm,network", "--prior", "defaults")
    assert code == 0, err
    text = " ".join(out.split())
    assert "8 run(s) on h100-sxm" in text and "error on runs left out of the fit" in text
    cal = json.loads((tmp_path / "c.json").read_text())
    assert cal["kind"] == "factors" and set(cal["factors"]) == {"gemm", "network"}
    assert cal["error_after"] < cal["error_before"] / 3  # the priors keep it from fitting all of it
    probe = runs[4]  # the 70B pipeline
    args = ("estimate", "-m", "llama3.1-70b", "--gpu", "h100-sxm", "--gpus", "64", "--gbs", "64", "--seq", "4096",
            "--tp", "8", "--pp", "4", "--json")
    code, out, err = run(capsys, *args, "--calibration", str(tmp_path / "c.json"))
    assert code == 0, err
    calibrated = json.loads(out)
    default = json.loads(run(capsys, *args, "--calibration", "none")[1])
    assert calibrated["interval"] is None and default["interval"] is not None
    miss = abs(calibrated["step_time_s"] / probe.step_time_s - 1)
    assert miss < abs(default["step_time_s"] / probe.step_time_s - 1) / 3 and miss < 0.03


def test_calibrate_centres_its_priors_on_the_public_calibration(tmp_path, capsys):
    """By default the priors are centred on the GPU's public calibration: the factors not fit keep its values, so
    the file holds all five; the error at that centre is printed; `--prior defaults` centres them on 1."""
    import json

    from cli_helpers import run

    from meshplan.hardware_db.calibration import public_log_factors

    (tmp_path / "runs.toml").write_text(_runs_toml(_runs({"gemm": -0.1})))
    centre = public_log_factors("h100-sxm")
    assert centre is not None and abs(centre["network"]) > 0.05  # a centre that differs from the defaults
    written = {}
    for prior in ("public", "defaults"):
        code, out, err = run(capsys, "calibrate", "--runs", str(tmp_path / "runs.toml"), "--out",
                             str(tmp_path / f"{prior}.json"), "--parameters", "gemm", "--prior", prior)
        assert code == 0, err
        written[prior] = json.loads((tmp_path / f"{prior}.json").read_text())
        assert ("at the priors' centre" in " ".join(out.split())) == (prior == "public")
    public, defaults = written["public"], written["defaults"]
    assert set(public["factors"]) == {"gemm", "attention", "memory", "network", "overhead"}
    for name in ("attention", "memory", "network", "overhead"):
        assert math.log(public["factors"][name]["factor"]) == pytest.approx(centre[name], abs=1e-12)
    assert public["prior"] == "public-h100-sxm" and public["error_prior"] is not None
    assert set(defaults["factors"]) == {"gemm"} and defaults["prior"] == "defaults" and defaults["error_prior"] is None


def test_peaks_made_with_a_known_activation_factor_give_it_back():
    """Peak memory the model predicts with the layers' activations x 1.3 (three kinds of run: data parallel, TP 8,
    a 70B pipeline; allocated and reserved peaks) gives 1.3 back under a wide prior, and part of the way under the
    default one; with no peak there is nothing to fit."""
    import dataclasses

    from meshplan.costmodels.fit import fit_memory, predicted_peaks

    runs = [r for n, r in enumerate(_runs({})) if n in (0, 1, 4)]
    kinds = ("allocated", "reserved", "peak")
    true = math.log(1.3)
    peaks = predicted_peaks([dataclasses.replace(r, memory_kind=k) for r, k in zip(runs, kinds, strict=True)], true)
    measured = [dataclasses.replace(r, peak_memory_gib=float(p), memory_kind=k)
                for r, p, k in zip(runs, peaks, kinds, strict=True)]
    got = fit_memory(measured, prior_sd=3.0)  # a prior that holds nothing
    assert got is not None and abs(got.log_factor - true) < 0.01
    assert max(abs(r) for r in got.after) < 0.002 < 0.03 < max(abs(r) for r in got.before)
    held = fit_memory(measured)  # the default prior: activations are part of a peak, so it pulls towards 1
    assert held is not None and 0 < held.log_factor < true and held.log_sd < got.log_sd  # the prior informs too
    assert fit_memory(runs) is None
    defaults = predicted_peaks(measured, 0.0)
    assert all(p < q for p, q in zip(defaults, peaks, strict=True))  # the factor raises every peak


def test_a_calibration_with_peaks_moves_memory_and_drops_the_memory_range(tmp_path, capsys):
    """Runs with measured peaks give the calibration an activation factor; `estimate --calibration` then predicts
    a peak scaled by it, with no memory range (the shipped errors describe the default memory model), and `plan
    --memory sure` with it is one error line."""
    import json

    from cli_helpers import assert_input_error, run

    runs = _runs({})[:2]
    text = _runs_toml(runs).replace("[run.layout]", "peak_memory_gib = 60.0\nmemory_kind = \"reserved\"\n[run.layout]")
    (tmp_path / "runs.toml").write_text(text)
    code, out, err = run(capsys, "calibrate", "--runs", str(tmp_path / "runs.toml"), "--out", str(tmp_path / "c.json"))
    assert code == 0, err
    assert "peak memory (2 run(s), reserved): activations x" in " ".join(out.split())
    cal = json.loads((tmp_path / "c.json").read_text())
    assert cal["memory_runs"] == 2 and cal["activations"]["factor"] > 1  # 60 GiB is above both predictions
    args = ("estimate", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "64", "--seq", "4096",
            "--json")
    calibrated = json.loads(run(capsys, *args, "--calibration", str(tmp_path / "c.json"))[1])
    default = json.loads(run(capsys, *args)[1])
    assert calibrated["memory_range"] is None and default["memory_range"] is not None
    assert calibrated["peak_memory_gib"] > default["peak_memory_gib"]
    assert_input_error(*run(capsys, "plan", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--memory", "sure",
                            "--calibration", str(tmp_path / "c.json")), "--memory estimate")


def test_bad_runs_files_are_one_line(tmp_path, capsys):
    from cli_helpers import assert_input_error, run

    good = _runs_toml(_runs({})[:1])
    cases = {
        "no runs": ("# nothing\n", "no runs"),
        "two measurements": (good.replace("[run.layout]", "tokens_per_s_per_gpu = 100.0\n[run.layout]"),
                             "exactly one of step_time_s"),
        "no such model": (good.replace('"llama3.1-8b"', '"llama9"'), "run 1"),
        "degrees": (good.replace("tp = 1", "tp = 3"), "run 1"),
        "unknown knob": (good.replace("tp = 1", "tpp = 1"), "tpp"),
        "a count as text": (good.replace("gpus = 8", 'gpus = "8"'), "gpus"),  # strict, as every file read
        "a memory kind": (good.replace("[run.layout]", 'peak_memory_gib = 50.0\nmemory_kind = "cached"\n[run.layout]'),
                          "memory_kind"),
    }
    for name, (text, word) in cases.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        out_file = tmp_path / f"{name}.json"
        assert_input_error(*run(capsys, "calibrate", "--runs", str(path), "--out", str(out_file)), word)
        assert not out_file.exists(), name
    factors = tmp_path / "f.json"
    (tmp_path / "ok.toml").write_text(good)
    assert run(capsys, "calibrate", "--runs", str(tmp_path / "ok.toml"), "--out", str(factors))[0] == 0
    assert_input_error(*run(capsys, "estimate", "-m", "llama3.1-8b", "--gpu", "a100-80gb", "--gpus", "8",
                            "--calibration", str(factors)), "fit to runs on h100-sxm")
    from meshplan.hardware_db.calibration import load_calibration
    with pytest.raises(InputError, match="meshplan profile"):
        load_calibration(factors)  # what verify reads: kernels measured on a device
    assert_input_error(*run(capsys, "calibrate", "--runs", str(tmp_path / "ok.toml"), "--out", str(tmp_path / "p.json"),
                            "--parameters", "gemm,gemmm"), "unknown parameter 'gemmm'")
    assert not (tmp_path / "p.json").exists()
    import json
    doc = json.loads(factors.read_text())
    estimate = ("estimate", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--calibration")
    for name, edit, word in [("newer", {"schema_version": 2}, "schema v2"),
                             ("bad field", {"runs": 0}, "runs")]:
        broken = tmp_path / f"{name}.json"
        broken.write_text(json.dumps(doc | edit))
        assert_input_error(*run(capsys, *estimate, str(broken)), word, "meshplan calibrate")


def test_serve_takes_a_calibration_and_its_plan_says_which(tmp_path, capsys):
    """`serve --calibration`: a factor file's memory factor slows the memory-bound decode of a pinned deployment;
    the serving plan records the calibration, which a reader re-applies when it is a shipped one (public, or an
    engine's) and otherwise shows as stored; without the flag serving takes vLLM's shipped engine calibration, never
    the public factors (they are fit to training runs)."""
    import json

    from cli_helpers import run

    from meshplan.hardware_db.calibration import calibration_dir

    cal = json.loads((calibration_dir() / "public-h100-sxm.json").read_text())
    cal["factors"] = {"memory": {"factor": 0.5, "log_sd": 0.0}}
    (tmp_path / "slow-hbm.json").write_text(json.dumps(cal))
    args = ["serve", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--isl", "512", "--osl", "64",
            "--layout", "tp1", "--engines", "1", "--batch", "32", "--json"]
    plans = {}
    for name, extra in (("default", ()), ("none", ("--calibration", "none")),
                        ("slow", ("--calibration", str(tmp_path / "slow-hbm.json"))), ("public", ("--calibration",
                                                                                              "public"))):
        code, out, err = run(capsys, *args, *extra)
        assert code == 0, err
        plans[name] = json.loads(out)
    tpot = {name: plan["prediction"]["tpot_ms"] for name, plan in plans.items()}
    # without the flag, vLLM's engine calibration (its rows ran on H100s); none: the GPU's defaults
    assert plans["default"]["inputs"]["calibration"].startswith("engine-vllm sha256:")
    assert plans["none"]["inputs"]["calibration"] is None and tpot["default"] != tpot["none"]
    assert 1.2 < tpot["slow"] / tpot["none"] < 2.0  # decode reads weights and KV: slower, not all of it HBM-bound
    assert plans["slow"]["inputs"]["calibration"].startswith("slow-hbm.json sha256:")
    for name in ("slow", "public", "default"):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(plans[name]))
        code, out, err = run(capsys, "show", str(path))
        assert code == 0, err
        assert ("not re-simulated" in " ".join(out.split())) == (name == "slow")  # the shipped ones are re-derived
    edited = dict(plans["public"], prediction={**plans["public"]["prediction"], "tpot_ms": 1.0})
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    assert run(capsys, "show", str(tmp_path / "edited.json"))[0] == 2  # re-derived under the public factors: caught
    from cli_helpers import assert_input_error

    on_h200 = [a if a != "h100-sxm" else "h200" for a in args]
    assert_input_error(*run(capsys, *on_h200, "--calibration", str(tmp_path / "slow-hbm.json")),
                       "was fit to runs on h100-sxm")
    assert_input_error(*run(capsys, *args, "--calibration", str(tmp_path / "missing.json")), "missing.json")
