"""Serving cost of one engine (a model replica): KV cache bytes per token, what fits beside the weights, and the
time of one iteration (decode tokens, prefill tokens, or both) per operator on one GPU.

An engine is attention TP x attention DP x PP GPUs. Attention and dense MLPs are tensor-parallel inside an attention
group of `tp` GPUs (Megatron sharding, as vLLM and SGLang do); `dp` attention groups each serve their own
sequences and keep their own KV cache (SGLang --enable-dp-attention, vLLM --data-parallel-size with expert
parallelism); the routed experts of an MoE layer are spread over all tp x dp ranks of a stage, `ep` ways by expert
and tp*dp/ep ways inside each expert (expert TP). Every operator is timed by the training cost model's roofline
(timing.op_time, with the GPU's efficiency or a calibration) and every collective by its ring formula on the
links the ranks cross (timing.timed_collective).

An engine with every slot full (aggregated_state, prefill_state, decode_state): an aggregated engine batches decode
and chunked prefill in every iteration, decode tokens riding in the GEMMs of the prompt chunk (Sarathi-Serve,
Agrawal et al. OSDI'24), so the prompt tokens prefilled per iteration keep pace with the sequences finishing,
P = B x ISL / OSL, and a sequence's mean context is ISL + OSL / 2; a prefill engine's iteration is its batch of
prompts, then the KV transfer (DistServe, Zhong et al. OSDI'24); a decode engine's is one token for each sequence.
What an engine delivers at a load, with its queueing delays, is costmodels/serving_load.py's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from meshplan.costmodels import comm
from meshplan.costmodels.comm import Link
from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.kernel_tables import gemm_read_bytes
from meshplan.costmodels.kernels import CONTENTION_SM
from meshplan.costmodels.timing import group_link, op_time, timed_collective
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.ops import ACT_BYTES, Op, elementwise, gemm, mla_query_and_latent
from meshplan.costmodels.queueing import Percentile
from meshplan.hardware_db.cluster import Cluster
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import GPUSpec

__all__ = ["ServeWorkload", "ServeTargets", "WEIGHT_BYTES", "WeightDtype", "EngineLayout", "PoolPoint", "MEM_FRACTION",
           "kv_bytes_per_token_layer",
           "kv_bytes_per_token", "weight_bytes_per_gpu", "Capacity", "capacity", "IterationTime", "iteration_time",
           "kv_transfer_s", "stage_layer_counts", "redundant_experts", "StepOptions",
           "EngineState", "aggregated_state", "prefill_state", "decode_state", "EngineGeometry",
           "engine_geometry"]


ServeDtype = Literal["bf16", "fp8"]  # the KV cache
WeightDtype = Literal["bf16", "fp8", "fp4"]  # weights and GEMMs (fp4: NVFP4, Blackwell)
ServeEngine = Literal["vllm", "sglang", "trtllm"]  # the engines an engine calibration is fit for (AIConfigurator's)
# engines that by default never mix prompt chunks with decode tokens, running prefill first (SGLang's ServerArgs
# enable_mixed_chunk = False, python/sglang/srt/server_args.py); vLLM's V1 scheduler and TensorRT-LLM's chunked
# context mix them
UNMIXED_ENGINES: frozenset[str] = frozenset({"sglang"})
ServeObjective = Literal["throughput", "min-gpus"]  # most output tokens/s per GPU, or fewest GPUs for a rate


class ServeWorkload(BaseModel):
    """Request lengths (mean input and output tokens) and precisions."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")
    isl: int = Field(gt=0, description="input (prompt) tokens per request")
    osl: int = Field(gt=0, description="output tokens per request")
    weight_dtype: WeightDtype = "bf16"
    kv_dtype: ServeDtype = "bf16"
    moe_imbalance: float = Field(default=1.0, ge=1.0, description="busiest expert rank's load / mean")
    isl_cv2: float = Field(default=0.0, ge=0.0, description="squared coefficient of variation of input lengths")
    osl_cv2: float = Field(default=0.0, ge=0.0, description="squared coefficient of variation of output lengths")
    prefix_hit: float = Field(default=0.0, ge=0.0, lt=1.0, description="fraction of prompt tokens found in the "
                                                                       "prefix cache (not computed)")
    spec_tokens: int = Field(default=0, ge=0, le=16, description="draft tokens per decode step (MTP, EAGLE)")
    accept_rate: float = Field(default=0.0, ge=0.0, le=1.0, description="probability that a draft token is accepted")
    two_batch_overlap: bool = Field(default=False, description="EP engines with attention DP run each iteration as "
                                    "two micro-batches, one's all-to-all under the other's compute")
    source: str | None = Field(default=None, description="where the lengths came from (a CSV's mean), if not given")

    @model_validator(mode="after")
    def _spec(self) -> ServeWorkload:
        if self.spec_tokens and not self.accept_rate:
            raise ValueError("speculative decoding needs its acceptance rate (--accept-rate; DeepSeek-V3 reports "
                             "85-90 % for its MTP token, report sec. 5.4.3)")
        return self

    @property
    def tokens_per_step(self) -> float:
        """Tokens a sequence gains per decode step: 1 without speculation, else the expected accepted drafts plus
        the verifier's own, (1 - a^(k+1)) / (1 - a) (Leviathan et al., ICML 2023, eq. 1)."""
        k, a = self.spec_tokens, self.accept_rate
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    @property
    def decode_steps(self) -> float:
        """Decode iterations a request takes."""
        return self.osl / self.tokens_per_step

    @property
    def computed_isl(self) -> float:
        """Prompt tokens an engine computes: those the prefix cache does not hold."""
        return self.isl * (1.0 - self.prefix_hit)

    @property
    def prompt_context(self) -> float:
        """The mean context a computed prompt token attends to: the cached prefix and half of its own part."""
        return self.isl * self.prefix_hit + self.computed_isl / 2


class ServeTargets(BaseModel):
    """Latency targets; None: no target."""

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2e_ms: float | None = Field(default=None, gt=0, description="TTFT + OSL x TPOT")
    request_rate: float | None = Field(default=None, gt=0, description="requests/s to serve (objective min-gpus)")
    percentile: Percentile = Field(default="p50", description="the TTFT and TPOT statistic the targets bound")


