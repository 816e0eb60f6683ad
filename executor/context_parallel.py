"""Context parallelism of the reference model: each cp rank runs a load-balanced share of every sequence.

Sharding (Llama 3, Dubey et al. 2024, arXiv:2407.21783 sec. 3.3.2; Megatron-LM
`megatron/training/utils.py:get_batch_on_this_cp_rank`): a sequence is cut into 2*cp equal chunks and
cp rank r holds chunks r and 2cp-1-r, so every rank has the same amount of causal attention work.
Everything outside attention is per token, so a rank runs the reference model on its tokens unchanged,
with their absolute positions (RoPE and learned position embeddings alike). Only the attention core
needs the other ranks' keys and values; two cores replace `attention.core` (the planner's `cp_comm`):

- "ring", `RingAttention`: Ring Attention (Liu et al. 2023, arXiv:2310.01889; Megatron-Core /
  TransformerEngine `AttnFuncWithCPAndKVP2P`). This rank's k, v go round the cp ring, cp-1 shifts; each block
  is masked by absolute positions and merged by log-sum-exp (online softmax, Milakov & Gimelshein 2018,
  arXiv:1805.02867).
- "a2a", `UlyssesAttention`: DeepSpeed-Ulysses (Jacobs et al. 2023, arXiv:2309.14509, sec. 3). q, k, v go
  all-to-all from (own tokens, all heads) to (all tokens, heads / cp), plain causal attention runs in sequence
  order, and the output goes back the same way.

Both are exact (float64 matches the single-process attention to ~1e-15) and differentiable through torch's
own functional `all_to_all_single` (torch.distributed._functional_collectives), whose registered backward is
the reverse all-to-all: a ring shift's gradient travels the other way round. Gradients: parameters are
replicated over cp; every rank's loss is the mean over its own (equally many) tokens, and the ring's backward
returns to each rank the gradient its k, v received from the others' losses, so averaging gradients over
dp x cp (`meshes["dp_cp"]`) gives the gradient of the global mean (executor/plan_run.py averages so).

Measured on torch 2.13 CPU/gloo: torch's own `torch.distributed.tensor.experimental.context_parallel`
does not run here (float64 and float32): SDPA dispatches to `aten._scaled_dot_product_flash_attention_for_cpu`,
which has no DTensor sharding strategy (NotImplementedError); forcing the math backend fails with
"aten.add.Tensor got mixed torch.Tensor and DTensor". Its ring handlers exist only for the CUDA flash,
efficient and cuDNN kernels. Hence the hand-written cores below, on torch's collectives, which do work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from meshplan.executor.compare import merge_reports
from meshplan.executor.model import ModelChunk, Transformer, causal_attention
from meshplan.executor.reference import RunResult

__all__ = ["CP_KINDS", "INJECTIONS", "RingAttention", "UlyssesAttention", "apply_context_parallel", "cp_positions",
           "cp_shard", "cp_unshard", "make_core", "merge_rank_results", "shard_positions"]

CP_KINDS = ("ring", "a2a")  # costmodels.config.CpComm

# Deliberate faults (plan_rank's inject=, `meshplan verify --inject`), so tests can show a wrong layout is caught:
#   "contiguous-shard"  a rank gets plain contiguous chunk r of cp (tokens, labels, positions), while the cores
#                       still mask and order by the load-balanced positions;
#   "no-cp-grad-sync"   gradients averaged over dp only, not over dp x cp.
INJECTIONS = ("contiguous-shard", "no-cp-grad-sync")


# ---- which tokens a cp rank holds ---------------------------------------------------------------------
def cp_positions(seq: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Absolute positions cp rank `cp_rank` runs, in its local order: chunk r, then chunk 2cp-1-r of 2cp."""
    if cp < 1 or not 0 <= cp_rank < cp:
        raise ValueError(f"cp rank {cp_rank} outside a cp group of {cp}")
    if seq % (2 * cp):
        raise ValueError(f"sequence length {seq} is not divisible by 2*cp = {2 * cp} (load-balanced causal CP)")
    c = seq // (2 * cp)
    head, tail = cp_rank * c, (2 * cp - 1 - cp_rank) * c
    return torch.cat((torch.arange(head, head + c), torch.arange(tail, tail + c)))


