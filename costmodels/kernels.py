"""How fast the kernels of a training step run: achieved fractions of peak by operator shape, precision recipe and
framework, from published measurements (the sources name each number; docs/cost_model.md, "Kernel efficiency").

Small pure functions that timing.op_time and ops.py read. Nothing here is fitted to a training run: the
numbers are microbenchmark measurements (GEMM and attention tables, bandwidth tests) and the algorithms the
libraries document (TransformerEngine's FP8 casts and transposes, userbuffers' overlap splits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Fp8Recipe = Literal["delayed", "tensorwise", "rowwise", "blockwise", "mxfp8"]
FP8_RECIPES: tuple[str, ...] = ("delayed", "tensorwise", "rowwise", "blockwise", "mxfp8")


@dataclass(frozen=True)
class Physics:
    """Which of the measured effects the cost model applies; all on by default. Each can be switched off to show
    what it contributes (benchmarks/physics_ablation.py); off, the term reverts to the plain roofline."""

    gemm_shape: bool = True  # K-depth ramp of a GEMM (small inner dimension, high TP)
    grouped_gemm: bool = True  # grouped expert GEMMs: one launch over all experts, under its own ceiling
    fp8: bool = True  # FP8 kernel ceiling below BF16's x 2, quantisation casts and transposes per GEMM
    attention: bool = True  # flash-attention forward / backward ceilings, causal tiles at short sequences
    memory_kernels: bool = True  # elementwise kernels at the framework's achieved bandwidth, cross-entropy passes
    contention: bool = True  # communication overlapped with compute slows the compute (SMs, HBM)
    overlap_limits: bool = True  # what overlap cannot hide: the last DP bucket, the first/last ring step, splits
    cp_steps: bool = True  # ring CP exposure per step instead of in aggregate, and the steps' output merges
    attention_keys: bool = True  # flash attention's rate ramps with the keys per launch (short sequences, CP chunks)

    @classmethod
    def none(cls) -> Physics:
        return cls(**{name: False for name in cls.__dataclass_fields__})

    def without(self, name: str) -> Physics:
        if name not in self.__dataclass_fields__:
            raise ValueError(f"unknown physics term {name!r}; one of {', '.join(self.__dataclass_fields__)}")
        return Physics(**{**{n: getattr(self, n) for n in self.__dataclass_fields__}, name: False})


# Compute slowdown per second of communication hidden behind it: NCCL's kernels take SMs exclusively (one per
# channel) and HBM bandwidth. 0.19 = the average compute slowdown while overlapped, A100/H100/MI250/MI210, GPT and
# LLaMA layers (arXiv:2507.03114, abstract: 18.9 % average, 40 % max). Copy-engine transfers (TE userbuffers
# ring-exchange, PyTorch async TP on symmetric memory) take almost no SMs: 0.13 from pytorch/pytorch#172714
# (8192^3 matmul + 64 MiB all-gather on H100: 2.02 ms overlapped on NCCL, 1.77 ms on copy engines, vs 1.6 + 1.35
# ms alone: 0.17 ms of slowdown per 1.35 ms hidden).
CONTENTION_SM = 0.19
CONTENTION_COPY_ENGINE = 0.13

# TransformerEngine's default grouped GEMM (GroupedLinear -> nvte_multi_tensor_gemm) launches one cuBLAS GEMM per
# expert, round-robin on 4 compute streams (transformer_engine/common/util/multi_stream.h: num_compute_streams = 4;
# gemm/cublaslt_gemm.cu: the CUTLASS grouped kernel only on Hopper with NVTE_USE_CUTLASS_GROUPED_GEMM=1). At most 4
# expert GEMMs share the GPU at once, so a wave saturates on 4 experts' FLOPs, and the host issues one launch per
# expert. Megatron-Core keeps this path unless its TransformerConfig sets moe_use_grouped_tensor (default False) or
# use_transformer_engine_op_fuser, which turns it on (megatron/core/transformer/transformer_config.py).
TE_GEMM_STREAMS = 4

# FP8 quantisation traffic per element of a GEMM operand on GPUs whose FP8 GEMMs take only the TN layout (Hopper)
# (TransformerEngine docs, low_precision_training performance_considerations.rst, "Handling transposes"): read the
# 16-bit tensor (2 B) and write its FP8 copy (1 B) plus the transposed copy the backward GEMMs read (1 B); current
# scaling (tensorwise) first reads the tensor once more for its amax (2 B); delayed scaling takes the amax from
# history (fused); block scales are computed in the cast pass. Checked against TE's own autocast-minus-kernel GEMM
# times (docs/examples/gemm_profiling, 5B layer, H200 NVL: 3.8 B delayed, 6.1 B current at the memory roof used
# here; tests/test_kernels.py). torchao's row-wise recipe casts each operand twice, once scaled along each dim
# (torchao/float8/float8_linear.py: the forward saves the 16-bit input, the backward casts it and the output
# gradient again along dim 1; config.py: "vanilla rowwise" scales "across" two dims): a row-scaled copy (read 2 B,
# write 1 B, the row's amax in the same pass) and a column-scaled one, whose amax is a separate reduction pass over
# the tensor (read 2 B, read 2 B, write 1 B): 8 B.
QUANT_BYTES_PER_ELEMENT: dict[str, float] = {"delayed": 4.0, "tensorwise": 6.0, "rowwise": 8.0, "blockwise": 4.0,
                                             "mxfp8": 4.75}
# The same on GPUs whose FP8 GEMMs take any operand layout (Blackwell: TE nvte_is_non_tn_fp8_gemm_supported, sm
# 10.x and >= 13.0; pytorch/csrc/quantizer.cpp writes a per-tensor transpose only where it is false): delayed
# scaling reads 2 B and writes 1 B (3 B; TE measures 2.6 on B300). Measured by TE's gemm_profiling tutorial on B300
# (autocast minus pre-quantised per-layer GEMM times of a 5B layer, over its 2.48e9 cast elements, at this GPU's
# memory roof): current scaling 6.1 B although it writes no transpose (its amax and cast passes run below the
# streaming roof: kept at 6), MXFP8 4.75 B (rowwise and columnwise copies each with 1x32 E8M0 scales, 4.06 B
# moved, below the roof); blockwise is emulated through MXFP8 there (TE gemm_profiling note).
QUANT_BYTES_ANY_LAYOUT: dict[str, float] = {"delayed": 3.0, "tensorwise": 6.0, "rowwise": 8.0, "blockwise": 4.75,
                                            "mxfp8": 4.75}
# MXFP8 GEMM kernels against per-tensor FP8 kernels on Blackwell: TE gemm_profiling, B300, pre-quantised 5B layer,
# 6.812 ms (FP8 current scaling) against 7.161 ms (MXFP8) of GEMM kernels per layer (1.92x and 1.83x BF16)
MXFP8_OVER_PER_TENSOR = 6.812 / 7.161


# torchao's MX training (prototype/mx_formats/mx_linear.py, torchao 0.13) casts each GEMM operand twice, in two
# kernels: the row-blocked copy (MXTensor.to_mx under torch.compile) and the column-blocked one (its dim1 CUDA
# kernel), each reading the 16-bit tensor (2 B) and writing 1 B plus a 1/32 B E8M0 scale; torchao's B200 cast
# microbenchmarks (docs/source/workflows/training.md, 16384 x 16384, 1000 W) run them at 6462 and 5404 GB/s, so
# the dim1 pass costs 6462 / 5404 of its bytes at the dim0 kernel's rate, which is the GPU's memory roof here.
TORCHAO_MX_CAST_BYTES = (2 + 1 + 1 / 32) * (1 + 6462.0 / 5404.46)


def quant_bytes_per_element(recipe: str, any_layout: bool, mx_per_dim: bool = False) -> float:
    """HBM traffic of casting one element of a GEMM operand to FP8 under `recipe` (TN-only GPUs keep a transpose);
    `mx_per_dim`: MXFP8 cast one block direction at a time (Runtime.mx_cast_per_dim)."""
    if mx_per_dim and recipe == "mxfp8":
        return TORCHAO_MX_CAST_BYTES
    return (QUANT_BYTES_ANY_LAYOUT if any_layout else QUANT_BYTES_PER_ELEMENT)[recipe]


# Inner dimension beyond which a GEMM gains nothing more: OpenXLA's table reaches K = 4096, and TransformerEngine's
# own per-pass times of a 5B layer (docs/examples/gemm_profiling, 15,872 tokens) show the backward GEMMs, whose inner
# dimension is 12,288-16,384 (dgrad) or 15,872 (wgrad), no faster than the forward's at K = 4096 (BF16, B300 4.20 /
# 4.29 / 4.27 ms, H200 NVL 10.65 / 10.81 / 10.55 ms for forward / dgrad / wgrad)
K_DEPTH_PLATEAU = 4096.0


def k_depth_factor(k: float, k_half: float) -> float:
    """A GEMM's efficiency over its inner (reduction) dimension: the tile pipeline's prologue and epilogue are paid
    per output tile whatever k is, so efficiency ramps as k / (k + k_half) (fitted form of OpenXLA's measured H100
    table, xla/service/gpu/model/matmul_interpolator_data.h: (4096, 4096, K) at K = 256 / 512 / 4096 runs at 40 /
    55 / 79 % of peak, i.e. k_half ~ 230; the Hopper files carry the ramps measured on an H200 at a training step's
    clock, 140 BF16 and 510 FP8: benchmarks/device_kernel_clocks.py --suite mixed), up to K_DEPTH_PLATEAU and flat
    beyond it."""
    if k_half <= 0 or k <= 0:
        return 1.0
    k = min(k, K_DEPTH_PLATEAU)
    return k / (k + k_half)


def causal_tile_factor(s_k: float, s0: float) -> float:
    """Flash attention's useful-FLOP rate under a causal mask relative to the unmasked rate, by key length: the
    diagonal tiles are half empty and short sequences have few full tiles. s / (s + s0) with s0 = 400 reproduces
    FlashAttention-3's H100 causal/non-causal forward ratios 0.63 / 0.83 / 0.91 / 0.95 at 512 / 2k / 4k / 16k
    (Shah et al. 2024, Fig. 5, hdim 128, bar labels; read off the figures in Dao-AILab/flash-attention assets)."""
    return s_k / (s_k + s0) if s0 > 0 and s_k > 0 else 1.0


# Keys at which a flash-attention launch's rate is half its long-sequence rate (non-causal), per kernel as
# (forward, backward): L0 least-squares fitted to L / (L + L0), normalised at 16K keys, over FlashAttention-3
# (Shah et al. 2024) Figs. 5-6, H100 SXM5, hdim 128, non-causal, 16K tokens per batch at 512 ... 16K keys
# (forward FA3 467/565/625/638/646/648, FA2 309/350/362/368/370/370, cuDNN 497/574/617/609/600/595 TFLOP/s;
# backward FA3 316/424/501/542/559/561, FA2 214/260/291/310/318/322, cuDNN 305/408/465/499/518/516). The fit is
# within 4 % of each bar but cuDNN's forward at 2-4K (3-7 % above). Blackwell kernels: the Hopper ramps (no figure).
ATTENTION_KEYS_HALF: dict[str, tuple[float, float]] = {"fused": (185.0, 375.0), "fa2": (90.0, 265.0),
                                                      "sdpa-fa2": (90.0, 265.0), "cudnn": (75.0, 330.0)}
# FlashAttention-2's backward runs slower per FLOP than its forward: 322 against 370 TFLOP/s at 16K keys, hdim 128,
# non-causal, H100 SXM5 (the FA2 bars of the FA3 paper's Figs. 5-6, as above); FA3's own pair is 561 / 648 (0.866)
FA2_BACKWARD_OVER_FORWARD = 322.0 / 370.0
# PyTorch SDPA's flash backend (a vendored FA2) against the flash-attn package's FA2, forward, non-causal, hdim 128,
# H100: 329.5 TFLOP/s at 4,608 keys (pytorch/pytorch#142132, tritonbench flash_attention) against FA2's 368 at 4K
# (FA3 paper Fig. 5); taken for its backward too (no published SDPA backward figure)
SDPA_FLASH_OVER_FA2 = 329.5 / 368.0
ATTENTION_KEYS_REFERENCE = 16384.0  # keys at which the GPU files' attention ceilings are read (FA3 paper, 16k)


def attention_keys_ramp(keys: float, kernel: str, backward: bool) -> float:
    """A flash-attention launch's non-causal rate over `keys` (its key length) relative to its rate at 16K keys:
    each query tile pays its prologue (loading Q, the softmax state) and epilogue (rescaling and writing O, or
    dQ/dK/dV) whatever the key loop's length, so the rate ramps as L / (L + L0); never above the 16K rate."""
    half = ATTENTION_KEYS_HALF.get(kernel, ATTENTION_KEYS_HALF["fused"])[1 if backward else 0]
    if keys <= 0:
        return 1.0
    return min(1.0, (keys / (keys + half)) / (ATTENTION_KEYS_REFERENCE / (ATTENTION_KEYS_REFERENCE + half)))


