"""The best published MFU of each model class on each GPU family, in meshplan's own accounting: the table the
realism guard (costmodels/realism.py) reads, recomputed from both development sets.

Usage:  python benchmarks/realism_table.py

For every run, the measured step time (from the run's own metric and FLOPs accounting) and meshplan's model
FLOPs (costmodels.estimate.model_flops_per_step: 6 x active parameters + the causal half of attention) give the
run's MFU against the dense peak of its precision; the best per (GPU family, dense/MoE, precision) is printed
with the run that set it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from published_runs import load_runs
from reference_runs import (DEFAULT_YAML, accounted_flops, configure, megatron_flops, megatron_gpt, run_cluster,
                            run_model, run_workload)

from meshplan.costmodels.estimate import model_flops_per_step
from meshplan.costmodels.realism import gpu_family


def first_set() -> list[tuple[str, str, str, str, float]]:
    out = []
    for e in yaml.safe_load(DEFAULT_YAML.read_text()):
        cluster, wl, _, _ = configure(e)
        model = megatron_gpt(e)
        m = e["metric"]
        if m.get("iteration_time_s"):
            step = m["iteration_time_s"]
        elif m.get("tflops_per_gpu"):
            flops = megatron_flops(e, wl.global_batch, "Eq.3" in str(m.get("flops_accounting", "")))
            step = flops / (m["tflops_per_gpu"] * 1e12 * cluster.num_gpus)
        else:
            flops = megatron_flops(e, wl.global_batch, False)
            step = flops / (m["mfu"] * e["hardware"]["peak_tflops_bf16_dense"] * 1e12 * cluster.num_gpus)
        mfu = model_flops_per_step(model, wl) / step / cluster.num_gpus / cluster.gpu.peak_flops("bf16")
        out.append((e["id"], gpu_family(cluster.spec.gpu), "dense", "bf16", mfu))
    return out


def second_set() -> list[tuple[str, str, str, str, float]]:
    out = []
    for run in load_runs():
        model, cluster, wl = run_model(run), run_cluster(run), run_workload(run)
        n = cluster.num_gpus
        if run.metric == "tokens_per_s_per_gpu":
            step = wl.tokens / (run.value * n)
        elif run.metric == "step_time_s":
            step = run.value
        elif run.metric == "samples_per_s":
            step = wl.global_batch / run.value
        elif run.metric == "tflops_per_gpu":
            step = accounted_flops(run, model, wl) / (run.value * 1e12 * n)
        else:
            assert run.mfu_peak_tflops is not None
            step = accounted_flops(run, model, wl) / (run.value * run.mfu_peak_tflops * 1e12 * n)
        mfu = model_flops_per_step(model, wl) / step / n / cluster.gpu.peak_flops(run.dtype if run.dtype != "fp16"
                                                                                  else "fp16")
        out.append((run.id, gpu_family(run.gpu), "moe" if model.moe else "dense", run.dtype, mfu))
    return out


def main() -> int:
    best: dict[tuple[str, str, str], tuple[float, str]] = {}
    for rid, fam, kind, dtype, mfu in first_set() + second_set():
        if fam is None:
            continue
        key = (fam, kind, dtype)
        if key not in best or mfu > best[key][0]:
            best[key] = (mfu, rid)
    print(f"{'family':12s} {'kind':6s} {'dtype':5s} {'best MFU':>8s}  run")
    for (fam, kind, dtype), (mfu, rid) in sorted(best.items()):
        print(f"{fam:12s} {kind:6s} {dtype:5s} {100 * mfu:7.1f}%  {rid}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
