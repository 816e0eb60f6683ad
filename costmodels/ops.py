"""Per-operator FLOPs and HBM bytes of a transformer on one rank, for one micro-batch.

Each operator has a forward, a backward-input and a backward-weight part (zero-bubble schedules need the split;
Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 2). Counts are per rank after TP/CP/EP sharding.
Formulas: a GEMM [m,k]x[k,n] costs 2mnk FLOPs (Narayanan et al. SC'21, sec. 5.1); its backward costs the same
again for the input gradient and again for the weight gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from meshplan.costmodels.config import Layout, Workload
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.runtime import Runtime

OpKind = Literal["gemm", "attention", "memory"]
Dim = Literal["tp", "cp", "ep", "etp", "dp", "pp"]
CollectiveKind = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p"]

ACT_BYTES = 2  # bf16/fp16 activations (fp8 GEMMs still keep 16-bit activations between operators)
# An FP8 EP dispatch element: 1 B plus a 4-byte scale per 1x128 tile (DeepSeek-V3 report sec. 3.3.3)
EP_FP8_DISPATCH_BYTES = 1 + 4 / 128


def ep_dispatch_bytes(rt: Runtime, wl: Workload) -> float:
    """Bytes per element of the EP all-to-all that carries tokens to the experts (the forward dispatch, and the
    activation gradient before the down-projection backward); the combines stay BF16 (DeepSeek-V3 sec. 3.3.3)."""
    return EP_FP8_DISPATCH_BYTES if rt.ep_fp8_dispatch and wl.dtype == "fp8" else ACT_BYTES


@dataclass(frozen=True)
class Op:
    """One operator on one rank. FLOPs and bytes per pass; `selective` marks what selective recompute recomputes."""

    name: str
    kind: OpKind
    fwd_flops: float
    fwd_bytes: float
    bwd_input_flops: float
    bwd_input_bytes: float
    bwd_weight_flops: float = 0.0
    bwd_weight_bytes: float = 0.0
    selective: bool = False
    gemm_dtype_scale: float = 1.0  # GEMM throughput multiple of the 16-bit peak (fp8 GEMMs run at the fp8 peak)
    shape: tuple[float, float, float] | None = None  # GEMM: (m, n, k) of one GEMM ([m,k] x [k,n])
    groups: float = 1.0  # identical GEMMs run as one grouped kernel (local experts); FLOPs and bytes are totals
    keys: float = 0.0  # attention: keys each query attends (the causal tile factor reads it)
    kernel: str = ""  # attention: the framework's kernel ("fused" FA3 class, "cudnn", "fa2", "sdpa-fa2")


@dataclass(frozen=True)
class Collective:
    """One collective in the forward (and its mirror in the backward) of a block."""

    name: str
    kind: CollectiveKind
    dim: Dim
    bytes_: float
    fwd_count: int  # times in the forward pass
    bwd_count: int  # times in the backward pass
    # "cp-first-step": hidden behind the first of cp attention steps only (torch CP's K,V all-gather)
    overlappable: Literal["tp", "cp", "cp-first-step", "ep", "none"] = "none"
    dedup_top_k: int = 0  # an EP token dispatch deduplicated per destination node (DeepEP): its copies per token
    bwd_bytes: float | None = None  # the backward mirror's bytes where they differ (an FP8 TP all-gather's mirror)

    def pass_bytes(self, backward: bool) -> float:
        return self.bwd_bytes if backward and self.bwd_bytes is not None else self.bytes_


@dataclass(frozen=True)
class Block:
    """A decoder layer, the embedding or the head: its operators and its communication."""

    name: str
    ops: tuple[Op, ...]
    comms: tuple[Collective, ...] = field(default_factory=tuple)


MEMORY_CLASSES = ("norm", "swiglu", "activation", "residual_add", "rope", "softmax", "cross_entropy", "embedding",
                  "fp8_cast")


def memory_class(name: str) -> str | None:
    """The class a calibration times a memory-bound operator by (executor/profiler.py), from its name here;
    None for operators the profile has no class for (they take the fit over all classes)."""
    base = name.removeprefix("expert_").removeprefix("shared_")
    if base.startswith("fp8_cast"):
        return "fp8_cast"
    if base.endswith("norm") or base.endswith("norms") or base in ("norm1", "norm2"):
        return "norm"
    if base in ("gelu", "relu2"):
        return "activation"
    if base == "dropout_add":
        return "residual_add"
    return base if base in MEMORY_CLASSES else None


def recompute_modules_of(op: Op, block: str) -> tuple[str, ...]:
    """The Megatron-Core recompute modules (config.RecomputeModule) whose checkpoint re-runs this operator of a
    block: core_attn wraps the attention core (attention.py _checkpointed_attention_forward), layernorm the two
    norms (transformer_layer.py), mla_up_proj the query/KV up-projections with RoPE (multi_latent_attention.py
    qkv_up_checkpoint), mlp a dense MLP, moe the whole MoE layer, moe_act the experts' activation (experts.py),
    shared_experts the shared MLP (moe_layer.py). An FP8 cast goes with its GEMM."""
    name = op.name.removeprefix("fp8_cast_")
    if op.selective:
        return ("core_attn",)
    if name in ("norm1", "norm2"):
        return ("layernorm",)
    if block == "attention":
        return ("mla_up_proj",) if name in ("q_up_proj", "kv_up_proj", "rope") else ()
    if block == "mlp":
        return ("mlp",)
    if block != "moe":
        return ()
    if name.startswith("shared_"):
        return ("moe", "shared_experts")
    if name in ("expert_swiglu", "expert_gelu", "expert_relu2"):
        return ("moe", "moe_act")
    return ("moe",)


def gemm(name: str, m: float, n: float, k: float, dtype_scale: float = 1.0, weight: bool = True) -> Op:
    """[m,k] x [k,n]: 2mnk FLOPs each pass; bytes: read both inputs, write the output (16-bit)."""
    flops = 2.0 * m * n * k
    io = ACT_BYTES * (m * k + k * n + m * n)
    return Op(name, "gemm", flops, io, flops, io, flops if weight else 0.0, io if weight else 0.0,
              gemm_dtype_scale=dtype_scale, shape=(m, n, k))


SHARED_INPUT_GEMMS = ("wk", "wv", "w3")  # unfused linears whose input an earlier one of the block also reads


def fp8_quantize_ops(ops: list[Op], recipe: str, any_layout: bool = False, mx_per_dim: bool = False) -> list[Op]:
    """The casts an FP8 recipe adds around each FP8 GEMM (TransformerEngine's Linear, docs/features/
    low_precision_training: performance_considerations.rst): its activation input to FP8 in the forward and the
    output gradient in the backward, each with the transposed / column-wise copy the other backward GEMM reads
    (kernels.quant_bytes_per_element: none on GPUs whose FP8 GEMMs take `any_layout`). Weights are cast once per
    step (estimate.fp8_weight_cast_s)."""
    from meshplan.costmodels.kernels import quant_bytes_per_element

    per = quant_bytes_per_element(recipe, any_layout, mx_per_dim)
    out = []
    for op in ops:
        if op.kind != "gemm" or op.gemm_dtype_scale <= 1 or op.shape is None:
            continue
        m, n, k = op.shape
        # unfused linears on one input (wk, wv after wq; w3 after w1) reuse its FP8 copy: torch.compile's graph
        # CSE merges the identical casts (torch/_functorch/config.py cse), which torchao needs anyway ("required
        # for competitive performance", torchtitan docs/float8.md); their output gradients are their own
        shared = op.name.removeprefix("expert_").removeprefix("shared_") in SHARED_INPUT_GEMMS
        out.append(Op(f"fp8_cast_{op.name}", "memory", 0.0, 0.0 if shared else per * m * k * op.groups, 0.0,
                      per * m * n * op.groups))
    return out


def elementwise(name: str, elements_in: float, elements_out: float, bwd_factor: float = 2.0,
                selective: bool = False) -> Op:
    """Memory-bound: reads its inputs and writes its outputs once; the backward moves about twice as much."""
    b = ACT_BYTES * (elements_in + elements_out)
    return Op(name, "memory", 0.0, b, 0.0, bwd_factor * b, selective=selective)


def mla_query_and_latent(model: ModelSpec, tokens: float, heads: float, dtype_scale: float) -> list[Op]:
    """MLA's query projection (through the q_lora bottleneck when there is one) and the KV down-projection to the
    latent and the RoPE key (DeepSeek-V2 sec. 2.1.2-2.1.3), for `tokens` tokens and this rank's `heads`. The
    down-projections are not split by TP in Megatron's MLA (replicated on every TP rank)."""
    a = model.mla
    assert a is not None
    h = model.hidden
    if a.q_lora_rank:
        ops = [gemm("q_down_proj", tokens, a.q_lora_rank, h, dtype_scale),
               gemm("q_up_proj", tokens, heads * a.qk_head_dim, a.q_lora_rank, dtype_scale)]
    else:
        ops = [gemm("q_proj", tokens, heads * a.qk_head_dim, h, dtype_scale)]
    return ops + [gemm("kv_down_proj", tokens, a.kv_lora_rank + a.qk_rope_head_dim, h, dtype_scale)]


