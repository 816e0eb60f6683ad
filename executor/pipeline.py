"""Pipeline parallelism of the reference model: uneven stages, virtual stages, and torch's schedules.

A plan's pipeline (its Layout: pp, vpp, stage_layers, schedule, mbs, num_microbatches) runs as it is:

- Chunks. `Layout.chunk_ranges()` gives every model chunk's [start, stop) layers; chunk c * pp + s
  runs on pipeline rank s (Megatron-LM's interleaving, Narayanan et al. SC'21 sec. 2.2.2). Each rank
  builds the whole model (same seed, same weights), keeps its chunks as `ModelChunk`s (which keep the
  reference's parameter names) and drops the rest, so its memory is its stage's.
- Stages and schedules. Every chunk is a `torch.distributed.pipelining.PipelineStage` over the pp group
  (stage index = chunk index, so torch's looped stage-to-rank mapping is Megatron's), run by the
  schedule the layout names (SCHEDULES): GPipe (Huang et al. 2019), 1F1B (PipeDream-Flush, Narayanan
  et al. 2021), interleaved 1F1B (vpp > 1), and "zb": torch's ScheduleInterleavedZeroBubble, which for
  one stage per rank is ZB-H1 (Qi et al. ICLR 2024, sec. 3.1: backward split into input (B) and weight
  (W) passes, rank r deferring r weight passes, 1F1B's activation memory) and for vpp > 1 is ZB1P.
- Loss scaling. The last stage's loss per micro-batch is the mean token cross-entropy divided by the
  number of micro-batches (Megatron's forward_step does the same), with the schedule's `scale_grads`
  off. torch's scale_grads divides each local stage's parameters' gradients after the step, so a
  Parameter held by two local stages is divided twice: measured with pp1 x vpp2 and a tied head, the
  embedding's gradient came out 4x too small (n_micro 4); with one stage per rank it was right.
  Summed over micro-batches the scaled loss gives the rank's mean loss's gradient; the dp x cp average
  makes it the global mean's.
- Tied embeddings (spec.tied_embeddings). The first chunk holds tok_embeddings.weight and the last the
  same Parameter as output.weight; on different pipeline ranks each has its own copy, equal from the
  build. Their gradients are summed over the embedding group (pipeline ranks 0 and pp - 1, Megatron's
  `_EMBEDDING_GROUP`) after backward, so AdamW keeps them equal; both report tok_embeddings.weight.
  Hand-written: torch's pipelining has no notion of a weight shared between stages.
- Replicated parameters are averaged over dp x cp after the schedule's step by executor/plan_run.py, which
  composes this with the other dimensions.
- Shapes. No stage is given its shapes: torch infers each stage's (TP/SP/CP-sharded) shapes by running
  every stage once on uninitialised tensors (its DYNAMIC mode), which matches the reference (measured).
- zb splits each backward into an input and a weight pass (torch's stage_backward_input / _weight): a full
  backward hook on a chunk that is neither first nor last breaks the input pass (measured, torch 2.13), so
  nothing registers one under zb (plan_run's timeline shows its forwards only).

On gloo (torch 2.13, CPU, float64), measured by tests/test_executor_pp.py: GPipe, 1F1B, interleaved 1F1B,
ZB-H1 and ZB1P run on 2 and 4 pipeline ranks, with dp 2 in both rank orders, and match the single-process
reference to ~1e-15 in gradients; nothing hand-written was needed for their P2P (isend/irecv, and
batch_isend_irecv for mixed send/receive batches) and none hung. torch's ZB-V and DualPipeV place stages in
a V (rank r holds stages r and 2pp - 1 - r), not Megatron's loop, so a plan's chunk ranges do not map to
them; they are not used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.tensor import DTensor

from meshplan.costmodels.config import Layout
from meshplan.costmodels.model import ModelSpec
from meshplan.executor.mesh import Meshes, group_of, rank_coords
from meshplan.executor.model import ModelChunk, Transformer, token_loss

__all__ = [
    "INJECTIONS", "SCHEDULES", "Pipeline", "build_chunks", "build_pipeline", "embedding_group", "local_ranges",
    "mean_loss_over", "named_parameters", "pp_train_step", "sync_tied_embedding",
]

# layout.schedule -> torch schedule class; "gpipe" and "1f1b" take one stage per rank, the others a list
SCHEDULES: Mapping[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb": ScheduleInterleavedZeroBubble,
}
_SINGLE_STAGE = ("gpipe", "1f1b")

# Deliberate faults, so the tests show a broken pipeline is caught (plan_rank's inject=, `meshplan verify --inject`;
# plan_rank's own "shift-stage" moves a stage boundary):
#   "no-embedding-sync"  tied embeddings: the first and last pipeline ranks never sum their gradients.
INJECTIONS = ("no-embedding-sync",)

TIED_NAMES = ("output.weight", "tok_embeddings.weight")  # (name in a last chunk, reference name)


# ---- chunks ------------------------------------------------------------------------------------
def local_ranges(lay: Layout, pp_rank: int) -> tuple[tuple[int, int], ...]:
    """[start, stop) of pipeline rank `pp_rank`'s chunks, in model order (chunk c * pp + pp_rank for c < vpp)."""
    ranges = lay.chunk_ranges()
    mine = tuple(ranges[c * lay.pp + pp_rank] for c in range(lay.vpp))
    empty = [r for r in mine if r[0] >= r[1]]
    if empty:
        raise ValueError(f"pipeline rank {pp_rank}: {lay.stage_layers[pp_rank]} layer(s) cannot fill vpp={lay.vpp} "
                         f"chunks (empty chunk {empty[0]})")
    return mine


