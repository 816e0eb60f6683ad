"""Calibration: the fits reproduce what they were fitted to and stay monotone, files from elsewhere are refused, the
cost model uses what a calibration measured, and `meshplan profile --quick` / `verify --calibration` run (issue 5)."""

from __future__ import annotations

import json
import math
from itertools import pairwise

import pytest
from cli_helpers import assert_input_error, run
from hypothesis import given
from hypothesis import strategies as st

from meshplan.costmodels import comm
from meshplan.costmodels.calibrate import fit_curve, fit_linear, fit_model, fit_ring, interpolate, isotonic
from meshplan.costmodels.comm import ring_shape
from meshplan.costmodels.config import ParallelConfig, Workload
from meshplan.costmodels.efficiency import Efficiency, calibrated_cluster
from meshplan.costmodels.estimate import simulate_config
from meshplan.costmodels.model_io import load_model
from meshplan.costmodels.timing import op_time, timed_collective
from meshplan.hardware_db.calibration import (CALIBRATION_SCHEMA_VERSION, ActivationPoint, AttentionPoint, Calibration,
                                              CollectivePoint, DeviceInfo, GemmPoint, LayerOverhead, Measurements,
                                              MemoryOpPoint, OptimizerPoint, Software, StepOverhead, calibration_dir,
                                              load_calibration, parse_calibration)
from meshplan.hardware_db.cluster import ClusterSpec
from meshplan.hardware_db.errors import InputError

EXAMPLE = calibration_dir() / "example-cpu.json"


# ---- the fits -----------------------------------------------------------------------------------------------------
@given(st.lists(st.floats(-1e3, 1e3), min_size=1, max_size=40))
def test_isotonic_is_non_decreasing_and_keeps_the_mean(values):
    out = isotonic(values)
    assert all(b >= a - 1e-9 for a, b in pairwise(out))
    assert math.isclose(sum(out), sum(values), rel_tol=1e-9, abs_tol=1e-6)
    if values == sorted(values):
        assert out == pytest.approx(values)


positive_points = st.lists(st.tuples(st.floats(1e3, 1e12), st.floats(1e-7, 10.0)), min_size=1, max_size=30)


@given(positive_points, st.lists(st.floats(1.0, 1e13), min_size=2, max_size=20))
def test_a_fitted_curve_never_takes_less_time_for_more_flops(points, queries):
    curve = fit_curve([f for f, _ in points], [t for _, t in points])
    times = [interpolate(curve.flops, curve.seconds, x) for x in sorted(queries)]
    assert all(b >= a * (1 - 1e-12) for a, b in pairwise(times))


@given(st.lists(st.floats(1e3, 1e12), min_size=2, max_size=20, unique=True), st.floats(1e9, 1e14),
       st.floats(1e-6, 1e-3))
def test_a_monotone_measurement_is_reproduced_exactly(flops, rate, launch):
    seconds = [launch + f / rate for f in flops]  # what a real device does: a launch cost, then a rate
    curve = fit_curve(flops, seconds)
    for f, t in zip(flops, seconds, strict=True):
        assert interpolate(curve.flops, curve.seconds, f) == pytest.approx(t, rel=1e-9)


def test_linear_and_ring_fits_recover_the_latency_and_bandwidth_they_were_made_with():
    sizes = [4096, 65536, 1 << 20, 8 << 20]
    f = fit_linear(sizes, [20e-6 + s / 3e9 for s in sizes])
    assert f.alpha_s == pytest.approx(20e-6, rel=1e-6) and f.bytes_per_s == pytest.approx(3e9, rel=1e-6)
    points = []
    for kind in ("all_reduce", "all_gather", "p2p"):
        for n in (2, 4):
            steps, share = ring_shape(kind, n)
            points += [CollectivePoint(kind=kind, ranks=n, bytes=s, seconds=steps * 7e-6 + share * s / 5e9)
                       for s in sizes]
    ring = fit_ring(points)
    assert ring.alpha_s == pytest.approx(7e-6, rel=1e-6) and ring.bytes_per_s == pytest.approx(5e9, rel=1e-6)