def attended_kv_heads(model: ModelSpec, rt: Runtime) -> int:
    """The K,V heads the attention kernel reads: the model's GQA heads, or the query heads where the runtime copies
    them up first (Runtime.gqa_repeats_kv); MLA up-projects a K,V per query head."""
    if model.mla is not None or rt.gqa_repeats_kv:
        return model.num_heads
    return model.kv_heads


def _attention_ops(model: ModelSpec, lay: Layout, wl: Workload, rt: Runtime, fp8: float) -> list[Op]:
    """Projections and attention core of one layer (GQA/MHA, or MLA as in DeepSeek-V2 sec. 2.1)."""
    b, s, h = lay.mbs, wl.seq_len, model.hidden
    s_local = s / lay.cp
    tokens = b * s_local
    heads = model.num_heads / lay.tp
    ops: list[Op] = []
    if model.mla is None:
        d = model.head_size
        kv = model.kv_heads / lay.tp
        if rt.fused_projections:
            ops.append(gemm("qkv_proj", tokens, (heads + 2 * kv) * d, h, fp8))
        else:  # three linears, each reading the layer's normalised input (torchtitan wq, wk, wv)
            ops += [gemm("wq", tokens, heads * d, h, fp8), gemm("wk", tokens, kv * d, h, fp8),
                    gemm("wv", tokens, kv * d, h, fp8)]
        ops.append(elementwise("rope", tokens * (heads + kv) * d, tokens * (heads + kv) * d))
        if rt.gqa_repeats_kv and kv < heads:
            # K and V copied up to the query heads (torchtitan repeat_kv: expand + reshape); the backward sums the
            # copies' gradients back, reading and writing as much
            ops.append(elementwise("repeat_kv", 2 * tokens * kv * d, 2 * tokens * heads * d, bwd_factor=1.0))
        d_qk = d_v = d
    else:
        a = model.mla
        d_qk, d_v = a.qk_head_dim, a.v_head_dim
        ops += mla_query_and_latent(model, tokens, heads, fp8)
        ops.append(gemm("kv_up_proj", tokens, heads * (a.qk_nope_head_dim + d_v), a.kv_lora_rank, fp8))
        rope = tokens * (heads + 1) * a.qk_rope_head_dim
        ops.append(elementwise("rope", rope, rope))
    # Attention core: QK^T is 2*s_q*s_k*d_qk and PV 2*s_q*s_k*d_v FLOPs per head (Vaswani et al. 2017).
    # Each CP rank holds s/cp queries against all s keys (Megatron context parallel, load-balanced causal chunks).
    scores = b * heads * s_local * s
    core_flops = 2.0 * scores * (d_qk + d_v)
    if rt.flash_attention:
        # FlashAttention-2 (Dao 2023, sec. 3.1) skips the masked half of causal blocks; backward = 2.5x forward
        # (5 GEMMs vs 2); IO: read Q,K,V,O once, no s^2 tensor in HBM.
        f = 0.5 * core_flops
        kv_heads = attended_kv_heads(model, rt) / lay.tp
        io = ACT_BYTES * tokens * (2 * heads * max(d_qk, d_v) + 2 * kv_heads * max(d_qk, d_v))
        # keys per query for the causal tile factor: a CP rank's load-balanced chunks see tiles of s / cp keys
        ops.append(Op("attention_core", "attention", f, io, 2.5 * f, 2.5 * io, selective=True, keys=s / lay.cp,
                      kernel=rt.attention_kernel))
    else:
        # Unfused Megatron path: baddbmm QK^T over the full s x s (mask applied after), fused scale-mask-softmax,
        # dropout on the probabilities, bmm with V (megatron/model/transformer.py, CoreAttention).
        qk = 2.0 * scores * d_qk
        pv = 2.0 * scores * d_v
        ops.append(Op("attn_scores", "gemm", qk, ACT_BYTES * (tokens * heads * d_qk * 2 + scores), qk,
                      ACT_BYTES * (tokens * heads * d_qk * 2 + 2 * scores), selective=True))
        ops.append(elementwise("softmax", scores, scores, bwd_factor=1.5, selective=True))
        if wl.uses_dropout(rt):
            ops.append(Op("attn_dropout", "memory", 0.0, ACT_BYTES * 2 * scores + scores, 0.0,
                          ACT_BYTES * 2 * scores + scores, selective=True))
        ops.append(Op("attn_pv", "gemm", pv, ACT_BYTES * (2 * scores + tokens * heads * d_v), pv,
                      ACT_BYTES * (3 * scores + 2 * tokens * heads * d_v), selective=True))
    ops.append(gemm("out_proj", tokens, h, heads * d_v, fp8))
    return ops


