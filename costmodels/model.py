"""ModelSpec: the architecture the cost model needs, independent of where it was read from."""

from __future__ import annotations

from functools import cached_property
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MLPKind = Literal["gelu", "relu2", "swiglu"]

# Bounds far above any published model (a typo of 1e12 must be refused, not run): per-layer work is O(layers), and
# widths, vocabularies and expert counts enter float arithmetic and memory that must stay finite.
MAX_LAYERS = 1024  # the deepest published Transformer has 1,000 (DeepNet, Wang et al. 2022, arXiv:2203.00555)
MAX_WIDTH = 2**20  # hidden, FFN, head and latent widths, head counts (the largest published hidden is 25,600)
MAX_VOCAB = 2**24  # the largest published vocabularies are about 256K
MAX_EXPERTS = 2**16  # the largest published MoE has 384 routed experts
MAX_SEQ = 2**30  # context lengths (the longest published is 10M)


class MoESpec(BaseModel):
    """Mixture-of-experts block. Layer i is MoE iff i >= first_k_dense and i % layer_freq == 0
    (the rule of Hugging Face's deepseek_v3 modelling code; Mixtral/Qwen-MoE are first_k_dense=0, layer_freq=1)."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid", strict=True)  # no true-as-1 or "4096"
    num_experts: int = Field(gt=0, le=MAX_EXPERTS)
    top_k: int = Field(gt=0, le=MAX_EXPERTS)
    expert_ffn_hidden: int = Field(gt=0, le=MAX_WIDTH)  # intermediate size of one routed expert
    num_shared_experts: int = Field(default=0, ge=0, le=MAX_EXPERTS)
    # per shared expert; default expert_ffn_hidden
    shared_ffn_hidden: int | None = Field(default=None, gt=0, le=MAX_WIDTH)
    first_k_dense: int = Field(default=0, ge=0, le=MAX_LAYERS)
    layer_freq: int = Field(default=1, gt=0, le=MAX_LAYERS)
    # the router, for the launch exports only (the cost model prices the experts' work, not how they were chosen):
    # gate scores by softmax or sigmoid (DeepSeek-V3), a per-expert bias for auxiliary-loss-free balancing (DeepSeek-V3
    # sec. 2.1.2), the routed weights' scale, group-limited routing (num_groups, group_topk), the balancing loss
    score_function: Literal["softmax", "sigmoid"] = "softmax"
    expert_bias: bool = False
    routed_scaling_factor: float | None = Field(default=None, gt=0, le=1e6)
    num_groups: int | None = Field(default=None, gt=0, le=MAX_EXPERTS)
    group_topk: int | None = Field(default=None, gt=0, le=MAX_EXPERTS)
    load_balancing: Literal["aux_loss", "seq_aux_loss", "none"] | None = None

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.top_k > self.num_experts:
            raise ValueError(f"moe.top_k ({self.top_k}) exceeds moe.num_experts ({self.num_experts})")
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError("moe.num_groups and moe.group_topk go together (group-limited routing)")
        if self.num_groups is not None and self.group_topk is not None and (
                self.num_experts % self.num_groups or self.group_topk > self.num_groups):
            raise ValueError(f"moe.num_groups ({self.num_groups}) must divide moe.num_experts "
                             f"({self.num_experts}) and be at least moe.group_topk ({self.group_topk})")
        return self

    @property
    def shared_hidden(self) -> int:
        return self.shared_ffn_hidden or self.expert_ffn_hidden


class RopeScaling(BaseModel):
    """RoPE frequency scaling for long context, as Hugging Face's rope_scaling block states it: "llama3" (Llama 3.1's
    banded scaling: factor, low/high_freq_factor, original length) or "yarn" (Peng et al. 2023, arXiv:2309.00071:
    factor, beta_fast/slow, mscale, mscale_all_dim, original length). Carried to the launch exports only."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid", strict=True)
    kind: Literal["llama3", "yarn"]
    factor: float = Field(gt=0, le=1e6)
    original_max_position_embeddings: int = Field(gt=0, le=MAX_SEQ)
    low_freq_factor: float | None = Field(default=None, gt=0, le=1e6)
    high_freq_factor: float | None = Field(default=None, gt=0, le=1e6)
    beta_fast: float | None = Field(default=None, gt=0, le=1e6)
    beta_slow: float | None = Field(default=None, gt=0, le=1e6)
    mscale: float | None = Field(default=None, ge=0, le=1e6)
    mscale_all_dim: float | None = Field(default=None, ge=0, le=1e6)