def _measurements(scale: float = 1.0) -> Measurements:
    """A device whose every time is `scale` times a reference device's (GEMM at 1 TFLOP/s + 5 us, ...)."""
    gemms = [GemmPoint(name="g", direction=d, m=m, n=m, k=m, seconds=scale * (5e-6 + 2 * m**3 / 1e12))
             for m in (64, 256, 1024, 4096) for d in ("forward", "backward")]
    attention = [AttentionPoint(batch=1, heads=8, kv_heads=8, seq=s, head_dim=64, fwd_flops=2 * 8 * s * s * 64,
                                fwd_seconds=scale * (2 * 8 * s * s * 64 / 5e11 + 1e-5),
                                bwd_seconds=scale * (2.5 * 2 * 8 * s * s * 64 / 4e11 + 2e-5)) for s in (256, 1024)]
    memory = [MemoryOpPoint(name=n, direction="forward", elements=e, model_bytes=4 * e,
                            seconds=scale * (3e-6 + 4 * e / 2e11))
              for n in ("norm", "swiglu", "residual_add", "rope", "cross_entropy", "embedding") for e in (1e4, 1e6)]
    collectives = [CollectivePoint(kind=k, ranks=2, bytes=b, seconds=scale * (1e-5 + b / 1e10))
                   for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p") for b in (1e4, 1e7)]
    return Measurements(dtype="float64", gemms=tuple(gemms), attention=tuple(attention), memory_ops=tuple(memory),
                        collectives=tuple(collectives), optimizer=tuple(
                            OptimizerPoint(params=p, seconds=scale * p / 1e8) for p in (10**5, 10**6)),
                        activations=(ActivationPoint(model="m", tokens=128, measured_bytes=3.0, predicted_bytes=2.0),))


def _calibration(kind: str = "cpu", target: str = "cpu", scale: float = 1.0) -> Calibration:
    m = _measurements(scale)
    return Calibration(schema_version=CALIBRATION_SCHEMA_VERSION, created="2026-11-30T00:00:00+00:00",
                       device=DeviceInfo(kind=kind, target=target, name="test device", threads=1, memory_bytes=2**34),
                       software=Software(meshplan="0", python="3.11", torch="2.13", backend="gloo"), measurements=m,
                       fitted=fit_model(m))


def test_the_fitted_model_reproduces_its_own_measurements():
    cal = _calibration()
    f, m = cal.fitted, cal.measurements
    for p in m.gemms:
        curve = f.gemm if p.direction == "forward" else f.gemm_backward
        assert interpolate(curve.flops, curve.seconds, p.flops) == pytest.approx(p.seconds, rel=1e-9)
    for p in m.attention:
        assert interpolate(f.attention.flops, f.attention.seconds, p.fwd_flops) == pytest.approx(p.fwd_seconds)
    for p in m.memory_ops:
        fit = next(c for c in f.memory_classes if c.name == p.name)
        assert fit.alpha_s + p.model_bytes / fit.bytes_per_s == pytest.approx(p.seconds, rel=1e-6)
    for p in m.collectives:
        fit = cal.collective(p.kind, p.ranks)
        assert fit is not None and fit.alpha_s + p.bytes / fit.bytes_per_s == pytest.approx(p.seconds, rel=1e-6)
    assert f.optimizer is not None and f.optimizer.params_per_s == pytest.approx(1e8, rel=1e-6)
    assert f.activation_ratios == {"none": 1.5} and f.activation_ratio_for("full") == 1.0


def test_the_example_calibration_of_this_projects_cpu_reproduces_its_measurements():
    """A real profile (2-core VM, float64): the monotone fit moves few points, and little."""
    cal = load_calibration(EXAMPLE)
    f = cal.fitted
    errors = [abs(interpolate(f.gemm.flops, f.gemm.seconds, p.flops) / p.seconds - 1)
              for p in cal.measurements.gemms if p.direction == "forward"]
    assert sorted(errors)[len(errors) // 2] < 0.05, errors


# ---- the cost model reads it --------------------------------------------------------------------------------------
def test_calibrated_operators_take_the_measured_times():
    cal = _calibration()
    cluster, eff = calibrated_cluster(ClusterSpec(gpu="cpu", num_gpus=2, gpus_per_node=2), cal, "t.json")
    peak, hbm = cluster.gpu.peak_flops("bf16"), cluster.gpu.hbm_bytes_per_s
    flops = 2 * 512**3
    expected = interpolate(cal.fitted.gemm.flops, cal.fitted.gemm.seconds, flops)
    assert op_time(flops, 1.0, "gemm", peak, hbm, eff) == pytest.approx(expected)
    assert eff.memory_op_time("norm1", 4e6) == pytest.approx(3e-6 + 4e6 / 2e11, rel=1e-6)
    assert eff.memory_op_time("expert_swiglu", 4e6) == pytest.approx(3e-6 + 4e6 / 2e11, rel=1e-6)
    inside = comm.Link(1e9, 1e-6, False)
    # measured kind and group size: alpha + bytes / beta; others: the ring formula on the link
    assert timed_collective("all_reduce", 1e6, 2, inside, eff) == pytest.approx(1e-5 + 1e6 / 1e10, rel=1e-6)
    assert timed_collective("all_reduce", 1e6, 4, inside, eff) == comm.all_reduce(1e6, 4, inside)
    across = comm.Link(1e9, 1e-6, True)
    assert timed_collective("all_reduce", 1e6, 2, across, eff) == comm.all_reduce(1e6, 2, across)
    assert eff.calibration is not None and eff.calibration.startswith("t.json sha256:")


def test_a_device_twice_as_slow_predicts_twice_the_compute():
    model = load_model("llama3.1-8b").model_copy(update={"num_layers": 2, "hidden": 256, "num_heads": 8,
                                                         "num_kv_heads": 4, "head_dim": 32, "ffn_hidden": 704,
                                                         "vocab": 2048})
    wl, cfg = Workload(global_batch=4, seq_len=256), ParallelConfig(mbs=1)
    times = []
    for scale in (1.0, 2.0):
        cluster, eff = calibrated_cluster(ClusterSpec(gpu="cpu", num_gpus=1, gpus_per_node=1),
                                          _calibration(scale=scale), "t")
        times.append(simulate_config(model, cluster, wl, cfg, "torchtitan", eff).estimate.breakdown_s)
    assert times[1]["compute"] == pytest.approx(2 * times[0]["compute"], rel=1e-6)
    assert times[1]["optimizer"] == pytest.approx(2 * times[0]["optimizer"], rel=1e-6)


def test_layer_and_step_overheads_are_added_per_layer_and_per_micro_batch():
    model = load_model("llama3.1-8b").model_copy(update={"num_layers": 3, "hidden": 256, "num_heads": 8,
                                                         "num_kv_heads": 4, "head_dim": 32, "ffn_hidden": 704,
                                                         "vocab": 2048})
    wl, cfg = Workload(global_batch=2, seq_len=128), ParallelConfig(mbs=1)
    base = _calibration()
    spec = ClusterSpec(gpu="cpu", num_gpus=1, gpus_per_node=1)
    fitted = base.fitted.model_copy(update={"layer_overhead": (LayerOverhead(tp=1, forward_s=1e-3, backward_s=2e-3),),
                                            "step_overhead": StepOverhead(forward_s=5e-3, backward_s=7e-3)})
    with_overhead = base.model_copy(update={"fitted": fitted})
    computes = []
    for cal in (base, with_overhead):
        cluster, eff = calibrated_cluster(spec, cal, "t")
        computes.append(simulate_config(model, cluster, wl, cfg, "torchtitan", eff).estimate.breakdown_s["compute"])
    # 2 micro-batches x (3 layers x (1 + 2) ms + (5 + 7) ms)
    assert computes[1] - computes[0] == pytest.approx(2 * (3 * 3e-3 + 12e-3), rel=1e-9)


def test_without_a_calibration_nothing_changes():
    eff = Efficiency(0.75, 2e9, 0.55, 0.8, 4e-6)
    link = comm.Link(1e11, 5e-6, False)
    assert timed_collective("all_gather", 1e8, 8, link, eff) == comm.all_gather(1e8, 8, link)
    assert eff.overhead(8, True) == (0.0, 0.0) and eff.memory_op_time("norm1", 1e6) is None


# ---- files from elsewhere are refused ------------------------------------------------------------------------------
def test_corrupt_newer_older_and_malformed_files_are_refused_in_one_line():
    good = json.loads(EXAMPLE.read_text())
    cases = {
        "{not json": "not valid JSON",
        json.dumps({"hello": 1}): "no schema_version",
        json.dumps({**good, "schema_version": CALIBRATION_SCHEMA_VERSION + 1}): "newer",
        json.dumps({**good, "schema_version": 0}): "older",
        json.dumps({**good, "fitted": {**good["fitted"], "gemm": {"flops": [2.0, 1.0], "seconds": [1.0, 2.0]}}}):
            "flops must increase",
        json.dumps({**good, "device": {**good["device"], "kind": "tpu"}}): "device.kind",
        # a file is read strictly: no true-as-1, no numbers as strings, no inf (hardware_db/documents.py)
        json.dumps({**good, "fitted": {**good["fitted"], "step_overhead": {"forward_s": -4e9, "backward_s": 0.01}}}):
            "step_overhead.forward_s",
        json.dumps({**good, "fitted": {**good["fitted"], "peak_flops": True}}): "peak_flops",
        json.dumps({**good, "fitted": {**good["fitted"], "peak_flops": "7e10"}}): "peak_flops",
        json.dumps(good).replace('"schema_version": 1', '"schema_version": 1e999'): "not a finite number",
    }
    for text, words in cases.items():
        with pytest.raises(InputError) as exc:
            parse_calibration(text, "c.json")
        assert words in str(exc.value) and "\n" not in str(exc.value) and "c.json" in str(exc.value)


def test_a_calibration_of_another_device_is_refused():
    gpu_cal = _calibration(kind="cuda", target="h100-sxm")
    with pytest.raises(InputError, match="measured on h100-sxm.*not on a100-80gb"):
        calibrated_cluster(ClusterSpec(gpu="a100-80gb", num_gpus=8), gpu_cal, "h100.json")
    cluster, eff = calibrated_cluster(ClusterSpec(gpu="h100-sxm", num_gpus=8), gpu_cal, "h100.json")
    assert cluster.gpu.name == "h100-sxm" and eff.gemm_curve is not None
    assert cluster.gpu.efficiency.kernel_overhead_us == pytest.approx(3.0, rel=1e-6)
    with pytest.raises(InputError, match="this host's CPU.*not on h100-sxm.*--gpu cpu"):
        calibrated_cluster(ClusterSpec(gpu="h100-sxm", num_gpus=8), _calibration(), "cpu.json")


def test_cli_refuses_bad_calibrations_in_one_line(capsys, tmp_path):
    args = ("estimate", "--model", "llama3.1-8b", "--gbs", "8", "--seq", "512")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    assert_input_error(*run(capsys, *args, "--gpu", "cpu", "--gpus", "1", "--calibration", str(bad)), "bad.json",
                       "not valid JSON")
    assert_input_error(*run(capsys, *args, "--gpu", "h100-sxm", "--gpus", "8", "--calibration", str(EXAMPLE)),
                       "not on h100-sxm", "--gpu cpu")
    assert_input_error(*run(capsys, *args, "--gpu", "cpu", "--gpus", "1", "--calibration", "nope.json"),
                       "not found", "meshplan profile")
    assert_input_error(*run(capsys, *args, "--gpu", "cpu", "--gpus", "1"), "unknown GPU 'cpu'")


def test_cli_estimates_and_plans_on_a_calibrated_cpu_and_the_plan_records_it(capsys, tmp_path):
    model = tmp_path / "m.json"
    model.write_text(json.dumps({"name": "cpu-small", "layers": 4, "hidden": 256, "heads": 8,
                                 "kv_heads": 4, "head_dim": 32, "ffn_hidden": 704, "vocab": 2048}))
    common = ("--model", str(model), "--gbs", "4", "--seq", "256", "--gpu", "cpu", "--gpus", "2",
              "--runtime", "torchtitan", "--calibration", "example-cpu")
    code, out, err = run(capsys, "estimate", *common, "--tp", "2", "--json")
    assert code == 0, err
    est = json.loads(out)
    assert 0.05 < est["step_time_s"] < 50  # a CPU: a step takes a fraction of a second to seconds, not microseconds
    plan_file = tmp_path / "plan.json"
    code, out, err = run(capsys, "plan", *common, "--out", str(plan_file))
    assert code == 0, err
    doc = json.loads(plan_file.read_text())
    assert doc["inputs"]["calibration"].startswith("example-cpu sha256:")
    assert doc["inputs"]["cluster"]["gpu_spec"]["vendor"] == "cpu"


# ---- the profiler and the closed loop (torch) -----------------------------------------------------------------------
# quick_profile: tests/conftest.py (session-scoped; the README example test shares it)


def test_profile_quick_writes_a_calibration_of_this_cpu(quick_profile):
    cal = load_calibration(quick_profile)
    assert cal.device.kind == "cpu" and cal.device.threads == 1 and cal.software.backend == "gloo"
    f = cal.fitted
    assert f.peak_flops > 1e8 and f.memory.bytes_per_s > 1e8
    assert {c.kind for c in f.collectives} == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"}
    assert {c.name for c in f.memory_classes} >= {"norm", "swiglu", "residual_add", "rope", "cross_entropy"}
    assert {(o.tp, o.sp) for o in f.layer_overhead} == {(1, False), (2, False), (2, True)}
    assert set(f.activation_ratios) == {"none", "selective", "full"}
    assert 0.5 < f.activation_ratios["full"] < 2.0  # full recompute keeps the layer input, as the formula says


def test_verify_reports_the_prediction_for_this_host(quick_profile, tmp_path, capsys):
    from meshplan.cli.main import main
    from meshplan.planner.builders import build_plan
    from meshplan.planner.plan import write_plan

    spec = load_model("llama3.1-8b").model_copy(update={"num_layers": 2})
    cluster, eff = calibrated_cluster(ClusterSpec(gpu="cpu", num_gpus=2, gpus_per_node=2),
                                      load_calibration(quick_profile), str(quick_profile))
    wl, cfg = Workload(global_batch=4, seq_len=16), ParallelConfig(dp=2, mbs=1)
    sim = simulate_config(spec, cluster, wl, cfg, "torchtitan", eff)
    plan = tmp_path / "plan.json"
    write_plan(build_plan(spec, cluster, wl, cfg, sim, "torchtitan", calibration=eff.calibration), plan)
    code = main(["verify", str(plan), "--calibration", str(quick_profile), "--steps", "3"])
    out, err = capsys.readouterr()
    assert code == 0, (out, err)
    assert "on this host's CPU" in out and "step time: measured" in out
    # a calibration predicts only the device it measured: a GPU's for gloo ranks, a CPU's for NCCL ones, each refused
    # in one line before any rank starts
    cal = load_calibration(quick_profile)
    gpu = tmp_path / "gpu.json"
    gpu.write_text(cal.model_copy(update={"device": cal.device.model_copy(update={"kind": "cuda", "target": "h200"})}
                                  ).model_dump_json())
    assert_input_error(*run(capsys, "verify", str(plan), "--calibration", str(gpu)), "--backend gloo",
                       "profile --device cpu")
    assert_input_error(*run(capsys, "verify", str(plan), "--calibration", str(quick_profile), "--backend", "nccl"),
                       "--backend nccl", "profile --device cuda")


def test_profile_refuses_a_device_this_machine_does_not_have(capsys, tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    out = tmp_path / "gpu.json"
    assert_input_error(*run(capsys, "profile", "--device", "cuda", "--out", str(out)), "no CUDA device",
                       "--device cpu")
    assert not out.exists()


def test_the_measured_activation_ratio_applies_to_plans_of_the_profiled_framework_only():
    from meshplan.costmodels.config import resolve
    from meshplan.costmodels.context import CostContext
    from meshplan.costmodels.memory import layer_activation_bytes
    from meshplan.costmodels.runtime import get_runtime

    model = load_model("llama3.1-8b").model_copy(update={"num_layers": 2, "hidden": 256, "num_heads": 8,
                                                         "num_kv_heads": 4, "head_dim": 32, "ffn_hidden": 704,
                                                         "vocab": 2048})
    wl, spec = Workload(global_batch=2, seq_len=128), ClusterSpec(gpu="cpu", num_gpus=1, gpus_per_node=1)
    lay = resolve(model, 1, wl, ParallelConfig(mbs=1))
    cal = _calibration()  # measured: 1.5 x the formula without recomputation; nothing for "full"
    for runtime, ratio in (("meshplan-executor", 1.5), ("torchtitan", 1.0)):
        cluster, eff = calibrated_cluster(spec, cal, "t", runtime)
        rt = get_runtime(runtime)
        ctx = CostContext(model, cluster, wl, lay, rt, eff)
        assert ctx.layer_activation(0, "none") == pytest.approx(
            ratio * layer_activation_bytes(model, 0, lay, wl, rt, "none"))
        assert ctx.layer_activation(0, "full") == pytest.approx(layer_activation_bytes(model, 0, lay, wl, rt, "full"))


def test_profile_refuses_more_collective_ranks_than_this_machine_has(capsys, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "cpu.json"
    assert_input_error(*run(capsys, "profile", "--ranks", "4096", "--out", str(out)), "--ranks 4096",
                       "ranks on this machine")
    assert not out.exists()


@pytest.mark.parametrize(("name", "gib", "target"), [
    ("NVIDIA H100 80GB HBM3", 79.2, "h100-sxm"), ("NVIDIA H100 PCIe", 79.2, "h100-pcie"),
    ("NVIDIA H100 NVL", 93.1, "h100-nvl"), ("NVIDIA H200", 139.8, "h200"), ("NVIDIA H200 NVL", 139.8, "h200-nvl"),
    ("NVIDIA H800", 79.2, "h800"), ("NVIDIA A100-SXM4-40GB", 39.4, "a100-40gb"),
    ("NVIDIA A100-SXM4-80GB", 79.2, "a100-80gb"), ("NVIDIA B200", 178.4, "b200"), ("NVIDIA L4", 22.0, "l4"),
    ("NVIDIA L40S", 44.4, "l40s"), ("AMD Instinct MI325X", 255.9, "mi325x"), ("AMD Instinct MI300X", 191.5, "mi300x"),
])
def test_device_names_map_to_hardware_db_by_name_and_memory(name, gib, target):
    """The review's loose mappings (H200 NVL and GH200 as h200, H100 NVL as h100-sxm, a PCIe A100 as a100-80gb, L4,
    L40S and MI325X unmapped) are each a table row now, cross-checked with the device's memory."""
    from meshplan.executor.profiler import gpu_target

    assert gpu_target(name, gib * 2**30) == target


@pytest.mark.parametrize(("name", "gib", "words"), [
    ("NVIDIA GH200 480GB", 95.0, ("no entry", "--gpu")), ("NVIDIA A100-PCIE-40GB", 39.4, ("no entry",)),
    ("NVIDIA H100 80GB HBM3", 94.5, ("94.5 gib", "h100-sxm has 80")), ("Some New GPU", 80.0, ("no entry",)),
])
def test_an_unknown_or_mismatched_device_asks_for_gpu(name, gib, words):
    from meshplan.executor.profiler import gpu_target

    with pytest.raises(InputError) as info:
        gpu_target(name, gib * 2**30)
    assert all(w in str(info.value).lower() for w in words) and "--gpu" in str(info.value)


def test_the_optimizer_probe_steps_fp32_masters_below_fp32():
    """Below fp32 the timed step is Megatron's mixed-precision one: AdamW on fp32 masters, then the masters copied
    into the bf16 weights; at fp32 and up there is nothing to copy."""
    torch = pytest.importorskip("torch")
    from meshplan.executor.profiler import _adamw_step

    weights = [torch.zeros(4, 3, dtype=torch.bfloat16)]
    masters = [torch.nn.Parameter(torch.full((4, 3), 0.5))]
    masters[0].grad = torch.ones(4, 3)
    opt = torch.optim.AdamW(masters, lr=0.1)
    _adamw_step(opt, weights, masters)
    assert masters[0].dtype == torch.float32 and float(masters[0].detach()[0, 0]) < 0.5  # stepped in fp32
    assert torch.equal(weights[0], masters[0].detach().to(torch.bfloat16))  # and copied into the model's weights


def test_gpu_profiles_leave_the_launch_bound_regime(monkeypatch):
    """A GPU's default grid (review finding 3): sequences 1k-8k, 2k-32k tokens, collectives on every visible GPU;
    the CPU's stays small. Blocks of back-to-back calls last about BLOCK_S (finding 4)."""
    torch = pytest.importorskip("torch")
    from meshplan.executor.profiler import BLOCK_S, back_to_back, default_grid

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    for quick in (True, False):
        grid = default_grid("cuda", quick)
        assert min(grid["seq"]) >= 1024 and max(grid["seq"]) == 8192
        assert min(grid["tokens"]) >= 2048 and max(grid["tokens"]) == 32768 and grid["ranks"] == (8,)
        assert grid["tp"] == (1, 2, 8)  # TP over the node's GPUs: its shapes, and the TP layer probe on 8 GPUs
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert default_grid("cuda", True)["ranks"] == () and default_grid("cuda", True)["tp"] == (1, 2)  # one GPU
    assert max(default_grid("cpu", True)["seq"]) <= 512 and default_grid("cpu", False) == {}
    assert back_to_back(10e-6) == 100 and back_to_back(BLOCK_S / 4) == 4 and back_to_back(1.0) == 1


def _burn_in_ranks(rank: int, world: int, burn_in_s: float) -> tuple[int, int]:
    """One TP rank's burn-in on a pretend GPU: rank 1's calls take 4x rank 0's, as a slower or colder GPU's would."""
    import time

    import torch

    from meshplan.executor import profiler

    torch.cuda.synchronize = lambda *a: None  # this spawned rank only: no GPU here, the count is what is tested
    profiler.BURN_IN_S = burn_in_s
    calls = [0]

    def fn() -> None:
        calls[0] += 1
        time.sleep(0.002 * (1 + 3 * rank))

    profiler._Timer(f"cuda:{rank}", 1, 0, agree=profiler._largest_over_ranks)._burn(fn)
    return calls[0], profiler._largest_over_ranks(calls[0])


def test_ranks_that_time_a_tp_layer_burn_in_the_same_number_of_calls():
    """Review finding 5 on NCCL: a TP layer's call holds all-reduces, so a burn-in of BURN_IN_S that each rank
    counts on its own clock would leave one rank waiting in a collective the other never calls. The ranks agree on
    a count (the largest of theirs); a single-process timer keeps burning by time."""
    pytest.importorskip("torch")
    from meshplan.executor import profiler
    from meshplan.executor.launch import run_world

    results = run_world(2, _burn_in_ranks, 0.05, timeout_s=120)
    # the same count on both ranks, though rank 1 alone would have made about a quarter of rank 0's calls; (the count
    # itself depends on this machine's load, so only its agreement and the timed first call are checked)
    assert results[0][0] == results[1][0] == results[0][1] >= 2
    timer = profiler._Timer("cuda:3", 1, 0)
    assert timer.device == "cuda" and not timer.burnt  # "cuda:3" is a GPU: it burns in