def shard_positions(seq: int, cp: int, cp_rank: int, inject: str | None = None) -> torch.Tensor:
    """The sequence positions this cp rank holds: its load-balanced chunks (cp_positions), or under the
    "contiguous-shard" fault plain chunk cp_rank of cp."""
    if inject == "contiguous-shard":
        return torch.arange(cp_rank * seq // cp, (cp_rank + 1) * seq // cp)
    return cp_positions(seq, cp, cp_rank)


def cp_shard(x: torch.Tensor, cp: int, cp_rank: int, dim: int = 1) -> torch.Tensor:
    """This cp rank's tokens of x (tokens, labels or hidden states) along the sequence dim `dim`."""
    return x.index_select(dim, cp_positions(x.shape[dim], cp, cp_rank).to(x.device))


def cp_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence from every cp rank's shard (in cp rank order): the inverse of cp_shard."""
    cp = len(shards)
    seq = shards[0].shape[dim] * cp
    order = torch.cat([cp_positions(seq, cp, r) for r in range(cp)])
    return torch.cat(list(shards), dim=dim).index_select(dim, torch.argsort(order).to(shards[0].device))


# ---- ring attention ----------------------------------------------------------------------------------
def _block_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal attention of q against one k, v block by absolute positions: (out (b, sq, h, dv), lse (b, sq, h)).

    Masked scores are the dtype's lowest finite value, not -inf (as SDPA's math kernel and flash-attention):
    a row with no visible key here gives a finite lse ~ finfo.min whose merge weight is exactly 0, and no NaN
    reaches the backward. GQA kv heads are repeated here, after the ring, so only kv heads travel.
    """
    group = q.shape[2] // k.shape[2]
    if group > 1:  # query head h reads kv head h // group (Ainslie et al. 2023), as causal_attention
        k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    hidden = k_pos.to(q.device)[None, :] > q_pos.to(q.device)[:, None]
    scores = scores.masked_fill(hidden, torch.finfo(scores.dtype).min)
    lse = scores.logsumexp(dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", (scores - lse[..., None]).exp(), v)
    return out, lse.transpose(1, 2)


def _merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial softmax attentions over disjoint key sets, merged exactly by their log-sum-exps
    (flash-attention's rescaling, Dao et al. 2022 alg. 1; Megatron-Core's CP correction)."""
    new = torch.logaddexp(lse, lse_b)
    return out * (lse - new).exp()[..., None] + out_b * (lse_b - new).exp()[..., None], new