def build_chunks(model: Transformer, lay: Layout, pp_rank: int,
                 positions: torch.Tensor | None = None) -> list[ModelChunk]:
    """This pipeline rank's ModelChunks (sharing the model's modules, so names stay the reference's), model order.

    The caller drops `model` afterwards; what the chunks hold is what stays."""
    n = len(model.layers)
    if sum(lay.stage_layers) != n:
        raise ValueError(f"stage_layers {lay.stage_layers} sum to {sum(lay.stage_layers)}, the model has {n} layers")
    return [ModelChunk(model, start, stop, positions) for start, stop in local_ranges(lay, pp_rank)]


# ---- stages and schedule -----------------------------------------------------------------------
@dataclass(frozen=True)
class Pipeline:
    """One rank's part of a pipeline: its chunks (model order), their PipelineStages, and the schedule."""

    chunks: tuple[ModelChunk, ...]
    stages: tuple[PipelineStage, ...]
    schedule: Any  # a torch.distributed.pipelining schedule
    n_micro: int

    @property
    def has_first(self) -> bool:
        return self.chunks[0].first

    @property
    def has_last(self) -> bool:
        return self.chunks[-1].last


def mean_loss_over(n_micro: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The per-micro-batch loss: mean token cross-entropy / n_micro, so the summed backward is the mean's."""

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss(logits, labels) / n_micro

    return loss_fn


def schedule_problem(lay: Layout, n_micro: int) -> str | None:
    """Why this layout's schedule cannot run `n_micro` micro-batches, or None: checked by build_pipeline on every
    rank and by verify before any rank starts."""
    if lay.schedule not in SCHEDULES:
        return f"unknown schedule {lay.schedule!r}; one of {', '.join(SCHEDULES)}"
    if lay.schedule in _SINGLE_STAGE and lay.vpp > 1:
        return f"schedule {lay.schedule!r} runs one chunk per pipeline rank; vpp={lay.vpp} needs 'interleaved' or 'zb'"
    if lay.schedule == "1f1b" and n_micro < lay.pp:
        return f"1F1B needs at least pp={lay.pp} micro-batches, got {n_micro}"
    return None


def build_pipeline(chunks: Sequence[ModelChunk], lay: Layout, pp_group: dist.ProcessGroup, n_micro: int,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                   device: torch.device | None = None) -> Pipeline:
    """PipelineStages for this rank's chunks over `pp_group` and the schedule `lay.schedule` names.

    Each stage infers its (TP/SP/CP-sharded) shapes (the module docstring's "Shapes").
    loss_fn: default mean token cross-entropy / n_micro (see the module docstring)."""
    problem = schedule_problem(lay, n_micro)
    if problem:
        raise ValueError(problem)
    device = device or torch.device("cpu")
    pp_rank, num_stages = dist.get_rank(pp_group), lay.pp * lay.vpp
    stages = []
    for c, chunk in enumerate(chunks):
        stages.append(PipelineStage(chunk, c * lay.pp + pp_rank, num_stages, device, group=pp_group))
    loss_fn = loss_fn or mean_loss_over(n_micro)
    cls = SCHEDULES[lay.schedule]
    target = stages[0] if lay.schedule in _SINGLE_STAGE else stages
    schedule = cls(target, n_micro, loss_fn=loss_fn, scale_grads=False)
    return Pipeline(chunks=tuple(chunks), stages=tuple(stages), schedule=schedule, n_micro=n_micro)


def pp_train_step(pipe: Pipeline, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """One forward and backward of the rank's micro-batches (concatenated along the batch: the schedule
    cuts them in n_micro equal pieces, as micro_batches does). Returns the sum of the last stage's scaled
    micro-batch losses (the rank's mean loss) where this rank holds the last stage, else None."""
    losses: list[torch.Tensor] = []
    args = (tokens,) if pipe.has_first else ()
    target = labels if pipe.has_last else None
    pipe.schedule.step(*args, target=target, losses=losses, return_outputs=False)
    if not pipe.has_last:
        return None
    return torch.stack([loss.detach() for loss in losses]).sum()


# ---- gradient synchronisation ------------------------------------------------------------------
def embedding_group(lay: Layout, rank: int, meshes: Meshes) -> dist.ProcessGroup | None:
    """The group of this rank's first and last pipeline ranks (Megatron's embedding group); None if this
    rank is neither. Collective over the whole world when pp > 2 (every rank creates every group, in order)."""
    if lay.pp == 1:
        return None
    coords = rank_coords(rank, lay)
    mine = coords["pp"] in (0, lay.pp - 1)
    if lay.pp == 2:  # the pp group is the embedding group
        return meshes["pp"].get_group() if mine else None
    own = None
    for pp_ranks in sorted({group_of(r, "pp", lay) for r in range(lay.world)}):
        group = dist.new_group([pp_ranks[0], pp_ranks[-1]])
        if rank in (pp_ranks[0], pp_ranks[-1]):
            own = group
    return own if mine else None


def _tied_weight(chunks: Sequence[ModelChunk]) -> nn.Parameter | None:
    """The tied embedding Parameter this rank holds in exactly one role (first or last chunk), else None."""
    first = next((c for c in chunks if c.first), None)
    last = next((c for c in chunks if c.last), None)
    if (first is None) == (last is None):  # both local: one Parameter, already summed by autograd
        return None
    return first.tok_embeddings.weight if first is not None else last.output.weight


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself outside autograd), or the plain tensor."""
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def sync_tied_embedding(chunks: Sequence[ModelChunk], spec: ModelSpec, group: dist.ProcessGroup | None) -> None:
    """Sum the tied embedding's gradient over the embedding group (first + last pipeline rank)."""
    if not spec.tied_embeddings or group is None:
        return
    weight = _tied_weight(chunks)
    if weight is not None:
        dist.all_reduce(_local(weight.grad), group=group)


# ---- results -----------------------------------------------------------------------------------
def reference_name(name: str, spec: ModelSpec) -> str:
    """A chunk's parameter name as the reference reports it (a tied head is its embedding)."""
    return TIED_NAMES[1] if spec.tied_embeddings and name == TIED_NAMES[0] else name


def named_parameters(chunks: Sequence[ModelChunk], spec: ModelSpec) -> list[tuple[str, nn.Parameter]]:
    """(reference name, Parameter) of every distinct parameter the chunks hold."""
    out: dict[int, tuple[str, nn.Parameter]] = {}
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            out.setdefault(id(p), (reference_name(name, spec), p))
    return list(out.values())
