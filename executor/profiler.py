"""`meshplan profile`: microbenchmarks of this device, fitted into a calibration (hardware_db/calibration.py).

What is timed, each after warm-up, several times, the median kept (CUDA events on a GPU, a monotonic clock on a
CPU, where every rank runs one thread as the executor's ranks do):
- GEMMs over the shapes a model's layers produce (QKV, out-projection, MLP up and down, expert GEMMs at small
  token counts, LM head; at each TP degree and token count), plus a square sweep that spans the FLOP range;
- causal attention (scaled_dot_product_attention) forward and backward over sequence lengths;
- memory-bound operators (norm, SwiGLU, residual add, rotary, softmax) forward and backward, as the reference
  executor computes them, against the bytes the cost model counts for them;
- collectives (all-reduce, all-gather, reduce-scatter, all_to_all_single, send/recv) over message sizes and
  group sizes, on spawned gloo ranks (CPU) or NCCL (one process per GPU);
- autograd's saved bytes for one decoder layer forward against the cost model's activation formula.
torch is imported inside the functions: `import executor.profiler` works without it.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import math
import os
import platform
import re
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from meshplan.costmodels.calibrate import fit_model
from meshplan.costmodels.config import ParallelConfig, Workload, resolve
from meshplan.costmodels.efficiency import EXECUTOR_RUNTIME
from meshplan.costmodels.memory import layer_activation_bytes
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.ops import ACT_BYTES
from meshplan.costmodels.runtime import get_runtime
from meshplan.hardware_db.calibration import (CALIBRATION_SCHEMA_VERSION, ActivationPoint, AttentionPoint, Calibration,
                                              CollectivePoint, DeviceInfo, GemmPoint, LayerOverhead, Measurements,
                                              MemoryOpPoint, OptimizerPoint, Software, StepOverhead)
from meshplan.hardware_db.errors import InputError

__all__ = ["ProfileOptions", "Progress", "default_grid", "gemm_shapes", "gpu_target", "profile"]

Progress = Callable[[str, int, int], None]  # (what is running, done, total)
DEEP = 4  # layers of the whole model whose overhead per layer is measured
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


@dataclass(frozen=True)
class ProfileOptions:
    """What to profile. tokens: token counts per micro-batch for the model's GEMMs; ranks: collective group sizes
    (CPU: spawned gloo ranks, at most the cores; one GPU: none)."""

    device: str = "cpu"
    quick: bool = False
    model: ModelSpec | None = None
    target: str | None = None  # hardware_db GPU name for a cuda profile (default: from the device's name)
    dtype: str = "float64"
    tokens: tuple[int, ...] = (128, 256, 512, 1024)
    tp: tuple[int, ...] = (1, 2)
    seq: tuple[int, ...] = (128, 256, 512)
    overhead_seq: tuple[int, ...] = (128, 256, 512)  # sequence lengths of the whole-layer and model probes
    ranks: tuple[int, ...] = (2,)
    repeats: int = 5
    warmup: int = 2
    statistic: str = "median"  # of the repetitions; "min" on a shared host whose speed drifts (noisy neighbours)
    timeout_s: float = 120.0


def default_grid(device: str, quick: bool) -> dict[str, Any]:
    """The shapes, repetitions and collective groups a profile takes unless told. A GPU's grid starts where its
    kernels stop being launch-bound (seq 1k-8k, 2k-32k tokens: below them an H200 times dispatch, not the kernel,
    and an 8k attention extrapolated from 512 comes out 3-5x slow; the review's finding 3); its collectives and its
    TP layer probe run on every visible GPU (with more than one), and TP over all of them joins the sharded shapes."""
    if device == "cuda":
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        grid: dict[str, Any] = dict(seq=(1024, 2048, 4096, 8192), overhead_seq=(1024, 4096),
                                    tokens=(2048, 4096, 8192, 16384, 32768), ranks=(gpus,) if gpus > 1 else (),
                                    tp=tuple(sorted({1, 2, max(gpus, 1)})))
        if quick:
            grid |= dict(seq=(1024, 4096, 8192), tokens=(2048, 8192, 32768), repeats=5, warmup=3)
        return grid
    return dict(repeats=3, warmup=1, seq=(128, 256), tokens=(128, 512, 2048)) if quick else {}


# ---- shapes ----------------------------------------------------------------------------------------------------------
def gemm_shapes(model: ModelSpec, tokens: Sequence[int], tps: Sequence[int]) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of the GEMMs a layer of `model` runs per rank (costmodels/ops.py's shapes) at each token
    count and TP degree that divides the model's heads."""
    out: set[tuple[str, int, int, int]] = set()
    h, d = model.hidden, model.head_size
    for t in tps:
        if model.num_heads % t or model.kv_heads % t:
            continue
        heads, kv = model.num_heads // t, model.kv_heads // t
        for m in tokens:
            out.add(("qkv_proj", m, (heads + 2 * kv) * d, h))
            out.add(("out_proj", m, h, heads * d))
            up = 2 * model.ffn_hidden // t if model.mlp == "swiglu" else model.ffn_hidden // t
            out.add(("up_proj", m, up, h))
            out.add(("down_proj", m, h, model.ffn_hidden // t))
            out.add(("lm_head", m, model.vocab // t, h))
            if model.moe is not None:
                for per_expert in (max(1, m // 64), max(1, m // 8)):  # experts see few tokens each
                    out.add(("expert_up", per_expert, 2 * model.moe.expert_ffn_hidden // t, h))
                    out.add(("expert_down", per_expert, h, model.moe.expert_ffn_hidden // t))
    return sorted(out, key=lambda s: (s[1] * s[2] * s[3], s))


def _sweep(quick: bool, gpu: bool) -> list[tuple[str, int, int, int]]:
    """Square and thin GEMMs from launch-bound to compute-bound, so other models' shapes interpolate."""
    sizes = [64, 128, 256, 512, 1024] if not gpu else [256, 512, 1024, 2048, 4096, 8192]
    if quick:
        sizes = sizes[::2] + ([sizes[-1]] if len(sizes) % 2 == 0 else [])
    shapes = [("square", s, s, s) for s in sizes]
    shapes += [("thin", 16, s, s) for s in sizes[1:]]
    return shapes


# ---- timing ----------------------------------------------------------------------------------------------------------
# a GPU idles at a low clock (345 MHz seen on the lent H200, ../shared/reviews/gpu_readiness.md finding 4); one second
# of work to raise it is an assumption, to be checked on the first GPU run
BURN_IN_S = 1.0
# calls run back to back between two events until a block is this long, so launches overlap and one call's launch
# latency is a small part of it: an assumption of the same kind
BLOCK_S = 1e-3


def back_to_back(seconds: float, most: int = 100) -> int:
    """How many calls of `seconds` each fill one timed block of BLOCK_S: small kernels are timed as the GPU runs
    them in a stream, not by the launch latency of one call between two events."""
    return max(1, min(most, math.ceil(BLOCK_S / max(seconds, 1e-9))))


class _Timer:
    """Median (or fastest) seconds of fn() over `repeats` runs after `warmup`: on a CPU, perf_counter around each
    call; on a GPU, after a burn-in of BURN_IN_S, CUDA events around a block of back_to_back calls (one call per block
    where `setup` must run before each)."""

    def __init__(self, device: str, repeats: int, warmup: int, statistic: str = "median",
                 agree: Callable[[int], int] | None = None) -> None:
        self.device, self.repeats, self.warmup = device.split(":")[0], repeats, warmup  # "cuda:1" times as "cuda"
        self.pick = min if statistic == "min" else statistics.median
        self.burnt = self.device != "cuda"
        # ranks whose calls hold collectives (a TP layer) must make as many calls as each other: the burn-in is then
        # a count every rank agrees on (the largest of theirs), not a time each rank keeps on its own
        self.agree = agree

    def _gpu(self, fn: Callable[[], Any]) -> float:
        """Seconds per call of fn on the GPU: burn-in (once per timer), warm-up, then blocks of back-to-back calls."""
        import torch

        self._burn(fn)
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(max(1, self.warmup)):
            fn()
        stop.record()
        torch.cuda.synchronize()
        calls = back_to_back(start.elapsed_time(stop) / 1e3 / max(1, self.warmup))
        times = []
        for _ in range(self.repeats):
            start.record()
            for _ in range(calls):
                fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop) / 1e3 / calls)
        return max(self.pick(times), 1e-9)

    def _burn(self, fn: Callable[[], Any], setup: Callable[[], Any] | None = None) -> None:
        """Once per timer on a GPU: BURN_IN_S of the first probe, so the clock is up before anything is timed."""
        import torch

        if self.burnt:
            return

        def once() -> None:
            if setup is not None:
                setup()
            fn()
            torch.cuda.synchronize()

        if self.agree is not None:
            t0 = time.perf_counter()
            once()
            for _ in range(self.agree(math.ceil(BURN_IN_S / max(time.perf_counter() - t0, 1e-6)))):
                once()
        else:
            end = time.perf_counter() + BURN_IN_S
            while time.perf_counter() < end:
                once()
        self.burnt = True

    def __call__(self, fn: Callable[[], Any], setup: Callable[[], Any] | None = None) -> float:
        import torch

        if self.device == "cuda" and setup is None:
            return self._gpu(fn)
        if self.device == "cuda":
            self._burn(fn, setup)
        times = []
        for i in range(self.warmup + self.repeats):
            if setup is not None:
                setup()
            if self.device == "cuda":
                start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                stop.record()
                torch.cuda.synchronize()
                elapsed = start.elapsed_time(stop) / 1e3
            else:
                t0 = time.perf_counter()
                fn()
                elapsed = time.perf_counter() - t0
            if i >= self.warmup:
                times.append(elapsed)
        return max(self.pick(times), 1e-9)


def _torch_dtype(name: str) -> Any:
    import torch

    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
              "float64": torch.float64}
    if name not in dtypes:
        raise InputError(f"--dtype {name!r}: choose one of {', '.join(dtypes)}")
    return dtypes[name]


def _time_gemms(shapes: Sequence[tuple[str, int, int, int]], opts: ProfileOptions, timer: _Timer,
                tick: Callable[[str], None], backward: bool) -> list[GemmPoint]:
    """Each shape as nn.Linear runs it: forward x[m,k] W[n,k]^T; with `backward` also the input gradient
    dy[m,n] W[n,k] and the weight gradient dy^T[n,m] x[m,k] (torch autograd's mm calls)."""
    dtype, points = _torch_dtype(opts.dtype), []
    for name, m, n, k in shapes:
        tick(f"GEMM {name} {m}x{k} @ {k}x{n}")
        points += _gemm_points(name, m, n, k, dtype, opts.device, timer, backward)
    return points


def _gemm_points(name: str, m: int, n: int, k: int, dtype: Any, device: str, timer: _Timer,
                 backward: bool) -> list[GemmPoint]:
    """One shape's forward (and with `backward` its dgrad and wgrad) timed; its own function so that the timed
    closures hold this shape's tensors."""
    import torch
    import torch.nn.functional as F

    x = torch.randn(m, k, dtype=dtype, device=device)
    w = torch.randn(n, k, dtype=dtype, device=device)
    points = [GemmPoint(name=name, m=m, n=n, k=k, seconds=timer(lambda: F.linear(x, w)))]
    if backward:
        dy = torch.randn(m, n, dtype=dtype, device=device)
        points.append(GemmPoint(name=f"{name} dgrad", direction="backward", m=m, n=k, k=n,
                                seconds=timer(lambda: torch.mm(dy, w))))
        points.append(GemmPoint(name=f"{name} wgrad", direction="backward", m=n, n=k, k=m,
                                seconds=timer(lambda: torch.mm(dy.t(), x))))
    return points


def _attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> float:
    """The cost model's causal flash-attention forward FLOPs (costmodels/ops.py: half of 2*b*h*s*s*(d_qk + d_v))."""
    return 0.5 * 2.0 * batch * heads * seq * seq * (2 * head_dim)


def _time_attention(model: ModelSpec, opts: ProfileOptions, timer: _Timer,
                    tick: Callable[[str], None]) -> list[AttentionPoint]:
    dtype, points = _torch_dtype(opts.dtype), []
    for t in opts.tp:
        if model.num_heads % t or model.kv_heads % t:
            continue
        heads, kv = model.num_heads // t, model.kv_heads // t
        for seq in opts.seq:
            tick(f"attention {heads} heads x {seq} tokens")
            points.append(_attention_point(heads, kv, seq, model.head_size, dtype, opts.device, timer))
    return points


def _attention_point(heads: int, kv: int, seq: int, d: int, dtype: Any, device: str,
                     timer: _Timer) -> AttentionPoint:
    """Causal attention of one shape, forward and backward, as the executor runs it (GQA: kv heads repeated, then
    causal SDPA)."""
    import torch
    import torch.nn.functional as F

    q = torch.randn(1, heads, seq, d, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(1, kv, seq, d, dtype=dtype, device=device, requires_grad=True)
    v = torch.randn(1, kv, seq, d, dtype=dtype, device=device, requires_grad=True)
    grad = torch.randn(1, heads, seq, d, dtype=dtype, device=device)

    def forward() -> Any:
        rep = heads // kv
        kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)

    fwd = timer(lambda: forward())
    holder: list[Any] = []
    bwd = timer(lambda: holder.pop().backward(grad), setup=lambda: holder.append(forward()))
    return AttentionPoint(batch=1, heads=heads, kv_heads=kv, seq=seq, head_dim=d,
                          fwd_flops=_attention_flops(1, heads, seq, d), fwd_seconds=fwd, bwd_seconds=bwd)


def _time_memory_ops(model: ModelSpec, opts: ProfileOptions, timer: _Timer,
                     tick: Callable[[str], None]) -> list[MemoryOpPoint]:
    """Each memory-bound operator class of costmodels/ops.py (memory_class), computed as the reference executor
    computes it (executor/model.py), so a CPU calibration times what verify runs; bytes as ops.py counts them
    (16-bit elements in + out, backward 2x (softmax 1.5x); cross-entropy 4 fp32 passes forward, 2 backward)."""
    import torch
    import torch.nn.functional as F

    from meshplan.executor.model import RMSNorm

    dtype, dev, points = _torch_dtype(opts.dtype), opts.device, []
    h, vocab = model.hidden, model.vocab
    norm = RMSNorm(h, dtype).to(dev) if model.norm != "layernorm" else torch.nn.LayerNorm(h, dtype=dtype).to(dev)
    emb = torch.nn.Embedding(vocab, h, dtype=dtype).to(dev)
    act = {"gelu": F.gelu, "relu2": lambda x: F.relu(x) ** 2}.get(model.mlp)

    def leaf(*shape: int) -> Any:
        return torch.randn(*shape, dtype=dtype, device=dev, requires_grad=True)

    for tokens in opts.tokens:
        for name, fn, model_bytes, bwd_factor in _memory_op_cases(model, tokens, leaf, norm, emb, act, dev):
            tick(f"{name} over {tokens} tokens")
            points += _memory_op_points(name, fn, tokens, model_bytes, bwd_factor, timer)
    return points


def _memory_op_cases(model: ModelSpec, tokens: int, leaf: Callable[..., Any], norm: Any, emb: Any,
                     act: Callable[[Any], Any] | None, dev: str) -> list[tuple[str, Callable[[], Any], float, float]]:
    """(class, its forward over `tokens` tokens, its bytes as ops.py counts them, its backward's bytes factor)."""
    import torch
    import torch.nn.functional as F

    from meshplan.executor.model import apply_rope

    h, d, vocab, ffn, heads = model.hidden, model.head_size, model.vocab, model.ffn_hidden, model.num_heads
    x, y = leaf(tokens, h), leaf(tokens, h)
    r = leaf(1, tokens, heads, d)
    pos = torch.arange(tokens, device=dev)
    s = leaf(heads, tokens)
    logits = leaf(tokens, vocab)
    labels = torch.randint(0, vocab, (tokens,), device=dev)
    ids = torch.randint(0, vocab, (1, tokens), device=dev)
    e = tokens * h
    cases: list[tuple[str, Callable[[], Any], float, float]] = [
        ("norm", lambda: norm(x), ACT_BYTES * 2 * e, 2.0),
        ("residual_add", lambda: x + y, ACT_BYTES * 3 * e, 2.0),
        ("rope", lambda: apply_rope(r, pos), ACT_BYTES * 2 * tokens * heads * d, 2.0),
        ("softmax", lambda: s.softmax(-1), ACT_BYTES * 2 * heads * tokens, 1.5),
        ("cross_entropy", lambda: F.cross_entropy(logits, labels), 4 * 4 * tokens * vocab, 0.5),
        ("embedding", lambda: emb(ids), ACT_BYTES * (tokens + e), 2.0),
    ]
    if model.mlp == "swiglu":
        g = leaf(tokens, 2 * ffn)
        cases.append(("swiglu", lambda: F.silu(g[:, :ffn]) * g[:, ffn:], ACT_BYTES * 3 * tokens * ffn, 2.0))
    elif act is not None:
        a = leaf(tokens, ffn)
        cases.append(("activation", lambda: act(a), ACT_BYTES * 2 * tokens * ffn, 2.0))
    return cases


def _memory_op_points(name: str, fn: Callable[[], Any], tokens: int, model_bytes: float, bwd_factor: float,
                      timer: _Timer) -> list[MemoryOpPoint]:
    """One memory-bound operator's forward and backward timed."""
    import torch

    fwd = timer(fn)
    holder: list[Any] = []

    def backward() -> None:
        out = holder.pop()
        out.backward(torch.ones_like(out))

    bwd = timer(backward, setup=lambda: holder.append(fn()))
    return [MemoryOpPoint(name=name, direction="forward", elements=tokens, model_bytes=model_bytes, seconds=fwd),
            MemoryOpPoint(name=name, direction="backward", elements=tokens, model_bytes=bwd_factor * model_bytes,
                          seconds=bwd)]


def _time_optimizer(model: ModelSpec, opts: ProfileOptions, timer: _Timer,
                    tick: Callable[[str], None]) -> list[OptimizerPoint]:
    """torch's AdamW over the parameters of 1, 2 and 4 layers (plus embedding and head) of the model: on a CPU
    with the executor's settings (executor/reference.py ADAMW: per-tensor loop), on a GPU fused. Below fp32 the step
    is mixed precision as Megatron's and torchtitan's: AdamW on fp32 master weights (fp32 gradients and moments),
    then the copy back into the bf16/fp16 weights (Megatron-LM optimizer.py, _copy_main_params_to_model_params)."""
    import torch

    from meshplan.executor.model import probe_model
    from meshplan.executor.reference import ADAMW

    dtype, points = _torch_dtype(opts.dtype), []
    settings = dict(ADAMW) if opts.device == "cpu" else {**ADAMW, "foreach": False, "fused": True}
    for layers in (1, 2, 4) if opts.quick else (1, 2, 4, 8):
        params = list(probe_model(model.model_copy(update={"num_layers": layers}), dtype, opts.device).parameters())
        count = sum(p.numel() for p in params)
        tick(f"AdamW step over {count / 1e6:.1f} M parameters")
        weights = [p.detach() for p in params]
        mixed = dtype.itemsize < 4
        masters = [torch.nn.Parameter(w.float() if mixed else w) for w in weights]
        for m in masters:
            m.grad = torch.randn_like(m)
        opt = torch.optim.AdamW(masters, lr=1e-4, **settings)
        step = functools.partial(_adamw_step, opt, weights if mixed else [], masters if mixed else [])
        points.append(OptimizerPoint(params=count, seconds=timer(step)))
    return points


def _adamw_step(opt, weights: list, masters: list) -> None:
    """One AdamW step, then the fp32 masters copied into the model's lower-precision weights (none: fp32 and up)."""
    import torch

    opt.step()
    if weights:
        torch._foreach_copy_(weights, masters)  # one multi-tensor launch, as Megatron's multi_tensor_applier


def _activation_points(model: ModelSpec, opts: ProfileOptions, tick: Callable[[str], None]) -> list[ActivationPoint]:
    """Saved bytes of the executor's decoder layer (forward of one micro-batch) under each recompute mode, as
    executor/recompute.py installs it, vs layer_activation_bytes for that mode."""
    import torch

    from meshplan.executor.model import TransformerBlock
    from meshplan.executor.recompute import _recomputed_block, _recomputed_core, saved_activation_bytes

    dtype = _torch_dtype(opts.dtype)
    itemsize = torch.empty((), dtype=dtype).element_size()
    rt = get_runtime(EXECUTOR_RUNTIME)
    points = []
    for mode in ("none", "selective", "full"):
        with torch.device(opts.device):  # built where it runs
            layer = TransformerBlock(model, 0, dtype)
        if mode == "full":
            layer.forward = partial(_recomputed_block, layer.forward)
        elif mode == "selective":
            layer.attention.core = partial(_recomputed_core, layer.attention.core)
        for seq in opts.seq:
            tick(f"activation memory of one layer, {seq} tokens, recompute {mode}")
            x = torch.randn(1, seq, model.hidden, dtype=dtype, device=opts.device, requires_grad=True)
            out, measured = saved_activation_bytes(list(layer.parameters()), layer, x,
                                                   torch.arange(seq, device=opts.device))
            out.sum().backward()
            wl = Workload(global_batch=1, seq_len=seq)
            lay = resolve(model, 1, wl, ParallelConfig(tp=1, pp=1, dp=1, mbs=1))
            predicted = layer_activation_bytes(model, 0, lay, wl, rt, mode) / ACT_BYTES * itemsize
            points.append(ActivationPoint(model=model.name, tokens=seq, recompute=mode,
                                          measured_bytes=float(max(measured, 1)), predicted_bytes=predicted))
    return points


# ---- whole layers and models: what the operators' sum leaves out --------------------------------------------------
def _backward_timer(timer: _Timer, run: Callable[[], Any], sync: Callable[[], None] | None) -> float:
    """Seconds of the backward of run()'s output (a fresh forward before each, not timed)."""
    import torch

    holder: list[Any] = []

    def setup() -> None:
        holder.append(run())
        if sync is not None:
            sync()

    def backward() -> None:
        y = holder.pop()
        y.backward(torch.ones_like(y))

    return timer(backward, setup=setup)


def _chunk_times(model: ModelSpec, dtype_name: str, device: str, seqs: Sequence[int], repeats: int, warmup: int,
                 layers: int, tp_mesh: Any = None, sp: bool = False,
                 statistic: str = "median") -> list[tuple[int, float, float]]:
    """(seq, forward s, backward s) of one micro-batch through the executor's model: layers=0, the middle layer of
    a 3-layer model (TP-sharded over tp_mesh when given, with sequence parallelism if sp: its input and output
    are then this rank's seq/tp tokens); layers=L, a whole L-layer model with its loss."""
    from meshplan.executor.model import probe_model

    dtype = _torch_dtype(dtype_name)
    timer = _Timer(device, repeats, warmup, statistic, agree=_largest_over_ranks if tp_mesh is not None else None)
    out = []
    for seq in seqs:  # a fresh model each: TP shards a module once, and its chunk's positions are per length
        full = probe_model(model.model_copy(update={"num_layers": layers or 3}), dtype, device)
        out += _chunk_seq_times(full, model, dtype, device, seq, timer, layers, tp_mesh, sp)
    return out


def _largest_over_ranks(n: int) -> int:
    """The largest n of every rank in the default group (a collective: every rank calls it)."""
    import torch
    import torch.distributed as dist

    from meshplan.executor.mesh import rank_device

    value = torch.tensor([n], dtype=torch.int64, device=rank_device())
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return int(value.item())


def _chunk_seq_times(full: Any, model: ModelSpec, dtype: Any, device: str, seq: int, timer: _Timer, layers: int,
                     tp_mesh: Any, sp: bool) -> list[tuple[int, float, float]]:
    import torch

    from meshplan.executor.model import ModelChunk

    tp = tp_mesh.size() if tp_mesh is not None else 1
    chunk = (ModelChunk(full, 1, 2, positions=torch.arange(seq, device=device)) if layers == 0 else full).to(device)
    if tp_mesh is not None:
        from meshplan.executor.tensor_parallel import apply_tensor_parallel

        apply_tensor_parallel(chunk, tp_mesh, sp)
    sync = (lambda: torch.distributed.barrier()) if tp_mesh is not None else None
    torch.manual_seed(seq)
    if layers == 0:
        local = seq // tp if sp else seq
        x = torch.randn(1, local, model.hidden, dtype=dtype, device=device, requires_grad=True)
        run: Callable[[], Any] = lambda: chunk(x)  # noqa: E731
    else:
        tokens = torch.randint(0, model.vocab, (1, seq), device=device)
        run = lambda: full(tokens, tokens)  # noqa: E731 - Transformer.forward: logits and the token loss
    return [(seq, timer(run, setup=sync), _backward_timer(timer, run, sync))]


def _tp_layer_rank(rank: int, world: int, model: ModelSpec, dtype_name: str, seqs: tuple[int, ...], repeats: int,
                   warmup: int, sp: bool, statistic: str) -> list[tuple[int, float, float]]:
    from torch.distributed.device_mesh import init_device_mesh

    from meshplan.executor.mesh import rank_device

    dev = rank_device()  # gloo: the CPU; NCCL: this rank's own GPU (launch.bind_device)
    return _chunk_times(model, dtype_name, str(dev), seqs, repeats, warmup, 0, init_device_mesh(dev.type, (world,)),
                        sp, statistic)


def _predicted(model: ModelSpec, cal: Calibration, seq: int, tp: int, layers: int,
               sp: bool = False) -> tuple[float, float]:
    """The calibrated cost model's (forward, backward) of what _chunk_times ran, communication included, without
    an overhead term (the calibration being fitted has none yet)."""
    from meshplan.costmodels.efficiency import calibrated_cluster
    from meshplan.costmodels.passes import GroupLinks, PassCache
    from meshplan.hardware_db.cluster import ClusterSpec

    spec = ClusterSpec(gpu=cal.device.target, num_gpus=tp, gpus_per_node=tp)
    cluster, eff = calibrated_cluster(spec, cal, "the profile")
    wl = Workload(global_batch=1, seq_len=seq)
    lay = resolve(model, tp, wl, ParallelConfig(tp=tp, mbs=1, sp=sp))
    passes, links = PassCache(model, cluster, wl, get_runtime(EXECUTOR_RUNTIME), eff), GroupLinks(cluster, lay)
    t, _ = passes.layer(1, lay, links)
    fwd, bwd = t.forward, t.backward_input + t.bwd_weight_compute
    if layers == 0:
        return fwd, bwd
    edges = [passes.embedding(lay, links), passes.head(lay, links)]
    return (layers * fwd + sum(e.forward for e in edges),
            layers * bwd + sum(e.backward_input + e.bwd_weight_compute for e in edges))


def _overheads(model: ModelSpec, cal: Calibration, opts: ProfileOptions, tp_degrees: Sequence[int],
               tick: Callable[[str], None]) -> tuple[list[LayerOverhead], StepOverhead]:
    """Measured minus predicted, the median over the probed sequence lengths: tp 1 from a decoder layer alone and
    whole models of 1 and DEEP layers (outside the layers: the 1-layer model's residual beyond its layer alone;
    per layer: the deep model's residual without that, over DEEP); tp > 1: that per-layer overhead plus what a layer
    alone on that many ranks (with and without SP) leaves beyond a layer alone at tp 1."""
    from meshplan.executor.launch import run_world

    seqs, reps = opts.overhead_seq, max(opts.repeats, 5)
    tick(f"one layer, and whole models of 1 and {DEEP} layers")

    def residuals(layers: int) -> tuple[list[float], list[float]]:
        times = _chunk_times(model, opts.dtype, opts.device, seqs, reps, opts.warmup, layers, statistic=opts.statistic)
        predicted = [_predicted(model, cal, seq, 1, layers) for seq, _, _ in times]
        return ([f - p[0] for (_, f, _), p in zip(times, predicted, strict=True)],
                [b - p[1] for (_, _, b), p in zip(times, predicted, strict=True)])

    alone, one, deep = residuals(0), residuals(1), residuals(DEEP)
    # outside the layers (embedding, head, loss): a one-layer model's residual beyond its layer's alone
    edge_f = [m - a for m, a in zip(one[0], alone[0], strict=True)]
    edge_b = [m - a for m, a in zip(one[1], alone[1], strict=True)]
    # per layer: from the deeper model, whose layers run as a training step runs them (caches shared along
    # the model, not one layer's warm inputs again and again)
    per_f = [(d - e) / DEEP for d, e in zip(deep[0], edge_f, strict=True)]
    per_b = [(d - e) / DEEP for d, e in zip(deep[1], edge_b, strict=True)]
    layers = [LayerOverhead(tp=1, forward_s=statistics.median(per_f), backward_s=statistics.median(per_b))]
    for tp in tp_degrees:
        for sp in (False, True):
            tick(f"one layer on {tp} TP ranks{' with SP' if sp else ''}")
            times = run_world(tp, _tp_layer_rank, model, opts.dtype, tuple(seqs), reps, opts.warmup, sp,
                              opts.statistic, backend="nccl" if opts.device == "cuda" else "gloo",
                              timeout_s=opts.timeout_s)[0]
            predicted = [_predicted(model, cal, seq, tp, 0, sp) for seq, _, _ in times]
            rf_tp = [f - p[0] for (_, f, _), p in zip(times, predicted, strict=True)]
            rb_tp = [b - p[1] for (_, _, b), p in zip(times, predicted, strict=True)]
            # what TP adds over a layer alone at tp 1, on top of the in-model overhead per layer at tp 1
            layers.append(LayerOverhead(
                tp=tp, sp=sp,
                forward_s=layers[0].forward_s + statistics.median(rf_tp) - statistics.median(alone[0]),
                backward_s=layers[0].backward_s + statistics.median(rb_tp) - statistics.median(alone[1])))
    return layers, StepOverhead(forward_s=statistics.median(edge_f), backward_s=statistics.median(edge_b))


# ---- collectives -----------------------------------------------------------------------------------------------------
def _collective_call(kind: str, rank: int, world: int, n: int, dev: str) -> Callable[[], None]:
    """One run of a collective over n fp32 elements on this rank (send / recv: ranks 0 and 1)."""
    import torch
    import torch.distributed as dist

    # torch 2.13 renamed the tensor forms (the old names warn); older releases have only the old ones
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    buf = torch.ones(n, dtype=torch.float32, device=dev)
    part = torch.ones(n // world, dtype=torch.float32, device=dev)
    recv = torch.empty_like(buf)

    def run() -> None:
        if kind == "all_reduce":
            dist.all_reduce(buf)
        elif kind == "all_gather":
            all_gather(recv, part)
        elif kind == "reduce_scatter":
            reduce_scatter(part, buf)
        elif kind == "all_to_all":
            dist.all_to_all_single(recv, buf)
        elif rank == 0:
            dist.send(buf, 1)
        elif rank == 1:
            dist.recv(recv, 0)

    return run


def _collective_rank(rank: int, world: int, sizes: tuple[int, ...], repeats: int, warmup: int,
                     statistic: str) -> list[tuple[str, int, float]]:
    """On every rank: each collective at each size, timed by _Timer after a barrier (CUDA events on a GPU, with a
    burn-in every rank agrees on); rank 0's seconds."""
    import torch.distributed as dist

    from meshplan.executor.mesh import rank_device

    dev = str(rank_device())  # NCCL: this rank's own GPU (launch.bind_device), not cuda:0 for all
    timer = _Timer(dev, repeats, warmup, statistic, agree=_largest_over_ranks)
    out = []
    for kind in COLLECTIVES:
        for nbytes in sizes:
            n = max(world, nbytes // 4 // world * world)  # fp32 elements, divisible by the world
            out.append((kind, 4 * n, timer(_collective_call(kind, rank, world, n, dev), setup=dist.barrier)))
    return out


def _time_collectives(opts: ProfileOptions, tick: Callable[[str], None]) -> list[CollectivePoint]:
    from meshplan.executor.launch import run_world

    if opts.device == "cuda":  # NVLink and NICs reach their bus bandwidth only near a GiB
        sizes = (65536, 4 << 20, 64 << 20, 1 << 30) if opts.quick else (4096, 65536, 1 << 20, 16 << 20, 256 << 20,
                                                                       1 << 30)
    else:
        sizes = (4096, 65536, 1 << 20, 4 << 20) if opts.quick else (4096, 32768, 262144, 1 << 20, 4 << 20, 16 << 20)
    points = []
    for world in opts.ranks:
        tick(f"collectives on {world} ranks ({'nccl' if opts.device == 'cuda' else 'gloo'})")
        backend = "nccl" if opts.device == "cuda" else "gloo"
        results = run_world(world, _collective_rank, sizes, opts.repeats, opts.warmup, opts.statistic,
                            backend=backend, timeout_s=opts.timeout_s)
        points += [CollectivePoint(kind=kind, ranks=world, bytes=float(b), seconds=t) for kind, b, t in results[0]]
    return points


# ---- the whole profile -----------------------------------------------------------------------------------------------
def _device_info(opts: ProfileOptions) -> DeviceInfo:
    import torch

    if opts.device == "cuda":
        if not torch.cuda.is_available():
            raise InputError("--device cuda: no CUDA device is visible to torch; use --device cpu")
        name = torch.cuda.get_device_name(0)
        mem = float(torch.cuda.get_device_properties(0).total_memory)
        target = opts.target or gpu_target(name, mem)
        return DeviceInfo(kind="cuda", target=target, name=name, threads=1, memory_bytes=mem)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) if hasattr(os, "sysconf") else 16 * 2**30
    return DeviceInfo(kind="cpu", target="cpu", name=name, threads=torch.get_num_threads(), memory_bytes=mem)


# torch's device names (the driver's, as nvidia-smi and rocm-smi print them) -> hardware_db GPUs, most specific first;
# None: a device hardware_db has no entry for (its interconnect or memory differs: a PCIe A100 is not the SXM4 part)
DEVICE_NAMES: tuple[tuple[str, str | None], ...] = (
    (r"\bgh200\b", None), (r"\bgb300\b", "gb300"), (r"\bgb200\b", "gb200"), (r"\bb300\b", "b300"),
    (r"\bb200\b", "b200"), (r"\bh200 nvl\b", "h200-nvl"), (r"\bh200\b", "h200"), (r"\bh100 nvl\b", "h100-nvl"),
    (r"\bh100 pcie\b", "h100-pcie"), (r"\bh100\b.*\b96gb\b", "h100-hbm2e-96gb"), (r"\bh100\b", "h100-sxm"),
    (r"\bh800 pcie\b", None), (r"\bh800\b", "h800"), (r"\ba100\b.*\bpcie\b", None),
    (r"\ba100\b.*\b40gb\b", "a100-40gb"), (r"\ba100\b", "a100-80gb"), (r"\bl40s\b", "l40s"), (r"\bl4\b", "l4"),
    (r"\bmi325x\b", "mi325x"), (r"\bmi300x\b", "mi300x"))
# torch's total_memory against hardware_db's nominal size: drivers reserve a little (an H100 80GB reports 79.2 GiB)
MEMORY_RATIO = (0.9, 1.05)


def gpu_target(device_name: str, memory_bytes: float) -> str:
    """The hardware_db GPU of a torch device ("NVIDIA H100 80GB HBM3" with 79.2 GiB -> "h100-sxm"), by the name
    table and then its memory size; anything else is one line asking for --gpu."""
    from meshplan.hardware_db.gpu import list_gpus, load_gpu

    name = device_name.lower()
    target = next((t for pattern, t in DEVICE_NAMES if re.search(pattern, name)), None)
    ask = f"pass --gpu NAME (one of: {', '.join(list_gpus())})"
    if target is None:
        raise InputError(f"hardware_db has no entry for '{device_name}'; {ask}, or add its TOML (docs/hardware.md)")
    gib = memory_bytes / 2**30
    nominal = load_gpu(target).hbm_gib.value
    if not MEMORY_RATIO[0] <= gib / nominal <= MEMORY_RATIO[1]:
        raise InputError(f"'{device_name}' reports {gib:.1f} GiB but hardware_db's {target} has {nominal:g}; {ask}")
    return target


def _software(opts: ProfileOptions) -> Software:
    from importlib.metadata import PackageNotFoundError, version

    import torch

    try:
        mine = version("meshplan")
    except PackageNotFoundError:
        mine = "source"
    backend = "nccl" if opts.device == "cuda" else "gloo"
    nccl = ""
    if opts.device == "cuda":
        try:
            nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - a build without NCCL: leave it empty
            nccl = ""
    return Software(meshplan=mine, python=platform.python_version(), torch=torch.__version__, backend=backend,
                    backend_version=nccl, cuda=torch.version.cuda or "")


def profile(opts: ProfileOptions, progress: Progress | None = None) -> Calibration:
    """Measure this device and fit its efficiency model; raises InputError for what cannot run here."""
    try:
        import torch
    except ImportError:
        raise InputError("meshplan profile needs PyTorch: pip install 'meshplan[torch]' (CPU: torch==2.13.0)") from None
    if opts.device not in ("cpu", "cuda"):
        raise InputError(f"--device {opts.device!r}: choose cpu or cuda")
    if opts.repeats < 1 or opts.warmup < 0:
        raise InputError("--repeats must be at least 1 and warm-up at least 0")
    model = opts.model or default_profile_model(opts.device)
    if opts.device == "cpu":
        cores = os.cpu_count() or 1
        bad = [r for r in opts.ranks if r < 2 or r > max(2, cores)]
        if bad:
            raise InputError(f"--ranks {bad[0]}: collective groups need 2 to {max(2, cores)} ranks on this machine")
        torch.set_num_threads(1)  # as every executor rank runs (executor/launch.py)
    device = _device_info(opts)
    sweep = _sweep(opts.quick, opts.device == "cuda")
    layer_shapes = gemm_shapes(model, opts.tokens, opts.tp)
    n_attn = sum(1 for t in opts.tp if not (model.num_heads % t or model.kv_heads % t)) * len(opts.seq)
    ranks = opts.ranks if opts.device == "cpu" or torch.cuda.device_count() >= 2 else ()
    # progress steps: GEMMs, attention, 7 memory classes per token count, optimizer, activations (3 modes), collective
    # worlds, the whole-model probe and two TP probes per degree
    total = (len(sweep) + len(layer_shapes) + n_attn + 7 * len(opts.tokens) + (3 if opts.quick else 4)
             + 3 * len(opts.seq) + len(ranks) + 1 + 2 * sum(1 for t in opts.tp if t > 1 and t in ranks))
    done = [0]

    def tick(what: str) -> None:
        if progress is not None:
            progress(what, done[0], total)
        done[0] += 1

    if opts.statistic not in ("median", "min"):
        raise InputError(f"--statistic {opts.statistic!r}: choose median or min")
    timer = _Timer(opts.device, opts.repeats, opts.warmup, opts.statistic)
    torch.manual_seed(0)
    gemms = _time_gemms(sweep, opts, timer, tick, backward=False) + _time_gemms(layer_shapes, opts, timer, tick,
                                                                                backward=True)
    attention = _time_attention(model, opts, timer, tick)
    memory_ops = _time_memory_ops(model, opts, timer, tick)
    optimizer = _time_optimizer(model, opts, timer, tick)
    activations = _activation_points(model, opts, tick)
    collectives = _time_collectives(dataclasses.replace(opts, ranks=ranks), tick) if ranks else []
    m = Measurements(dtype=opts.dtype, gemms=tuple(gemms), attention=tuple(attention), memory_ops=tuple(memory_ops),
                     collectives=tuple(collectives), activations=tuple(activations), optimizer=tuple(optimizer))
    cal = Calibration(schema_version=CALIBRATION_SCHEMA_VERSION,
                      created=dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), device=device,
                      software=_software(opts), measurements=m, fitted=fit_model(m))
    # What whole layers and models take beyond their operators (TP degrees among the collective ranks: on a GPU
    # host, up to its GPU count, one GPU per rank)
    tps = [t for t in opts.tp if t > 1 and t in ranks and not (model.num_heads % t or model.kv_heads % t)]
    layers, step = _overheads(model, cal, opts, tps, tick)
    if progress is not None:
        progress("fitting", total, total)
    return cal.model_copy(update={"fitted": cal.fitted.model_copy(update={"layer_overhead": tuple(layers),
                                                                          "step_overhead": step})})


def default_profile_model(device: str) -> ModelSpec:
    """The shapes profiled when no --model is given: Llama-3.1-8B on a GPU; on a CPU a narrow model of the same
    structure (SwiGLU, GQA), whose GEMMs take milliseconds on one thread."""
    from meshplan.costmodels.model_io import load_model

    spec = load_model("llama3.1-8b")
    if device == "cuda":
        return spec
    return spec.model_copy(update={"name": "cpu-probe (llama3.1-8b structure, hidden 256)", "hidden": 256,
                                   "num_heads": 8, "num_kv_heads": 4, "head_dim": 32, "ffn_hidden": 704,
                                   "vocab": 2048, "num_layers": 2})

