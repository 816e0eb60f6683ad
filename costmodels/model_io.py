"""Load a ModelSpec from a zoo name, a Hugging Face config.json, or a meshplan model file (JSON or TOML).

Every failure is an InputError with a one-line message that names the source, what is wrong and how
to fix it; no pydantic ValidationError, KeyError or TypeError escapes. The model-file format and the
Hugging Face mapping are documented in docs/models.md.
"""

from __future__ import annotations

import json
import os
import re
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any
from collections.abc import Callable

from pydantic import ValidationError

from meshplan.costmodels.model import MAX_LAYERS, ModelSpec
from meshplan.hardware_db.documents import read_document, read_text
from meshplan.hardware_db.errors import InputError, did_you_mean

__all__ = [
    "HF_MODEL_TYPES",
    "MODEL_FILE_KEYS",
    "MOE_KEYS",
    "MLA_KEYS",
    "from_hf_config",
    "parse_model_file",
    "load_model_file",
    "to_model_file",
    "list_zoo",
    "load_zoo",
    "zoo_source",
    "load_model",
]

DOCS = "docs/models.md"

# ---- meshplan model file: documented key -> ModelSpec field ------------------------------------
MODEL_FILE_KEYS: dict[str, str] = {
    "name": "name",
    "layers": "num_layers",
    "hidden": "hidden",
    "heads": "num_heads",
    "kv_heads": "num_kv_heads",
    "head_dim": "head_dim",
    "ffn_hidden": "ffn_hidden",
    "mlp": "mlp",
    "vocab": "vocab",
    "tied_embeddings": "tied_embeddings",
    "norm": "norm",
    "qkv_bias": "qkv_bias",
    "linear_bias": "linear_bias",
    "learned_positions": "learned_positions",
    "max_seq_len": "max_seq_len",
    "mtp_layers": "num_mtp_layers",
    "rope_theta": "rope_theta",
    "norm_eps": "norm_eps",
    "dropout": "dropout",
    "weight_dtype": "weight_dtype",
    "weight_block_scaled": "weight_block_scaled",
}
MOE_KEYS: dict[str, str] = {
    "experts": "num_experts",
    "top_k": "top_k",
    "expert_ffn_hidden": "expert_ffn_hidden",
    "shared_experts": "num_shared_experts",
    "shared_ffn_hidden": "shared_ffn_hidden",
    "first_k_dense": "first_k_dense",
    "layer_freq": "layer_freq",
    "score_function": "score_function",
    "expert_bias": "expert_bias",
    "routed_scaling_factor": "routed_scaling_factor",
    "num_groups": "num_groups",
    "group_topk": "group_topk",
    "load_balancing": "load_balancing",
}
MLA_KEYS: dict[str, str] = {
    k: k for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
}
ROPE_SCALING_KEYS: dict[str, str] = {
    k: k for k in ("kind", "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor",
                   "beta_fast", "beta_slow", "mscale", "mscale_all_dim")
}
# top-level keys that are documentation only and never reach ModelSpec
_DOC_KEYS = ("source",)
_BLOCKS = (("moe", MOE_KEYS), ("mla", MLA_KEYS), ("rope_scaling", ROPE_SCALING_KEYS))
_ALL_TOP_KEYS = (*MODEL_FILE_KEYS, *(b for b, _ in _BLOCKS), *_DOC_KEYS)

# ModelSpec error location -> the key the user wrote, for model files
_FILE_LOC_NAMES: dict[str, str] = {v: k for k, v in MODEL_FILE_KEYS.items()}
_FILE_LOC_NAMES |= {f"moe.{v}": f"moe.{k}" for k, v in MOE_KEYS.items()}
_FILE_LOC_NAMES |= {f"mla.{v}": f"mla.{k}" for k, v in MLA_KEYS.items()}
_FILE_LOC_NAMES |= {f"rope_scaling.{v}": f"rope_scaling.{k}" for k, v in ROPE_SCALING_KEYS.items()}


# ---- small helpers ----------------------------------------------------------------------------
def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _fail(origin: str, msg: str) -> InputError:
    return InputError(_one_line(f"{origin}: {msg}"))