# bytes per weight / KV element: the serving dtypes, and the reference executor's run dtypes (its checks)
# fp4 is NVFP4: a 4-bit value and one FP8 (E4M3) scale per 16 values, 4.5 bits (NVIDIA technical blog, "Introducing
# NVFP4 for Efficient and Accurate Low-Precision Inference", 2025; its per-tensor FP32 scale is negligible)
WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp8": 1, "fp4": 0.5625, "float32": 4, "float64": 8}
RESERVED_BYTES = 1.0 * 2**30  # CUDA context, NCCL and cuBLAS workspaces (the training model's stated assumption)


@dataclass(frozen=True)
class EngineLayout:
    """One engine's parallel layout; GPUs = tp x dp x pp."""

    tp: int = 1  # tensor parallel inside an attention group
    dp: int = 1  # attention data-parallel groups
    pp: int = 1  # pipeline stages
    ep: int = 1  # MoE: expert parallel over the tp x dp ranks of a stage

    @property
    def gpus(self) -> int:
        return self.tp * self.dp * self.pp

    @property
    def etp(self) -> int:
        """Expert tensor parallel: the ranks of a stage that share each expert."""
        return self.tp * self.dp // self.ep

    def check(self, model: ModelSpec) -> None:
        """InputError naming the rule (vLLM and SGLang: heads split evenly over TP; experts over EP)."""
        if model.num_heads % self.tp:
            raise InputError(f"tp {self.tp} does not divide the {model.num_heads} attention heads of {model.name}")
        if self.pp > model.num_layers:
            raise InputError(f"pp {self.pp} exceeds the {model.num_layers} layers of {model.name}")
        if model.moe is None:
            if self.ep > 1:
                raise InputError(f"ep {self.ep} given but {model.name} has no experts")
            if self.dp > 1:
                raise InputError("attention data parallelism is for MoE models; serve a dense model with replicas")
            return
        if (self.tp * self.dp) % self.ep:
            raise InputError(f"ep {self.ep} must divide tp*dp = {self.tp * self.dp} (the ranks of a stage the experts "
                             f"are spread over)")

    def label(self) -> str:
        parts = [f"TP{self.tp}"]
        if self.dp > 1:
            parts.append(f"DP{self.dp}")
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        return " ".join(parts)


def redundant_experts(experts: int, ep: int) -> int:
    """Expert replicas an EP group adds so that every rank holds the same number, ceil(E / ep): DeepSeek-V3's
    decode holds 2 of 256 + 32 redundant on each of 144 GPUs (DeepSeek, "Day 6: Inference System Overview", 2025);
    SGLang's --ep-num-redundant-experts, one expert per GPU beyond E."""
    return math.ceil(experts / ep) * ep - experts


# ---- KV cache and weights ------------------------------------------------------------------------------------------

def kv_bytes_per_token_layer(model: ModelSpec, tp: int, kv_bytes: float) -> float:
    """KV cache bytes one GPU keeps per token and layer."""
    if model.mla is not None:
        # MLA caches the compressed latent c_KV and the decoupled RoPE key k^R, shared by all heads (DeepSeek-V2
        # sec. 2.1.2-2.1.3); serving engines keep it whole on every TP rank (vLLM and SGLang MLA backends)
        return (model.mla.kv_lora_rank + model.mla.qk_rope_head_dim) * kv_bytes
    # K and V of the KV heads this rank holds; TP beyond the KV heads replicates them (vLLM QKVParallelLinear)
    return 2 * math.ceil(model.kv_heads / tp) * model.head_size * kv_bytes


def stage_layer_counts(model: ModelSpec, pp: int) -> tuple[int, int]:
    """(dense, MoE) decoder layers on the heaviest pipeline stage: layers split evenly, the larger shares first."""
    per_stage = math.ceil(model.num_layers / pp)
    layers = range(per_stage)  # the first stage: the dense layers of an MoE model come first
    moe = sum(model.is_moe_layer(i) for i in layers)
    if model.moe is not None and pp > 1:
        moe = max(moe, min(per_stage, model.num_moe_layers))  # a later stage may be all MoE
    return per_stage - moe, moe


def kv_bytes_per_token(model: ModelSpec, layout: EngineLayout, kv_bytes: float) -> float:
    """KV bytes per token on one GPU of the heaviest stage (all its layers)."""
    return math.ceil(model.num_layers / layout.pp) * kv_bytes_per_token_layer(model, layout.tp, kv_bytes)


def weight_bytes_per_gpu(model: ModelSpec, layout: EngineLayout, weight_bytes: float) -> float:
    """Weights on one GPU of the heaviest stage: attention, norms and dense MLPs over tp (MLA's down-projections
    and the router replicated, as vLLM's ReplicatedLinear), routed experts over ep x etp, embedding and LM head
    vocab-parallel over tp. The MTP modules are not loaded (they serve only speculative decoding)."""
    dense_layers, moe_layers = stage_layer_counts(model, layout.pp)
    attn = model.attention_params()
    replicated = 2 * model.norm_params()
    if model.mla is not None:
        a = model.mla
        down = model.hidden * (a.kv_lora_rank + a.qk_rope_head_dim) + (model.hidden * a.q_lora_rank if a.q_lora_rank
                                                                         else 0)
        attn -= down
        replicated += down
    per_dense = (attn + model.mlp_params(model.ffn_hidden)) / layout.tp + replicated
    params = dense_layers * per_dense
    if moe_layers:
        moe = model.moe
        assert moe is not None
        local = math.ceil(moe.num_experts / layout.ep)  # with redundant experts (redundant_experts)
        experts = local * model.mlp_params(moe.expert_ffn_hidden) / layout.etp
        shared = moe.num_shared_experts * model.mlp_params(moe.shared_hidden) / layout.tp
        router = model.hidden * moe.num_experts
        params += moe_layers * (attn / layout.tp + replicated + shared + router + experts)
    ends = model.embedding_params() + model.head_params() if layout.pp == 1 else max(
        model.embedding_params(), model.head_params())
    return (params + ends / layout.tp) * weight_bytes


