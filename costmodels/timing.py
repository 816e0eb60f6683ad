"""Operator and collective times on the cluster: the roofline with achieved efficiency, the rank groups of each
parallel dimension and the links they cross."""

from __future__ import annotations

from typing import NamedTuple

from meshplan.costmodels import comm
from meshplan.costmodels.calibrate import interpolate
from meshplan.costmodels.config import DEFAULT_RANK_ORDER, Layout, Workload
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.kernels import (SDPA_FLASH_OVER_FA2, attention_keys_factor, causal_tile_factor,
                                         fp8_kernel_ceiling, k_depth_factor)
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.ops import ACT_BYTES, Collective
from meshplan.hardware_db.cluster import Cluster

RANK_ORDER = tuple(DEFAULT_RANK_ORDER.split("-"))  # innermost first: Megatron-LM's default "tp-cp-ep-dp-pp"


# ---- operator and collective times -------------------------------------------------------------------------------

class KernelShape(NamedTuple):
    """What besides FLOPs and bytes sets an operator's kernel efficiency (op_time's docstring says how each does). A
    NamedTuple: the pass cache builds three per operator, and a tuple is the cheapest immutable value to build."""

    depth: float = 0.0  # the pass's inner GEMM dimension (the k-depth ramp)
    groups: float = 1.0  # expert GEMMs in one grouped kernel
    fp8: str | None = None  # the FP8 recipe of an FP8 GEMM
    keys: float = 0.0  # attention: keys per query (the causal tile factor)
    kernel: str = "fused"  # attention kernel
    bandwidth_factor: float = 1.0  # a memory-bound kernel's share of the fused-kernel bandwidth
    chunks: float = 1.0  # a GEMM split to overlap a TP collective
    streams: int = 0  # grouped GEMM as one GEMM per group on this many streams (0: one grouped kernel)


def op_time(flops: float, bytes_: float, kind: str, peak: float, hbm: float, eff: Efficiency,
            backward: bool = False, shape: KernelShape = KernelShape()) -> float:
    """Roofline: max(FLOPs / (peak x efficiency), bytes / achieved bandwidth) + launch overhead (Williams et al.,
    "Roofline", CACM 2009). Efficiency = ceiling x F / (F + F_half) x shape factors (kernels.py): F is the kernel's
    FLOPs (a grouped kernel of `groups` expert GEMMs saturates on all of them, under the grouped ceiling),
    `depth` the pass's inner dimension (the k-depth ramp), `fp8` the recipe of an FP8 GEMM (its ceiling is a
    fraction of the FP8 `peak`), attention by pass and `kernel` with the causal tile factor at `keys`. Memory-bound
    operators run at the framework kernel's `bandwidth_factor` of the GPU's fused-kernel bandwidth. A GEMM split
    into `chunks` to overlap a TP collective (kernels.tp_gemm_chunks) runs at the efficiency of one chunk. A
    grouped GEMM run as one GEMM per group on `streams` streams (0: one grouped kernel) saturates on `streams`
    groups' FLOPs and takes at least one launch per group (kernels.TE_GEMM_STREAMS).
    Calibrated: the measured time at these FLOPs (calibrate.interpolate, the backward curve for backward passes;
    it includes the launch), never below the memory roof. `peak` above the 16-bit one (fp8) shortens a calibrated
    GEMM by the same factor."""
    if flops <= 0 and bytes_ <= 0:
        return 0.0
    depth, groups, fp8, keys, kernel = shape.depth, shape.groups, shape.fp8, shape.keys, shape.kernel
    bandwidth_factor, chunks, streams = shape.bandwidth_factor, shape.chunks, shape.streams
    ph = eff.physics
    t_mem = bytes_ / (hbm * eff.memory_bandwidth * (bandwidth_factor if ph.memory_kernels else 1.0))
    if flops > 0:
        if kind == "attention":
            curve = (eff.attention_bwd_curve if backward else None) or eff.attention_curve
        else:
            curve = (eff.gemm_bwd_curve if backward else None) or eff.gemm_curve
        if curve is not None:
            at = flops * (eff.curve_peak / peak if eff.curve_peak else 1.0)
            return max(interpolate(curve[0], curve[1], at), t_mem + eff.kernel_overhead_s)
        grouped = groups > 1 and ph.grouped_gemm
        # a grouped GEMM is one launch whose tiles from all groups fill the GPU together, so it saturates on its
        # total FLOPs (TE's CUTLASS grouped GEMM reaches dense efficiency at 8-16 groups; TE PR #2045)
        one = flops / (chunks if ph.overlap_limits else 1.0)
        launches = 0.0
        if grouped and streams > 0:  # one GEMM per expert, `streams` at a time (kernels.TE_GEMM_STREAMS)
            one = one / groups * min(groups, streams)
            launches = groups * eff.kernel_overhead_s
        half = eff.gemm_half_flops * (peak / eff.bf16_peak if eff.bf16_peak and fp8 else 1.0)
        e = one / (one + half)
        if kind == "attention":
            if ph.attention:
                if kernel in ("fa2", "sdpa-fa2"):
                    ceiling = eff.attention_fa2_bwd_max if backward else eff.attention_fa2_max
                    if kernel == "sdpa-fa2":
                        ceiling *= SDPA_FLASH_OVER_FA2
                elif kernel == "cudnn":
                    ceiling = eff.attention_cudnn_bwd_max if backward else eff.attention_cudnn_max
                else:
                    ceiling = eff.attention_bwd_max if backward else eff.attention_max
                e *= ceiling * causal_tile_factor(keys, eff.attention_causal_s0)
                if ph.attention_keys:  # the backward's steeper ramp over short keys (short sequences, CP chunks)
                    e *= attention_keys_factor(keys, kernel, backward)
            else:
                e *= eff.attention_max
        else:
            bf16 = (eff.grouped_gemm_max if grouped else eff.gemm_max) * (
                k_depth_factor(depth, eff.gemm_k_half) if ph.gemm_shape else 1.0)
            if fp8 and ph.fp8:
                ceiling = fp8_kernel_ceiling(eff.gemm_max, eff.fp8_gemm_max, fp8, eff.fp8_block_factor,
                                             eff.fp8_any_layout)
                if grouped:
                    ceiling *= eff.fp8_grouped_gemm_max / eff.fp8_gemm_max
                # FP8's own ramp over k: its main loop covers k twice as fast against the same per-tile costs
                ceiling *= k_depth_factor(depth, eff.fp8_gemm_k_half or eff.gemm_k_half) if ph.gemm_shape else 1.0
                # an FP8 kernel keeps no larger a share of its peak than the BF16 one of its shape (TE's measured
                # GEMMs: 0.69 vs 0.72, docs/examples/gemm_profiling): FP8 at most halves a GEMM
                e *= min(ceiling, bf16)
            else:  # BF16, or (fp8 physics off) an FP8 GEMM at BF16's efficiency of the FP8 peak
                e *= bf16
        return max(flops / (peak * e), t_mem, launches) + eff.kernel_overhead_s
    return t_mem + eff.kernel_overhead_s


