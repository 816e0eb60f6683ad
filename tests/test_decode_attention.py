"""Decode attention on paged caches from the engines' measured kernels (hardware_db/decode_attention.py): the fit
recovers a known kernel, refuses one faster than HBM, the shipped file covers the measured deployments' GPUs and
engines, serving's decode iterations take it per layer exactly (MLA keeps its roofline), and the shipped file is
what the tables give (with the optional extra meshplan[aic])."""

from __future__ import annotations

import dataclasses

import pytest

from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.kernel_tables import DecodePoint, fit_decode_attention
from meshplan.costmodels.model_io import load_zoo
from meshplan.costmodels.serving import EngineLayout, StepOptions, iteration_time, kv_bytes_per_token_layer
from meshplan.costmodels.timing import op_time
from meshplan.hardware_db.cluster import Cluster, ClusterSpec
from meshplan.hardware_db.decode_attention import decode_attention_kernels, parse_decode_attention
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import load_gpu

LLAMA8 = load_zoo("llama3.1-8b")
DSV3 = load_zoo("deepseek-v3")
HBM = 3.35e12


def test_the_fit_recovers_a_kernel_it_is_given():
    """Rows made by 12 us + bytes / (0.7 x HBM), 1 MB to 4 GB: the fit gives back 12 us and 0.7, exactly."""
    points = [DecodePoint("fp8", b, 12e-6 + b / (0.7 * HBM)) for b in (1e6, 3e6, 1e7, 5e7, 2e8, 1e9, 4e9)]
    fit = fit_decode_attention(points, HBM)
    assert fit.latency_s == pytest.approx(12e-6, rel=1e-9)
    assert fit.bandwidth == pytest.approx(0.7, rel=1e-9)
    assert fit.rows == 7 and fit.log_spread == pytest.approx(0.0, abs=1e-9)


def test_a_table_faster_than_hbm_is_refused():
    points = [DecodePoint("bf16", b, 5e-6 + b / (1.2 * HBM)) for b in (1e6, 1e7, 1e8, 1e9)]
    with pytest.raises(InputError, match="1.20 of HBM bandwidth"):
        fit_decode_attention(points, HBM)


def test_the_shipped_file_covers_the_measured_gpus_and_engines():
    """Every GPU of AIConfigurator's measured deployments, each engine, both KV dtypes, within physical bounds; no
    engine takes the engines' median; a GPU without tables keeps the roofline."""
    for gpu in ("h100-sxm", "h200", "b200", "b300", "gb200", "gb300"):
        medians = dict((d, (t, s)) for d, t, s in decode_attention_kernels(gpu))
        assert set(medians) == {"bf16", "fp8"}
        for engine in ("sglang", "trtllm", "vllm"):
            kernels = {d: (t, s) for d, t, s in decode_attention_kernels(gpu, engine)}
            assert set(kernels) == {"bf16", "fp8"}
            assert all(5e-6 < t < 30e-6 and 0.4 < s <= 1.0 for t, s in kernels.values())
        for dtype, (t, s) in medians.items():
            each = [dict((d, (x, y)) for d, x, y in decode_attention_kernels(gpu, e))[dtype]
                    for e in ("sglang", "trtllm", "vllm")]
            assert t == sorted(x for x, _ in each)[1] and s == sorted(y for _, y in each)[1]
    assert decode_attention_kernels("mi300x") == ()
    assert Efficiency.from_gpu(load_gpu("mi300x")).decode_attention == ()


def test_a_malformed_table_file_gets_one_line():
    text = ('source = "x y z"\n[[kernel]]\ngpu = "h200"\nengine = "vllm"\nkv_dtype = "fp8"\nlatency_us = 10\n'
            'bandwidth = 1.5\nrows = 3\nlog_spread = 0.1\ntable = "h200_sxm/attention/vllm/0.24.0"\n')
    with pytest.raises(InputError, match=r"^bad.toml: .*bandwidth"):
        parse_decode_attention(text, "bad.toml")


def test_a_decode_iteration_takes_the_measured_kernel_per_layer():
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


def test_the_shipped_file_is_what_the_tables_give():
    """With the optional extra: H200 TensorRT-LLM's FP8 table fit again gives the file's entry to its digits."""
    pytest.importorskip("aiconfigurator_core")
    pytest.importorskip("pyarrow")
    from meshplan.costmodels.kernel_tables import decode_attention_fits

    fits, source = decode_attention_fits("h200", "trtllm")
    kernels = dict((d, (t, s)) for d, t, s in decode_attention_kernels("h200", "trtllm"))
    assert source.startswith("h200_sxm/attention/trtllm/")
    assert kernels["fp8"][0] == pytest.approx(fits["fp8"].latency_s, abs=1e-8)
    assert kernels["fp8"][1] == pytest.approx(fits["fp8"].bandwidth, abs=1e-4)
