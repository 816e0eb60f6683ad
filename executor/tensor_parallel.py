"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019, sec. 3) and sequence parallelism (Korthikanti et al.
2022, sec. 4) of the reference model, with DTensor and torch.distributed.tensor.parallel's styles.

The plan follows torchtitan's `parallelize_llama` (torchtitan/models/llama3/infra/parallelize.py, apply_tp) and,
for MLA, its DeepSeek-V3 plan (torchtitan/models/deepseek_v3/infra/parallelize.py):

| module | style | parameters |
| --- | --- | --- |
| tok_embeddings | RowwiseParallel (vocab-parallel embedding) | rows (vocab) split |
| pos_embeddings (learned) | replicated; with SP its output is cut to this rank's sequence shard | whole |
| attention wq, wk, wv (MLA: wq or wq_b, wkv_b) | ColwiseParallel: heads split | rows (and biases) split |
| attention wo | RowwiseParallel: partial sums all-reduced (SP: reduce-scattered) | columns split, bias whole |
| MLA wq_a, q_norm, wkv_a, kv_norm | replicated (Megatron's MLA does the same) | whole |
| MLP w1, w3 / w2 (and MoE shared experts) | ColwiseParallel / RowwiseParallel | split |
| MoE router, routed experts | untouched (expert parallelism is executor.expert_parallel's) | whole |
| norms | none; with SP SequenceParallel (Replicate DTensor weights) | whole |
| output head | ColwiseParallel, logits left vocab-sharded for `loss_parallel` | rows (vocab) split |

Inside attention and MLP a rank computes on plain local tensors: its own heads (the model takes head counts
from the shapes) and its own slice of the MLP's hidden units, so `attention.core` (context parallelism,
recompute) still gets plain (batch, seq, local heads, dim) tensors.

Sequence parallelism: the residual stream between the sub-layers is a plain local tensor holding this rank's
seq/tp tokens (dim 1); each attention / MLP input is all-gathered to the whole sequence (backward:
reduce-scattered), each row-parallel output reduce-scattered back (backward: all-gathered). Positions are the
whole sequence's, unchanged: attention always sees every token of the (context-parallel) sequence.

Module-level contract for composing with the other dimensions:
- MoE layers get the full hidden states of every token, replicated over tp, with or without SP (with SP they
  are gathered before the MoE layer and cut back to the rank's shard after it). Their output must be replicated
  over tp and their input gradient must be the whole gradient on every tp rank. Expert parallelism therefore
  sees tp-replicated tokens in both cases (and must count each token once).
- Under SP a ModelChunk that is not the first gets hidden states of seq/tp tokens, so it needs explicit
  `positions` (the whole sequence's); a guard raises otherwise.
- The loss: the head's logits are a DTensor sharded over the vocabulary; compute the loss with `tp_loss` (or
  the model's own forward) and run forward AND backward inside `vocab_parallel_loss()` (torch's loss_parallel;
  measured: a backward outside it raises "aten.nll_loss_backward.default got mixed torch.Tensor and DTensor";
  torchtitan wraps its train step and pipeline schedule.step in it). `vocab_parallel=False` gathers the logits
  instead (plain tensors, any loss, no context).
- Gradients: call `reduce_partial_grads` after backward (before dp reduction, clipping, optimizer): under SP the
  norm weights' gradients come back Partial over tp. Everything else comes back whole or as its shard.

On gloo with float64 CPU tensors (torch 2.13, tests/test_executor_tp.py) every torch piece used here works as
is: parallelize_module and its styles, loss_parallel, DTensor redistribution, FSDP2 over the dp mesh on top of
TP (2-D, in executor/plan_run.py). Hand-written: only MLA's rope-key gradient sum (`_sum_rope_key_grad`, see
there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, ParallelStyle, PrepareModuleInput,
                                               PrepareModuleInputOutput, PrepareModuleOutput, RowwiseParallel,
                                               SequenceParallel, loss_parallel, parallelize_module)

from meshplan.executor.model import MLAttention, ModelChunk, TransformerBlock, token_loss

__all__ = [
    "INJECTIONS", "apply_tensor_parallel", "check_tp_degree", "full_grads", "full_params", "full_state",
    "reduce_partial_grads", "tp_loss", "vocab_parallel_loss",
]

# Deliberate faults, so the tests show the comparison can fail (plan_rank's inject=, `meshplan verify --inject`):
#   "no-kpe-sync"  MLA: the rope key's gradient, which each tp rank gets only from its own heads, is not summed;
#   "no-wo-reduce" attention's wo leaves its partial sums unreduced (a row-parallel layer without all-reduce).
INJECTIONS = ("no-kpe-sync", "no-wo-reduce")


# ---- the plan --------------------------------------------------------------------------------------
def _layers(module: nn.Module) -> Iterator[TransformerBlock]:
    """The decoder layers of a Transformer (ModuleList) or a ModelChunk (ModuleDict keyed by global index)."""
    layers = module.layers
    return iter(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def check_tp_degree(module: nn.Module, tp: int) -> None:
    """Raise ValueError unless tp divides every dimension TP splits (heads, kv heads, MLP and vocab widths)."""
    sizes: dict[str, int] = {}
    for layer in _layers(module):
        att = layer.attention
        if isinstance(att, MLAttention):
            sizes["heads"] = att.n_heads
        else:
            sizes["heads"], sizes["kv heads"] = att.n_heads, att.n_kv_heads
        for name, mlp in _mlps(layer):
            sizes[f"{name} hidden"] = mlp.w1.out_features
    for name in ("tok_embeddings", "output"):
        sub = getattr(module, name, None)
        if sub is not None:
            sizes["vocab"] = sub.weight.shape[0]
    bad = [f"{k} {v}" for k, v in sizes.items() if v % tp]
    if bad:
        raise ValueError(f"tp={tp} does not divide {', '.join(bad)}")


def _mlps(layer: TransformerBlock) -> list[tuple[str, nn.Module]]:
    """(plan prefix, MLP) of what TP shards in the feed-forward: the MLP, or the MoE's shared experts."""
    ff = layer.feed_forward
    if not layer.is_moe:
        return [("feed_forward", ff)]
    return [(f"feed_forward.shared_experts.{j}", mlp) for j, mlp in ff.shared_experts.named_children()]


def _mlp_plan(prefix: str, mlp: nn.Module, out: Placement) -> dict[str, ParallelStyle]:
    """Megatron's MLP split (Shoeybi et al. 2019, sec. 3, fig. 3a): w1 (and w3) by columns, w2 by rows."""
    plan: dict[str, ParallelStyle] = {f"{prefix}.w1": ColwiseParallel(),
                                      f"{prefix}.w2": RowwiseParallel(output_layouts=out)}
    if hasattr(mlp, "w3"):
        plan[f"{prefix}.w3"] = ColwiseParallel()
    return plan


def _layer_plan(layer: TransformerBlock, sp: bool, inject: str | None) -> dict[str, ParallelStyle]:
    """torchtitan's per-block plan (apply_tp), with MLA and MoE variants; see the module docstring."""
    seq_out = Shard(1) if sp else Replicate()
    att = layer.attention
    mla = isinstance(att, MLAttention)
    wo_out = Partial() if inject == "no-wo-reduce" else seq_out
    plan: dict[str, ParallelStyle] = {"attention.wo": RowwiseParallel(output_layouts=wo_out)}
    if mla:  # the latent projections stay replicated; only the per-head up-projections are split
        plan["attention.wq_b" if att.q_compressed else "attention.wq"] = ColwiseParallel()
        plan["attention.wkv_b"] = ColwiseParallel()
    else:
        plan.update({f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")})
    if layer.is_moe:  # shared experts end replicated: the MoE output is replicated over tp (module docstring)
        for prefix, mlp in _mlps(layer):
            plan.update(_mlp_plan(prefix, mlp, Replicate()))
    else:
        plan.update(_mlp_plan("feed_forward", layer.feed_forward, seq_out))
    if sp:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
        # GQA: a DTensor input, so wq/wk/wv's partial input gradients add up and are reduce-scattered once.
        # MLA: a plain input for its plain replicated down-projections; the gradient arriving here is then
        # already whole (wq_b / wkv_b all-reduce their inputs', as Megatron's MLA, and k_pe's is summed).
        plan["attention"] = PrepareModuleInput(input_layouts=(Shard(1), None),
                                               desired_input_layouts=(Replicate(), None), use_local_output=mla)
        if layer.is_moe:
            plan["feed_forward"] = PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)
        else:
            plan["feed_forward"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return plan


def _copy_to_tp_region(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward, gradient summed over tp backward: Megatron's f operator (Shoeybi et al. 2019, sec. 3,
    fig. 3; megatron/core/tensor_parallel/mappings.py copy_to_tensor_model_parallel_region), in DTensor terms:
    a Replicate tensor whose local gradient is declared Partial, so DTensor all-reduces it."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def _sum_rope_key_grad(att: MLAttention, mesh: DeviceMesh) -> None:
    """MLA's rope key k_pe is one head shared by all heads; a tp rank expands it only to its own heads, so its
    gradient there is partial: sum it over tp (the latent half's is whole already, via wkv_b's input all-reduce).
    Hand-written (a forward hook on wkv_a): no parallel style can address a slice of a layer's output, and
    torchtitan's alternative (DTensor activations through the whole attention) would hand attention.core DTensors."""
    rope = att.rope

    def hook(_mod: nn.Module, _inputs: Any, out: torch.Tensor) -> torch.Tensor:
        latent, k_pe = out.split([out.shape[-1] - rope, rope], dim=-1)
        return torch.cat((latent, _copy_to_tp_region(k_pe, mesh)), dim=-1)

    att.wkv_a.register_forward_hook(hook)


def _positions_guard(chunk: ModelChunk) -> None:
    """Under SP a non-first chunk sees seq/tp tokens: arange of that length would be the wrong positions."""

    def hook(mod: nn.Module, _inputs: Any) -> None:
        if mod.positions is None:
            raise ValueError("under sequence parallelism a ModelChunk that is not the first needs explicit positions")

    chunk.register_forward_pre_hook(hook)


def apply_tensor_parallel(module: nn.Module, tp_mesh: DeviceMesh, sp: bool, *, vocab_parallel: bool = True,
                          inject: str | None = None) -> nn.Module:
    """Shard a Transformer or ModelChunk in place over the 1-D `tp_mesh` (see the module docstring); returns it.

    vocab_parallel: the head's logits stay vocab-sharded (a DTensor, for `vocab_parallel_loss`); False gathers
    them into plain full logits (an all-gather of batch x seq x vocab) that any loss takes outside the context.

    Parameter names stay the reference's; a tied head is tied again to the (identically sharded) embedding
    when both are in `module`. Every tp rank calls it, on the same model (same seed). Apply expert
    parallelism to MoE layers first (this only shards their shared experts and wraps the MoE module).
    """
    tp = tp_mesh.size()
    check_tp_degree(module, tp)
    tied = getattr(module, "output", None) is not None and getattr(module, "tok_embeddings", None) is not None \
        and module.output.weight is module.tok_embeddings.weight
    seq_out = Shard(1) if sp else Replicate()
    if getattr(module, "tok_embeddings", None) is not None:
        parallelize_module(module.tok_embeddings, tp_mesh,
                           RowwiseParallel(input_layouts=Replicate(), output_layouts=seq_out))
    if sp and getattr(module, "pos_embeddings", None) is not None:  # positions run along dim 0 of its output
        parallelize_module(module.pos_embeddings, tp_mesh,
                           PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0)))
    for layer in _layers(module):
        parallelize_module(layer, tp_mesh, _layer_plan(layer, sp, inject))
        if isinstance(layer.attention, MLAttention) and inject != "no-kpe-sync":
            _sum_rope_key_grad(layer.attention, tp_mesh)
    if getattr(module, "output", None) is not None:
        if sp:
            parallelize_module(module.norm, tp_mesh, SequenceParallel())
        # vocab-sharded logits (a DTensor) for loss_parallel, as torchtitan; or gathered
        logits = Shard(-1) if vocab_parallel else Replicate()
        parallelize_module(module.output, tp_mesh, ColwiseParallel(input_layouts=seq_out, output_layouts=logits,
                                                                   use_local_output=not vocab_parallel))
    if tied:
        module.output.weight = module.tok_embeddings.weight
    if sp and isinstance(module, ModelChunk) and not module.first:
        _positions_guard(module)
    return module


# ---- the loss ---------------------------------------------------------------------------------------
@contextlib.contextmanager
def vocab_parallel_loss() -> Iterator[None]:
    """torch's loss_parallel: cross-entropy on vocab-sharded logits without gathering them (Megatron's
    vocab-parallel cross-entropy). Wrap forward and backward (or a pipeline schedule's step) in it."""
    with loss_parallel():
        yield


def tp_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of (batch, seq, vocab) logits, vocab-sharded DTensor or plain; a plain scalar
    tensor (a pipeline loss_fn). Call it, and the backward, inside `vocab_parallel_loss()` for DTensor logits."""
    loss = token_loss(logits, labels)
    return loss.to_local() if isinstance(loss, DTensor) else loss


# ---- full tensors by reference name ------------------------------------------------------------------
def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered over its mesh (collective), or a plain tensor copied."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)


def full_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter as a full tensor, by reference name. Collective: every rank of the meshes calls it."""
    return {name: _full(p) for name, p in module.named_parameters()}


def full_grads(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as a full tensor, by reference name. Collective; raises on a missing grad."""
    out = {}
    for name, p in module.named_parameters():
        if p.grad is None:
            raise RuntimeError(f"parameter {name} received no gradient")
        out[name] = _full(p.grad)
    return out


def reduce_partial_grads(module: nn.Module) -> None:
    """Sum over tp the gradients DTensor left Partial, once per step after backward, before any dp reduction,
    clipping or optimizer step. Under SP a norm weight's (Replicate) gradient comes back Partial(sum) (measured:
    each rank saw only its seq/tp tokens); Megatron all-reduces these in finalize_model_grads
    (megatron/core/distributed/finalize_model_grads.py, _allreduce_layernorm_grads). FSDP2 does it itself."""
    for p in module.parameters():
        g = p.grad
        if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
            p.grad = g.redistribute(g.device_mesh, p.placements)


def full_state(module: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(full_grads, full_params). Collective."""
    return full_grads(module), full_params(module)


# ---- a runner for the tests: tp x dp ------------------------------------------------------------------
