"""Measured runs read from the logs frameworks print (planner/framework_logs.py, planner/measured_runs.py): the
examples in examples/logs/ read back to the layout and step time they state, a plan's own Megatron arguments survive
the trip through a printed arguments block, calibrate takes the logs and plan takes the calibration, and a bad log
or runs entry is one line."""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
from pathlib import Path

import pytest
from cli_helpers import assert_input_error, run
from launcher_helpers import make_plan

from meshplan.costmodels.config import ParallelConfig, Workload
from meshplan.hardware_db.errors import InputError
from meshplan.planner.framework_logs import read_megatron_log, read_torchtitan_log
from meshplan.planner.launchers.megatron import megatron_args, parse_megatron_args
from meshplan.planner.launchers.torchtitan import parse_torchtitan_toml
from meshplan.planner.measured_runs import read_runs

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "examples" / "logs"
TITAN_LOG, TITAN_TOML = LOGS / "torchtitan-llama3-8b-h200.log", LOGS / "torchtitan-llama3-8b-h200.toml"


def _render():
    """benchmarks/megatron_ci_logs.py, which writes Megatron's arguments block."""
    spec = importlib.util.spec_from_file_location("megatron_ci_logs", ROOT / "benchmarks" / "megatron_ci_logs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _elapsed_ms(path: Path) -> list[float]:
    """The iteration times the file prints, read with nothing but a split (not the module's regular expression)."""
    return [float(line.split("elapsed time per iteration (ms):")[1].split("|")[0])
            for line in path.read_text().splitlines() if "elapsed time per iteration (ms):" in line]


def test_the_megatron_examples_read_back_to_their_layout_and_median_step():
    cases = {f"megatron-gpt3-7b-{layout}-{platform}.log": knobs for platform in ("h100", "gb200")
             for layout, knobs in (("tp4-pp1", (4, 1, 1, 2)), ("tp1-pp4-vpp8", (1, 4, 8, 1)))}
    for name, (tp, pp, vpp, mbs) in cases.items():
        path = LOGS / name
        run_ = read_megatron_log(path.read_text(), str(path))
        c = run_.launch.config
        assert (c.tp, c.pp, c.vpp, c.mbs, c.zero) == (tp, pp, vpp, mbs, 1)  # --use-distributed-optimizer: ZeRO-1
        assert run_.num_gpus == 8 and run_.launch.workload.global_batch == 8 and run_.launch.workload.seq_len == 8192
        times = _elapsed_ms(path)
        assert len(run_.step_times_s) == len(times) - 1  # the first interval is warm-up
        assert run_.step_time_s == pytest.approx(statistics.median(times[1:]) / 1e3)
        assert run_.step_time_s < times[0] / 1e3 / 3  # and the warm-up one is far slower: it had to go
        model = run_.launch.model
        assert model is not None and (model.num_layers, model.hidden, model.num_kv_heads) == (32, 4096, 8)
        assert run_.memory_kind == "allocated" and 45 < (run_.peak_memory_gib or 0) < 60


def test_the_torchtitan_example_reads_back_with_its_config_of_2025():
    run_ = read_torchtitan_log(TITAN_LOG.read_text(), TITAN_TOML.read_text(), "log", "toml")
    c = run_.launch.config
    assert run_.num_gpus == 8  # "Building 1-D device mesh with ['dp_shard'], [8]"
    assert (c.dp, c.zero, c.mbs, c.recompute) == (8, 3, 1, "selective")  # [training] batch_size = 1, of 2025-02
    assert run_.launch.runtime == "torchtitan"
    tps = [int(m.group(1).replace(",", "")) for m in re.finditer(r"tps: ([0-9,]+)", TITAN_LOG.read_text())]
    assert len(tps) == 11 and len(run_.step_times_s) == 10
    assert run_.step_time_s == pytest.approx(statistics.median(8 * 8192 / (t * 8) for t in tps[1:]))
    assert run_.peak_memory_gib == 49.59 and run_.memory_kind == "reserved"


def test_a_plans_megatron_arguments_survive_a_printed_arguments_block():
    """What `export megatron` writes, printed as Megatron prints its arguments, reads back to the same knobs."""
    render = _render()
    wl = Workload(global_batch=64, seq_len=4096)
    cases = [("llama3.1-8b", 8, ParallelConfig(tp=2, sp=True, mbs=2, zero=1)),
             ("llama3.1-70b", 64, ParallelConfig(tp=4, pp=4, vpp=5, mbs=1, recompute="full", recompute_group=2)),
             ("llama3.1-70b", 64, ParallelConfig(tp=8, pp=2, cp=2, recompute="selective")),
             ("mixtral-8x7b", 16, ParallelConfig(tp=2, ep=8, mbs=1, zero=1))]
    for model, gpus, config in cases:
        argv = megatron_args(make_plan(model, "h100-sxm", gpus, wl, config))
        flags: dict[str, object] = {}
        for n, token in enumerate(argv):
            if token.startswith("--"):
                values = []
                for t in argv[n + 1:]:
                    if t.startswith("--"):
                        break
                    values.append(t)
                flags[token] = True if not values else values[0] if len(values) == 1 else values
        text = "\n".join(render.argument_block(flags, gpus)) + \
            f"\n iteration        2/      10 | elapsed time per iteration (ms): 1234.5 | global batch size: {64:5d} |" \
            f"\n iteration        3/      10 | elapsed time per iteration (ms): 1000.0 | global batch size: {64:5d} |\n"
        logged = read_megatron_log(text, model)
        assert logged.launch.config == parse_megatron_args(argv).config, model
        assert logged.num_gpus == gpus and logged.step_times_s == (1.0,)


def test_the_torchtitan_configs_of_2025_and_0_2_both_read():
    old = TITAN_TOML.read_text()
    assert parse_torchtitan_toml(old, "t", world_size=8)[0].config.mbs == 1
    with pytest.raises(InputError, match="training.batch_size and training.local_batch_size both given"):
        parse_torchtitan_toml(old.replace("batch_size = 1", "batch_size = 1\nlocal_batch_size = 2"), "t", 8)
    new = ('[model]\nname = "llama3"\nflavor = "8B"\nconverters = ["quantize.linear.float8"]\n'
           '[training]\nlocal_batch_size = 2\nseq_len = 8192\n[parallelism]\ndata_parallel_shard_degree = -1\n'
           '[compile]\nenable = true\n[quantize.linear.float8]\nrecipe_name = "rowwise"\n')
    launch, zoo = parse_torchtitan_toml(new, "t", world_size=16)
    assert zoo == "llama3.1-8b" and launch.config.dp == 16 and launch.workload.global_batch == 32
    assert launch.runtime == "torchtitan+compile"  # 0.2's [compile] section
    assert (launch.workload.dtype, launch.workload.fp8_recipe) == ("fp8", "rowwise")
    with pytest.raises(InputError, match="needs the world size"):
        parse_torchtitan_toml(new, "t")
    with pytest.raises(InputError, match="not a multiple"):
        parse_torchtitan_toml(new.replace("[compile]", "[parallelism.x]\n[compile]").replace(
            "data_parallel_shard_degree = -1", "data_parallel_shard_degree = -1\ntensor_parallel_degree = 3"), "t", 16)


def test_calibrate_takes_the_logs_and_plan_takes_the_calibration(tmp_path, capsys):
    """The round trip of issue 44: logs -> meshplan calibrate -> plan --calibration, for both formats. The
    calibrated prediction of each logged layout is nearer its measured step than the defaults' (it was fit to them:
    the command prints the held-out error beside it)."""
    for runs, gpu, runtime in [("megatron-h100.toml", "h100-sxm", "megatron-core"),
                               ("torchtitan-h200.toml", "h200", "torchtitan")]:
        out = tmp_path / f"{gpu}.json"
        code, text, err = run(capsys, "calibrate", "--runs", str(LOGS / runs), "--out", str(out))
        assert code == 0, err
        assert "peak memory (" in text and "activations x" in text
        cal = json.loads(out.read_text())
        assert cal["kind"] == "factors" and cal["gpu"] == gpu and cal["error_after"] < cal["error_before"]
        assert cal["memory_runs"] == len(read_runs(LOGS / runs))
        assert cal["memory_error_after"] <= cal["memory_error_before"]
        code, text, err = run(capsys, "plan", "-m", "llama3.1-8b", "--gpu", gpu, "--gpus", "8", "--gbs", "8", "--seq",
                              "8192", "--runtime", runtime, "--calibration", str(out), "--json")
        assert code == 0, err
        assert json.loads(text)["prediction"]["step_time_s"] > 0
    steps = read_runs(LOGS / "megatron-h100.toml")
    assert [s.cluster.num_gpus for s in steps] == [8, 8] and steps[0].model.name == "megatron-gpt3-7b-tp4-pp1-h100"


def test_bad_log_runs_are_one_line(tmp_path, capsys):
    megatron = (LOGS / "megatron-gpt3-7b-tp4-pp1-h100.log").read_text()
    (tmp_path / "m.log").write_text(megatron)
    (tmp_path / "cut.log").write_text(megatron.split("-------------------- end of arguments")[0])
    (tmp_path / "short.log").write_text(megatron.split(" iteration        4/")[0])
    (tmp_path / "t.log").write_text(TITAN_LOG.read_text())
    (tmp_path / "t.toml").write_text(TITAN_TOML.read_text())
    (tmp_path / "t16.toml").write_text(TITAN_TOML.read_text().replace("batch_size = 1", "batch_size = 2"))
    entry = '[[run]]\nlog = "m.log"\nformat = "megatron"\ngpu = "h100-sxm"\n'
    titan = '[[run]]\nlog = "t.log"\nformat = "torchtitan"\nconfig = "t.toml"\ngpu = "h200"\n'
    cases = {
        "layout given": (entry + "gpus = 8\n", "gpus is read from the log"),
        "memory kind given": (entry + 'memory_kind = "reserved"\n', "memory_kind is read from the log"),
        "no block": (entry.replace("m.log", "cut.log"), "end of arguments"),
        "no such log": (entry.replace("m.log", "none.log"), "none.log"),
        "one interval": (entry.replace("m.log", "short.log"), "warm-up"),
        "another model": (entry + 'model = "llama3.1-70b"\n', "do not describe llama3.1-70b"),
        "titan without config": (titan.replace('config = "t.toml"\n', ""), "config"),
        "titan, another config": (titan.replace("t.toml", "t16.toml"), "pair the log with its own config"),
        "a bad format": (entry.replace('"megatron"', '"nemo2"'), "format"),
    }
    for name, (text, word) in cases.items():
        path = tmp_path / f"{name}.toml"
        path.write_text(text)
        out = tmp_path / f"{name}.json"
        assert_input_error(*run(capsys, "calibrate", "--runs", str(path), "--out", str(out)), word, "run 1")
        assert not out.exists(), name


def test_bf16_gradients_travel_through_the_export_the_import_and_the_log():
    """A plan priced with bf16 gradients exports --grad-reduce-in-bf16 (and NeMo's grad_reduce_in_fp32 = False),
    which reads back as the bf16-grads runtime; so does a log whose arguments block shows fp32 accumulation off."""
    from meshplan.planner.launchers.nemo import ddp_fields

    wl = Workload(global_batch=16, seq_len=4096)
    plan = make_plan("llama3.1-8b", "h100-sxm", 8, wl, ParallelConfig(tp=2, zero=1), "megatron-core+bf16-grads")
    argv = megatron_args(plan)
    assert "--grad-reduce-in-bf16" in argv and parse_megatron_args(argv).runtime == "megatron-core+bf16-grads"
    assert ddp_fields(plan)["grad_reduce_in_fp32"] is False
    fp32 = make_plan("llama3.1-8b", "h100-sxm", 8, wl, ParallelConfig(tp=2, zero=1))
    assert "--grad-reduce-in-bf16" not in megatron_args(fp32)
    assert parse_megatron_args(megatron_args(fp32)).runtime is None
    text = (LOGS / "megatron-gpt3-7b-tp4-pp1-h100.log").read_text()
    flipped = text.replace("  bf16 ....", "  accumulate_allreduce_grads_in_fp32 .............. False\n  bf16 ....", 1)
    assert read_megatron_log(flipped, "log").launch.runtime == "megatron-core+bf16-grads"
    assert read_megatron_log(text, "log").launch.runtime is None


def test_sweep_takes_a_calibration_for_its_gpu_and_says_so_for_the_others(tmp_path, capsys):
    """`sweep --calibration` prices the calibration's GPU type with it; a point on another GPU carries the reason."""
    cal = tmp_path / "h100.json"
    assert run(capsys, "calibrate", "--runs", str(LOGS / "megatron-h100.toml"), "--out", str(cal))[0] == 0
    args = ["sweep", "-m", "llama3.1-8b", "--gpu", "h100-sxm,h200", "--gpus", "8", "--gbs", "16", "--seq", "4096"]
    code, plain, err = run(capsys, *args)
    assert code == 0, err
    code, calibrated, err = run(capsys, *args, "--calibration", str(cal))
    assert code == 0, err
    text = " ".join(calibrated.split())
    assert "fit to runs on h100-sxm, not on h200" in text
    h100 = [line for line in calibrated.splitlines() if "h100-sxm; GPUs 8" in line]
    assert h100 and h100[0] not in plain  # the calibrated figures differ from the defaults'
