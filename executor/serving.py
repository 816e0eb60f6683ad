"""The serving check: one prefill and several decode steps of a serving plan's engine layout (TP, attention DP,
EP) on the reference model with a KV cache, against the single-process forward of the whole sequences.

Each rank builds the reference model (same seed), applies the training executor's expert parallelism and tensor
parallelism (logits gathered), and gives every attention layer a `KVCacheCore`: the attention core hook keeps
this rank's keys and values of every token so far and lets the new queries attend to them with the causal offset.
Attention group g (the rank's dp coordinate) serves its own `batch` sequences; the MoE layers exchange every
group's tokens over the ep x etp ranks, as an engine with attention DP and EP does. The prefill is the prompt in
one forward; each decode step feeds the next token of the sequence (teacher-forced, so the check needs no
sampling) at its absolute position. Passing means every logit of every step matches the reference's forward of
prompt + steps tokens (no cache) to float64 rounding: the cache, the positions, the TP head split, the KV-head
replication and the expert exchange are all exercised.

The cache holds what the reference attention computes: for MLA that is the per-head keys and values after the
up-projection, not the latent a serving engine keeps, so its bytes are reported as held, not as the cost model's
latent cache.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshplan.costmodels.config import Layout, StagePolicy
from meshplan.costmodels.model import ModelSpec
from meshplan.executor.expert_parallel import apply_expert_parallel
from meshplan.executor.mesh import build_meshes, rank_coords, rank_device, wait_for
from meshplan.executor.model import build_model
from meshplan.executor.tensor_parallel import apply_tensor_parallel

if TYPE_CHECKING:
    from meshplan.hardware_db.calibration import Calibration
    from meshplan.planner.plan import ServingPlan

__all__ = ["KVCacheCore", "ServeRankReport", "serve_tokens", "serve_rank", "serve_reference", "max_relative_error",
           "INJECTIONS", "ServeEngineCheck", "ServeCheckReport", "run_serve_check"]

# deliberate faults: decode at the wrong position (the check must fail); the last rank raises before its prefill,
# or sleeps there (verify's --timeout must end the run naming it), as executor/plan_run.py's for training plans
INJECTIONS = ("position-offset", "raise", "hang")


class KVCacheCore:
    """An attention core (executor.model.AttentionCore) with a KV cache: the keys and values of earlier calls
    are kept and prepended; query i of this call sits at position past + i and attends to keys 0..past + i."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k is not None:
            k, v = torch.cat((self.k, k), dim=1), torch.cat((self.v, v), dim=1)
        self.k, self.v = k, v
        past = k.shape[1] - q.shape[1]
        group = q.shape[2] // k.shape[2]
        if group > 1:  # GQA: query head h reads kv head h // group (the cache keeps the kv heads only)
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        keys, queries = torch.arange(k.shape[1], device=q.device), torch.arange(q.shape[1], device=q.device)
        mask = keys[None, :] <= (past + queries)[:, None]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return out.transpose(1, 2)

    @property
    def bytes(self) -> int:
        if self.k is None or self.v is None:
            return 0
        return self.k.numel() * self.k.element_size() + self.v.numel() * self.v.element_size()


@dataclass(frozen=True)
class ServeRankReport:
    """One rank's logits of its group's sequences (batch, prompt + steps, vocab) and its timings."""

    rank: int
    group: int
    logits: torch.Tensor
    prefill_s: float
    decode_s: tuple[float, ...]
    cache_bytes: int

    @property
    def decode_median_s(self) -> float:
        return statistics.median(self.decode_s) if self.decode_s else 0.0


def serve_tokens(spec: ModelSpec, sequences: int, length: int, seed: int) -> torch.Tensor:
    """The token ids every rank and the reference use: (sequences, length), from the seed alone."""
    gen = torch.Generator().manual_seed(seed + 1)
    return torch.randint(0, spec.vocab, (sequences, length), generator=gen)


