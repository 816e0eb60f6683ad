"""Predicted vs published throughput for every run in ../shared/reference_runs/training_dev.yaml.

Usage:  python benchmarks/reference_runs.py [--yaml PATH] [--markdown]

Each run is estimated with its published configuration; knobs the entry leaves unknown take the value from the
authors' own launch scripts where those exist (cited below) and otherwise Megatron-LM's defaults. The prediction is
converted to the entry's own metric with the entry's own FLOPs accounting before comparing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from costmodels.config import ParallelConfig, Workload  # noqa: E402
from costmodels.estimate import Efficiency, estimate  # noqa: E402
from costmodels.model import ModelSpec  # noqa: E402
from hardware_db.cluster import Cluster, ClusterSpec  # noqa: E402

DEFAULT_YAML = ROOT.parent / "shared" / "reference_runs" / "training_dev.yaml"

# Micro-batch size and layers per virtual stage of the SC'21 Table 1 runs: NVIDIA/Megatron-LM
# examples/sc21/run_table_1.sh (MBS, --num-layers-per-virtual-pipeline-stage), keyed by layer count.
SC21_SCRIPT = {24: (16, None), 30: (16, None), 36: (16, None), 40: (8, None), 48: (4, None), 60: (2, 5),
               80: (2, 5), 96: (1, 3), 105: (1, 1), 128: (1, None)}

GPU_NAMES = {"A100 80GB": "a100-80gb", "H100 80GB": "h100-sxm"}


@dataclass(frozen=True)
class Row:
    id: str
    metric: str
    published: float
    predicted: float
    step_time_s: float
    mfu: float

    @property
    def error(self) -> float:
        return (self.predicted - self.published) / self.published


def gpu_name(text: str) -> str:
    for key, name in GPU_NAMES.items():
        if key in text:
            return name
    raise ValueError(f"no hardware_db GPU for '{text}'")


def megatron_gpt(entry: dict) -> ModelSpec:
    """Megatron's GPT: GELU MLP (4h unless stated), LayerNorm, biases, learned positions, tied embeddings."""
    m = entry["model"]
    tied = not entry["id"].startswith("mcore-")  # Megatron-Core benchmark GPTs are untied (param counts say so)
    return ModelSpec(name=entry["id"], num_layers=m["layers"], hidden=m["hidden"], num_heads=m["heads"],
                     num_kv_heads=m.get("kv_heads") or m["heads"], ffn_hidden=m.get("ffn_hidden") or 4 * m["hidden"],
                     mlp="gelu", vocab=m["vocab"], tied_embeddings=tied, norm="layernorm", qkv_bias=True,
                     linear_bias=True, learned_positions=True, max_seq_len=m["seq_len"])


def megatron_flops(entry: dict, global_batch: int, recompute_forward: bool) -> float:
    """FLOPs per iteration as Megatron counts them: 72 B s l h^2 (1 + s/6h + V/12lh) (Korthikanti et al. Eq. 7;
    Megatron-LM training.py), or 96 B s l h^2 (1 + s/6h + V/16lh) when the recomputed forward is counted
    (Narayanan et al. SC'21, Eq. 3)."""
    m = entry["model"]
    b, s, l, h, v = global_batch, m["seq_len"], m["layers"], m["hidden"], m["vocab"]
    if recompute_forward:
        return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
    return 72 * b * s * l * h * h * (1 + s / (6 * h) + v / (12 * l * h))