@dataclass(frozen=True)
class Capacity:
    """Memory of one GPU (GiB) and the KV tokens the engine can hold."""

    weights_gib: float
    workspace_gib: float
    kv_gib: float  # left for the KV cache on one GPU
    kv_bytes_per_token: float  # on one GPU
    tokens: int  # KV tokens the whole engine holds (all attention groups)

    @property
    def fits(self) -> bool:
        return self.tokens > 0


def _workspace_bytes(model: ModelSpec, layout: EngineLayout, batched_tokens: int, max_seqs: int) -> float:
    """Activation peak of one iteration, which vLLM measures by a dummy forward of max_num_batched_tokens
    (vllm/v1/worker/gpu_worker.py, determine_available_memory): residual and normed hidden states, the QKV and
    the MLP intermediates of the group's tokens, and fp32 logits of the sequences sampled."""
    tokens = batched_tokens / layout.dp
    q = model.num_heads * (model.head_size if model.mla is None else model.mla.qk_head_dim)
    ffn = max(model.ffn_hidden, model.moe.expert_ffn_hidden * model.moe.top_k if model.moe else 0)
    per_token = ACT_BYTES * (2 * model.hidden + 2 * q / layout.tp + 3 * ffn / layout.tp)
    return tokens * per_token + 4.0 * max_seqs / layout.dp * model.vocab / layout.tp


