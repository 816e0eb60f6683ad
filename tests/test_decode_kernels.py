"""Decode attention on paged caches and decode GEMMs from the engines' measured kernels (hardware_db/
decode_kernels.py): the fit recovers a known kernel, refuses one faster than HBM, the shipped file covers the
measured deployments' GPUs and engines, serving's iterations take it per layer exactly (MLA keeps its attention
roofline; block-scaled FP8 checkpoints take the block-scaled GEMMs), and the shipped file is what the tables give
(with the optional extra meshplan[aic])."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.kernel_tables import ReadPoint, fit_decode_kernel, gemm_read_bytes
from meshplan.costmodels.model import ModelSpec
from meshplan.costmodels.model_io import from_hf_config, load_zoo
from meshplan.costmodels.serving import EngineLayout, StepOptions, iteration_time, kv_bytes_per_token_layer
from meshplan.costmodels.timing import op_time
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.decode_kernels import decode_kernels, parse_decode_kernels
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import load_gpu

LLAMA8 = load_zoo("llama3.1-8b")
DSV3 = load_zoo("deepseek-v3")
HBM = 3.35e12
GPUS = ("h100-sxm", "h200", "b200", "b300", "gb200", "gb300")
ENGINES = ("sglang", "trtllm", "vllm")


def test_the_fit_recovers_a_kernel_it_is_given():
    """Rows made by 12 us + bytes / (0.7 x HBM), 1 MB to 4 GB: the fit gives back 12 us and 0.7, exactly."""
    points = [ReadPoint("fp8", b, 12e-6 + b / (0.7 * HBM)) for b in (1e6, 3e6, 1e7, 5e7, 2e8, 1e9, 4e9)]
    fit = fit_decode_kernel(points, HBM)
    assert fit.latency_s == pytest.approx(12e-6, rel=1e-9)
    assert fit.bandwidth == pytest.approx(0.7, rel=1e-9)
    assert fit.rows == 7 and fit.log_spread == pytest.approx(0.0, abs=1e-9)


def test_a_table_faster_than_hbm_is_refused():
    points = [ReadPoint("bf16", b, 5e-6 + b / (1.2 * HBM)) for b in (1e6, 1e7, 1e8, 1e9)]
    with pytest.raises(InputError, match="1.20 of HBM bandwidth"):
        fit_decode_kernel(points, HBM)


def test_the_shipped_file_covers_the_measured_gpus_and_engines():
    """Every GPU of AIConfigurator's measured deployments, each engine: both KV dtypes for attention, BF16 and FP8
    GEMMs (FP4 on Blackwell), within physical bounds; no engine takes the engines' median; a GPU without tables
    keeps the roofline."""
    for gpu in GPUS:
        for op, dtypes, fixed in (("attention", {"bf16", "fp8"}, 30e-6), ("gemm", {"bf16", "fp8"}, 20e-6)):
            medians = dict((d, (t, s)) for d, t, s in decode_kernels(gpu, op))
            assert dtypes <= set(medians)
            for engine in ENGINES:
                kernels = {d: (t, s) for d, t, s in decode_kernels(gpu, op, engine)}
                assert dtypes <= set(kernels)
                assert all(1e-6 < t < fixed and 0.4 < s <= 1.0 for t, s in kernels.values())
            for dtype in dtypes:
                each = [dict((d, (x, y)) for d, x, y in decode_kernels(gpu, op, e))[dtype] for e in ENGINES]
                t, s = medians[dtype]
                assert t == sorted(x for x, _ in each)[1] and s == sorted(y for _, y in each)[1]
        blackwell = gpu not in ("h100-sxm", "h200")
        assert ("fp4" in dict((d, t) for d, t, _ in decode_kernels(gpu, "gemm", "trtllm"))) == blackwell
    assert decode_kernels("mi300x", "attention") == () and decode_kernels("mi300x", "gemm") == ()
    eff = Efficiency.from_gpu(load_gpu("mi300x"))
    assert eff.decode_attention == () and eff.decode_gemm == ()


def test_a_malformed_table_file_gets_one_line():
    text = ('source = "x y z"\n[[kernel]]\ngpu = "h200"\nengine = "vllm"\nop = "gemm"\ndtype = "fp8"\n'
            'latency_us = 10\nbandwidth = 1.5\nrows = 3\nlog_spread = 0.1\ntable = "h200_sxm/gemm/vllm/0.24.0"\n')
    with pytest.raises(InputError, match=r"^bad.toml: .*bandwidth"):
        parse_decode_kernels(text, "bad.toml")


def test_a_decode_iteration_takes_the_measured_attention_per_layer():
    """Llama-3.1-8B on one H100, 64 sequences at 2,000 tokens, BF16 cache: every one of its 32 layers' decode
    attention reads 64 x 2,000 x 4,096 bytes and takes the measured kernel's fixed time plus those bytes at its
    share of HBM, not the roofline's time: the iteration differs from the roofline's by 32 times the difference.
    DeepSeek-V3's latent attention (MLA) is another kernel: its iteration does not change."""
    c = Cluster(ClusterSpec(gpu="h100-sxm", num_gpus=1))
    gpu = c.gpu
    measured = Efficiency.from_gpu(gpu)
    roofline = dataclasses.replace(measured, decode_attention=())
    fixed, share = dict((d, (t, s)) for d, t, s in measured.decode_attention)["bf16"]
    read = 64 * 2000 * kv_bytes_per_token_layer(LLAMA8, 1, 2)
    assert read == 64 * 2000 * 4096
    flops = 2.0 * 64 * LLAMA8.num_heads * 2000 * 2 * LLAMA8.head_size
    before = op_time(flops, read, "attention", gpu.peak_flops("bf16"), gpu.hbm_bytes_per_s, roofline)
    after = max(before, fixed + read / (gpu.hbm_bytes_per_s * share))
    assert after > before  # the measured kernel is the slower here
    one = EngineLayout(tp=1)
    new = iteration_time(LLAMA8, c, one, 64, 2000, 0, 0, StepOptions(), measured).seconds
    old = iteration_time(LLAMA8, c, one, 64, 2000, 0, 0, StepOptions(), roofline).seconds
    assert new - old == pytest.approx(LLAMA8.num_layers * (after - before), rel=1e-9)
    h200 = Cluster(ClusterSpec(gpu="h200", num_gpus=8))
    mla = Efficiency.from_gpu(h200.gpu)
    eight = EngineLayout(tp=8)
    opts = StepOptions(weight_dtype="fp8", kv_dtype="fp8")
    assert iteration_time(DSV3, h200, eight, 64, 2000, 0, 0, opts, mla).seconds == \
        iteration_time(DSV3, h200, eight, 64, 2000, 0, 0, opts, dataclasses.replace(mla, decode_attention=())).seconds


