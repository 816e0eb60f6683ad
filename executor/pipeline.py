"""Pipeline parallelism of the reference model: uneven stages, virtual stages, and torch's schedules.

A plan's pipeline (ExecLayout: pp, vpp, stage_layers, schedule, mbs, num_microbatches) runs as it is:

- Chunks. `ExecLayout.chunk_ranges()` gives every model chunk's [start, stop) layers; chunk c * pp + s
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
- Replicated parameters are averaged over dp x cp (`meshes["dp_cp"]`; routed-expert weights over
  `meshes["edp"]`) by one hand-written all_reduce(AVG) per group over the flattened gradients, after the
  schedule's step, rather than by wrapping each chunk in DDP/FSDP: the same code serves any group (and
  DTensor gradients' local shards under TP), and needs no no_sync bookkeeping across micro-batches.
- Shapes. Each stage is given its input and output shapes (`stage_io`), which puts PipelineStage in its
  STATIC mode; with io=None torch infers them by running every stage once on uninitialised tensors
  (its DYNAMIC mode), which also matches the reference (measured) but costs a forward and backward.

On gloo (torch 2.13, CPU, float64), measured by tests/test_executor_pp.py: GPipe, 1F1B, interleaved 1F1B,
ZB-H1 and ZB1P run on 2 and 4 pipeline ranks, with dp 2 in both rank orders, and match the single-process
reference to ~1e-15 in gradients; nothing hand-written was needed for their P2P (isend/irecv, and
batch_isend_irecv for mixed send/receive batches) and none hung. torch's ZB-V and DualPipeV place stages in
a V (rank r holds stages r and 2pp - 1 - r), not Megatron's loop, so a plan's chunk ranges do not map to
them; they are not used.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                          ScheduleInterleavedZeroBubble)
from torch.distributed.tensor import DTensor

from meshplan.costmodels.model import ModelSpec
from meshplan.executor.data_parallel import micro_batches
from meshplan.executor.mesh import ExecLayout, Meshes, build_meshes, group_of, rank_coords
from meshplan.executor.model import ModelChunk, Transformer, token_loss
from meshplan.executor.recompute import apply_recompute
from meshplan.executor.reference import ADAMW, RankResult, RunSpec

__all__ = [
    "INJECTIONS", "SCHEDULES", "PPResult", "Pipeline", "average_replicated_grads", "build_chunks", "build_pipeline",
    "embedding_group", "full_named", "global_loss", "local_ranges", "mean_loss_over",
    "named_parameters", "pp_run", "pp_train_step", "stage_io", "sync_tied_embedding",
]

# layout.schedule -> torch schedule class; "gpipe" and "1f1b" take one stage per rank, the others a list
SCHEDULES: Mapping[str, type] = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved": ScheduleInterleaved1F1B,
    "zb": ScheduleInterleavedZeroBubble,
}
_SINGLE_STAGE = ("gpipe", "1f1b")

# Deliberate faults, so the tests show a broken pipeline is caught:
#   "shift-boundary"     the last pipeline rank starts its first chunk one layer early (that layer runs twice);
#   "no-embedding-sync"  tied embeddings: the first and last pipeline ranks never sum their gradients.
INJECTIONS = ("shift-boundary", "no-embedding-sync")

TIED_NAMES = ("output.weight", "tok_embeddings.weight")  # (name in a last chunk, reference name)


# ---- chunks ------------------------------------------------------------------------------------
def local_ranges(lay: ExecLayout, pp_rank: int) -> tuple[tuple[int, int], ...]:
    """[start, stop) of pipeline rank `pp_rank`'s chunks, in model order (chunk c * pp + pp_rank for c < vpp)."""
    ranges = lay.chunk_ranges()
    mine = tuple(ranges[c * lay.pp + pp_rank] for c in range(lay.vpp))
    empty = [r for r in mine if r[0] >= r[1]]
    if empty:
        raise ValueError(f"pipeline rank {pp_rank}: {lay.stage_layers[pp_rank]} layer(s) cannot fill vpp={lay.vpp} "
                         f"chunks (empty chunk {empty[0]})")
    return mine


