"""The training framework's behaviour: what it fuses, which kernels and overlap it has, which schedules, CP kinds
and ZeRO stages it runs. Presets (RUNTIMES), each with its source, and their '+option's (RUNTIME_OPTIONS)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict

from meshplan.costmodels.config import DEFAULT_RECOMPUTE_MODULES, Schedule
from meshplan.hardware_db.errors import InputError


class Runtime(BaseModel):
    """How the training framework executes: what it fuses and what communication it overlaps.

    These are properties of a framework version, not of a run; presets below, each with its source.
    """

    model_config = ConfigDict(defer_build=True, frozen=True, extra="forbid")
    name: str
    flash_attention: bool  # fused attention core (no s^2 activations, causal blocks skipped)
    dropout: bool  # dropout masks stored (Megatron GPT defaults: hidden and attention dropout 0.1)
    overlap_grad_reduce: bool  # DP gradient reduce overlapped with the backward pass
    overlap_param_gather: bool  # ZeRO param all-gather overlapped with the forward pass
    # TP communication overlap: none (blocking collectives), userbuffers (TransformerEngine's ring-exchange and
    # pipelined GEMM+collective splits), async-tp (PyTorch's micro-pipelined all-gather/reduce-scatter matmuls)
    tp_overlap: Literal["none", "userbuffers", "async-tp"]
    p2p_overlap: bool  # pipeline send/recv overlapped with compute
    # the attention kernel: "fused" = FlashAttention-3 class, "cudnn" = cuDNN fused attention (TransformerEngine's
    # choice on Hopper and later: dot_product_attention/utils.py "give FusedAttention preference on Hopper+"),
    # "fa2" = FlashAttention-2 (the flash-attn package; TransformerEngine's FlashAttention backend), "sdpa-fa2" =
    # PyTorch SDPA's flash backend (its own copy of the FA2 kernels, slower: kernels.SDPA_FLASH_OVER_FA2); all
    # skip masked causal blocks
    attention_kernel: Literal["fused", "cudnn", "fa2", "sdpa-fa2"] = "fused"
    # memory-bound kernels by ops.memory_class: their achieved fraction of the GPU's fused-kernel bandwidth
    # (GPUSpec efficiency.memory_bandwidth); a class not listed runs fused (1.0)
    memory_kernels: tuple[tuple[str, float], ...] = ()
    # the same for a class's backward kernel where it differs from its forward one (a class not listed: as above)
    memory_kernels_backward: tuple[tuple[str, float], ...] = ()
    ep_overlap: bool = False  # EP all-to-all hidden behind another micro-batch's compute (DualPipe / 1F1B A2A)
    # the EP token dispatcher: NCCL all-to-all, or DeepEP / HybridEP (one copy per destination node over the NIC,
    # forwarded over NVLink: DeepSeek-V3 report sec. 3.2.2; Megatron-Core flex dispatcher)
    ep_dispatch: Literal["all-to-all", "deepep"] = "all-to-all"
    # FP8 training only: the dispatch (forward) and the activation gradient before the down-projection (backward)
    # cross the EP all-to-all in FP8, the combines in BF16 (DeepSeek-V3 report sec. 3.3.3; ops.ep_dispatch_bytes)
    ep_fp8_dispatch: bool = False
    # expert GEMMs: one grouped kernel over all local experts (torch._grouped_mm, CUTLASS, DeepGEMM, TE's
    # GroupedTensor path), or TransformerEngine's default of one cuBLAS GEMM per expert on 4 streams
    # (kernels.TE_GEMM_STREAMS)
    grouped_gemm: Literal["kernel", "multi-stream"] = "kernel"
    # what "selective" recomputation means in this framework: Megatron's core attention (Korthikanti et al. 2022
    # sec. 5), or torchtitan's op-level SAC (saves matmul outputs but every other one and the attention output,
    # recomputes the rest: torchtitan parallelize_llama.py _save_list)
    selective: Literal["core-attention", "op-sac"] = "core-attention"
    # Q, K, V as one GEMM and a gated MLP's gate and up projections as one (Megatron-Core linear_qkv and
    # linear_fc1, megatron/core/transformer/attention.py and mlp.py), or as separate linears, each reading the
    # same input again and each a narrower GEMM (torchtitan/models/llama3/model.py wq, wk, wv, w1, w3)
    fused_projections: bool = True
    # FP8 recipes under which the TP all-gathers (the SP input forward, the output gradient backward) move FP8:
    # torchao's Float8ColwiseParallel / PrepareFloat8ModuleInput cast before the all-gather and
    # Float8RowwiseParallel casts the output gradient (torchao float8/float8_tensor_parallel.py), which torchtitan
    # uses for tensorwise only ("for rowwise recipes ... all-gather happens in high precision", parallelize_llama.py)
    tp_fp8_all_gather: tuple[str, ...] = ()
    # ZeRO-3 / FSDP sharding copies each gathered layer out of the all-gather buffer and each gradient into the
    # reduce-scatter buffer on the compute stream (PyTorch FSDP2; estimate.FSDP_COPY_OUT_BYTES / _IN_BYTES)
    fsdp_copies: bool = False
    # GQA K,V heads copied up to the query heads before the attention kernel (torchtitan's repeat_kv ahead of
    # F.scaled_dot_product_attention, models/llama/model.py until #2259 "GQA without kv repeats", 2026-01-27): the
    # copy costs a pass over the repeated tensors, and the kernel, torch CP's K,V exchange and the saved K,V carry
    # query-head width. False: the kernel reads the grouped heads in place (TE / flash-attn GQA, SDPA enable_gqa)
    gqa_repeats_kv: bool = False
    # MXFP8 casts: both block directions in one fused pass (TransformerEngine's MXFP8 quantizer), or one kernel per
    # direction, each reading the 16-bit operand again (torchao's MXLinear; kernels.TORCHAO_MX_CAST_BYTES)
    mx_cast_per_dim: bool = False
    # what the framework can run at all: the search picks only these, a pinned knob outside them is refused
    schedules: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved", "zb")
    cp_comms: tuple[Literal["ring", "a2a"], ...] = ("ring", "a2a")  # () = no context parallelism
    # how ring CP moves K,V: "p2p", one chunk per attention step (Megatron-Core / TE AttnFuncWithCPAndKVP2P), or
    # "allgather" (torch context_parallel's default rotate method, _ContextParallelOptions.rotate_method: one
    # all-gather issued with the first, local step and waited before the second, again in the backward; the K,V
    # gradients go round in fp32, convert_to_f32; torch/distributed/tensor/experimental/_attention.py)
    cp_rotate: Literal["p2p", "allgather"] = "p2p"
    # bytes per logit element the loss holds at its peak on the last stage: 16-bit logits plus their fp32 copy in
    # Megatron's fused vocab-parallel cross-entropy (Korthikanti et al. 2022 sec. 4.3, 4sbv/t), or, for an eager
    # F.cross_entropy(pred.float(), labels) (torchtitan components/loss.py), the backward of its log_softmax: the
    # saved fp32 output, its incoming and its outgoing fp32 gradient, 12 bytes
    loss_bytes_per_logit: float = 6.0
    # the same under TP's vocab-sharded loss where it differs (None: as loss_bytes_per_logit): torch's loss_parallel
    # runs its own eager log-softmax (torch/distributed/tensor/parallel/loss.py _log_softmax: the fp32 input, the
    # shifted copy and its exp beside the 16-bit logits, 14 B; _nll_loss_and_log_softmax_backward: the saved fp32
    # output, a zeros_like gradient, exp(x) and their sum, 16 B)
    loss_parallel_bytes_per_logit: float | None = None
    # torch's sequence parallelism (DTensor SequenceParallel + PrepareModuleInput) hands the all-gathered norm
    # output to the column-parallel linears, which save it whole for their weight gradients; Megatron saves its
    # shard and gathers it again in the backward (Korthikanti et al. 2022 sec. 4.2.3)
    sp_saves_gathered_input: bool = False
    zero_stages: tuple[Literal[0, 1, 2, 3], ...] = (0, 1, 2, 3)
    # recomputation it runs: one policy on every pipeline stage (Megatron's --recompute-granularity and
    # --recompute-method apply to every stage, megatron/core/transformer/transformer_block.py _checkpointed_forward;
    # torchtitan's activation_checkpoint.mode wraps every block alike, torchtitan/distributed/activation_checkpoint.py),
    # or also a policy of each stage's own ("per-stage": meshplan's executor takes the plan's per-stage policies)
    recomputes: tuple[Literal["none", "selective", "full", "per-stage"], ...] = ("none", "selective", "full")
    # ZeRO-2/3 gradients (sharded): reduce-scattered layer by layer in every micro-batch's backward
    # ("every-microbatch": Megatron-FSDP, "for grads shard mode there will actually always be gradient sync",
    # megatron_fsdp.py no_sync, and docs/user-guide/features/megatron_fsdp.md "accumulated during every backward
    # pass"; FSDP2 in a gradient-accumulation loop, torchtitan trainer.py train_step), or, under a pipeline
    # schedule, accumulated unsharded in fp32 and reduced after the last micro-batch only ("pipeline-defers":
    # torch.distributed.pipelining stage.py backward_maybe_with_nosync, FSDPParam.to_accumulated_grad_if_needed)
    sharded_grad_reduce: Literal["every-microbatch", "pipeline-defers"] = "every-microbatch"
    # bytes per gradient element in the gradient buffer and the DP reduce: fp32 (Megatron-LM trains bf16 with
    # --accumulate-allreduce-grads-in-fp32, which validate_args turns on for bf16: "bfloat16 requires gradient
    # accumulation and all-reduce to be done in fp32", megatron/training/arguments.py; PyTorch FSDP2's
    # MixedPrecisionPolicy(reduce_dtype=float32) in torchtitan), or 2 where a recipe reduces in bf16 (the
    # "bf16-grads" option: Megatron-Core's buffer takes param.dtype without grad_reduce_in_fp32,
    # param_and_grad_buffer.py)
    grad_bytes: float = 4.0

    def reduces_each_microbatch(self, zero: int, pp: int) -> bool:
        """Whether each micro-batch's backward reduce-scatters its gradients (sharded gradients, not deferred)."""
        return zero >= 2 and not (self.sharded_grad_reduce == "pipeline-defers" and pp > 1)

    def holds_unsharded_grads(self, zero: int, pp: int) -> bool:
        """Whether ZeRO-2/3 gradients sit unsharded (fp32) between micro-batches: pipelining's deferred reduce."""
        return zero >= 2 and not self.reduces_each_microbatch(zero, pp)

    def memory_kernel(self, cls: str | None, backward: bool = False) -> float:
        """The achieved fraction of the GPU's fused-kernel bandwidth of this framework's kernel of a class (of its
        backward kernel, `backward`)."""
        if backward:
            found = next((f for c, f in self.memory_kernels_backward if c == cls), None)
            if found is not None:
                return found
        return next((f for c, f in self.memory_kernels if c == cls), 1.0)

    def lacks(self, schedule: str | None = None, cp: int = 1, cp_comm: str = "ring",
              zero: int | None = None, recompute_modules: tuple[str, ...] = DEFAULT_RECOMPUTE_MODULES,
              recompute: str | None = None) -> str | None:
        """Why this framework cannot run these knobs (one clause), or None."""
        if recompute is not None and recompute not in self.recomputes:
            return f"{self.name} recomputes every pipeline stage alike (it has no {recompute} recomputation)"
        if schedule is not None and schedule not in self.schedules:
            return f"{self.name} has no {schedule} schedule (it runs {', '.join(self.schedules)})"
        if cp > 1 and not self.cp_comms:
            return f"{self.name} has no context parallelism"
        if cp > 1 and cp_comm not in self.cp_comms:
            return f"{self.name} has no {cp_comm} context parallelism (it has {', '.join(self.cp_comms)})"
        if zero is not None and zero not in self.zero_stages:
            return f"{self.name} has no ZeRO-{zero} (it has {', '.join(map(str, self.zero_stages))})"
        if self.selective == "op-sac" and tuple(recompute_modules) != DEFAULT_RECOMPUTE_MODULES:
            return (f"{self.name} has no --recompute-modules (its selective recompute is per-operator SAC); drop "
                    f"--recompute-modules or use a megatron-core runtime")
        return None


