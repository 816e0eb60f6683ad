"""Loading ModelSpecs: Hugging Face configs, meshplan model files, the zoo, and their errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import (HF_MODEL_TYPES, from_hf_config, list_zoo, load_model, load_model_file,
                                          load_zoo, parse_model_file, to_model_file, zoo_source)
from meshplan.hardware_db.errors import InputError

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples" / "models"


def raises_one_line(fn, *args, match: str = "") -> str:
    with pytest.raises(InputError) as info:
        fn(*args)
    msg = str(info.value)
    assert "\n" not in msg and msg.strip() == msg and msg, msg
    assert match.lower() in msg.lower(), msg
    return msg


# ---- published parameter counts ---------------------------------------------------------------
# (zoo name, published total in billions, published active in billions or None) -- within 2%.
PUBLISHED = [
    ("llama3.1-8b", 8.03, None),  # Meta model card
    ("llama3.1-70b", 70.6, None),
    ("llama3.1-405b", 405.9, None),
    ("mixtral-8x7b", 46.7, 12.9),  # Mistral AI announcement
    ("mixtral-8x22b", 141.0, 39.0),
    ("qwen3-30b-a3b", 30.5, 3.3),  # Qwen3 model cards
    ("qwen3-235b-a22b", 235.0, 22.0),
    ("qwen3-32b", 32.8, None),  # Qwen3-32B model card: 32.8B
    ("llama2-70b", 70.0, None),  # Llama 2 paper (Touvron et al. 2023), Table 1
    ("deepseek-v3", 671.0, 37.0),  # DeepSeek-V3 report, main model without the MTP module
    ("gpt3-175b", 175.0, None),  # Brown et al. 2020
    ("nemotron-4-340b", 341.0, None),  # Nemotron-4 340B report
    ("nemotron-4-15b", 15.6, None),  # Nemotron-4 15B report: 3.2B embedding + 12.5B non-embedding
]


@pytest.mark.parametrize(("name", "total_b", "active_b"), PUBLISHED)
def test_published_parameter_counts(name: str, total_b: float, active_b: float | None) -> None:
    spec = load_zoo(name)
    assert spec.total_params() == pytest.approx(total_b * 1e9, rel=0.02)
    if active_b is None:
        assert spec.active_params() == spec.total_params()
    else:
        assert spec.active_params() == pytest.approx(active_b * 1e9, rel=0.02)


@pytest.mark.parametrize(("name", "count"), [
    ("llama3.1-8b", 8_030_261_248),  # the released safetensors' parameter counts
    ("llama3.1-70b", 70_553_706_496),
    ("llama3.1-405b", 405_853_388_800),
    ("mixtral-8x7b", 46_702_792_704),
])
def test_exact_checkpoint_counts(name: str, count: int) -> None:
    assert load_zoo(name).total_params() == count


SC21 = [("1.7b", 1.7), ("3.6b", 3.6), ("7.5b", 7.5), ("18.4b", 18.4), ("39.1b", 39.1), ("76.1b", 76.1),
        ("145.6b", 145.6), ("310.1b", 310.1), ("529.6b", 529.6), ("1t", 1008.0)]


@pytest.mark.parametrize(("tag", "published_b"), SC21)
def test_megatron_sc21_counts_match_table1(tag: str, published_b: float) -> None:
    # SC'21 Table 1 prints params to one decimal from P = 12lh^2(1 + 13/12h + (V+s)/12lh): tied, learned positions.
    total = load_zoo(f"megatron-gpt-{tag}").total_params() / 1e9
    assert abs(total - published_b) <= 0.051, total


def test_deepseek_v3_with_mtp_matches_checkpoint() -> None:
    # the released checkpoint is 685B: 671B main model + 14B MTP module
    assert load_zoo("deepseek-v3").total_params(include_mtp=True) == pytest.approx(685e9, rel=0.02)


# ---- the zoo ----------------------------------------------------------------------------------
YAML_SHAPES = [  # every distinct model shape of benchmarks/training_dev.yaml
    ("megatron-gpt-1.7b", 24, 2304, 24, 51200), ("megatron-gpt-3.6b", 30, 3072, 32, 51200),
    ("megatron-gpt-7.5b", 36, 4096, 32, 51200), ("megatron-gpt-18.4b", 40, 6144, 48, 51200),
    ("megatron-gpt-39.1b", 48, 8192, 64, 51200), ("megatron-gpt-76.1b", 60, 10240, 80, 51200),
    ("megatron-gpt-145.6b", 80, 12288, 96, 51200), ("megatron-gpt-310.1b", 96, 16384, 128, 51200),
    ("megatron-gpt-529.6b", 105, 20480, 128, 51200), ("megatron-gpt-1t", 128, 25600, 160, 51200),
    ("megatron-gpt-22b", 48, 6144, 64, 51200), ("gpt3-175b", 96, 12288, 96, 51200),
    ("mcore-gpt-1.7b", 24, 2048, 16, 131072), ("mcore-gpt-7.1b", 30, 4096, 32, 131072),
    ("mcore-gpt-16b", 32, 6144, 48, 131072), ("mcore-gpt-32b", 48, 7168, 56, 131072),
    ("mcore-gpt-70b", 84, 8192, 64, 131072), ("mcore-gpt-119b", 92, 10240, 80, 131072),
    ("mcore-gpt-177b", 96, 12288, 96, 131072), ("mcore-gpt-314b", 96, 16384, 128, 131072),
    ("mcore-gpt-462b", 112, 18432, 144, 131072),
]


@pytest.mark.parametrize(("name", "layers", "hidden", "heads", "vocab"), YAML_SHAPES)
def test_reference_run_shapes_are_in_the_zoo(name: str, layers: int, hidden: int, heads: int, vocab: int) -> None:
    m = load_zoo(name)
    assert (m.num_layers, m.hidden, m.num_heads, m.kv_heads, m.vocab) == (layers, hidden, heads, heads, vocab)
    assert (m.ffn_hidden, m.mlp, m.norm) == (4 * hidden, "gelu", "layernorm")


def test_reference_yaml_shapes_all_covered() -> None:
    yaml = pytest.importorskip("yaml")
    path = REPO / "benchmarks" / "training_dev.yaml"  # the repository carries its data (no sibling folder)
    zoo = {(m.num_layers, m.hidden, m.num_heads, m.vocab) for m in map(load_zoo, list_zoo())}
    for run in yaml.safe_load(path.read_text()):
        m = run["model"]
        assert (m["layers"], m["hidden"], m["heads"], m["vocab"]) in zoo, run["id"]


def test_zoo_files_are_well_formed() -> None:
    names = list_zoo()
    assert len(names) >= 31
    for name in names:
        doc = json.loads((REPO / "costmodels" / "zoo" / f"{name}.json").read_text())
        assert doc["name"] == name
        assert len(doc.get("source", "")) > 20, f"{name} needs a 'source'"
        assert zoo_source(name) == doc["source"]
        spec = load_zoo(name)
        assert isinstance(spec, ModelSpec) and spec.name == name
        assert load_model(name) == spec
        assert parse_model_file(to_model_file(spec), "roundtrip") == spec


def test_zoo_lookup_is_case_insensitive() -> None:
    assert load_model("  Llama3.1-8B ") == load_zoo("llama3.1-8b")


def test_zoo_architectures() -> None:
    nemo = load_zoo("nemotron-4-340b")
    assert (nemo.mlp, nemo.kv_heads, nemo.ffn_hidden, nemo.vocab) == ("relu2", 8, 73728, 256000)
    assert not nemo.tied_embeddings
    ds = load_zoo("deepseek-v3")
    assert ds.mla is not None and ds.moe is not None and ds.num_mtp_layers == 1
    assert ds.num_moe_layers == 58
    assert load_zoo("gpt3-175b").tied_embeddings and load_zoo("gpt3-175b").learned_positions
    assert not load_zoo("mcore-gpt-70b").tied_embeddings


def test_examples_match_zoo() -> None:
    assert load_model(str(EXAMPLES / "nemotron-4-15b.toml")) == load_zoo("nemotron-4-15b")
    hf = load_model(str(EXAMPLES / "llama3.1-8b.config.json"))
    assert hf == load_zoo("llama3.1-8b")
    assert hf.name == "llama3.1-8b"


def test_hf_config_directory(tmp_path: Path) -> None:
    snap = tmp_path / "Meta-Llama-3.1-8B"
    snap.mkdir()
    (snap / "config.json").write_text((EXAMPLES / "llama3.1-8b.config.json").read_text())
    spec = load_model(str(snap))
    assert spec.name == "Meta-Llama-3.1-8B"
    assert spec.total_params() == load_zoo("llama3.1-8b").total_params()


# ---- each Hugging Face model_type -----------------------------------------------------------------
def base(**kw):
    return {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8, "intermediate_size": 688,
            "vocab_size": 1000, "max_position_embeddings": 512} | kw


def test_hf_llama() -> None:
    m = from_hf_config(base(model_type="llama", num_key_value_heads=2), "tiny")
    assert (m.name, m.num_layers, m.hidden, m.num_heads, m.kv_heads, m.head_size) == ("tiny", 4, 256, 8, 2, 32)
    assert (m.ffn_hidden, m.vocab, m.max_seq_len) == (688, 1000, 512)
    assert (m.mlp, m.norm, m.tied_embeddings, m.qkv_bias, m.linear_bias, m.learned_positions) == (
        "swiglu", "rmsnorm", False, False, False, False)
    m = from_hf_config(base(model_type="llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True), "b")
    assert (m.kv_heads, m.qkv_bias, m.linear_bias, m.tied_embeddings) == (8, True, True, True)


def test_hf_mistral() -> None:
    m = from_hf_config(base(model_type="mistral", num_key_value_heads=4, head_dim=64, sliding_window=4096), "nemo")
    assert (m.kv_heads, m.head_size, m.mlp, m.norm) == (4, 64, "swiglu", "rmsnorm")
    assert (m.tied_embeddings, m.qkv_bias) == (False, False)


def test_hf_qwen2() -> None:
    m = from_hf_config(base(model_type="qwen2", num_key_value_heads=2), "q2")
    assert (m.qkv_bias, m.linear_bias, m.tied_embeddings, m.kv_heads) == (True, False, False, 2)
    assert from_hf_config(base(model_type="qwen2", tie_word_embeddings=True), "q2s").tied_embeddings


def test_hf_qwen3() -> None:
    m = from_hf_config(base(model_type="qwen3", num_key_value_heads=4, head_dim=64), "q3")
    assert (m.head_size, m.kv_heads, m.qkv_bias, m.norm) == (64, 4, False, "rmsnorm")
    assert from_hf_config(base(model_type="qwen3"), "q3d").head_dim == 128  # Qwen3Config default


def test_hf_gpt2() -> None:
    cfg = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None, "vocab_size": 50257,
           "n_positions": 1024, "activation_function": "gelu_new"}
    m = from_hf_config(cfg, "gpt2")
    assert (m.hidden, m.num_layers, m.num_heads, m.ffn_hidden) == (768, 12, 12, 3072)
    assert (m.vocab, m.max_seq_len) == (50257, 1024)
    assert (m.mlp, m.norm, m.tied_embeddings, m.learned_positions, m.qkv_bias, m.linear_bias) == (
        "gelu", "layernorm", True, True, True, True)
    assert m.total_params() == 124_439_808  # the parameter count of the released GPT-2 small
    assert from_hf_config(cfg | {"n_inner": 1000}, "g").ffn_hidden == 1000


def test_hf_gpt_neox() -> None:
    cfg = {"model_type": "gpt_neox", "hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8,
           "intermediate_size": 2048, "vocab_size": 50304, "max_position_embeddings": 2048, "rotary_pct": 0.25}
    m = from_hf_config(cfg, "pythia-70m")
    assert (m.mlp, m.norm, m.tied_embeddings, m.qkv_bias, m.linear_bias, m.learned_positions) == (
        "gelu", "layernorm", False, True, True, False)
    assert m.total_params() == 70_426_624  # Pythia-70M's parameter count (GPT-NeoX, untied)


def test_hf_mixtral() -> None:
    cfg = base(model_type="mixtral", num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
    m = from_hf_config(cfg, "mx")
    assert m.moe is not None
    assert (m.moe.num_experts, m.moe.top_k, m.moe.expert_ffn_hidden, m.moe.num_shared_experts) == (8, 2, 688, 0)
    assert m.num_moe_layers == 4 and m.active_params() < m.total_params()


def test_hf_qwen2_moe() -> None:
    cfg = base(model_type="qwen2_moe", num_key_value_heads=8, num_experts=60, num_experts_per_tok=4,
               moe_intermediate_size=64, shared_expert_intermediate_size=256, decoder_sparse_step=1, mlp_only_layers=[])
    m = from_hf_config(cfg, "qmoe")
    assert m.moe is not None and m.qkv_bias
    assert (m.moe.num_experts, m.moe.top_k, m.moe.expert_ffn_hidden) == (60, 4, 64)
    assert (m.moe.num_shared_experts, m.moe.shared_hidden, m.ffn_hidden) == (1, 256, 688)
    assert m.num_moe_layers == 4
    # a dense prefix in mlp_only_layers becomes first_k_dense; the dense layers use intermediate_size
    m = from_hf_config(cfg | {"mlp_only_layers": [0, 1]}, "qmoe2")
    assert m.moe is not None and m.moe.first_k_dense == 2 and m.num_moe_layers == 2
    assert m.layer_params(0) - m.attention_params() - 2 * m.norm_params() == m.mlp_params(688)
    # a layout ModelSpec cannot express is refused, not approximated
    raises_one_line(from_hf_config, cfg | {"decoder_sparse_step": 2}, "x", match="layer_freq")
    # no experts at all: a dense model
    assert from_hf_config(cfg | {"num_experts": 0}, "d").moe is None


def test_hf_qwen3_moe() -> None:
    cfg = base(model_type="qwen3_moe", num_key_value_heads=4, head_dim=64, num_experts=16, num_experts_per_tok=4,
               moe_intermediate_size=96)
    m = from_hf_config(cfg, "q3moe")
    assert m.moe is not None and not m.qkv_bias and m.head_size == 64
    assert (m.moe.num_experts, m.moe.top_k, m.moe.expert_ffn_hidden, m.moe.num_shared_experts) == (16, 4, 96, 0)
    assert (m.moe.first_k_dense, m.moe.layer_freq) == (0, 1)


def deepseek_cfg(model_type: str, **kw):
    return base(model_type=model_type, num_key_value_heads=8, q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32,
                qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4,
                moe_intermediate_size=64, n_shared_experts=2, first_k_dense_replace=1, moe_layer_freq=1) | kw


def test_hf_deepseek_v2() -> None:
    m = from_hf_config(deepseek_cfg("deepseek_v2", q_lora_rank=None), "v2-lite")
    assert m.mla is not None and m.mla.q_lora_rank is None
    assert (m.mla.kv_lora_rank, m.mla.qk_head_dim, m.mla.v_head_dim) == (64, 48, 32)
    assert m.moe is not None and (m.moe.num_experts, m.moe.num_shared_experts, m.moe.shared_hidden) == (16, 2, 64)
    assert (m.moe.first_k_dense, m.num_moe_layers, m.num_mtp_layers, m.ffn_hidden) == (1, 3, 0, 688)


def test_hf_deepseek_v3() -> None:
    m = from_hf_config(deepseek_cfg("deepseek_v3", num_nextn_predict_layers=1, moe_layer_freq=2), "v3")
    assert m.mla is not None and m.mla.q_lora_rank == 96 and m.num_mtp_layers == 1
    assert m.moe is not None and (m.moe.first_k_dense, m.moe.layer_freq) == (1, 2)
    assert [m.is_moe_layer(i) for i in range(4)] == [False, False, True, False]


def test_hf_deepseek_v3_full_config_matches_zoo() -> None:
    cfg = {"model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
           "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128, "n_routed_experts": 256,
           "n_shared_experts": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1,
           "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
           "vocab_size": 129280, "max_position_embeddings": 163840, "num_nextn_predict_layers": 1,
           "tie_word_embeddings": False, "rope_theta": 10000, "rms_norm_eps": 1e-06, "attention_dropout": 0.0,
           "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "type": "yarn"},
           "scoring_func": "sigmoid", "topk_method": "noaux_tc", "routed_scaling_factor": 2.5, "n_group": 8,
           "topk_group": 4, "seq_aux": True, "norm_topk_prob": True, "torch_dtype": "bfloat16",
           "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                   "weight_block_size": [128, 128]}}
    assert from_hf_config(cfg, "deepseek-v3") == load_zoo("deepseek-v3")
    # a config without the router and RoPE fields is the same shape, priced alike, with nothing to export for them
    bare = {k: v for k, v in cfg.items() if k not in ("rope_theta", "rms_norm_eps", "attention_dropout",
                                                      "rope_scaling", "scoring_func", "topk_method",
                                                      "routed_scaling_factor", "n_group", "topk_group", "seq_aux")}
    spec = from_hf_config(bare, "deepseek-v3")
    assert spec.rope_scaling is None and spec.moe.score_function == "softmax" and not spec.moe.expert_bias
    assert spec.total_params() == load_zoo("deepseek-v3").total_params()


def test_every_supported_type_has_a_test() -> None:
    tested = {"llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox", "mixtral", "qwen2_moe", "qwen3_moe",
              "deepseek_v2", "deepseek_v3"}
    assert set(HF_MODEL_TYPES) == tested


# ---- errors -----------------------------------------------------------------------------------------
def test_unknown_model_type() -> None:
    msg = raises_one_line(from_hf_config, base(model_type="falcon"), "f", match="unsupported model_type 'falcon'")
    assert "llama" in msg and "docs/models.md" in msg


def test_missing_model_type() -> None:
    raises_one_line(from_hf_config, base(), "x", match="model_type")


def test_missing_field_names_field_and_type() -> None:
    cfg = base(model_type="llama")
    del cfg["intermediate_size"]
    msg = raises_one_line(from_hf_config, cfg, "x", match="'intermediate_size'")
    assert "llama" in msg
    raises_one_line(from_hf_config, base(model_type="mixtral"), "x", match="'num_local_experts'")
    cfg = deepseek_cfg("deepseek_v3")
    del cfg["q_lora_rank"]
    raises_one_line(from_hf_config, cfg, "x", match="'q_lora_rank'")


def test_heads_not_dividing_hidden() -> None:
    raises_one_line(from_hf_config, base(model_type="llama", num_attention_heads=7), "x", match="must divide hidden")


def test_kv_heads_not_dividing_heads() -> None:
    cfg = base(model_type="llama", num_key_value_heads=3)
    raises_one_line(from_hf_config, cfg, "x", match="must divide attention heads")


def test_top_k_above_experts() -> None:
    cfg = base(model_type="mixtral", num_local_experts=4, num_experts_per_tok=8)
    raises_one_line(from_hf_config, cfg, "x", match="num_experts_per_tok (8) exceeds num_local_experts (4)")


def test_bad_value_names_hf_key() -> None:
    raises_one_line(from_hf_config, base(model_type="llama", vocab_size=0), "x", match="'vocab_size'")
    raises_one_line(from_hf_config, base(model_type="gpt2", n_embd="big", n_layer=2, n_head=2, n_positions=8), "x",
                    match="'n_embd' must be an integer")
    raises_one_line(from_hf_config, ["not", "a", "dict"], "x", match="JSON object")


def test_malformed_json_file(tmp_path: Path) -> None:
    p = tmp_path / "broken.json"
    p.write_text('{"name": "x",\n "layers": 2,,}')
    msg = raises_one_line(load_model_file, p, match="not valid JSON")
    assert str(p) in msg
    raises_one_line(load_model, str(p), match="not valid JSON")


def test_malformed_toml_file(tmp_path: Path) -> None:
    p = tmp_path / "broken.toml"
    p.write_text("name = 'x'\nlayers = = 2\n")
    raises_one_line(load_model_file, p, match="not valid TOML")


def test_unknown_key_in_model_file(tmp_path: Path) -> None:
    p = tmp_path / "m.toml"
    p.write_text('name = "m"\nlayers = 2\nhidden = 64\nheads = 4\nffn_hidden = 128\nvocab = 100\nhiden = 3\n')
    msg = raises_one_line(load_model_file, p, match="unknown key(s) 'hiden'")
    assert "allowed keys:" in msg and "ffn_hidden" in msg and "mla" in msg
    p.write_text('name = "m"\nlayers = 2\nhidden = 64\nheads = 4\nffn_hidden = 128\nvocab = 100\n[moe]\nexpert = 4\n')
    msg = raises_one_line(load_model_file, p, match="'expert' in [moe]")
    assert "top_k" in msg


def test_model_file_bad_value_names_file_key(tmp_path: Path) -> None:
    p = tmp_path / "m.json"
    p.write_text(json.dumps({"name": "m", "layers": 0, "hidden": 64, "heads": 4, "ffn_hidden": 128, "vocab": 100}))
    raises_one_line(load_model_file, p, match="'layers'")
    p.write_text(json.dumps({"name": "m", "layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 128, "vocab": 100,
                             "moe": {"experts": 0, "top_k": 1, "expert_ffn_hidden": 8}}))
    raises_one_line(load_model_file, p, match="'moe.experts'")
    p.write_text(json.dumps({"name": "m", "layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 128, "vocab": 100,
                             "mlp": "silu"}))
    raises_one_line(load_model_file, p, match="'mlp'")
    p.write_text(json.dumps([1, 2]))
    raises_one_line(load_model_file, p, match="JSON object")


def test_model_file_name_defaults_to_stem_and_hf_detection(tmp_path: Path) -> None:
    p = tmp_path / "tiny.json"
    p.write_text(json.dumps({"layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 128, "vocab": 100}))
    assert load_model_file(p).name == "tiny"
    p = tmp_path / "tiny-hf.toml"  # a top-level model_type means a Hugging Face config, whatever the suffix
    p.write_text('model_type = "llama"\nhidden_size = 64\nnum_hidden_layers = 2\nnum_attention_heads = 4\n'
                 'intermediate_size = 128\nvocab_size = 100\n')
    assert load_model_file(p).name == "tiny-hf"


def test_unknown_zoo_name() -> None:
    msg = raises_one_line(load_model, "llama-9000", match="unknown model 'llama-9000'")
    assert "llama3.1-8b" in msg and "deepseek-v3" in msg
    raises_one_line(load_zoo, "../model", match="unknown model")


def test_missing_file_and_bad_suffix(tmp_path: Path) -> None:
    raises_one_line(load_model, str(tmp_path / "nope.json"), match="no such file")
    p = tmp_path / "model.yaml"
    p.write_text("layers: 2\n")
    raises_one_line(load_model, str(p), match=".json or .toml")
    raises_one_line(load_model, str(tmp_path), match="config.json")


# ---- properties -----------------------------------------------------------------------------------
@st.composite
def dense_shapes(draw):
    heads = draw(st.integers(1, 32))
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    head_dim = draw(st.integers(1, 64))
    return {
        "name": "dense",
        "layers": draw(st.integers(1, 16)),
        "hidden": heads * head_dim,
        "heads": heads,
        "kv_heads": kv,
        "ffn_hidden": draw(st.integers(1, 4096)),
        "mlp": draw(st.sampled_from(["gelu", "relu2", "swiglu"])),
        "vocab": draw(st.integers(1, 100_000)),
        "tied_embeddings": draw(st.booleans()),
        "norm": draw(st.sampled_from(["layernorm", "rmsnorm"])),
        "qkv_bias": draw(st.booleans()),
        "linear_bias": draw(st.booleans()),
        "learned_positions": draw(st.booleans()),
        "max_seq_len": draw(st.integers(1, 8192)),
    }


@settings(max_examples=200, deadline=None)
@given(dense_shapes())
def test_dense_total_equals_active(doc) -> None:
    spec = parse_model_file(doc, "hypothesis")
    assert spec.total_params() == spec.active_params() > 0
    assert parse_model_file(to_model_file(spec), "roundtrip") == spec


@settings(max_examples=200, deadline=None)
@given(dense_shapes(), st.data())
def test_moe_active_below_total(doc, data) -> None:
    experts = data.draw(st.integers(2, 64))
    layers = doc["layers"]
    moe = {
        "experts": experts,
        "top_k": data.draw(st.integers(1, experts - 1)),
        "expert_ffn_hidden": data.draw(st.integers(1, 2048)),
        "shared_experts": data.draw(st.integers(0, 2)),
        "first_k_dense": data.draw(st.integers(0, layers - 1)),
        "layer_freq": data.draw(st.integers(1, 3)),
    }
    spec = parse_model_file(doc | {"moe": moe}, "hypothesis")
    assume(spec.num_moe_layers > 0)
    assert 0 < spec.active_params() < spec.total_params()
    assert parse_model_file(to_model_file(spec), "roundtrip") == spec


def test_moe_layout_matches_modelspec_rule_exhaustively() -> None:
    from meshplan.costmodels.model_io import _moe_layout

    for layers in range(1, 9):
        for mask in range(1 << layers):
            sparse = [i for i in range(layers) if mask >> i & 1]
            rule = {(k, f): [i for i in range(layers) if i >= k and i % f == 0]
                    for k in range(layers + 1) for f in range(1, layers + 2)}
            expressible = sparse in rule.values()
            if not sparse:
                assert _moe_layout(sparse, layers, "o", "t") is None
            elif expressible:
                assert rule[_moe_layout(sparse, layers, "o", "t")] == sparse
            else:
                raises_one_line(_moe_layout, sparse, layers, "o", "t", match="layer_freq")


def test_zoo_name_wins_over_unrelated_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "deepseek-v3").mkdir()  # e.g. a checkpoint folder without config.json
    monkeypatch.chdir(tmp_path)
    assert load_model("deepseek-v3") == load_zoo("deepseek-v3")
    (tmp_path / "other").mkdir()
    raises_one_line(load_model, "other", match="without a config.json")


JUNK = st.one_of(st.none(), st.booleans(), st.integers(-3, 10**6), st.floats(allow_nan=True), st.text(max_size=4),
                 st.lists(st.integers(-2, 8), max_size=3),
                 st.dictionaries(st.text(max_size=2), st.integers(), max_size=2))
VALID_HF = {
    "llama": base(model_type="llama"), "mistral": base(model_type="mistral"), "qwen2": base(model_type="qwen2"),
    "qwen3": base(model_type="qwen3"), "gpt_neox": base(model_type="gpt_neox"),
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 100, "n_positions": 32},
    "mixtral": base(model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": base(model_type="qwen2_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64),
    "qwen3_moe": base(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
    "deepseek_v2": deepseek_cfg("deepseek_v2"), "deepseek_v3": deepseek_cfg("deepseek_v3"),
}


@settings(max_examples=400, deadline=None)
@given(st.sampled_from(sorted(VALID_HF)), st.data())
def test_hf_garbage_raises_only_input_error(model_type: str, data) -> None:
    cfg = dict(VALID_HF[model_type])
    optional = {"num_key_value_heads", "head_dim", "tie_word_embeddings", "attention_bias", "mlp_bias", "n_inner",
                "decoder_sparse_step", "mlp_only_layers", "num_nextn_predict_layers", "model_type"}
    for key in data.draw(st.lists(st.sampled_from(sorted(set(cfg) | optional)), max_size=3, unique=True)):
        if data.draw(st.booleans()):
            cfg.pop(key, None)
        else:
            cfg[key] = data.draw(JUNK)
    try:
        assert isinstance(from_hf_config(cfg, "fuzz"), ModelSpec)
    except InputError as exc:
        assert "\n" not in str(exc)


def test_an_absurd_layer_count_is_refused_before_any_per_layer_work():
    """A float layer count that is integral (1e15) once made the Qwen-MoE rule build a list over every layer until
    the machine ran out of memory; it is one clear error now, for every model type."""
    for model_type in ("qwen2_moe", "llama", "deepseek_v3"):
        cfg = dict(VALID_HF[model_type], num_hidden_layers=1e15)
        with pytest.raises(InputError, match="1024|num_hidden_layers|num_layers"):
            from_hf_config(cfg, "fuzz")
