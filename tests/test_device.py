"""The GPU path is the CPU path on another device: the executor's model, its KV-cache attention and RoPE make every
tensor on the device of their inputs. Run on torch's "meta" device (shapes only, no data), a tensor made anywhere
else (a CPU default, a forgotten device=) either mixes devices and raises, or shows up in the hooks below."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from meshplan.costmodels.model_io import load_zoo  # noqa: E402
from meshplan.executor.model import build_model, rope_cos_sin  # noqa: E402
from meshplan.executor.scale import scale_model  # noqa: E402
from meshplan.executor.serving import KVCacheCore  # noqa: E402

META = torch.device("meta")


def _watch(model) -> list[str]:
    """Every module's outputs that are not on the meta device, by module name."""
    wrong: list[str] = []

    def check(name):
        def hook(module, args, out):
            for t in (out if isinstance(out, tuple) else (out,)):
                if isinstance(t, torch.Tensor) and t.device != META:
                    wrong.append(f"{name}: {t.device}")
        return hook

    for name, module in model.named_modules():
        module.register_forward_hook(check(name or "model"))
    return wrong


@pytest.fixture()
def meta_nonzero():
    """MoE routing asks nonzero() for the tokens of each expert, which has no shape on meta; torch's own switch
    assumes every element non-zero (shapes only: the values do not matter here)."""
    import torch.fx.experimental._config as fx_config

    with fx_config.patch(meta_nonzero_assume_all_nonzero=True):
        yield


@pytest.mark.parametrize("name", ["llama3.1-8b", "deepseek-v3", "qwen3-30b-a3b", "gpt3-175b"])
def test_training_step_makes_every_tensor_on_the_inputs_device(name, meta_nonzero):
    spec = scale_model(load_zoo(name), "tiny")
    model = build_model(spec, torch.float32).to(META)
    wrong = _watch(model)
    tokens = torch.zeros(2, 16, dtype=torch.long, device=META)
    loss = model(tokens, tokens)
    loss.backward()
    assert loss.device == META and not wrong, wrong
    for pname, p in model.named_parameters():
        assert p.device == META and p.grad is not None and p.grad.device == META, pname
    for bname, b in model.named_buffers():
        assert b.device == META, bname


def test_kv_cache_decoding_stays_on_the_device(meta_nonzero):
    spec = scale_model(load_zoo("llama3.1-8b"), "tiny")
    model = build_model(spec, torch.float32).to(META)
    for layer in model.layers:
        layer.attention.core = KVCacheCore()
    wrong = _watch(model)
    tokens = torch.zeros(2, 8, dtype=torch.long, device=META)
    with torch.no_grad():
        model.logits(tokens[:, :6], torch.arange(6, device=META))
        out = model.logits(tokens[:, 6:7], torch.tensor([6], device=META))
    assert out.device == META and not wrong, wrong


def test_the_check_catches_a_tensor_made_on_the_cpu():
    """The check is live: RoPE with its frequencies on the CPU (the review's finding 1) fails on meta positions."""
    cos, sin = rope_cos_sin(torch.arange(4, device=META), 8, torch.float32)
    assert cos.device == META and sin.device == META
    cpu_freqs = torch.arange(0, 8, 2, dtype=torch.float64)  # what the code did before: no device=
    with pytest.raises(RuntimeError, match="not on the expected device"):
        torch.arange(4, device=META).to(torch.float64)[:, None] * cpu_freqs[None, :]


def test_the_allocator_peak_is_reported_beside_the_accounting_not_in_it():
    """A GPU's allocator peak (review finding 15) is its own figure: the CPU has none, and the measured total stays
    the tensor accounting's sum."""
    from meshplan.executor.mesh import allocator_peak
    from meshplan.executor.verify import MemoryRow

    assert allocator_peak(torch.device("cpu")) is None
    row = MemoryRow(rank=0, stage=0, measured={"parameters": 1.0, "gradients": 2.0, "optimizer": 3.0,
                                               "activations": 4.0, "allocator_peak": 100.0},
                    predicted={"parameters": 1.0})
    assert row.measured_total == 10.0


def test_a_calibration_must_be_of_the_device_the_run_uses():
    """verify takes a GPU's calibration for an NCCL run and a CPU's for a gloo run (review finding 17), and says so
    before any rank starts."""
    from meshplan.executor.verify import VerifyOptions, _check_calibration
    from meshplan.hardware_db.calibration import load_calibration
    from meshplan.hardware_db.errors import InputError

    cpu = load_calibration("example-cpu")
    gpu = cpu.model_copy(update={"device": cpu.device.model_copy(update={"kind": "cuda", "target": "h200"})})
    _check_calibration(VerifyOptions(backend="gloo", calibration=cpu))
    _check_calibration(VerifyOptions(backend="nccl", calibration=gpu))
    for opts, words in ((VerifyOptions(backend="gloo", calibration=gpu), "--device cpu"),
                        (VerifyOptions(backend="nccl", calibration=cpu), "--device cuda")):
        with pytest.raises(InputError, match=words):
            _check_calibration(opts)


@pytest.mark.parametrize(("dtype", "gap", "agree"), [("float32", 1e-8, True), ("float32", 1e-4, False),
                                                     ("float64", 1e-14, True), ("float64", 1e-9, False),
                                                     ("bfloat16", 5e-2, True), ("bfloat16", 0.5, False)])
def test_replicas_agree_to_their_dtypes_rounding(dtype, gap, agree):
    """Replicas (dp copies, tp-gathered tensors) are held to their dtype (review finding 16): bitwise-close in
    float64, float32 rounding accumulated in float32 (a GPU's backward reduces in a nondeterministic order), bf16 apart
    by AdamW's +-lr steps; a missing reduction (a gap of 1e-4 or more, O(1) in bf16) still shows."""
    from meshplan.executor.compare import merge_reports
    from meshplan.executor.reference import RunResult, RunSpec

    run = RunSpec(model=load_zoo("llama3.1-8b"), gbs=2, seq=8, dtype=dtype)
    one = torch.ones(4, dtype=torch.float64)
    a = RunResult(run=run, losses=(1.0,), grads={"w": one}, params={"w": one})
    b = RunResult(run=run, losses=(1.0,), grads={"w": one * (1 + gap)}, params={"w": one})
    _, problems = merge_reports([a, b])
    assert (not problems) == agree, problems
