"""What a new user meets: suggestions for misspelt names, Hugging Face ids from the local cache, serving in the
model's published dtype, and tables readable at 80 columns."""

from __future__ import annotations

import json

import pytest
from cli_helpers import assert_input_error, run

from meshplan.costmodels.model_io import hf_hub_cache, load_model

LLAMA_8B_CONFIG = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"}}


@pytest.mark.parametrize(("args", "words"), [
    (("--model", "llama3-8b", "--gpu", "h100-sxm"), ("unknown model 'llama3-8b'", "did you mean llama3.1-8b")),
    (("--model", "llama3.1-8b", "--gpu", "h100sxm"), ("unknown gpu 'h100sxm'", "did you mean h100-sxm?")),
    (("--model", "deepseek-v4", "--gpu", "h100-sxm"), ("did you mean deepseek-v3",)),
    # the names it begins come first: h100 used to suggest "h800 or h200" only
    (("--model", "llama3.1-8b", "--gpu", "h100"), ("did you mean h100-nvl, h100-sxm, h100-pcie",)),
])
def test_a_misspelt_name_gets_a_suggestion(capsys, args, words):
    assert_input_error(*run(capsys, "estimate", *args, "--gpus", "8"), *words)


def test_no_suggestion_for_a_name_like_nothing(capsys):
    line = assert_input_error(*run(capsys, "estimate", "--model", "zzzz", "--gpu", "h100-sxm", "--gpus", "8"),
                              "unknown model")
    assert "did you mean" not in line


def _cache(root, repo, config):
    folder = root / "hub" / ("models--" + repo.replace("/", "--"))
    (folder / "snapshots" / "rev1").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("rev1")
    (folder / "snapshots" / "rev1" / "config.json").write_text(json.dumps(config))


def test_a_hub_id_resolves_from_the_local_cache(monkeypatch, tmp_path, capsys):
    """HF_HOME/hub/models--meta-llama--Llama-3.1-8B/snapshots/<refs/main>/config.json, as huggingface_hub lays it
    out: the model is read from there and named after the repository."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    _cache(tmp_path, "meta-llama/Llama-3.1-8B", LLAMA_8B_CONFIG)
    assert hf_hub_cache() == tmp_path / "hub"
    spec = load_model("meta-llama/Llama-3.1-8B")
    assert spec.name == "Llama-3.1-8B" and spec.num_layers == 32 and spec.rope_theta == 500000.0
    assert spec.total_params() == load_model("llama3.1-8b").total_params()
    code, out, err = run(capsys, "estimate", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "h100-sxm", "--gpus",
                         "8", "--gbs", "64")
    assert code == 0 and out.startswith("Llama-3.1-8B"), err
    # HF_HUB_CACHE wins over HF_HOME
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    line = assert_input_error(*run(capsys, "estimate", "--model", "meta-llama/Llama-3.1-8B", "--gpu", "h100-sxm",
                                   "--gpus", "8"), "hugging face cache", "huggingface-cli download")
    assert str(tmp_path / "elsewhere") in line


def test_serve_loads_the_published_weights(capsys):
    """DeepSeek-V3 ships FP8 weights: serve plans them in fp8 unless --weight-dtype says otherwise."""
    assert load_model("deepseek-v3").weight_dtype == "fp8" and load_model("llama3.1-70b").weight_dtype == "bf16"
    base = ("serve", "--model", "deepseek-v3", "--gpu", "h200", "--gpus", "16", "--isl", "1000", "--osl", "200",
            "--layout", "tp16", "--json")
    code, out, err = run(capsys, *base)
    assert code == 0, err
    assert json.loads(out)["inputs"]["workload"]["weight_dtype"] == "fp8"
    code, out, err = run(capsys, *base, "--weight-dtype", "bf16")
    assert code == 0, err
    assert json.loads(out)["inputs"]["workload"]["weight_dtype"] == "bf16"


@pytest.mark.parametrize("args", [
    ("plan", "--model", "llama3.1-70b", "--gpu", "h100-sxm", "--gpus", "64", "--gbs", "256", "--seq", "8192"),
    ("estimate", "--model", "deepseek-v3", "--gpu", "h800", "--gpus", "256", "--pp", "8", "--ep", "32"),
    ("serve", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--isl", "1000", "--osl", "200"),
    ("sweep", "--model", "llama3.1-8b", "--gpu", "h100-sxm,b200", "--gpus", "8,16"),
    ("models", "list"), ("hardware", "list"), ("hardware", "show", "h100-sxm"), ("models", "show", "deepseek-v3"),
])
def test_80_columns_cut_no_cell(monkeypatch, capsys, args):
    """At COLUMNS=80 no line is wider and no cell is cut short with an ellipsis (a table too wide becomes one line
    of `header value` pairs per row)."""
    monkeypatch.setenv("COLUMNS", "80")
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert "…" not in out
    assert max(len(line) for line in out.splitlines()) <= 80


def test_piped_long_steps_print_plain_progress_lines(capsys, monkeypatch):
    """Piped output (not a terminal) used to get no progress at all: 89 s of a sweep, 206 s of a profile. Past
    PROGRESS_FIRST_S CPU seconds a step prints `progress:` lines on stderr (here the threshold is 0, so every
    step does); the command's own output is unchanged, and a short command prints none at the real threshold."""
    from meshplan.cli import options

    args = ("sweep", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8,16", "--gbs", "16", "--seq", "2048")
    code, quiet_out, err = run(capsys, *args)
    assert code == 0 and "progress:" not in err
    monkeypatch.setattr(options, "PROGRESS_FIRST_S", 0.0)
    monkeypatch.setattr(options, "PROGRESS_EVERY_S", 0.0)
    code, out, err = run(capsys, *args)
    assert code == 0 and out == quiet_out
    assert [x for x in err.splitlines() if x.startswith("progress: planning: ")], err
    monkeypatch.setattr(options, "PROGRESS_POLL_S", 0.001)
    code, out, err = run(capsys, "serve", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--isl",
                         "1000", "--osl", "100")
    assert code == 0 and "progress: searching deployments of llama3.1-8b" in err