def serve_rank(rank: int, world: int, spec_json: str, tp: int, dp: int, ep: int, batch: int, prompt: int,
               steps: int, seed: int, inject: str | None = None) -> ServeRankReport:
    """One rank of the engine (run by executor.launch.run_world or run_torchrun): prefill, then `steps` decodes."""
    device = rank_device()  # the model drawn on the CPU from the seed, then moved before sharding
    spec = ModelSpec.model_validate_json(spec_json)
    etp = tp * dp // ep
    # an inference engine's groups: one stage, the experts folded over tp x dp; the training fields unused
    lay = Layout(tp=tp, pp=1, vpp=1, dp=dp, cp=1, cp_comm="ring", ep=ep, etp=etp, edp=tp * dp // (etp * ep), mbs=1,
                 num_microbatches=1, zero=0, recompute="none", sp=False, schedule="1f1b",
                 stage_layers=(spec.num_layers,), stage_recompute=(StagePolicy(),))
    if lay.world != world:
        raise ValueError(f"the engine needs tp*dp = {lay.world} ranks, the world has {world}")
    meshes = build_meshes(lay, device.type)
    model = build_model(spec, torch.float64, seed).to(device)
    if spec.moe is not None:
        apply_expert_parallel(model, meshes, lay)
    if tp > 1:
        apply_tensor_parallel(model, meshes["tp"], sp=False, vocab_parallel=False)
    caches = []
    for layer in model.layers:
        layer.attention.core = core = KVCacheCore()
        caches.append(core)
    if inject in ("raise", "hang") and rank == world - 1:
        if inject == "raise":
            raise RuntimeError("injected failure (--inject raise)")
        time.sleep(24 * 3600)
    group = rank_coords(rank, lay)["dp"]
    tokens = serve_tokens(spec, dp * batch, prompt + steps, seed)[group * batch:(group + 1) * batch].to(device)
    outs, decode_s = [], []
    with torch.no_grad():
        dist.barrier()
        start = time.perf_counter()
        outs.append(model.logits(tokens[:, :prompt], torch.arange(prompt, device=device)))
        wait_for(device)
        prefill_s = time.perf_counter() - start
        for t in range(steps):
            pos = prompt + t
            dist.barrier()
            start = time.perf_counter()
            at = pos + 1 if inject == "position-offset" else pos
            outs.append(model.logits(tokens[:, pos:pos + 1], torch.tensor([at], device=device)))
            wait_for(device)
            decode_s.append(time.perf_counter() - start)
    return ServeRankReport(rank, group, torch.cat(outs, dim=1).cpu(), prefill_s, tuple(decode_s),
                           sum(c.bytes for c in caches))


def serve_reference(spec: ModelSpec, sequences: int, length: int, seed: int) -> torch.Tensor:
    """The single-process logits of the whole sequences in one causal forward, no cache: (sequences, length,
    vocab)."""
    model = build_model(spec, torch.float64, seed)
    with torch.no_grad():
        return model.logits(serve_tokens(spec, sequences, length, seed))