def test_a_decode_iteration_takes_the_measured_gemms_per_layer():
    """Llama-3.1-8B, FP8 weights, on one H200, 16 sequences: each of a layer's four linear layers (qkv, out, the
    fused gate/up and down projections) takes the measured kernel's fixed time plus its weight, input and output at
    its share of HBM, in place of the roofline (the launch included: decode replays CUDA graphs). The iteration
    differs from the roofline's by 32 layers times those four differences plus the LM head's."""
    c = Cluster(ClusterSpec(gpu="h200", num_gpus=1))
    gpu = c.gpu
    measured = Efficiency.from_gpu(gpu)
    roofline = dataclasses.replace(measured, decode_gemm=())
    fixed, share = dict((d, (t, s)) for d, t, s in measured.decode_gemm)["fp8"]
    h, f, d = LLAMA8.hidden, LLAMA8.ffn_hidden, LLAMA8.head_size
    shapes = [(16, (LLAMA8.num_heads + 2 * LLAMA8.kv_heads) * d, h), (16, h, LLAMA8.num_heads * d), (16, 2 * f, h),
              (16, h, f)]
    peak = gpu.peak_flops("fp8")

    def change(m: int, n: int, k: int) -> float:
        before = op_time(2.0 * m * n * k, 2 * (m * k + k * n + m * n) / 2, "gemm", peak, gpu.hbm_bytes_per_s, roofline)
        after = fixed + gemm_read_bytes(m, n, k, 1.0) / (gpu.hbm_bytes_per_s * share)
        return after - before

    expected = LLAMA8.num_layers * sum(change(*s) for s in shapes) + change(16, LLAMA8.vocab, h)
    one = EngineLayout(tp=1)
    opts = StepOptions(weight_dtype="fp8", kv_dtype="fp8")
    new = iteration_time(LLAMA8, c, one, 16, 1000, 0, 0, opts, measured).seconds
    old = iteration_time(LLAMA8, c, one, 16, 1000, 0, 0, opts, roofline).seconds
    assert new > old  # the engines' FP8 GEMMs stream at 0.7-0.8 of HBM, below the norm kernels' 0.87
    assert new - old == pytest.approx(expected, rel=1e-9)


