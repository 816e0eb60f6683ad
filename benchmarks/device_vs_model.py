"""The cost model's kernel rates against those measured on a GPU by benchmarks/device_kernel_clocks.py.

Reads the JSON files that script wrote (default: the lent H200's, benchmarks/device_results/h200-2026-12-04) and
prints, for each kernel measured at the power limit ("sustained"), the measured and the modelled TFLOP/s and their
ratio, with the median per family. Needs no GPU: `python benchmarks/device_vs_model.py [--gpu h200] [DIR]`.
GEMMs are priced as the kernels TransformerEngine runs (FP8 forward GEMMs in fast accumulation, the backward's
split: the forward FP8 rows come from the `--fast-accum` file where it exists); grouped GEMMs one per expert on
kernels.TE_GEMM_STREAMS streams; attention by its kernel (cuDNN, or PyTorch SDPA's FlashAttention-2 copy).
The harness launches each expert's GEMM from a Python loop, so small experts (Qwen3-30B's, and Qwen3-235B's FP8
ones) measure the host's launch rate, not the GPU's: only DeepSeek-V3's expert GEMMs are evidence for the ceilings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from device_kernel_clocks import EXPERTS, LINEARS

from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.timing import KernelShape, op_time
from meshplan.costmodels.kernels import TE_GEMM_STREAMS
from meshplan.hardware_db.gpu import load_gpu

DEFAULT_DIR = ROOT / "benchmarks" / "device_results" / "h200-2026-12-04"
PASSES = {"fwd": lambda t, o, i: (t, o, i), "dgrad": lambda t, o, i: (t, i, o), "wgrad": lambda t, o, i: (o, i, t)}
EXPERT_PASSES = {"fc1_fwd": lambda t, h, f: (t, 2 * f, h), "fc2_fwd": lambda t, h, f: (t, h, f),
                 "fc1_wgrad": lambda t, h, f: (2 * f, h, t)}


def sustained(directory: Path) -> dict[str, float]:
    """kernel name -> TFLOP/s at the power limit, over every file in the directory (fast-accumulation FP8 rows
    under their plain names with a `_fast` suffix)."""
    rates: dict[str, float] = {}
    for path in sorted(directory.glob("*.json")):
        for r in json.loads(path.read_text())["readings"]:
            if r["mode"] == "sustained":
                rates[r["kernel"]] = r["tflops"]
    return rates


def modelled(name: str, gpu_name: str) -> tuple[str, float] | None:
    """(family, the model's TFLOP/s) for one measured kernel name, None for kernels it has no counterpart for."""
    gpu = load_gpu(gpu_name)
    eff = Efficiency.from_gpu(gpu)

    def gemm_rate(m: int, n: int, k: int, dtype: str, groups: int = 1) -> float:
        flops = 2.0 * m * n * k * groups
        shape = KernelShape(depth=k, groups=groups, streams=TE_GEMM_STREAMS if groups > 1 else 0,
                            fp8="tensorwise" if dtype == "fp8" else None)
        t = op_time(flops, 0.0, "gemm", gpu.peak_flops(dtype), gpu.hbm_bytes_per_s, eff, shape=shape)
        return flops / t / 1e12

    if name.startswith("attn_"):
        _, backend, pass_, seq = name.split("_")
        s, batch, heads, dim = int(seq), 16384 // int(seq), 32, 128
        flops = 4.0 * batch * heads * s * s * dim / 2 * (2.5 if pass_ == "bwd" else 1.0)
        kernel = "cudnn" if backend == "cudnn" else "sdpa-fa2"
        t = op_time(flops, 0.0, "attention", gpu.peak_flops("bf16"), gpu.hbm_bytes_per_s, eff, pass_ == "bwd",
                    KernelShape(keys=s, kernel=kernel))
        return f"attention {backend} {pass_}", flops / t / 1e12
    dtype = name.rsplit("_", 1)[1]
    head, _, shape_text = name.rsplit("_", 1)[0].rpartition("_")
    if head in ("k", "size", "mixed_k"):  # the shape sweeps: alone (the clock rises for shallow GEMMs) or after a
        m, n, k = (int(x) for x in shape_text.split("x"))  # dense GEMM (a training step's clock)
        family = {"k": "k sweep alone", "size": "size sweep alone", "mixed_k": "k sweep after a dense GEMM"}[head]
        return f"{family} {dtype}", gemm_rate(m, n, k, dtype)
    for label, tokens, out, inp in LINEARS:
        for pass_, shape in PASSES.items():
            if name == f"{label}_{pass_}_{dtype}":
                return f"gemm {dtype}", gemm_rate(*shape(tokens, out, inp), dtype)
    for label, experts, tokens, hidden, ffn in EXPERTS:
        for pass_, shape in EXPERT_PASSES.items():
            if name == f"{label}_{pass_}_{dtype}":
                return f"grouped {label} {dtype}", gemm_rate(*shape(tokens, hidden, ffn), dtype, groups=experts)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", nargs="?", default=str(DEFAULT_DIR))
    parser.add_argument("--gpu", default="h200", help="the hardware_db GPU the measurements were taken on")
    args = parser.parse_args()
    rates = sustained(Path(args.directory))
    by_family: dict[str, list[float]] = {}
    print(f"{'kernel':30s} {'measured':>9s} {'model':>8s} {'measured/model':>15s}")
    for name, measured in rates.items():
        if name.endswith("_fast") or name.startswith("gemm_"):  # the clocks suite's 8192^3 pair: in the sweep
            continue
        if name.endswith("_fp8") and "_fwd_" in name and f"{name}_fast" in rates:
            measured = rates[f"{name}_fast"]  # TransformerEngine's forward FP8 GEMMs accumulate fast
        priced = modelled(name, args.gpu)
        if priced is None:
            continue
        family, model = priced
        by_family.setdefault(family, []).append(measured / model)
        print(f"{name:30s} {measured:9.1f} {model:8.1f} {measured / model:15.3f}")
    print("\nmedian measured / model by family:")
    for family, ratios in by_family.items():
        print(f"  {family:32s} {statistics.median(ratios):.3f}  ({len(ratios)} kernels, "
              f"{min(ratios):.3f}-{max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
