"""One rank of a plan's whole layout: every parallel dimension at once, on the same model and batch.

`plan_rank(rank, world, run, lay)` is what `meshplan verify` runs on each rank (`run_world`, gloo, or
torchrun, NCCL), and the one training loop of the executor: the tests run each dimension's layouts through it
too (tests/test_executor_{dp,tp,cp,pp,ep}.py). It composes the per-dimension pieces:

1. meshes      executor/mesh.py             the plan's groups, by its rank order and MoE folding
2. chunks      executor/pipeline.py         this pipeline rank's model chunks (uneven stages, vpp)
3. experts     executor/expert_parallel.py  EP / expert-TP on MoE layers (before TP: it wraps them)
4. tensors     executor/tensor_parallel.py  TP (+SP) with DTensor styles
5. context     executor/context_parallel.py ring or all-to-all attention core, load-balanced chunks
6. recompute   executor/recompute.py        per stage, after CP (selective wraps the core CP installed)
7. data        ZeRO 0: gradients averaged by hand; 1: as 0, AdamW states sharded (ZeroRedundancyOptimizer,
               or executor/sharded_optimizer.py for DTensor shards); 2/3: FSDP2 over dp x cp (2-D with TP),
               routed experts left to their own group
8. schedule    executor/pipeline.py         torch pipelining (pp > 1), else a plain micro-batch loop

Composition rules (each piece's contract): MoE layers see tokens replicated over tp (TP gathers them
under SP too), so EP always splits them over tp; dense gradients are averaged over dp x cp, routed
experts' summed over edp and divided by dp x cp (executor.expert_parallel.reduce_expert_grads); a tied
embedding on two pipeline ranks is summed over the embedding group. Under pp > 1 with TP the head's
logits are gathered (plain tensors between torch pipelining's stages and its loss) instead of kept
vocab-sharded; the loss is the same, the head's memory is not.

Every rank reports the gradients (after step 1) and parameters (after the last step) it holds as full
tensors by the reference's names, its measured memory (torch's MemTracker, last step) and its timeline.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from meshplan.costmodels.config import Layout
from meshplan.executor.context_parallel import INJECTIONS as CP_INJECTIONS
from meshplan.executor.context_parallel import apply_context_parallel, shard_positions
from meshplan.executor.data_parallel import fsdp_reduction_factor, make_fsdp_sum, micro_batches
from meshplan.executor.expert_parallel import INJECTIONS as EP_INJECTIONS
from meshplan.executor.expert_parallel import (apply_expert_parallel, expert_parameters, full_tensors,
                                               reduce_expert_grads)
from meshplan.executor.mesh import (Meshes, allocator_peak, build_meshes, rank_coords, rank_device,
                                    reset_allocator_peak, wait_for)
from meshplan.executor.model import ModelChunk, token_loss
from meshplan.executor.pipeline import INJECTIONS as PP_INJECTIONS
from meshplan.executor.pipeline import (build_chunks, build_pipeline, embedding_group, local_ranges, mean_loss_over,
                                        named_parameters, pp_train_step, sync_tied_embedding)
from meshplan.executor.recompute import apply_recompute
from meshplan.executor.reference import ADAMW, RankResult, RunSpec
from meshplan.executor.sharded_optimizer import ShardedAdamW
from meshplan.executor.tensor_parallel import INJECTIONS as TP_INJECTIONS
from meshplan.executor.tensor_parallel import apply_tensor_parallel, reduce_partial_grads, vocab_parallel_loss

with warnings.catch_warnings():  # torch.distributed.optim scripts its functional optimizers; 2.13 deprecates jit
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.distributed.optim import ZeroRedundancyOptimizer

__all__ = ["INJECTIONS", "RankReport", "plan_rank"]

# Deliberate faults for `meshplan verify --inject`, so a test can show that verify fails on a wrong layout:
#   "no-grad-sync"    dense gradients are never averaged over dp x cp (ZeRO 0/1);
#   "shift-stage"     the last pipeline rank's first chunk starts one layer early (pp > 1);
#   "scale-loss"      the last dp rank doubles its loss (a wrong but synchronised gradient);
#   "fsdp-sums"       ZeRO 2/3: FSDP2 made to sum gradients instead of averaging them, as it did on gloo in some
#                     torch versions; the executor detects and corrects it, so this run still matches;
#   "no-kpe-sync", "no-wo-reduce"  TP faults (executor.tensor_parallel.INJECTIONS);
#   "contiguous-shard", "no-cp-grad-sync"  CP faults (executor.context_parallel.INJECTIONS);
#   "no-embedding-sync"  a tied embedding's two pipeline copies never sum their gradients (pipeline.INJECTIONS);
#   "no-expert-grad-sync", "wrong-expert-placement", "no-token-split"  EP faults (expert_parallel.INJECTIONS);
#   "raise"           the last rank raises before its first step; "hang": it sleeps instead (verify's timeout).
INJECTIONS = ("no-grad-sync", "shift-stage", "scale-loss", "fsdp-sums", *TP_INJECTIONS, *CP_INJECTIONS,
              *PP_INJECTIONS, *EP_INJECTIONS, "raise", "hang")


@dataclass(frozen=True)
class Event:
    """One measured slice of a rank's last step (seconds from the step's start), for the Chrome trace."""

    name: str
    category: str  # forward | backward | sync | optimizer
    start_s: float
    duration_s: float


@dataclass(frozen=True, kw_only=True)
class RankReport(RankResult):
    """One rank's report (fields as executor.reference.RunResult, plus what verify shows beside it)."""

    coords: Mapping[str, int]
    layers: tuple[tuple[int, int], ...]  # this rank's chunks' [start, stop)
    memory: Mapping[str, float]  # bytes in the last step: parameters, gradients, optimizer states, peak activations
    step_s: tuple[float, ...]
    events: tuple[Event, ...]
    notes: tuple[str, ...]


