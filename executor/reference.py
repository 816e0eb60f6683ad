"""The single-process training step that distributed runs of a plan are compared against.

Everything here is deterministic: batches come from a seeded generator, the step is one forward and
one backward in one process, and `train` uses AdamW with fixed hyperparameters. `meshplan verify`
(issue 4) runs the same model, batch and optimizer under a plan's layout and compares the loss, every
gradient after one step, and the parameters after N steps with these.

`RunSpec` names one such run (model, global batch, sequence length, steps, seed, lr, dtype) so a
distributed executor and `reference_run` compute the same thing; both report a `RunResult`-shaped
record that `executor.compare.compare_to_reference` holds side by side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from meshplan.costmodels.model import ModelSpec
from meshplan.executor.model import build_model

__all__ = ["ADAMW", "DTYPES", "RankResult", "RunResult", "RunSpec", "StepResult", "as_spec", "make_batch",
           "reference_run", "reference_step", "train"]

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


# ---- a whole run, described once for the reference and for every distributed executor --------------
DTYPES: Mapping[str, torch.dtype] = MappingProxyType({"float64": torch.float64, "float32": torch.float32,
                                                     "bfloat16": torch.bfloat16})  # bf16: compare.TOLERANCES


def as_spec(spec: ModelSpec | str | Mapping[str, Any]) -> ModelSpec:
    """A ModelSpec from itself, its JSON text (`ModelSpec.model_dump_json()`) or its dict."""
    if isinstance(spec, ModelSpec):
        return spec
    if isinstance(spec, str):
        return ModelSpec.model_validate_json(spec)
    return ModelSpec.model_validate(dict(spec))


@dataclass(frozen=True)
class RunSpec:
    """One comparable training run: `steps` AdamW steps (hyperparameters ADAMW, constant `lr`) of the model
    built from (model, dtype, seed), step i on a global batch of `gbs` sequences of `seq` tokens drawn by
    `make_batch(model, gbs, seq, seed + i)`. Hashable and picklable: it travels to every rank."""

    model: ModelSpec
    gbs: int
    seq: int
    steps: int = 1
    seed: int = 0
    lr: float = 1e-3
    dtype: str = "float64"

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", as_spec(self.model))
        if self.gbs < 1 or self.seq < 1 or self.steps < 1:
            raise ValueError(f"gbs, seq and steps must be positive, got {self.gbs}, {self.seq}, {self.steps}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def build(self) -> nn.Module:
        return build_model(self.model, dtype=self.torch_dtype, seed=self.seed)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The global batch of step `step` (0-based): tokens and labels, (gbs, seq) each."""
        return make_batch(self.model, self.gbs, self.seq, self.seed + step)


def _read_only(value: object) -> object:
    return MappingProxyType(dict(value)) if isinstance(value, Mapping) else value


class FrozenRecord:
    """Mixin for frozen dataclasses with Mapping fields: stored read-only, pickled as plain dicts
    (a mappingproxy does not pickle, and these records travel from the ranks to the launcher)."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            object.__setattr__(self, f.name, _read_only(getattr(self, f.name)))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        values = {f.name: getattr(self, f.name) for f in fields(self)}  # type: ignore[arg-type]
        return _rebuild, (type(self), {k: dict(v) if isinstance(v, Mapping) else v for k, v in values.items()})


def _rebuild(cls: type, values: dict[str, Any]) -> Any:
    """Unpickle a FrozenRecord by keyword (its subclasses' added fields are keyword-only)."""
    return cls(**values)


@dataclass(frozen=True)
class RunResult(FrozenRecord):
    """What a run reports for comparison: the global-batch loss of every step (before its update), every
    parameter's full gradient after step 1 (before the optimizer step) and every full parameter after the
    last step, by named_parameters name. A distributed executor fills grads and params on one rank only
    (None elsewhere)."""

    run: RunSpec
    losses: tuple[float, ...]
    grads: Mapping[str, torch.Tensor] | None
    params: Mapping[str, torch.Tensor] | None
    layout: str = "single process"


@dataclass(frozen=True, kw_only=True)
class RankResult(RunResult):
    """One rank's RunResult in a distributed run; the executors' records add what identifies their layout."""

    rank: int


def reference_run(run: RunSpec) -> RunResult:
    """The single-process run: reference_step on step 0's batch, then `train` for run.steps steps."""
    model = run.build()
    batches = [run.batch(i) for i in range(run.steps)]
    first = reference_step(model, *batches[0])
    losses = train(model, batches, run.steps, run.lr)
    params = {name: p.detach().clone() for name, p in model.named_parameters()}
    return RunResult(run=run, losses=tuple(losses), grads=first.grads, params=params)
