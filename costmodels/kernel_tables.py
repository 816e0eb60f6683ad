"""Measured kernel tables (issue 44, setting (b)): NVIDIA AIConfigurator's GEMM measurements (Apache-2.0, shipped in
the `aiconfigurator-core` wheel, the optional extra `meshplan[aic]`), read to give the cost model's GEMM factor a
measured centre and spread for a GPU. Nothing here is fit to training runs: a table's factor comes from kernel
timings alone, so predictions under it are held out from every published run.

A table row is one GEMM (dtype, m, n, k) and its latency in milliseconds (`systems/data/<system>/gemm/<framework>/
<version>/gemm_perf.parquet`, columns m, n, k, gemm_dtype, latency; the `torch_flow` rows time torch's matmul, i.e.
cuBLAS, the library Megatron-Core and torchtitan call for dense GEMMs). Only training shapes are read (TRAINING_M
tokens or more, both weight dimensions TRAINING_NK or more): inference's small-m GEMMs sit on another part of the
efficiency curve. The factor is exp(median log(predicted / measured)) over those rows, in BF16 and per-tensor FP8;
its spread is the rows' scaled median absolute deviation (1.4826 MAD: the standard deviation of a normal).

The same wheel's generation-attention and GEMM tables give serving's decode attention on paged caches and its decode
GEMMs (issue 45 item 2): fit_decode_kernel below, written to hardware_db/decode_kernels.toml by
benchmarks/decode_kernel_tables.py.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from importlib import resources
from typing import Any

from meshplan.costmodels.efficiency import Efficiency
from meshplan.costmodels.timing import KernelShape, op_time
from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import GPUSpec, load_gpu

EXTRA = "pip install 'meshplan[aic]'"  # the optional extra that brings aiconfigurator-core (pyproject.toml)
PACKAGE = "aiconfigurator_core"
# meshplan GPU -> AIConfigurator system (aiconfigurator_core/systems/<system>.yaml): the same part and memory
SYSTEMS = {"a100-80gb": "a100_sxm", "h100-sxm": "h100_sxm", "h200": "h200_sxm", "b200": "b200_sxm",
           "b300": "b300_sxm", "gb200": "gb200", "gb300": "gb300"}
FRAMEWORK = "trtllm"  # its GEMM rows are torch matmul (cuBLAS), as training frameworks call
TRAINING_M, TRAINING_NK = 2048, 1024
DTYPES = {"bfloat16": None, "fp8": "tensorwise"}  # table dtype -> meshplan FP8 recipe (None: BF16)
PRECISION = {"bfloat16": "bf16", "fp8": "fp8"}  # table dtype -> the workload dtype it stands for
MAD_TO_SD = 1.4826  # a normal's standard deviation over its median absolute deviation


@dataclass(frozen=True)
class GemmPoint:
    dtype: str  # the table's gemm_dtype
    m: int
    n: int
    k: int
    latency_s: float


@dataclass(frozen=True)
class KernelFactor:
    """A measured GEMM factor for one GPU and precision: the centre and spread of log(predicted / measured) over a
    table's rows (a factor above 1: the table's kernels are faster than the cost model's defaults)."""

    gpu: str
    dtype: str  # "bf16" or "fp8" (per-tensor FP8 rows)
    source: str  # system / framework / version of the table
    log_factor: float
    log_sd: float
    rows: int


def aic_package() -> Any:
    try:
        return resources.files(PACKAGE)
    except ModuleNotFoundError:
        raise InputError(f"AIConfigurator's kernel tables come with the optional extra: {EXTRA}") from None


def gemm_table_path(gpu: str) -> tuple[Any, str]:
    """The newest GEMM table of FRAMEWORK for this GPU, and where it is from."""
    system = SYSTEMS.get(gpu)
    if system is None:
        raise InputError(f"AIConfigurator has no GEMM table for {gpu}; it covers {', '.join(sorted(SYSTEMS))}")
    folder = aic_package().joinpath("systems", "data", system, "gemm", FRAMEWORK)
    if not folder.is_dir():
        raise InputError(f"the installed aiconfigurator-core has no {FRAMEWORK} GEMM table for {system} ({gpu}); "
                         f"upgrade it ({EXTRA})")
    newest = _newest_version(folder, "gemm_perf.parquet")
    if newest is None:
        raise InputError(f"the installed aiconfigurator-core has no {FRAMEWORK} GEMM table for {system} ({gpu})")
    return folder.joinpath(newest, "gemm_perf.parquet"), f"aiconfigurator-core {system}/{FRAMEWORK}/{newest}"