def _validate(fields: dict[str, Any], origin: str, loc_names: dict[str, str]) -> ModelSpec:
    """Build the ModelSpec; a ValidationError becomes one InputError naming the user's key."""
    try:
        return ModelSpec.model_validate(fields)
    except ValidationError as exc:
        err = exc.errors()[0]
        msg = str(err["msg"]).removeprefix("Value error, ")
        loc = ".".join(str(p) for p in err["loc"])
        if err["type"] == "value_error":  # a ModelSpec check: it names ModelSpec fields; say the user's keys
            for field in sorted(loc_names, key=len, reverse=True):
                msg = re.sub(rf"(?<![\w.]){re.escape(field)}(?![\w.])", loc_names[field], msg)
        elif loc:
            msg = f"'{loc_names.get(loc, loc)}': {msg}"
            got = err.get("input")
            if isinstance(got, (bool, int, float, str)):  # the value, where a type was wrong (true, "4096")
                shown = repr(got)
                msg += f", got {shown if len(shown) <= 40 else shown[:36] + '...'}"
        raise _fail(origin, msg) from None


def _as_int(value: Any, key: str, origin: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
        isinstance(value, float) and not value.is_integer()
    ):
        raise _fail(origin, f"'{key}' must be an integer, got {value!r}")
    return int(value)


class _HF:
    """Typed access to one Hugging Face config dict, with errors that name the field and model_type."""

    def __init__(self, config: dict[str, Any], model_type: str, origin: str) -> None:
        self.c, self.mt, self.origin = config, model_type, origin

    def req(self, key: str, *, nullable: bool = False) -> Any:
        if key not in self.c or (self.c[key] is None and not nullable):
            raise _fail(
                self.origin,
                f"model_type '{self.mt}' config is missing required field '{key}'; "
                f"add it (copy the model's config.json from the Hugging Face Hub)",
            )
        return self.c[key]

    def req_int(self, key: str) -> int:
        return _as_int(self.req(key), key, self.origin)

    def opt(self, key: str, default: Any = None) -> Any:
        value = self.c.get(key)
        return default if value is None else value

    def opt_int(self, key: str, default: int | None = None) -> int | None:
        value = self.c.get(key)
        return default if value is None else _as_int(value, key, self.origin)

    def opt_bool(self, key: str, default: bool) -> bool:
        value = self.c.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise _fail(self.origin, f"'{key}' must be true or false, got {value!r}")
        return value


def _moe_layout(sparse: list[int], num_layers: int, origin: str, why: str) -> tuple[int, int] | None:
    """(first_k_dense, layer_freq) reproducing exactly this set of MoE layer indices; None if no MoE layer."""
    if not sparse:
        return None
    first = sparse[0]
    if len(sparse) > 1:  # an arithmetic progression: its step is the only candidate
        candidates = [sparse[1] - first]
    else:  # one MoE layer: layer_freq must divide its index (any freq >= num_layers when it is 0)
        candidates = [num_layers] if first == 0 else [f for f in range(1, first + 1) if first % f == 0]
    for freq in candidates:
        if first % freq == 0 and list(range(first, num_layers, freq)) == sparse:
            return first, freq
    shown = sparse if len(sparse) <= 8 else [*sparse[:8], "..."]
    raise _fail(
        origin,
        f"MoE layers {shown} ({why}) are not 'every layer_freq-th layer from first_k_dense on', the only layout "
        f"meshplan models; write a meshplan model file with the nearest layout (see {DOCS})",
    )


# ---- Hugging Face config.json -------------------------------------------------------------------
# Each mapper returns the ModelSpec fields and a map from ModelSpec error location to the HF key.
_Mapped = tuple[dict[str, Any], dict[str, str]]

_BASE_LOCS = {
    "num_layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads",
    "head_dim": "head_dim",
    "ffn_hidden": "intermediate_size",
    "vocab": "vocab_size",
    "max_seq_len": "max_position_embeddings",
    "tied_embeddings": "tie_word_embeddings",
}


def _common(hf: _HF, *, head_dim_default: int | None = None, tie_default: bool = False) -> dict[str, Any]:
    """Fields shared by the Llama-style decoders (RMSNorm, RoPE, gated-SiLU MLP)."""
    return {
        "num_layers": hf.req("num_hidden_layers"),
        "hidden": hf.req("hidden_size"),
        "num_heads": hf.req("num_attention_heads"),
        "num_kv_heads": hf.opt("num_key_value_heads"),
        "head_dim": hf.opt("head_dim", head_dim_default),
        "vocab": hf.req("vocab_size"),
        "max_seq_len": hf.opt("max_position_embeddings"),
        "tied_embeddings": hf.opt_bool("tie_word_embeddings", tie_default),
        "mlp": "swiglu",
        "norm": "rmsnorm",
    } | _training_fields(hf)


