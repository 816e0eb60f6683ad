"""Predicted vs published throughput for every run of both development sets: benchmarks/training_dev.yaml (the
first, copied from the design's shared/reference_runs) and benchmarks/published_runs.yaml (the second).

Usage:  python benchmarks/reference_runs.py [--yaml PATH] [--runs PATH] [--markdown] [--only-second]

Each run is estimated with its published configuration; knobs the entry leaves unknown take the value from the
authors' own launch scripts where those exist (cited below, or in the entry's `assumed`) and otherwise the
framework's defaults. The prediction is converted to the entry's own metric with the entry's own FLOPs accounting
before comparing. The summary gives the MAPE overall and per group (GPU type, dense/MoE, precision, framework,
sequences of 32K tokens or more).
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
sys.path.insert(0, str(ROOT / "benchmarks"))

from published_runs import DEFAULT_FILE, Run, load_runs

from meshplan.costmodels.config import ParallelConfig, StagePolicy, Workload, split_evenly
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.estimate import Estimate, estimate, model_flops_per_step
from meshplan.costmodels.kernels import Physics
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import load_model
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.planner.launchers.megatron import parse_layout

DEFAULT_YAML = ROOT / "benchmarks" / "training_dev.yaml"  # copied from the design's shared/reference_runs

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
    groups: tuple[tuple[str, str], ...] = ()  # (group kind, value): gpu, experts, precision, framework, sequence
    peak_gib: float = 0.0  # predicted peak memory where the source measures it (torchtitan: rank 0's stage)
    published_gib: float | None = None  # the source's peak memory per GPU, where it gives one
    fullest_gib: float = 0.0  # predicted peak memory of the fullest stage: what `fits` compares with the HBM
    hbm_gib: float = 0.0
    comm_share: float = 0.0  # the prediction's exposed communication over its step (exposed_comm_share)

    @property
    def fits(self) -> bool:
        """The estimate's own test (Estimate.fits): the fullest stage within the HBM."""
        return self.fullest_gib <= self.hbm_gib

    @property
    def error(self) -> float:
        """Predicted over published throughput, minus one: positive = the model is optimistic (for a time metric
        the ratio is inverted, so the sign means the same for every metric)."""
        if self.metric in TIME_METRICS:
            return self.published / self.predicted - 1
        return (self.predicted - self.published) / self.published

    @property
    def measured_step_s(self) -> float:
        """The run's measured step time, read off its metric (every metric is throughput or time per step)."""
        return self.step_time_s * (1 + self.error)


TIME_METRICS = ("iteration s", "step s")


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
    b, s, layers, h, v = global_batch, m["seq_len"], m["layers"], m["hidden"], m["vocab"]
    if recompute_forward:
        return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    return 72 * b * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h))


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


def evaluate(entry: dict, efficiency: Efficiency | None = None, physics: Physics | None = None) -> Row:
    """Predict one run (with the GPU's default efficiencies and `physics` unless given) in the run's metric."""
    cluster, wl, cfg, runtime = configure(entry)
    efficiency = efficiency or (Efficiency.from_gpu(cluster.gpu, physics) if physics else None)
    est = estimate(megatron_gpt(entry), cluster, wl, cfg, runtime=runtime, efficiency=efficiency)
    metric = entry["metric"]
    gpus = cluster.num_gpus
    comm = exposed_comm_share(est.breakdown_s, est.step_time_s)
    groups = (("set", "first"), ("gpu", cluster.spec.gpu), ("experts", "dense"), ("precision", "bf16"),
              ("framework", runtime), ("sequence", ">= 32K" if wl.seq_len >= 32768 else "< 32K"))
    if metric.get("iteration_time_s"):
        return Row(entry["id"], "iteration s", metric["iteration_time_s"], est.step_time_s, est.step_time_s, est.mfu,
                   groups, fullest_gib=est.peak_memory_gib, hbm_gib=est.hbm_gib, comm_share=comm)
    if metric.get("tflops_per_gpu"):
        counts_recompute = "Eq.3" in str(metric.get("flops_accounting", ""))
        flops = megatron_flops(entry, wl.global_batch, counts_recompute)
        return Row(entry["id"], "TFLOP/s/GPU", metric["tflops_per_gpu"], flops / est.step_time_s / gpus / 1e12,
                   est.step_time_s, est.mfu, groups, fullest_gib=est.peak_memory_gib, hbm_gib=est.hbm_gib,
                   comm_share=comm)
    peak = entry["hardware"]["peak_tflops_bf16_dense"] * 1e12
    mfu = megatron_flops(entry, wl.global_batch, False) / est.step_time_s / gpus / peak
    return Row(entry["id"], "MFU", metric["mfu"], mfu, est.step_time_s, est.mfu, groups,
               fullest_gib=est.peak_memory_gib, hbm_gib=est.hbm_gib, comm_share=comm)