def attention_keys_factor(keys: float, kernel: str, backward: bool) -> float:
    """What the model applies on top of the causal tile factor and the FLOP saturation: those two reproduce the
    causal forward figure (FA3 and cuDNN, 512-16K keys, within 12 %; tests/test_kernels.py), so the forward's
    ramp is in them; the backward ramps more steeply (FA3 L0 375 against 185 forward), so a backward launch
    runs at its ramp over the forward's."""
    if not backward:
        return 1.0
    return min(1.0, attention_keys_ramp(keys, kernel, True) / attention_keys_ramp(keys, kernel, False))


def fp8_kernel_ceiling(gemm_max: float, fp8_gemm_max: float, recipe: str, block_factor: float,
                       any_layout: bool = False) -> float:
    """Fraction of the FP8 peak an FP8 GEMM kernel reaches: the GPU's per-tensor (tensorwise / delayed) ceiling;
    block- or row-scaled kernels on Hopper run at `block_factor` of it (scales applied inside the main loop);
    MXFP8 (Blackwell's block format, which also carries blockwise there) at MXFP8_OVER_PER_TENSOR of it."""
    if recipe == "mxfp8" or (recipe == "blockwise" and any_layout):
        return fp8_gemm_max * MXFP8_OVER_PER_TENSOR
    if recipe in ("blockwise", "rowwise"):
        return fp8_gemm_max * block_factor
    return fp8_gemm_max


