"""The command line: output of estimate / models / hardware, and one-line errors with exit code 2 for bad input.

Most tests call cli.main.main(argv) in-process (the same function the `meshplan` console script runs) and read
stdout and stderr apart with capsys; a few run `python -m cli.main` as a subprocess to check the real process.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import assert_input_error, run

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "32", "--seq", "2048"]


# ---- estimate ------------------------------------------------------------------------------------------------------

def test_estimate_json_keys_and_sane_values(capsys):
    code, out, err = run(capsys, *SMALL, "--tp", "2", "--json")
    assert code == 0, err
    data = json.loads(out)  # --json prints the JSON document and nothing else
    for key in ("step_time_s", "tokens_per_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu", "peak_memory_gib",
                "fits", "breakdown_s"):
        assert key in data, key
    assert 0 < data["mfu"] < 1
    assert isinstance(data["fits"], bool) and data["fits"]
    assert data["step_time_s"] > 0 and data["peak_memory_gib"] > 0
    assert data["tokens_per_s"] == pytest.approx(32 * 2048 / data["step_time_s"])
    assert data["tokens_per_s_per_gpu"] == pytest.approx(data["tokens_per_s"] / 8)
    assert data["layout"]["tp"] == 2 and data["layout"]["dp"] == 4


def test_estimate_rich_summary(capsys):
    code, out, err = run(capsys, *SMALL, "--pp", "2", "--recompute", "selective")
    assert code == 0, err
    for text in ("MFU", "HFU", "tokens/s/GPU", "TFLOP/s/GPU", "Memory per GPU", "first stage", "last stage",
                 "activations", "optimizer", "fragmentation", "pipeline bubble", "% of step", "fits"):
        assert text in out, text


def test_estimate_knobs_reach_the_model(capsys):
    code, out, _ = run(capsys, *SMALL, "--tp", "2", "--pp", "2", "--vpp", "2", "--mbs", "2", "--zero", "0",
                       "--no-sp", "--runtime", "torchtitan", "--dtype", "fp8", "--json")
    assert code == 0
    data = json.loads(out)
    lay = data["layout"]
    got = (lay["tp"], lay["pp"], lay["vpp"], lay["dp"], lay["mbs"], lay["zero"], lay["sp"])
    assert got == (2, 2, 2, 2, 2, 0, False)
    assert lay["schedule"] == "interleaved"
    assert data["runtime"] == "torchtitan"


def test_estimate_not_fitting_is_reported(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "llama3.1-70b", "--gpu", "h100-sxm", "--gpus", "8")
    assert code == 0
    assert "memory: does not fit with 95 % confidence" in " ".join(out.split())
    code, out, _ = run(capsys, "estimate", "--model", "llama3.1-70b", "--gpu", "h100-sxm", "--gpus", "8", "--json")
    assert json.loads(out)["fits"] is False


def test_readme_quickstart_command_plans(capsys, tmp_path):
    """The README's first Quickstart command, as written (its --out redirected): a plan that fits, proven optimal
    (its best is a PP 4 per-stage plan: the per-stage enumeration walks only the partitions whose cheapest-policy J
    is below the best, so it closes that plan's gap)."""
    readme = (ROOT / "README.md").read_text()
    line = next(ln for ln in readme.splitlines() if "meshplan plan" in ln and ln.lstrip().startswith("pip "))
    args = line.split("meshplan ", 1)[1].split()
    args[args.index("--out") + 1] = str(tmp_path / "plan.json")
    code, out, err = run(capsys, *args, "--json")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["prediction"]["fits"] and 0 < plan["prediction"]["mfu"] < 1
    search = plan["search"]
    assert search["status"] == "optimal" and search["gap"] == 0.0, search
    assert json.loads((tmp_path / "plan.json").read_text()) == plan


def test_estimate_with_cluster_file(capsys):
    code, out, err = run(capsys, "estimate", "--model", "llama3.1-8b", "--cluster",
                         str(ROOT / "examples/clusters/dgx-h100-64.toml"), "--tp", "8", "--json")
    assert code == 0, err
    assert json.loads(out)["layout"]["dp"] == 8


def test_estimate_model_file(capsys):
    code, out, err = run(capsys, "estimate", "--model", str(ROOT / "examples/models/llama3.1-8b.config.json"),
                         "--gpu", "h100-sxm", "--gpus", "8", "--json")
    assert code == 0, err
    assert 0 < json.loads(out)["mfu"] < 1


# ---- models and hardware -------------------------------------------------------------------------------------------

def test_models_list(capsys):
    code, out, _ = run(capsys, "models", "list")
    assert code == 0
    assert "llama3.1-8b" in out and "deepseek-v3" in out
    assert "671" in out  # deepseek-v3 total params in billions


def test_models_show(capsys):
    code, out, _ = run(capsys, "models", "show", "deepseek-v3")
    assert code == 0
    for text in ("num_layers", "moe.num_experts", "mla.kv_lora_rank", "total params", "active params", "source"):
        assert text in out, text


def test_hardware_list(capsys):
    code, out, _ = run(capsys, "hardware", "list")
    assert code == 0
    assert "h100-sxm" in out and "989.4" in out and "$/GPU-h" in out


def test_hardware_show_prints_sources(capsys):
    code, out, _ = run(capsys, "hardware", "show", "h100-sxm")
    assert code == 0
    assert "datasheet" in out  # the source of the peak numbers
    assert "989.4" in out and "TFLOP/s" in out and "GiB" in out
    # and what plan uses without --calibration: the public calibration's factors, or the defaults alone
    from meshplan.hardware_db.calibration import public_log_factors

    gemm = math.exp(public_log_factors("h100-sxm")["gemm"])  # type: ignore[index]
    assert f"plans it under public-h100-sxm: gemm x {gemm:.3f}" in " ".join(out.split())
    code, out, _ = run(capsys, "hardware", "show", "l4")
    assert code == 0 and "ships no public calibration" in " ".join(out.split())


def test_help_and_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("meshplan ")
    code, out, _ = run(capsys, "estimate", "--help")
    assert code == 0
    for text in ("--gbs", "in sequences", "Gb/s", "GB/s", "--recompute", "--runtime", "megatron-core"):
        assert text in out, text


# ---- bad input: one line on stderr, exit 2, no traceback -----------------------------------------------------------

def test_unknown_gpu(capsys):
    assert_input_error(*run(capsys, "estimate", "--model", "llama3.1-8b", "--gpu", "h999", "--gpus", "8"), "h999")


def test_unknown_model(capsys):
    assert_input_error(*run(capsys, "estimate", "--model", "llama9-1t", "--gpu", "h100-sxm", "--gpus", "8"),
                       "llama9-1t")
    assert_input_error(*run(capsys, "models", "show", "llama9-1t"), "llama9-1t")


def test_malformed_model_json(capsys, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"name": "x", "layers": 4,')
    assert_input_error(*run(capsys, "estimate", "--model", str(bad), "--gpu", "h100-sxm", "--gpus", "8"), "JSON")


def test_unknown_model_type(capsys, tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "mamba", "hidden_size": 768, "num_hidden_layers": 24}))
    assert_input_error(*run(capsys, "estimate", "--model", str(cfg), "--gpu", "h100-sxm", "--gpus", "8"), "mamba")