def _newest_version(folder: Any, table: str) -> str | None:
    """The newest version folder under `folder` that holds `table` (PEP 440 order; names that are no version sort
    first), or None."""
    from packaging.version import InvalidVersion, Version

    def order(name: str) -> tuple[int, Any]:
        try:
            return 1, Version(name)
        except InvalidVersion:
            return 0, name

    versions = sorted((v.name for v in folder.iterdir() if v.joinpath(table).is_file()), key=order) \
        if folder.is_dir() else []
    return versions[-1] if versions else None


def gemm_points(gpu: str) -> tuple[list[GemmPoint], str]:
    """The table's training-shape rows for this GPU (BF16 and per-tensor FP8), and where they are from."""
    path, source = gemm_table_path(gpu)
    import pyarrow.parquet as pq  # a dependency of aiconfigurator-core

    with resources.as_file(path) as local:
        table = pq.read_table(local, columns=["gemm_dtype", "m", "n", "k", "latency"]).to_pydict()
    points = [GemmPoint(d, m, n, k, lat / 1e3) for d, m, n, k, lat in zip(
        table["gemm_dtype"], table["m"], table["n"], table["k"], table["latency"], strict=True)
        if d in DTYPES and m >= TRAINING_M and n >= TRAINING_NK and k >= TRAINING_NK and lat > 0]
    if not points:
        raise InputError(f"{source} holds no training-shape GEMM (m >= {TRAINING_M}, n and k >= {TRAINING_NK})")
    return points, source


def predicted_gemm_s(p: GemmPoint, gpu: GPUSpec, eff: Efficiency) -> float:
    """The cost model's time for one table GEMM: 2mnk FLOPs, its operands read once in their precision (FP8: one
    byte) and its output written once in 16 bits (timing.op_time), at the inner dimension k."""
    recipe = DTYPES[p.dtype]
    peak = gpu.peak_flops("fp8" if recipe else "bf16")
    element = 1 if recipe else 2
    bytes_ = element * (p.m * p.k + p.k * p.n) + 2 * p.m * p.n
    return op_time(2.0 * p.m * p.n * p.k, bytes_, "gemm", peak, gpu.hbm_bytes_per_s, eff,
                   shape=KernelShape(depth=p.k, fp8=recipe))


def gemm_factors(gpu_name: str) -> dict[str, KernelFactor]:
    """The measured GEMM factors of a GPU, by workload dtype (module docstring). BF16 and FP8 are apart: on every
    table with both, the BF16 median is 30-55 % above the FP8 one, so one factor for both would fit neither."""
    points, source = gemm_points(gpu_name)
    gpu = load_gpu(gpu_name)
    eff = Efficiency.from_gpu(gpu)
    logs: dict[str, list[float]] = {}
    for p in points:
        logs.setdefault(PRECISION[p.dtype], []).append(math.log(predicted_gemm_s(p, gpu, eff) / p.latency_s))
    out = {}
    for dtype, xs in logs.items():
        centre = statistics.median(xs)
        out[dtype] = KernelFactor(gpu_name, dtype, source, centre,
                                  MAD_TO_SD * statistics.median(abs(x - centre) for x in xs), len(xs))
    return out


def gemm_prior(gpu_name: str, dtypes: list[str]) -> KernelFactor:
    """The table factor a calibration's GEMM prior centres on: the GPU's, for the precision most of the runs
    trained in (`dtypes`, their workloads'; FP8 recipes share the per-tensor FP8 rows)."""
    dtype = "fp8" if dtypes.count("fp8") > len(dtypes) / 2 else "bf16"
    found = gemm_factors(gpu_name).get(dtype)
    if found is None:
        raise InputError(f"AIConfigurator's table for {gpu_name} has no {dtype} GEMMs; use --kernels none")
    return found