def injection_problem(lay: Layout, inject: str | None) -> str | None:
    """Why the fault `inject` cannot be injected into this layout, or None: checked by every rank and by verify
    before any rank starts."""
    if inject is not None and inject not in INJECTIONS:
        return f"unknown injection {inject!r}; known: {', '.join(INJECTIONS)}"
    if inject == "no-grad-sync" and lay.zero >= 2:
        return "--inject no-grad-sync needs ZeRO 0 or 1 (FSDP2 reduces inside the backward)"
    if inject == "fsdp-sums" and lay.zero < 2:
        return "--inject fsdp-sums emulates a fault of FSDP2: it needs ZeRO 2 or 3"
    if inject in TP_INJECTIONS and lay.tp == 1:
        return f"--inject {inject} is a tensor-parallel fault: it needs tp > 1"
    if inject in CP_INJECTIONS and lay.cp == 1:
        return f"--inject {inject} is a context-parallel fault: it needs cp > 1"
    if inject == "no-cp-grad-sync" and lay.zero >= 2:
        return "--inject no-cp-grad-sync needs ZeRO 0 or 1 (FSDP2 reduces over dp x cp inside the backward)"
    if inject == "no-wo-reduce" and lay.sp:
        return "--inject no-wo-reduce leaves wo's output whole-sequence: it needs sequence parallelism off"
    if inject in ("no-expert-grad-sync", "wrong-expert-placement") and lay.ep == 1:
        return f"--inject {inject} is an expert-parallel fault: it needs ep > 1 (and a model with experts)"
    if inject == "no-token-split" and lay.tp == 1:
        return "--inject no-token-split needs tp > 1 (tokens replicated over tp reach the experts)"
    if inject in ("shift-stage", *PP_INJECTIONS) and lay.pp == 1:
        return f"--inject {inject} needs a pipeline (pp > 1)"
    if inject == "shift-stage" and local_ranges(lay, lay.pp - 1)[0][0] < 2:
        return "--inject shift-stage needs the last stage to start at layer 2 or later"
    return None


# ---- building this rank's model --------------------------------------------------------------------------------
def _chunks(run: RunSpec, lay: Layout, pp_rank: int, positions: torch.Tensor, inject: str | None,
            device: torch.device) -> list[ModelChunk]:
    """This rank's chunks of the model, on the rank's device before any sharding (the model is drawn on the CPU, from
    the seed alone, so every device starts from the same parameters as the single-process reference)."""
    model = run.build()
    chunks = build_chunks(model, lay, pp_rank, positions)
    if inject == "shift-stage" and pp_rank == lay.pp - 1:  # injection_problem: it starts at layer 2 or later
        chunks[0] = ModelChunk(model, chunks[0].start - 1, chunks[0].stop, positions)
    for chunk in chunks:
        chunk.to(device)
    return chunks  # the full model goes out of scope here: the chunks keep only this stage's modules