def _mlp_ops(prefix: str, model: ModelSpec, tokens: float, ffn_local: float, fp8: float,
             fused: bool = True) -> list[Op]:
    """A (dense, shared or expert) MLP; `fused`: the gated MLP's gate and up projections as one GEMM
    (Megatron-Core linear_fc1 with gated_linear_unit), else two linears on the same input (torchtitan w1, w3)."""
    h = model.hidden
    if model.mlp == "swiglu" and not fused:
        return [
            gemm(f"{prefix}w1", tokens, ffn_local, h, fp8),
            gemm(f"{prefix}w3", tokens, ffn_local, h, fp8),
            elementwise(f"{prefix}swiglu", 2 * tokens * ffn_local, tokens * ffn_local),
            gemm(f"{prefix}down_proj", tokens, h, ffn_local, fp8),
        ]
    if model.mlp == "swiglu":
        return [
            gemm(f"{prefix}up_gate_proj", tokens, 2 * ffn_local, h, fp8),
            elementwise(f"{prefix}swiglu", 2 * tokens * ffn_local, tokens * ffn_local),
            gemm(f"{prefix}down_proj", tokens, h, ffn_local, fp8),
        ]
    act = "gelu" if model.mlp == "gelu" else "relu2"
    return [
        gemm(f"{prefix}up_proj", tokens, ffn_local, h, fp8),
        elementwise(f"{prefix}{act}", tokens * ffn_local, tokens * ffn_local),
        gemm(f"{prefix}down_proj", tokens, h, ffn_local, fp8),
    ]


