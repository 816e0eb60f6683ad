"""The serving check (executor/serving.py): prefill and decode steps with a KV cache on the engine's TP, attention
DP and EP ranks against one forward of the whole sequences, and `meshplan verify` on a serving plan."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from cli_helpers import run

from meshplan.costmodels.model_io import load_zoo
from meshplan.executor.launch import run_world
from meshplan.executor.model import build_model
from meshplan.executor.scale import scale_model
from meshplan.executor.serving import KVCacheCore, max_relative_error, serve_rank, serve_reference, serve_tokens
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.planner.builders import build_serving_plan
from meshplan.planner.plan import write_plan
from meshplan.costmodels.serving import ServeTargets, ServeWorkload
from meshplan.planner.serve import parse_engine_layout, pinned_deployment


def test_cache_core_matches_one_forward_in_one_process():
    """Prefill 5 tokens, then 3 single-token steps through KVCacheCore = the logits of one causal forward."""
    spec = scale_model(load_zoo("llama3.1-8b"), "tiny")
    model = build_model(spec)
    tokens = serve_tokens(spec, 2, 8, 0)
    with torch.no_grad():
        want = model.logits(tokens)
        for layer in model.layers:
            layer.attention.core = KVCacheCore()
        got = [model.logits(tokens[:, :5], torch.arange(5))]
        got += [model.logits(tokens[:, p:p + 1], torch.tensor([p])) for p in range(5, 8)]
    assert max_relative_error(torch.cat(got, dim=1), want) < 1e-12
    assert sum(layer.attention.core.bytes for layer in model.layers) == spec.num_layers * 2 * 2 * 8 * 2 * 8 * 8


CASES = [  # (zoo model, tp, dp, ep): TP with GQA; attention DP with EP on MLA + MoE; TP with EP
    ("llama3.1-8b", 2, 1, 1),
    ("deepseek-v3", 1, 2, 2),
    ("qwen3-30b-a3b", 2, 1, 2),
]


@pytest.mark.parametrize("name, tp, dp, ep", CASES)
def test_engine_ranks_match_the_reference(name, tp, dp, ep):
    spec = scale_model(load_zoo(name), "tiny", heads_multiple=tp, kv_multiple=tp, experts_multiple=ep)
    batch, prompt, steps = 2, 6, 3
    reports = run_world(tp * dp, serve_rank, spec.model_dump_json(), tp, dp, ep, batch, prompt, steps, 0,
                        timeout_s=120)
    ref = serve_reference(spec, dp * batch, prompt + steps, 0)
    for r in reports:
        assert r.logits.shape == (batch, prompt + steps, spec.vocab)
        assert max_relative_error(r.logits, ref[r.group * batch:(r.group + 1) * batch]) < 1e-12
        assert len(r.decode_s) == steps and r.prefill_s > 0 and r.cache_bytes > 0
    assert sorted({r.group for r in reports}) == list(range(dp))


def test_a_wrong_position_fails():
    spec = scale_model(load_zoo("llama3.1-8b"), "tiny", heads_multiple=2, kv_multiple=2)
    reports = run_world(2, serve_rank, spec.model_dump_json(), 2, 1, 1, 2, 6, 2, 0, "position-offset",
                        timeout_s=120)
    ref = serve_reference(spec, 2, 8, 0)
    assert max_relative_error(reports[0].logits, ref) > 1e-6


def _serving_plan(tmp_path, model: str, layout: str, gpu: str = "h100-sxm"):
    spec = load_zoo(model)
    cluster = Cluster(ClusterSpec(gpu=gpu, num_gpus=2))
    wl = ServeWorkload(isl=500, osl=100)
    targets = ServeTargets()
    d = pinned_deployment(spec, cluster, wl, targets, parse_engine_layout(layout))
    path = tmp_path / "serve.json"
    write_plan(build_serving_plan(spec, cluster, wl, targets, d), path)
    return path


def test_cli_verify_serving_plan(capsys, tmp_path):
    path = _serving_plan(tmp_path, "llama3.1-8b", "tp2")
    code, out, err = run(capsys, "verify", str(path), "--calibration", "example-cpu", "--out",
                         str(tmp_path / "r.json"))
    assert code == 0, err
    assert "OK: every logit" in out and "this host (calibrated)" in out
    report = json.loads((tmp_path / "r.json").read_text())
    engine, = report["engines"]
    assert report["ok"] and engine["cache_bytes"] == engine["predicted_cache_bytes"] == 7680  # the KV formula
    code, out, err = run(capsys, "verify", str(path), "--inject", "position-offset")
    assert code == 1 and "FAILED" in out
    # the serving check runs on gloo: --backend nccl is refused in one line, not dropped
    code, out, err = run(capsys, "verify", str(path), "--backend", "nccl")
    assert code == 2 and err.startswith("error: the serving check") and "Traceback" not in err


@pytest.mark.parametrize("inject, extra, words", [
    ("raise", [], "rank 1: RuntimeError: injected failure (--inject raise)"),
    ("hang", ["--timeout", "20"], "rank 1: no result after 20 s"),
])
def test_a_serving_rank_that_raises_or_hangs_ends_verify_in_one_line(capsys, tmp_path, inject, extra, words):
    """Fault injection for serving plans too: the last rank raises, or sleeps past --timeout; verify exits 1 with
    one line naming it (a RankFailure out of the serving check was a traceback before)."""
    path = _serving_plan(tmp_path, "llama3.1-8b", "tp2")
    code, out, err = run(capsys, "verify", str(path), "--inject", inject, *extra)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith(f"error: {words}"), err
    assert "Traceback" not in err


@pytest.mark.parametrize("layout, extra, words", [
    ("tp1,pp2", [], ["pp 2", "pipeline"]),
    ("tp2", ["--max-ranks", "1"], ["2 ranks", "at most 1"]),
    ("tp2", ["--inject", "nonsense"], ["unknown injection"]),
    ("tp2", ["--scale", "huge"], ["--scale"]),
])
def test_cli_verify_serving_refusals(capsys, tmp_path, layout, extra, words):
    """Refused before any rank starts: one error line, exit 2."""
    from cli_helpers import assert_input_error

    path = _serving_plan(tmp_path, "llama3.1-8b", layout)
    assert_input_error(*run(capsys, "verify", str(path), *extra), *words)
