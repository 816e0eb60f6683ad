"""The prepared GPU check dry-runs on this CPU host (issue 21): its CPU phases pass, each CUDA phase ends in one
error line (or is skipped for want of a calibration), and the output folder has every file, within its deadline."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_gpu_check_dry_runs_on_the_cpu(tmp_path):
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: this is the dry run of a host without one")
    out = tmp_path / "gpu"
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--out", str(out),
                           "--deadline", "170"], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    status = {o["phase"]: o for o in json.loads((out / "summary.json").read_text())}
    assert [status[p]["status"] for p in ("probe", "plans", "verify-gloo")] == ["ok"] * 3
    for phase in ("profile", "verify-dense", "verify-moe"):
        assert status[phase]["status"] == "refused", status[phase]
        assert status[phase]["detail"].startswith("error: ") and "\n" not in status[phase]["detail"]
    assert status["estimate"]["status"] == "skipped"
    for name in ("probe.json", "plan-dense.json", "plan-moe.json", "verify-gloo.json", "summary.txt"):
        assert (out / name).exists(), name
    assert {p.name for p in (out / "logs").iterdir()} == {f"{p}.log" for p in status}
    assert json.loads((out / "verify-gloo.json").read_text())["ok"]
    assert sum(o["seconds"] for o in status.values()) < 170


def test_the_wrapper_scripts_parse():
    for script in ("gpu_check.sh", "gpu_wheels.sh"):
        done = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