def _ring_shift(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """x of the previous cp rank (r-1 sends to r, r to r+1); autograd sends the gradient back to r-1.

    torch's functional all_to_all_single with one non-empty split each way (what torch's own CP rotates kv
    with, via funcol.permute_tensor): its registered backward is the reverse all-to-all.
    """
    cp, rank, n = dist.get_world_size(group), dist.get_rank(group), x.numel()
    send, recv = [0] * cp, [0] * cp
    send[(rank + 1) % cp] = n
    recv[(rank - 1) % cp] = n
    return funcol.all_to_all_single_autograd(x.reshape(-1), recv, send, group).view(x.shape)


@dataclass(frozen=True)
class RingAttention:
    """Ring attention over `group` (the cp group): an AttentionCore for this rank's load-balanced tokens.

    q (b, s_local, heads, d), k (b, s_local, kv heads, d), v (b, s_local, kv heads, dv) -> (b, s_local, heads, dv).
    Step i attends to the k, v of cp rank r-i (step 0: its own), masked by absolute positions, merged by
    log-sum-exp; k and v travel packed in one buffer. Softmax scale 1/sqrt(d), as SDPA's default. Every
    block is computed whole (masked), not skipped by halves as Megatron does: exact, twice the work.
    """

    group: dist.ProcessGroup

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        seq = q.shape[1] * cp
        q_pos = cp_positions(seq, cp, rank)
        scale = 1.0 / math.sqrt(q.shape[-1])
        kv, split = torch.cat((k.reshape(-1), v.reshape(-1))), k.numel()
        # each shift is issued before the block it overlaps is computed; funcol waits at the first use
        incoming = _ring_shift(kv, self.group) if cp > 1 else None
        out, lse = _block_attention(q, k, v, q_pos, q_pos, scale)
        for step in range(1, cp):
            kv = incoming
            if step + 1 < cp:
                incoming = _ring_shift(kv, self.group)
            k_b, v_b = kv[:split].view(k.shape), kv[split:].view(v.shape)
            k_pos = cp_positions(seq, cp, (rank - step) % cp)
            out, lse = _merge(out, lse, *_block_attention(q, k_b, v_b, q_pos, k_pos, scale))
        return out


# ---- all-to-all (DeepSpeed-Ulysses) -----------------------------------------------------------------
def _all_to_all(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Piece j of dim 0 goes to group rank j; torch's functional all_to_all_single, whose backward is the reverse."""
    return funcol.all_to_all_single_autograd(x.contiguous(), None, None, group)


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, s_local, h, d) -> (b, cp * s_local, h / cp, d): every rank's tokens (in rank order), head group r."""
    cp = dist.get_world_size(group)
    b, s, h, d = x.shape
    y = _all_to_all(x.reshape(b, s, cp, h // cp, d).permute(2, 0, 1, 3, 4), group)  # y[j]: rank j's tokens
    return y.permute(1, 0, 2, 3, 4).reshape(b, cp * s, h // cp, d)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """(b, cp * s_local, h / cp, d) -> (b, s_local, h, d): the inverse of _seq_to_heads."""
    cp = dist.get_world_size(group)
    b, total, hc, d = x.shape
    y = _all_to_all(x.reshape(b, cp, total // cp, hc, d).permute(1, 0, 2, 3, 4), group)  # y[j]: head group j
    return y.permute(1, 2, 0, 3, 4).reshape(b, total // cp, cp * hc, d)


def _kv_heads_for(k: torch.Tensor, q_heads: int, cp: int) -> torch.Tensor:
    """GQA kv heads that cp does not divide, each repeated f = cp / gcd(kv, cp) times (adjacent copies), so
    head group r of the queries finds its kv heads in kv head group r. f divides the GQA group size
    q_heads / kv because cp divides q_heads, so query head i still reads copy i // (group / f) of kv head
    i // group."""
    kv = k.shape[2]
    if kv % cp == 0:
        return k
    f = cp // math.gcd(kv, cp)
    if (q_heads // kv) % f:
        raise ValueError(f"cannot spread {kv} kv heads of {q_heads} query heads over cp={cp}")
    return k.repeat_interleave(f, dim=2)


@dataclass(frozen=True)
class UlyssesAttention:
    """All-to-all context parallelism over `group` (the cp group): an AttentionCore for this rank's tokens.

    Query heads (this rank's, after any TP) must divide by cp (the planner's rule). The all-to-all gathers the
    ranks' load-balanced shards in rank order; they are put back into sequence order before the causal
    attention (the model's own `causal_attention`, so GQA and MLA's value dim behave as in the reference)
    and into shard order after it.
    """

    group: dist.ProcessGroup

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cp = dist.get_world_size(self.group)
        heads = q.shape[2]
        if heads % cp:
            raise ValueError(f"a2a context parallelism needs the {heads} query heads divisible by cp={cp}")
        k, v = _kv_heads_for(k, heads, cp), _kv_heads_for(v, heads, cp)
        seq = q.shape[1] * cp
        order = torch.cat([cp_positions(seq, cp, r) for r in range(cp)]).to(q.device)  # gathered index -> position
        restore = torch.argsort(order)  # position -> gathered index
        q, k, v = (_seq_to_heads(x, self.group).index_select(1, restore) for x in (q, k, v))
        return _heads_to_seq(causal_attention(q, k, v).index_select(1, order), self.group)


# ---- a model under CP -----------------------------------------------------------------------------------
def make_core(kind: str, group: dist.ProcessGroup) -> RingAttention | UlyssesAttention:
    """The attention core for cp_comm `kind` ("ring" or "a2a") over the cp process group."""
    if kind == "ring":
        return RingAttention(group)
    if kind == "a2a":
        return UlyssesAttention(group)
    raise ValueError(f"unknown cp_comm {kind!r}; one of {', '.join(CP_KINDS)}")


def _layers(module: nn.Module) -> list[nn.Module]:
    layers = module.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def apply_context_parallel(module: Transformer | ModelChunk, cp_mesh: DeviceMesh, kind: str,
                           seq: int) -> torch.Tensor:
    """Give every layer of `module` the cp core and return this rank's positions (cp_positions of `seq`).

    In place: a ModelChunk also gets them as `module.positions`; a Transformer takes them as forward's
    `positions` argument. The rank's tokens and labels are then `cp_shard` of each (full-sequence) micro-batch.
    cp_mesh: the 1-D cp mesh (`meshes["cp"]`). Works under TP too (heads come from the shapes).
    """
    cp, rank = cp_mesh.size(), cp_mesh.get_local_rank()
    positions = cp_positions(seq, cp, rank)
    core = make_core(kind, cp_mesh.get_group())
    for layer in _layers(module):
        layer.attention.core = core
    if isinstance(module, ModelChunk):
        module.positions = positions
    return positions


def merge_rank_results(results: Sequence[RunResult], tolerance: float = 1e-12) -> RunResult:
    """executor.compare.merge_reports, raising ValueError at the first disagreement between ranks."""
    merged, problems = merge_reports(results, tolerance)
    if problems:
        raise ValueError(f"ranks disagree: {problems[0]}")
    return merged
