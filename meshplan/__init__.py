"""meshplan: a parallelism auto-planner for large-model training and serving.

The Python API (docs/api.md) is `meshplan.plan`, `meshplan.estimate`, `meshplan.serve` and `meshplan.load_plan`; the
packages are `meshplan.costmodels` (the cost model), `meshplan.hardware_db` (GPUs, clusters, calibrations),
`meshplan.planner` (the searches, the plan file, the exporters), `meshplan.executor` (the reference PyTorch executor,
needs torch) and `meshplan.cli` (the command line).

Installed, setuptools' package-dir puts the repository's top-level folders under meshplan/ (pyproject.toml). In a
checkout they stay at the top level, so this package's search path also holds the repository root there: the same
dotted names work both ways. The API functions are imported on first use, so `import meshplan.costmodels.x` stays
as light as that module.
"""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve().parent
if not (_HERE / "planner").is_dir() and (_HERE.parent / "planner" / "__init__.py").is_file():
    __path__.append(str(_HERE.parent))  # a checkout: meshplan.planner is <repo>/planner  # noqa: F821

# name -> module it is imported from on first use
EXPORTS = {
    "plan": "meshplan.api", "estimate": "meshplan.api", "serve": "meshplan.api", "load_plan": "meshplan.api",
    "search_plans": "meshplan.api", "search_deployments": "meshplan.api", "PinnedDeployment": "meshplan.api",
    "ClusterSpec": "meshplan.hardware_db.cluster", "InputError": "meshplan.hardware_db.errors",
    "Workload": "meshplan.costmodels.config", "ParallelConfig": "meshplan.costmodels.config",
    "ServeWorkload": "meshplan.costmodels.serving",
    "ServeTargets": "meshplan.costmodels.serving", "EngineLayout": "meshplan.costmodels.serving",
    "Plan": "meshplan.planner.plan", "ServingPlan": "meshplan.planner.plan",
}
__all__ = sorted(EXPORTS)


def lazy_exports(package: str, exports: dict[str, str]):
    """A package's module-level __getattr__ that imports each name of `exports` (name -> module) on first use, so that
    importing the package, or one light module of it, does not import what the names pull in."""

    def __getattr__(name: str):
        if name in exports:
            import importlib

            return getattr(importlib.import_module(exports[name]), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


__getattr__ = lazy_exports(__name__, EXPORTS)
