"""Expert parallelism (EP) and expert tensor parallelism (ETP) of the reference MoE, with MoE parallel folding.

Placement (Megatron-LM; Liu et al. 2025, "MoE Parallel Folding", arXiv:2504.14960 sec. 3): the experts of
every MoE layer are split over the ep ranks, ep rank i holding experts [i*E/ep, (i+1)*E/ep); each expert's
MLP is split over the etp ranks, w1/w3 by output rows (column-parallel) and w2 by input columns
(row-parallel), so an etp rank's output is a partial sum. The ep x etp groups fold onto the tp x cp x dp
ranks of a stage (`executor.mesh.build_meshes`: `meshes["ep"]`, `["etp"]`, `["edp"]`), so one group's ranks
may hold different tokens (other dp/cp ranks) or the same tokens (other tp ranks without sequence
parallelism).

Forward of `ExpertParallelMoE` (GShard's dispatch/combine, Lepikhin et al. 2020 sec. 3.2; Megatron-LM
megatron/core/transformer/moe/token_dispatcher.py, MoEAlltoAllTokenDispatcher):
1. route locally with the reference's own gating (`MoE.route`: softmax, top-k, renormalise);
2. tokens replicated over tp (tp > 1, no SP): each tp rank keeps only its 1/tp of the tokens (and of their
   routing weights) and the routed output is all-gathered over tp afterwards, so every token goes through
   the experts once (Megatron's scatter/gather over the tp region, megatron/core/tensor_parallel/mappings.py);
3. exchange per-expert counts, then send every (token, expert) pair to the etp ranks of the expert's ep
   rank with one `all_to_all_single` over the flattened ep x etp group, ordered (destination, expert, token);
4. each rank runs its local experts on what it received, in source order, and sends the results back by
   the reverse all-to-all;
5. the sender adds each expert's etp partial sums (etp rank 0 first) and combines them with the routing
   weights expert by expert in global expert order (the reference's `index_add` order), then shared experts.

Gradients: the global loss is the mean over the dp x cp ranks of their local losses, so dense gradients are
averaged over dp x cp. An expert receives the gradient of every token routed to it from every rank of its
ep x etp group; summed over the edp replicas that is the gradient of the SUM of the dp x cp local losses,
so `reduce_expert_grads` all-reduces SUM over edp and divides by dp*cp (Megatron-LM
megatron/core/distributed/distributed_data_parallel.py: `expert_gradient_scaling_factor = 1 / dp_cp size`
with a SUM over the expert-dp group). Under etp > 1 a w2 bias is added by etp rank 0 only, so its gradient
is first summed over etp.

Composition notes: the router and shared experts stay replicated here; under SP (tokens already split over
tp) the router's gradient is partial over tp and must be all-reduced over tp like the norm weights.
executor/plan_run.py composes it with the other dimensions (and the tests run EP layouts through it).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from meshplan.costmodels.config import Layout
from meshplan.executor.mesh import Meshes, rank_coords
from meshplan.executor.model import MLP, ModelChunk, MoE, Transformer

__all__ = [
    "INJECTIONS", "ExpertParallelMoE", "ExpertPlacement", "all_to_all", "apply_expert_parallel", "expert_parameters",
    "full_tensors", "reduce_expert_grads",
]

# Deliberate faults, so a test can show the comparison catches a broken layout:
#   "no-expert-grad-sync"     expert gradients are neither summed over edp nor divided by dp*cp;
#   "wrong-expert-placement"  ep rank i holds ep rank (i+1)'s expert weights under its own experts' names;
#   "no-token-split"          tokens replicated over tp are all dispatched by every tp rank (counted tp times).
INJECTIONS = ("no-expert-grad-sync", "wrong-expert-placement", "no-token-split")


# ---- placement ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ExpertPlacement:
    """Which experts (and which etp shard of them) a rank holds; positions are ranks of the flattened
    ep x etp group, ep-major (`meshes.expert["ep", "etp"]` flattened)."""

    num_experts: int
    ep: int = 1
    etp: int = 1
    ep_rank: int = 0
    etp_rank: int = 0

    def __post_init__(self) -> None:
        if self.num_experts % self.ep:
            raise ValueError(f"ep={self.ep} does not divide the {self.num_experts} experts")
        if not (0 <= self.ep_rank < self.ep and 0 <= self.etp_rank < self.etp):
            raise ValueError(f"ep rank {self.ep_rank} / etp rank {self.etp_rank} outside ep={self.ep}, etp={self.etp}")

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.ep

    @property
    def group_size(self) -> int:
        return self.ep * self.etp

    @property
    def position(self) -> int:
        return self.ep_rank * self.etp + self.etp_rank

    def experts_of(self, ep_rank: int) -> range:
        return range(ep_rank * self.per_rank, (ep_rank + 1) * self.per_rank)

    @property
    def local_experts(self) -> range:
        return self.experts_of(self.ep_rank)


# ---- collectives -------------------------------------------------------------------------------
class _AllToAll(torch.autograd.Function):
    """all_to_all_single whose backward is the reverse all_to_all_single. Hand-written: torch's differentiable
    one (torch.distributed.nn.functional.all_to_all_single) works on gloo (measured, torch 2.13) but is
    deprecated there, and its named replacement is in the private torch.distributed._functional_collectives."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int],  # type: ignore[override]
                group: dist.ProcessGroup) -> torch.Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _a2a(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:  # type: ignore[override]
        out_splits, in_splits = ctx.splits
        return _a2a(grad, in_splits, out_splits, ctx.group), None, None, None


def _a2a(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable ragged all-to-all along dim 0: in_splits[p] rows go to group rank p, out_splits[q] come from q."""
    return _AllToAll.apply(x, out_splits, in_splits, group)


def _exchange_counts(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """send[p, j]: rows for peer p's j-th local expert; returns recv[q, j]: rows from peer q for my j-th expert."""
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv.view(-1), send.contiguous().view(-1), group=group)
    return recv


def _split_over(x: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This tp rank's chunk of a tensor replicated over `mesh` (torch.chunk sizes); backward all-gathers the
    gradient, which is then whole on every rank, as a replicated tensor's must be (DTensor Replicate -> Shard)."""
    dt = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return dt.redistribute(mesh, [Shard(0)]).to_local()


def _gather_over(x: torch.Tensor, mesh: DeviceMesh, rows: int) -> torch.Tensor:
    """The chunks of `_split_over` all-gathered into `rows` rows; backward keeps this rank's chunk of the
    (replicated, whole) gradient and sends nothing (DTensor Shard -> Replicate)."""
    shape = torch.Size((rows, *x.shape[1:]))
    dt = DTensor.from_local(x, mesh, [Shard(0)], run_check=False, shape=shape, stride=_contiguous_stride(shape))
    return dt.redistribute(mesh, [Replicate()]).to_local()


def _contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    stride, out = 1, []
    for n in reversed(shape):
        out.append(stride)
        stride *= n
    return tuple(reversed(out))


def _chunk_rows(n: int, parts: int, index: int) -> slice:
    """Rows of chunk `index` of torch.chunk(n rows, parts): what DTensor's Shard(0) gives each rank."""
    size = -(-n // parts)
    start = min(index * size, n)
    return slice(start, min(start + size, n))


# ---- expert tensor parallelism -----------------------------------------------------------------
class _RowShard(nn.Linear):
    """w2 of an etp shard: its input columns; the bias (whole, replicated over etp) is added on etp rank 0 only,
    so the partial sums added by the sender contain it once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, add_bias: bool,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.add_bias = add_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias if self.add_bias else None)


def _sliced(lin: nn.Linear, rows: slice | None, cols: slice | None, add_bias: bool = True) -> nn.Linear:
    """A copy of `lin` holding rows (output features, bias too) or columns (input features) of its weight."""
    w = lin.weight.detach()
    w = w[rows] if rows is not None else w[:, cols]
    cls = nn.Linear if cols is None else _RowShard
    kwargs = {} if cols is None else {"add_bias": add_bias}
    new = torch.nn.utils.skip_init(cls, w.shape[1], w.shape[0], bias=lin.bias is not None, dtype=w.dtype,
                                   device=w.device, **kwargs)
    with torch.no_grad():
        new.weight.copy_(w)
        if lin.bias is not None:
            new.bias.copy_(lin.bias.detach()[rows] if rows is not None else lin.bias.detach())
    return new


def _shard_expert(mlp: MLP, etp: int, etp_rank: int) -> MLP:
    """Megatron's expert TP in place: w1 (and w3) column-parallel, w2 row-parallel; etp = 1 keeps the module.
    Plain slices, not DTensor's Colwise/RowwiseParallel: RowwiseParallel would all-reduce w2's output over etp,
    while here each etp shard returns its partial sum and the token's sender adds them (module docstring, step 5)."""
    if etp == 1:
        return mlp
    ffn = mlp.w1.out_features
    if ffn % etp:
        raise ValueError(f"etp={etp} does not divide the expert width {ffn}")
    part = slice(etp_rank * ffn // etp, (etp_rank + 1) * ffn // etp)
    mlp.w1 = _sliced(mlp.w1, part, None)
    if hasattr(mlp, "w3"):
        mlp.w3 = _sliced(mlp.w3, part, None)
    mlp.w2 = _sliced(mlp.w2, None, part, add_bias=etp_rank == 0)
    return mlp


def _etp_dim(name: str) -> int | None:
    """The dim an expert parameter (name relative to the expert) is split on over etp; None: not split."""
    if name.startswith(("w1.", "w3.")):
        return 0
    return 1 if name == "w2.weight" else None


# ---- the layer ---------------------------------------------------------------------------------
class ExpertParallelMoE(nn.Module):
    """The reference MoE with its routed experts spread over the ep x etp group (see the module docstring).

    Parameter names are the reference's: `router.weight`, `experts.<global id>.w1.weight` (a ModuleDict of this
    rank's experts, etp-sliced), `shared_experts.<j>...`. `group`: the flattened ep x etp process group (group
    rank = placement.position). `tp_mesh`: given iff the input tokens are replicated over tp (tp > 1 without
    SP); each tp rank then dispatches only its chunk. `source_block` (tests only): take the experts' weights
    from this ep block instead of placement.ep_rank's.
    """

    def __init__(self, moe: MoE, placement: ExpertPlacement, group: dist.ProcessGroup,
                 tp_mesh: DeviceMesh | None = None, source_block: int | None = None) -> None:
        super().__init__()
        if len(moe.experts) != placement.num_experts:
            raise ValueError(f"the MoE has {len(moe.experts)} experts, the placement {placement.num_experts}")
        if dist.get_world_size(group) != placement.group_size:
            raise ValueError(f"group of {dist.get_world_size(group)} ranks for ep x etp = {placement.group_size}")
        if dist.get_rank(group) != placement.position:
            raise ValueError(f"group rank {dist.get_rank(group)} is not the placement's position {placement.position}")
        self.top_k = moe.top_k
        self.router = moe.router
        self.placement = placement
        self.group = group
        self.tp_mesh = tp_mesh
        block = placement.ep_rank if source_block is None else source_block
        held = zip(placement.local_experts, placement.experts_of(block), strict=True)
        self.experts = nn.ModuleDict(
            {str(e): _shard_expert(moe.experts[src], placement.etp, placement.etp_rank) for e, src in held})
        self.shared_experts = moe.shared_experts

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference gating itself (same ops, so top-k ties break the same way)."""
        return MoE.route(self, x)  # type: ignore[arg-type]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.route(flat)
        if self.tp_mesh is None:
            out = self._routed(flat, weights, ids)
        else:  # route all tokens (the router's gradient stays whole on every tp rank), dispatch this rank's chunk
            rows = _chunk_rows(flat.shape[0], self.tp_mesh.size(), self.tp_mesh.get_local_rank())
            mine = self._routed(_split_over(flat, self.tp_mesh), _split_over(weights, self.tp_mesh), ids[rows])
            out = _gather_over(mine, self.tp_mesh, flat.shape[0])
        for shared in self.shared_experts:
            out = out + shared(flat)
        return out.view(shape)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Dispatch, run the experts, return and combine: the routed experts' output for tokens x (tokens, hidden)."""
        p = self.placement
        picks = [(ids == e).nonzero(as_tuple=True) for e in range(p.num_experts)]  # (token, slot), tokens ascending
        order = [e for dest in range(p.group_size) for e in p.experts_of(dest // p.etp)]  # to every etp shard
        send = torch.tensor([picks[e][0].numel() for e in order], dtype=torch.int64,
                            device=x.device).view(p.group_size, p.per_rank)  # NCCL exchanges device tensors only
        recv = _exchange_counts(send, self.group)
        send_splits, recv_splits = send.sum(1).tolist(), recv.sum(1).tolist()
        rows = torch.cat([x.index_select(0, picks[e][0]) for e in order])
        received = all_to_all(rows, recv_splits, send_splits, self.group)
        back = all_to_all(self._run_local(received, recv), send_splits, recv_splits, self.group)
        return self._combine(back.split(send.view(-1).tolist()), picks, weights, torch.zeros_like(x))

    def _combine(self, back: tuple[torch.Tensor, ...], picks: list[tuple[torch.Tensor, torch.Tensor]],
                 weights: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Add each expert's etp partial sums (shard 0 first), weight them and index_add them into `out` expert by
        expert in global order, as the reference does. back[dest * per_rank + j]: dest's j-th expert's rows."""
        p = self.placement
        for e, (token, slot) in enumerate(picks):
            i, j = divmod(e, p.per_rank)
            y = back[i * p.etp * p.per_rank + j]
            for t in range(1, p.etp):
                y = y + back[(i * p.etp + t) * p.per_rank + j]
            out = out.index_add(0, token, y * weights[token, slot, None])
        return out

    def _run_local(self, received: torch.Tensor, recv: torch.Tensor) -> torch.Tensor:
        """Each local expert on its rows from every source (in source order); results in the received order."""
        p = self.placement
        pieces = received.split(recv.view(-1).tolist())  # source q, local expert j at q * per_rank + j
        outs: list[torch.Tensor] = list(pieces)
        for j, e in enumerate(p.local_experts):
            index = [q * p.per_rank + j for q in range(p.group_size)]
            y = self.experts[str(e)](torch.cat([pieces[k] for k in index]))  # runs on zero rows too: grad never None
            for k, part in zip(index, y.split([pieces[k].shape[0] for k in index]), strict=True):
                outs[k] = part
        return torch.cat(outs)


# ---- applying it -------------------------------------------------------------------------------
def _blocks(module: Transformer | ModelChunk) -> Iterator[nn.Module]:
    layers = module.layers
    return iter(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def _ep_etp_group(meshes: Meshes) -> dist.ProcessGroup:
    # the flattened sub-mesh is cached by name, so a second call (another chunk) reuses the same group
    return meshes.expert["ep", "etp"]._flatten("ep_etp").get_group()  # noqa: SLF001 - torch's way to merge mesh dims


def apply_expert_parallel(module: Transformer | ModelChunk, meshes: Meshes, lay: Layout,
                          inject: str | None = None) -> Transformer | ModelChunk:
    """Replace every MoE feed-forward of `module` (a Transformer or a ModelChunk, built identically on every rank)
    by an ExpertParallelMoE for this rank, in place; returns `module`. Collective: every rank of the world calls it
    (the first call flattens the ep x etp mesh). Tokens are split over tp iff lay.tp > 1 and not lay.sp."""
    if inject is not None and inject not in INJECTIONS:
        raise ValueError(f"unknown injection {inject!r}; known: {', '.join(INJECTIONS)}")
    coords = rank_coords(dist.get_rank(), lay)
    group = _ep_etp_group(meshes)
    split = lay.tp > 1 and not lay.sp and inject != "no-token-split"
    tp_mesh = meshes["tp"] if split else None
    for block in _blocks(module):
        if not isinstance(block.feed_forward, MoE):
            continue
        placement = ExpertPlacement(len(block.feed_forward.experts), lay.ep, lay.etp, coords["ep"], coords["etp"])
        source = (coords["ep"] + 1) % lay.ep if inject == "wrong-expert-placement" else None
        block.feed_forward = ExpertParallelMoE(block.feed_forward, placement, group, tp_mesh, source)
    return module


def expert_parameters(module: nn.Module) -> dict[str, tuple[nn.Parameter, int | None]]:
    """Every routed-expert parameter of `module` by reference name, with the dim it is split on over etp (None:
    whole; always None when etp = 1)."""
    out: dict[str, tuple[nn.Parameter, int | None]] = {}
    for prefix, m in module.named_modules():
        if isinstance(m, ExpertParallelMoE):
            base = f"{prefix}.experts." if prefix else "experts."
            for name, p in m.experts.named_parameters():
                dim = _etp_dim(name.split(".", 1)[1]) if m.placement.etp > 1 else None  # name less the expert id
                out[base + name] = (p, dim)
    return out


def reduce_expert_grads(module: nn.Module, meshes: Meshes, lay: Layout, divide_by: float | None = None) -> None:
    """Turn every expert parameter's local gradient into the global-mean-loss gradient: w2 biases (added on etp
    rank 0 only) summed over etp, then every expert gradient SUMmed over edp and divided by `divide_by`
    (default dp*cp: the dense gradients' averaging group; see the module docstring). Collective over etp and edp;
    call it once per step after the last micro-batch's backward."""
    divide_by = float(lay.dp * lay.cp) if divide_by is None else divide_by
    params = expert_parameters(module)
    for p, dim in params.values():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if lay.etp > 1 and dim is None:  # a w2 bias: only etp rank 0 computed its gradient
            dist.all_reduce(p.grad, group=meshes["etp"].get_group())
    grads = [p.grad for p, _ in params.values()]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])  # one all-reduce for all experts of the module
    if lay.edp > 1:
        dist.all_reduce(flat, group=meshes["edp"].get_group())
    flat.div_(divide_by)
    for g, part in zip(grads, flat.split([g.numel() for g in grads]), strict=True):
        g.copy_(part.view_as(g))


def full_tensors(module: nn.Module, meshes: Meshes, lay: Layout, grads: bool = False) -> dict[str, torch.Tensor]:
    """{reference name: full tensor} of every parameter (grads=True: every gradient) this rank holds, etp shards
    all-gathered (DTensor Shard -> full_tensor over meshes["etp"]). Collective over etp."""
    sharded = expert_parameters(module)
    out = {}
    for name, p in module.named_parameters():
        t = p.grad if grads else p
        if t is None:
            raise RuntimeError(f"parameter {name} has no gradient")
        dim = sharded.get(name, (None, None))[1]
        if dim is not None:
            t = DTensor.from_local(t.detach(), meshes["etp"], [Shard(dim)], run_check=False).full_tensor()
        out[name] = t.detach().to("cpu", copy=True)
    return out


# ---- merging the ranks' reports ----------------------------------------------------------------