def max_relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|."""
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-300))


# ---- the check of a serving plan -------------------------------------------------------------------------------

@dataclass(frozen=True)
class ServeEngineCheck:
    """One engine of the plan at the reduced size: numerics, and measured vs predicted time and KV memory."""

    role: str
    layout: str
    ranks: int
    batch: int  # sequences per attention group
    prompt: int
    steps: int
    max_relative_error: float
    ok: bool
    prefill_s: float  # slowest rank
    decode_s: float  # slowest rank's median step
    predicted_prefill_s: float
    predicted_decode_s: float
    predicted_on: str  # "this host (calibrated)" or the plan's GPU
    cache_bytes: int  # the largest rank's, as the executor holds them
    predicted_cache_bytes: float | None  # the cost model's, where it counts what the executor holds (not MLA)


@dataclass(frozen=True)
class ServeCheckReport:
    model: str
    scaled: str
    engines: tuple[ServeEngineCheck, ...]
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.engines)


TOLERANCE = 1e-9  # float64 relative; the runs match to ~1e-16


def run_serve_check(plan: ServingPlan, scale: str = "tiny", prompt: int | None = None, steps: int = 2,
                    batch: int = 2, seed: int = 0, max_ranks: int = 16, timeout_s: float = 300.0,
                    calibration: Calibration | None = None, calibration_origin: str = "the calibration",
                    inject: str | None = None) -> ServeCheckReport:
    """Every engine of `plan` (pp 1) at a reduced size: its ranks against the reference forward."""
    from meshplan.costmodels.efficiency import EXECUTOR_RUNTIME, Efficiency, calibrated_cluster
    from meshplan.costmodels.serving import EngineLayout, StepOptions, iteration_time, kv_bytes_per_token
    from meshplan.executor.launch import run_world
    from meshplan.executor.scale import SCALES, scale_model
    from meshplan.hardware_db.cluster import ClusterSpec, engine_cluster
    from meshplan.hardware_db.errors import InputError

    if scale not in SCALES and scale != "none":
        raise InputError(f"--scale {scale!r}: choose one of {', '.join(SCALES)} or none")
    if inject is not None and inject not in INJECTIONS:
        raise InputError(f"unknown injection {inject!r}; known: {', '.join(INJECTIONS)}")
    if steps < 1:
        raise InputError(f"--steps (decode steps) must be at least 1, got {steps}")
    spec0 = plan.inputs.model_spec()
    checks = []
    scaled_name = spec0.name
    for engine in plan.engines:
        if engine.pp > 1:
            raise InputError(f"the {engine.role} engine has pp {engine.pp}; the serving check runs engines without "
                             f"pipeline stages (verify a training plan for the pipeline)")
        world = engine.tp * engine.dp
        if world > max_ranks:
            raise InputError(f"the {engine.role} engine runs {world} ranks; this machine runs at most {max_ranks} "
                             f"(raise --max-ranks)")
        spec = spec0 if scale == "none" else scale_model(spec0, scale, heads_multiple=engine.tp,
                                                         kv_multiple=engine.tp, experts_multiple=engine.ep)
        scaled_name = spec.name
        n_prompt = prompt or 8
        if spec.max_seq_len is not None and n_prompt + steps > spec.max_seq_len:
            raise InputError(f"prompt {n_prompt} + {steps} steps exceed the scaled model's {spec.max_seq_len} "
                             f"positions")
        reports = run_world(world, serve_rank, spec.model_dump_json(), engine.tp, engine.dp, engine.ep, batch,
                            n_prompt, steps, seed, inject, timeout_s=timeout_s)
        ref = serve_reference(spec, engine.dp * batch, n_prompt + steps, seed)
        err = max(max_relative_error(r.logits, ref[r.group * batch:(r.group + 1) * batch]) for r in reports)
        layout = EngineLayout(tp=engine.tp, dp=engine.dp, pp=1, ep=engine.ep)
        if calibration is not None:
            if calibration.device.kind != "cpu":
                raise InputError(f"{calibration_origin} is of {calibration.device.target}; the check runs on this "
                                 f"host's CPU, so it needs a CPU calibration (meshplan profile --device cpu)")
            cluster, eff = calibrated_cluster(ClusterSpec(gpu="cpu", num_gpus=world, gpus_per_node=world),
                                              calibration, calibration_origin, EXECUTOR_RUNTIME)
            dtype, where = "float64", "this host (calibrated)"
        else:
            cluster = engine_cluster(plan.inputs.cluster.cluster(), world)
            eff, dtype, where = Efficiency.from_gpu(cluster.gpu), plan.inputs.workload.weight_dtype, cluster.gpu.name
        kv = "float64" if calibration is not None else plan.inputs.workload.kv_dtype
        options = StepOptions(weight_dtype=dtype, kv_dtype=kv)
        pre = iteration_time(spec, cluster, layout, 0, 0, engine.dp * batch * n_prompt, n_prompt / 2, options, eff)
        dec = iteration_time(spec, cluster, layout, engine.dp * batch, n_prompt + steps / 2, 0, 0, options, eff)
        held = batch * (n_prompt + steps)
        predicted_cache = None if spec.mla is not None else held * kv_bytes_per_token(spec, layout, 8)
        checks.append(ServeEngineCheck(
            role=engine.role, layout=layout.label(), ranks=world, batch=batch, prompt=n_prompt, steps=steps,
            max_relative_error=err, ok=err <= TOLERANCE, prefill_s=max(r.prefill_s for r in reports),
            decode_s=max(r.decode_median_s for r in reports), predicted_prefill_s=pre.seconds,
            predicted_decode_s=dec.seconds, predicted_on=where, cache_bytes=max(r.cache_bytes for r in reports),
            predicted_cache_bytes=predicted_cache))
    return ServeCheckReport(model=spec0.name, scaled=scaled_name, engines=tuple(checks), tolerance=TOLERANCE)
