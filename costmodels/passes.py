"""Forward and backward pass times of the model's blocks for one layout (PassCache: shared across the candidates
that share a block's shape), what recomputation re-runs of them, and the sync coefficients of the gradient
reduction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from operator import attrgetter

from meshplan.costmodels import comm
from meshplan.costmodels.config import Layout, Workload
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.kernels import (TE_GEMM_STREAMS, column_gemm_count, overlapped_exposed, ring_cp_exposed,
                                         tp_exposed_fraction, tp_gemm_chunks)
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.ops import (ACT_BYTES, Block, Op, attention_half, embedding_block, ep_dispatch_bytes,
                                     head_block, memory_class, mlp_half, mtp_projection, recompute_modules_of)
from meshplan.costmodels.runtime import Runtime
from meshplan.costmodels.timing import KernelShape, collective_time, group_link, group_ranks, op_time
from meshplan.hardware_db.cluster import Cluster




@dataclass(frozen=True)
class PassTimes:
    """Seconds for one micro-batch through a block: compute and exposed communication per parallel dimension."""

    fwd_compute: float = 0.0
    bwd_input_compute: float = 0.0
    bwd_weight_compute: float = 0.0
    fwd_comm: dict[str, float] = field(default_factory=dict)
    bwd_comm: dict[str, float] = field(default_factory=dict)
    recompute: float = 0.0  # part of the backward spent re-running the forward

    @property
    def forward(self) -> float:
        return self.fwd_compute + sum(self.fwd_comm.values())

    @property
    def backward_input(self) -> float:
        return self.bwd_input_compute + sum(self.bwd_comm.values()) + self.recompute

    @classmethod
    def total(cls, parts: list[tuple[PassTimes, int]]) -> PassTimes:
        """sum of count x times over (times, count) pairs: a stage's layers by kind, without one add per layer."""
        fwd: dict[str, float] = {}
        bwd: dict[str, float] = {}
        for t, n in parts:
            for k, v in t.fwd_comm.items():
                fwd[k] = fwd.get(k, 0.0) + n * v
            for k, v in t.bwd_comm.items():
                bwd[k] = bwd.get(k, 0.0) + n * v
        return cls(sum(n * t.fwd_compute for t, n in parts), sum(n * t.bwd_input_compute for t, n in parts),
                   sum(n * t.bwd_weight_compute for t, n in parts), fwd, bwd, sum(n * t.recompute for t, n in parts))

    def plus(self, other: PassTimes) -> PassTimes:
        def add(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
            out = dict(a)  # a's keys first, then b's new ones: float sums do not depend on hashing
            for k, v in b.items():
                out[k] = out[k] + v if k in out else v
            return out

        return PassTimes(self.fwd_compute + other.fwd_compute, self.bwd_input_compute + other.bwd_input_compute,
                         self.bwd_weight_compute + other.bwd_weight_compute, add(self.fwd_comm, other.fwd_comm),
                         add(self.bwd_comm, other.bwd_comm), self.recompute + other.recompute)


# ---- the estimate ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class SyncCoefficients:
    """DP gradient reduce and parameter gather over P parameters take alpha + beta * P seconds (ring alpha-beta,
    comm.py) when P > 0; the optimizer step streams ADAM_BYTES_PER_PARAM bytes per local parameter from HBM."""

    reduce_alpha_dense: float
    reduce_beta_dense: float
    reduce_alpha_expert: float
    reduce_beta_expert: float
    gather_alpha_dense: float
    gather_beta_dense: float
    gather_alpha_expert: float
    gather_beta_expert: float
    optimizer_s_per_dense_param: float
    optimizer_s_per_expert_param: float

    def without_reduce(self) -> SyncCoefficients:
        """No gradient reduce after the last backward: each micro-batch's backward reduce-scattered already."""
        return dataclasses.replace(self, reduce_alpha_dense=0.0, reduce_beta_dense=0.0, reduce_alpha_expert=0.0,
                                   reduce_beta_expert=0.0)

    def reduce(self, dense: float, expert: float) -> float:
        return ((self.reduce_alpha_dense + self.reduce_beta_dense * dense if dense > 0 else 0.0)
                + (self.reduce_alpha_expert + self.reduce_beta_expert * expert if expert > 0 else 0.0))

    def gather(self, dense: float, expert: float) -> float:
        return ((self.gather_alpha_dense + self.gather_beta_dense * dense if dense > 0 else 0.0)
                + (self.gather_alpha_expert + self.gather_beta_expert * expert if expert > 0 else 0.0))

    def optimizer(self, dense: float, expert: float) -> float:
        return self.optimizer_s_per_dense_param * dense + self.optimizer_s_per_expert_param * expert


# The layout fields and links each block of ops.py reads: a PassCache shares a block's passes under this key.
BLOCK_KEYS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "attention": (("tp", "cp", "cp_comm", "sp", "mbs"), ("tp", "cp")),
    "mlp": (("tp", "cp", "sp", "mbs"), ("tp",)),
    "moe": (("tp", "cp", "mbs", "ep", "etp"), ("ep", "etp")),
    "embedding": (("tp", "cp", "sp", "mbs"), ("tp",)),
    "head": (("tp", "cp", "sp", "mbs"), ("tp",)),
    "mtp_projection": (("tp", "cp", "sp", "mbs"), ()),
}
_BLOCK_GETTERS = {name: (attrgetter(*fields), dims) for name, (fields, dims) in BLOCK_KEYS.items()}