def exposed_comm_share(breakdown_s: dict[str, float], step_time_s: float) -> float:
    """The share of a predicted step spent waiting on communication: the breakdown's exposed collectives,
    point-to-point and host copies (the "*_comm" entries of costmodels.estimate._breakdown)."""
    return sum(v for k, v in breakdown_s.items() if k.endswith("_comm")) / step_time_s


# ---- the second set (benchmarks/published_runs.yaml) ------------------------------------------------------------

def run_model(run: Run) -> ModelSpec:
    """A zoo model, or a model file of benchmarks/models/ (by path or by its name)."""
    local = ROOT / "benchmarks" / "models" / f"{run.model}.json"
    if run.model.startswith("benchmarks/"):
        return load_model(str(ROOT / run.model))
    return load_model(str(local) if local.exists() else run.model)


def run_config(run: Run, model: ModelSpec) -> ParallelConfig:
    """The run's parallel configuration as meshplan's knobs: uneven first/last stages as stage_layers, a Megatron
    layout string as per-chunk layers, full recomputation of k layers per stage as stage policies."""
    p = run.parallel
    stage_layers = chunk_layers = None
    if p.layout:
        chunks, _, _, _ = parse_layout(p.layout, p.pp)
        chunk_layers = tuple(chunks)
    elif p.first_stage_layers is not None or p.last_stage_layers is not None:
        first = p.first_stage_layers
        last = p.last_stage_layers
        middle = p.pp - (first is not None) - (last is not None)
        rest = model.num_layers - (first or 0) - (last or 0)
        each = rest // middle if middle else 0
        stage_layers = tuple([first if first is not None else each] + [each] * (p.pp - 2)
                             + [last if last is not None else each]) if p.pp > 1 else (model.num_layers,)
        if p.vpp > 1:  # Megatron counts the embedding / loss as a layer of the first / last virtual stage
            chunk_layers = end_light_chunks(stage_layers, p.vpp)
            stage_layers = None
    stage_recompute = None
    if p.recompute == "full" and p.recompute_layers is not None:
        counts = stage_layers
        if counts is None and chunk_layers is not None:
            counts = tuple(sum(chunk_layers[s::p.pp]) for s in range(p.pp))
        if counts is None:
            counts = tuple([model.num_layers // p.pp] * p.pp)
        stage_recompute = tuple(StagePolicy(granularity="full", full_layers=min(p.recompute_layers, n))
                                for n in counts)
    schedule = {"dualpipe": "1f1b"}.get(p.schedule or "", p.schedule)
    return ParallelConfig(tp=p.tp, pp=p.pp, vpp=p.vpp, dp=p.dp, cp=p.cp,
                          cp_comm="a2a" if p.cp_comm == "a2a" else "ring",
                          ep=p.ep, etp=p.etp, mbs=p.mbs, zero=p.zero, recompute=p.recompute, sp=p.sp,
                          schedule=schedule, stage_layers=stage_layers, chunk_layers=chunk_layers,
                          stage_recompute=stage_recompute, rank_order=p.rank_order or "tp-cp-dp-pp",
                          offload_layers=p.offload_layers,
                          **({"recompute_modules": p.recompute_modules} if p.recompute_modules else {}))


def end_light_chunks(stage_layers: tuple[int, ...], vpp: int) -> tuple[int, ...]:
    """Chunk layers (model order) when the first and last stages are lighter than the others: the middle stages'
    per-chunk count k on every chunk, the first stage's deficit taken from its first chunk (which also holds the
    embedding) and the last stage's from its last chunk (which holds the loss), as Megatron's
    --account-for-embedding/loss-in-pipeline-split place them."""
    pp = len(stage_layers)
    k = max(stage_layers) // vpp if pp <= 2 else stage_layers[1] // vpp
    per_stage = []
    for s, n in enumerate(stage_layers):
        row = [k] * vpp
        deficit = k * vpp - n
        where = vpp - 1 if s == pp - 1 and s > 0 else 0
        row[where] -= deficit
        if min(row) < 0 or sum(row) != n:
            row = split_evenly(n, vpp)
        per_stage.append(row)
    return tuple(per_stage[s][c] for c in range(vpp) for s in range(pp))


def accounted_flops(run: Run, model: ModelSpec, wl: Workload) -> float:
    """Model FLOPs of one step as the source counts them (published_runs.FlopsAccounting)."""
    tokens = wl.tokens
    n = model.active_params() - model.embedding_params() + (model.vocab * model.hidden if model.tied_embeddings
                                                            else 0)
    d_qk = model.head_size if model.mla is None else model.mla.qk_head_dim
    d_v = model.head_size if model.mla is None else model.mla.v_head_dim
    full_attention = 6 * model.num_layers * model.num_heads * wl.seq_len * (d_qk + d_v) * tokens
    acc = run.flops_accounting
    if acc == "megatron-causal":
        return model_flops_per_step(model, wl)
    if acc == "6n":
        return 6 * n * tokens
    if acc in ("palm", "megatron"):  # 6N + the attention scores in full (PaLM App. B; Megatron before 2025-03)
        return 6 * n * tokens + full_attention
    raise ValueError(f"{run.id}: flops accounting {acc} is for the first set's GPT runs")


def evaluate_run(run: Run, efficiency: Efficiency | None = None, physics: Physics | None = None,
                 runtime_options: tuple[str, ...] = ()) -> Row:
    """Predict one run of the second set in its own metric; `runtime_options` appended to its runtime (an
    ablation: config.RUNTIME_OPTIONS)."""
    model = run_model(run)
    cluster = run_cluster(run)
    efficiency = efficiency or (Efficiency.from_gpu(cluster.gpu, physics) if physics else None)
    wl = run_workload(run)
    runtime = "+".join([run_runtime(run), *runtime_options])
    est = estimate(model, cluster, wl, run_config(run, model), runtime=runtime, efficiency=efficiency)
    predicted, label = predicted_metric(run, model, wl, est, cluster)
    groups = (("set", "second"), ("gpu", run.gpu), ("experts", "moe" if model.moe is not None else "dense"),
              ("precision", run.dtype), ("framework", run.runtime),
              ("sequence", ">= 32K" if run.seq_len >= 32768 else "< 32K"))
    # torchtitan's published memory is rank 0's log line (run_train.sh LOG_RANK=0; the allocator's max_reserved):
    # the first pipeline stage; other sources state the peak over the job
    memory = est.stages[0].peak_gib if run.runtime == "torchtitan" else max(s.peak_gib for s in est.stages)
    return Row(run.id, label, run.value, predicted, est.step_time_s, est.mfu, groups, memory, run.memory_gib,
               est.peak_memory_gib, est.hbm_gib, exposed_comm_share(est.breakdown_s, est.step_time_s))


def run_cluster(run: Run) -> Cluster:
    return Cluster(ClusterSpec(gpu=run.gpu, num_gpus=run.gpus, gpus_per_node=run.gpus_per_node, nic_gbps=run.nic_gbps))


def run_runtime(run: Run) -> str:
    """The run's runtime preset with the options its recorded features select (config.RUNTIME_OPTIONS): torch.compile
    and async TP in torchtitan; in Megatron-Core a recipe read without TP overlap runs its TP collectives blocking;
    the EP all-to-all overlap; the attention kernel where the source (or the framework version) fixes it."""
    options = []
    f = set(run.features)
    kernels = {"flash-attention-2": "fa2", "flash-attention-3": "fa3", "cudnn-attention": "cudnn-attention"}
    if run.runtime == "torchtitan":
        options += ["compile"] if "torch.compile" in f else []
        options += ["compiled-loss"] if "compiled-loss" in f else []
        options += ["async-tp"] if "async-tp" in f else []
    read = f - set(kernels)  # the recipe's execution flags were read (an attention kernel alone says nothing of TP)
    if run.runtime == "megatron-core" and read and run.parallel.tp > 1 and "tp-comm-overlap" not in f:
        options.append("no-tp-comm-overlap")
    if "ep-a2a-overlap" in f:
        options.append("ep-a2a-overlap")
    if "deepep" in f:
        options.append("deepep")
    if "fp8-dispatch" in f:
        options.append("fp8-dispatch")
    if "sharded-grad-accumulation" in f:
        options.append("reduce-each-microbatch")
    if "sp-regather" in f:
        options.append("sp-regather")
    if "native-gqa" in f:
        options.append("native-gqa")
    if "bf16-grads" in f:
        options.append("bf16-grads")
    options += [opt for feature, opt in kernels.items() if feature in f]
    return "+".join([run.runtime, *options])


def run_workload(run: Run) -> Workload:
    dropout = run.dropout if run.dropout is not None else (None if run.runtime.startswith("megatron-2022") else False)
    return Workload(global_batch=run.global_batch, seq_len=run.seq_len, dtype=run.dtype,
                    fp8_recipe=run.fp8_recipe or "tensorwise", dropout=dropout)


def predicted_metric(run: Run, model: ModelSpec, wl: Workload, est: Estimate, cluster: Cluster) -> tuple[float, str]:
    step = est.step_time_s
    if run.metric == "tokens_per_s_per_gpu":
        return est.tokens_per_s_per_gpu, "tokens/s/GPU"
    if run.metric == "step_time_s":
        return step, "step s"
    if run.metric == "samples_per_s":
        return wl.global_batch / step, "samples/s"
    flops = accounted_flops(run, model, wl) / step / cluster.num_gpus
    if run.metric == "tflops_per_gpu":
        return flops / 1e12, "TFLOP/s/GPU"
    assert run.mfu_peak_tflops is not None
    return flops / (run.mfu_peak_tflops * 1e12), "MFU"


def summary(rows: list[Row]) -> list[tuple[str, str, int, float, float]]:
    """(group kind, value, runs, MAPE, mean signed error) overall and per group."""
    out = [("all", "", len(rows), statistics.mean(abs(r.error) for r in rows),
            statistics.mean(r.error for r in rows))]
    kinds: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        for k, v in r.groups:
            kinds.setdefault((k, v), []).append(r)
    for (k, v), rs in sorted(kinds.items()):
        out.append((k, v, len(rs), statistics.mean(abs(r.error) for r in rs), statistics.mean(r.error for r in rs)))
    return out


def all_rows(yaml_path: Path = DEFAULT_YAML, runs_path: Path = DEFAULT_FILE, first: bool = True,
             physics: Physics | None = None, runtime_options: tuple[str, ...] = ()) -> list[Row]:
    """Both sets' rows, each run at its GPU's default efficiencies with `physics` (all terms on unless given); the
    second set's with `runtime_options` appended (the first set's 2021-22 runtime has none of these terms)."""
    rows = [evaluate(e, physics=physics) for e in yaml.safe_load(yaml_path.read_text())] if first else []
    return rows + [evaluate_run(r, physics=physics, runtime_options=runtime_options) for r in load_runs(runs_path)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--yaml", type=Path, default=DEFAULT_YAML, help="the first set")
    ap.add_argument("--runs", type=Path, default=DEFAULT_FILE, help="the second set (published_runs.py schema)")
    ap.add_argument("--only-second", action="store_true")
    ap.add_argument("--markdown", action="store_true", help="print markdown tables for RESULTS.md")
    args = ap.parse_args()
    rows = all_rows(args.yaml, args.runs, first=not args.only_second)
    if args.markdown:
        print("| run | metric | published | predicted | error | fits |")
        print("| --- | --- | ---: | ---: | ---: | --- |")
        for r in rows:
            print(f"| {r.id} | {r.metric} | {r.published:.4g} | {r.predicted:.4g} | {100 * r.error:+.1f}% | "
                  f"{'yes' if r.fits else 'NO'} |")
    else:
        print(f"{'run':52s} {'metric':12s} {'published':>10s} {'predicted':>10s} {'error':>8s}")
        for r in rows:
            print(f"{r.id:52s} {r.metric:12s} {r.published:10.4g} {r.predicted:10.4g} {100 * r.error:+7.1f}%"
                  f"{'' if r.fits else '  DOES NOT FIT'}")
    errors = [abs(r.error) for r in rows]
    print(f"\nMAPE over {len(rows)} runs: {100 * statistics.mean(errors):.2f}%  (max {100 * max(errors):.2f}%); "
          f"error > 0: predicted faster than measured; {sum(not r.fits for r in rows)} published configurations "
          f"predicted not to fit")
    kor = [abs(r.error) for r in rows if r.id.startswith("korthikanti") and r.metric == "iteration s"]
    if kor:
        print(f"Korthikanti iteration times ({len(kor)} runs): mean {100 * statistics.mean(kor):.2f}%, "
              f"max {100 * max(kor):.2f}%  (Calculon: 3.65% mean, 8.87% max)")
    print("\n| group | runs | MAPE | mean signed error |" if args.markdown else "")
    if args.markdown:
        print("| --- | ---: | ---: | ---: |")
    for kind, value, n, mape, signed in summary(rows):
        label = f"{kind} {value}".strip()
        print(f"| {label} | {n} | {100 * mape:.1f}% | {100 * signed:+.1f}% |" if args.markdown
              else f"{label:32s} {n:4d} runs  MAPE {100 * mape:5.1f}%  mean {100 * signed:+6.1f}%")
    memory = [r for r in rows if r.published_gib]
    if memory:  # the memory model, which decides what the search calls fitting
        print(f"\nPeak memory per GPU where the source gives it ({len(memory)} runs; predicted / published - 1):")
        for r in memory:
            error = 100 * (r.peak_gib / r.published_gib - 1)
            print(f"| {r.id} | {r.published_gib:.1f} | {r.peak_gib:.1f} | {error:+.1f}% |"
                  if args.markdown else f"{r.id:52s} {r.published_gib:6.1f} GiB  predicted {r.peak_gib:6.1f}  "
                  f"{100 * (r.peak_gib / r.published_gib - 1):+6.1f}%")
        print(f"memory MAPE {100 * statistics.mean(abs(r.peak_gib / r.published_gib - 1) for r in memory):.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
