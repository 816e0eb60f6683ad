"""The cost model's expert dispatch beside DeepEP's measured kernels (issue 44 item 5: "dispatch from the measured MoE
and DeepEP tables").

AIConfigurator (the optional extra meshplan[aic]) ships SGLang's measurements of DeepEP's normal (prefill and
training) kernels per GPU: `systems/data/<system>/comm/sglang/<version>/wideep_deepep_normal_perf.parquet` (each
node count from the newest version that measured it), one row per node count, hidden size, tokens per GPU, top-k,
expert count and SM budget, with the dispatch and combine times. The combine moves BF16 (the dispatch FP8 in
SGLang), so it is compared with the cost model's all-to-all of the same BF16 buffer (tokens x top-k x hidden x 2
bytes, costmodels/comm.py all_to_all with DeepEP's per-node deduplication), on rows a training step sees: 2K-32K
tokens per GPU, top-k >= 4, the largest SM budget measured at each node count.

Printed per GPU, node count and top-k: the median of measured / predicted (above 1: the kernel is slower than the
model). Also what the model would give if it deduplicated per GPU as well (DeepEP sends a token once to each GPU
holding any of its experts: rank share n (1 - (1 - 1/n)^k) / k of the NVLink bytes), on one node only.

    pip install 'meshplan[aic]' && python benchmarks/deepep_tables.py
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshplan.costmodels import comm
from meshplan.costmodels.kernel_tables import SYSTEMS, aic_package
from meshplan.costmodels.timing import group_link
from meshplan.hardware_db.cluster import Cluster, ClusterSpec

TABLE = "wideep_deepep_normal_perf.parquet"
TOKENS = (2048, 32768)  # tokens per GPU of a training micro-batch's MoE layer
MIN_TOP_K = 4
BF16 = 2


def rank_share(top_k: int, ranks: int) -> float:
    """NVLink bytes of a dispatch sent once per GPU hit over one sent per expert copy."""
    return ranks * (1 - (1 - 1 / ranks) ** top_k) / top_k


def table_rows(system: str) -> tuple[list[dict], str]:
    """The rows of every version's table, each node count from the newest version that measured it."""
    import pyarrow.parquet as pq
    from packaging.version import Version

    folder = aic_package().joinpath("systems", "data", system, "comm", "sglang")
    if not folder.is_dir():
        return [], ""
    versions = sorted((v.name for v in folder.iterdir() if v.joinpath(TABLE).is_file()), key=Version, reverse=True)
    rows: list[dict] = []
    used = []
    for version in versions:
        seen = {r["node_num"] for r in rows}
        new = [r for r in pq.read_table(folder.joinpath(version, TABLE)).to_pylist() if r["node_num"] not in seen]
        if new:
            rows += new
            used.append(version)
    return rows, f"{system}/comm/sglang/{'+'.join(used)}"


def compare(gpu: str, system: str) -> list[str]:
    rows, source = table_rows(system)
    if not rows:
        return [f"{gpu}: no DeepEP normal table in the installed aiconfigurator-core"]
    sms = {}  # node count -> the largest SM budget measured there
    for r in rows:
        sms[r["node_num"]] = max(sms.get(r["node_num"], 0), r["combine_sms"])
    groups: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for r in rows:
        if (r["combine_sms"] != sms[r["node_num"]] or not TOKENS[0] <= r["num_token"] <= TOKENS[1]
                or r["num_topk"] < MIN_TOP_K):
            continue
        nodes, k = int(r["node_num"]), int(r["num_topk"])
        n = 8 * nodes
        link = group_link(Cluster(ClusterSpec(gpu=gpu, num_gpus=n, gpus_per_node=8)), tuple(range(n)))
        predicted = comm.all_to_all(r["num_token"] * k * r["hidden_size"] * BF16, n, link, dedup_top_k=k)
        measured = r["combine_transmit_us"] * 1e-6
        groups.setdefault((nodes, k), []).append((measured / predicted,
                                                  measured / (predicted * rank_share(k, n)) if nodes == 1 else 0.0))
    out = [f"{gpu} ({source}):"]
    for (nodes, k), ratios in sorted(groups.items()):
        line = (f"  {nodes} node(s) of 8, top {k:2d}, {sms[nodes]} SMs: measured / predicted "
                f"{statistics.median(r for r, _ in ratios):.2f} ({len(ratios)} rows)")
        if nodes == 1:
            line += f"; deduplicated per GPU {statistics.median(d for _, d in ratios):.2f}"
        out.append(line)
    return out


def main() -> int:
    for gpu, system in SYSTEMS.items():
        if gpu == "a100-80gb":
            continue  # no DeepEP (Hopper and later)
        print("\n".join(compare(gpu, system)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