class GroupLinks(dict):
    """The links of a layout's process groups by dim, each read off the cluster on first use (a planner's bounds
    need only a few of them for most meshes)."""

    def __init__(self, cluster: Cluster, lay: Layout):
        super().__init__()
        self.cluster, self.lay = cluster, lay

    def __missing__(self, dim: str) -> comm.Link:
        link = self[dim] = group_link(self.cluster, group_ranks(dim, self.lay))
        return link


class PassCache:
    """Block passes (ops.py) by what they depend on (BLOCK_KEYS), for one model, cluster, workload, runtime and
    efficiency, and the per-layer, embedding and head passes composed from them. Every CostContext reads its
    passes here; a planner shares one cache among thousands of contexts (and reads it without any) because the
    attention, MLP and MoE halves repeat across them, and computing them is most of what a context costs.
    `lay` is anything with the BLOCK_KEYS fields (a Layout, or the planner's per-layer key); `links` the groups'
    links by dim."""

    def __init__(self, model: ModelSpec, cluster: Cluster, wl: Workload, rt: Runtime, eff: Efficiency):
        self.owner = (model, cluster, wl, rt, eff)
        self.model, self.wl, self.rt, self.eff = model, wl, rt, eff
        gpu = cluster.gpu
        self.peak16 = gpu.peak_flops("bf16" if "bf16" in gpu.peak_tflops else "fp16")
        self.peak_fp8 = gpu.peak_flops("fp8") if wl.dtype == "fp8" else self.peak16
        self.hbm = gpu.hbm_bytes_per_s
        # keyed by block shape (and links): each block's passes and recompute parts, the head (+ MTP) passes, and
        # each block's (forward, backward, recompute parts) totals
        self.blocks: dict[tuple, tuple[PassTimes, RecomputeParts]] = {}
        self.heads: dict[tuple, PassTimes] = {}
        self.totals: dict[tuple, tuple[float, float, RecomputeParts]] = {}

    def layer(self, i: int, lay, links) -> tuple[PassTimes, float]:
        """A decoder layer's passes without recomputation and its selective part: the attention half plus the MLP
        (or MoE) half (ops.decoder_layer)."""
        model, wl, rt, any_layout = self.model, self.wl, self.rt, self.eff.fp8_any_layout
        kind = model.is_moe_layer(i)
        attn_key = self._key("attention", lay, links)

        def attn_build() -> Block:
            return attention_half(model, lay, wl, rt, any_layout)

        mlp_name = "moe" if kind else "mlp"
        mlp_key, mlp_build = self._key(mlp_name, lay, links), lambda: mlp_half(model, i, lay, wl, rt, any_layout)
        key = ("layer", attn_key, mlp_key)
        found = self.blocks.get(key)
        if found is None:
            attn, sel_attn = self._block(attn_key, attn_build, lay, links)
            mlp, sel_mlp = self._block(mlp_key, mlp_build, lay, links)
            found = self.blocks[key] = (self._ep_overlapped(attn, mlp), _merge_parts(sel_attn, sel_mlp))
        return found[0], self._selective_s(found[1], lay)

    def _ep_overlapped(self, attn: PassTimes, mlp: PassTimes) -> PassTimes:
        """The layer (attention then MLP half). DualPipe and Megatron-Core's EP A2A overlap
        (--overlap-moe-expert-parallel-comm) run one micro-batch's forward chunk beside another's backward chunk,
        each all-to-all under one piece of the other's compute (DeepSeek-V3 report sec. 3.2.1, Fig. 4): the forward
        dispatch under the paired MLP backward, the forward combine under the attention backward, the backward
        dispatch under the MLP forward, the backward combine under the attention forward. Dispatch and combine
        move the same elements; the first piece of each pass is the dispatch, at ops.ep_dispatch_bytes per element
        (FP8 with +fp8-dispatch), the second a BF16 combine; what is hidden slows the compute
        (kernels.CONTENTION_SM)."""
        layer = attn.plus(mlp)
        tf, tb = mlp.fwd_comm.get("ep", 0.0), mlp.bwd_comm.get("ep", 0.0)
        if not self.rt.ep_overlap or tf + tb <= 0:
            return layer
        ph = self.eff.physics

        dispatch = ep_dispatch_bytes(self.rt, self.wl)
        first = dispatch / (dispatch + ACT_BYTES)  # the dispatch's share of the pair's bytes

        def hidden(comm_s: float, window_a: float, window_b: float) -> float:
            return (overlapped_exposed(comm_s * first, window_a, 0.0, ph)
                    + overlapped_exposed(comm_s * (1 - first), window_b, 0.0, ph))

        mlp_bwd = mlp.bwd_input_compute + mlp.bwd_weight_compute
        attn_bwd = attn.bwd_input_compute + attn.bwd_weight_compute
        fwd_comm = {**layer.fwd_comm, "ep": hidden(tf, mlp_bwd, attn_bwd)}
        bwd_comm = {**layer.bwd_comm, "ep": hidden(tb, mlp.fwd_compute, attn.fwd_compute)}
        return dataclasses.replace(layer, fwd_comm=fwd_comm, bwd_comm=bwd_comm)

    def _selective_s(self, parts: RecomputeParts, lay) -> float:
        """Forward seconds selective recomputation re-runs: torchtitan's op-SAC share, or the layout's modules."""
        if self.rt.selective == "op-sac":
            return dict(parts).get("op-sac", 0.0)
        return sum(t for m, t in parts if m in lay.recompute_modules)

    def layer_times(self, i: int, mode: str, lay, links) -> PassTimes:
        base, selective = self.layer(i, lay, links)
        return with_recompute(base, mode, selective)

    def embedding(self, lay, links) -> PassTimes:
        return self._block(self._key("embedding", lay, links), lambda: embedding_block(self.model, lay, self.wl),
                           lay, links)[0]

    def head(self, lay, links) -> PassTimes:
        """The last stage's own block: final norm, LM head and loss, and after them each MTP module (its
        projection, a decoder layer like the model's last, the head again; ops.mtp_projection). Each module's ring
        exchange overlaps its own attention."""
        model = self.model
        head_key = self._key("head", lay, links)
        key: tuple = ("head+mtp", head_key)
        if model.num_mtp_layers:  # the modules' decoder layer is like the model's last
            last = "moe" if model.is_moe_layer(model.num_layers - 1) else "mlp"
            key += (self._key("attention", lay, links), self._key(last, lay, links), self._key("mtp_projection", lay,
                                                                                                links))
        found = self.heads.get(key)
        if found is None:
            head = self._block(head_key, lambda: head_block(model, lay, self.wl), lay, links)[0]
            if model.num_mtp_layers:
                projection = self._block(self._key("mtp_projection", lay, links),
                                         lambda: mtp_projection(model, lay, self.wl), lay, links)[0]
                module = projection.plus(self.layer(model.num_layers - 1, lay, links)[0]).plus(head)
                head = head.plus(PassTimes.total([(module, model.num_mtp_layers)]))
            found = self.heads[key] = head
        return found

    def layer_fb(self, i: int, mode: str, lay, links) -> tuple[float, float]:
        """(forward, backward) seconds of decoder layer i under a recompute mode (backward: input and weight
        gradients and the recomputation) from the halves' totals alone: what the planner's work bounds read, for
        thousands of layer keys, without composing PassTimes."""
        return with_recompute_fb(self.layer_parts(i, lay, links), mode)

    def layer_parts(self, i: int, lay, links) -> tuple[float, float, float]:
        """(forward, backward without recomputation, selective recomputation's forward seconds) of decoder layer i:
        layer_fb of every mode from one lookup (with_recompute_fb)."""
        model = self.model
        if self.rt.ep_overlap and model.is_moe_layer(i):  # the overlap pairs the halves' passes (_ep_overlapped)
            base, selective = self.layer(i, lay, links)
            return base.forward, base.backward_input + base.bwd_weight_compute, selective
        any_layout = self.eff.fp8_any_layout
        attn = self._totals(self._key("attention", lay, links),
                            lambda: attention_half(model, lay, self.wl, self.rt, any_layout), lay, links)
        mlp = self._totals(self._key("moe" if model.is_moe_layer(i) else "mlp", lay, links),
                           lambda: mlp_half(model, i, lay, self.wl, self.rt, any_layout), lay, links)
        return (attn[0] + mlp[0], attn[1] + mlp[1],
                self._selective_s(attn[2], lay) + self._selective_s(mlp[2], lay))

    def edges_fb(self, lay, links) -> tuple[tuple[float, float], tuple[float, float]]:
        """((forward, backward) of the embedding, of the head with the MTP modules): as layer_fb."""
        model, wl = self.model, self.wl
        emb = self._totals(self._key("embedding", lay, links), lambda: embedding_block(model, lay, wl), lay, links)
        head = self._totals(self._key("head", lay, links), lambda: head_block(model, lay, wl), lay, links)
        f, b = head[0], head[1]
        if model.num_mtp_layers:
            proj = self._totals(self._key("mtp_projection", lay, links), lambda: mtp_projection(model, lay, wl),
                                lay, links)
            layer_f, layer_b = self.layer_fb(model.num_layers - 1, "none", lay, links)
            f += model.num_mtp_layers * (proj[0] + layer_f + head[0])
            b += model.num_mtp_layers * (proj[1] + layer_b + head[1])
        return (emb[0], emb[1]), (f, b)

    def _totals(self, key: tuple, build, lay, links) -> tuple[float, float, RecomputeParts]:
        """A block's (forward, backward without recomputation, recompute parts), cached beside its passes."""
        found = self.totals.get(key)
        if found is None:
            t, sel = self._block(key, build, lay, links)
            found = self.totals[key] = (t.forward, t.backward_input + t.bwd_weight_compute, sel)
        return found

    @staticmethod
    def _key(name: str, lay, links) -> tuple:
        fields, dims = _BLOCK_GETTERS[name]
        return (name, fields(lay), *[links[d] for d in dims])

    def _block(self, key: tuple, build, lay, links) -> tuple[PassTimes, RecomputeParts]:
        found = self.blocks.get(key)
        if found is None:
            block = build()
            if block.name != key[0]:
                raise ValueError(f"block {block.name!r} cached as {key[0]!r}")
            found = self.blocks[key] = self._passes_of(block, lay, links)
        return found

    def _passes_of(self, block: Block, lay, links) -> tuple[PassTimes, RecomputeParts]:
        """The block's passes without recomputation, and the forward seconds of what each recompute module (and
        torchtitan's op-SAC, as "op-sac") would re-run."""
        fwd = bwd_i = bwd_w = 0.0
        parts: dict[str, float] = {}
        attn_core = attn_core_bwd = 0.0
        eff = self.eff
        columns = column_gemm_count(op.name for op in block.ops)
        for op in block.ops:
            fp8 = op.kind == "gemm" and op.gemm_dtype_scale > 1
            if op.name.startswith("fp8_cast") and not eff.physics.fp8:
                continue
            if op.name == "cp_merge" and not eff.physics.cp_steps:  # the ring's per-step merges go with its steps
                continue
            if op.name.startswith("async_tp_") and not eff.physics.overlap_limits:  # what the overlap costs
                continue
            peak = self.peak_fp8 if fp8 else self.peak16
            measured = eff.memory_op_time(op.name, op.fwd_bytes) if op.kind == "memory" else None
            if measured is not None:  # calibrated: this operator class's measured rate (forward, backward)
                f = measured
                bwd_i += eff.memory_op_time(op.name, op.bwd_input_bytes) or 0.0
                fwd += f
            else:
                m, n, k = op.shape or (0.0, 0.0, 0.0)  # each pass's inner dimension: k, then n (dgrad), m (wgrad)
                recipe = self.wl.fp8_recipe if fp8 else None
                kernel = op.kernel or "fused"
                streams = TE_GEMM_STREAMS if self.rt.grouped_gemm == "multi-stream" else 0
                memory = op.kind == "memory"
                # a memory class's backward kernel may run at its own rate (Runtime.memory_kernel)
                band_f = self.rt.memory_kernel(memory_class(op.name)) if memory else 1.0
                band_b = self.rt.memory_kernel(memory_class(op.name), backward=True) if memory else 1.0
                split = tp_gemm_chunks(self.rt.tp_overlap, op.name, lay.tp, lay.sp,
                                       column_gemms=columns) if op.kind == "gemm" else 1
                split_b = tp_gemm_chunks(self.rt.tp_overlap, op.name, lay.tp, lay.sp, True,
                                         column_gemms=columns) if op.kind == "gemm" else 1
                f = op_time(op.fwd_flops, op.fwd_bytes, op.kind, peak, self.hbm, eff, False,
                            KernelShape(k, op.groups, recipe, op.keys, kernel, band_f, split, streams))
                fwd += f
                b = op_time(op.bwd_input_flops, op.bwd_input_bytes, op.kind, peak, self.hbm, eff, True,
                            KernelShape(n, op.groups, recipe, op.keys, kernel, band_b, split_b, streams))
                bwd_i += b
                if op.kind == "attention" or op.name.startswith("attn_"):
                    attn_core_bwd += b
                bwd_w += op_time(op.bwd_weight_flops, op.bwd_weight_bytes, op.kind, peak, self.hbm, eff, True,
                                 KernelShape(m, op.groups, recipe, op.keys, kernel, band_b, 1.0, streams))
            if self.rt.selective == "op-sac":  # torchtitan: per-operator SAC, no modules
                parts["op-sac"] = parts.get("op-sac", 0.0) + f * op_sac_recomputed(op, self.model)
            else:
                for module in recompute_modules_of(op, block.name):
                    parts[module] = parts.get(module, 0.0) + f
            if op.kind == "attention" or op.name.startswith("attn_"):
                attn_core += f
        if block.name == "attention" and eff.layer_overhead:  # once per decoder layer: its measured framework cost
            over_f, over_b = eff.overhead(lay.tp, lay.sp)
            fwd += over_f
            bwd_i += over_b
        elif block.name == "head" and eff.head_overhead is not None:  # per micro-batch, outside the layers
            fwd += eff.head_overhead.forward_s
            bwd_i += eff.head_overhead.backward_s
        fwd_comm, bwd_comm, again = self._block_comms(block, lay, links, columns, attn_core, attn_core_bwd)
        for module, tf in again:
            parts[module] = parts.get(module, 0.0) + tf
        return PassTimes(fwd, bwd_i, bwd_w, fwd_comm, bwd_comm, 0.0), tuple(sorted(parts.items()))

    def _block_comms(self, block: Block, lay, links, columns: int, attn_core: float,
                     attn_core_bwd: float) -> tuple[dict[str, float], dict[str, float], list[tuple[str, float]]]:
        """The block's collectives exposed in its forward and backward, per dimension (TP overlap, the CP ring under
        the attention steps), and the forward collective seconds each recompute module runs again."""
        eff = self.eff
        fwd_comm: dict[str, float] = {}
        bwd_comm: dict[str, float] = {}
        rerun: list[tuple[str, float]] = []
        for c in block.comms:
            t = collective_time(c, getattr(lay, c.dim), links[c.dim], self.eff)  # tp, cp, ep, etp: group sizes
            t_b = t if c.bwd_bytes is None else collective_time(c, getattr(lay, c.dim), links[c.dim], self.eff, True)
            tf, tb = c.fwd_count * t, c.bwd_count * t_b
            if c.overlappable == "tp":
                tf *= tp_exposed_fraction(self.rt.tp_overlap, lay.tp, lay.sp, eff.physics, collective=c.name,
                                          column_gemms=columns)
                tb *= tp_exposed_fraction(self.rt.tp_overlap, lay.tp, lay.sp, eff.physics, backward=True,
                                          collective=c.name, column_gemms=columns)
            attn_bwd = attn_core_bwd or 2.5 * attn_core
            if c.overlappable == "cp":  # the ring exchange runs under the attention steps (kernels.ring_cp_exposed)
                tf = ring_cp_exposed(tf, attn_core, lay.cp, False, eff.physics)
                tb = ring_cp_exposed(tb, attn_bwd, lay.cp, True, eff.physics)
            elif c.overlappable == "cp-first-step":  # waited before the second step: one step's compute hides it
                tf = overlapped_exposed(tf, attn_core / lay.cp, 0.0, eff.physics)
                tb = overlapped_exposed(tb, attn_bwd / lay.cp, 0.0, eff.physics)
            # with rt.ep_overlap the EP all-to-all stays raw here: PassCache.layer hides it under a paired pass
            fwd_comm[c.dim] = fwd_comm.get(c.dim, 0.0) + tf
            bwd_comm[c.dim] = bwd_comm.get(c.dim, 0.0) + tb
            # a recomputed dense MLP or MoE layer runs its own TP pair / dispatch and combine again
            again = {"mlp": ("mlp",), "moe": ("moe",)}.get(block.name, ())
            if self.rt.selective == "op-sac" and c.name == "tp_all_gather":
                # op-level SAC saves reduce-scatter outputs but not all-gather ones (torchtitan parallelize_llama.py
                # _save_list), and the linears it re-runs (wk, wo, w3) need the gathered input: both all-gathered
                # again in the backward
                again = ("op-sac",)
            rerun += [(m, tf) for m in again]
        return fwd_comm, bwd_comm, rerun


