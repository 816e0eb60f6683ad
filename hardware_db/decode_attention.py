"""Decode attention on paged KV caches as the engines' own kernels run it (issue 45 item 2, "decode attention
efficiency on paged caches"): for each GPU, serving engine and KV cache dtype, one layer's decode attention takes

    t = latency + bytes / (HBM bandwidth x share)

(a fixed time, then the cached K and V read once), fit to NVIDIA AIConfigurator's measured generation-attention
tables (Apache-2.0, the `aiconfigurator-core` wheel; `benchmarks/decode_attention_tables.py` writes
hardware_db/decode_attention.toml from them, costmodels.kernel_tables.fit_decode_attention states the fit). The
tables time each engine's attention op under CUDA graphs, as the engines run decode, so the fixed time is the op's
kernels (the K/V append and the attention), not a launch from the host.
"""

from __future__ import annotations

import functools
import statistics
from importlib import resources
from typing import Literal

from pydantic import BaseModel, Field, ValidationError

from meshplan.hardware_db.documents import STRICT, parse_document
from meshplan.hardware_db.errors import InputError, field_error

__all__ = ["DecodeAttentionKernel", "DecodeAttentionTables", "decode_attention_kernels", "parse_decode_attention"]

FILE = "decode_attention.toml"


class DecodeAttentionKernel(BaseModel):
    """One table's fit: its GPU (meshplan's name), engine and KV cache dtype, the fixed time and the share of HBM
    bandwidth, the rows fit and the median |log(fit / measured)| over them."""

    model_config = STRICT
    gpu: str
    engine: Literal["sglang", "trtllm", "vllm"]
    kv_dtype: Literal["bf16", "fp8"]
    latency_us: float = Field(gt=0, le=1000)
    bandwidth: float = Field(gt=0, le=1)
    rows: int = Field(gt=0)
    log_spread: float = Field(ge=0)
    table: str = Field(min_length=3)  # system/attention/engine/version of the table


class DecodeAttentionTables(BaseModel):
    model_config = STRICT
    source: str = Field(min_length=3)
    kernel: list[DecodeAttentionKernel]


def parse_decode_attention(text: str, origin: str) -> DecodeAttentionTables:
    try:
        return DecodeAttentionTables.model_validate(parse_document(text, "toml", origin))
    except ValidationError as exc:
        raise InputError(f"{origin}: {field_error(exc)}") from None


@functools.lru_cache(maxsize=1)
def _shipped() -> DecodeAttentionTables:
    """The file meshplan ships, read once: every engine iteration's pricing looks it up."""
    text = resources.files("meshplan.hardware_db").joinpath(FILE).read_text(encoding="utf-8")
    return parse_decode_attention(text, f"hardware_db/{FILE}")


@functools.lru_cache(maxsize=128)  # every Efficiency.from_gpu asks, training's fits many times over
def decode_attention_kernels(gpu: str, engine: str | None = None) -> tuple[tuple[str, float, float], ...]:
    """(KV dtype, fixed seconds, share of HBM bandwidth) of `engine`'s decode attention on `gpu`; with no engine (or
    one without a table there), the median of the engines' values per dtype; () for a GPU with no table (the cost
    model then keeps its roofline)."""
    rows = [k for k in _shipped().kernel if k.gpu == gpu]
    if engine is not None and any(k.engine == engine for k in rows):
        rows = [k for k in rows if k.engine == engine]
    out = []
    for dtype in sorted({k.kv_dtype for k in rows}):
        same = [k for k in rows if k.kv_dtype == dtype]
        out.append((dtype, statistics.median(k.latency_us for k in same) * 1e-6,
                    statistics.median(k.bandwidth for k in same)))
    return tuple(out)