def _training_fields(hf: _HF) -> dict[str, Any]:
    """rope_theta, rms_norm_eps, attention_dropout and a llama3 or yarn rope_scaling block, as stated (the launch
    exports carry them); other rope_scaling kinds are not kept (docs/models.md)."""
    fields: dict[str, Any] = {"rope_theta": hf.opt("rope_theta"), "norm_eps": hf.opt("rms_norm_eps"),
                              "dropout": hf.opt("attention_dropout"), "weight_dtype": _published_dtype(hf),
                              "weight_block_scaled": _block_scaled(hf)}
    scaling = hf.opt("rope_scaling")
    if isinstance(scaling, dict):
        kind = scaling.get("rope_type") or scaling.get("type")
        keys = ("factor", "original_max_position_embeddings") + (
            ("low_freq_factor", "high_freq_factor") if kind == "llama3" else
            ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"))
        if kind in ("llama3", "yarn"):
            fields["rope_scaling"] = {"kind": kind} | {k: scaling[k] for k in keys if scaling.get(k) is not None}
    return fields


def _published_dtype(hf: _HF) -> str | None:
    """The checkpoint's weights: fp8 under a quantization_config of quant_method "fp8" (DeepSeek-V3's block-scaled
    e4m3), fp4 under ModelOpt's NVFP4 (quant_algo "NVFP4"), else bf16 when torch_dtype (or dtype) says bfloat16."""
    quant = hf.opt("quantization_config")
    if isinstance(quant, dict):
        if quant.get("quant_method") == "fp8":
            return "fp8"
        if str(quant.get("quant_algo", "")).upper() == "NVFP4":
            return "fp4"
    return "bf16" if (hf.opt("torch_dtype") or hf.opt("dtype")) == "bfloat16" else None


def _block_scaled(hf: _HF) -> bool:
    """FP8 weights scaled per block: quant_method "fp8" with a weight_block_size (DeepSeek-V3's [128, 128])."""
    quant = hf.opt("quantization_config")
    return isinstance(quant, dict) and quant.get("quant_method") == "fp8" and bool(quant.get("weight_block_size"))


def _llama(hf: _HF) -> _Mapped:
    # HF LlamaConfig: attention_bias puts biases on q/k/v/o, mlp_bias on the MLP; o-proj bias is dropped here.
    f = _common(hf) | {"ffn_hidden": hf.req("intermediate_size")}
    f["qkv_bias"] = hf.opt_bool("attention_bias", False)
    f["linear_bias"] = hf.opt_bool("mlp_bias", False)
    return f, _BASE_LOCS


def _mistral(hf: _HF) -> _Mapped:
    return _common(hf) | {"ffn_hidden": hf.req("intermediate_size")}, _BASE_LOCS


def _qwen2(hf: _HF) -> _Mapped:
    # Qwen2Attention always has q/k/v biases (no o-proj bias); small Qwen2 checkpoints set tie_word_embeddings.
    return _common(hf) | {"ffn_hidden": hf.req("intermediate_size"), "qkv_bias": True}, _BASE_LOCS


def _qwen3(hf: _HF) -> _Mapped:
    # Qwen3Config: head_dim defaults to 128, attention_bias to false.
    # Its q/k RMSNorms (2*head_dim per layer) are not modelled.
    f = _common(hf, head_dim_default=128) | {"ffn_hidden": hf.req("intermediate_size")}
    f["qkv_bias"] = hf.opt_bool("attention_bias", False)
    return f, _BASE_LOCS


def _gpt2(hf: _HF) -> _Mapped:
    hidden = hf.req_int("n_embd")
    f = {
        "num_layers": hf.req("n_layer"),
        "hidden": hidden,
        "num_heads": hf.req("n_head"),
        "ffn_hidden": hf.opt_int("n_inner", 4 * hidden),
        "vocab": hf.req("vocab_size"),
        "max_seq_len": hf.req("n_positions"),
        "tied_embeddings": hf.opt_bool("tie_word_embeddings", True),
        "mlp": "gelu",
        "norm": "layernorm",
        "qkv_bias": True,
        "linear_bias": True,
        "learned_positions": True,
    }
    locs = {"num_layers": "n_layer", "hidden": "n_embd", "num_heads": "n_head", "ffn_hidden": "n_inner",
            "vocab": "vocab_size", "max_seq_len": "n_positions", "tied_embeddings": "tie_word_embeddings"}
    return f, locs


def _gpt_neox(hf: _HF) -> _Mapped:
    # GPTNeoX: fused qkv and out-proj biases follow attention_bias (default true); MLP linears always have biases.
    f = {
        "num_layers": hf.req("num_hidden_layers"),
        "hidden": hf.req("hidden_size"),
        "num_heads": hf.req("num_attention_heads"),
        "ffn_hidden": hf.req("intermediate_size"),
        "vocab": hf.req("vocab_size"),
        "max_seq_len": hf.opt("max_position_embeddings"),
        "tied_embeddings": hf.opt_bool("tie_word_embeddings", False),
        "mlp": "gelu",
        "norm": "layernorm",
        "qkv_bias": hf.opt_bool("attention_bias", True),
        "linear_bias": True,
    }
    return f, _BASE_LOCS


def _mixtral(hf: _HF) -> _Mapped:
    expert = hf.req("intermediate_size")  # Mixtral's intermediate_size is one expert's size; every layer is MoE
    f = _common(hf) | {"ffn_hidden": expert}
    f["moe"] = {
        "num_experts": hf.req("num_local_experts"),
        "top_k": hf.req("num_experts_per_tok"),
        "expert_ffn_hidden": expert,
    }
    locs = _BASE_LOCS | {"moe.num_experts": "num_local_experts", "moe.top_k": "num_experts_per_tok",
                         "moe.expert_ffn_hidden": "intermediate_size"}
    return f, locs


def _qwen_moe_layers(hf: _HF, num_layers: int) -> tuple[int, int] | None:
    """Qwen2/3-MoE rule: layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    step = hf.opt_int("decoder_sparse_step", 1)
    if step is None or step < 1:
        raise _fail(hf.origin, f"'decoder_sparse_step' must be at least 1, got {step}")
    dense = hf.opt("mlp_only_layers", [])
    if not isinstance(dense, list):
        raise _fail(hf.origin, f"'mlp_only_layers' must be a list of layer indices, got {dense!r}")
    dense_set = {_as_int(i, "mlp_only_layers", hf.origin) for i in dense}
    bad = sorted(i for i in dense_set if not 0 <= i < num_layers)
    if bad:
        raise _fail(hf.origin, f"'mlp_only_layers' has indices {bad} outside 0..{num_layers - 1}; remove them")
    sparse = [i for i in range(num_layers) if i not in dense_set and (i + 1) % step == 0]
    return _moe_layout(sparse, num_layers, hf.origin, "from decoder_sparse_step and mlp_only_layers")


def _qwen_moe(hf: _HF, *, shared: bool) -> _Mapped:
    # Qwen2-MoE has q/k/v biases and one gated shared expert; Qwen3-MoE has neither (its q/k norms are not modelled).
    f = _common(hf, head_dim_default=None) | {"ffn_hidden": hf.req("intermediate_size")}
    f["qkv_bias"] = True if shared else hf.opt_bool("attention_bias", False)
    locs = _BASE_LOCS | {"moe.num_experts": "num_experts", "moe.top_k": "num_experts_per_tok",
                         "moe.expert_ffn_hidden": "moe_intermediate_size",
                         "moe.shared_ffn_hidden": "shared_expert_intermediate_size"}
    experts = hf.req_int("num_experts")
    if experts == 0:  # HF: no sparse block at all
        return f, locs
    layers = hf.req_int("num_hidden_layers")
    if not 1 <= layers <= MAX_LAYERS:  # checked before the per-layer rule runs over them
        raise _fail(hf.origin, f"'num_hidden_layers' must be between 1 and {MAX_LAYERS}, got {layers}")
    layout = _qwen_moe_layers(hf, layers)
    if layout is None:
        return f, locs
    moe: dict[str, Any] = {
        "num_experts": experts,
        "top_k": hf.req("num_experts_per_tok"),
        "expert_ffn_hidden": hf.req("moe_intermediate_size"),
        "first_k_dense": layout[0],
        "layer_freq": layout[1],
    }
    if shared:
        size = hf.req("shared_expert_intermediate_size")
        if size:
            moe |= {"num_shared_experts": 1, "shared_ffn_hidden": size}
    f["moe"] = moe
    return f, locs


def _deepseek(hf: _HF) -> _Mapped:
    f = _common(hf) | {"ffn_hidden": hf.req("intermediate_size")}
    f["mla"] = {
        "q_lora_rank": hf.req("q_lora_rank", nullable=True),  # null: queries not compressed (V2-Lite)
        "kv_lora_rank": hf.req("kv_lora_rank"),
        "qk_nope_head_dim": hf.req("qk_nope_head_dim"),
        "qk_rope_head_dim": hf.req("qk_rope_head_dim"),
        "v_head_dim": hf.req("v_head_dim"),
    }
    f["head_dim"] = None  # MLA head sizes live in the mla block
    f["num_mtp_layers"] = hf.opt("num_nextn_predict_layers", 0)
    if hf.req("n_routed_experts", nullable=True) is not None:  # HF: null routed experts means a dense model
        f["moe"] = {
            "num_experts": hf.req("n_routed_experts"),
            "top_k": hf.req("num_experts_per_tok"),
            "expert_ffn_hidden": hf.req("moe_intermediate_size"),
            "num_shared_experts": hf.opt("n_shared_experts", 0),  # DeepSeek's shared MLP = n_shared experts' width
            "first_k_dense": hf.opt("first_k_dense_replace", 0),
            "layer_freq": hf.opt("moe_layer_freq", 1),
            # DeepSeek-V3's router (its modeling code's MoEGate): sigmoid scores, "noaux_tc" top-k with a
            # per-expert correction bias, routed_scaling_factor, n_group/topk_group; seq_aux: a per-sequence loss
            "score_function": hf.opt("scoring_func", "softmax"),
            "expert_bias": hf.opt("topk_method") == "noaux_tc",
            "routed_scaling_factor": hf.opt("routed_scaling_factor"),
            "num_groups": hf.opt("n_group") if hf.opt("topk_group") else None,
            "group_topk": hf.opt("topk_group") if hf.opt("n_group") else None,
            "load_balancing": "seq_aux_loss" if hf.opt("seq_aux") else None,
        }
    locs = _BASE_LOCS | {f"mla.{k}": k for k in MLA_KEYS} | {
        "num_mtp_layers": "num_nextn_predict_layers", "moe.num_experts": "n_routed_experts",
        "moe.top_k": "num_experts_per_tok", "moe.expert_ffn_hidden": "moe_intermediate_size",
        "moe.num_shared_experts": "n_shared_experts", "moe.first_k_dense": "first_k_dense_replace",
        "moe.layer_freq": "moe_layer_freq",
    }
    return f, locs


_HF_MAPPERS: dict[str, Callable[[_HF], _Mapped]] = {
    "llama": _llama,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "gpt2": _gpt2,
    "gpt_neox": _gpt_neox,
    "mixtral": _mixtral,
    "qwen2_moe": lambda hf: _qwen_moe(hf, shared=True),
    "qwen3_moe": lambda hf: _qwen_moe(hf, shared=False),
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
}
HF_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_HF_MAPPERS))


def from_hf_config(config: dict, name: str, origin: str | None = None) -> ModelSpec:
    """A ModelSpec from a parsed Hugging Face config.json; `origin` (default: the name) prefixes errors."""
    origin = origin or f"Hugging Face config '{name}'"
    if not isinstance(config, dict):
        raise _fail(origin, f"a Hugging Face config must be a JSON object, got {type(config).__name__}")
    model_type = config.get("model_type")
    if not model_type:
        raise _fail(origin, "missing 'model_type'; a Hugging Face config.json names its architecture there")
    mapper = _HF_MAPPERS.get(model_type) if isinstance(model_type, str) else None
    if mapper is None:
        raise _fail(
            origin,
            f"unsupported model_type '{model_type}'; supported: {', '.join(HF_MODEL_TYPES)}; "
            f"or write a meshplan model file (see {DOCS})",
        )
    fields, locs = mapper(_HF(config, model_type, origin))
    fields = {k: v for k, v in fields.items() if v is not None}
    return _validate({"name": name, **fields}, origin, locs)


# ---- meshplan model file -----------------------------------------------------------------------
def _block(data: Any, block: str, keys: dict[str, str], origin: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise _fail(origin, f"'{block}' must be a table/object with keys {', '.join(keys)}, got {data!r}")
    unknown = [k for k in data if k not in keys]
    if unknown:
        raise _fail(
            origin,
            f"unknown key(s) {', '.join(repr(k) for k in unknown)} in [{block}]; allowed keys: {', '.join(keys)}",
        )
    return {keys[k]: v for k, v in data.items() if v is not None}


def parse_model_file(data: Any, origin: str, default_name: str | None = None) -> ModelSpec:
    """Validate an already-parsed meshplan model document (see docs/models.md)."""
    if not isinstance(data, dict):
        raise _fail(origin, f"a model file must be a JSON object or TOML table, got {type(data).__name__}")
    unknown = [k for k in data if k not in _ALL_TOP_KEYS]
    if unknown:
        hint = " (a Hugging Face config.json also needs 'model_type')" if "hidden_size" in data else ""
        raise _fail(
            origin,
            f"unknown key(s) {', '.join(repr(k) for k in unknown)}; allowed keys: {', '.join(_ALL_TOP_KEYS)}{hint}",
        )
    source = data.get("source")
    if source is not None and not isinstance(source, str):
        raise _fail(origin, f"'source' must be a string saying where the shape comes from, got {source!r}")
    fields = {MODEL_FILE_KEYS[k]: v for k, v in data.items() if k in MODEL_FILE_KEYS and v is not None}
    if "name" not in fields:
        if default_name is None:
            raise _fail(origin, "missing 'name'; add a 'name' key naming the model")
        fields["name"] = default_name
    for block, keys in _BLOCKS:
        if data.get(block) is not None:
            fields[block] = _block(data[block], block, keys, origin)
    return _validate(fields, origin, _FILE_LOC_NAMES)


def to_model_file(spec: ModelSpec, source: str | None = None) -> dict[str, Any]:
    """The meshplan model-file document for a ModelSpec (defaults omitted); parse_model_file inverts it."""
    dumped = spec.model_dump(exclude_defaults=True)
    out: dict[str, Any] = {"name": spec.name}
    if source is not None:
        out["source"] = source
    for key, field in MODEL_FILE_KEYS.items():
        if field in dumped and key != "name":
            out[key] = dumped[field]
    for block, keys in _BLOCKS:
        sub = getattr(spec, block)
        if sub is not None:
            d = sub.model_dump(exclude_defaults=True)
            out[block] = {k: d[f] for k, f in keys.items() if f in d}
    return out


def _read_document(path: Path) -> tuple[Any, str]:
    """Parse a .json or .toml file; returns (document, origin)."""
    return read_document(path, "a model file")


def _name_from_path(path: Path) -> str:
    """'.../Llama-3.1-8B/config.json' -> 'Llama-3.1-8B'; 'llama3.1-8b.config.json' -> 'llama3.1-8b'."""
    stem = path.stem
    if stem == "config" and path.resolve().parent.name:
        return path.resolve().parent.name
    return stem.removesuffix(".config") or stem


def load_model_file(path: str | Path) -> ModelSpec:
    """A .json or .toml file: a Hugging Face config if it has a top-level model_type, else a meshplan model file."""
    path = Path(path)
    doc, origin = _read_document(path)
    if isinstance(doc, dict) and "model_type" in doc:
        return from_hf_config(doc, _name_from_path(path), origin=origin)
    return parse_model_file(doc, origin, default_name=_name_from_path(path))


# ---- zoo ---------------------------------------------------------------------------------------
def _zoo_dir():
    return resources.files("meshplan.costmodels.zoo")


def list_zoo() -> list[str]:
    """Names of the built-in models."""
    return sorted(p.name[: -len(".json")] for p in _zoo_dir().iterdir() if p.name.endswith(".json"))


@cache
def _zoo_document(key: str) -> dict[str, Any]:
    if key not in list_zoo():
        raise InputError(
            f"unknown model '{key}';{did_you_mean(key, list_zoo())} zoo models: {', '.join(list_zoo())}; "
            f"or pass a Hugging Face config.json or a meshplan model file (.json/.toml, see {DOCS})"
        )
    origin = f"costmodels/zoo/{key}.json"
    try:
        doc = json.loads((_zoo_dir() / f"{key}.json").read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise _fail(origin, f"not valid JSON ({exc})") from None
    return doc


@cache
def _load_zoo_key(key: str) -> ModelSpec:
    return parse_model_file(_zoo_document(key), f"costmodels/zoo/{key}.json", default_name=key)


def load_zoo(name: str) -> ModelSpec:
    """A built-in model by name (case-insensitive), e.g. 'llama3.1-70b'."""
    return _load_zoo_key(str(name).strip().lower())


def zoo_source(name: str) -> str:
    """Where a built-in model's shape comes from (its file's 'source')."""
    return str(_zoo_document(str(name).strip().lower()).get("source", ""))


# ---- one entry point ---------------------------------------------------------------------------
def load_model(name_or_path: str) -> ModelSpec:
    """A zoo name, a .json/.toml file (HF config.json if it has model_type, else a meshplan model file),
    or a directory holding a Hugging Face config.json. An existing .json/.toml file or a directory with a
    config.json wins over a zoo name of the same spelling."""
    text = str(name_or_path).strip()
    path = Path(text).expanduser()
    is_model_file = path.suffix.lower() in (".json", ".toml")
    if path.is_file() and is_model_file:
        return load_model_file(path)
    if path.is_dir() and (path / "config.json").is_file():
        return load_model_file(path / "config.json")
    key = text.lower()
    if key in list_zoo():
        return _load_zoo_key(key)
    if path.is_dir():
        raise _fail(text, "is a directory without a config.json; pass a zoo name or a .json/.toml model file")
    if path.is_file():
        raise _fail(text, "a model file must end in .json or .toml")
    if HF_REPO_ID.fullmatch(text) and not is_model_file:
        return _from_hf_cache(text)
    if is_model_file or "/" in text or "\\" in text:
        raise _fail(text, "no such file; check the path, or pass a zoo name instead")
    return load_zoo(key)  # raises the unknown-model error listing the zoo


# a Hugging Face Hub model id: owner/name (huggingface_hub's repo id rules: letters, digits, - _ .)
HF_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*")


def hf_hub_cache() -> Path:
    """The local Hugging Face Hub cache, as huggingface_hub resolves it (its docs, "Manage huggingface_hub cache-
    system"): $HF_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub."""
    env = os.environ
    try:
        if env.get("HF_HUB_CACHE"):
            return Path(env["HF_HUB_CACHE"]).expanduser()
        if env.get("HF_HOME"):
            return Path(env["HF_HOME"]).expanduser() / "hub"
        return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "huggingface" / "hub"
    except RuntimeError:  # pathlib: a ~user that does not exist, or no home directory at all
        raise InputError("the Hugging Face cache's folder names a home directory that does not exist; set "
                         "HF_HUB_CACHE to an existing folder, or pass the config.json's path") from None


def _revision(ref: Path) -> str:
    """The snapshot a cache's refs/main names (huggingface_hub writes a commit hash there): one folder name."""
    text = read_text(ref, "a Hugging Face cache ref").strip()
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,99}", text):
        raise _fail(str(ref), "does not name a snapshot (a commit hash); the Hugging Face cache is damaged: "
                              "download the config.json again, or pass the file's path")
    return text


def _from_hf_cache(repo_id: str) -> ModelSpec:
    """A Hub id's config.json from the local cache (models--owner--name/snapshots/REV/config.json, the revision
    refs/main names, else the newest snapshot holding one); the model is named after the repository."""
    folder = hf_hub_cache() / ("models--" + repo_id.replace("/", "--"))
    snapshots = folder / "snapshots"
    main = folder / "refs" / "main"
    candidates = [snapshots / _revision(main) / "config.json"] if main.is_file() else []
    if snapshots.is_dir():
        candidates += sorted(snapshots.glob("*/config.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise InputError(f"{repo_id}: not a zoo model, a file, or in the Hugging Face cache ({folder}); fetch its "
                         f"config.json (huggingface-cli download {repo_id} config.json) or pass the file's path")
    doc, origin = _read_document(found)
    if not (isinstance(doc, dict) and "model_type" in doc):
        raise _fail(origin, "the cached config.json has no model_type; pass a meshplan model file instead")
    return from_hf_config(doc, repo_id.split("/")[1], origin=f"{repo_id} ({found})")
