"""GPU specifications, cluster presets and calibrations: data with a validating loader; no cost logic.

The names below are imported on first use, so `from meshplan.hardware_db.errors import InputError` (what the command
line needs before any command runs) does not build the GPU schema."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["InputError", "GPUSpec", "list_gpus", "load_gpu"]
_FROM = {"InputError": "meshplan.hardware_db.errors", "GPUSpec": "meshplan.hardware_db.gpu",
         "list_gpus": "meshplan.hardware_db.gpu", "load_gpu": "meshplan.hardware_db.gpu"}


def __getattr__(name: str) -> Any:
    if name not in _FROM:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_FROM[name]), name)
