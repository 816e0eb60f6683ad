"""A decode step's two heaviest readers as the engines' own kernels run them (issue 45 item 2, "decode attention
efficiency on paged caches"): for each GPU, serving engine and dtype, one call of decode attention on a paged KV
cache (per KV cache dtype) or of a linear layer at a few tokens (per weight format) takes

    t = latency + bytes / (HBM bandwidth x share)

(a fixed time, then its bytes read once), fit to NVIDIA AIConfigurator's measured generation-attention and GEMM
tables (Apache-2.0, the `aiconfigurator-core` wheel; `benchmarks/decode_kernel_tables.py` writes
hardware_db/decode_kernels.toml from them, costmodels.kernel_tables.fit_decode_kernel states the fit). The tables time
each engine's op under CUDA graphs, as the engines run decode, so the fixed time is the op's kernels (for attention
the K/V append and the attention), not a launch from the host.
"""

from __future__ import annotations

import functools
import statistics
from importlib import resources
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from meshplan.hardware_db.documents import STRICT, parse_document
from meshplan.hardware_db.errors import InputError, field_error

__all__ = ["DecodeKernel", "DecodeKernelTables", "decode_kernels", "parse_decode_kernels"]

FILE = "decode_kernels.toml"
Op = Literal["attention", "gemm"]


class DecodeKernel(BaseModel):
    """One table's fit: its GPU (meshplan's name), engine, op and dtype (attention: the KV cache's; GEMM: the weight
    format, fp8_block for weights scaled per 128x128 block), the fixed time and the share of HBM bandwidth, the rows
    fit and the median |log(fit / measured)| over them."""

    model_config = STRICT
    gpu: str
    engine: Literal["sglang", "trtllm", "vllm"]
    op: Op
    dtype: Literal["bf16", "fp8", "fp8_block", "fp4"]
    latency_us: float = Field(gt=0, le=1000)
    bandwidth: float = Field(gt=0, le=1)
    rows: int = Field(gt=0)
    log_spread: float = Field(ge=0)
    table: str = Field(min_length=3)  # system/folder/engine/version of the table


class DecodeKernelTables(BaseModel):
    model_config = STRICT
    source: str = Field(min_length=3)
    kernel: list[DecodeKernel]


def parse_decode_kernels(text: str, origin: str) -> DecodeKernelTables:
    try:
        return DecodeKernelTables.model_validate(parse_document(text, "toml", origin))
    except ValidationError as exc:
        raise InputError(f"{origin}: {field_error(exc)}") from None


@functools.lru_cache(maxsize=1)
def _shipped() -> DecodeKernelTables:
    """The file meshplan ships, read once: every engine iteration's pricing looks it up."""
    text = resources.files("meshplan.hardware_db").joinpath(FILE).read_text(encoding="utf-8")
    return parse_decode_kernels(text, f"hardware_db/{FILE}")


@functools.lru_cache(maxsize=256)  # every Efficiency.from_gpu asks, training's fits many times over
def decode_kernels(gpu: str, op: Op, engine: str | None = None) -> tuple[tuple[str, float, float], ...]:
    """(dtype, fixed seconds, share of HBM bandwidth) of `engine`'s decode `op` on `gpu`; with no engine (or one
    without a table there), the median of the engines' values per dtype; () for a GPU with no table (the cost model
    then keeps its roofline)."""
    rows = [k for k in _shipped().kernel if k.gpu == gpu and k.op == op]
    if engine is not None and any(k.engine == engine for k in rows):
        rows = [k for k in rows if k.engine == engine]
    out = []
    for dtype in sorted({k.dtype for k in rows}):
        same = [k for k in rows if k.dtype == dtype]
        out.append((dtype, statistics.median(k.latency_us for k in same) * 1e-6,
                    statistics.median(k.bandwidth for k in same)))
    return tuple(out)