@pytest.mark.parametrize("flag,value", [("--gpus", "0"), ("--gbs", "-1"), ("--tp", "0"), ("--seq", "0"),
                                        ("--mbs", "-2"), ("--zero", "4")])
def test_non_positive_sizes(capsys, flag, value):
    args = ["estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", flag, value]
    assert_input_error(*run(capsys, *args), flag)


def test_tp_not_dividing_heads(capsys):
    # 24 GPUs so that tp=3 divides the GPU count; the 32 heads of llama3.1-8b are the failing rule
    assert_input_error(*run(capsys, *SMALL[:5], "--gpus", "24", "--gbs", "48", "--tp", "3"), "--tp 3", "32")


def test_tp_pp_not_dividing_gpus(capsys):
    assert_input_error(*run(capsys, *SMALL, "--tp", "4", "--pp", "4"), "divide", "8 GPUs")


def test_cluster_file_missing_field(capsys, tmp_path):
    f = tmp_path / "cluster.toml"
    f.write_text('gpu = "h100-sxm"\ngpus_per_node = 8\n')
    assert_input_error(*run(capsys, "estimate", "--model", "llama3.1-8b", "--cluster", str(f)), "num_gpus")


@pytest.mark.parametrize("args", [
    ["estimate", "--gpu", "h100-sxm", "--gpus", "8"],  # --model missing
    ["estimate", "--model", "llama3.1-8b"],  # no cluster
    ["estimate", "--model", "llama3.1-8b", "--cluster", "nowhere.toml"],
    ["estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--dtype", "fp4"],
    ["estimate", "--model", "llama3.1-8b", "--gpu", "a100-80gb", "--gpus", "8", "--dtype", "fp8"],
    ["estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "12"],
    ["estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "12"],
    ["estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gpus-per-node", "3"],
    ["estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--ep", "2"],
    ["hardware", "show", "nope"],
    ["estimate", "--bogus"],
])
def test_other_bad_input(capsys, args):
    assert_input_error(*run(capsys, *args))


def test_fp8_recipe_and_runtime_options_bad_input(capsys):
    assert_input_error(*run(capsys, *SMALL, "--fp8-recipe", "mxfp8"), "--fp8-recipe", "--dtype fp8")
    assert_input_error(*run(capsys, *SMALL, "--runtime", "megatron-core+bogus"), "+bogus", "+compile")
    assert_input_error(*run(capsys, *SMALL, "--runtime", "nemo"), "nemo", "megatron-core")
    plan = ["plan", *SMALL[1:], "--pp", "2", "--schedule", "gpipe"]
    assert_input_error(*run(capsys, *plan), "megatron-core has no gpipe", "--runtime")


def test_real_process_one_line_error_and_version():
    cmd = [sys.executable, "-m", "meshplan.cli.main"]
    p = subprocess.run([*cmd, "estimate", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "0"],
                       capture_output=True, text=True, cwd=ROOT)
    assert_input_error(p.returncode, p.stdout, p.stderr, "--gpus")
    p = subprocess.run([*cmd, "estimate", "--model", "nope", "--gpu", "h100-sxm", "--gpus", "8"],
                       capture_output=True, text=True, cwd=ROOT)
    assert_input_error(p.returncode, p.stdout, p.stderr, "nope")
    p = subprocess.run([*cmd, "--version"], capture_output=True, text=True, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.startswith("meshplan ")


def _imported(*args: str) -> set[str]:
    """The modules a real `meshplan ARGS` process imports (python -X importtime writes one line per module)."""
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "meshplan.cli.main", *args], capture_output=True,
                       text=True, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")}


def test_a_command_imports_only_what_it_uses():
    """Start-up (issue 49): `--version` and the command list import no library (no pydantic, numpy or cost model);
    `plan` imports no networkx (links come from the two levels: hardware_db/cluster.py), OR-Tools, torch, launcher
    (without --export) or the other commands' modules."""
    for args in (["--version"], ["--help"]):
        heavy = {m for m in _imported(*args) if m.split(".")[0] in ("pydantic", "numpy", "networkx", "torch", "rich")
                 or m.startswith(("meshplan.costmodels", "meshplan.planner", "meshplan.cli.options"))}
        assert heavy == set(), (args, sorted(heavy)[:10])
    modules = _imported("plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16")
    assert "meshplan.planner.search" in modules  # the check sees what it should
    unused = {m for m in modules if m.split(".")[0] in ("networkx", "ortools", "torch", "matplotlib")
              or m in ("meshplan.cli.serve", "meshplan.cli.launch", "meshplan.cli.catalog", "meshplan.cli.compare")
              or m.startswith("meshplan.planner.launchers.") and m != "meshplan.planner.launchers.common"}
    assert unused == set(), sorted(unused)[:10]


def test_a_bare_command_prints_its_help(capsys):
    """`meshplan` and `meshplan models` alone print their usage and the commands (exit 0); they printed nothing."""
    from meshplan.cli.main import COMMANDS, main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Usage: meshplan") and all(name in out for name in COMMANDS)
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert "Usage:" in out and "list" in out and "show" in out


def test_every_listed_command_loads():
    """The command list in cli/main.py is the app's registration: each entry imports and builds, and its help runs
    (a command missing from the table would not exist)."""
    from meshplan.cli.main import COMMANDS, load_command, main

    for name in COMMANDS:
        command = load_command(name)
        assert command.name == ("" if name in ("models", "hardware") else name)  # the groups are named by the table
        assert main([name, "--help"]) == 0, name


def test_interleaved_stage_labels_list_every_chunk(capsys, monkeypatch):
    """With virtual stages a rank holds separate layer ranges; the memory table names each of them."""
    monkeypatch.setenv("COLUMNS", "300")  # one line per header cell
    code, out, err = run(capsys, "estimate", "--model", "llama3.1-70b", "--gpu", "h100-sxm", "--gpus", "64",
                         "--tp", "4", "--pp", "4", "--vpp", "5", "--gbs", "256", "--seq", "8192")
    assert code == 0, err
    assert "rank 0, layers 0-3, 16-19, 32-35, 48-51, 64-67" in " ".join(out.split())