def test_a_block_scaled_checkpoint_takes_the_block_scaled_gemms():
    """A config.json whose FP8 quantization_config names a weight_block_size reads as block-scaled, and its decode
    GEMMs take the fp8_block kernel where the engine has one; DeepSeek-V3's zoo file says so too. A block scale on
    BF16 weights is refused."""
    hf = {"model_type": "llama", "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8,
          "num_hidden_layers": 32, "intermediate_size": 14336, "vocab_size": 128256,
          "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    block = from_hf_config(hf, "block")
    tensor = from_hf_config(hf | {"quantization_config": {"quant_method": "fp8"}}, "tensor")
    assert block.weight_block_scaled and block.weight_dtype == "fp8"
    assert not tensor.weight_block_scaled and tensor.weight_dtype == "fp8"
    assert DSV3.weight_block_scaled
    with pytest.raises(ValueError, match="weight_block_scaled describes FP8 weights"):
        ModelSpec.model_validate(LLAMA8.model_dump() | {"weight_block_scaled": True, "weight_dtype": "bf16"})
    c = Cluster(ClusterSpec(gpu="h200", num_gpus=1))
    eff = Efficiency.from_gpu(c.gpu)
    kernels = dict((d, (t, s)) for d, t, s in eff.decode_gemm)
    assert kernels["fp8_block"] != kernels["fp8"]
    opts = StepOptions(weight_dtype="fp8", kv_dtype="fp8")
    one = EngineLayout(tp=1)
    only_block = dataclasses.replace(eff, decode_gemm=(("fp8_block",) + kernels["fp8_block"],))
    only_tensor = dataclasses.replace(eff, decode_gemm=(("fp8",) + kernels["fp8"],))
    none = dataclasses.replace(eff, decode_gemm=())

    def step(model, e):
        return iteration_time(model, c, one, 16, 1000, 0, 0, opts, e).seconds

    assert step(block, only_block) == step(block, eff) != step(block, none) == step(block, only_tensor)
    assert step(tensor, only_tensor) == step(tensor, eff) != step(tensor, none) == step(tensor, only_block)


@pytest.mark.parametrize("op", ["attention", "gemm"])
def test_the_shipped_file_is_what_the_tables_give(op):
    """With the optional extra: H200 TensorRT-LLM's FP8 table fit again gives the file's entry to its digits."""
    pytest.importorskip("aiconfigurator_core")
    pytest.importorskip("pyarrow")
    from meshplan.costmodels.kernel_tables import decode_kernel_fits

    fits, source = decode_kernel_fits("h200", "trtllm", op)
    kernels = dict((d, (t, s)) for d, t, s in decode_kernels("h200", op, "trtllm"))
    assert source.startswith(f"h200_sxm/{op}/trtllm/")
    assert kernels["fp8"][0] == pytest.approx(fits["fp8"].latency_s, abs=1e-8)
    assert kernels["fp8"][1] == pytest.approx(fits["fp8"].bandwidth, abs=1e-4)


def test_a_memory_factor_scales_the_measured_kernels_shares():
    """A calibration's memory factor (efficiency.scaled) slows the measured decode kernels' reads as it slows the
    roofline's, within HBM's rate; their fixed times stay."""
    import math

    from meshplan.costmodels.efficiency import scaled

    gpu = load_gpu("h200")
    eff = Efficiency.from_gpu(gpu)
    _, slow = scaled(gpu, eff, {"memory": math.log(0.5)})
    _, fast = scaled(gpu, eff, {"memory": math.log(3.0)})
    for name in ("decode_attention", "decode_gemm"):
        for (d, t, s), (d2, t2, s2), (_, t3, s3) in zip(getattr(eff, name), getattr(slow, name), getattr(fast, name),
                                                        strict=True):
            assert (d2, t2, t3) == (d, t, t) and s2 == pytest.approx(0.5 * s) and s3 == 1.0


def test_a_block_scale_on_bf16_weights_in_a_model_file_is_one_line(tmp_path, capsys):
    """`serve --model FILE` whose file sets weight_block_scaled with BF16 weights: exit 2, one error line that names
    the key and the fix, no traceback, nothing written."""
    import json

    from cli_helpers import assert_input_error, run

    path = tmp_path / "m.json"
    path.write_text(json.dumps({"name": "m", "layers": 2, "hidden": 64, "heads": 4, "ffn_hidden": 128,
                                "vocab": 100, "weight_dtype": "bf16", "weight_block_scaled": True}))
    out_file = tmp_path / "serve.json"
    code, out, err = run(capsys, "serve", "--model", str(path), "--gpu", "h100-sxm", "--gpus", "1", "--isl", "64",
                         "--osl", "8", "--out", str(out_file))
    assert_input_error(code, out, err, "weight_block_scaled", "fp8")
    assert not out_file.exists()