class MLASpec(BaseModel):
    """Multi-head latent attention (DeepSeek-V2 paper, section 2.1)."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid", strict=True)  # no true-as-1 or "4096"
    q_lora_rank: int | None = Field(default=None, gt=0, le=MAX_WIDTH)  # None: queries are not compressed (V2-Lite)
    kv_lora_rank: int = Field(gt=0, le=MAX_WIDTH)
    qk_nope_head_dim: int = Field(gt=0, le=MAX_WIDTH)
    qk_rope_head_dim: int = Field(gt=0, le=MAX_WIDTH)
    v_head_dim: int = Field(gt=0, le=MAX_WIDTH)

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim




class ModelSpec(BaseModel):
    """A decoder-only transformer. `ffn_hidden` is the dense MLP's intermediate size (dense layers only for MoE)."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid", strict=True)  # no true-as-1 or "4096"
    name: str
    num_layers: int = Field(gt=0, le=MAX_LAYERS)
    hidden: int = Field(gt=0, le=MAX_WIDTH)
    num_heads: int = Field(gt=0, le=MAX_WIDTH)
    num_kv_heads: int | None = Field(default=None, gt=0, le=MAX_WIDTH)  # default: num_heads (MHA)
    head_dim: int | None = Field(default=None, gt=0, le=MAX_WIDTH)  # default: hidden // num_heads
    ffn_hidden: int = Field(gt=0, le=MAX_WIDTH)
    mlp: MLPKind = "swiglu"
    vocab: int = Field(gt=0, le=MAX_VOCAB)
    tied_embeddings: bool = False
    norm: Literal["layernorm", "rmsnorm"] = "rmsnorm"
    qkv_bias: bool = False
    linear_bias: bool = False  # bias on out-proj and MLP linears (GPT-2, Megatron GPT)
    learned_positions: bool = False  # absolute position embeddings (GPT-2) instead of RoPE
    max_seq_len: int | None = Field(default=None, gt=0, le=MAX_SEQ)
    moe: MoESpec | None = None
    mla: MLASpec | None = None
    num_mtp_layers: int = Field(default=0, ge=0, le=MAX_LAYERS)  # DeepSeek-V3 multi-token-prediction modules
    # what the model trains with beyond its shape, for the launch exports (None: not stated, the framework's default)
    rope_theta: float | None = Field(default=None, gt=0, le=1e12)
    rope_scaling: RopeScaling | None = None
    norm_eps: float | None = Field(default=None, gt=0, le=1.0)
    dropout: float | None = Field(default=None, ge=0, lt=1.0)  # hidden and attention dropout probability
    # the published checkpoint's weights (DeepSeek-V3 ships FP8): what `serve` loads unless told otherwise
    weight_dtype: Literal["bf16", "fp8", "fp4"] | None = None
    # its FP8 weights carry one scale per 128x128 block (quantization_config.weight_block_size; DeepSeek-V3, Qwen3
    # FP8), which the engines run on their block-scaled GEMM kernels
    weight_block_scaled: bool = False

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        kv = self.kv_heads
        if self.num_heads % kv:
            raise ValueError(f"kv heads ({kv}) must divide attention heads ({self.num_heads})")
        if self.head_dim is None and self.mla is None and self.hidden % self.num_heads:
            raise ValueError(
                f"heads ({self.num_heads}) must divide hidden ({self.hidden}), or give head_dim explicitly"
            )
        if self.moe is not None and self.moe.first_k_dense > self.num_layers:
            raise ValueError(f"moe.first_k_dense ({self.moe.first_k_dense}) exceeds num_layers ({self.num_layers})")
        if self.weight_block_scaled and self.weight_dtype != "fp8":
            raise ValueError("weight_block_scaled describes FP8 weights: set weight_dtype \"fp8\" or drop it")
        return self

    # ---- derived shape -------------------------------------------------------------------------
    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.num_heads

    def is_moe_layer(self, index: int) -> bool:
        m = self.moe
        return m is not None and index >= m.first_k_dense and index % m.layer_freq == 0

    @cached_property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_layers))

    # ---- parameter counts (weights only; biases and norms included) ----------------------------
    def attention_params(self) -> int:
        h = self.hidden
        if self.mla is not None:
            a = self.mla
            n = self.num_heads
            q = ((h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * n * a.qk_head_dim) if a.q_lora_rank
                 else h * n * a.qk_head_dim)
            kv = (h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
                  + a.kv_lora_rank * n * (a.qk_nope_head_dim + a.v_head_dim))
            return q + kv + n * a.v_head_dim * h
        d = self.head_size
        q_out = self.num_heads * d
        kv_out = self.kv_heads * d
        params = h * (q_out + 2 * kv_out) + q_out * h
        if self.qkv_bias:
            params += q_out + 2 * kv_out
        if self.linear_bias:
            params += h
        return params

    def mlp_params(self, ffn: int) -> int:
        h = self.hidden
        mats = 3 if self.mlp == "swiglu" else 2
        params = mats * h * ffn
        if self.linear_bias:
            params += (mats - 1) * ffn + h
        return params

    def norm_params(self) -> int:
        return self.hidden * (2 if self.norm == "layernorm" else 1)

    def layer_params(self, index: int, active_only: bool = False) -> int:
        """Parameters of decoder layer `index`; with active_only, only the experts one token uses."""
        params = self.attention_params() + 2 * self.norm_params()
        if not self.is_moe_layer(index):
            return params + self.mlp_params(self.ffn_hidden)
        m = self.moe
        assert m is not None
        routed = m.top_k if active_only else m.num_experts
        params += self.hidden * m.num_experts  # router
        params += routed * self.mlp_params(m.expert_ffn_hidden)
        params += m.num_shared_experts * self.mlp_params(m.shared_hidden)
        return params

    def embedding_params(self) -> int:
        params = self.vocab * self.hidden
        if self.learned_positions and self.max_seq_len:
            params += self.max_seq_len * self.hidden
        return params

    def head_params(self) -> int:
        """Final norm plus the LM head (zero extra weights when tied)."""
        return self.norm_params() + (0 if self.tied_embeddings else self.vocab * self.hidden)

    def mtp_params(self, active_only: bool = False) -> int:
        """DeepSeek-V3 MTP module: a projection 2h->h, two norms and one (MoE) decoder layer; shares embedding/head."""
        if not self.num_mtp_layers:
            return 0
        per = (2 * self.hidden * self.hidden + 2 * self.norm_params()
               + self.layer_params(self.num_layers - 1, active_only))
        return self.num_mtp_layers * per

    def total_params(self, include_mtp: bool = False) -> int:
        body = sum(self.layer_params(i) for i in range(self.num_layers))
        return self.embedding_params() + body + self.head_params() + (self.mtp_params() if include_mtp else 0)

    def active_params(self, include_mtp: bool = False) -> int:
        body = sum(self.layer_params(i, active_only=True) for i in range(self.num_layers))
        return self.embedding_params() + body + self.head_params() + (self.mtp_params(True) if include_mtp else 0)
