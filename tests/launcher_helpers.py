"""Plans for the launcher tests: the golden configurations and small pinned ones."""

from __future__ import annotations

from meshplan.costmodels.config import ParallelConfig, Workload
from meshplan.costmodels.estimate import simulate_config
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import load_zoo
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.planner.builders import build_plan
from meshplan.planner.plan import Plan

# Llama 3 paper (Dubey et al. 2024, table 4 and section 3.3.2): 16,384 H100, TP8 CP1 PP16 DP128, sequence 8,192,
# 16M tokens per batch (2,048 sequences); one layer fewer on the first and the last stage (126 = 7 + 14*8 + 7).
LLAMA_405B = ("llama3.1-405b", "h100-sxm", 16384, Workload(global_batch=2048, seq_len=8192))
LLAMA_405B_STAGES = (7,) + (8,) * 14 + (7,)
# DeepSeek-V3 report (arXiv:2412.19437, section 3.2): 2,048 H800, PP16, EP64 over 8 nodes, ZeRO-1 DP, no TP;
# sequence 4,096, batch 15,360 sequences at the end of the ramp. 61 layers over 16 stages: 3 + 14*4 + 2.
DEEPSEEK_V3 = ("deepseek-v3", "h800", 2048, Workload(global_batch=15360, seq_len=4096))
DEEPSEEK_V3_STAGES = (3,) + (4,) * 14 + (2,)


def make_plan(model: str | ModelSpec, gpu: str, gpus: int, workload: Workload, config: ParallelConfig,
              runtime: str = "megatron-core") -> Plan:
    spec = load_zoo(model) if isinstance(model, str) else model
    cluster = Cluster(ClusterSpec(gpu=gpu, num_gpus=gpus))
    sim = simulate_config(spec, cluster, workload, config, runtime)
    return build_plan(spec, cluster, workload, config, sim, runtime)


def llama_405b(**knobs) -> Plan:
    model, gpu, gpus, wl = LLAMA_405B
    config = dict(tp=8, pp=16, mbs=1, zero=1, stage_layers=LLAMA_405B_STAGES) | knobs
    return make_plan(model, gpu, gpus, wl, ParallelConfig(**config))


def deepseek_v3(**knobs) -> Plan:
    model, gpu, gpus, wl = DEEPSEEK_V3
    config = dict(tp=1, pp=16, ep=64, mbs=1, zero=1, stage_layers=DEEPSEEK_V3_STAGES) | knobs
    return make_plan(model, gpu, gpus, wl, ParallelConfig(**config))


def flags(argv: list[str]) -> dict[str, str | bool]:
    """--flag value pairs of an argument list (a switch maps to True)."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        if argv[i].startswith("--"):
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[argv[i]] = argv[i + 1]
                i += 2
                continue
            out[argv[i]] = True
        i += 1
    return out
