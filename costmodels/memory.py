"""Memory per GPU on one pipeline stage: model states, activations, logits, buffers, fragmentation allowance.

Model states under mixed-precision Adam: 16-bit weights (2 B/param), fp32 gradient buffer (4; 2 where a recipe
reduces gradients in bf16, Runtime.grad_bytes), fp32 master weights and two Adam moments (12) (Rajbhandari et al.,
"ZeRO", SC'20, sec. 3.1, K=12; Megatron-LM docs distrib_optimizer.md: 6 + 12/d bytes per parameter with the
distributed optimizer). ZeRO-2 also shards gradients, ZeRO-3 / FSDP also the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from meshplan.costmodels.config import Layout, Workload
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.ops import ACT_BYTES, attended_kv_heads
from meshplan.costmodels.runtime import Runtime

GIB = 2**30
FRAGMENTATION = 0.05  # allocator fragmentation allowance, fraction of the rest (stated assumption)
RESERVED_BYTES = 1.0 * GIB  # CUDA context, NCCL and cuBLAS workspaces (stated assumption)


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU on one stage, by category."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    logits: float
    buffers: float
    fragmentation: float

    @property
    def total(self) -> float:
        return (self.weights + self.gradients + self.optimizer + self.activations + self.logits + self.buffers
                + self.fragmentation)


@dataclass(frozen=True)
class StageParams:
    """Parameters held by one GPU of a stage, split into dense (sharded by TP, replicated over DP x CP) and
    expert (sharded by EP x ETP, replicated over expert-DP)."""

    dense: float
    expert: float


def stage_params(model: ModelSpec, lay: Layout, layers: range, first: bool, last: bool) -> StageParams:
    dense = 0.0
    expert = 0.0
    moe_layers = [i for i in layers if model.is_moe_layer(i)]  # layers of one kind hold the same parameters
    dense_layers = len(layers) - len(moe_layers)
    if moe_layers:
        moe = model.moe
        assert moe is not None
        experts: float = moe.num_experts * model.mlp_params(moe.expert_ffn_hidden)
        expert += len(moe_layers) * experts / (lay.ep * lay.etp)
        dense += len(moe_layers) * (model.layer_params(moe_layers[0]) - experts) / lay.tp
    if dense_layers:
        first_dense = next(i for i in layers if not model.is_moe_layer(i))
        dense += dense_layers * model.layer_params(first_dense) / lay.tp
    if first:
        dense += model.embedding_params() / lay.tp
    if last:
        dense += model.head_params() / lay.tp
        if model.num_mtp_layers:  # the MTP modules live on the last stage (Megatron-Core multi_token_prediction.py)
            experts = 0.0
            if model.is_moe_layer(model.num_layers - 1):
                moe = model.moe
                assert moe is not None
                experts = moe.num_experts * model.mlp_params(moe.expert_ffn_hidden) * model.num_mtp_layers
            expert += experts / (lay.ep * lay.etp)
            dense += (model.mtp_params() - experts) / lay.tp
        if model.tied_embeddings and lay.pp > 1:
            # Megatron keeps a copy of the tied embedding on the last stage
            dense += model.vocab * model.hidden / lay.tp
    return StageParams(dense, expert)


def model_state_bytes(params: StageParams, lay: Layout, unsharded_grads: bool = False,
                      grad_bytes: float = 4.0) -> tuple[float, float, float]:
    """(weights, gradients, optimizer) bytes per GPU under the layout's ZeRO stage; `unsharded_grads`: ZeRO-2/3
    gradients accumulated whole between micro-batches (Runtime.holds_unsharded_grads); `grad_bytes`: the gradient
    buffer's element size (Runtime.grad_bytes)."""
    dp_dense = lay.dp * lay.cp  # Megatron shards the distributed optimizer over DP x CP
    dp_expert = lay.edp

    def shard(n: float, d: int, stage_needed: int) -> float:
        return n / d if lay.zero >= stage_needed else n

    weights = 2 * (shard(params.dense, dp_dense, 3) + shard(params.expert, dp_expert, 3))
    grads = grad_bytes * ((params.dense + params.expert) if unsharded_grads
                 else shard(params.dense, dp_dense, 2) + shard(params.expert, dp_expert, 2))
    optim = 12 * (shard(params.dense, dp_dense, 1) + shard(params.expert, dp_expert, 1))
    return weights, grads, optim