def tp_exposed_fraction(kind: str, tp: int, sp: bool, physics: Physics, *, backward: bool = False,
                        collective: str = "", column_gemms: int = 1) -> float:
    """Share of a TP collective's time on the critical path under the framework's overlap. TransformerEngine's
    userbuffers overlap needs sequence parallelism (Megatron-LM arguments.py: --tp-comm-overlap needs
    --sequence-parallel) and splits each collective: the ring-exchange all-gather before QKV / FC1 into tp
    chunks on copy engines (1 SM), the pipelined reduce-scatter after the projection / FC2 into 4 chunks on 16 SMs
    (transformer_engine/pytorch/module/base.py, get_default_config); the first chunk of each is exposed and the
    rest slows the GEMM it hides behind (CONTENTION_*). PyTorch async TP micro-pipelines both over tp chunks on
    copy engines (pytorch/pytorch#130583), but only where Inductor finds the patterns (async_tp_fused). A
    collective split into k chunks exposes 1/k of itself. `collective` names the forward collective whose mirror
    the backward runs; `column_gemms` counts the block's column-parallel GEMMs."""
    if kind == "none" or tp <= 1 or (kind == "userbuffers" and not sp):
        return 1.0
    if kind == "async-tp" and physics.overlap_limits and not async_tp_fused(sp, backward, collective, column_gemms):
        return 1.0

    def split(chunks: int, contention: float) -> float:
        first = 1.0 / chunks if physics.overlap_limits else 0.0
        return first + (contention if physics.contention else 0.0) * (1.0 - first)

    if kind == "async-tp":
        return split(tp, CONTENTION_COPY_ENGINE)
    return 0.5 * split(tp, CONTENTION_COPY_ENGINE) + 0.5 * split(4, CONTENTION_SM)