def attention_half(model: ModelSpec, lay: Layout, wl: Workload, rt: Runtime, fp8_any_layout: bool = False) -> Block:
    """A decoder layer's norms, attention and residual adds, with the attention's TP pair and the CP exchange: the
    part every decoder layer shares, dense or MoE (the cost model caches it apart from the MLP half).
    `fp8_any_layout`: the GPU's FP8 GEMMs take any operand layout (its casts write no transposes)."""
    fp8 = 2.0 if wl.dtype == "fp8" else 1.0
    h = model.hidden
    tokens = lay.mbs * wl.seq_len / lay.cp
    # sequence parallel shards norms and dropouts (Korthikanti sec. 4.2.2)
    norm_tokens = tokens / lay.tp if lay.sp else tokens
    residual = elementwise("dropout_add" if wl.uses_dropout(rt) else "residual_add", 2 * norm_tokens * h,
                           norm_tokens * h)
    ops: list[Op] = [elementwise("norm1", norm_tokens * h, norm_tokens * h)]
    ops += _attention_ops(model, lay, wl, rt, fp8)
    if lay.cp > 1 and lay.cp_comm == "ring":
        ops.append(cp_merge(model, lay, wl, rt))
    ops += [residual, elementwise("norm2", norm_tokens * h, norm_tokens * h), residual]
    if wl.dtype == "fp8":
        ops += fp8_quantize_ops(ops, wl.fp8_recipe, fp8_any_layout, rt.mx_cast_per_dim)
    comms = _tp_pair(model, lay, wl, rt)
    ops += async_tp_copies(lay, rt, ops, comms)
    if lay.cp > 1:
        kv_dim = (attended_kv_heads(model, rt) * model.head_size) if model.mla is None else model.num_heads * (
            model.mla.qk_head_dim + model.mla.v_head_dim) / 2
        kv_bytes = 2 * ACT_BYTES * tokens * kv_dim / lay.tp
        if lay.cp_comm == "ring" and rt.cp_rotate == "allgather":
            # torch context_parallel (_templated_ring_attention with _AllGatherRotater): the K,V chunks all-gathered
            # once per pass, hidden behind the first (local) step only; the backward gathers them again and passes
            # the K,V gradients round in fp32 (grad_key / grad_value accumulate in float32 under convert_to_f32),
            # one hop after each step's compute (dkv_rotater, all-to-all), the last after the loop.
            comms.append(Collective("cp_allgather_kv", "all_gather", "cp", kv_bytes * lay.cp, 1, 1,
                                    overlappable="cp-first-step"))
            comms.append(Collective("cp_ring_dkv", "p2p", "cp", 2 * kv_bytes * lay.cp, 0, 1, overlappable="cp"))
        elif lay.cp_comm == "ring":
            # Ring attention: cp-1 exchanges of each rank's K,V chunk forward; K,V and their gradients backward
            # (Liu et al., "Ring Attention", 2023; Megatron-Core context_parallel.rst), overlapped with attention.
            comms.append(Collective("cp_ring_kv", "p2p", "cp", kv_bytes * (lay.cp - 1), 1, 2, overlappable="cp"))
        else:
            # Ulysses: all-to-all Q, K, V from sequence- to head-sharded before the core and O back after it;
            # the backward mirrors it (Jacobs et al., "DeepSpeed Ulysses", 2023, sec. 3). Not overlapped.
            q_dim = model.num_heads * (model.head_size if model.mla is None else model.mla.qk_head_dim)
            qkv_bytes = ACT_BYTES * tokens * q_dim / lay.tp + kv_bytes
            out_bytes = ACT_BYTES * tokens * q_dim / lay.tp
            comms.append(Collective("cp_a2a_qkv", "all_to_all", "cp", qkv_bytes, 1, 1))
            comms.append(Collective("cp_a2a_out", "all_to_all", "cp", out_bytes, 1, 1))
    return Block("attention", tuple(ops), tuple(comms))