def layer_activation_bytes(model: ModelSpec, index: int, lay: Layout, wl: Workload, rt: Runtime,
                           recompute: str) -> float:
    """Activations one layer stores for its backward, per micro-batch (Korthikanti et al. 2022, sec. 4, Eq. 1-2,
    generalised to GQA, SwiGLU, MoE and flash attention; 16-bit tensors, 1-byte dropout masks)."""
    b, s, h = lay.mbs, wl.seq_len / lay.cp, model.hidden
    t = lay.tp
    sp = t if lay.sp else 1
    sbh = s * b * h
    if recompute == "full":
        return ACT_BYTES * sbh / sp  # only the layer input is kept (Korthikanti Eq. 5 with SP)
    mask = 1.0 if wl.uses_dropout(rt) else 0.0
    # FP8 training saves each FP8 GEMM's quantised input for its weight gradient, 1 byte an element
    # (TransformerEngine transformer_engine/pytorch/module/linear.py: the forward saves its FP8 input)
    gin = 1.0 if wl.dtype == "fp8" else ACT_BYTES
    if recompute == "selective" and rt.selective == "op-sac":
        return _op_sac_bytes(model, index, lay, wl)
    # What selective recomputation drops (Megatron-Core --recompute-modules; config.RecomputeModule): the module's
    # outputs are freed after the forward and rebuilt in the backward from its kept input.
    drops = set(lay.recompute_modules) if recompute == "selective" else set()
    # Outside the TP region (sharded only by SP): two norm inputs, the inputs of the QKV and first MLP linears (the
    # norms' outputs: dropped under layernorm), two dropout masks: Korthikanti's 10sbh (Eq. 2), /t with SP (Eq. 4).
    norm_out = 0.0 if "layernorm" in drops else 2 * gin
    if rt.sp_saves_gathered_input and lay.sp:  # saved as gathered for the linears (Runtime.sp_saves_gathered_input)
        outside = (2 * ACT_BYTES + 2 * mask) * sbh / sp + norm_out * sbh
    else:
        outside = (2 * ACT_BYTES + norm_out + 2 * mask) * sbh / sp
    if model.mla is None:
        q = model.num_heads * model.head_size
        kv: float = attended_kv_heads(model, rt) * model.head_size  # the kernel's K,V inputs, repeated or grouped
        v_dim = q
        latents = 0.0
    else:
        a = model.mla
        q = model.num_heads * a.qk_head_dim
        kv = model.num_heads * (a.qk_head_dim + a.v_head_dim) / 2
        v_dim = model.num_heads * a.v_head_dim
        # the up-projections' inputs: the query and KV latents and the RoPE key, not split by TP in Megatron's MLA
        # (DeepSeek-V2 sec. 2.1.2; multi_latent_attention.py)
        latents = (gin * ((a.q_lora_rank or 0) + a.kv_lora_rank) + ACT_BYTES * a.qk_rope_head_dim) * s * b
    # Inside the TP region: Q, K, V for the core (dropped under mla_up_proj, which rebuilds them from the latents)
    # and the core output feeding the out-projection (8sbh/t for MHA).
    qkv = 0.0 if "mla_up_proj" in drops else ACT_BYTES * (q + 2 * kv)
    attn = (qkv + gin * v_dim) * s * b / t + latents
    heads = model.num_heads / t
    if rt.flash_attention:
        attn += 4 * b * heads * s  # fp32 log-sum-exp per query row (FlashAttention-2)
    elif "core_attn" not in drops:
        # softmax output (2), dropout mask (1), dropout output (2) per score: 5as^2b/t (Korthikanti Eq. 1)
        attn += (2 + mask + (ACT_BYTES if wl.uses_dropout(rt) else 0)) * b * heads * s * s
    if model.is_moe_layer(index):
        moe = model.moe
        assert moe is not None
        assignments = s * b / t * moe.top_k * wl.moe_imbalance
        ffn = moe.expert_ffn_hidden / lay.etp
        # permuted expert inputs and the experts' activation tensors (the last one, the down projection's input, is
        # the activation's output: dropped under moe_act)
        kept = _act_bytes(model, ffn, gin) - (gin * ffn if "moe_act" in drops else 0.0)
        mlp = assignments * (gin * h + kept) * lay.etp
        if moe.num_shared_experts and "shared_experts" not in drops:
            f = moe.num_shared_experts * moe.shared_hidden
            mlp += s * b * _act_bytes(model, f, gin) / t
        if "moe" in drops:  # the whole MoE layer re-runs from its input (the pre-MLP norm's output, kept)
            mlp = 0.0
    else:
        f = model.ffn_hidden
        # MLP activation input(s) and output: GELU/ReLU^2 2x(sbf) (16sbh/t at f=4h), SwiGLU gate, up and product 3x(sbf)
        mlp = 0.0 if "mlp" in drops else s * b * _act_bytes(model, f, gin) / t
    return outside + attn + mlp


