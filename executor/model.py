"""The reference transformer: plain PyTorch modules built from a ModelSpec, in one readable file.

It is the model every distributed run of a plan is checked against, so it favours being obviously
right over being fast: attention through `scaled_dot_product_attention`, MoE experts looped over one
by one with exact (capacity-free) routing. Its parameters are exactly the ones the cost model counts
(`ModelSpec.total_params()`); the tests hold the two to the same number.

Layout (torchtitan style): `tok_embeddings` (+ `pos_embeddings` for learned positions), `layers`
(an nn.ModuleList of TransformerBlock, which later steps split into pipeline stages), `norm`,
`output`. Sources: RoPE, Su et al. 2021 (arXiv:2104.09864); GQA, Ainslie et al. 2023
(arXiv:2305.13245); SwiGLU, Shazeer 2020 (arXiv:2002.05202); squared ReLU, So et al. 2021
(arXiv:2109.08668); MoE gating, Mixtral (Jiang et al. 2024, arXiv:2401.04088, eq. 1-2); MLA,
DeepSeek-V2 (arXiv:2405.04434, sec. 2.1) as used by DeepSeek-V3 (arXiv:2412.19437).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from meshplan.costmodels.model import ModelSpec

__all__ = [
    "INIT_STD", "NORM_EPS", "ROPE_THETA", "AttentionCore", "ModelChunk", "Transformer", "TransformerBlock",
    "apply_rope", "build_model", "num_params", "token_loss",
]

# ModelSpec has no field for these; the values below are the common defaults, fixed so runs compare.
ROPE_THETA = 10000.0  # Su et al. 2021 / Llama 2 base; Llama 3's 500000 and YaRN scaling matter only at long context
NORM_EPS = 1e-5
INIT_STD = 0.02  # GPT-2 / Megatron-LM init_method_std


# ---- building blocks ---------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """x / rms(x) * weight (Zhang & Sennrich 2019); computed in the input dtype (float64 in the reference)."""

    def __init__(self, dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + NORM_EPS) * self.weight


def make_norm(spec: ModelSpec, dim: int, dtype: torch.dtype) -> nn.Module:
    """The norm the spec names: LayerNorm has weight and bias, RMSNorm only a weight (as ModelSpec.norm_params)."""
    if spec.norm == "layernorm":
        return nn.LayerNorm(dim, eps=NORM_EPS, dtype=dtype)
    return RMSNorm(dim, dtype)


def rope_cos_sin(positions: torch.Tensor, dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (seq, dim) for the given absolute positions (Su et al. 2021, eq. 34 frequencies)."""
    inv_freq = ROPE_THETA ** (-torch.arange(0, dim, 2, dtype=torch.float64, device=positions.device) / dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)  # rotate-half layout: pair i with i + dim/2
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, seq, heads, dim) by its positions, in the rotate-half (GPT-NeoX / HF Llama) layout.

    Real arithmetic rather than complex numbers, so it runs in any dtype and shards like any tensor.
    """
    cos, sin = rope_cos_sin(positions, x.shape[-1], x.dtype)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


AttentionCore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""softmax attention of q, k, v (batch, seq, heads, dim) -> (batch, seq, q heads, v dim): the part of an
attention layer that context parallelism (a ring or all-to-all over this rank's tokens) and selective
recomputation (checkpointing just this part, Korthikanti et al. 2022 sec. 5) replace."""


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal softmax attention on (batch, seq, heads, dim) tensors; kv heads are repeated for GQA.

    SDPA is exact in float64 on CPU (its math kernel), and allows a value dim other than the qk dim (MLA).
    """
    group = q.shape[2] // k.shape[2]
    if group > 1:  # GQA: query head h reads kv head h // group (Ainslie et al. 2023)
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
    return out.transpose(1, 2)


class Attention(nn.Module):
    """Multi-head attention with GQA and RoPE; q/k/v biases iff qkv_bias, out-proj bias iff linear_bias."""

    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        h, d = spec.hidden, spec.head_size
        self.n_heads, self.n_kv_heads, self.head_dim = spec.num_heads, spec.kv_heads, d
        self.use_rope = not spec.learned_positions
        self.wq = nn.Linear(h, self.n_heads * d, bias=spec.qkv_bias, dtype=dtype)
        self.wk = nn.Linear(h, self.n_kv_heads * d, bias=spec.qkv_bias, dtype=dtype)
        self.wv = nn.Linear(h, self.n_kv_heads * d, bias=spec.qkv_bias, dtype=dtype)
        self.wo = nn.Linear(self.n_heads * d, h, bias=spec.linear_bias, dtype=dtype)
        self.core: AttentionCore = causal_attention  # context parallelism and selective recompute replace it

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # -1, not n_heads: under tensor parallelism this rank holds a slice of the heads
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        if self.use_rope:
            q, k = apply_rope(q, positions), apply_rope(k, positions)
        return self.wo(self.core(q, k, v).reshape(b, s, -1))


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2 sec. 2.1, eq. 37-47), without the inference-time absorption.

    Queries go through an optional low-rank bottleneck (q_lora_rank), keys and values through a shared
    latent of kv_lora_rank; RoPE acts only on the decoupled qk_rope_head_dim part, whose key is one
    head shared by all heads. The latent norms are RMSNorms as in DeepSeek (whatever spec.norm says),
    and there are no biases: that is what ModelSpec.attention_params counts for MLA.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        a = spec.mla
        assert a is not None
        h, n = spec.hidden, spec.num_heads
        self.n_heads, self.nope, self.rope, self.v_dim = n, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim
        self.kv_lora_rank = a.kv_lora_rank
        self.q_compressed = a.q_lora_rank is not None
        if not self.q_compressed:  # V2-Lite: queries not compressed
            self.wq = nn.Linear(h, n * a.qk_head_dim, bias=False, dtype=dtype)
        else:
            self.wq_a = nn.Linear(h, a.q_lora_rank, bias=False, dtype=dtype)
            self.q_norm = RMSNorm(a.q_lora_rank, dtype)
            self.wq_b = nn.Linear(a.q_lora_rank, n * a.qk_head_dim, bias=False, dtype=dtype)
        self.wkv_a = nn.Linear(h, a.kv_lora_rank + a.qk_rope_head_dim, bias=False, dtype=dtype)
        self.kv_norm = RMSNorm(a.kv_lora_rank, dtype)
        self.wkv_b = nn.Linear(a.kv_lora_rank, n * (a.qk_nope_head_dim + a.v_head_dim), bias=False, dtype=dtype)
        self.wo = nn.Linear(n * a.v_head_dim, h, bias=False, dtype=dtype)
        self.core: AttentionCore = causal_attention  # context parallelism and selective recompute replace it

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_compressed:
            return self.wq_b(self.q_norm(self.wq_a(x)))
        return self.wq(x)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self._queries(x).view(b, s, -1, self.nope + self.rope)  # -1: this rank's heads under TP
        heads = q.shape[2]
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.wkv_b(self.kv_norm(latent)).view(b, s, heads, self.nope + self.v_dim)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = apply_rope(k_pe.view(b, s, 1, self.rope), positions).expand(b, s, heads, self.rope)
        q = torch.cat((q_nope, apply_rope(q_pe, positions)), dim=-1)
        k = torch.cat((k_nope, k_pe), dim=-1)
        return self.wo(self.core(q, k, v).reshape(b, s, -1))  # scale 1/sqrt(nope + rope), as DeepSeek


class MLP(nn.Module):
    """gelu / relu2: w2(act(w1 x)); swiglu: w2(silu(w1 x) * w3 x). Biases on every linear iff linear_bias."""

    def __init__(self, spec: ModelSpec, ffn: int, dtype: torch.dtype) -> None:
        super().__init__()
        h, bias = spec.hidden, spec.linear_bias
        self.kind = spec.mlp
        self.w1 = nn.Linear(h, ffn, bias=bias, dtype=dtype)
        self.w2 = nn.Linear(ffn, h, bias=bias, dtype=dtype)
        if self.kind == "swiglu":
            self.w3 = nn.Linear(h, ffn, bias=bias, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":  # Shazeer 2020, eq. 6 (Swish_1 = SiLU)
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        if self.kind == "relu2":  # So et al. 2021 (Primer), as in Nemotron-4
            return self.w2(F.relu(self.w1(x)).square())
        return self.w2(F.gelu(self.w1(x)))  # exact erf GELU (Hendrycks & Gimpel 2016), Megatron's default


class MoE(nn.Module):
    """Routed experts plus always-on shared experts, computed exactly: no capacity, no token dropping.

    Gating (Mixtral, Jiang et al. 2024 eq. 1-2; Qwen3-MoE with norm_topk_prob): softmax over all experts'
    router logits, keep the top_k, renormalise those k weights to sum to 1 (this equals softmax over the
    top-k logits). DeepSeek-V3's sigmoid affinities with a bias-corrected top-k (its report, eq. 12-16)
    are not implemented; neither are auxiliary balance losses, so the loss is pure cross-entropy.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype) -> None:
        super().__init__()
        m = spec.moe
        assert m is not None
        self.top_k = m.top_k
        self.router = nn.Linear(spec.hidden, m.num_experts, bias=False, dtype=dtype)
        self.experts = nn.ModuleList(MLP(spec, m.expert_ffn_hidden, dtype) for _ in range(m.num_experts))
        self.shared_experts = nn.ModuleList(MLP(spec, m.shared_hidden, dtype) for _ in range(m.num_shared_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids), both (tokens, top_k), for flattened tokens x (tokens, hidden)."""
        probs = self.router(x).softmax(dim=-1)
        weights, ids = probs.topk(self.top_k, dim=-1)
        return weights / weights.sum(dim=-1, keepdim=True), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            # every expert runs, on zero tokens if none chose it, so its gradient is zeros and never None
            token, slot = (ids == e).nonzero(as_tuple=True)
            y = expert(x.index_select(0, token)) * weights[token, slot, None]
            out = out.index_add(0, token, y)
        for shared in self.shared_experts:
            out = out + shared(x)
        return out.view(shape)


class TransformerBlock(nn.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then + mlp_or_moe(norm(x))."""

    def __init__(self, spec: ModelSpec, index: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.index = index
        self.attention_norm = make_norm(spec, spec.hidden, dtype)
        self.attention = MLAttention(spec, dtype) if spec.mla is not None else Attention(spec, dtype)
        self.ffn_norm = make_norm(spec, spec.hidden, dtype)
        self.is_moe = spec.is_moe_layer(index)
        self.feed_forward = MoE(spec, dtype) if self.is_moe else MLP(spec, spec.ffn_hidden, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), positions)
        return x + self.feed_forward(self.ffn_norm(x))


def embed_tokens(tok: nn.Module, pos: nn.Module | None, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Token embeddings, plus learned position embeddings when the model has them."""
    h = tok(tokens)
    if pos is not None:
        if positions.device.type != "meta" and int(positions.max()) >= pos.num_embeddings:  # meta: shapes only
            raise ValueError(f"position {int(positions.max())} beyond max_seq_len {pos.num_embeddings}")
        h = h + pos(positions)[None]
    return h


# ---- the model ---------------------------------------------------------------------------------
class Transformer(nn.Module):
    """Decoder-only LM: embeddings, `layers`, final `norm`, `output` head, mean token cross-entropy.

    `positions` (seq,) are absolute token positions, arange(seq) by default; a context-parallel rank
    passes the positions of the chunk it holds.
    """

    def __init__(self, spec: ModelSpec, dtype: torch.dtype = torch.float64) -> None:
        super().__init__()
        if spec.learned_positions and spec.max_seq_len is None:
            raise ValueError(f"{spec.name}: learned positions need max_seq_len (the position table's size)")
        self.spec = spec
        self.tok_embeddings = nn.Embedding(spec.vocab, spec.hidden, dtype=dtype)
        self.pos_embeddings = (
            nn.Embedding(spec.max_seq_len, spec.hidden, dtype=dtype) if spec.learned_positions else None
        )
        self.layers = nn.ModuleList(TransformerBlock(spec, i, dtype) for i in range(spec.num_layers))
        self.norm = make_norm(spec, spec.hidden, dtype)
        self.output = nn.Linear(spec.hidden, spec.vocab, bias=False, dtype=dtype)
        if spec.tied_embeddings:  # one Parameter, counted and updated once (parameters() deduplicates it)
            self.output.weight = self.tok_embeddings.weight

    def embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return embed_tokens(self.tok_embeddings, self.pos_embeddings, tokens, positions)

    def hidden_states(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """The final-normed hidden states (batch, seq, hidden)."""
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.embed(tokens, positions)
        for layer in self.layers:
            h = layer(h, positions)
        return self.norm(h)

    def logits(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        return self.output(self.hidden_states(tokens, positions))

    def forward(
        self, tokens: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Mean cross-entropy over all batch * seq tokens."""
        return token_loss(self.logits(tokens, positions), labels)


def token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over all tokens of logits (batch, seq, vocab) against labels (batch, seq)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


class ModelChunk(nn.Module):
    """Decoder layers [start, stop) of a Transformer, as a pipeline stage's model chunk holds them: the
    embeddings too if start is 0, the final norm and head too if stop is the last layer.

    The modules are the model's own, not copies, and keep the model's parameter names (`layers` is a
    ModuleDict keyed by global layer index, torchtitan's convention), so a chunk's gradients compare with
    the reference by name. A tied head in a last chunk that is not also first keeps the embedding's
    Parameter under the name `output.weight`; keeping it in step with the first chunk's copy (Megatron's
    embedding group) is the pipeline's job. `positions` are the absolute positions of the tokens this
    rank runs (a context-parallel rank's chunks); None means arange of the input's sequence length.
    Input: token ids (batch, seq) if first, else hidden states; output: logits if last, else hidden states.
    """

    def __init__(self, model: Transformer, start: int, stop: int, positions: torch.Tensor | None = None) -> None:
        super().__init__()
        n = len(model.layers)
        if not 0 <= start < stop <= n:
            raise ValueError(f"chunk [{start}, {stop}) is not a non-empty range of the {n} layers")
        self.start, self.stop = start, stop
        self.first, self.last = start == 0, stop == n
        self.positions = positions
        if self.first:
            self.tok_embeddings = model.tok_embeddings
            self.pos_embeddings = model.pos_embeddings
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(start, stop)})
        if self.last:
            self.norm = model.norm
            self.output = model.output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = self.positions if self.positions is not None else torch.arange(x.shape[1], device=x.device)
        if self.first:
            x = embed_tokens(self.tok_embeddings, self.pos_embeddings, x, positions)
        for layer in self.layers.values():
            x = layer(x, positions)
        if self.last:
            x = self.output(self.norm(x))
        return x


