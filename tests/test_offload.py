"""Activation offload to host memory (Megatron --cpu-offloading-num-layers): the memory it frees by hand, the
transfer it adds, the rules Megatron enforces, and the exports that can or cannot carry it."""

from __future__ import annotations

import pytest

from meshplan.costmodels.config import ParallelConfig, Workload
from meshplan.costmodels.estimate import estimate
from meshplan.costmodels.kernels import CONTENTION_COPY_ENGINE, Physics, copy_engine_exposed
from meshplan.costmodels.memory import layer_activation_bytes
from meshplan.costmodels.model_io import load_model
from meshplan.costmodels.runtime import get_runtime
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.errors import InputError
from meshplan.planner.launchers import export_plan
from meshplan.planner.launchers.megatron import megatron_args, parse_megatron_args
from tests.cli_helpers import assert_input_error, run
from tests.launcher_helpers import make_plan

MODEL = load_model("llama3.1-8b")
WL = Workload(global_batch=64, seq_len=8192, dtype="bf16")
CLUSTER = Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=8))


def _est(**knobs):
    return estimate(MODEL, CLUSTER, WL, ParallelConfig(**({"tp": 2, "mbs": 1} | knobs)))


def test_offload_frees_all_but_one_layer_in_transit():
    base, off = _est(), _est(offload_layers=10)
    per_layer = layer_activation_bytes(MODEL, 0, base.layout, WL, get_runtime("megatron-core"), "none")
    assert base.stages[0].memory.activations - off.stages[0].memory.activations == pytest.approx(9 * per_layer)
    assert off.step_time_s > base.step_time_s  # the copies contend for HBM even when hidden
    assert off.breakdown_s["offload_comm"] > 0


def test_copy_engine_exposure_by_hand():
    on = Physics()
    assert copy_engine_exposed(1.0, 3.0, on) == pytest.approx(CONTENTION_COPY_ENGINE)  # hidden, contention only
    assert copy_engine_exposed(3.0, 1.0, on) == pytest.approx(2.0 + CONTENTION_COPY_ENGINE * 1.0)
    assert copy_engine_exposed(3.0, 1.0, Physics.none()) == 2.0
    assert copy_engine_exposed(0.0, 1.0, on) == 0.0


def test_a_slower_host_link_never_speeds_the_step():
    slow = Cluster(ClusterSpec(gpu="a100-80gb", num_gpus=8))  # PCIe 4.0 against H100's PCIe 5.0
    cfg = ParallelConfig(tp=2, mbs=1, offload_layers=16)
    a100, h100 = estimate(MODEL, slow, WL, cfg), estimate(MODEL, CLUSTER, WL, cfg)
    assert a100.breakdown_s["offload_comm"] > h100.breakdown_s["offload_comm"]


def test_megatron_rules_refuse_with_one_clear_error():
    with pytest.raises(InputError, match="--pp 1"):
        _est(pp=2, offload_layers=4)
    with pytest.raises(InputError, match="recomputation"):
        _est(offload_layers=4, recompute="selective")
    with pytest.raises(InputError, match="fewer than"):
        _est(offload_layers=32)
    amd = Cluster(ClusterSpec(gpu="mi300x", num_gpus=8))
    with pytest.raises(InputError, match="host_link_gb_s"):
        estimate(MODEL, amd, WL, ParallelConfig(tp=2, offload_layers=4))


def test_cli_offload(capsys):
    code, out, err = run(capsys, "estimate", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--tp", "2",
                         "--seq", "8192", "--gbs", "64", "--offload-layers", "8")
    assert code == 0, err
    assert "activation offload" in out
    assert_input_error(*run(capsys, "estimate", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--pp", "2",
                            "--offload-layers", "8"), "--pp 1")
    assert_input_error(*run(capsys, "estimate", "-m", "llama3.1-8b", "--gpu", "mi300x", "--gpus", "8",
                            "--offload-layers", "8"), "host_link_gb_s")


def test_exports_carry_or_refuse_the_offload():
    plan = make_plan("llama3.1-8b", "h100-sxm", 8, WL, ParallelConfig(tp=2, offload_layers=8))
    argv = megatron_args(plan)
    assert argv[argv.index("--cpu-offloading-num-layers") + 1] == "8"
    assert parse_megatron_args(argv).config.offload_layers == 8
    assert "cpu_offloading=True" in export_plan(plan, "nemo").files[0].text
    with pytest.raises(InputError, match="host memory"):
        export_plan(plan, "torchtitan")
