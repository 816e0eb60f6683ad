"""The reference executor's model: scaling keeps structure, parameters match the cost model exactly,
gradients match finite differences, runs are deterministic, attention is causal and RoPE relative."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import list_zoo, load_model
from meshplan.executor.model import apply_rope, build_model, num_params
from meshplan.executor.reference import StepResult, make_batch, reference_step, train
from meshplan.executor.scale import scale_model

ZOO = list_zoo()
DENSE, MOE, MLA = "llama3.1-8b", "mixtral-8x7b", "deepseek-v3"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors gain nothing from intra-op threads, and on a busy 2-core machine their spin-waits
    made this file 10x slower; restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(name: str) -> ModelSpec:
    return scale_model(load_model(name), "tiny")


def moe_pattern(spec: ModelSpec) -> list[bool]:
    return [spec.is_moe_layer(i) for i in range(spec.num_layers)]


# ---- scale_model keeps the structure ----------------------------------------------------------
@pytest.mark.parametrize("name", ZOO)
def test_scale_keeps_structure(name: str) -> None:
    orig = load_model(name)
    s = scale_model(orig, "tiny")
    assert s.name == f"{name}@tiny"
    assert s.num_heads // s.kv_heads == orig.num_heads // orig.kv_heads  # GQA group size
    assert (s.mla is None) == (orig.mla is None)
    if orig.mla is not None:
        assert (s.mla.q_lora_rank is None) == (orig.mla.q_lora_rank is None)
    for field in ("mlp", "norm", "tied_embeddings", "qkv_bias", "linear_bias", "learned_positions"):
        assert getattr(s, field) == getattr(orig, field), field
    assert s.hidden < orig.hidden and s.vocab < orig.vocab and s.num_layers <= orig.num_layers
    assert (s.moe is None) == (orig.moe is None)
    if orig.moe is not None:
        assert s.moe.top_k == orig.moe.top_k and s.moe.num_shared_experts == orig.moe.num_shared_experts
        assert s.moe.layer_freq == orig.moe.layer_freq and s.moe.first_k_dense == min(orig.moe.first_k_dense, 1)
        assert s.moe.top_k <= s.moe.num_experts <= orig.moe.num_experts
        orig_kinds, kinds = set(moe_pattern(orig)), set(moe_pattern(s))
        assert kinds == orig_kinds  # one dense and one MoE layer wherever the original has both
    assert scale_model(orig, "tiny") == s  # deterministic


def test_scale_small_and_layer_override() -> None:
    s = scale_model(load_model(MLA), "small")
    assert s.name == "deepseek-v3@small" and s.hidden == 128 and s.vocab == 512 and s.num_layers == 6
    assert moe_pattern(s) == [False] + [True] * 5
    four = scale_model(load_model(MLA), "tiny", num_layers=4)
    assert four.num_layers == 4 and moe_pattern(four) == [False, True, True, True]
    with pytest.raises(ValueError, match="at least 2"):
        scale_model(load_model(MLA), "tiny", num_layers=1)


@pytest.mark.parametrize("scale", ["huge", "", "Tiny"])
def test_scale_rejects_unknown_scale(scale: str) -> None:
    with pytest.raises(ValueError, match="unknown scale"):
        scale_model(load_model(DENSE), scale)  # type: ignore[arg-type]


# ---- every zoo model: parameters, loss at init, gradients --------------------------------------
@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_builds_and_trains(name: str) -> None:
    spec = tiny(name)
    model = build_model(spec)
    # the executor's parameters are exactly the ones the cost model's formulas count
    assert num_params(model) == spec.total_params()
    assert [layer.is_moe for layer in model.layers] == moe_pattern(spec)
    tokens, labels = make_batch(spec, batch=2, seq=16, seed=0)
    step = reference_step(model, tokens, labels)
    assert math.isfinite(step.loss) and abs(step.loss - math.log(spec.vocab)) < 0.5
    names = [n for n, _ in model.named_parameters()]
    assert list(step.grads) == names
    for n, g in step.grads.items():
        assert torch.isfinite(g).all(), n
    assert any(g.abs().sum() > 0 for n, g in step.grads.items() if ".experts." in n) or spec.moe is None


# Branches of the parameter formulas the zoo does not reach at tiny scale.
VARIANTS = {
    "mla-no-q-lora": (MLA, lambda s: {"mla": s.mla.model_copy(update={"q_lora_rank": None})}),
    "swiglu-biases": (DENSE, lambda s: {"qkv_bias": True, "linear_bias": True}),
    "gelu-rmsnorm-untied-rope": ("gpt3-175b", lambda s: {"norm": "rmsnorm", "learned_positions": False,
                                                          "tied_embeddings": False}),
    "moe-wide-shared-freq2": (MLA, lambda s: {"num_layers": 4, "moe": s.moe.model_copy(
        update={"num_shared_experts": 2, "shared_ffn_hidden": 24, "layer_freq": 2})}),
    "moe-biases-layernorm": (MOE, lambda s: {"linear_bias": True, "norm": "layernorm"}),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_param_count_variants(variant: str) -> None:
    base, update = VARIANTS[variant]
    s = tiny(base)
    spec = ModelSpec.model_validate(s.model_dump() | update(s))
    model = build_model(spec)
    assert num_params(model) == spec.total_params()
    tokens, labels = make_batch(spec, 2, 8, seed=3)
    assert math.isfinite(reference_step(model, tokens, labels).loss)


# ---- gradients against finite differences ------------------------------------------------------
def routing(model) -> list[torch.Tensor]:
    """The experts each token is sent to, per MoE layer, on the last forward (recorded by router hooks)."""
    return [layer.feed_forward.last_ids for layer in model.layers if layer.is_moe]


def record_routing(model) -> None:
    for layer in model.layers:
        if layer.is_moe:
            moe = layer.feed_forward

            def hook(_mod, _inp, logits, moe=moe) -> None:
                moe.last_ids = logits.topk(moe.top_k, dim=-1).indices.sort(dim=-1).values

            moe.router.register_forward_hook(hook)


def directional_fd(model, tokens, labels, p: torch.Tensor, v: torch.Tensor, h: float) -> float | None:
    """d loss / d t at p + t v by the 4th-order central difference (truncation O(h^4), roundoff ~1e-16 L / h);
    None if a token changes experts between the sample points (top-k routing is piecewise constant)."""
    model(tokens, labels)
    routed = routing(model)

    def loss_at(t: float) -> float | None:
        with torch.no_grad():
            p.add_(v, alpha=t)
            out = float(model(tokens, labels))
            p.add_(v, alpha=-t)
        same = all(torch.equal(a, b) for a, b in zip(routing(model), routed, strict=True))
        return out if same else None

    f = [loss_at(t) for t in (h, -h, 2 * h, -2 * h)]
    if None in f:
        return None
    return (8 * (f[0] - f[1]) - (f[2] - f[3])) / (12 * h)


def fd_relative_error(model, tokens, labels, p: torch.Tensor, v: torch.Tensor, autograd: float) -> float:
    """The smallest relative error over steps h in (1e-3, 1e-4, 1e-5).

    No one h suits every parameter: a norm weight whose derivative is ~1e-5 of the loss needs h ~1e-3
    to beat roundoff, a matrix of 0.02-sized entries needs h <= 1e-4 to keep truncation small, and at
    init the router's k-th and (k+1)-th probabilities can be ~1e-5 apart, so larger steps may reroute
    a token. A wrong gradient is off by the same amount at every h, so taking the best h hides nothing.
    """
    errors = [abs(fd - autograd) / abs(autograd) for h in (1e-3, 1e-4, 1e-5)
              if (fd := directional_fd(model, tokens, labels, p, v, h)) is not None]
    assert errors, "routing changed at every step size"
    return min(errors)


FD_PARAMS = {
    DENSE: ["tok_embeddings.weight", "layers.0.attention.wq.weight", "layers.0.attention.wk.weight",
            "layers.1.attention_norm.weight", "layers.2.feed_forward.w3.weight", "output.weight"],
    MOE: ["layers.0.feed_forward.router.weight", "layers.1.feed_forward.experts.0.w1.weight",
          "layers.2.feed_forward.experts.3.w2.weight", "layers.1.attention.wv.weight", "norm.weight"],
    MLA: ["layers.0.attention.wq_a.weight", "layers.0.attention.q_norm.weight", "layers.0.attention.wq_b.weight",
          "layers.1.attention.wkv_a.weight", "layers.1.attention.kv_norm.weight", "layers.2.attention.wkv_b.weight",
          "layers.0.feed_forward.w2.weight", "layers.1.feed_forward.router.weight",
          "layers.2.feed_forward.shared_experts.0.w1.weight"],
    "gpt3-175b": ["pos_embeddings.weight", "tok_embeddings.weight", "layers.0.attention.wq.bias",
                  "layers.1.attention_norm.bias", "layers.2.feed_forward.w1.bias"],
}


@pytest.mark.parametrize("name", list(FD_PARAMS))
def test_gradients_match_finite_differences(name: str) -> None:
    spec = tiny(name)
    model = build_model(spec, seed=1)
    record_routing(model)
    tokens, labels = make_batch(spec, batch=2, seq=8, seed=1)
    step = reference_step(model, tokens, labels)
    params = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(0)
    for pname in FD_PARAMS[name]:
        p = params[pname]
        v = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        autograd = float((step.grads[pname] * v).sum())
        error = fd_relative_error(model, tokens, labels, p, v, autograd)
        assert error <= 1e-6, (pname, error, autograd)


# ---- determinism -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [DENSE, MLA])
def test_same_seed_same_model_and_loss(name: str) -> None:
    spec = tiny(name)
    rng = torch.get_rng_state()
    a, b = build_model(spec, seed=7), build_model(spec, seed=7)
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is left alone
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    assert not torch.equal(build_model(spec, seed=8).layers[0].attention.wo.weight, a.layers[0].attention.wo.weight)
    t1, l1 = make_batch(spec, 2, 8, seed=5)
    t2, l2 = make_batch(spec, 2, 8, seed=5)
    assert torch.equal(t1, t2) and torch.equal(l1, l2) and torch.equal(t1[:, 1:], l1[:, :-1])
    assert float(a(t1, l1).detach()) == float(b(t1, l1).detach())


def test_train_is_bit_identical() -> None:
    spec = tiny(MLA)
    batches = [make_batch(spec, 2, 8, seed=s) for s in range(2)]
    runs = []
    for _ in range(2):
        model = build_model(spec, seed=0)
        losses = train(model, batches, steps=3, lr=1e-3)
        runs.append((losses, [p.detach().clone() for p in model.parameters()]))
    assert len(runs[0][0]) == 3 and all(math.isfinite(x) for x in runs[0][0])
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(p, q) for p, q in zip(runs[0][1], runs[1][1], strict=True))
    assert not torch.equal(runs[0][1][0], build_model(spec, seed=0).tok_embeddings.weight)  # it did update


def test_step_result_is_frozen() -> None:
    spec = tiny(DENSE)
    step = reference_step(build_model(spec), *make_batch(spec, 1, 4, seed=0))
    assert isinstance(step, StepResult)
    with pytest.raises(AttributeError):
        step.loss = 0.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        step.grads["x"] = torch.zeros(1)  # type: ignore[index]


# ---- causality and RoPE ------------------------------------------------------------------------
@pytest.mark.parametrize("name", [DENSE, MOE, MLA, "gpt3-175b"])
def test_future_tokens_do_not_change_the_past(name: str) -> None:
    spec = tiny(name)
    model = build_model(spec)
    tokens, _ = make_batch(spec, 2, 12, seed=2)
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % spec.vocab
    with torch.no_grad():
        a, b = model.logits(tokens), model.logits(changed)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-12)
    assert (a[:, 7:] - b[:, 7:]).abs().amax(dim=-1).min() > 1e-9  # and it does change the rest


def test_rope_depends_only_on_relative_position() -> None:
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 1, 3, 16, generator=gen, dtype=torch.float64) for _ in range(2))

    def score(m: int, n: int) -> torch.Tensor:
        return (apply_rope(q, torch.tensor([m])) * apply_rope(k, torch.tensor([n]))).sum(-1)

    torch.testing.assert_close(score(5, 2), score(105, 102), rtol=0, atol=1e-12)
    assert not torch.allclose(score(5, 2), score(5, 3))
    torch.testing.assert_close(apply_rope(q, torch.tensor([9])).norm(dim=-1), q.norm(dim=-1))  # a rotation


@pytest.mark.parametrize("name", [DENSE, MLA])
def test_rope_models_are_shift_invariant(name: str) -> None:
    spec = tiny(name)
    model = build_model(spec)
    tokens, labels = make_batch(spec, 2, 8, seed=4)
    with torch.no_grad():
        base = model(tokens, labels)
        shifted = model(tokens, labels, positions=torch.arange(8) + 13)
    torch.testing.assert_close(base, shifted, rtol=1e-12, atol=0)


# ---- packaging ---------------------------------------------------------------------------------
def test_planner_and_costmodels_import_neither_torch_nor_executor() -> None:
    code = (
        "import sys, meshplan.planner.search, meshplan.planner.plan, meshplan.costmodels.estimate, meshplan.cli.main\n"
        # scaling is torch-free too: the cost model predicts the scaled run
        "import meshplan.costmodels.model_io, meshplan.executor.scale\n"
        "bad = [m for m in ('torch', 'meshplan.executor.model', 'meshplan.executor.reference') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", ["llama3.1-8b", "deepseek-v3", "gpt3-175b"])
def test_chunks_in_a_row_are_the_model(name):
    from meshplan.executor.model import ModelChunk

    spec = scale_model(load_model(name), "tiny", num_layers=4)
    model = build_model(spec, torch.float64, seed=1)
    tokens, _ = make_batch(spec, 2, 8, seed=0)
    chunks = [ModelChunk(model, a, b) for a, b in ((0, 1), (1, 3), (3, 4))]
    x = tokens
    for c in chunks:
        x = c(x)
    assert torch.equal(x, model.logits(tokens))
    names = {n for c in chunks for n, _ in c.named_parameters()}
    assert names == {n for n, _ in model.named_parameters()} | ({"output.weight"} if spec.tied_embeddings else set())