def cp_merge(model: ModelSpec, lay: Layout, wl: Workload, rt: Runtime) -> Op:
    """Ring CP computes each step's partial output and log-sum-exp and merges them; the backward accumulates each
    step's query and key/value gradients. Megatron-Core (TransformerEngine context_parallel.py,
    flash_attn_fwd_out_correction, dq.add_ / dkv.add_): in the 16-bit dtype, the first step copies (read 2 B, write
    2 B an element), each later one adds (read the step's 2 B, read and write the sum's 4 B), on the last CP rank,
    whose every step covers its whole chunk. torch context_parallel (_templated_ring_attention, convert_to_f32):
    the sum in fp32 (10 B an element a step). Per-token log-sum-exp traffic (1/head_dim of it) left out. Part of the
    attention core: selective recompute (core_attn) re-runs it; op-level SAC saves the SDPA op's merged output."""
    tokens = lay.mbs * wl.seq_len / lay.cp
    heads = model.num_heads / lay.tp
    d_qk = model.head_size if model.mla is None else model.mla.qk_head_dim
    d_v = model.head_size if model.mla is None else model.mla.v_head_dim
    kv_heads = attended_kv_heads(model, rt) / lay.tp
    out, q, kv = tokens * heads * d_v, tokens * heads * d_qk, tokens * kv_heads * (d_qk + d_v)
    steps = lay.cp - 1
    per = (4.0 + 10.0 * steps) if rt.cp_rotate == "allgather" else (2 * ACT_BYTES + 3 * ACT_BYTES * steps)
    return Op("cp_merge", "memory", 0.0, per * out, 0.0, per * (q + kv), selective=True)