def configure(entry: dict) -> tuple[Cluster, Workload, ParallelConfig, str]:
    m, p, hw, bt = entry["model"], entry["parallel"], entry["hardware"], entry["batch"]
    cluster = Cluster(ClusterSpec(gpu=gpu_name(hw["gpu"]), num_gpus=hw["num_gpus"], gpus_per_node=hw["gpus_per_node"]))
    recompute_text = str(p.get("activation_recompute") or "none")
    recompute = "full" if "full" in recompute_text else "selective" if "selective" in recompute_text else "none"
    mbs, vpp = bt.get("micro_batch"), p.get("vp")
    if entry["id"].startswith("megatron-sc21"):
        mbs, layers_per_virtual = SC21_SCRIPT[m["layers"]]
        if layers_per_virtual:
            vpp = m["layers"] // p["pp"] // layers_per_virtual
    # Not published for korthikanti-530b-...-dp8: the DP=1 run's batch per replica, times DP (an assumption).
    global_batch = bt.get("global_batch_seqs") or 280 * p["dp"]
    mbs = mbs or 1  # Megatron-LM's --micro-batch-size when a run does not state it
    vpp = vpp or 1
    runtime = "megatron-core" if entry["id"].startswith("mcore-") else "megatron-2022"
    zero = 1 if (p.get("distributed_optimizer") or runtime == "megatron-core") else 0
    sp = bool(p.get("sequence_parallel")) if p.get("sequence_parallel") is not None else runtime == "megatron-core"
    wl = Workload(global_batch=global_batch, seq_len=m["seq_len"], dtype="bf16")
    cfg = ParallelConfig(tp=p["tp"], pp=p["pp"], vpp=vpp, dp=p["dp"], cp=p.get("cp") or 1, mbs=mbs, zero=zero,
                         recompute=recompute, sp=sp and p["tp"] > 1)
    return cluster, wl, cfg, runtime


def evaluate(entry: dict, efficiency: Efficiency | None = None) -> Row:
    """Predict one run (with the GPU's default efficiencies unless given) in the run's own metric."""
    cluster, wl, cfg, runtime = configure(entry)
    est = estimate(megatron_gpt(entry), cluster, wl, cfg, runtime=runtime, efficiency=efficiency)
    metric = entry["metric"]
    gpus = cluster.num_gpus
    if metric.get("iteration_time_s"):
        return Row(entry["id"], "iteration s", metric["iteration_time_s"], est.step_time_s, est.step_time_s, est.mfu)
    if metric.get("tflops_per_gpu"):
        counts_recompute = "Eq.3" in str(metric.get("flops_accounting", ""))
        flops = megatron_flops(entry, wl.global_batch, counts_recompute)
        return Row(entry["id"], "TFLOP/s/GPU", metric["tflops_per_gpu"], flops / est.step_time_s / gpus / 1e12,
                   est.step_time_s, est.mfu)
    peak = entry["hardware"]["peak_tflops_bf16_dense"] * 1e12
    mfu = megatron_flops(entry, wl.global_batch, False) / est.step_time_s / gpus / peak
    return Row(entry["id"], "MFU", metric["mfu"], mfu, est.step_time_s, est.mfu)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--yaml", type=Path, default=DEFAULT_YAML)
    ap.add_argument("--markdown", action="store_true", help="print a markdown table for RESULTS.md")
    args = ap.parse_args()
    entries = yaml.safe_load(args.yaml.read_text())
    rows = [evaluate(e) for e in entries]
    if args.markdown:
        print("| run | metric | published | predicted | error |")
        print("| --- | --- | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r.id} | {r.metric} | {r.published:.4g} | {r.predicted:.4g} | {100 * r.error:+.1f}% |")
    else:
        print(f"{'run':40s} {'metric':12s} {'published':>10s} {'predicted':>10s} {'error':>8s}")
        for r in rows:
            print(f"{r.id:40s} {r.metric:12s} {r.published:10.4g} {r.predicted:10.4g} {100 * r.error:+7.1f}%")
    errors = [abs(r.error) for r in rows]
    kor = [abs(r.error) for r in rows if r.id.startswith("korthikanti") and r.metric == "iteration s"]
    print(f"\nMAPE over {len(rows)} runs: {100 * statistics.mean(errors):.2f}%  (max {100 * max(errors):.2f}%)")
    if kor:
        print(f"Korthikanti iteration times ({len(kor)} runs): mean {100 * statistics.mean(kor):.2f}%, "
              f"max {100 * max(kor):.2f}%  (Calculon: 3.65% mean, 8.87% max)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
