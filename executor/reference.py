"""The single-process training step that distributed runs of a plan are compared against.

Everything here is deterministic: batches come from a seeded generator, the step is one forward and
one backward in one process, and `train` uses AdamW with fixed hyperparameters. `meshplan verify`
(issue 4) runs the same model, batch and optimizer under a plan's layout and compares the loss, every
gradient after one step, and the parameters after N steps with these.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import torch
from torch import nn

from costmodels.model import ModelSpec

__all__ = ["ADAMW", "StepResult", "make_batch", "reference_step", "train"]

# AdamW (Loshchilov & Hutter 2019) with the Llama-3 / Megatron-LM GPT pretraining betas, eps and weight
# decay; foreach/fused pinned off so the update is the plain per-parameter loop on every platform.
ADAMW: Mapping[str, object] = MappingProxyType(
    {"betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1, "foreach": False, "fused": False}
)


@dataclass(frozen=True)
class StepResult:
    """The loss and each parameter's gradient (by named_parameters name; a tied weight appears once)."""

    loss: float
    grads: Mapping[str, torch.Tensor]


def make_batch(spec: ModelSpec, batch: int, seq: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (batch, seq) and their next-token labels, drawn from `seed` alone.

    One (batch, seq + 1) draw: tokens are its first seq columns, labels the last seq (tokens shifted by one).
    """
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, spec.vocab, (batch, seq + 1), generator=gen, dtype=torch.long)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def reference_step(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> StepResult:
    """One forward and backward; parameters are not changed. Raises if any parameter gets no gradient."""
    model.zero_grad(set_to_none=True)
    loss = model(tokens, labels)
    loss.backward()
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if p.grad is None:  # a parameter outside the graph is a model bug; a distributed run would hang on it
            raise RuntimeError(f"parameter {name} received no gradient")
        grads[name] = p.grad.detach().clone()
    return StepResult(loss=float(loss.detach()), grads=MappingProxyType(grads))


def train(model: nn.Module, batches: Sequence[tuple[torch.Tensor, torch.Tensor]], steps: int, lr: float) -> list[float]:
    """`steps` AdamW steps (hyperparameters ADAMW, constant lr), step i on batches[i % len(batches)].

    Returns the loss of each step, measured before its update. The model's parameters are updated in place.
    """
    if not batches:
        raise ValueError("train needs at least one batch")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, **ADAMW)
    losses: list[float] = []
    for i in range(steps):
        tokens, labels = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = model(tokens, labels)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses
