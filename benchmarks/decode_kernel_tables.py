"""Decode attention on paged caches and decode GEMMs from the engines' measured kernels (issue 45 item 2): fits
t = latency + bytes / (HBM x share) to each of AIConfigurator's generation-attention tables (per GPU, engine and KV
cache dtype) and GEMM tables (per GPU, engine and weight format, at 64 tokens or fewer;
costmodels.kernel_tables.fit_decode_kernel) and prints, beside each, how far the roofline meshplan used before
(timing.op_time at the GPU's defaults) was from the same rows. --write puts the fits in the file meshplan ships,
hardware_db/decode_kernels.toml, which serving's iterations then use (costmodels/serving.py).

    pip install 'meshplan[aic]' && python benchmarks/decode_kernel_tables.py \
        [--write hardware_db/decode_kernels.toml]
(about 40 s)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from meshplan.costmodels.efficiency import Efficiency  # noqa: E402
from meshplan.costmodels.kernel_tables import (DECODE_ENGINES, SYSTEMS, ReadPoint, aic_package,  # noqa: E402
                                               decode_gemm_points, decode_points, fit_decode_kernel)
from meshplan.costmodels.timing import op_time  # noqa: E402
from meshplan.hardware_db.decode_kernels import parse_decode_kernels  # noqa: E402
from meshplan.hardware_db.errors import InputError  # noqa: E402
from meshplan.hardware_db.gpu import GPUSpec, load_gpu  # noqa: E402
from meshplan.planner.plan import write_text_atomic  # noqa: E402

BANDS = ((1e6, 1e7), (1e7, 1e8), (1e8, 1e9), (1e9, math.inf))  # bytes read per call
PEAK = {"bf16": "bf16", "fp8": "fp8", "fp8_block": "fp8", "fp4": "fp4"}  # weight format -> the peak its GEMM runs at


def _version() -> str:
    from importlib.metadata import version

    return version("aiconfigurator-core")


def _before(p: ReadPoint, op: str, gpu: GPUSpec, eff: Efficiency) -> float:
    """The roofline meshplan priced the row with before: attention, its bytes at the memory-bound kernels' share
    plus a launch (the FLOPs side is below it for GQA at one query per sequence); a GEMM, op_time at its format's
    peak."""
    if op == "attention":
        return op_time(0.0, p.bytes_read, "attention", gpu.peak_flops("bf16"), gpu.hbm_bytes_per_s, eff)
    return op_time(p.flops, p.bytes_read, "gemm", gpu.peak_flops(PEAK[p.dtype]), gpu.hbm_bytes_per_s, eff)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, metavar="FILE", help="write the fits as TOML there (hardware_db/"
                    "decode_kernels.toml is the file meshplan ships)")
    args = ap.parse_args()
    try:
        aic_package()
        version = _version()
    except (InputError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("model / measured, median by bytes read per call (1-10 MB, 10-100 MB, 0.1-1 GB, 1 GB+): the roofline "
          "before (op_time) | the fit; fit: fixed time, share of HBM, median |log error|")
    entries = []
    for op, read in (("attention", decode_points), ("gemm", decode_gemm_points)):
        for gpu_name in sorted(SYSTEMS):
            gpu = load_gpu(gpu_name)
            eff = Efficiency.from_gpu(gpu)
            for engine in DECODE_ENGINES:
                try:
                    points, source = read(gpu_name, engine)
                except InputError as exc:
                    print(f"{op:9s} {gpu_name:9s} {engine:7s} skipped: {exc}")
                    continue
                for dtype in sorted({p.dtype for p in points}):
                    if PEAK.get(dtype) == "fp4" and "fp4" not in gpu.peak_tflops:
                        continue
                    rows = [p for p in points if p.dtype == dtype]
                    try:
                        fit = fit_decode_kernel(rows, gpu.hbm_bytes_per_s)
                    except InputError as exc:
                        print(f"{op:9s} {gpu_name:9s} {engine:7s} {dtype:9s} refused: {exc}")
                        continue
                    cells = []
                    for lo, hi in BANDS:
                        band = [p for p in rows if lo <= p.bytes_read < hi]
                        if not band:
                            cells.append("     -     ")
                            continue
                        before = statistics.median(_before(p, op, gpu, eff) / p.latency_s for p in band)
                        after = statistics.median((fit.latency_s + p.bytes_read / (gpu.hbm_bytes_per_s
                                                                                    * fit.bandwidth))
                                                  / p.latency_s for p in band)
                        cells.append(f"{before:.2f} | {after:.2f}")
                    print(f"{op:9s} {gpu_name:9s} {engine:7s} {dtype:9s} {fit.rows:6d} rows  "
                          f"{fit.latency_s * 1e6:5.1f} us  {fit.bandwidth:.2f}  {fit.log_spread:.3f}   "
                          + "   ".join(cells))
                    entries.append((gpu_name, engine, op, dtype, fit, source))
    if args.write:
        lines = [f'source = "fit by benchmarks/decode_kernel_tables.py to aiconfigurator-core {version}\'s '
                 f'generation-attention tables (systems/data/<table>/generation_attention_perf.parquet, full '
                 f'attention, reads of 1 MB or more) and GEMM tables (gemm_perf.parquet, 64 tokens or fewer, '
                 f'weights of 2^20 elements or more): t = latency + bytes / (HBM x bandwidth), least squares on '
                 f'the relative error"', ""]
        for gpu_name, engine, op, dtype, fit, source in entries:
            lines += ["[[kernel]]", f'gpu = "{gpu_name}"', f'engine = "{engine}"', f'op = "{op}"',
                      f'dtype = "{dtype}"', f"latency_us = {fit.latency_s * 1e6:.2f}",
                      f"bandwidth = {fit.bandwidth:.4f}", f"rows = {fit.rows}", f"log_spread = {fit.log_spread:.4f}",
                      f'table = "{source}"', ""]
        text = "\n".join(lines)
        parse_decode_kernels(text, str(args.write))  # what is written reads back
        write_text_atomic(args.write, text)
        print(f"wrote {args.write}: {len(entries)} tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
