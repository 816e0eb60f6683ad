"""Decode attention on paged KV caches from the engines' measured kernels (issue 45 item 2): fits t = latency +
bytes / (HBM x share) to each of AIConfigurator's generation-attention tables (per GPU, engine and KV cache dtype;
costmodels.kernel_tables.fit_decode_attention) and prints, beside it, how far the roofline meshplan used before
(timing.op_time at the GPU's defaults) was from the same rows. --write puts the fits in the file meshplan ships,
hardware_db/decode_attention.toml, which serving's decode iterations then use (costmodels/serving.py).

    pip install 'meshplan[aic]' && python benchmarks/decode_attention_tables.py \
        [--write hardware_db/decode_attention.toml]
(about 10 s)
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
from meshplan.costmodels.kernel_tables import (DECODE_ENGINES, SYSTEMS, aic_package, decode_points,  # noqa: E402
                                               fit_decode_attention)
from meshplan.costmodels.timing import op_time  # noqa: E402
from meshplan.hardware_db.decode_attention import parse_decode_attention  # noqa: E402
from meshplan.hardware_db.errors import InputError  # noqa: E402
from meshplan.hardware_db.gpu import load_gpu  # noqa: E402
from meshplan.planner.plan import write_text_atomic  # noqa: E402

BANDS = ((1e6, 1e7), (1e7, 1e8), (1e8, 1e9), (1e9, math.inf))  # bytes read per call


def _version() -> str:
    from importlib.metadata import version

    return version("aiconfigurator-core")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, metavar="FILE", help="write the fits as TOML there (hardware_db/"
                    "decode_attention.toml is the file meshplan ships)")
    args = ap.parse_args()
    try:
        aic_package()
        version = _version()
    except (InputError, ImportError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("model / measured, median by bytes read per call: the roofline before (op_time) | the fit; "
          "fit: fixed time, share of HBM, median |log error|")
    entries = []
    for gpu_name in sorted(SYSTEMS):
        gpu = load_gpu(gpu_name)
        eff = Efficiency.from_gpu(gpu)
        peak = gpu.peak_flops("bf16" if "bf16" in gpu.peak_tflops else "fp16")
        for engine in DECODE_ENGINES:
            try:
                points, source = decode_points(gpu_name, engine)
            except InputError as exc:
                print(f"{gpu_name:9s} {engine:7s} skipped: {exc}")
                continue
            for dtype in sorted({p.kv_dtype for p in points}):
                rows = [p for p in points if p.kv_dtype == dtype]
                try:
                    fit = fit_decode_attention(rows, gpu.hbm_bytes_per_s)
                except InputError as exc:
                    print(f"{gpu_name:9s} {engine:7s} {dtype:4s} skipped: {exc}")
                    continue
                cells = []
                for lo, hi in BANDS:
                    band = [p for p in rows if lo <= p.bytes_read < hi]
                    if not band:
                        cells.append("-")
                        continue
                    # the roofline before: the op's bytes at the memory-bound kernels' share, plus a launch (the
                    # FLOPs side is below it for these GQA shapes at one query per sequence)
                    before = statistics.median(op_time(0.0, p.bytes_read, "attention", peak, gpu.hbm_bytes_per_s,
                                                       eff) / p.latency_s for p in band)
                    after = statistics.median((fit.latency_s + p.bytes_read / (gpu.hbm_bytes_per_s * fit.bandwidth))
                                              / p.latency_s for p in band)
                    cells.append(f"{before:.2f} | {after:.2f}")
                print(f"{gpu_name:9s} {engine:7s} {dtype:4s} {fit.rows:6d} rows  {fit.latency_s * 1e6:5.1f} us  "
                      f"{fit.bandwidth:.2f}  {fit.log_spread:.3f}   " + "   ".join(cells))
                entries.append((gpu_name, engine, dtype, fit, source))
    if args.write:
        lines = [f'source = "fit by benchmarks/decode_attention_tables.py to aiconfigurator-core {version}\'s '
                 f'generation-attention tables (systems/data/<table>/generation_attention_perf.parquet, full '
                 f'attention, reads of 1 MB or more): t = latency + bytes / (HBM x bandwidth), least squares on the '
                 f'relative error"', ""]
        for gpu_name, engine, dtype, fit, source in entries:
            lines += ["[[kernel]]", f'gpu = "{gpu_name}"', f'engine = "{engine}"', f'kv_dtype = "{dtype}"',
                      f"latency_us = {fit.latency_s * 1e6:.2f}", f"bandwidth = {fit.bandwidth:.4f}",
                      f"rows = {fit.rows}", f"log_spread = {fit.log_spread:.4f}", f'table = "{source}"', ""]
        text = "\n".join(lines)
        parse_decode_attention(text, str(args.write))  # what is written reads back
        write_text_atomic(args.write, text)
        print(f"wrote {args.write}: {len(entries)} tables")
    return 0


if __name__ == "__main__":
    sys.exit(main())
