"""Write Megatron-LM logs from the step times NVIDIA's own CI measured, for examples/logs/ (issue 44: calibrate on a
Megatron-LM log, in the real format).

Megatron-LM's functional tests keep, per test case, the arguments (`model_config.yaml`, MODEL_ARGS) and the values
its CI measured on each platform (`golden_values_dev_dgx_h100.json`: iteration-time in seconds and
mem-max-allocated-bytes per step); the recipes run them on one DGX H100 node of 8 GPUs
(`tests/test_utils/recipes/h100/gpt.yaml`) and on two GB200 trays of 4 (`recipes/gb200/gpt.yaml`). This script
renders those as the rank-0 stdout Megatron prints: the arguments block of `megatron/training/arguments.py`
`_print_args` and the iteration lines of `megatron/training/training.py` `training_log`, with `report_memory`'s
line. Only what the test case states is printed: the block holds MODEL_ARGS (as argparse names) and the world size,
and the lines leave out what the golden values lack (timestamps, learning rate, throughput, grad norm). The files
say so in their first lines.

    python benchmarks/megatron_ci_logs.py --megatron /path/to/Megatron-LM [--commit d98e8a6...]
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMMIT = "d98e8a64ddf34856e74b24714e3bedb2f5a39553"  # NVIDIA/Megatron-LM main, 2026-08-22
CASES = {  # test case -> the log file it becomes (with the platform)
    "gpt3_7b_tp4_pp1_memory_speed": "megatron-gpt3-7b-tp4-pp1-{platform}.log",
    "gpt3_7b_tp1_pp4_memory_speed": "megatron-gpt3-7b-tp1-pp4-vpp8-{platform}.log",
}
# platform -> (golden values suffix, where the recipe runs it); 8 GPUs on both
PLATFORMS = {"h100": ("dgx_h100", "one DGX H100 node of 8 GPUs (tests/test_utils/recipes/h100/gpt.yaml)"),
             "gb200": ("dgx_gb200", "two GB200 trays of 4 GPUs (tests/test_utils/recipes/gb200/gpt.yaml)")}
WORLD = 8
MB = 2**20


def git_show(repo: Path, commit: str, path: str) -> str:
    return subprocess.run(["git", "--git-dir", str(repo), "show", f"{commit}:{path}"], check=True,
                          capture_output=True, text=True).stdout


def argument_block(model_args: dict[str, object], world: int = WORLD) -> list[str]:
    """The `_print_args` block for these flags: `  name <dots to 48> value`, sorted case-insensitively."""
    values: dict[str, object] = {}
    for flag, value in model_args.items():
        name = flag.lstrip("-").replace("-", "_")
        if name.startswith("no_") and value is True:  # Megatron's --no-X flags store False in X
            name, value = name[3:], False
        values[name] = value
    values["world_size"] = world
    lines = [f"  {name} {'.' * (48 - len(name))} {_printed(value)}" for name, value in values.items()]
    return ["------------------------ arguments ------------------------",
            *sorted(lines, key=str.lower),
            "-------------------- end of arguments ---------------------"]


def _printed(value: object) -> str:
    return str(value) if not isinstance(value, float) or value != int(value) else repr(value)


def iteration_lines(golden: dict, model_args: dict[str, object]) -> list[str]:
    times = {int(k): float(v) for k, v in golden["iteration-time"]["values"].items() if v != "nan"}
    losses = {int(k): float(v) for k, v in golden["lm loss"]["values"].items()}
    peaks = {int(k): float(v) for k, v in golden["mem-max-allocated-bytes"]["values"].items() if v != "nan"}
    held = {int(k): float(v) for k, v in golden["mem-allocated-bytes"]["values"].items() if v != "nan"}
    batch, iters = int(model_args["--global-batch-size"]), int(model_args["--train-iters"])  # type: ignore[call-overload]
    out = []
    for step in sorted(times):
        if math.isnan(times[step]):
            continue
        out.append(f" iteration {step:8d}/{iters:8d} | consumed samples: {step * batch:12d} | elapsed time per "
                   f"iteration (ms): {times[step] * 1000.0:.1f} | global batch size: {batch:5d} | lm loss: "
                   f"{losses[step]:.6E} |")
        if step == min(times):
            out.append(f"[Rank 0] (after {step} iterations) memory (MB) | allocated: {held[step] / MB:.2f} | max "
                       f"allocated: {peaks[step] / MB:.2f}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megatron", type=Path, required=True, help="a Megatron-LM clone (its .git directory)")
    parser.add_argument("--commit", default=COMMIT)
    parser.add_argument("--out", type=Path, default=ROOT / "examples" / "logs")
    a = parser.parse_args()
    for platform, (suffix, where) in PLATFORMS.items():
        for case, name in CASES.items():
            base = f"tests/functional_tests/test_cases/gpt/{case}"
            config = yaml.safe_load(git_show(a.megatron, a.commit, f"{base}/model_config.yaml"))
            golden = json.loads(git_show(a.megatron, a.commit, f"{base}/golden_values_dev_{suffix}.json"))
            header = [
                f"# meshplan examples/logs: rendered by benchmarks/megatron_ci_logs.py in Megatron-LM's stdout "
                f"format (training.py training_log, arguments.py _print_args at {a.commit[:7]})",
                f"# from the values NVIDIA's CI measured: https://github.com/NVIDIA/Megatron-LM/tree/{a.commit}/{base} "
                f"(model_config.yaml, golden_values_dev_{suffix}.json), {where}.",
                "# The arguments block holds MODEL_ARGS only; the iteration lines leave out what the golden values "
                "lack.",
            ]
            text = "\n".join(header + argument_block(config["MODEL_ARGS"])
                             + iteration_lines(golden, config["MODEL_ARGS"]))
            path = a.out / name.format(platform=platform)
            path.write_text(text + "\n", encoding="utf-8")
            print(f"wrote {path}")


if __name__ == "__main__":
    main()
