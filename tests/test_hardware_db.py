"""The built-in GPU files load, carry sane numbers, and the loader reports bad input as InputError."""

from __future__ import annotations

import tomllib

import pytest
from pydantic import ValidationError

from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import GPUSpec, _gpu_dir, list_gpus, load_gpu, parse_gpu

REQUIRED = {
    "a100-40gb",
    "a100-80gb",
    "h100-sxm",
    "h100-pcie",
    "h800",
    "h200",
    "b200",
    "gb200",
    "mi300x",
    "mi325x",
    "l40s",
    "l4",
}


def _text(name: str) -> str:
    return (_gpu_dir() / f"{name}.toml").read_text()


@pytest.mark.parametrize("name", list_gpus())
def test_every_builtin_gpu_loads(name: str) -> None:
    gpu = load_gpu(name)
    assert isinstance(gpu, GPUSpec)
    assert gpu.name == name  # the file name and the name field agree


def test_required_gpus_present() -> None:
    missing = REQUIRED - set(list_gpus())
    assert not missing, f"missing GPU files: {sorted(missing)}"


@pytest.mark.parametrize("name", list_gpus())
def test_basic_sanity(name: str) -> None:
    gpu = load_gpu(name)
    assert "bf16" in gpu.peak_tflops or "fp16" in gpu.peak_tflops
    assert gpu.hbm_gib.value > 0
    assert gpu.hbm_bytes > 0
    assert gpu.hbm_tb_s.value > 0
    assert gpu.scaleup_domain.value >= 1
    assert float(gpu.scaleup_domain.value).is_integer()
    # dense tensor peaks are far above plain FP32, and FP8 (where present) is at least the 16-bit rate
    half = gpu.peak_tflops.get("bf16") or gpu.peak_tflops["fp16"]
    assert half.value > gpu.peak_tflops["fp32"].value
    if "fp8" in gpu.peak_tflops:
        assert gpu.peak_tflops["fp8"].value >= half.value
    assert "meshplan" in gpu.efficiency.source and 0 < gpu.efficiency.gemm_max <= 1


@pytest.mark.parametrize("name", ["a100-40gb", "a100-80gb"])
def test_a100_has_no_fp8(name: str) -> None:
    assert "fp8" not in load_gpu(name).peak_tflops


@pytest.mark.parametrize("name", ["h100-sxm", "h200", "b200", "mi300x"])
def test_fp8_chips_have_fp8(name: str) -> None:
    gpu = load_gpu(name)
    assert "fp8" in gpu.peak_tflops
    assert gpu.peak_flops("fp8") > 0


def test_hand_checked_values() -> None:
    h100 = load_gpu("h100-sxm")
    assert h100.peak_flops("bf16") == pytest.approx(989.4e12, rel=0.01)
    assert h100.scaleup_gb_s.value == pytest.approx(450)
    assert load_gpu("a100-80gb").hbm_gib.value == 80
    assert load_gpu("h800").scaleup_gb_s.value == pytest.approx(200)
    assert load_gpu("gb200").scaleup_domain.value == 72


def test_load_is_case_insensitive_and_accepts_a_path(tmp_path) -> None:
    assert load_gpu("H100-SXM").name == "h100-sxm"
    path = tmp_path / "custom.toml"
    path.write_text(_text("h100-sxm"))
    assert load_gpu(str(path)).name == "h100-sxm"


def test_unknown_gpu_lists_known_ones() -> None:
    with pytest.raises(InputError) as info:
        load_gpu("nope")
    message = str(info.value)
    assert "nope" in message
    for name in list_gpus():
        assert name in message


def test_malformed_toml_is_input_error() -> None:
    with pytest.raises(InputError) as info:
        parse_gpu('name = "x"\nthis is = = not toml [', "bad.toml")
    assert "bad.toml" in str(info.value)
    assert not isinstance(info.value, ValidationError)


def test_missing_field_is_input_error_not_validation_error() -> None:
    data = tomllib.loads(_text("h100-sxm"))
    lines = [ln for ln in _text("h100-sxm").splitlines() if not ln.startswith("display_name")]
    assert "display_name" in data  # the field really was there before removal
    with pytest.raises(InputError) as info:
        parse_gpu("\n".join(lines), "missing.toml")
    assert not isinstance(info.value, ValidationError)
    assert "missing.toml" in str(info.value)
    assert "display_name" in str(info.value)


def test_missing_bf16_and_fp16_is_input_error() -> None:
    # drop the [peak_tflops.bf16] and [peak_tflops.fp16] tables, keep fp32
    kept, skipping = [], False
    for line in _text("a100-80gb").splitlines():
        if line.startswith("["):
            skipping = line.strip() in ("[peak_tflops.bf16]", "[peak_tflops.fp16]")
        if not skipping:
            kept.append(line)
    cut = "\n".join(kept)
    assert "fp32" in tomllib.loads(cut)["peak_tflops"]
    with pytest.raises(InputError) as info:
        parse_gpu(cut, "nobf16.toml")
    assert "bf16" in str(info.value)


def test_peak_flops_fp8_on_a100_is_input_error() -> None:
    a100 = load_gpu("a100-80gb")
    with pytest.raises(InputError) as info:
        a100.peak_flops("fp8")
    assert "fp8" in str(info.value)
    assert "bf16" in str(info.value)  # says what the chip does have