def _act_bytes(model: ModelSpec, ffn: float, gin: float) -> float:
    """Per token, what an MLP of width ffn keeps: the activation's input(s) in 16 bits and its output, the down
    projection's input, at `gin` bytes."""
    return (2 * ACT_BYTES + gin if model.mlp == "swiglu" else ACT_BYTES + gin) * ffn


def _op_sac_bytes(model: ModelSpec, index: int, lay: Layout, wl: Workload) -> float:
    """torchtitan's op-level SAC (parallelize_llama.py _save_list): the block input, the attention output, and the
    outputs of every other matmul (q, v, the first MLP matmul, the down projection); norms, RoPE, the activation
    and the other matmuls are recomputed."""
    b, s, h, t = lay.mbs, wl.seq_len / lay.cp, model.hidden, lay.tp
    sp = t if lay.sp else 1
    if model.mla is None:
        q, v = model.num_heads * model.head_size, model.kv_heads * model.head_size
    else:
        q, v = model.num_heads * model.mla.qk_head_dim, model.num_heads * model.mla.v_head_dim
    core_out = model.num_heads * (model.head_size if model.mla is None else model.mla.v_head_dim)
    if model.is_moe_layer(index):
        moe = model.moe
        assert moe is not None
        assignments = s * b / t * moe.top_k * wl.moe_imbalance
        mlp = assignments * (moe.expert_ffn_hidden / lay.etp + h) * lay.etp
    else:
        mlp = s * b * (model.ffn_hidden / t + h / sp)
    return ACT_BYTES * (s * b * (h / sp + (q + v + core_out) / t) + mlp)


def logits_bytes(model: ModelSpec, lay: Layout, wl: Workload, rt: Runtime) -> float:
    """Last stage: what the loss holds per logit element at its peak (Runtime.loss_bytes_per_logit: Megatron's
    16-bit logits plus their fp32 copy, Korthikanti sec. 4.3 4sbv/t; torchtitan's eager fp32 cross-entropy, or
    under TP torch's loss_parallel, Runtime.loss_parallel_bytes_per_logit)."""
    per = rt.loss_bytes_per_logit
    if lay.tp > 1 and rt.loss_parallel_bytes_per_logit is not None:
        per = rt.loss_parallel_bytes_per_logit
    return per * lay.mbs * wl.seq_len / lay.cp * model.vocab / lay.tp


def mtp_activation_bytes(model: ModelSpec, lay: Layout, wl: Workload, rt: Runtime) -> float:
    """Last stage, per MTP module: the projection's 2h input, one decoder layer's activations and a second set of
    logits (DeepSeek-V3 report sec. 2.2), for the one micro-batch whose head runs (as logits_bytes)."""
    if not model.num_mtp_layers:
        return 0.0
    sp = lay.tp if lay.sp else 1
    proj_in = ACT_BYTES * lay.mbs * wl.seq_len / lay.cp * 2 * model.hidden / sp
    layer = layer_activation_bytes(model, model.num_layers - 1, lay, wl, rt, "none")
    return model.num_mtp_layers * (proj_in + layer + logits_bytes(model, lay, wl, rt))


def embedding_activation_bytes(model: ModelSpec, lay: Layout, wl: Workload, rt: Runtime) -> float:
    """First stage: embedding output dropout mask per in-flight micro-batch (Korthikanti sec. 4.3)."""
    sp = lay.tp if lay.sp else 1
    return (1.0 if wl.uses_dropout(rt) else 0.0) * lay.mbs * wl.seq_len / lay.cp * model.hidden / sp