def _shard(chunks: Sequence[ModelChunk], run: RunSpec, lay: Layout, meshes: Meshes, pp_rank: int,
           inject: str | None) -> None:
    """EP, then TP, then CP, then recomputation, in place."""
    for chunk in chunks:
        if run.model.moe is not None:
            # TP hands MoE layers tp-replicated tokens even under SP, so EP always splits them over tp
            apply_expert_parallel(chunk, meshes, replace(lay, sp=False),
                                  inject=inject if inject in EP_INJECTIONS else None)
        if lay.tp > 1:
            apply_tensor_parallel(chunk, meshes["tp"], lay.sp, vocab_parallel=lay.pp == 1,
                                  inject=inject if inject in TP_INJECTIONS else None)
        if lay.cp > 1:
            apply_context_parallel(chunk, meshes["cp"], lay.cp_comm, run.seq)
    apply_recompute(chunks, lay, pp_rank)


def _fsdp(chunks: Sequence[ModelChunk], meshes: Meshes, lay: Layout, experts: set[nn.Parameter],
          dtype: torch.dtype, emulate_sum: bool) -> float:
    """ZeRO 2/3 with FSDP2 over dp x cp: each decoder layer, then the chunk; routed experts (replicated over edp,
    not dp x cp) are left out and reduced by reduce_expert_grads. Returns what FSDP2 multiplies the averaged
    gradient by (1, or dp x cp where it sums: probed, then divided out after the backward)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = meshes["dp_cp"]
    factor = fsdp_reduction_factor(mesh, dtype, emulate_sum=emulate_sum)
    n = mesh.size()
    if abs(factor - 1.0) > 1e-12 and abs(factor - n) > 1e-12 * n:
        raise RuntimeError(f"FSDP2 delivered {factor:g} x the average gradient over dp x cp (expected 1 or {n})")
    reshard = lay.zero == 3
    for chunk in chunks:
        for layer in chunk.layers.values():
            mine = {p for p in layer.parameters() if p in experts}
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, ignored_params=mine or None)
        fully_shard(chunk, mesh=mesh, reshard_after_forward=reshard, ignored_params=experts or None)
        if emulate_sum:
            for module in chunk.modules():
                if isinstance(module, FSDPModule):
                    make_fsdp_sum(module)
    return factor


def _optimizer(named: Sequence[tuple[str, nn.Parameter]], lay: Layout, meshes: Meshes, lr: float,
               experts: set[nn.Parameter]) -> list[Any]:
    """AdamW; under ZeRO 1 its states sharded over the parameters' data-parallel group (dense: dp x cp, routed
    experts: edp): torch's ZeroRedundancyOptimizer for plain tensors, ShardedAdamW for DTensor (TP) shards."""
    dense = [p for _, p in named if p not in experts]
    routed = [p for _, p in named if p in experts]
    opts: list[Any] = []
    for params, dim in ((dense, "dp_cp"), (routed, "edp")):
        if not params:
            continue
        if lay.zero != 1 or meshes[dim].size() == 1:
            opts.append(torch.optim.AdamW(params, lr=lr, **ADAMW))
        elif any(isinstance(p, DTensor) for p in params):
            opts.append(ShardedAdamW(params, meshes[dim].get_group(), lr=lr, **ADAMW))
        else:
            opts.append(ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW,
                                                process_group=meshes[dim].get_group(), lr=lr, **ADAMW))
    return opts


# ---- one step ------------------------------------------------------------------------------------------------------
class _Timeline:
    """Forward and backward slices of every chunk through module hooks (a chunk's backward hook fires when the
    gradient of its inputs is ready, so a first chunk, whose input is token ids, shows its forward only)."""

    def __init__(self, chunks: Sequence[ModelChunk], backward: bool = True) -> None:
        self.t0 = time.perf_counter()
        self.events: list[Event] = []
        self.on = False
        self._open: dict[tuple[int, str], float] = {}
        for i, chunk in enumerate(chunks):
            name = f"layers {chunk.start}-{chunk.stop - 1}"
            chunk.register_forward_pre_hook(lambda m, a, i=i: self._start(i, "forward"))
            chunk.register_forward_hook(lambda m, a, o, i=i, n=name: self._end(i, "forward", n))
            if backward and not chunk.first:
                chunk.register_full_backward_pre_hook(lambda m, g, i=i: self._start(i, "backward"))
                chunk.register_full_backward_hook(lambda m, gi, go, i=i, n=name: self._end(i, "backward", n))

    def reset(self, on: bool) -> None:
        self.on, self.events, self.t0 = on, [], time.perf_counter()

    def _start(self, i: int, kind: str) -> None:
        if self.on:
            self._open[(i, kind)] = time.perf_counter()

    def _end(self, i: int, kind: str, name: str) -> None:
        start = self._open.pop((i, kind), None)
        if self.on and start is not None:
            self.events.append(Event(f"{kind[0].upper()} {name}", kind, start - self.t0, time.perf_counter() - start))

    def mark(self, name: str, category: str, start: float) -> None:
        if self.on:
            self.events.append(Event(name, category, start - self.t0, time.perf_counter() - start))