def ring_cp_exposed(comm_s: float, compute_s: float, cp: int, backward: bool, physics: Physics) -> float:
    """Exposed seconds of ring context parallelism's KV exchange (Liu et al., "Ring Attention", 2023; Megatron-Core
    context_parallel.rst): cp attention steps, each computing the local queries against one KV chunk while the next
    chunk travels, so cp - 1 transfers each hide behind one step's compute; a transfer longer than its step shows
    the difference, and the hidden part slows the step (NCCL P2P takes SMs, CONTENTION_SM). The backward also moves
    the KV gradients and sends the last of them home after the last step (exposed). `comm_s` is the pass's total
    exchange time, `compute_s` its attention compute."""
    if cp <= 1 or comm_s <= 0:
        return 0.0
    if not physics.cp_steps:  # the aggregate model: all the exchange hides behind all the compute
        return max(0.0, comm_s - compute_s)
    transfers = cp - 1 + (1 if backward else 0)
    per_comm, per_compute = comm_s / transfers, compute_s / cp
    hidden = min(per_comm, per_compute)
    exposed = (cp - 1) * (per_comm - hidden)
    if backward:
        exposed += per_comm  # the last KV-gradient hop has no step behind it
    if physics.contention:
        exposed += CONTENTION_SM * (cp - 1) * hidden
    return exposed


