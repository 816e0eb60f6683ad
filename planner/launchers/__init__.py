"""Plans as launch configurations: one module per launcher, each a small function of the Plan.

`export_plan(plan, target)` returns the files that launch the plan with Megatron-LM, torchtitan, DeepSpeed
(Megatron-DeepSpeed), torchrun (meshplan's executor) or NeMo / Megatron-Bridge, or raises ExportError with the reason
when the target cannot express the plan (never a silently changed plan). `pinned_plan` turns a launch
configuration read back (`megatron.parse_megatron_args`, `torchtitan.parse_torchtitan_toml`) into a Plan.

The names below live in registry.py, which imports every launcher (torchtitan's TOML schema alone is 60 ms); they
are imported on first use, so a command that only catches ExportError (launchers.common) does not pay for them.
"""

from meshplan import lazy_exports

__all__ = ["TARGETS", "SERVING_TARGETS", "EXPORT_NAMES", "Exported", "ExportedFile", "ExportError", "LaunchSpec",
           "export_plan", "export_files", "write_export",
           "SOURCES", "read_launch", "launch_model", "launch_world", "pinned_plan"]
__getattr__ = lazy_exports(__name__, dict.fromkeys(__all__, "meshplan.planner.launchers.registry"))