def _tp_pair(model: ModelSpec, lay: Layout, wl: Workload, rt: Runtime) -> list[Collective]:
    """One TP pair around a column- then row-parallel block: an all-reduce of the [b, s, h] activations forward and
    one backward (Shoeybi et al. 2019, fig. 4); with sequence parallel an all-gather plus a reduce-scatter
    (Korthikanti et al. 2022, sec. 4.2.2). Attention has one, a dense MLP another; experts use EP/ETP instead.
    Where the runtime all-gathers FP8 (Runtime.tp_fp8_all_gather) both all-gathers move 1 byte an element: the
    forward one of the cast input, the backward one (the reduce-scatter's mirror) of the cast output gradient;
    the reduce-scatters stay 16-bit."""
    if lay.tp == 1:
        return []
    elements = lay.mbs * wl.seq_len / lay.cp * model.hidden
    act_bytes = ACT_BYTES * elements
    if lay.sp:
        if wl.dtype == "fp8" and wl.fp8_recipe in rt.tp_fp8_all_gather:  # each mirror at its own bytes
            return [Collective("tp_all_gather", "all_gather", "tp", elements, 1, 1, overlappable="tp",
                               bwd_bytes=act_bytes),
                    Collective("tp_reduce_scatter", "reduce_scatter", "tp", act_bytes, 1, 1, overlappable="tp",
                               bwd_bytes=elements)]
        return [Collective("tp_all_gather", "all_gather", "tp", act_bytes, 1, 1, overlappable="tp"),
                Collective("tp_reduce_scatter", "reduce_scatter", "tp", act_bytes, 1, 1, overlappable="tp")]
    return [Collective("tp_all_reduce", "all_reduce", "tp", act_bytes, 1, 1, overlappable="tp")]


def async_tp_copies(lay: Layout, rt: Runtime, ops: list[Op], comms: list[Collective]) -> list[Op]:
    """The memory passes PyTorch async TP adds on the compute stream where it fuses a TP collective with its GEMM
    (torch/distributed/_symmetric_memory/__init__.py). A fused all-gather matmul first copies the local shard into
    its symmetric buffer (read and written) before any peer may pull it, unoverlapped by design
    (_pipelined_multi_all_gather_and_consume: "giving up the chance to overlap mv"). A fused matmul reduce-scatter
    lands the tp partial outputs in a stacked buffer and sums them in a kernel of its own
    (_fused_matmul_reduce_scatter_impl: reduce_fn over the stacked partials): it reads the whole unscattered output
    and writes its shard, the reduction NCCL's reduce-scatter does inside the collective. The backward mirrors
    them where it is fused too (kernels.async_tp_fused): the output gradient's all-gather, the input gradient's
    reduce-scatter."""
    from meshplan.costmodels.kernels import async_tp_fused, column_gemm_count

    pair = {c.name: c for c in comms if c.name in ("tp_all_gather", "tp_reduce_scatter")}
    if rt.tp_overlap != "async-tp" or len(pair) < 2:  # no TP, or TP without SP (an all-reduce): nothing fused
        return []
    columns = column_gemm_count(op.name for op in ops)
    gather, scatter = pair["tp_all_gather"], pair["tp_reduce_scatter"]
    # the stacked partials read and the shard written, 16-bit as the forward reduce-scatter's buffer
    reduce_pass = (1 + 1 / lay.tp) * scatter.bytes_

    def fused(backward: bool, name: str) -> bool:
        return async_tp_fused(lay.sp, backward, name, columns)

    copy_f = 2 * gather.bytes_ / lay.tp if fused(False, "tp_all_gather") else 0.0
    copy_b = 2 * scatter.pass_bytes(True) / lay.tp if fused(True, "tp_reduce_scatter") else 0.0
    reduce_f = reduce_pass if fused(False, "tp_reduce_scatter") else 0.0
    reduce_b = reduce_pass if fused(True, "tp_all_gather") else 0.0
    return [Op("async_tp_shard_copy", "memory", 0.0, copy_f, 0.0, copy_b),
            Op("async_tp_partials_sum", "memory", 0.0, reduce_f, 0.0, reduce_b)]


