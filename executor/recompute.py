"""Activation recomputation of a pipeline stage, by the plan's per-stage policy (Layout.stage_recompute).

- "full", k: the whole decoder block of the stage's first k layers is checkpointed: its forward keeps only
  the block's input, and backward runs the block again (Megatron-LM --recompute-granularity full
  --recompute-method block --recompute-num-layers k). Layers are counted over the stage's layers in model
  order, across its virtual-stage chunks (costmodels.estimate.layer_modes, StagePolicy.layer_mode).
- "selective": only the attention core (softmax(q k^T) v: the (seq x seq) scores, probabilities and their
  softmax state) is recomputed (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", sec. 5); q, k and v themselves are kept. On the CPU, SDPA's flash kernel keeps no
  (seq x seq) matrix anyway, so what selective saves there is GQA's repeated k, v and the kernel's own
  state (measured, 2 x 16 tokens, 4 layers: llama3.1-8b@tiny 11% of the saved bytes, gpt3-175b@tiny 1%).
- "none": nothing.

Both use non-reentrant checkpointing (torch.utils.checkpoint.checkpoint, use_reentrant=False), installed
without changing any parameter name (the executor compares by name): "full" replaces the block's forward
by a checkpointed call of it, "selective" replaces `block.attention.core` by a checkpointed call of the core
it finds there (so apply it after context parallelism has installed its core). Hand-written rather than
torch's two module-level pieces: checkpoint_wrapper renames every parameter (`_checkpoint_wrapped_module.`),
and the composable `torch.distributed._composable.checkpoint(module)`, which keeps names, fails when one
forward is backwarded twice (input gradients, then weight gradients: the zero-bubble schedules' B/W split)
with "AttributeError: '_GeneratorContextManager' object has no attribute 'args'" (torch 2.13, measured):
its recompute context is a one-shot generator. torch.utils.checkpoint handles that case, but recomputes
the region once per backward traversal, so under "zb" a recomputed block runs forward three times, not two.
Recomputation on the CPU is deterministic: gradients are bit-identical with and without it
(tests/test_executor_pp.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from meshplan.costmodels.config import Layout
from meshplan.executor.model import AttentionCore, ModelChunk

__all__ = ["GRANULARITIES", "apply_recompute", "layer_modes", "saved_activation_bytes"]

GRANULARITIES = ("none", "selective", "full")


def layer_modes(granularity: str, full_layers: int, num_layers: int) -> tuple[str, ...]:
    """The mode of each of a stage's layers in model order (as costmodels.config.StagePolicy.layer_mode)."""
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown recompute granularity {granularity!r}; one of {', '.join(GRANULARITIES)}")
    if granularity == "full":
        if not 1 <= full_layers <= num_layers:
            raise ValueError(f"full recompute of {full_layers} layers, but the stage has {num_layers}")
        return tuple("full" if i < full_layers else "none" for i in range(num_layers))
    if full_layers:
        raise ValueError(f"full_layers is only meaningful with granularity 'full', got {full_layers}")
    return (granularity,) * num_layers


def _recomputed_core(core: AttentionCore, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return checkpoint(core, q, k, v, use_reentrant=False)


def _recomputed_block(forward: Callable[..., torch.Tensor], x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return checkpoint(forward, x, positions, use_reentrant=False)


def _stage_layers(chunks: Sequence[ModelChunk]) -> Iterator[nn.Module]:
    for chunk in chunks:  # chunks in model order, each's layers in model order
        yield from chunk.layers.values()


def apply_recompute(chunks: Sequence[ModelChunk], lay: Layout, pp_rank: int) -> tuple[str, ...]:
    """Apply pipeline rank `pp_rank`'s policy to its chunks (model order), in place, once; returns each layer's mode.

    `chunks` are the rank's ModelChunks in model order (a single-process run may pass [ModelChunk(model, 0, n)])."""
    policy = lay.stage_recompute[pp_rank]
    layers = list(_stage_layers(chunks))
    modes = layer_modes(policy.granularity, policy.full_layers, len(layers))
    for layer, mode in zip(layers, modes, strict=True):
        if mode == "full":  # an instance attribute: nn.Module.__call__ (and its hooks) still wrap it
            layer.forward = partial(_recomputed_block, layer.forward)
        elif mode == "selective":
            layer.attention.core = partial(_recomputed_core, layer.attention.core)
    return modes


def saved_activation_bytes(params: Iterable[torch.Tensor], fn: Callable[..., Any], *args: Any) -> tuple[Any, int]:
    """Run fn(*args) and count the bytes autograd saves for backward: distinct storages, those of `params`
    excluded. A recomputed region saves nothing; its inputs, which it recomputes from, are held by the
    checkpoint (not counted), and are mostly saved by the ops before it anyway. Returns (fn's result, bytes)."""
    weights = {p.untyped_storage().data_ptr() for p in params}
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in weights:
            storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    return out, sum(storages.values())
