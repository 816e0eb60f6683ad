"""AIConfigurator's measured GEMM tables (costmodels/kernel_tables.py, the extra meshplan[aic]): read through the
extra where it is installed (skipped where not); a missing extra and a GPU with no table are one error line either
way; a prior centred on a table moves the fit's start and centre, not what "with the defaults" means."""

from __future__ import annotations

import math

import pytest
from cli_helpers import assert_input_error, run

from meshplan.costmodels import kernel_tables
from meshplan.costmodels.config import ParallelConfig, Workload
from meshplan.costmodels.fit import MeasuredStep, fit, predicted_steps
from meshplan.costmodels.model_io import load_zoo
from meshplan.hardware_db.cluster import ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import load_gpu

RUNS = ('[[run]]\nmodel = "llama3.1-8b"\ngpu = "{gpu}"\ngpus = 8\nglobal_batch = 16\nseq_len = 4096\n'
        'step_time_s = 1.5\n')


def test_without_the_extra_the_tables_are_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(kernel_tables, "PACKAGE", "meshplan_no_such_package")
    with pytest.raises(InputError, match=r"meshplan\[aic\]"):
        kernel_tables.gemm_factors("h100-sxm")
    (tmp_path / "runs.toml").write_text(RUNS.format(gpu="h100-sxm"))
    out = tmp_path / "c.json"
    assert_input_error(*run(capsys, "calibrate", "--runs", str(tmp_path / "runs.toml"), "--out", str(out),
                            "--kernels", "aiconfigurator"), "meshplan[aic]")
    assert not out.exists()


def test_a_gpu_without_a_table_is_one_line(tmp_path, capsys):
    with pytest.raises(InputError, match="no GEMM table for mi300x"):
        kernel_tables.gemm_table_path("mi300x")
    (tmp_path / "runs.toml").write_text(RUNS.format(gpu="mi300x"))
    assert_input_error(*run(capsys, "calibrate", "--runs", str(tmp_path / "runs.toml"), "--out",
                            str(tmp_path / "c.json"), "--kernels", "aiconfigurator"), "mi300x", "covers")


def test_the_h100_tables_read_through_the_extra():
    pytest.importorskip("aiconfigurator_core")
    points, source = kernel_tables.gemm_points("h100-sxm")
    assert "h100_sxm/trtllm" in source and len(points) > 1000
    assert all(p.m >= kernel_tables.TRAINING_M and min(p.n, p.k) >= kernel_tables.TRAINING_NK for p in points)
    factors = kernel_tables.gemm_factors("h100-sxm")
    assert set(factors) == {"bf16", "fp8"}
    for f in factors.values():
        assert 0.5 < math.exp(f.log_factor) < 2 and 0 < f.log_sd < 1 and f.rows > 1000
    gpu = load_gpu("h100-sxm")
    big = max((p for p in points if p.dtype == "bfloat16"), key=lambda p: p.m * p.n * p.k)
    achieved = 2 * big.m * big.n * big.k / big.latency_s / gpu.peak_flops("bf16")
    assert 0.5 < achieved <= 1.0  # a large BF16 GEMM measured at a sane share of the H100's dense peak


def test_a_measured_prior_centre_moves_the_fit_not_the_defaults():
    model = load_zoo("llama3.1-8b")
    steps = [MeasuredStep(model, ClusterSpec(gpu="h100-sxm", num_gpus=8), Workload(global_batch=64, seq_len=s),
                          ParallelConfig(tp=t), "megatron-core", 1.0) for s, t in ((4096, 1), (2048, 2))]
    truth = predicted_steps(steps, load_gpu("h100-sxm"), {"memory": -0.3})
    steps = [MeasuredStep(s.model, s.cluster, s.workload, s.config, s.runtime, float(t))
             for s, t in zip(steps, truth, strict=True)]
    plain = fit(steps, ("memory", "overhead"))
    centred = fit(steps, ("memory", "overhead"), prior_mean={"overhead": 0.5})
    assert centred.before == plain.before  # "with the defaults" stays the defaults
    assert centred.log_factors[1] > plain.log_factors[1] + 0.3  # the runs barely tell the launch cost: the prior does