def overlapped_exposed(comm_s: float, window_s: float, unhidden_share: float, physics: Physics) -> float:
    """Exposed seconds of a collective overlapped with `window_s` of compute: what exceeds the window, at least the
    share no overlap can hide (Megatron's last gradient bucket, the first parameter all-gather: one layer, or one
    virtual stage with interleaving; Megatron-Bridge docs/performance-guide.md, overlap section), plus the
    slowdown its hidden part costs the compute (CONTENTION_SM)."""
    if comm_s <= 0:
        return 0.0
    exposed = max(0.0, comm_s - window_s)
    if physics.overlap_limits:
        exposed = max(exposed, unhidden_share * comm_s)
    if physics.contention:
        exposed += CONTENTION_SM * (comm_s - exposed)
    return exposed


def copy_engine_exposed(transfer_s: float, window_s: float, physics: Physics) -> float:
    """Exposed seconds of a copy-engine transfer (activation offload to host memory) beside `window_s` of compute:
    what exceeds the window, plus the HBM contention its hidden part costs (CONTENTION_COPY_ENGINE: copy engines
    take no SMs)."""
    if transfer_s <= 0:
        return 0.0
    exposed = max(0.0, transfer_s - window_s)
    if physics.contention:
        exposed += CONTENTION_COPY_ENGINE * (transfer_s - exposed)
    return exposed


# the column-parallel GEMMs after a TP all-gather and the row-parallel ones before a reduce-scatter; wq/wk/wv and
# w1/w3 are the unfused projections of frameworks that keep them as separate linears (ops.py, Runtime.fused_projections)
TP_OVERLAPPED_GEMMS = {"qkv_proj": "all_gather", "up_gate_proj": "all_gather", "up_proj": "all_gather",
                       "wq": "all_gather", "wk": "all_gather", "wv": "all_gather", "w1": "all_gather",
                       "w3": "all_gather", "out_proj": "reduce_scatter", "down_proj": "reduce_scatter"}


def column_gemm_count(names) -> int:
    """A block's column-parallel GEMMs (those beside its TP all-gather), by operator name: async_tp_fused reads it."""
    return sum(TP_OVERLAPPED_GEMMS.get(name) == "all_gather" for name in names)


def async_tp_fused(sp: bool, backward: bool, collective: str, column_gemms: int) -> bool:
    """Whether PyTorch's micro-pipeline TP pass fuses a TP collective with its GEMM. It matches only all-gather
    -> matmul and matmul -> reduce-scatter where the reduce-scatter's input is one matmul's sole output
    (torch/_inductor/fx_passes/micro_pipeline_tp.py, fuse_matmul_reduce_scatter), so without sequence parallelism
    nothing is fused, and the backward's mirror of the all-gather, the reduce-scatter of the input gradient, is
    fused only when one linear makes that gradient (`column_gemms`, the block's column-parallel GEMMs, is 1):
    torchtitan's models keep Q, K, V and the gated MLP's w1, w3 as separate nn.Linear layers
    (torchtitan/models/llama3/model.py), whose input gradients are summed first."""
    if not sp:
        return False
    return not (backward and collective == "tp_all_gather" and column_gemms != 1)


def tp_gemm_chunks(kind: str, gemm: str, tp: int, sp: bool, backward: bool = False, column_gemms: int = 1) -> int:
    """Pieces a GEMM beside a TP collective is cut into to overlap it, each running at a smaller GEMM's efficiency:
    userbuffers splits the all-gather side into tp ring-exchange steps and the reduce-scatter side into 4 pipeline
    chunks (TransformerEngine get_default_config); PyTorch async TP micro-pipelines both over tp shards
    (pytorch/pytorch#130583) where it fuses them (async_tp_fused; `backward`: the input-gradient GEMM). MLA's and
    the experts' GEMMs are not beside a TP collective."""
    if tp <= 1 or kind == "none" or (kind == "userbuffers" and not sp):
        return 1
    side = TP_OVERLAPPED_GEMMS.get(gemm)
    if side is None:
        return 1
    if kind == "async-tp":  # the backward input-gradient GEMM of an unfused reduce-scatter runs whole
        fused = async_tp_fused(sp, backward, "tp_all_gather" if side == "all_gather" else "tp_reduce_scatter",
                               column_gemms)
        return tp if fused else 1
    return tp if side == "all_gather" else 4
