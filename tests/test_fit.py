"""Calibration from measured runs (costmodels/fit.py): runs the model itself generated with known factors give those
factors back; the prior holds what the runs cannot tell; ceilings stay at 1 or below; bad input is one line."""

from __future__ import annotations

import math

import pytest

from meshplan.costmodels.config import ParallelConfig, Workload
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.fit import MeasuredStep, fit, predicted_steps, scaled
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