def mlp_half(model: ModelSpec, index: int, lay: Layout, wl: Workload, rt: Runtime,
             fp8_any_layout: bool = False) -> Block:
    """A decoder layer's MLP: dense (with its TP pair), or MoE (router, experts, EP/ETP communication)."""
    fp8 = 2.0 if wl.dtype == "fp8" else 1.0
    h = model.hidden
    tokens = lay.mbs * wl.seq_len / lay.cp
    if not model.is_moe_layer(index):
        dense = _mlp_ops("", model, tokens, model.ffn_hidden / lay.tp, fp8, rt.fused_projections)
        if wl.dtype == "fp8":
            dense += fp8_quantize_ops(dense, wl.fp8_recipe, fp8_any_layout, rt.mx_cast_per_dim)
        pair = _tp_pair(model, lay, wl, rt)
        return Block("mlp", tuple(dense + async_tp_copies(lay, rt, dense, pair)), tuple(pair))
    moe = model.moe
    assert moe is not None
    ops: list[Op] = []
    comms: list[Collective] = []
    # MoE parallel folding (Megatron-Core moe README): tokens of the TP x CP x DP ranks go to EP x ETP expert shards.
    local_tokens = tokens / lay.tp
    assignments = local_tokens * moe.top_k * wl.moe_imbalance
    experts_local = moe.num_experts / lay.ep
    tokens_per_expert = assignments * lay.ep * lay.etp / moe.num_experts
    ffn_local = moe.expert_ffn_hidden / lay.etp
    ops.append(gemm("router", local_tokens, moe.num_experts, h, weight=True))
    ops.append(elementwise("router_topk", local_tokens * moe.num_experts, local_tokens * moe.top_k * 2))
    ops.append(elementwise("permute", assignments * h, assignments * h))
    for op in _mlp_ops("expert_", model, tokens_per_expert, ffn_local, fp8, rt.fused_projections):
        ops.append(_scale(op, experts_local))
    ops.append(elementwise("unpermute", assignments * h, assignments * h / moe.top_k))
    if moe.num_shared_experts:
        ops += _mlp_ops("shared_", model, tokens, moe.num_shared_experts * moe.shared_hidden / lay.tp, fp8,
                        rt.fused_projections)
    if wl.dtype == "fp8":
        ops += fp8_quantize_ops(ops, wl.fp8_recipe, fp8_any_layout, rt.mx_cast_per_dim)
    if lay.ep > 1:
        # Dispatch and combine: each rank sends its token copies to the experts' owners (GShard, Lepikhin 2020).
        # each pass: one all-to-all at the dispatch's element bytes, one (a combine) in BF16, counted as 2 of the mean
        per_element = (ep_dispatch_bytes(rt, wl) + ACT_BYTES) / 2
        comms.append(Collective("ep_all_to_all", "all_to_all", "ep", per_element * assignments * h, 2, 2,
                                overlappable="ep", dedup_top_k=moe.top_k if rt.ep_dispatch == "deepep" else 0))
    if lay.etp > 1:
        comms.append(Collective("etp_all_gather", "all_gather", "etp", ACT_BYTES * assignments * h * lay.etp, 1, 1))
        comms.append(Collective("etp_reduce_scatter", "reduce_scatter", "etp", ACT_BYTES * assignments * h * lay.etp,
                                1, 1))
    return Block("moe", tuple(ops), tuple(comms))