# ---- initialisation ----------------------------------------------------------------------------
def _init_value(name: str, p: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Norm weights 1, biases 0, every matrix and embedding N(0, INIT_STD^2)."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "bias":
        return torch.zeros_like(p)
    if p.dim() == 1:  # RMSNorm / LayerNorm weight
        return torch.ones_like(p)
    return torch.randn(p.shape, generator=gen, dtype=torch.float64).mul_(INIT_STD).to(p.dtype)


def build_model(spec: ModelSpec, dtype: torch.dtype = torch.float64, seed: int = 0) -> Transformer:
    """A Transformer whose parameters depend only on (spec, dtype, seed), drawn in named_parameters order.

    The draws are made in float64 and cast, so two dtypes hold the same model up to rounding; the global
    RNG is neither read nor advanced.
    """
    with torch.random.fork_rng(devices=[]):  # the modules' own default init would advance the global RNG
        model = Transformer(spec, dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_init_value(name, p, gen))
    return model


def probe_model(spec: ModelSpec, dtype: torch.dtype, device: str | torch.device) -> Transformer:
    """The model's shapes for timing and memory probes: built on `device` with the modules' own initialisation, not
    build_model's float64 draws on the CPU (minutes for an 8B model; a probe's timings do not depend on values)."""
    with torch.device(device):
        return Transformer(spec, dtype)


def num_params(model: nn.Module) -> int:
    """Distinct parameters (a tied embedding counts once), the figure ModelSpec.total_params() predicts."""
    return sum(p.numel() for p in model.parameters())