# PyTorch FSDP2's copies around its collectives, per parameter of the layer (torch/distributed/fsdp/_fully_shard/
# _fsdp_collectives.py): after each all-gather, foreach_all_gather_copy_out splits the gathered 16-bit buffer into
# the parameters (split_with_sizes_copy: read 2 B, write 2 B) on the compute stream once the gather is waited;
# before each reduce-scatter, foreach_reduce_scatter_copy_in concatenates the 16-bit gradients into the fp32
# reduce-scatter input (chunk_cat: read 2 B, write 4 B), on the compute stream too ("Only after the copy-in
# finishes can we free the gradients"). Megatron's distributed optimizer and Megatron-FSDP gather into and reduce
# from contiguous buffers (no copies).


RecomputeParts = tuple[tuple[str, float], ...]  # (recompute module or "op-sac", forward seconds it re-runs)


def _merge_parts(a: RecomputeParts, b: RecomputeParts) -> RecomputeParts:
    out = dict(a)
    for k, v in b:
        out[k] = out.get(k, 0.0) + v
    return tuple(sorted(out.items()))


def with_recompute_fb(parts: tuple[float, float, float], mode: str) -> tuple[float, float]:
    """(forward, backward) of a layer's (forward, backward, selective forward) under a recompute mode: full re-runs
    the forward in the backward, selective its modules' share (as with_recompute)."""
    forward, backward, selective = parts
    again = forward if mode == "full" else selective if mode == "selective" else 0.0
    return forward, backward + again


