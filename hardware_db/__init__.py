"""GPU specifications, cluster presets and calibrations: data with a validating loader; no cost logic."""

from meshplan.hardware_db.errors import InputError
from meshplan.hardware_db.gpu import GPUSpec, list_gpus, load_gpu

__all__ = ["InputError", "GPUSpec", "list_gpus", "load_gpu"]
