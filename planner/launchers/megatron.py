"""Megatron-LM: a plan as `pretrain_gpt.py` arguments (and the torchrun line around them), and back.

The flag names and their rules are Megatron-LM's megatron/training/arguments.py and megatron-core's
megatron/core/transformer/transformer_config.py (v0.16): uneven stages by --decoder-first/last-pipeline-num-layers
(the middle stages equal, every stage's layers divisible by the virtual stages) or else by the
--pipeline-model-parallel-layout string (megatron/core/transformer/pipeline_parallel_layer_layout.py: "E" the
embedding, "t" a decoder layer, "m" an MTP layer, "L" the loss, "|" between virtual stages, "x*n" and "(...)*n"
repeat; virtual stage v of pipeline rank r is entry v*pp + r).
"""

from __future__ import annotations

import argparse
import math
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from meshplan.costmodels.config import (DEFAULT_RECOMPUTE_MODULES, PP_INSIDE_DP, RECOMPUTE_MODULES, ParallelConfig,
                                        Recompute, StagePolicy, TrainDtype, Workload, ZeroStage, split_evenly)
from meshplan.costmodels.model import ModelSpec, RopeScaling
from meshplan.costmodels.runtime import get_runtime
from meshplan.hardware_db.errors import InputError
from meshplan.planner.launchers.common import (UNIFORM_RECOMPUTE, Exported, ExportedFile, header_lines, refuse,
                                               shell_lines, torchrun_args, uniform_recompute)
from meshplan.planner.plan import Plan

__all__ = ["TARGET", "Setting", "model_settings", "parallel_settings", "megatron_args", "export_megatron",
           "pipeline_layout", "parse_layout", "moe_layer_freq", "parse_moe_layer_freq", "LaunchSpec",
           "parse_megatron_args", "parser_names", "model_disagreement", "MEGATRON_SCRIPT"]