# Decode kernels (issue 45 item 2): AIConfigurator's tables of the engines' own kernels, timed under CUDA graphs as the
# engines run decode (collector/helper.py benchmark_with_power), give the two ops that read most of a decode step's
# bytes a measured fixed time and share of HBM bandwidth:
# - attention: `systems/data/<system>/attention/<engine>/<version>/generation_attention_perf.parquet`, one row per
#   (batch_size, step = cached tokens, num_heads, num_key_value_heads, head_dim, window_size, kv_cache_dtype) and its
#   latency in ms. Full attention only (window 0); reads below DECODE_MIN_BYTES are left out (a served model's layer
#   reads more: 64 sequences of 1,000 tokens through one 128-wide FP8 KV head, 16 MB).
# - GEMMs: `gemm/<engine>/<version>/gemm_perf.parquet` (columns m, n, k, gemm_dtype, latency in ms), each engine's
#   own linear kernel per weight format; rows of DECODE_GEMM_M tokens or fewer, where a GEMM streams its weight, and
#   weights of DECODE_MIN_WEIGHTS elements or more (a served model's projections are larger).
DECODE_ENGINES = ("sglang", "trtllm", "vllm")
DECODE_KV = {"bfloat16": ("bf16", 2), "fp8": ("fp8", 1)}  # table dtype -> (meshplan KV dtype, bytes per element)
DECODE_MIN_BYTES = 1e6
# table gemm_dtype -> (meshplan weight format, bytes per weight and per activation element): NVFP4 packs two values
# a byte and one FP8 scale per 16 (NVIDIA's NVFP4 format, TensorRT Model Optimizer docs); FP8 block scales (one FP32
# per 128x128 block, DeepSeek-V3 report sec. 3.3.2) add 1/4096 of a byte: left out
GEMM_FORMATS = {"bfloat16": ("bf16", 2.0), "fp8": ("fp8", 1.0), "fp8_block": ("fp8_block", 1.0),
                "nvfp4": ("fp4", 0.5625)}
DECODE_GEMM_M = 64
DECODE_MIN_WEIGHTS = 2 ** 20


@dataclass(frozen=True)
class ReadPoint:
    dtype: str  # meshplan's: the KV cache dtype (attention) or the weight format (GEMM)
    bytes_read: float  # attention: the cached K and V of every sequence, once; GEMM: weight, input and output once
    latency_s: float
    flops: float = 0.0  # GEMM: 2mnk (what the roofline before prices beside the bytes)


@dataclass(frozen=True)
class DecodeKernelFit:
    """t = latency_s + bytes / (HBM x bandwidth) over one table's rows of one dtype, and how well it holds: the
    median |log(fit / measured)|."""

    latency_s: float
    bandwidth: float
    rows: int
    log_spread: float


def decode_table_path(gpu: str, engine: str, op: str) -> tuple[Any, str]:
    """The newest table of `engine`'s decode `op` ("attention" or "gemm") for this GPU, and its system/folder/engine/
    version."""
    system = SYSTEMS.get(gpu)
    if system is None:
        raise InputError(f"AIConfigurator has no {op} table for {gpu}; it covers {', '.join(sorted(SYSTEMS))}")
    folder_name, name = {"attention": ("attention", "generation_attention_perf.parquet"),
                         "gemm": ("gemm", "gemm_perf.parquet")}[op]
    folder = aic_package().joinpath("systems", "data", system, folder_name, engine)
    newest = _newest_version(folder, name)
    if newest is None:
        raise InputError(f"the installed aiconfigurator-core has no {engine} {op} table for {system} ({gpu}); "
                         f"upgrade it ({EXTRA})")
    return folder.joinpath(newest, name), f"{system}/{folder_name}/{engine}/{newest}"


