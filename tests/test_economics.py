"""Money and time (costmodels/economics.py, issue 20): dollars and GPU-hours by hand, Young's and Daly's checkpoint
intervals against their closed forms and Daly's published examples, and the expected wall time with failures."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.costmodels.economics import (LLAMA3_FAILURES_PER_GPU_HOUR, Reliability, daly_interval, daly_wall_time,
                                           serving_cost, training_cost, young_interval)


def test_dollars_and_gpu_hours_by_hand():
    """64 GPUs at $2.50 an hour making 100,000 tokens/s: $160 an hour; a million tokens take 10 s, so $0.444 and
    0.178 GPU-hours."""
    c = training_cost(64, 2.5, 1e5, parameters=70e9)
    assert c.usd_per_hour == pytest.approx(160.0)
    assert c.usd_per_million_tokens == pytest.approx(160.0 * 10 / 3600)
    assert c.gpu_hours_per_million_tokens == pytest.approx(64 * 10 / 3600)
    assert c.tokens is None and c.expected_s is None
    s = serving_cost(8, 3.0, 2000.0)
    assert s.usd_per_hour == pytest.approx(24.0)
    assert s.usd_per_million_output_tokens == pytest.approx(24.0 / 7.2)


@pytest.mark.parametrize(("mtbf_min", "interval_min"), [(24 * 60, 117), (6 * 60, 57), (15, 9.1)])
def test_daly_interval_matches_dalys_examples(mtbf_min, interval_min):
    """Daly 2006, Figs. 3-5: delta = 5 min; the higher-order optimum is 117, 57 and 9.1 minutes at M = 24 h, 6 h and
    15 min (to the figures' rounding)."""
    assert daly_interval(5 * 60, mtbf_min * 60) / 60 == pytest.approx(interval_min, abs=0.5 if interval_min > 10
                                                                    else 0.05)


def test_young_is_daly_to_first_order():
    assert young_interval(300, 86400) == pytest.approx(math.sqrt(2 * 300 * 86400))
    assert daly_interval(300, 86400) == pytest.approx(young_interval(300, 86400) - 300, rel=0.02)
    assert daly_interval(1000, 400) == 400  # delta >= 2M: checkpoint once per mean time between failures


@given(delta=st.floats(1, 3600), mtbf=st.floats(600, 1e6), restart=st.floats(0, 3600))
@settings(max_examples=80, deadline=None)
def test_dalys_interval_is_near_the_least_wall_time(delta, mtbf, restart):
    """The expected wall time never falls below the work itself, and Daly's interval is within 1 % of the best of
    a fine scan of intervals (his perturbation solution is accurate to high order for delta < 2M)."""
    solve = 100 * 3600.0
    tau = daly_interval(delta, mtbf)
    best = min(daly_wall_time(solve, t, delta, restart, mtbf) for t in (tau * 1.02 ** k for k in range(-100, 101)))
    here = daly_wall_time(solve, tau, delta, restart, mtbf)
    assert here >= solve
    if delta < 2 * mtbf:
        assert here <= best * 1.01


def test_time_to_train_with_llama3s_failure_rate():
    """16,384 GPUs at Llama 3's 419 interruptions in 54 days: a job MTBF of 54 x 24 / 419 = 3.09 hours. Without
    failures the run takes tokens / rate; with them it takes longer, by at least a restart per failure, and the
    plan's interval is Daly's at its checkpoint time (405B parameters x 14 bytes at 2 TB/s: 2.8 s)."""
    c = training_cost(16384, 2.0, 2.6e6, parameters=405e9, tokens=15.6e12)
    assert c.mtbf_s / 3600 == pytest.approx(54 * 24 / 419)
    assert c.checkpoint_s == pytest.approx(405e9 * 14 / 2e12)
    assert c.checkpoint_interval_s == pytest.approx(daly_interval(c.checkpoint_s, c.mtbf_s))
    assert c.ideal_s == pytest.approx(15.6e12 / 2.6e6)
    failures = c.expected_s / c.mtbf_s
    assert c.expected_s > c.ideal_s + 0.9 * failures * Reliability().restart_s
    assert 0.8 < c.goodput < 1.0
    assert c.total_usd == pytest.approx(16384 * 2.0 * c.expected_s / 3600)
    assert pytest.approx(419 / (54 * 24 * 16384)) == LLAMA3_FAILURES_PER_GPU_HOUR
    never = training_cost(16384, 2.0, 2.6e6, parameters=405e9, tokens=15.6e12,
                          reliability=Reliability(failures_per_gpu_hour=1e-12))
    assert never.goodput > 0.99


def test_plan_records_and_prints_its_cost(capsys, tmp_path):
    """`plan --tokens 1e12 --price-per-gpu-hour 2`: the plan's economics section is training_cost of its own
    throughput and the model's parameters, and the table's lines say the same; `show` prints it back."""
    import json

    from cli_helpers import run

    from meshplan.costmodels.model_io import load_zoo

    path = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "64",
                         "--seq", "4096", "--tokens", "1e12", "--price-per-gpu-hour", "2", "--restart-min", "5",
                         "--out", str(path))
    assert code == 0, err
    doc = json.loads(path.read_text())
    econ = doc["economics"]
    expected = training_cost(8, 2.0, doc["prediction"]["tokens_per_s"], load_zoo("llama3.1-8b").total_params(),
                             1e12, Reliability(restart_s=300.0))
    assert econ["usd_per_hour"] == pytest.approx(16.0)
    assert econ["checkpoint_interval_s"] == pytest.approx(expected.checkpoint_interval_s)
    assert econ["expected_s"] == pytest.approx(expected.expected_s)
    assert econ["total_usd"] == pytest.approx(expected.total_usd)
    assert "cost: $16.00/hour at $2 per GPU-hour" in out
    assert f"{expected.expected_s / 86400:,.1f} days expected" in out
    code, out, err = run(capsys, "show", str(path))
    assert code == 0 and f"{expected.expected_s / 86400:,.1f} days expected" in out