def build_chunks(model: Transformer, lay: ExecLayout, pp_rank: int,
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


def stage_io(chunk: ModelChunk, spec: ModelSpec, mbs: int, seq: int,
             dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Meta tensors of a chunk's input and output per micro-batch: token ids or hidden states in, logits or
    hidden states out; hidden states require grad (torch sends and receives gradients only for
    those: without it the first stage's backward gets None). Given to PipelineStage, they put it in its
    STATIC mode: no shape-inference forward and backward on uninitialised tensors."""
    hidden = torch.empty(mbs, seq, spec.hidden, dtype=dtype, device="meta", requires_grad=True)  # gradients flow back
    x = torch.empty(mbs, seq, dtype=torch.long, device="meta") if chunk.first else hidden
    y = torch.empty(mbs, seq, spec.vocab, dtype=dtype, device="meta", requires_grad=True) if chunk.last else hidden
    return x, y


def mean_loss_over(n_micro: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The per-micro-batch loss: mean token cross-entropy / n_micro, so the summed backward is the mean's."""

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_loss(logits, labels) / n_micro

    return loss_fn


def schedule_problem(lay: ExecLayout, n_micro: int) -> str | None:
    """Why this layout's schedule cannot run `n_micro` micro-batches, or None: checked by build_pipeline on every
    rank and by verify before any rank starts."""
    if lay.schedule not in SCHEDULES:
        return f"unknown schedule {lay.schedule!r}; one of {', '.join(SCHEDULES)}"
    if lay.schedule in _SINGLE_STAGE and lay.vpp > 1:
        return f"schedule {lay.schedule!r} runs one chunk per pipeline rank; vpp={lay.vpp} needs 'interleaved' or 'zb'"
    if lay.schedule == "1f1b" and n_micro < lay.pp:
        return f"1F1B needs at least pp={lay.pp} micro-batches, got {n_micro}"
    return None


def build_pipeline(chunks: Sequence[ModelChunk], lay: ExecLayout, pp_group: dist.ProcessGroup, n_micro: int,
                   io: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None,
                   loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                   device: torch.device | None = None) -> Pipeline:
    """PipelineStages for this rank's chunks over `pp_group` and the schedule `lay.schedule` names.

    io: per chunk (input, output) meta tensors (`stage_io`), or None for torch's shape inference.
    loss_fn: default mean token cross-entropy / n_micro (see the module docstring)."""
    problem = schedule_problem(lay, n_micro)
    if problem:
        raise ValueError(problem)
    device = device or torch.device("cpu")
    pp_rank, num_stages = dist.get_rank(pp_group), lay.pp * lay.vpp
    stages = []
    for c, chunk in enumerate(chunks):
        x, y = io[c] if io is not None else (None, None)
        stages.append(PipelineStage(chunk, c * lay.pp + pp_rank, num_stages, device, input_args=x, output_args=y,
                                    group=pp_group))
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
def embedding_group(lay: ExecLayout, rank: int, meshes: Meshes) -> dist.ProcessGroup | None:
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


def is_expert(name: str) -> bool:
    """Routed-expert weights (averaged over edp); the router and shared experts are dense (dp x cp)."""
    return ".feed_forward.experts." in name


def _all_reduce_avg(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """One all_reduce(AVG) of the gradients flattened together (fewer gloo round trips than one per tensor)."""
    if not grads:
        return
    grads = [_local(g) for g in grads]  # DTensor gradients (TP): the dp ranks hold the same shard
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


@torch.no_grad()
def average_replicated_grads(named: Iterable[tuple[str, nn.Parameter]], meshes: Meshes) -> None:
    """Average gradients over the ranks that hold the same parameter: dp x cp for dense, edp for experts."""
    by_dim: dict[str, list[torch.Tensor]] = {"dp_cp": [], "edp": []}
    for name, p in named:
        if p.grad is None:  # still takes part: the other ranks' collective needs this rank's share
            p.grad = torch.zeros_like(p)
        by_dim["edp" if is_expert(name) else "dp_cp"].append(p.grad)
    for dim, grads in by_dim.items():
        if meshes[dim].size() > 1:
            _all_reduce_avg(grads, meshes[dim].get_group())


def global_loss(local: torch.Tensor | None, meshes: Meshes) -> float:
    """The global-batch mean loss on every rank: the last pipeline rank's mean, averaged over dp x cp."""
    x = torch.zeros((), dtype=torch.float64) if local is None else local.to(torch.float64).clone()
    if meshes["pp"].size() > 1:
        dist.all_reduce(x, group=meshes["pp"].get_group())  # only the last pipeline rank contributes
    if meshes["dp_cp"].size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.AVG, group=meshes["dp_cp"].get_group())
    return float(x)


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


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered (collective within its mesh), or a plain tensor copied; on the CPU."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)


def full_named(named: Sequence[tuple[str, nn.Parameter]], what: str) -> dict[str, torch.Tensor]:
    """{reference name: full tensor} of the parameters ("params") or their gradients ("grads")."""
    return {name: _full(p if what == "params" else p.grad) for name, p in named}


@dataclass(frozen=True, kw_only=True)
class PPResult(RankResult):
    """One rank's report of a pipeline run (fields as executor.reference.RunResult): the global-batch loss of
    every step (the same on every rank), and the full gradients after step 1 and parameters after the last
    step of the parameters this rank holds, by reference name."""

    pp_rank: int
    dp_rank: int


# ---- a whole run -------------------------------------------------------------------------------
def _check(run: RunSpec, lay: ExecLayout, world: int, inject: str | None) -> int:
    """The number of micro-batches per dp rank, after checking that the layout is one pp_run runs."""
    if inject is not None and inject not in INJECTIONS:
        raise ValueError(f"unknown injection {inject!r}; known: {', '.join(INJECTIONS)}")
    if world != lay.world:
        raise ValueError(f"layout needs {lay.world} ranks, the world has {world}")
    if lay.tp != 1 or lay.cp != 1 or lay.ep != 1 or lay.etp != 1 or lay.zero != 0:
        raise ValueError("pp_run runs pp x dp layouts (tp = cp = ep = etp = 1, ZeRO 0)")
    if run.gbs % (lay.dp * lay.mbs):
        raise ValueError(f"global batch {run.gbs} is not a multiple of dp * mbs = {lay.dp} * {lay.mbs}")
    n_micro = run.gbs // (lay.dp * lay.mbs)
    if n_micro != lay.num_microbatches:
        raise ValueError(f"gbs {run.gbs} / (dp {lay.dp} * mbs {lay.mbs}) = {n_micro} micro-batches, the layout "
                         f"says {lay.num_microbatches}")
    return n_micro


def _shifted(lay: ExecLayout, pp_rank: int, model: Transformer) -> list[ModelChunk]:
    """The "shift-boundary" fault: the last pipeline rank's first chunk starts one layer early (not at layer 0,
    which would make it take token ids where hidden states arrive: gloo aborts the process on the size mismatch)."""
    chunks = build_chunks(model, lay, pp_rank)
    if pp_rank == lay.pp - 1:
        if chunks[0].start < 2:
            raise ValueError("shift-boundary needs the last pipeline rank to start at layer 2 or later")
        chunks[0] = ModelChunk(model, chunks[0].start - 1, chunks[0].stop)
    return chunks


def pp_run(rank: int, world: int, run: RunSpec, lay: ExecLayout, *, meshes: Meshes | None = None,
           inject: str | None = None) -> PPResult:
    """Run `run` under a pp x dp layout (any rank order, schedule, vpp, uneven stages, recompute policy).

    Collective: every rank of the world calls it with the same arguments (run_world(lay.world, pp_run, run, lay)).
    meshes: build_meshes(lay), or meshes built for another layout with the same degrees and rank order (its
    groups are the same), to save creating them again. Each rank reports its own parameters' full gradients
    (after step 1) and values (after the last step); `executor.compare.merge_reports` puts the ranks' reports
    together."""
    n_micro = _check(run, lay, world, inject)
    torch.set_num_threads(1)
    meshes = meshes or build_meshes(lay)
    if meshes["pp"].size() != lay.pp or meshes["dp_cp"].size() != lay.dp:
        raise ValueError(f"meshes of pp {meshes['pp'].size()} x dp {meshes['dp_cp'].size()}, the layout is "
                         f"pp {lay.pp} x dp {lay.dp}")
    coords = rank_coords(rank, lay)
    pp_rank, dp_rank = coords["pp"], coords["dp"]
    model = run.build()
    chunks = _shifted(lay, pp_rank, model) if inject == "shift-boundary" else build_chunks(model, lay, pp_rank)
    del model  # the chunks hold this stage's modules; the rest goes
    apply_recompute(chunks, lay, pp_rank)
    io = [stage_io(c, run.model, lay.mbs, run.seq, run.torch_dtype) for c in chunks]
    pipe = build_pipeline(chunks, lay, meshes["pp"].get_group(), n_micro, io=io)
    emb_group = embedding_group(lay, rank, meshes)
    named = named_parameters(chunks, run.model)
    opt = torch.optim.AdamW([p for _, p in named], lr=run.lr, **ADAMW)

    losses: list[float] = []
    grads: dict[str, torch.Tensor] | None = None
    for step in range(run.steps):
        opt.zero_grad(set_to_none=True)
        parts = micro_batches(*run.batch(step), dp_rank, lay.dp, lay.mbs)
        tokens, labels = torch.cat([t for t, _ in parts]), torch.cat([y for _, y in parts])
        local = pp_train_step(pipe, tokens, labels)
        if inject != "no-embedding-sync":
            sync_tied_embedding(chunks, run.model, emb_group)
        average_replicated_grads(named, meshes)
        losses.append(global_loss(local, meshes))
        if step == 0:
            grads = full_named(named, "grads")
        opt.step()
    return PPResult(run=run, losses=tuple(losses), grads=grads, params=full_named(named, "params"),
                    layout=lay.label(inject), rank=rank, pp_rank=pp_rank, dp_rank=dp_rank)