TARGET = "megatron"
MEGATRON_SCRIPT = "pretrain_gpt.py"
Setting = tuple[str, object]  # (Megatron argument name with underscores, value); True: a switch; False/None: absent
# DistributedDataParallelConfig, mcore v0.16
FSDP_STRATEGY: dict[ZeroStage, str] = {1: "optim", 2: "optim_grads", 3: "optim_grads_params"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _argv(settings: list[Setting]) -> list[str]:
    argv: list[str] = []
    for name, value in settings:
        if value is None or value is False:
            continue
        if isinstance(value, (list, tuple)):  # nargs="*" flags (--recompute-modules a b)
            argv += [_flag(name), *map(str, value)]
        else:
            argv += [_flag(name)] if value is True else [_flag(name), str(value)]
    return argv


# ---- the model -----------------------------------------------------------------------------------------------------

def moe_layer_freq(model: ModelSpec) -> int | str:
    """--moe-layer-freq: an int N (layer i is MoE iff i % N == 0) or a Python list expression of 0/1 per layer,
    run-length written ("([0]*3+[1]*58)", the form Megatron's DeepSeek-V3 recipes use)."""
    moe = model.moe
    assert moe is not None
    if moe.first_k_dense == 0:
        return moe.layer_freq
    pattern = [int(model.is_moe_layer(i)) for i in range(model.num_layers)]
    runs: list[list[int]] = []
    for bit in pattern:
        if runs and runs[-1][0] == bit:
            runs[-1][1] += 1
        else:
            runs.append([bit, 1])
    return "(" + "+".join(f"[{bit}]*{n}" for bit, n in runs) + ")"


def parse_moe_layer_freq(text: str, num_layers: int) -> list[int]:
    """The 0/1 pattern of an int or a list expression of --moe-layer-freq (the sums of `[..]*n` and `[..]` terms
    Megatron's recipes write; evaluated here without eval)."""
    text = text.strip()
    if re.fullmatch(r"[0-9]+", text):
        n = int(text)
        if n < 1:
            raise InputError(f"--moe-layer-freq {text}: must be >= 1")
        return [int(i % n == 0) for i in range(num_layers)]
    body = text[1:-1] if text.startswith("(") and text.endswith(")") else text
    pattern: list[int] = []
    for term in body.split("+"):
        m = re.fullmatch(r"\s*\[([0-9,\s]*)\]\s*(?:\*\s*([0-9]+))?\s*", term)
        if not m:
            raise InputError(f"--moe-layer-freq {text!r}: cannot read {term.strip()!r}; write an int or a list "
                             f"expression like ([0]*3+[1]*58)")
        items = [int(x) for x in m.group(1).replace(" ", "").split(",") if x]
        if any(x not in (0, 1) for x in items):
            raise InputError(f"--moe-layer-freq {text!r}: list entries must be 0 or 1")
        times = int(m.group(2) or 1)
        if len(pattern) + len(items) * times > num_layers:  # checked before it is built: '[1]*10**12' is no list
            raise InputError(f"--moe-layer-freq {text!r} describes more layers than the model's {num_layers}")
        pattern += items * times
    if len(pattern) != num_layers:
        raise InputError(f"--moe-layer-freq {text!r} describes {len(pattern)} layers; the model has {num_layers}")
    return pattern


def model_settings(model: ModelSpec, seq_len: int) -> list[Setting]:
    """The model shape arguments of `model` (megatron/training/arguments.py, _add_network_size_args and the MoE and
    MLA groups)."""
    if model.linear_bias and not model.qkv_bias:
        raise refuse(TARGET, f"{model.name} has linear biases but no QKV bias, and Megatron's --add-bias-linear "
                     "also biases QKV", "use a model file with qkv_bias true or linear_bias false")
    mla = model.mla
    s: list[Setting] = [
        ("num_layers", model.num_layers), ("hidden_size", model.hidden), ("ffn_hidden_size", model.ffn_hidden),
        ("num_attention_heads", model.num_heads),
    ]
    if mla is None:
        gqa = model.kv_heads < model.num_heads
        s += [("group_query_attention", gqa), ("num_query_groups", model.kv_heads if gqa else None)]
        explicit = model.head_dim is not None and model.head_dim * model.num_heads != model.hidden
        s.append(("kv_channels", model.head_dim if explicit else None))
    else:
        s += [("multi_latent_attention", True), ("q_lora_rank", mla.q_lora_rank), ("kv_lora_rank", mla.kv_lora_rank),
              ("qk_head_dim", mla.qk_nope_head_dim), ("qk_pos_emb_head_dim", mla.qk_rope_head_dim),
              ("v_head_dim", mla.v_head_dim)]
    s += [
        ("seq_length", seq_len), ("max_position_embeddings", model.max_seq_len or seq_len),
        ("swiglu", model.mlp == "swiglu"), ("squared_relu", model.mlp == "relu2"),
        ("normalization", "RMSNorm" if model.norm == "rmsnorm" else "LayerNorm"),
        ("position_embedding_type", "learned_absolute" if model.learned_positions else "rope"),
        ("untie_embeddings_and_output_weights", not model.tied_embeddings),
        ("disable_bias_linear", not model.linear_bias), ("add_qkv_bias", model.qkv_bias and not model.linear_bias),
        ("vocab_size", model.vocab),
    ]
    moe = model.moe
    if moe is not None:
        shared = moe.num_shared_experts * moe.shared_hidden if moe.num_shared_experts else None
        s += [("num_experts", moe.num_experts), ("moe_router_topk", moe.top_k),
              ("moe_ffn_hidden_size", moe.expert_ffn_hidden), ("moe_shared_expert_intermediate_size", shared),
              ("moe_layer_freq", moe_layer_freq(model))]
    s.append(("mtp_num_layers", model.num_mtp_layers or None))
    return s + training_settings(model)


# megatron-core's fixed Llama 3.1 bands (models/common/embeddings/rotary_pos_embedding.py, _apply_scaling) and
# MLATransformerConfig's YaRN defaults (transformer_config.py): the CLI reaches only the factor of the first, and
# for MLA not the original length or the betas
MEGATRON_LLAMA3_ORIGINAL, MLA_YARN_ORIGINAL = 8192, 4096
MEGATRON_LLAMA3_BANDS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": float(MEGATRON_LLAMA3_ORIGINAL)}
MLA_YARN_DEFAULTS = {"original_max_position_embeddings": float(MLA_YARN_ORIGINAL), "beta_fast": 32.0,
                     "beta_slow": 1.0}


def _rope_settings(model: ModelSpec) -> list[Setting]:
    """RoPE base and scaling (arguments.py: --rotary-base, --use-rope-scaling/--rope-scaling-factor for Llama 3.1,
    --position-embedding-type yarn with --rotary-scaling-factor, --mscale, --mscale-all-dim and --yarn-*; MLA reads
    --rope-type and the unprefixed YaRN flags)."""
    if model.learned_positions:
        return []
    s: list[Setting] = []
    if model.rope_theta is not None:
        if not float(model.rope_theta).is_integer():
            raise refuse(TARGET, f"Megatron's --rotary-base is an integer; {model.name} has rope_theta "
                         f"{model.rope_theta:g}", "use a model file with an integer rope_theta")
        s.append(("rotary_base", int(model.rope_theta)))
    scaling = model.rope_scaling
    if scaling is None:
        return s
    if scaling.kind == "llama3":
        given = {k: getattr(scaling, k) for k in MEGATRON_LLAMA3_BANDS}
        if any(v is not None and v != MEGATRON_LLAMA3_BANDS[k] for k, v in given.items()):
            raise refuse(TARGET, f"megatron-core's Llama 3 RoPE scaling fixes {MEGATRON_LLAMA3_BANDS}; {model.name} "
                         f"has {given}", "train it with a launcher that takes the bands, or a model file without them")
        return s + [("use_rope_scaling", True), ("rope_scaling_factor", scaling.factor)]
    yarn = [("rotary_scaling_factor", scaling.factor),
            ("mscale", scaling.mscale),
            ("mscale_all_dim", scaling.mscale_all_dim)]
    if model.mla is not None:
        given = {k: getattr(scaling, k) for k in MLA_YARN_DEFAULTS}
        if any(v is not None and v != MLA_YARN_DEFAULTS[k] for k, v in given.items()):
            raise refuse(TARGET, f"Megatron's MLA YaRN takes MLATransformerConfig's {MLA_YARN_DEFAULTS} (no flag "
                         f"sets them); {model.name} has {given}", "set them on the config in your launcher")
        return s + [("rope_type", "yarn")] + yarn
    return s + [("position_embedding_type", "yarn")] + yarn + [
        ("yarn_original_max_position_embeddings", scaling.original_max_position_embeddings),
        ("yarn_beta_fast", scaling.beta_fast),
        ("yarn_beta_slow", scaling.beta_slow)]


def training_settings(model: ModelSpec) -> list[Setting]:
    """What the model trains with beyond its shape, where stated and Megatron's default differs: RoPE, the norm's
    epsilon (TransformerConfig.layernorm_epsilon, --norm-epsilon, default 1e-5), dropout (hidden_dropout and
    attention_dropout, default 0.1), and the MoE router and dispatcher (TransformerConfig's moe_router_* and
    moe_token_dispatcher_type fields, their flags the field names)."""
    s = _rope_settings(model)
    if model.norm_eps is not None:
        s.append(("norm_epsilon", model.norm_eps))
    if model.dropout is not None:
        s += [("hidden_dropout", model.dropout), ("attention_dropout", model.dropout)]
    moe = model.moe
    if moe is not None:
        s += [("moe_router_score_function", moe.score_function if moe.score_function != "softmax" else None),
              ("moe_router_enable_expert_bias", moe.expert_bias),
              ("moe_router_topk_scaling_factor", moe.routed_scaling_factor),
              ("moe_router_num_groups", moe.num_groups), ("moe_router_group_topk", moe.group_topk),
              ("moe_router_load_balancing_type", moe.load_balancing),
              # the all-to-all the cost model prices (ops.py's ep_all_to_all), not Megatron's allgather default
              ("moe_token_dispatcher_type", "alltoall")]
    return s


# ---- the pipeline layout -------------------------------------------------------------------------------------------

def pipeline_layout(chunk_layers: list[int], pp: int, mtp_layers: int) -> str:
    """The layout string of decoder layers per virtual stage (model order: entry v*pp + r), embedding first, MTP
    layers and loss in the last; a run of equal middle stages written once as "(...|)*n", four or more layers as
    "t*n"."""
    stages = ["t" * n for n in chunk_layers]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * mtp_layers + "L"
    parts = [stages[0] + "|"]
    i = 1
    while i < len(stages) - 1:
        j = i
        while j + 1 < len(stages) - 1 and stages[j + 1] == stages[i]:
            j += 1
        parts.append(f"({stages[i]}|)*{j - i + 1}" if j > i else stages[i] + "|")
        i = j + 1
    parts.append(stages[-1])
    return re.sub(r"t{4,}", lambda m: f"t*{len(m.group(0))}", "".join(parts))


LAYOUT_MAX_CHARS = 100_000  # a layout expanded past this names far more layers than any model has


def _repeat(count: str, text: str) -> int:
    """A layout's `*n`, refused when it would expand the layout past LAYOUT_MAX_CHARS."""
    if len(count) > 6 or int(count) > LAYOUT_MAX_CHARS:
        raise InputError(f"--pipeline-model-parallel-layout {text[:60]!r}: a repeat of {count[:12]} is more "
                         f"layers than any model has")
    return int(count)


def _bounded_expansion(text: str, start: int) -> Callable[[re.Match], str]:
    """re.sub's replacement for a repeat `(...)*n` of the layout: the piece n times, refused once the expansion so
    far (from `start` characters) would pass LAYOUT_MAX_CHARS, before the piece is built."""
    grown = [start]

    def expand(m: re.Match) -> str:
        times = _repeat(m.group(2), text)
        grown[0] += len(m.group(1)) * times
        if grown[0] > LAYOUT_MAX_CHARS:
            raise InputError(f"--pipeline-model-parallel-layout {text[:60]!r} expands to more layers than any "
                             f"model has")
        return m.group(1) * times

    return expand


def parse_layout(text: str, pp: int) -> tuple[list[int], int, bool, bool]:
    """(decoder layers per virtual stage in model order, MTP layers, embedding first?, loss last?) of a layout
    string, read by the grammar of megatron-core's PipelineParallelLayerLayout.parse_str_to_list."""
    flat = text.replace(",", "")
    for pattern in (r"\(([^)]+)\)\*([0-9]+)", r"(.)\*([0-9]+)"):
        flat = re.sub(pattern, _bounded_expansion(text, len(flat)), flat)
    stages = flat.split("|")
    bad = set(flat) - set("EtmL|")
    if bad:
        raise InputError(f"--pipeline-model-parallel-layout {text!r}: unknown layer characters {sorted(bad)}; "
                         f"use E, t, m, L and |")
    if len(stages) % pp:
        raise InputError(f"--pipeline-model-parallel-layout {text!r} has {len(stages)} virtual stages, not a "
                         f"multiple of --pipeline-model-parallel-size {pp}")
    joined = "".join(stages)
    if joined.count("E") != 1 or joined.count("L") != 1:
        raise InputError(f"--pipeline-model-parallel-layout {text!r}: needs exactly one E and one L")
    return ([s.count("t") for s in stages], joined.count("m"), stages[0].startswith("E"), stages[-1].endswith("L"))


def _pipeline_settings(plan: Plan, mtp_layers: int) -> list[Setting]:
    pipe, pp, vpp = plan.pipeline, plan.mesh.pp, plan.pipeline.vpp
    if pipe.schedule in ("gpipe", "zb"):
        raise refuse(TARGET, f"Megatron-LM has no {pipe.schedule} schedule (megatron/core/pipeline_parallel/"
                     "schedules.py runs 1F1B, interleaved with virtual stages)", "re-plan with --schedule 1f1b",
                     ({"schedule": "1f1b", "vpp": 1}, {"schedule": "interleaved"}))
    s: list[Setting] = [("pipeline_model_parallel_size", pp)]
    if pp == 1:
        return s
    layers = [st.num_layers for st in pipe.stages]
    chunk_model_order = [pipe.stages[r].chunks[v].num_layers for v in range(vpp) for r in range(pp)]
    chunks_even = all([c.num_layers for c in st.chunks] == split_evenly(st.num_layers, vpp) for st in pipe.stages)
    divisible = all(n % vpp == 0 for n in layers)
    middle = set(layers[1:-1])
    if chunks_even and divisible and len(set(layers)) == 1:
        if vpp > 1:
            s.append(("num_layers_per_virtual_pipeline_stage", layers[0] // vpp))
        return s
    if chunks_even and divisible and len(middle) <= 1:
        m = middle.pop() if middle else None
        first = layers[0] if layers[0] != m or m is None else None
        last = layers[-1] if layers[-1] != m or m is None else None
        s += [("decoder_first_pipeline_num_layers", first), ("decoder_last_pipeline_num_layers", last),
              ("num_virtual_stages_per_pipeline_rank", vpp if vpp > 1 else None)]
        return s
    s.append(("pipeline_model_parallel_layout", pipeline_layout(chunk_model_order, pp, mtp_layers)))
    return s


# ---- the parallel configuration ------------------------------------------------------------------------------------

def parallel_settings(plan: Plan) -> list[Setting]:
    mesh, pipe, wl = plan.mesh, plan.pipeline, plan.inputs.workload
    model = plan.inputs.model_spec()
    s: list[Setting] = [("tensor_model_parallel_size", mesh.tp)]
    s += _pipeline_settings(plan, model.num_mtp_layers)
    s += [("context_parallel_size", mesh.cp if mesh.cp > 1 else None),
          ("cp_comm_type", {"ring": "p2p", "a2a": "a2a"}[mesh.cp_comm] if mesh.cp > 1 else None)]
    if model.moe is not None:  # the experts run as one grouped GEMM, as the cost model prices them (ops.mlp_half)
        s += [("expert_model_parallel_size", mesh.ep), ("expert_tensor_parallel_size", mesh.etp),
              ("moe_grouped_gemm", True)]
    s += [("sequence_parallel", mesh.sp), ("use_tp_pp_dp_mapping", "-".join(mesh.rank_order) == PP_INSIDE_DP)]
    zero = plan.memory.zero
    if zero == 1:
        s.append(("use_distributed_optimizer", True))
    elif zero > 1:
        s += [("use_megatron_fsdp", True), ("data_parallel_sharding_strategy", FSDP_STRATEGY[zero])]
    try:
        kind, k = uniform_recompute(plan)
    except ValueError as exc:
        raise refuse(TARGET, f"Megatron applies one recompute policy to every pipeline stage, but {exc}",
                     "re-plan with --recompute none, selective or full", UNIFORM_RECOMPUTE) from None
    if kind == "selective":
        s.append(("recompute_granularity", "selective"))
        modules = list(plan.memory.recompute_modules)
        if modules != list(DEFAULT_RECOMPUTE_MODULES):  # megatron-core's default is core_attn alone
            s.append(("recompute_modules", modules))
    elif kind == "full" and k is None:
        s += [("recompute_granularity", "full"), ("recompute_method", "uniform"),
              ("recompute_num_layers", plan.memory.recompute_group)]
    elif kind == "full":
        if pipe.vpp > 1:
            raise refuse(TARGET, f"--recompute-method block recomputes {k} layers of every virtual stage, the plan "
                         f"{k} of every pipeline stage", "re-plan with --recompute full or without virtual stages",
                         ({"recompute": "full"}, {"vpp": 1}))
        s += [("recompute_granularity", "full"), ("recompute_method", "block"), ("recompute_num_layers", k)]
    # Megatron sets cpu_offloading itself when the count is positive (training/arguments.py)
    s.append(("cpu_offloading_num_layers", plan.memory.offload_layers or None))
    s += [("micro_batch_size", pipe.micro_batch_size), ("global_batch_size", wl.global_batch)]
    s += [("bf16", wl.dtype in ("bf16", "fp8")), ("fp16", wl.dtype == "fp16"),
          ("fp8_format", "hybrid" if wl.dtype == "fp8" else None)]
    runtime = get_runtime(plan.inputs.runtime)  # what the prediction assumed the framework overlaps
    s += [("overlap_grad_reduce", runtime.overlap_grad_reduce and mesh.dp > 1),
          ("overlap_param_gather", runtime.overlap_param_gather and mesh.dp > 1 and zero >= 1),
          ("tp_comm_overlap", runtime.tp_overlap == "userbuffers" and mesh.tp > 1 and mesh.sp)]
    # priced with bf16 gradients (runtime option bf16-grads): Megatron keeps them fp32 for bf16 unless told
    # (--grad-reduce-in-bf16, megatron/training/arguments.py validate_args)
    s.append(("grad_reduce_in_bf16", runtime.grad_bytes == 2 and wl.dtype in ("bf16", "fp8")))
    return s


def megatron_args(plan: Plan) -> list[str]:
    """`pretrain_gpt.py`'s arguments for the plan: parallel layout, batch, precision, then the model shape."""
    wl = plan.inputs.workload
    return _argv(parallel_settings(plan) + model_settings(plan.inputs.model_spec(), wl.seq_len))


def export_megatron(plan: Plan) -> Exported:
    args = megatron_args(plan)  # its refusals first: the header may price the plan under megatron-core (a simulation)
    header = "\n".join("# " + line for line in header_lines(plan, "Megatron-LM", TARGET))
    note = ("# Add your data, tokenizer, optimizer and checkpoint arguments. Megatron pads the vocabulary to a "
            "multiple of\n# --make-vocab-size-divisible-by x tp; --vocab-size is read with --tokenizer-type "
            "NullTokenizer.")
    command = shell_lines(torchrun_args(plan) + [MEGATRON_SCRIPT] + args)
    text = f"#!/usr/bin/env bash\n{header}\n{note}\nset -euo pipefail\n{command} \\\n    \"$@\"\n"
    return Exported(TARGET, (ExportedFile("megatron.sh", text),))


# ---- import --------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LaunchSpec:
    """A launch configuration read back: the knobs, the workload, the world size when the command names one, and
    the model when the arguments describe it whole (else the caller names one)."""

    config: ParallelConfig
    workload: Workload
    num_gpus: int | None
    gpus_per_node: int | None
    model: ModelSpec | None
    model_fields: tuple[Setting, ...]  # the model-shape arguments as given, to check against a named model
    runtime: str | None = None  # the runtime preset and options the configuration itself implies (torchtitan's)


class _Parser(argparse.ArgumentParser):
    """argparse whose errors are one InputError line, not its usage text and a SystemExit."""

    def error(self, message: str):  # type: ignore[override]
        raise InputError(f"megatron arguments: {message}")


MAX_ARGUMENT = 10**9  # no layer count, width, degree or batch in a launch is larger


def _count(text: str) -> int:
    """A whole number as Megatron's arguments take it: ASCII digits, at most MAX_ARGUMENT (int() would also take
    '٣', '1_000' and 4,000-digit numbers)."""
    if not re.fullmatch(r"[0-9]{1,10}", text) or int(text) > MAX_ARGUMENT:
        shown = text if len(text) <= 24 else text[:20] + "..."
        raise argparse.ArgumentTypeError(f"{shown!r} is not a whole number from 0 to {MAX_ARGUMENT:,}")
    return int(text)


def _real(text: str) -> float:
    """A finite decimal number (RoPE factors, epsilons, dropout)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not math.isfinite(value) or not re.fullmatch(r"[0-9.eE+-]{1,32}", text):
        raise argparse.ArgumentTypeError(f"{text[:24]!r} is not a finite number")
    return value


# degrees and sizes that must be at least 1 when given (Megatron's own defaults apply only when left out)
AT_LEAST_ONE = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                "expert_model_parallel_size", "expert_tensor_parallel_size", "micro_batch_size", "global_batch_size",
                "seq_length", "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                "num_query_groups", "kv_channels", "vocab_size", "num_virtual_stages_per_pipeline_rank",
                "num_layers_per_virtual_pipeline_stage", "recompute_num_layers", "moe_router_topk")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(add_help=False, allow_abbrev=False)
    ints = ["num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
            "seq_length", "max_position_embeddings", "vocab_size", "num_experts", "moe_router_topk",
            "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank",
            "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "mtp_num_layers", "tensor_model_parallel_size",
            "pipeline_model_parallel_size", "num_layers_per_virtual_pipeline_stage",
            "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
            "decoder_last_pipeline_num_layers", "context_parallel_size", "expert_model_parallel_size",
            "expert_tensor_parallel_size", "recompute_num_layers", "micro_batch_size", "global_batch_size",
            "cpu_offloading_num_layers", "rotary_base", "yarn_original_max_position_embeddings",
            "moe_router_num_groups", "moe_router_group_topk"]
    reals = ["rope_scaling_factor", "rotary_scaling_factor", "mscale", "mscale_all_dim", "yarn_beta_fast",
             "yarn_beta_slow", "norm_epsilon", "hidden_dropout", "attention_dropout", "moe_router_topk_scaling_factor"]
    strs = ["normalization", "position_embedding_type", "moe_layer_freq", "pipeline_model_parallel_layout",
            "cp_comm_type", "data_parallel_sharding_strategy", "recompute_granularity", "recompute_method",
            "fp8_format", "rope_type", "moe_router_score_function", "moe_router_load_balancing_type",
            "moe_token_dispatcher_type"]
    switches = ["group_query_attention", "multi_latent_attention", "swiglu", "squared_relu",
                "untie_embeddings_and_output_weights", "disable_bias_linear", "add_qkv_bias", "sequence_parallel",
                "use_tp_pp_dp_mapping", "use_distributed_optimizer", "use_megatron_fsdp", "use_torch_fsdp2", "bf16",
                "fp16", "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split",
                "moe_grouped_gemm", "use_rope_scaling", "moe_router_enable_expert_bias", "grad_reduce_in_bf16"]
    for name in ints:
        p.add_argument(_flag(name), dest=name, type=_count)
    for name in reals:
        p.add_argument(_flag(name), dest=name, type=_real)
    for name in strs:
        p.add_argument(_flag(name), dest=name)
    for name in switches:
        p.add_argument(_flag(name), dest=name, action="store_true")
    p.add_argument("--recompute-modules", dest="recompute_modules", nargs="*")
    return p


def parser_names() -> tuple[frozenset[str], frozenset[str]]:
    """(the switches, every argument) meshplan reads, by Megatron's argument names: what a log's arguments block
    (planner/framework_logs.py) is turned back into flags for."""
    actions = _parser()._actions
    return (frozenset(a.dest for a in actions if a.nargs == 0), frozenset(a.dest for a in actions))


def _torchrun_geometry(tokens: list[str]) -> tuple[list[str], int | None, int | None]:
    """Split an optional `torchrun ... script.py` prefix off: (the script's arguments, nodes, processes per node)."""
    if not tokens or not (tokens[0].endswith("torchrun") or tokens[0].endswith("torch.distributed.run")):
        return tokens, None, None
    script = next((i for i, t in enumerate(tokens) if t.endswith(".py")), None)
    if script is None:
        raise InputError("the torchrun line names no .py script; pass `torchrun ... pretrain_gpt.py ARGS` or the "
                         "script's arguments alone")
    p = _Parser(add_help=False, allow_abbrev=False)
    p.add_argument("--nnodes")
    p.add_argument("--nproc-per-node", "--nproc_per_node", dest="nproc")
    launch, _ = p.parse_known_args(tokens[1:script])
    for flag, value in (("--nnodes", launch.nnodes), ("--nproc-per-node", launch.nproc)):
        if value is not None and not re.fullmatch(r"[0-9]+", value):
            raise InputError(f"torchrun {flag} {value!r}: give a number (an elastic range such as 1:4 does not fix "
                             f"the world size; pass --gpus)")
        if value is not None and (int(value) < 1 or len(value) > 9):  # torch.distributed.run: 0 < nnodes
            raise InputError(f"torchrun {flag} {value}: torchrun takes 1 to 999,999,999; give the real count")
    nodes = int(launch.nnodes) if launch.nnodes else None
    per_node = int(launch.nproc) if launch.nproc else None
    return tokens[script + 1:], nodes, per_node


def _check_supported(a: argparse.Namespace) -> None:
    if a.account_for_embedding_in_pipeline_split or a.account_for_loss_in_pipeline_split:
        raise InputError("--account-for-embedding/loss-in-pipeline-split: meshplan places decoder layers only; "
                         "write the same split with --decoder-first/last-pipeline-num-layers or a layout")
    if a.cp_comm_type not in (None, "p2p", "a2a"):
        raise InputError(f"--cp-comm-type {a.cp_comm_type}: meshplan models p2p (ring) and a2a (Ulysses)")
    if a.recompute_granularity not in (None, "full", "selective"):
        raise InputError(f"--recompute-granularity {a.recompute_granularity}: choose full or selective")
    if a.recompute_method not in (None, "uniform", "block"):
        raise InputError(f"--recompute-method {a.recompute_method}: choose uniform or block")


def _check_recompute_layers(a: argparse.Namespace, stage_layers: tuple[int, ...] | None, layers: int | None) -> None:
    """--recompute-num-layers as Megatron-Core's TransformerConfig takes it (megatron/core/transformer/
    transformer_config.py __post_init__): with full recomputation a method and a count between 1 and the layers per
    pipeline rank; with selective none at all."""
    k = a.recompute_num_layers
    if a.recompute_granularity == "selective" and k is not None:
        raise InputError(f"--recompute-num-layers {k} with --recompute-granularity selective: Megatron-Core refuses "
                         f"it (recompute_num_layers must be None); drop it")
    if a.recompute_granularity != "full":
        if k is not None or a.recompute_method is not None:
            raise InputError("--recompute-num-layers / --recompute-method without --recompute-granularity full: "
                             "Megatron recomputes nothing with them; add --recompute-granularity full or drop them")
        return
    if a.recompute_method is None or k is None:
        raise InputError("--recompute-granularity full needs --recompute-method uniform|block and "
                         "--recompute-num-layers (Megatron-Core refuses it without them)")
    pp = a.pipeline_model_parallel_size or 1
    per_rank = max(stage_layers) if stage_layers else (layers // pp if layers else None)
    if per_rank is not None and k > per_rank:
        raise InputError(f"--recompute-num-layers {k}: Megatron-Core takes 1 to the layers per pipeline rank "
                         f"({per_rank}); give at most {per_rank}")


def _stage_layers(a: argparse.Namespace, num_layers: int | None,
                  mtp: int) -> tuple[tuple[int, ...] | None, int, tuple[int, ...] | None]:
    """(decoder layers per pipeline stage or None for Megatron's even split, virtual stages, decoder layers per
    virtual stage in model order where a layout gives them)."""
    pp = a.pipeline_model_parallel_size or 1
    if a.pipeline_model_parallel_layout:
        if a.decoder_first_pipeline_num_layers or a.decoder_last_pipeline_num_layers:
            raise InputError("--pipeline-model-parallel-layout cannot be combined with --decoder-first/last-"
                             "pipeline-num-layers (Megatron refuses it too)")
        chunks, mtp_in_layout, e_first, l_last = parse_layout(a.pipeline_model_parallel_layout, pp)
        if not (e_first and l_last):
            raise InputError("--pipeline-model-parallel-layout: the embedding must open the first virtual stage and "
                             "the loss close the last (meshplan places them there)")
        if mtp_in_layout != mtp:
            raise InputError(f"--pipeline-model-parallel-layout places {mtp_in_layout} MTP layers; the model has "
                             f"{mtp}")
        vpp = len(chunks) // pp
        per_stage = [sum(chunks[r::pp]) for r in range(pp)]
        empty = [r for r, n in enumerate(per_stage) if n < 1]
        if empty:
            raise InputError(f"--pipeline-model-parallel-layout: pipeline rank {empty[0]} holds no decoder layer; "
                             f"meshplan needs at least one per rank")
        return tuple(per_stage), vpp, tuple(chunks)
    vpp = a.num_virtual_stages_per_pipeline_rank or 1
    first, last = a.decoder_first_pipeline_num_layers, a.decoder_last_pipeline_num_layers
    if a.num_layers_per_virtual_pipeline_stage:
        if first or last or a.num_virtual_stages_per_pipeline_rank:
            raise InputError("--num-layers-per-virtual-pipeline-stage cannot be combined with uneven stages or "
                             "--num-virtual-stages-per-pipeline-rank (Megatron's rule)")
        if num_layers is None or num_layers % pp or (num_layers // pp) % a.num_layers_per_virtual_pipeline_stage:
            raise InputError(f"--num-layers-per-virtual-pipeline-stage {a.num_layers_per_virtual_pipeline_stage} "
                             f"must divide the layers per pipeline stage")
        vpp = num_layers // pp // a.num_layers_per_virtual_pipeline_stage
    if not (first or last):
        return None, vpp, None
    if num_layers is None:
        raise InputError("uneven stages need --num-layers")
    middle_stages = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if middle_stages < 0 or (middle_stages == 0) != (rest == 0) or (middle_stages and rest % middle_stages):
        raise InputError(f"--decoder-first/last-pipeline-num-layers {first}/{last}: the other {rest} layers do not "
                         f"split evenly over {max(middle_stages, 0)} middle stages (Megatron's rule)")
    m = rest // middle_stages if middle_stages else 0
    layers = [m] * pp
    if first is not None:
        layers[0] = first
    if last is not None:
        layers[-1] = last
    return tuple(layers), vpp, None


def _model_from(a: argparse.Namespace, name: str) -> ModelSpec | None:
    """The model the arguments describe, when they describe one whole (Megatron's defaults for what is left out:
    arguments.py sets ffn_hidden_size 4h, or int(8h/3/64)*64 with --swiglu, and kv_channels h / heads)."""
    if a.num_layers is None or a.hidden_size is None or a.num_attention_heads is None or a.vocab_size is None:
        return None
    from meshplan.costmodels.model import (  # the model types, only when the arguments name a whole model
        MLASpec,
        MoESpec,
    )

    h = a.hidden_size
    ffn = a.ffn_hidden_size or (int(4 * h * 2 / 3 / 64) * 64 if a.swiglu else 4 * h)
    moe = None
    if a.num_experts:
        pattern = parse_moe_layer_freq(a.moe_layer_freq or "1", a.num_layers)
        first_k = next((i for i, bit in enumerate(pattern) if bit), a.num_layers)
        freq = _layer_freq(pattern, first_k)
        moe = MoESpec(num_experts=a.num_experts, top_k=a.moe_router_topk or 2,
                      expert_ffn_hidden=a.moe_ffn_hidden_size or ffn,
                      num_shared_experts=1 if a.moe_shared_expert_intermediate_size else 0,
                      shared_ffn_hidden=a.moe_shared_expert_intermediate_size, first_k_dense=first_k, layer_freq=freq,
                      **_router_from(a))
    mla = None
    if a.multi_latent_attention:
        missing = [f for f in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
                   if getattr(a, f) is None]
        if missing:
            raise InputError(f"--multi-latent-attention: give {', '.join(_flag(f) for f in missing)} too")
        mla = MLASpec(q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_head_dim,
                      qk_rope_head_dim=a.qk_pos_emb_head_dim, v_head_dim=a.v_head_dim)
    return ModelSpec(
        name=name, num_layers=a.num_layers, hidden=h, num_heads=a.num_attention_heads,
        num_kv_heads=a.num_query_groups if a.group_query_attention else None, head_dim=a.kv_channels,
        ffn_hidden=ffn, mlp="swiglu" if a.swiglu else "relu2" if a.squared_relu else "gelu", vocab=a.vocab_size,
        tied_embeddings=not a.untie_embeddings_and_output_weights,
        norm="rmsnorm" if (a.normalization or "LayerNorm") == "RMSNorm" else "layernorm",
        qkv_bias=not a.disable_bias_linear or a.add_qkv_bias, linear_bias=not a.disable_bias_linear,
        learned_positions=(a.position_embedding_type or "learned_absolute") == "learned_absolute",
        max_seq_len=a.max_position_embeddings, moe=moe, mla=mla, num_mtp_layers=a.mtp_num_layers or 0,
        rope_theta=None if a.rotary_base is None else float(a.rotary_base), rope_scaling=_rope_from(a),
        norm_eps=a.norm_epsilon, dropout=_dropout_from(a))


def _router_from(a: argparse.Namespace) -> dict[str, Any]:
    """The MoE router fields of the arguments (training_settings' inverse)."""
    if a.moe_router_score_function not in (None, "softmax", "sigmoid"):
        raise InputError(f"--moe-router-score-function {a.moe_router_score_function}: meshplan's model files hold "
                         "softmax or sigmoid")
    balancing = a.moe_router_load_balancing_type
    if balancing not in (None, "aux_loss", "seq_aux_loss", "none"):
        raise InputError(f"--moe-router-load-balancing-type {balancing}: meshplan's model files hold aux_loss, "
                         "seq_aux_loss or none")
    return dict(score_function=a.moe_router_score_function or "softmax", expert_bias=a.moe_router_enable_expert_bias,
                routed_scaling_factor=a.moe_router_topk_scaling_factor, num_groups=a.moe_router_num_groups,
                group_topk=a.moe_router_group_topk, load_balancing=balancing)


def _rope_from(a: argparse.Namespace) -> RopeScaling | None:
    """RoPE scaling as the arguments set it, with megatron-core's fixed values for what no flag reaches."""
    if a.use_rope_scaling:
        return RopeScaling(kind="llama3", factor=a.rope_scaling_factor or 8.0,
                           original_max_position_embeddings=MEGATRON_LLAMA3_ORIGINAL,
                           low_freq_factor=MEGATRON_LLAMA3_BANDS["low_freq_factor"],
                           high_freq_factor=MEGATRON_LLAMA3_BANDS["high_freq_factor"])
    mla_yarn = a.multi_latent_attention and a.rope_type in (None, "yarn") and a.rotary_scaling_factor is not None
    if not (mla_yarn or a.position_embedding_type == "yarn"):
        return None
    if a.multi_latent_attention:
        original, fast, slow = MLA_YARN_ORIGINAL, MLA_YARN_DEFAULTS["beta_fast"], MLA_YARN_DEFAULTS["beta_slow"]
    else:  # megatron-core's YarnRotaryEmbedding defaults for what is left out
        original = a.yarn_original_max_position_embeddings or MLA_YARN_ORIGINAL
        fast, slow = a.yarn_beta_fast or 32.0, a.yarn_beta_slow or 1.0
    return RopeScaling(kind="yarn", factor=a.rotary_scaling_factor or 1.0, original_max_position_embeddings=original,
                       beta_fast=fast, beta_slow=slow, mscale=a.mscale, mscale_all_dim=a.mscale_all_dim)


def _dropout_from(a: argparse.Namespace) -> float | None:
    if a.hidden_dropout is None and a.attention_dropout is None:
        return None
    if a.hidden_dropout != a.attention_dropout:
        raise InputError(f"--hidden-dropout {a.hidden_dropout} and --attention-dropout {a.attention_dropout}: "
                         "meshplan's model files hold one dropout probability; give both the same")
    return a.hidden_dropout


def _layer_freq(pattern: list[int], first_k: int) -> int:
    """The meshplan MoE rule (i >= first_k and i % freq == 0) that gives `pattern`, or an InputError."""
    for freq in range(1, len(pattern) + 1):
        if pattern == [int(i >= first_k and i % freq == 0) for i in range(len(pattern))]:
            return freq
    raise InputError("--moe-layer-freq: meshplan models MoE layers as every k-th layer after the first dense ones; "
                     "this pattern is not of that form")


def parse_megatron_args(args: str | list[str], model_name: str = "megatron-import",
                        num_layers: int | None = None) -> LaunchSpec:
    """Read `pretrain_gpt.py` arguments (optionally after `torchrun ... script.py`); other arguments (data,
    optimizer, logging) are ignored. `num_layers`: the named model's, when the arguments omit --num-layers (uneven
    stages and block recomputation need it). InputError names anything meshplan cannot represent."""
    if isinstance(args, str):
        text = re.sub(r"\\\s*(\n|$)", " ", args)  # shell line continuations, a trailing one too
        try:
            tokens = shlex.split(text, comments=True)
        except ValueError as exc:
            raise InputError(f"cannot split the arguments as a shell would ({exc}); check the quotes") from None
    else:
        tokens = list(args)
    tokens = [t for t in tokens if t not in ("\\", "$@")]
    start = next((i for i, t in enumerate(tokens) if t.endswith("torchrun") or t.endswith(".py")), 0)
    tokens = tokens[start:] if tokens[start:start + 1] and tokens[start].endswith("torchrun") else tokens
    tokens, nodes, per_node = _torchrun_geometry(tokens)
    a, _unknown = _parser().parse_known_args(tokens)
    for name in AT_LEAST_ONE:
        if getattr(a, name) == 0:
            raise InputError(f"{_flag(name)} 0: give at least 1 (or leave it out for Megatron's default)")
    _check_supported(a)
    if a.seq_length is None or a.global_batch_size is None:
        raise InputError("the arguments need --seq-length and --global-batch-size (the workload)")
    if a.fp16 and a.bf16:
        raise InputError("--fp16 and --bf16 together: choose one")
    dtype: TrainDtype = "fp8" if a.fp8_format else "fp16" if a.fp16 else "bf16"
    workload = Workload(global_batch=a.global_batch_size, seq_len=a.seq_length, dtype=dtype)
    model = _model_from(a, model_name)
    layers = a.num_layers if a.num_layers is not None else num_layers
    stage_layers, vpp, chunk_layers = _stage_layers(a, layers, a.mtp_num_layers or 0)
    zero: ZeroStage = 0
    if a.use_distributed_optimizer:
        zero = 1
    if a.use_megatron_fsdp:
        strategies: dict[str, ZeroStage] = {v: k for k, v in FSDP_STRATEGY.items()} | {"no_shard": 0}
        if a.data_parallel_sharding_strategy not in strategies:
            raise InputError(f"--data-parallel-sharding-strategy {a.data_parallel_sharding_strategy}: choose "
                             f"{', '.join(strategies)}")
        zero = strategies[a.data_parallel_sharding_strategy]
    if a.use_torch_fsdp2:
        zero = 3
    recompute: Recompute = "none"
    stage_recompute = None
    group = 1
    modules = tuple(a.recompute_modules) if a.recompute_modules else DEFAULT_RECOMPUTE_MODULES
    unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
    if unknown:
        raise InputError(f"--recompute-modules {' '.join(unknown)}: choose from {', '.join(RECOMPUTE_MODULES)}")
    _check_recompute_layers(a, stage_layers, layers)
    if a.recompute_granularity == "selective":
        recompute = "selective"
    elif a.recompute_granularity == "full":
        if a.recompute_method == "block":
            if stage_layers is None:
                pp = a.pipeline_model_parallel_size or 1
                if layers is None or layers % pp:
                    raise InputError("--recompute-method block needs --num-layers divisible by the pipeline size")
                stage_layers = (layers // pp,) * pp
            k = a.recompute_num_layers or 1
            stage_recompute = tuple(StagePolicy(granularity="full", full_layers=min(k, n)) for n in stage_layers)
        else:  # uniform: every layer, in groups of --recompute-num-layers (Megatron's default method needs it set)
            recompute = "full"
            group = a.recompute_num_layers or 1
    tp = a.tensor_model_parallel_size or 1
    config = ParallelConfig(
        tp=tp, pp=a.pipeline_model_parallel_size or 1, vpp=vpp, cp=a.context_parallel_size or 1,
        cp_comm="a2a" if a.cp_comm_type == "a2a" else "ring", ep=a.expert_model_parallel_size or 1,
        etp=a.expert_tensor_parallel_size, mbs=a.micro_batch_size or 1, zero=zero, recompute=recompute,
        sp=a.sequence_parallel and tp > 1, stage_layers=stage_layers, stage_recompute=stage_recompute,
        chunk_layers=chunk_layers, rank_order=PP_INSIDE_DP if a.use_tp_pp_dp_mapping else "tp-cp-dp-pp",
        recompute_modules=modules, offload_layers=a.cpu_offloading_num_layers or 0, recompute_group=group)
    num_gpus = (nodes or 1) * per_node if per_node else None
    given = tuple((k, v) for k, v in vars(a).items() if v not in (None, False))
    return LaunchSpec(config=config, workload=workload, num_gpus=num_gpus, gpus_per_node=per_node, model=model,
                      model_fields=given, runtime="megatron-core+bf16-grads" if a.grad_reduce_in_bf16 else None)


# exported with the model but the launch's to choose: a launch that differs is not another model
NOT_THE_MODEL = ("seq_length", "max_position_embeddings", "moe_token_dispatcher_type", "hidden_dropout",
                 "attention_dropout")


def model_disagreement(launch: LaunchSpec, model: ModelSpec) -> str | None:
    """The first model-shape argument in `launch` that `model` contradicts, as a sentence; None when they agree."""
    expected = dict(model_settings(model, launch.workload.seq_len))
    for name, value in launch.model_fields:
        if name not in expected or name in NOT_THE_MODEL:
            continue
        want = expected[name]
        if name == "moe_layer_freq":
            if parse_moe_layer_freq(str(value), model.num_layers) != parse_moe_layer_freq(str(want), model.num_layers):
                return f"{_flag(name)} {value} does not give {model.name}'s MoE layers ({want})"
        elif isinstance(value, float) and want is not None and not isinstance(want, bool):
            if value != float(str(want)):
                return f"{_flag(name)} {value:g} but {model.name} has {want}"
        elif str(value) != str(want) and not (want in (None, False) and value in (None, False)):
            shown = "absent" if want in (None, False) else want
            return f"{_flag(name)} {value} but {model.name} has {shown}"
    return None