def capacity(model: ModelSpec, cluster: Cluster, layout: EngineLayout, weight_dtype: str, kv_dtype: str,
             mem_fraction: float, batched_tokens: int, max_seqs: int) -> Capacity:
    """What is left for the KV cache after the weights, the iteration's activations and the runtime's reserve, of
    the `mem_fraction` of HBM the engine may use (vLLM --gpu-memory-utilization, SGLang --mem-fraction-static)."""
    weights = weight_bytes_per_gpu(model, layout, WEIGHT_BYTES[weight_dtype])
    work = _workspace_bytes(model, layout, batched_tokens, max_seqs)
    free = cluster.gpu.hbm_bytes * mem_fraction - weights - work - RESERVED_BYTES
    per_token = kv_bytes_per_token(model, layout, WEIGHT_BYTES[kv_dtype])
    tokens = int(free // per_token) * layout.dp if free > 0 else 0  # every attention group its own cache
    gib = 2**30
    return Capacity(weights / gib, work / gib, max(free, 0.0) / gib, per_token, tokens)


# ---- one iteration -------------------------------------------------------------------------------------------------

# NCCL's cost model of a ring all-reduce over NVLink (src/graph/tuning.cc: baseLat + nsteps x hwLat[NVLINK][Ring]
# in us per protocol; LL moves data at 1/4 and LL128 at 0.92 of the bus bandwidth): (base s, per step s, bandwidth)
NCCL_NVLINK_RING = {"LL": (3.6e-6, 0.47e-6, 0.25), "LL128": (10.0e-6, 1.9e-6, 0.92), "Simple": (8.4e-6, 3.4e-6, 1.0)}
# vLLM's custom all-reduce (vllm/distributed/device_communicators/custom_all_reduce.py max_size; csrc/
# custom_all_reduce.cuh): buffers up to 8 MiB, one-shot below 512 KiB (4 ranks or fewer) or 256 KiB (8 ranks)
CUSTOM_AR_MAX_BYTES = 8 * 2**20


def _nccl_ring_in_node(bytes_: float, n: int, link: Link) -> float:
    """NCCL's ring all-reduce inside a node, at the protocol its tuner picks (the fastest by its own model):
    2(n-1) steps of latency and 2(n-1)/n of the buffer over the bus."""
    steps = 2 * (n - 1)
    return min(base + steps * hop + steps / n * bytes_ / (link.bus_bytes_per_s * share)
               for base, hop, share in NCCL_NVLINK_RING.values())


def _all_reduce(bytes_: float, n: int, link: Link, eff: Efficiency) -> float:
    """A serving step's all-reduces are small to middling. Inside a node vLLM reduces buffers up to 8 MiB itself,
    each rank reading its peers' buffers over NVLink: one-shot (one latency, (n-1) buffers) for small ones,
    two-shot (a reduce-scatter and an all-gather by peer reads: two latencies, 2(n-1)/n of the buffer) above;
    larger ones go to NCCL, timed by NCCL's own per-protocol model. Across nodes NCCL's double binary tree
    (2 log2 n latencies) or the ring. A calibration's measured fit replaces the formulas."""
    if n <= 1 or bytes_ <= 0:
        return 0.0
    if eff.collective_fit("all_reduce", n, link) is not None or link.crosses_nodes:
        ring = timed_collective("all_reduce", bytes_, n, link, eff)
        if not link.crosses_nodes:
            return ring
        # NCCL's double binary tree: 2 log2(n) latencies (NCCL 2.4 release notes, "trees")
        _, share = comm.ring_shape("all_reduce", n)
        return min(ring, 2 * math.ceil(math.log2(n)) * link.latency_s + share * bytes_ / link.bus_bytes_per_s)
    best = _nccl_ring_in_node(bytes_, n, link)
    if bytes_ <= CUSTOM_AR_MAX_BYTES:
        one_shot_max = 512 * 2**10 if n <= 4 else 256 * 2**10
        if bytes_ < one_shot_max:
            best = min(best, link.latency_s + (n - 1) * bytes_ / link.bus_bytes_per_s)
        best = min(best, 2 * link.latency_s + 2 * (n - 1) / n * bytes_ / link.bus_bytes_per_s)
    return best


def _all_to_all(bytes_: float, n: int, link: Link, eff: Efficiency) -> float:
    """Expert dispatch or combine: every rank sends to all peers at once (DeepEP's low-latency kernels, NCCL grouped
    send/recv), so one latency, not the training model's pairwise exchange of n-1 steps, which small decode
    messages would make latency-bound n-1 times over. Across nodes the training model's split (comm.all_to_all):
    the (n-k)/n of the buffer for the other nodes leaves through the GPU's own NIC while the (k-1)/n for its node's
    peers crosses NVLink, both at once (DeepEP's low-latency kernels: RDMA, with NVLink inside a node since its PR
    #173); inside a node (n-1)/n at the link's bus rate. Checked against DeepEP's published kernel times in
    tests/test_serving.py."""
    if n <= 1 or bytes_ <= 0:
        return 0.0
    fit = eff.collective_fit("all_to_all", n, link)
    if fit is not None:
        return fit[0] + bytes_ / fit[1]
    if not link.crosses_nodes or not link.nic_bytes_per_s:
        return link.latency_s + (n - 1) / n * bytes_ / link.bus_bytes_per_s
    return comm.all_to_all(bytes_, n, link, at_once=True)


def _expert_exchange(model: ModelSpec, layout: EngineLayout, tokens: float, decoding: bool, fp8: bool, link: Link,
                     eff: Efficiency) -> float:
    """Dispatch and combine of one MoE layer: each GPU sends its share of its group's `tokens`, top-k copies of
    each (GShard); with fp8 weights the dispatch goes in fp8 with a scale per 128 values, the combine in bf16
    (DeepSeek-V3 report sec. 3.3.2). Steps with decode tokens use DeepEP's low-latency kernels, prefill-only steps
    its normal kernels, a token sent once per node and forwarded there over NVLink (SGLang's --deepep-mode auto)."""
    moe = model.moe
    assert moe is not None
    copies = (tokens / layout.tp) * moe.top_k * model.hidden
    dispatch = copies * (1.0 + 4.0 / 128) if fp8 else ACT_BYTES * copies
    if decoding:
        return _all_to_all(dispatch, layout.ep, link, eff) + _all_to_all(ACT_BYTES * copies, layout.ep, link, eff)
    return sum(timed_collective("all_to_all", b, layout.ep, link, eff, moe.top_k)
               for b in (dispatch, ACT_BYTES * copies))


@dataclass(frozen=True)
class IterationTime:
    """Seconds of one engine iteration: every decode sequence advances one token and the prefill tokens are
    processed; split into compute (operators) and exposed communication."""

    seconds: float
    compute_s: float
    comm_s: float
    head_s: float = 0.0  # of seconds: the LM head and its logits' gather
    head_comm_s: float = 0.0  # of head_s: the logits' gather


@dataclass(frozen=True)
class StepOptions:
    """How an engine runs an iteration beyond its layout: the precisions, the busiest expert rank's load over the
    mean, draft tokens verified per decode step, and two-batch overlap (EP engines with attention DP)."""

    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    moe_imbalance: float = 1.0
    spec_tokens: int = 0
    two_batch_overlap: bool = False
    context_cv: float = 0.0  # decode sequences' cached context: standard deviation / mean

    @classmethod
    def of(cls, wl: ServeWorkload) -> StepOptions:
        return cls(wl.weight_dtype, wl.kv_dtype, wl.moe_imbalance, wl.spec_tokens, wl.two_batch_overlap,
                   decode_context_cv(wl))


def decode_context_cv(wl: ServeWorkload) -> float:
    """The spread of a running sequence's context, ISL + its position in the output: in steady state a sequence is
    anywhere in its output alike, so the position is uniform over [0, OSL], with E[pos^2] = E[OSL^2] / 3; the
    prompt lengths add their own variance."""
    mean = wl.isl + wl.osl / 2
    position = wl.osl ** 2 * (1.0 + wl.osl_cv2) / 3.0 - (wl.osl / 2) ** 2
    return math.sqrt(wl.isl ** 2 * wl.isl_cv2 + position) / mean


def busiest_group_context(dec_ctx: float, seqs_per_group: float, groups: int, cv: float) -> float:
    """Attention DP: each group holds its own sequences, and the iteration waits for the group whose caches are
    largest. A group's total context is a sum of n sequences' (mean n mu, deviation sqrt(n) sigma); the largest of
    d such sums sits at Blom's expected normal maximum, Phi^-1((d - 0.375) / (d + 0.25)) deviations above the mean
    (Blom 1958, "Statistical Estimates and Transformed Beta-Variables"). Counts per group are taken equal (SGLang's
    round-robin DP assignment)."""
    if groups <= 1 or cv <= 0 or seqs_per_group <= 0:
        return dec_ctx
    z = NormalDist().inv_cdf((groups - 0.375) / (groups + 0.25))
    return dec_ctx * (1.0 + z * cv / math.sqrt(max(seqs_per_group, 1.0)))


def _attention_ops(model: ModelSpec, tp: int, dec: float, dec_ctx: float, pre: float, pre_ctx: float,
                   wdt: float, kv_bytes: float, queries: int = 1) -> list[Op]:
    """Projections and attention core of one layer for `dec` decode sequences of `queries` tokens each (the last
    token and the drafts being verified, all attending to the `dec_ctx` cached tokens, read once) and `pre` prefill
    tokens (to `pre_ctx` on average) of one attention group, on one of its GPUs."""
    h = model.hidden
    t = dec * queries + pre
    heads = model.num_heads / tp
    ops: list[Op] = []
    if model.mla is None:
        d = model.head_size
        kv = math.ceil(model.kv_heads / tp)
        ops.append(gemm("qkv_proj", t, (heads + 2 * kv) * d, h, wdt))
        d_qk = d_v = d
        cache = kv_bytes_per_token_layer(model, tp, kv_bytes)
        # decode: read the sequence's cached K,V once per token (FlashDecoding / paged attention): 2*ctx*(d_qk+d_v)
        # FLOPs per head (Vaswani et al. 2017)
        dec_flops = 2.0 * dec * queries * heads * dec_ctx * (d_qk + d_v)
        dec_bytes = dec * dec_ctx * cache
    else:
        a = model.mla
        d_qk, d_v = a.qk_head_dim, a.v_head_dim
        ops += mla_query_and_latent(model, t, heads, wdt)
        if pre:  # prefill expands the latent to per-head K and V (DeepSeek-V2 sec. 2.1.2)
            ops.append(gemm("kv_up_proj", pre, heads * (a.qk_nope_head_dim + d_v), a.kv_lora_rank, wdt))
        if dec:  # decode absorbs W_UK into the query and W_UV into the output and attends over the latent
            ops.append(_per_head_gemm("q_absorb", heads, dec * queries, a.kv_lora_rank, a.qk_nope_head_dim, wdt))
            ops.append(_per_head_gemm("o_absorb", heads, dec * queries, d_v, a.kv_lora_rank, wdt))
        latent = a.kv_lora_rank + a.qk_rope_head_dim
        dec_flops = 2.0 * dec * queries * heads * dec_ctx * (latent + a.kv_lora_rank)
        dec_bytes = dec * dec_ctx * latent * kv_bytes
    if dec:
        ops.append(Op("decode_attention", "attention", dec_flops, dec_bytes, 0.0, 0.0))
    if pre:
        # causal prefill with FlashAttention: pre_ctx is the average context, so the masked half is already out
        pre_flops = 2.0 * pre * heads * pre_ctx * (d_qk + d_v)
        pre_bytes = ACT_BYTES * pre * heads * (2 * d_qk + 2 * d_v)
        ops.append(Op("prefill_attention", "attention", pre_flops, pre_bytes, 0.0, 0.0))
    ops.append(gemm("out_proj", t, h, heads * d_v, wdt))
    ops.append(elementwise("norms_residuals", 4 * t * h, 2 * t * h))
    return ops


def _per_head_gemm(name: str, heads: float, m: float, n: float, k: float, wdt: float) -> Op:
    """A batched GEMM with one [k, n] weight per head: `heads` times [m,k] x [k,n]."""
    flops = 2.0 * heads * m * n * k
    return Op(name, "gemm", flops, ACT_BYTES * heads * (m * k + k * n + m * n), 0.0, 0.0, gemm_dtype_scale=wdt)


def _mlp_ops(model: ModelSpec, tokens: float, ffn_local: float, wdt: float, prefix: str = "") -> list[Op]:
    mats = 2 if model.mlp == "swiglu" else 1
    return [gemm(f"{prefix}up_proj", tokens, mats * ffn_local, model.hidden, wdt),
            gemm(f"{prefix}down_proj", tokens, model.hidden, ffn_local, wdt)]


def _experts_op(model: ModelSpec, layout: EngineLayout, tokens_engine: float, wdt: float,
                imbalance: float) -> tuple[Op, float]:
    """The routed experts of one MoE layer on one GPU: its E/ep experts, each split etp ways. FLOPs follow the
    tokens routed to them (top-k of every token, the busiest rank `imbalance` times the mean); bytes read the
    weights of the experts at least one token reaches: of E experts and n = tokens x k uniform assignments,
    E (1 - (1 - 1/E)^n) are hit on average (balls into bins). With the op, the tokens each local expert reached
    computes (the grouped kernel's efficiency follows them)."""
    moe = model.moe
    assert moe is not None
    mats = 3 if model.mlp == "swiglu" else 2
    expert_params = mats * model.hidden * moe.expert_ffn_hidden / layout.etp
    assignments = tokens_engine * moe.top_k
    local_tokens = assignments * imbalance / layout.ep
    flops = 2.0 * local_tokens * expert_params
    hit = 1.0 - (1.0 - 1.0 / moe.num_experts) ** assignments
    local_experts = math.ceil(moe.num_experts / layout.ep)  # with redundant experts (redundant_experts)
    io = ACT_BYTES * (local_experts * hit * expert_params + local_tokens * model.hidden * 2)  # 16-bit units, as gemm()
    per_expert = local_tokens / max(local_experts * hit, 1e-9)
    return Op("routed_experts", "gemm", flops, io, 0.0, 0.0, gemm_dtype_scale=wdt), per_expert


def _grouped_floor(flops: float, per_expert: float, table: list[list[float]], peak: float) -> float:
    """The routed experts' time as the GPU's measured grouped FP8 kernel runs them at this many tokens per expert
    (hardware_db efficiency.fp8_grouped_by_tokens; on Hopper DeepGEMM's masked and contiguous tables): the
    fraction of peak interpolated in log tokens, held at the table's ends. Below its first point the kernel
    is bound by reading the experts' weights, which the roofline (op_time) prices; this floor then adds
    nothing that was not measured."""
    tokens = min(max(per_expert, table[0][0]), table[-1][0])
    i = next(i for i in range(1, len(table)) if tokens <= table[i][0]) if len(table) > 1 else 0
    (m0, f0), (m1, f1) = table[max(i - 1, 0)], table[i]
    share = f0 if m1 == m0 else f0 + (f1 - f0) * math.log(tokens / m0) / math.log(m1 / m0)
    return flops / (peak * share)


@dataclass(frozen=True)
class EngineGeometry:
    """What every iteration of one engine layout on one cluster shares, whatever its tokens: the links its groups
    cross, the layers of its heaviest stage and the efficiency it is timed with. Worked out once per layout
    (engine_geometry): the search times each layout's iterations by the dozen."""

    eff: Efficiency
    tp_link: Link
    ep_link: Link
    etp_link: Link
    p2p_link: Link  # between pipeline stages (tp_link when pp is 1)
    dense_layers: int
    moe_layers: int


def engine_geometry(model: ModelSpec, cluster: Cluster, layout: EngineLayout,
                    eff: Efficiency | None = None) -> EngineGeometry:
    tp_link = group_link(cluster, tuple(range(layout.tp)))
    ep_link = group_link(cluster, tuple(range(layout.ep))) if layout.ep > 1 else tp_link
    etp_link = group_link(cluster, tuple(range(layout.etp))) if layout.etp > 1 else tp_link
    stage_ranks = layout.tp * layout.dp
    p2p_link = tp_link
    if layout.pp > 1 and cluster.num_gpus > stage_ranks:
        p2p_link = group_link(cluster, (0, stage_ranks))
    dense, moe = stage_layer_counts(model, layout.pp)
    return EngineGeometry(eff or Efficiency.from_gpu(cluster.gpu), tp_link, ep_link, etp_link, p2p_link, dense, moe)


def iteration_time(model: ModelSpec, cluster: Cluster, layout: EngineLayout, dec_seqs: float, dec_ctx: float,
                   pre_tokens: float, pre_ctx: float, options: StepOptions = StepOptions(),
                   eff: Efficiency | None = None, geometry: EngineGeometry | None = None) -> IterationTime:
    """One iteration of the engine: `dec_seqs` sequences each decode a token at context `dec_ctx`, and
    `pre_tokens` prompt tokens at average context `pre_ctx` are prefilled (chunked prefill batches both, as in
    Sarathi-Serve, Agrawal et al. OSDI'24). With pp > 1 the batch is split into pp micro-batches that keep every
    stage busy (vLLM's virtual engines): the iteration is pp stage-times of a micro-batch plus its transfers.
    With `spec_tokens` k, every decode sequence verifies k draft tokens with its own (k + 1 queries in the
    model's pass) and a drafter proposes them first: k passes of one transformer block and the output head over
    the decode tokens (an MTP module, DeepSeek-V3 report sec. 2.2; an EAGLE head is one block too).
    `geometry` (engine_geometry of this model, cluster and layout; its efficiency then stands for `eff`) saves
    working the links out again."""
    geo = geometry or engine_geometry(model, cluster, layout, eff)
    queries = 1 + options.spec_tokens
    step = _step(model, cluster, layout, dec_seqs, dec_ctx, pre_tokens, pre_ctx, options, geo, queries)
    if options.two_batch_overlap and layout.ep > 1 and layout.dp > 1:
        half = _step(model, cluster, layout, dec_seqs / 2, dec_ctx, pre_tokens / 2, pre_ctx, options, geo, queries)
        # DeepEP's normal kernels (prefill) hold SMs while they move data; its low-latency ones (decode) issue RDMA
        # and free every SM (deepseek-ai/profile-data README, "Decoding")
        slowdown = CONTENTION_SM if geo.eff.physics.contention and pre_tokens else 0.0
        step = min(step, _overlapped(step, half, slowdown), key=lambda it: it.seconds)
    if not options.spec_tokens or not dec_seqs:
        return step
    one = _step(model, cluster, layout, dec_seqs, dec_ctx, 0, 0, options, geo, 1)
    block = (one.seconds - one.head_s) / (geo.dense_layers + geo.moe_layers) + one.head_s
    draft = options.spec_tokens * block
    share = one.compute_s / one.seconds
    return IterationTime(step.seconds + draft, step.compute_s + draft * share, step.comm_s + draft * (1 - share),
                         step.head_s, step.head_comm_s)


def _overlapped(whole: IterationTime, half: IterationTime, slowdown: float) -> IterationTime:
    """Two-batch overlap (DeepSeek's inference system, "dual micro-batch overlap"; SGLang's TBO, LMSYS large-scale
    EP post; vLLM's DBO): the batch runs as two micro-batches, each one's communication (the expert dispatch and
    combine, the TP collectives) under the other's compute, so the layers take twice the larger of a half batch's
    compute and communication, the compute slowed by `slowdown` per second of communication hidden behind it (the
    communication kernels' SMs and HBM traffic; kernels.CONTENTION_SM, as training's overlaps); the LM head runs
    after, on the whole batch. Engines take it only where it pays (vLLM's --dbo-*-token-threshold): the caller
    keeps the faster of the two."""
    compute = half.compute_s - (half.head_s - half.head_comm_s)
    comm = half.comm_s - half.head_comm_s
    compute += slowdown * min(compute, comm)
    layers = 2.0 * max(compute, comm)
    head_compute = whole.head_s - whole.head_comm_s
    return IterationTime(layers + whole.head_s, 2.0 * compute + head_compute, layers - 2.0 * compute
                         + whole.head_comm_s, whole.head_s, whole.head_comm_s)


def _step(model: ModelSpec, cluster: Cluster, layout: EngineLayout, dec_seqs: float, dec_ctx: float,
          pre_tokens: float, pre_ctx: float, options: StepOptions, geo: EngineGeometry,
          queries: int) -> IterationTime:
    """iteration_time's one forward pass, every decode sequence with `queries` tokens."""
    eff = geo.eff
    gpu = cluster.gpu
    weight_dtype, kv_dtype = options.weight_dtype, options.kv_dtype
    wbytes = WEIGHT_BYTES[weight_dtype]
    quantised = weight_dtype in ("fp8", "fp4")
    wdt = 2.0 if quantised else 1.0  # quantised GEMMs run at the low-precision peak
    peak16 = gpu.peak_flops("bf16" if "bf16" in gpu.peak_tflops else "fp16")
    peak8 = _gemm_peak(gpu, weight_dtype, eff) if quantised else peak16
    hbm = gpu.hbm_bytes_per_s
    micro = layout.pp
    dec = dec_seqs / layout.dp / micro  # per attention group and micro-batch
    pre = pre_tokens / layout.dp / micro
    t = dec * queries + pre

    # GQA / MHA decode attention as the engine's kernels run it on paged caches (hardware_db/decode_kernels.py);
    # MLA's latent attention is another kernel, left to the roofline
    paged = {dtype: (fixed, share) for dtype, fixed, share in eff.decode_attention} if model.mla is None else {}
    measured = paged.get("bf16" if kv_dtype == "fp16" else kv_dtype)
    # the linear layers as the engine's own GEMM kernels run them at a few tokens, for the weights' format
    # (hardware_db/decode_kernels.py; block-scaled FP8 checkpoints on their block-scaled kernels)
    weight_format = {"fp16": "bf16", "fp8": "fp8_block" if model.weight_block_scaled else "fp8"}.get(weight_dtype,
                                                                                                 weight_dtype)
    linear = {dtype: (fixed, share) for dtype, fixed, share in eff.decode_gemm}.get(weight_format)

    def ops_time(ops: list[Op]) -> float:
        total = 0.0
        for op in ops:
            peak = peak8 if (op.kind == "gemm" and op.gemm_dtype_scale > 1) else peak16
            if op.kind == "gemm" and op.shape is not None and linear is not None:  # one weight, not per expert
                # the measured kernel streaming its bytes, or its FLOPs at the roofline's compute rate where more
                # (many tokens); the fixed time stands for the launch as well, as decode replays CUDA graphs
                compute = op_time(op.fwd_flops, 0.0, op.kind, peak, hbm, eff) - eff.kernel_overhead_s
                total += max(compute, linear[0] + gemm_read_bytes(*op.shape, wbytes) / (hbm * linear[1]))
                continue
            # weights are read at their own width: scale a GEMM's bytes for fp8 weights
            t = op_time(op.fwd_flops, op.fwd_bytes * (wbytes / ACT_BYTES if op.kind == "gemm" else 1.0),
                        op.kind, peak, hbm, eff)
            if op.name == "decode_attention" and measured is not None:
                # the measured kernel's fixed time and bandwidth, never below the roofline
                t = max(t, measured[0] + op.fwd_bytes / (hbm * measured[1]))
            total += t
        return total

    tp_link, ep_link, etp_link = geo.tp_link, geo.ep_link, geo.etp_link
    tp_ar = _all_reduce(ACT_BYTES * t * model.hidden, layout.tp, tp_link, eff)

    busiest = busiest_group_context(dec_ctx, dec, layout.dp, options.context_cv)
    attention = ops_time(_attention_ops(model, layout.tp, dec, busiest, pre, pre_ctx, wdt, WEIGHT_BYTES[kv_dtype],
                                        queries))
    dense_layers, moe_layers = geo.dense_layers, geo.moe_layers
    compute = comm = 0.0
    if dense_layers:
        compute += dense_layers * (attention + ops_time(_mlp_ops(model, t, model.ffn_hidden / layout.tp, wdt)))
        comm += dense_layers * 2 * tp_ar
    if moe_layers:
        moe = model.moe
        assert moe is not None
        engine_tokens = t * layout.dp
        experts, per_expert = _experts_op(model, layout, engine_tokens, wdt, options.moe_imbalance)
        ops = [gemm("router", t, moe.num_experts, model.hidden, wdt)]
        if moe.num_shared_experts:
            ops += _mlp_ops(model, t, moe.num_shared_experts * moe.shared_hidden / layout.tp, wdt, "shared_")
        routed = ops_time([experts])
        table = gpu.efficiency.fp8_grouped_by_tokens
        if table and weight_dtype == "fp8" and experts.fwd_flops > 0:
            routed = max(routed, _grouped_floor(experts.fwd_flops, per_expert, table, gpu.peak_flops("fp8")))
        compute += moe_layers * (attention + ops_time(ops) + routed)
        per_layer = tp_ar  # the attention output
        if layout.ep > 1:
            per_layer += _expert_exchange(model, layout, t, bool(dec), quantised, ep_link, eff)
        if layout.etp > 1:  # expert TP: the partial sums of each expert's output
            out = ACT_BYTES * engine_tokens * moe.top_k / layout.ep * model.hidden
            per_layer += _all_reduce(out, layout.etp, etp_link, eff)
        elif layout.tp > 1:
            per_layer += tp_ar
        comm += moe_layers * per_layer
    sampled = dec * queries + (1.0 if pre else 0.0)
    head = ops_time([gemm("lm_head", sampled, model.vocab / layout.tp, model.hidden, wdt),
                     elementwise("embedding", t, t * model.hidden)])
    head_comm = _all_to_all(4.0 * sampled * model.vocab, layout.tp, tp_link, eff)  # gather the logits' shards
    # a calibration's measured framework cost: per decoder layer forward at this TP degree, per forward outside
    # the layers (efficiency.Efficiency.overhead; zero uncalibrated, where a GPU engine's CUDA graphs hide it)
    over_layer, _ = eff.overhead(layout.tp, False)
    compute += (dense_layers + moe_layers) * over_layer
    head += eff.head_overhead.forward_s if eff.head_overhead is not None else 0.0
    stage = compute + comm + head + head_comm  # the heaviest stage: its layers and the LM head (the last stage)
    p2p = 0.0
    if layout.pp > 1:
        p2p = timed_collective("p2p", ACT_BYTES * t * model.hidden, 2, geo.p2p_link, eff)
    seconds = micro * (stage + p2p)
    return IterationTime(seconds, micro * (compute + head), micro * (comm + head_comm + p2p),
                         micro * (head + head_comm), micro * head_comm)


def _gemm_peak(gpu: GPUSpec, weight_dtype: str, eff: Efficiency) -> float:
    """The peak a quantised GEMM's op_time divides by. fp8: the FP8 peak (at the BF16 ceiling's share of it, as
    every serving GEMM). fp4: the FP4 peak scaled so that the BF16 ceiling of it is the NVFP4 kernels' own ceiling
    (hardware_db efficiency.fp4_gemm_max, default the FP8 ceiling's share)."""
    peak = gpu.peak_flops(weight_dtype)
    if weight_dtype != "fp4":
        return peak
    fp4 = gpu.efficiency.fp4_gemm_max or eff.fp8_gemm_max  # the Efficiency's FP8 ceiling, its default derived
    return peak * fp4 / eff.gemm_max


def kv_transfer_s(model: ModelSpec, cluster: Cluster, prompt_tokens: float, kv_dtype: str,
                  crosses_nodes: bool = True) -> float:
    """Moving one request's KV cache from a prefill engine to a decode engine (DistServe, Zhong et al. OSDI'24,
    sec. 4): all layers of the prompt's tokens over one GPU's NIC (or NVLink inside a node), at the link's
    achieved rate."""
    per_token = model.num_layers * kv_bytes_per_token_layer(model, 1, WEIGHT_BYTES[kv_dtype])
    e = cluster.gpu.efficiency
    if crosses_nodes:
        rate, latency = cluster.scaleout.bytes_per_s * e.scaleout_bandwidth, cluster.scaleout.latency_s
    else:
        rate, latency = cluster.scaleup.bytes_per_s * e.scaleup_bandwidth, cluster.scaleup.latency_s
    return latency + prompt_tokens * per_token / rate


MEM_FRACTION = 0.9  # vLLM --gpu-memory-utilization default


@dataclass(frozen=True)
class EngineState:
    """An engine with `batch` sequences running (a prefill engine: `batch` prompts per iteration) and its memory
    admitted for them: what its iterations take. The points at a load (PoolPoint) are built from these."""

    role: Literal["aggregated", "prefill", "decode"]
    layout: EngineLayout
    batch: int
    chunk: int  # max tokens per iteration (max_num_batched_tokens)
    step_s: float  # the steady iteration: decode + the prefill that keeps pace; a decode step; a prefill batch
    full_s: float  # aggregated: an iteration with the whole budget (prompts queued); else step_s
    memory: Capacity
    mem_fraction: float = MEM_FRACTION
    transfer_s: float = 0.0  # prefill: a prompt's KV cache to its decode engine
    prompt_s: float = 0.0  # aggregated: an iteration carrying one new prompt's chunk in every attention group
    decode_s: float = 0.0  # aggregated: an iteration of the decode tokens alone
    request_s: float = 0.0  # aggregated, prefill: the front end's time on each TTFT (Efficiency.request_s)


@dataclass(frozen=True)
class PoolPoint:
    """One engine configuration at one load: what an engine of it delivers and the latencies its requests see
    (at the percentile of the targets)."""

    role: Literal["aggregated", "prefill", "decode"]
    layout: EngineLayout
    batch: int  # max running sequences (aggregated, decode: max_num_seqs) or prompts per prefill iteration
    chunk: int  # max tokens per iteration (max_num_batched_tokens)
    ttft_s: float  # aggregated, prefill (queue + prefill + KV transfer); decode: the wait for a running slot
    tpot_s: float  # aggregated, decode; 0 for prefill
    requests_per_s: float  # one engine, at this load
    memory: Capacity
    mem_fraction: float = 0.9  # of HBM the engine may use (vLLM --gpu-memory-utilization)
    load: float = 1.0  # mean running sequences / batch (aggregated, decode); busy fraction (prefill)


# ---- one engine with every slot full ---------------------------------------------------------------------------------

def aggregated_state(model: ModelSpec, cluster: Cluster, lay: EngineLayout, wl: ServeWorkload, batch: int,
                     chunk: int, eff: Efficiency | None = None, mem_fraction: float = MEM_FRACTION,
                     geometry: EngineGeometry | None = None) -> EngineState | None:
    """An engine that prefills and decodes, `batch` sequences running; None when they do not fit its memory or
    the budget cannot keep prefill in pace with decode (P = batch x computed ISL / decode steps of a request,
    prompt tokens per iteration)."""
    if batch < lay.dp:
        return None
    prefill_per_iter = batch * wl.computed_isl / wl.decode_steps
    budget = chunk - batch * (1 + wl.spec_tokens)
    if budget <= 0 or prefill_per_iter > budget:
        return None
    mem = capacity(model, cluster, lay, wl.weight_dtype, wl.kv_dtype, mem_fraction, chunk, batch)
    if batch * (wl.isl + wl.osl) > mem.tokens:
        return None
    geo = geometry or engine_geometry(model, cluster, lay, eff)

    options = StepOptions.of(wl)

    def step(prefill: float) -> float:
        return iteration_time(model, cluster, lay, batch, wl.isl + wl.osl / 2, prefill, wl.prompt_context, options,
                              geometry=geo).seconds

    # the steady iteration; one with the whole budget (prompts queued); one with a lone new prompt's chunk,
    # min(computed ISL, the group's share of the budget), in every attention group; one of the decode tokens alone
    return EngineState("aggregated", lay, batch, chunk, step(prefill_per_iter), step(budget), mem, mem_fraction,
                       prompt_s=step(min(budget, lay.dp * wl.computed_isl)), decode_s=step(0.0),
                       request_s=geo.eff.request_s)


def prefill_state(model: ModelSpec, cluster: Cluster, lay: EngineLayout, wl: ServeWorkload, prompts: int,
                  eff: Efficiency | None = None, crosses_nodes: bool = True, mem_fraction: float = MEM_FRACTION,
                  geometry: EngineGeometry | None = None) -> EngineState | None:
    """A prefill engine taking `prompts` prompts per iteration (one attention group each at least); it computes
    the tokens the prefix cache does not hold and sends the whole prompt's KV cache on."""
    if prompts < lay.dp or prompts % lay.dp:
        return None
    tokens = prompts * wl.computed_isl
    mem = capacity(model, cluster, lay, wl.weight_dtype, wl.kv_dtype, mem_fraction, math.ceil(tokens), prompts)
    if prompts * wl.isl > mem.tokens:
        return None
    geo = geometry or engine_geometry(model, cluster, lay, eff)
    it = iteration_time(model, cluster, lay, 0, 0, tokens, wl.prompt_context, StepOptions.of(wl), geometry=geo)
    return EngineState("prefill", lay, prompts, math.ceil(tokens), it.seconds, it.seconds, mem, mem_fraction,
                       kv_transfer_s(model, cluster, wl.isl, wl.kv_dtype, crosses_nodes), request_s=geo.eff.request_s)


def decode_state(model: ModelSpec, cluster: Cluster, lay: EngineLayout, wl: ServeWorkload, batch: int,
                 eff: Efficiency | None = None, mem_fraction: float = MEM_FRACTION,
                 geometry: EngineGeometry | None = None) -> EngineState | None:
    if batch < lay.dp:
        return None
    mem = capacity(model, cluster, lay, wl.weight_dtype, wl.kv_dtype, mem_fraction, batch * (1 + wl.spec_tokens),
                   batch)
    if batch * (wl.isl + wl.osl) > mem.tokens:
        return None
    it = iteration_time(model, cluster, lay, batch, wl.isl + wl.osl / 2, 0, 0, StepOptions.of(wl), eff, geometry)
    return EngineState("decode", lay, batch, batch, it.seconds, it.seconds, mem, mem_fraction)