def decoder_layer(model: ModelSpec, index: int, lay: Layout, wl: Workload, rt: Runtime,
                  fp8_any_layout: bool = False) -> Block:
    """One pre-norm decoder layer on one rank (Megatron-LM ParallelTransformerLayer / TransformerLayer): the
    attention half and the MLP half."""
    attn = attention_half(model, lay, wl, rt, fp8_any_layout)
    mlp = mlp_half(model, index, lay, wl, rt, fp8_any_layout)
    return Block(f"layer{index}", attn.ops + mlp.ops, attn.comms + mlp.comms)


def _scale(op: Op, times: float) -> Op:
    """`times` identical GEMMs (one per local expert) as one grouped operator."""
    return Op(op.name, op.kind, op.fwd_flops * times, op.fwd_bytes * times, op.bwd_input_flops * times,
              op.bwd_input_bytes * times, op.bwd_weight_flops * times, op.bwd_weight_bytes * times,
              op.selective, op.gemm_dtype_scale, op.shape, op.groups * times if op.kind == "gemm" else 1.0,
              op.keys, op.kernel)


def embedding_block(model: ModelSpec, lay: Layout, wl: Workload) -> Block:
    """Vocab-parallel embedding lookup; its partial sums are all-reduced (reduce-scattered with SP) over TP."""
    tokens = lay.mbs * wl.seq_len / lay.cp
    out = tokens * model.hidden
    ops = (elementwise("embedding", tokens, out, bwd_factor=2.0),)
    comms: tuple[Collective, ...] = ()
    if lay.tp > 1:
        kind: CollectiveKind = "reduce_scatter" if lay.sp else "all_reduce"
        comms = (Collective("embedding_tp", kind, "tp", ACT_BYTES * out, 1, 0),)
    return Block("embedding", ops, comms)


def mtp_projection(model: ModelSpec, lay: Layout, wl: Workload) -> Block:
    """What one of DeepSeek-V3's multi-token-prediction modules adds to a decoder layer and the shared head: two
    norms and the projection of [hidden; embedding] (2h -> h, column-parallel) (DeepSeek-V3 report sec. 2.2;
    Megatron-Core multi_token_prediction.py). The last pipeline stage runs each module after the head: this block,
    one decoder layer like the model's last, and the head and cross-entropy again (CostContext.head)."""
    tokens = lay.mbs * wl.seq_len / lay.cp
    norm_tokens = tokens / lay.tp if lay.sp else tokens
    h = model.hidden
    return Block("mtp_projection", (elementwise("mtp_norms", 2 * norm_tokens * h, 2 * norm_tokens * h),
                                    gemm("mtp_proj", tokens, h / lay.tp, 2 * h)))


def head_block(model: ModelSpec, lay: Layout, wl: Workload) -> Block:
    """Final norm, vocab-parallel LM head and cross-entropy (Megatron vocab_parallel_cross_entropy, fp32 softmax)."""
    tokens = lay.mbs * wl.seq_len / lay.cp
    norm_tokens = tokens / lay.tp if lay.sp else tokens
    vocab_local = model.vocab / lay.tp
    ops = (
        elementwise("final_norm", norm_tokens * model.hidden, norm_tokens * model.hidden),
        gemm("lm_head", tokens, vocab_local, model.hidden),
        # logits read, cast to fp32, exp/sum/normalise and the gradient written: about 4 passes of fp32 logits.
        Op("cross_entropy", "memory", 0.0, 4 * 4 * tokens * vocab_local, 0.0, 2 * 4 * tokens * vocab_local),
    )
    comms: tuple[Collective, ...] = ()
    if lay.tp > 1:
        comms = (
            Collective("head_gather", "all_gather" if lay.sp else "all_reduce", "tp", ACT_BYTES * tokens * model.hidden,
                       1, 1),
            Collective("ce_reductions", "all_reduce", "tp", 3 * 4 * tokens, 1, 0),  # max, sum-exp, target logit
        )
    return Block("head", ops, comms)
