"""GPU specifications, cluster presets and calibrations: data with a validating loader; no cost logic.

The names below are imported on first use, so `from meshplan.hardware_db.errors import InputError` (what the command
line needs before any command runs) does not build the GPU schema."""

from meshplan import lazy_exports

__all__ = ["InputError", "GPUSpec", "list_gpus", "load_gpu"]
_GPU = "meshplan.hardware_db.gpu"
__getattr__ = lazy_exports(__name__, {"InputError": "meshplan.hardware_db.errors", "GPUSpec": _GPU, "list_gpus": _GPU,
                                      "load_gpu": _GPU})