class _SavedBytes:
    """Tensor accounting of activations: the bytes of tensors autograd keeps for backward, live at each moment,
    and their peak over a step. Hand-written: torch's MemTracker (torch.distributed._tools) refuses a module
    run once per micro-batch ("multiple iterative calls", torch 2.13), and the CPU allocator keeps no stats.

    Every packed tensor is wrapped in a handle; a storage counts once while any handle to it lives (autograd
    drops the handles when it frees the graph, after the backward that used them). Parameters are excluded:
    they are counted as parameters."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        self.skip = {_storage_key(p) for p in params}
        self.live: dict[int, list[int]] = {}  # storage key -> [bytes, handles]
        self.now = 0
        self.peak = 0

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _Handle.unpack)

    def _pack(self, t: torch.Tensor) -> Any:
        key = _storage_key(t)
        if key is None or key in self.skip:
            return t
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [t.untyped_storage().nbytes(), 0]
            self.now += entry[0]
            self.peak = max(self.peak, self.now)
        entry[1] += 1
        return _Handle(t, self, key)

    def release(self, key: int) -> None:
        entry = self.live[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.now -= entry[0]
            del self.live[key]


class _Handle:
    __slots__ = ("tensor", "owner", "key")

    def __init__(self, tensor: torch.Tensor, owner: _SavedBytes, key: int) -> None:
        self.tensor, self.owner, self.key = tensor, owner, key

    @staticmethod
    def unpack(handle: Any) -> torch.Tensor:
        return handle.tensor if isinstance(handle, _Handle) else handle

    def __del__(self) -> None:
        self.owner.release(self.key)


def _storage_key(t: torch.Tensor) -> int | None:
    t = t.to_local() if isinstance(t, DTensor) else t
    try:
        return t.untyped_storage().data_ptr() if t.device.type != "meta" else None
    except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. some wrapper subclasses)
        return None


def _local_bytes(tensors: Any) -> float:
    total = 0.0
    for t in tensors:
        if t is None:
            continue
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _state_bytes(opts: Sequence[torch.optim.Optimizer]) -> float:
    """Bytes of the optimizer states this rank holds (ZeroRedundancyOptimizer: its own partition's)."""
    total = 0.0
    for opt in opts:
        inner = getattr(opt, "optim", opt)  # ZeroRedundancyOptimizer keeps the local AdamW in .optim
        for state in inner.state.values():
            total += _local_bytes(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def _check_world(rank: int, world: int, run: RunSpec, lay: Layout, inject: str | None) -> int:
    """The micro-batches per step, after checking the world, the batch and the fault; the injected failures
    ("raise", "hang") happen here, before any collective."""
    problem = injection_problem(lay, inject)
    if problem:
        raise ValueError(problem)
    if world != lay.world:
        raise ValueError(f"the layout has {lay.world} ranks, the world {world}")
    n_micro = run.gbs // (lay.dp * lay.mbs)
    if n_micro * lay.dp * lay.mbs != run.gbs or n_micro != lay.num_microbatches:
        raise ValueError(f"gbs {run.gbs} != dp {lay.dp} x mbs {lay.mbs} x {lay.num_microbatches} micro-batches")
    if inject in ("raise", "hang") and rank == world - 1:
        if inject == "raise":
            raise RuntimeError("injected failure (--inject raise)")
        time.sleep(10 ** 6)
    return n_micro


def plan_rank(rank: int, world: int, run: RunSpec, lay: Layout, inject: str | None = None) -> RankReport:
    """Run `run` under the whole layout `lay` on this rank; collective over the world (lay.world ranks)."""
    n_micro = _check_world(rank, world, run, lay, inject)
    device = rank_device()  # chosen once: every tensor of this rank is made on it or moved to it here
    notes: list[str] = []
    meshes = build_meshes(lay, device.type)
    coords = rank_coords(rank, lay)
    pp_rank, cp_rank = coords["pp"], coords["cp"]
    positions = shard_positions(run.seq, lay.cp, cp_rank, inject) if lay.cp > 1 else torch.arange(run.seq)
    positions = positions.to(device)
    chunks = _chunks(run, lay, pp_rank, positions, inject, device)
    _shard(chunks, run, lay, meshes, pp_rank, inject)
    if inject == "contiguous-shard":  # the cores keep the load-balanced order they installed; the chunks do not
        for chunk in chunks:
            chunk.positions = positions
    experts: set[nn.Parameter] = set()
    for chunk in chunks:
        experts |= {p for p, _ in expert_parameters(chunk).values()}
    fsdp_factor = 1.0
    if lay.zero >= 2:
        fsdp_factor = _fsdp(chunks, meshes, lay, experts, run.torch_dtype, inject == "fsdp-sums")
    named = named_parameters(chunks, run.model)
    opts = _optimizer(named, lay, meshes, run.lr, experts)
    if lay.pp > 1 and lay.tp > 1:
        notes.append("pp > 1 with TP: the head's logits are gathered over tp (torch's pipelining passes plain "
                     "tensors), so the loss is the same but the head's activations are not vocab-sharded")

    emb_group = embedding_group(lay, rank, meshes)
    pipe = None
    if lay.pp > 1:
        # torch infers each stage's (local, TP/SP/CP-sharded) shapes by one forward and backward
        pipe = build_pipeline(chunks, lay, meshes["pp"].get_group(), n_micro, loss_fn=mean_loss_over(n_micro),
                              device=device)
    # zb splits each backward into input and weight passes (torch's stage_backward_input): a full backward hook on a
    # middle stage's chunk breaks the first (measured, torch 2.13, pp 4), so zb's timeline shows forwards only
    timeline = _Timeline(chunks, backward=lay.schedule != "zb")
    losses: list[float] = []
    step_s: list[float] = []
    grads: dict[str, torch.Tensor] | None = None
    memory: dict[str, float] = {}
    loss_ctx = vocab_parallel_loss if lay.tp > 1 and lay.pp == 1 else contextlib.nullcontext
    for step in range(run.steps):
        last_step = step == run.steps - 1
        saved = _SavedBytes([p for _, p in named])
        if last_step:
            reset_allocator_peak(device)
        dist.barrier()
        timeline.reset(on=last_step)
        t_step = time.perf_counter()
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        with saved.hooks():
            local_loss = _forward_backward(chunks, pipe, run, lay, step, coords, positions, n_micro, loss_ctx,
                                           inject)
        t_sync = time.perf_counter()
        _synchronise(chunks, named, run, lay, meshes, emb_group, experts, inject, fsdp_factor)
        timeline.mark("gradient sync", "sync", t_sync)
        loss_value = _global_loss(local_loss, meshes, device)
        losses.append(loss_value)
        if step == 0:
            grads = _full_named(chunks, named, meshes, lay, experts, "grads")
        grad_bytes = _local_bytes(p.grad for _, p in named)
        t_opt = time.perf_counter()
        for opt in opts:
            opt.step()
        wait_for(device)  # the optimizer's kernels inside the step they belong to
        timeline.mark("optimizer", "optimizer", t_opt)
        step_s.append(time.perf_counter() - t_step)
        if last_step:
            memory = {"parameters": _local_bytes(p for _, p in named), "gradients": grad_bytes,
                      "optimizer": _state_bytes(opts), "activations": float(saved.peak)}
            peak = allocator_peak(device)  # on a GPU, what the allocator held at most, beside the accounting
            if peak is not None:
                memory["allocator_peak"] = peak
    params = _full_named(chunks, named, meshes, lay, experts, "params")
    return RankReport(run=run, losses=tuple(losses), grads=grads, params=params,
                      layout=lay.label(inject), rank=rank, coords=coords,
                      layers=tuple((c.start, c.stop) for c in chunks), memory=memory, step_s=tuple(step_s),
                      events=tuple(timeline.events), notes=tuple(notes))


def _forward_backward(chunks: Sequence[ModelChunk], pipe: Any, run: RunSpec, lay: Layout, step: int,
                      coords: Mapping[str, int], positions: torch.Tensor, n_micro: int, loss_ctx: Any,
                      inject: str | None) -> torch.Tensor | None:
    """Every micro-batch's forward and backward (through the pipeline schedule when pp > 1) on this rank's
    sequence `positions`; this rank's mean loss where it holds the last stage, else None."""
    dp_rank = coords["dp"]
    device = positions.device
    parts = [(t.to(device), y.to(device)) for t, y in micro_batches(*run.batch(step), dp_rank, lay.dp, lay.mbs)]
    if lay.cp > 1:  # this cp rank's tokens (cp_shard)
        parts = [(t.index_select(1, positions), y.index_select(1, positions)) for t, y in parts]
    scale = 2.0 if inject == "scale-loss" and dp_rank == lay.dp - 1 else 1.0
    if pipe is not None:
        tokens, labels = torch.cat([t for t, _ in parts]), torch.cat([y for _, y in parts])
        local = pp_train_step(pipe, tokens, labels)
        return None if local is None else local.to(torch.float64) * scale
    local_loss = torch.zeros((), dtype=torch.float64, device=device)
    (chunk,) = chunks
    for tokens, labels in parts:
        with loss_ctx():
            loss = token_loss(chunk(tokens), labels)
            (loss * scale / n_micro).backward()
        loss = loss.to_local() if isinstance(loss, DTensor) else loss
        local_loss += loss.detach().to(torch.float64) / n_micro
    return local_loss


def _synchronise(chunks: Sequence[ModelChunk], named: Sequence[tuple[str, nn.Parameter]], run: RunSpec,
                 lay: Layout, meshes: Meshes, emb_group: Any, experts: set[nn.Parameter],
                 inject: str | None, fsdp_factor: float) -> None:
    """After the step's backward: a summing FSDP2's gradients back to the average (_fsdp), TP partial sums, the tied
    embedding, dense dp x cp average, expert reduction."""
    if fsdp_factor != 1.0:
        for _, p in named:
            if p not in experts and p.grad is not None:
                p.grad.div_(fsdp_factor)
    if lay.tp > 1 and lay.zero < 2:
        for chunk in chunks:
            reduce_partial_grads(chunk)
    if inject != "no-embedding-sync":
        sync_tied_embedding(chunks, run.model, emb_group)
    average_over = meshes["dp"] if inject == "no-cp-grad-sync" else meshes["dp_cp"]
    if lay.zero < 2 and inject != "no-grad-sync" and average_over.size() > 1:
        dense = []
        for _, p in named:
            if p in experts:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dense.append(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad)
        flat = torch.cat([g.reshape(-1) for g in dense])
        dist.all_reduce(flat, op=dist.ReduceOp.AVG, group=average_over.get_group())
        for g, part in zip(dense, flat.split([g.numel() for g in dense]), strict=True):
            g.copy_(part.view_as(g))
    if experts and inject != "no-expert-grad-sync":
        for chunk in chunks:
            reduce_expert_grads(chunk, meshes, lay)


def _global_loss(local: torch.Tensor | None, meshes: Meshes, device: torch.device) -> float:
    x = torch.zeros((), dtype=torch.float64, device=device) if local is None else local.detach().clone()
    if meshes["pp"].size() > 1:
        dist.all_reduce(x, group=meshes["pp"].get_group())  # only the last stage holds the loss
    if meshes["dp_cp"].size() > 1:
        dist.all_reduce(x, op=dist.ReduceOp.AVG, group=meshes["dp_cp"].get_group())
    return float(x)


def _full_named(chunks: Sequence[ModelChunk], named: Sequence[tuple[str, nn.Parameter]], meshes: Meshes,
                lay: Layout, experts: set[nn.Parameter], what: str) -> dict[str, torch.Tensor]:
    """{reference name: full tensor} of this rank's parameters or gradients: expert-TP shards gathered over etp,
    DTensors (TP, FSDP) over their meshes. Collective within each group; the ranks of a group hold the same
    chunks, so they gather in the same order."""
    by_param: dict[nn.Parameter, torch.Tensor] = {}
    if experts:
        for chunk in chunks:
            gathered = full_tensors(chunk, meshes, lay, grads=what == "grads")
            for name, p in chunk.named_parameters():
                if p in experts:
                    by_param[p] = gathered[name]
    out: dict[str, torch.Tensor] = {}
    for ref, p in named:
        if p in by_param:
            out[ref] = by_param[p]
            continue
        t = p if what == "params" else p.grad
        if t is None:
            raise RuntimeError(f"parameter {ref} received no gradient")
        out[ref] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().to("cpu", copy=True)
    return out