RUNTIMES: dict[str, Runtime] = {
    # Megatron-LM as in Narayanan et al. SC'21 and Korthikanti et al. 2022: unfused softmax attention, DP all-reduce
    # after the backward pass, blocking TP all-reduce and blocking P2P (megatron/schedules.py of that time).
    # It runs 1F1B and interleaved 1F1B only, has no context parallelism (Megatron-Core 0.4, 2023, added it) and
    # shards nothing beyond the distributed optimizer (--use-distributed-optimizer, Megatron-LM 2022).
    "megatron-2022": Runtime(name="megatron-2022", flash_attention=False, dropout=True, overlap_grad_reduce=False,
                             overlap_param_gather=False, tp_overlap="none", p2p_overlap=False,
                             schedules=("1f1b", "interleaved"), cp_comms=(), zero_stages=(0, 1)),
    # Megatron-Core r0.8 (2024) with TransformerEngine: flash attention, --overlap-grad-reduce,
    # --overlap-param-gather, --tp-comm-overlap (userbuffers); NVIDIA/Megatron-LM README "Performance Benchmarking".
    # Schedules: megatron/core/pipeline_parallel/schedules.py has 1F1B and interleaved 1F1B (no GPipe, no zero
    # bubble); CP: --cp-comm-type p2p (ring) or a2a; ZeRO: 1 = distributed optimizer, 2/3 = Megatron-FSDP
    # (--data-parallel-sharding-strategy optim_grads / optim_grads_params).
    # Expert GEMMs: TE GroupedLinear's default, one cuBLAS GEMM per expert on 4 streams (kernels.TE_GEMM_STREAMS).
    # Kernels: TransformerEngine's fused norms (LayerNormLinear) and cuDNN fused attention; SwiGLU / GeLU through
    # Megatron's TorchScript bias_swiglu / bias_gelu: 55 % of H100 HBM forward, backward 2.6x slower than Liger's
    # ~90 % kernel (Liger-Kernel benchmark/data/all_benchmark_data.csv @ ead96b6, 8192 tokens, ffn 16384), i.e.
    # 0.44 of the fused rate over a forward + backward; cross-entropy: fused_vocab_parallel_cross_entropy takes
    # 18.2 ms fwd+bwd for 8192 tokens x 131,072 vocab on H100 (same file), 0.47 of its bytes at the fused rate.
    "megatron-core": Runtime(name="megatron-core", flash_attention=True, dropout=True, overlap_grad_reduce=True,
                             overlap_param_gather=True, tp_overlap="userbuffers", p2p_overlap=True,
                             schedules=("1f1b", "interleaved"), attention_kernel="cudnn", grouped_gemm="multi-stream",
                             memory_kernels=(("swiglu", 0.44), ("activation", 0.44), ("cross_entropy", 0.47))),
    # A plain PyTorch FSDP2 / torchtitan run: flash SDPA, prefetching FSDP (overlapped), no TP overlap.
    # torch.distributed.pipelining schedules GPipe, 1F1B and Interleaved1F1B (its zero-bubble schedules are V-shaped
    # or interleaved, not meshplan's ZB-H1); CP: ring attention only (torch context_parallel); sharding: DDP or
    # FSDP2 (reshard after forward = ZeRO-3, never = ZeRO-2), no ZeRO-1.
    # Kernels (eager, torch <= 2.8): SDPA picks FlashAttention-2 on H100, not cuDNN (pytorch/pytorch#142132:
    # 329 vs 631 TFLOP/s, nightly 2024-12; cuDNN SDPA is opt-in until torch 2.9, #138522 / #162073); nn.RMSNorm
    # 54 % of H100 HBM (0.6 of fused), eager SwiGLU 32 % (0.36), eager cross-entropy like Megatron's unfused one,
    # 21.3 ms for 8192 x 131,072 (0.40) (Liger-Kernel all_benchmark_data.csv @ ead96b6); eager RoPE in fp32 complex
    # (models/llama3/model.py apply_rotary_emb: .float() 2+4 B, the complex multiply 4+4 B, .type_as 4+2 B an
    # element against a fused kernel's 2+2 B: 0.2). `+compile` fuses them.
    # Its models keep wq, wk, wv and w1, w3 as separate linears (models/llama3/model.py): fused_projections off;
    # they repeat GQA K,V heads before SDPA until 2026-01 (gqa_repeats_kv; `+native-gqa` for later versions).
    "torchtitan": Runtime(name="torchtitan", flash_attention=True, dropout=False, overlap_grad_reduce=True,
                          overlap_param_gather=True, tp_overlap="none", p2p_overlap=True,
                          schedules=("gpipe", "1f1b", "interleaved"), cp_comms=("ring",), zero_stages=(0, 2, 3),
                          cp_rotate="allgather", loss_bytes_per_logit=12.0, loss_parallel_bytes_per_logit=16.0,
                          sp_saves_gathered_input=True,
                          sharded_grad_reduce="pipeline-defers",
                          attention_kernel="sdpa-fa2", selective="op-sac", fused_projections=False,
                          tp_fp8_all_gather=("tensorwise",), fsdp_copies=True, gqa_repeats_kv=True,
                          mx_cast_per_dim=True,
                          memory_kernels=(("norm", 0.6), ("swiglu", 0.36), ("activation", 0.36), ("rope", 0.2),
                                          ("cross_entropy", 0.40))),
    # meshplan's reference executor (executor/plan_run.py): SDPA attention, no dropout, gradients synchronised after
    # the backward, ZeRO-1 parameters broadcast after the step, blocking TP collectives and pipeline send/recv.
    # `verify --calibration` predicts its runs with this preset. Its attention core repeats GQA heads inside the
    # core, after the CP exchange (executor/model.py causal_attention, context_parallel.py _block_attention): the
    # exchange moves grouped heads, so gqa_repeats_kv stays False and the in-core copy is left out.
    "meshplan-executor": Runtime(name="meshplan-executor", flash_attention=True, dropout=False,
                                 overlap_grad_reduce=False, overlap_param_gather=False, tp_overlap="none",
                                 p2p_overlap=False, fused_projections=False, fsdp_copies=True,
                                 sp_saves_gathered_input=True, recomputes=("none", "selective", "full", "per-stage")),
}
DEFAULT_RUNTIME = "megatron-core"