def decode_points(gpu: str, engine: str) -> tuple[list[ReadPoint], str]:
    """The attention table's full-attention rows for this GPU and engine (note above), and where they are from."""
    path, source = decode_table_path(gpu, engine, "attention")
    import pyarrow.parquet as pq  # a dependency of aiconfigurator-core

    columns = ["batch_size", "step", "num_key_value_heads", "head_dim", "window_size", "kv_cache_dtype", "latency"]
    with resources.as_file(path) as local:
        have = set(pq.read_schema(local).names)
        t = pq.read_table(local, columns=[c for c in columns if c in have]).to_pydict()
    t.setdefault("window_size", [0] * len(t["latency"]))  # older tables time full attention only
    points = []
    for b, s, kv, d, w, dtype, lat in zip(*(t[c] for c in columns), strict=True):
        if w or dtype not in DECODE_KV or lat <= 0:
            continue
        name, element = DECODE_KV[dtype]
        read = 2.0 * b * s * kv * d * element  # K and V
        if read >= DECODE_MIN_BYTES:
            points.append(ReadPoint(name, read, lat / 1e3))
    if not points:
        raise InputError(f"{source} holds no full-attention decode row reading {DECODE_MIN_BYTES:.0e} bytes or more")
    return points, source


def gemm_read_bytes(m: float, n: float, k: float, element: float) -> float:
    """A decode GEMM's traffic: its [k, n] weight and [m, k] input at the weight format's width, its output in 16
    bits, each once."""
    return element * (n * k + m * k) + 2.0 * m * n


def decode_gemm_points(gpu: str, engine: str) -> tuple[list[ReadPoint], str]:
    """The GEMM table's decode rows for this GPU and engine (note above), and where they are from."""
    path, source = decode_table_path(gpu, engine, "gemm")
    import pyarrow.parquet as pq  # a dependency of aiconfigurator-core

    with resources.as_file(path) as local:
        t = pq.read_table(local, columns=["gemm_dtype", "m", "n", "k", "latency"]).to_pydict()
    points = [ReadPoint(GEMM_FORMATS[d][0], gemm_read_bytes(m, n, k, GEMM_FORMATS[d][1]), lat / 1e3, 2.0 * m * n * k)
              for d, m, n, k, lat in zip(t["gemm_dtype"], t["m"], t["n"], t["k"], t["latency"], strict=True)
              if d in GEMM_FORMATS and lat > 0 and m <= DECODE_GEMM_M and n * k >= DECODE_MIN_WEIGHTS]
    if not points:
        raise InputError(f"{source} holds no GEMM of {DECODE_GEMM_M} tokens or fewer")
    return points, source


def fit_decode_kernel(points: list[ReadPoint], hbm_bytes_per_s: float) -> DecodeKernelFit:
    """Least squares on the relative error (each row's equation divided by its latency, so a 10 us row weighs as
    much as a 10 ms one): latency + bytes / (HBM x bandwidth) = measured. A fit beyond HBM's rate is refused: those
    rows are some other cost than reading memory (vLLM's block-FP8 GEMMs: a flat 57 us on H200 at any size)."""
    import numpy as np

    x = np.array([p.bytes_read / hbm_bytes_per_s for p in points])
    t = np.array([p.latency_s for p in points])
    (latency, inverse), *_ = np.linalg.lstsq(np.c_[np.ones_like(x), x] / t[:, None], np.ones_like(t), rcond=None)
    if latency <= 0 or inverse < 1.0:
        raise InputError(f"the rows fit a fixed time of {latency * 1e6:.1f} us and {1 / inverse:.2f} of HBM "
                         f"bandwidth: no kernel that reads its bytes runs that way, so the table is not used")
    spread = float(np.median(np.abs(np.log((latency + inverse * x) / t))))
    return DecodeKernelFit(float(latency), float(1.0 / inverse), len(points), spread)


def decode_kernel_fits(gpu: str, engine: str, op: str) -> tuple[dict[str, DecodeKernelFit], str]:
    """The fit per dtype of `engine`'s newest `op` table for this GPU (the dtypes whose rows fit), and the table's
    name."""
    points, source = (decode_points if op == "attention" else decode_gemm_points)(gpu, engine)
    hbm = load_gpu(gpu).hbm_bytes_per_s
    fits = {}
    for dtype in sorted({p.dtype for p in points}):
        try:
            fits[dtype] = fit_decode_kernel([p for p in points if p.dtype == dtype], hbm)
        except InputError:
            continue
    return fits, source
