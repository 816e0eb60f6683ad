"""The reference-run benchmark keeps working: every entry configures, resolves and gets a finite prediction.

Accuracy targets live in benchmarks/RESULTS.md; this only guards the benchmark against rot and unit slips
(a factor-of-two band catches a wrong byte size or a lost x1e12, not a calibration drift).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[1]
YAML = REPO / "benchmarks" / "training_dev.yaml"


def _benchmark():
    spec = importlib.util.spec_from_file_location("reference_runs", REPO / "benchmarks" / "reference_runs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["reference_runs"] = module  # dataclasses need their module registered
    spec.loader.exec_module(module)
    return module


def test_every_reference_run_gets_a_prediction_in_a_sane_band():
    bench = _benchmark()
    entries = yaml.safe_load(YAML.read_text())
    rows = [bench.evaluate(e) for e in entries]
    assert len(rows) == len(entries) >= 20
    for row in rows:
        assert row.step_time_s > 0 and 0 < row.mfu < 1, row
        assert 0.5 < row.predicted / row.published < 2.0, row


def test_every_run_of_the_second_set_validates_and_gets_a_prediction():
    """benchmarks/published_runs.yaml: every entry validates (published_runs.Run), resolves and gets a finite
    prediction within a factor of three of the published figure (a rot guard: the accuracy is in RESULTS.md)."""
    bench = _benchmark()
    runs = bench.load_runs()
    assert len(runs) >= 40
    for run in runs:
        row = bench.evaluate_run(run)
        assert row.step_time_s > 0 and 0 < row.mfu < 1, row
        assert 1 / 3 < row.predicted / row.published < 3, row


def test_the_device_benchmark_refuses_a_machine_without_a_gpu_in_one_line():
    """benchmarks/device_kernel_clocks.py needs a CUDA GPU; without one (CI, this project's machines) it says so in
    one stderr line and exits 2, before touching anything else."""
    import subprocess

    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the benchmark would run")
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "device_kernel_clocks.py"), "--suite", "gemm"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().startswith("error: no CUDA GPU visible") and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""