@dataclass(frozen=True)
class RuntimeOption:
    """One '+option' of a preset: what it means, and the Runtime fields it sets."""

    description: str
    fields: tuple[tuple[str, object], ...]


# A preset's framework options, appended as "+option" (e.g. torchtitan+compile+async-tp).
RUNTIME_OPTIONS: dict[str, RuntimeOption] = {
    # torch.compile (Inductor) fuses the elementwise chains into Triton kernels near the HBM roof (QuACK's
    # comparison puts its RMSNorm at 0.5-1.25x QuACK's ~90 %); its cross-entropy reads the logits once more than
    # a fused one (QuACK blog, 2025-07-10: 1.89 vs 3.01 TB/s softmax): 0.63 of fused. Its RMSNorm backward runs at
    # about half its forward's rate: 2,276 against 4,176 GB/s on the H200 (0.545; GB200 3,177 / 6,425 and GB300
    # 3,227 / 6,460: 0.49-0.50), the fastest of each in cuDNN frontend's norm benchmark (benchmark/norms/results,
    # torch_compile backend, cuDNN 9.19.1, 2026-02; on the H200 that forward is memory_bandwidth itself)
    "compile": RuntimeOption("elementwise kernels fused (torch.compile)",
                             (("memory_kernels", (("cross_entropy", 0.63),)),
                              ("memory_kernels_backward", (("norm", 0.545),)))),
    # torchtitan compiles the loss with the model since PR #1033 (2025-04-01, components/loss.py
    # build_cross_entropy_loss; reverted once in Dec 2024, PR #755): Inductor fuses the fp32 cast, the log-softmax
    # and its backward, so the loss holds the 16-bit logits it saved and their 16-bit gradient
    "compiled-loss": RuntimeOption("cross-entropy compiled with torch.compile (16-bit logits and gradient held)",
                                   (("loss_bytes_per_logit", 4.0), ("loss_parallel_bytes_per_logit", 4.0))),
    "async-tp": RuntimeOption("TP all-gather / reduce-scatter micro-pipelined with the matmuls (PyTorch async TP)",
                              (("tp_overlap", "async-tp"),)),
    "tp-comm-overlap": RuntimeOption("TransformerEngine userbuffers TP overlap", (("tp_overlap", "userbuffers"),)),
    "no-tp-comm-overlap": RuntimeOption("blocking TP collectives", (("tp_overlap", "none"),)),
    "cudnn-attention": RuntimeOption("cuDNN fused attention kernels", (("attention_kernel", "cudnn"),)),
    "fa3": RuntimeOption("FlashAttention-3 class attention kernels", (("attention_kernel", "fused"),)),
    "fa2": RuntimeOption("FlashAttention-2 kernels (flash-attn)", (("attention_kernel", "fa2"),)),
    "sdpa-fa2": RuntimeOption("PyTorch SDPA's FlashAttention-2 backend", (("attention_kernel", "sdpa-fa2"),)),
    "ep-a2a-overlap": RuntimeOption("EP all-to-all hidden behind another micro-batch (DualPipe / Megatron 1F1B A2A "
                                    "overlap)", (("ep_overlap", True),)),
    "grouped-kernel": RuntimeOption("expert GEMMs as one grouped kernel (TE GroupedTensor / op fuser, CUTLASS, "
                                    "DeepGEMM)", (("grouped_gemm", "kernel"),)),
    "fp8-dispatch": RuntimeOption("FP8 EP dispatch, BF16 combine, in FP8 training (DeepSeek-V3 report sec. 3.3.3)",
                                  (("ep_fp8_dispatch", True),)),
    "reduce-each-microbatch": RuntimeOption("ZeRO-2/3 gradients reduce-scattered in every micro-batch's backward "
                                            "under pipelining too (kept sharded, as Megatron-FSDP does)",
                                            (("sharded_grad_reduce", "every-microbatch"),)),
    "fused-projections": RuntimeOption("Q, K, V and the gated MLP's gate and up projections each one GEMM "
                                       "(Megatron-Core linear_qkv / linear_fc1)", (("fused_projections", True),)),
    "no-fsdp-copies": RuntimeOption("ZeRO-3 / FSDP gathering into and reducing from the parameters' own buffers "
                                    "(no copy-out / copy-in)", (("fsdp_copies", False),)),
    "bf16-tp-gather": RuntimeOption("TP all-gathers in 16 bits whatever the FP8 recipe", (("tp_fp8_all_gather", ()),)),
    "sp-regather": RuntimeOption("sequence parallelism saving each linear's input shard and gathering it again in "
                                 "the backward (Megatron's; Korthikanti et al. 2022 sec. 4.2.3)",
                                 (("sp_saves_gathered_input", False),)),
    "native-gqa": RuntimeOption("GQA K,V heads read in place by the attention kernel, not repeated to the query heads "
                                "(torchtitan since #2259, 2026-01; SDPA enable_gqa)", (("gqa_repeats_kv", False),)),
    "cp-alltoall": RuntimeOption("ring CP rotating K,V one chunk per attention step (torch context_parallel "
                                 "set_rotate_method('alltoall'); torchtitan context_parallel_rotate_method)",
                                 (("cp_rotate", "p2p"),)),
    # Megatron-Bridge's performance recipes set ddp.grad_reduce_in_fp32 = False for every model family since
    # v0.1.0rc3 (scripts/performance/configs/*/..._llm_pretrain.yaml "grad_reduce_in_fp32: false"; at 067f987
    # src/megatron/bridge/perf_recipes/_common.py _benchmark_common), so gradients are bf16 in the buffer and the
    # DP reduce-scatter
    "bf16-grads": RuntimeOption("gradients kept and reduced in bf16 (grad_reduce_in_fp32 off)",
                                (("grad_bytes", 2.0),)),
    "deepep": RuntimeOption("DeepEP / HybridEP token dispatch: each token crosses the NIC once per node (Megatron-Core "
                            "--moe-token-dispatcher-type flex)", (("ep_dispatch", "deepep"),)),
}


def get_runtime(name: str) -> Runtime:
    """A preset by name, with options appended as '+option' (RUNTIME_OPTIONS), applied left to right."""
    base, *options = name.split("+")
    if base not in RUNTIMES:
        raise InputError(f"unknown runtime '{base}'; choose one of: {', '.join(RUNTIMES)}")
    rt = RUNTIMES[base]
    if not options:
        return rt
    update: dict = {"name": name}
    for opt in options:
        if opt not in RUNTIME_OPTIONS:
            raise InputError(f"unknown runtime option '+{opt}'; choose from: "
                             + ", ".join(f"+{o}" for o in RUNTIME_OPTIONS))
        update.update(RUNTIME_OPTIONS[opt].fields)
    return rt.model_copy(update=update)