def rank_strides(lay: Layout) -> dict[str, int]:
    """Distance between neighbouring ranks of each dense dim: the product of the sizes inside it in the order."""
    sizes = {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp, "pp": lay.pp}
    strides, stride = {}, 1
    for d in lay.rank_order.split("-"):
        strides[d] = stride
        stride *= sizes[d]
    return strides


def group_ranks(dim: str, lay: Layout) -> tuple[int, ...]:
    """Ranks of rank 0's group along `dim`: dense dims by the layout's rank order; the distributed optimizer's
    dp_cp group spans cp x dp; experts fold etp-ep-edp over the non-pp ranks (tp-cp-dp, Megatron's MoE folding)."""
    sizes = {"tp": lay.tp, "cp": lay.cp, "dp": lay.dp, "pp": lay.pp}
    strides = rank_strides(lay)
    if dim in sizes:
        return tuple(i * strides[dim] for i in range(sizes[dim]))
    if dim == "dp_cp":
        return tuple(c * strides["cp"] + d * strides["dp"] for d in range(lay.dp) for c in range(lay.cp))
    folded = {"etp": (1, lay.etp), "ep": (lay.etp, lay.ep), "edp": (lay.etp * lay.ep, lay.edp)}
    if dim in folded:
        step, n = folded[dim]
        return tuple(_unfold(i * step, lay.tp * lay.cp, strides["dp"]) for i in range(n))
    raise ValueError(dim)


def _unfold(k: int, tp_cp: int, stride_dp: int) -> int:
    """Global rank of index k of the folded tp-cp-dp ranks (tp and cp are innermost in every order)."""
    return k % tp_cp + (k // tp_cp) * stride_dp


def stage_p2p_s(model: ModelSpec, wl: Workload, lay: Layout, link: comm.Link, eff: Efficiency) -> float:
    """P2P of one micro-batch's activations between stages; Megatron sends 1/tp with scatter-gather (SC'21 4.1)."""
    if lay.pp == 1:
        return 0.0
    return timed_collective("p2p", ACT_BYTES * lay.mbs * wl.seq_len / lay.cp * model.hidden / lay.tp, 2, link, eff)


def group_link(cluster: Cluster, ranks: tuple[int, ...]) -> comm.Link:
    """Achieved bus bandwidth: line rate x the GPU's NCCL efficiency on the level the ring crosses."""
    e = cluster.gpu.efficiency
    bw, lat, crosses = cluster.group_link(ranks, e.scaleup_bandwidth, e.scaleout_bandwidth)
    a2a = cluster.scaleup.bytes_per_s * (e.scaleup_a2a_bandwidth or e.scaleup_bandwidth)
    if not crosses:
        return comm.Link(bw, lat, crosses, min(a2a, bw) if e.scaleup_a2a_bandwidth else 0.0)
    per_node: dict[int, int] = {}
    for r in ranks:
        per_node[cluster.node_of(r)] = per_node.get(cluster.node_of(r), 0) + 1
    return comm.Link(bw, lat, crosses, a2a, cluster.scaleout.bytes_per_s * e.scaleout_bandwidth, min(per_node.values()))


_RING = {"all_reduce": comm.all_reduce, "all_gather": comm.all_gather, "reduce_scatter": comm.reduce_scatter,
         "all_to_all": comm.all_to_all}


def timed_collective(kind: str, bytes_: float, n: int, link: comm.Link, eff: Efficiency, dedup_top_k: int = 0) -> float:
    """A collective's seconds: the calibration's measured alpha + bytes / beta for this kind and group size inside
    one node (Hockney's model, fitted by costmodels/calibrate.py), else the ring formula of comm.py."""
    if n <= 1 or bytes_ <= 0:
        return 0.0
    fit = eff.collective_fit(kind, n, link)
    if fit is not None:
        return fit[0] + bytes_ / fit[1]
    if kind == "all_to_all":
        return comm.all_to_all(bytes_, n, link, dedup_top_k)
    return comm.p2p(bytes_, link) if kind == "p2p" else _RING[kind](bytes_, n, link)


def collective_time(c: Collective, n: int, link: comm.Link, eff: Efficiency, backward: bool = False) -> float:
    """One forward (or, `backward`, one backward-mirror) instance of a block's collective."""
    return timed_collective(c.kind, c.pass_bytes(backward), 2 if c.kind == "p2p" else n, link, eff,  # P2P: 2 ranks
                            c.dedup_top_k)