def test_estimate_prints_its_cost_at_the_databases_price(capsys):
    from cli_helpers import run

    from meshplan.hardware_db.gpu import load_gpu

    code, out, err = run(capsys, "estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs",
                         "64", "--seq", "4096")
    price = load_gpu("h100-sxm").price_usd_per_hour.value
    assert code == 0 and f"cost: ${8 * price:,.2f}/hour at ${price:g} per GPU-hour" in out


def test_a_negative_price_is_refused(capsys):
    from cli_helpers import run

    code, out, err = run(capsys, "estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8",
                         "--price-per-gpu-hour", "-1")
    assert code == 2 and "Traceback" not in err and "--price-per-gpu-hour" in err


@pytest.mark.parametrize(("flags", "words"), [(("--failure-rate", "0"), "--failure-rate"),
                                              (("--failure-rate", "1", "--restart-min", "10000"), "never finishes")])
def test_failures_the_run_cannot_outlast_are_refused(capsys, flags, words):
    """No failures at all is not a rate (give a tiny one); failures so frequent that a restart never completes the
    work make the expected time overflow: both one line, exit 2, no traceback."""
    from cli_helpers import run

    code, out, err = run(capsys, "estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8",
                         "--tokens", "1e12", *flags)
    assert code == 2 and "Traceback" not in err + out and words in err


def test_serve_records_its_cost_at_the_given_price(capsys, tmp_path):
    """`serve --price-per-gpu-hour 2`: the serving plan's economics is the deployment's GPUs at $2 an hour over its
    predicted output tokens/s, by hand; `show` prints it back; without the flag the database's price."""
    import json

    from cli_helpers import run

    from meshplan.hardware_db.gpu import load_gpu

    path = tmp_path / "serve.json"
    args = ("serve", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--isl", "1000", "--osl", "200")
    code, out, err = run(capsys, *args, "--price-per-gpu-hour", "2", "--out", str(path))
    assert code == 0, err
    doc = json.loads(path.read_text())
    gpus, rate = doc["prediction"]["gpus"], doc["prediction"]["output_tokens_per_s"]
    econ = doc["economics"]
    assert econ["usd_per_hour"] == pytest.approx(2.0 * gpus)
    assert econ["usd_per_million_output_tokens"] == pytest.approx(2.0 * gpus / (rate * 3600 / 1e6))
    line = f"cost: ${2.0 * gpus:,.2f}/hour at $2 per GPU-hour, ${econ['usd_per_million_output_tokens']:,.3f}"
    assert line in out
    code, out, err = run(capsys, "show", str(path))
    assert code == 0 and line in out
    code, out, err = run(capsys, *args, "--json")
    price = load_gpu("h100-sxm").price_usd_per_hour.value
    assert code == 0 and json.loads(out)["economics"]["usd_per_gpu_hour"] == price
