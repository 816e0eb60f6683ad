"""Reduced-size copies of a ModelSpec that keep its structure, for running plans on small hardware.

`meshplan verify` cannot run a 671B model on a laptop, but it can run the same *kind* of model: the
same attention variant and GQA group size, the same MLP, the same dense-then-MoE layer pattern, the
same tied-or-not embeddings. `scale_model` shrinks every width and count that does not define the
structure and keeps every one that does. It imports no torch: the scaled spec also feeds the cost
model, whose prediction for the scaled run is compared with the measured one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from meshplan.costmodels.model import MLASpec, ModelSpec, MoESpec

__all__ = ["SCALES", "Scale", "scale_model"]

Scale = Literal["tiny", "small"]


@dataclass(frozen=True)
class _Dims:
    """The sizes of one scale. Every width is a multiple of 8 so TP degrees up to 8 divide it."""

    hidden: int
    vocab: int
    layers: int  # base layer count; raised when the MoE pattern needs more
    head_dim: int  # even: RoPE rotates pairs
    mha_heads: int  # heads of an MHA model (also MLA, which is MHA)
    kv_heads: int  # kv heads of a GQA model (query heads = group size * this)
    base_experts: int  # routed experts at least this many (and 2 * top_k), at most the original's
    max_seq_len: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


SCALES: MappingProxyType[str, _Dims] = MappingProxyType({
    # tiny: 3 layers so a pipeline of 2 stages can be split unevenly (2 + 1); test-suite size.
    "tiny": _Dims(hidden=32, vocab=128, layers=3, head_dim=8, mha_heads=4, kv_heads=2, base_experts=4,
                  max_seq_len=64, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                  qk_rope_head_dim=4, v_head_dim=8),
    # small: 6 layers so PP2 x VPP3 or PP3 x VPP2 have one layer per virtual stage.
    "small": _Dims(hidden=128, vocab=512, layers=6, head_dim=16, mha_heads=8, kv_heads=4, base_experts=8,
                   max_seq_len=256, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=16,
                   qk_rope_head_dim=8, v_head_dim=16),
})


def _width(size: int, spec: ModelSpec, hidden: int) -> int:
    """An intermediate size scaled with the model width (its ratio to hidden kept), rounded to 8, at least 8."""
    return max(8, 8 * round(size * hidden / spec.hidden / 8))


def _first_moe_layer(first_k_dense: int, layer_freq: int) -> int:
    """The smallest i with i >= first_k_dense and i % layer_freq == 0 (ModelSpec.is_moe_layer's rule)."""
    return -(-first_k_dense // layer_freq) * layer_freq


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


def _scale_moe(spec: ModelSpec, d: _Dims, ep: int = 1) -> MoESpec | None:
    """Fewer, narrower experts (a multiple of ep); top_k, shared experts and layer_freq kept; first_k_dense capped
    at 1."""
    m = spec.moe
    if m is None:
        return None
    experts = min(m.num_experts, max(d.base_experts, 2 * m.top_k))  # 2*top_k: routing stays a real choice
    experts = min(m.num_experts, _round_up(experts, ep))  # ep divides the original, so this stays within it
    return MoESpec(
        num_experts=experts,
        top_k=m.top_k,
        expert_ffn_hidden=_width(m.expert_ffn_hidden, spec, d.hidden),
        num_shared_experts=m.num_shared_experts,
        shared_ffn_hidden=None if m.shared_ffn_hidden is None else _width(m.shared_ffn_hidden, spec, d.hidden),
        first_k_dense=min(m.first_k_dense, 1),
        layer_freq=m.layer_freq,
    )


def _scale_mla(spec: ModelSpec, d: _Dims) -> MLASpec | None:
    a = spec.mla
    if a is None:
        return None
    return MLASpec(
        q_lora_rank=None if a.q_lora_rank is None else d.q_lora_rank,  # compressed queries or not, as the original
        kv_lora_rank=d.kv_lora_rank,
        qk_nope_head_dim=d.qk_nope_head_dim,
        qk_rope_head_dim=d.qk_rope_head_dim,
        v_head_dim=d.v_head_dim,
    )


def _heads(spec: ModelSpec, d: _Dims, heads_multiple: int = 1, kv_multiple: int = 1) -> tuple[int, int]:
    """(query heads, kv heads): the GQA group size heads/kv_heads is kept exactly; heads a multiple of
    `heads_multiple` and (GQA) kv heads of `kv_multiple`, raised within the original's counts."""
    if spec.kv_heads == spec.num_heads:  # MHA (and MLA)
        heads = min(spec.num_heads, _round_up(min(spec.num_heads, d.mha_heads), heads_multiple))
        return heads, heads
    group = spec.num_heads // spec.kv_heads
    step = math.lcm(kv_multiple, heads_multiple // math.gcd(heads_multiple, group))
    kv = min(spec.kv_heads, _round_up(min(spec.kv_heads, d.kv_heads), step))
    return kv * group, kv


def _num_layers(spec: ModelSpec, moe: MoESpec | None, base: int, requested: int | None) -> int:
    """Enough layers for one dense and one MoE layer where the original has both; never more than the original."""
    needed = 1
    if moe is not None:
        first_moe = _first_moe_layer(moe.first_k_dense, moe.layer_freq)
        has_dense = moe.first_k_dense > 0 or moe.layer_freq > 1
        needed = max(first_moe + 1, 2 if has_dense else 1)
    if requested is not None:
        if requested < needed:
            raise ValueError(
                f"{spec.name}: {requested} layer(s) cannot hold its dense-then-MoE pattern "
                f"(first_k_dense {moe.first_k_dense if moe else 0}, layer_freq {moe.layer_freq if moe else 1}); "
                f"ask for at least {needed}"
            )
        return requested
    return min(spec.num_layers, max(base, needed))


def scale_model(spec: ModelSpec, scale: Scale, *, num_layers: int | None = None, heads_multiple: int = 1,
                kv_multiple: int = 1, experts_multiple: int = 1) -> ModelSpec:
    """A reduced copy of `spec` named "<name>@<scale>" with the same structure.

    Kept: the GQA group size (heads / kv_heads), MHA-ness, MLA (with q compression or not), the MLP
    kind, norm kind, biases, learned positions vs RoPE, tied embeddings, MoE top_k, shared-expert
    count and layer_freq, and the ratios of the MLP and expert widths to hidden (rounded to 8).
    Reduced (see SCALES): hidden, vocab, head_dim, kv heads (at most 2 tiny / 4 small), the MLA ranks
    and head dims, max_seq_len, the routed experts (to min(original, max(4 tiny / 8 small, 2*top_k))),
    first_k_dense (capped at 1) and the layers (3 tiny / 6 small, or more if the MoE pattern needs it
    to show one dense and one MoE layer, never more than the original). `num_layers` overrides the
    layer count (e.g. to hold a plan's pipeline layout) and must still show the pattern.
    `heads_multiple`, `kv_multiple`, `experts_multiple` keep a plan's degrees dividing the scaled model:
    heads a multiple of tp (tp * cp for all-to-all CP), kv heads of tp, routed experts of ep, raised
    towards the original's counts (which the plan's degrees already divide).
    Dropped: DeepSeek-V3's multi-token-prediction modules (num_mtp_layers = 0), which the reference
    executor does not build.
    """
    if scale not in SCALES:
        raise ValueError(f"unknown scale {scale!r}; choose one of {', '.join(SCALES)}")
    d = SCALES[scale]
    moe = _scale_moe(spec, d, experts_multiple)
    mla = _scale_mla(spec, d)
    heads, kv_heads = _heads(spec, d, heads_multiple, kv_multiple)
    return ModelSpec(
        name=f"{spec.name}@{scale}",
        num_layers=_num_layers(spec, moe, d.layers, num_layers),
        hidden=d.hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=None if mla is not None else d.head_dim,  # MLA's head sizes live in its own block
        ffn_hidden=_width(spec.ffn_hidden, spec, d.hidden),
        mlp=spec.mlp,
        vocab=d.vocab,
        tied_embeddings=spec.tied_embeddings,
        norm=spec.norm,
        qkv_bias=spec.qkv_bias,
        linear_bias=spec.linear_bias,
        learned_positions=spec.learned_positions,
        max_seq_len=d.max_seq_len,
        moe=moe,
        mla=mla,
        num_mtp_layers=0,
    )