def with_recompute(base: PassTimes, recompute: str, selective_s: float) -> PassTimes:
    """Full recomputation re-runs the whole forward, its communication included; selective what its modules re-run
    (the attention core by default: Korthikanti et al. 2022, sec. 5)."""
    re = base.forward if recompute == "full" else selective_s if recompute == "selective" else 0.0
    return PassTimes(base.fwd_compute, base.bwd_input_compute, base.bwd_weight_compute, base.fwd_comm, base.bwd_comm,
                     re)


def op_sac_recomputed(op: Op, model: ModelSpec) -> float:
    """The share of an operator's forward torchtitan's op-level SAC re-runs in the backward (memory._op_sac_bytes):
    every memory-bound operator; of the matmuls every second one in forward order: the k projection (wk, or its
    share of a fused qkv), the output projection, the SwiGLU up half (w3) or the GeLU down projection; the
    attention kernel's output is saved."""
    if op.name == "cp_merge":  # inside the saved SDPA op (torch context_parallel dispatches it whole)
        return 0.0
    if op.name == "async_tp_partials_sum":  # part of the fused reduce-scatter, whose output the SAC list saves
        return 0.0
    if op.kind == "memory":
        return 1.0
    if op.kind == "attention":
        return 0.0
    if op.name == "qkv_proj" and model.mla is None:
        q, kv = model.num_heads, model.kv_heads
        return kv / (q + 2 * kv)
    swiglu = model.mlp == "swiglu"
    share = {"wq": 0.0, "wk": 1.0, "wv": 0.0, "w1": 0.0, "w3": 1.0, "out_proj": 1.0, "up_gate_proj": 0.5,
             "up_proj": 0.0, "down_proj": 0.0 if swiglu else 1.0}
    return share.get(op.name, 0.5)
