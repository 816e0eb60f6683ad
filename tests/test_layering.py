"""The planning packages never import torch or the executor (DESIGN.md: "planning never imports torch"; issue 18):
checked two ways, by reading every import statement of their source, and by importing every module in a process
where `import torch` fails."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANNING = ("planner", "costmodels", "hardware_db")
FORBIDDEN = ("torch", "executor")


def planning_modules() -> list[tuple[str, Path]]:
    """(dotted name, path) of every module of the planning packages."""
    found = []
    for package in PLANNING:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found.append((".".join(("meshplan",) + (parts[:-1] if parts[-1] == "__init__" else parts)), path))
    return found


def imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import statement in a file, at any depth (inside functions too); text inside string
    literals (the launch scripts an exporter writes) is not an import."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            names += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append((node.lineno, node.module))
    return names


def test_no_planning_module_imports_torch_or_the_executor():
    modules = planning_modules()
    assert len(modules) > 20 and any(name == "meshplan.planner.search" for name, _ in modules)
    bad = [f"{path.relative_to(ROOT)}:{line} imports {name}" for _, path in modules
           for line, name in imported_names(path)
           if name.split(".")[0] in FORBIDDEN or name.startswith("meshplan.executor")]
    assert bad == []


def test_the_walker_sees_imports_inside_functions():
    """The check above can fail: the profiler (executor/profiler.py) imports torch only inside its functions."""
    names = {name for _, name in imported_names(ROOT / "executor" / "profiler.py")}
    assert "torch" in names and "meshplan.executor.model" in names


def test_every_planning_module_and_the_cli_import_without_torch():
    """sys.modules["torch"] = None makes `import torch` raise ImportError, as on a machine without it."""
    names = [name for name, _ in planning_modules()] + ["meshplan", "meshplan.api", "meshplan.cli.main"]
    code = ("import importlib, sys\nsys.modules['torch'] = None\n"
            f"for name in {names!r}:\n    importlib.import_module(name)\n"
            "assert 'torch' not in [m for m in sys.modules if sys.modules[m] is not None]\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_the_cli_and_the_executor_import_without_ortools_and_matplotlib():
    """A GPU image carries only what profile, verify and estimate need (issue 21): OR-Tools loads when a search first
    calls CP-SAT, matplotlib when a report is drawn; with both missing the CLI, the profiler and verify import, and an
    estimate runs."""
    code = ("import sys\nsys.modules['ortools'] = None\nsys.modules['matplotlib'] = None\n"
            "import meshplan.cli.main, meshplan.executor.verify, meshplan.executor.profiler\n"
            "from meshplan.cli.main import main\n"
            "assert main(['estimate', '--model', 'llama3.1-8b', '--gpu', 'h100-sxm', '--gpus', '8']) == 0\n"
            "print('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]


def test_the_plan_schema_imports_no_search():
    """planner/plan.py is the contract the exporters and the executor read: its schema and reading and writing
    only. The builders (planner/builders.py) import the searches; the plan does not."""
    names = {name for _, name in imported_names(ROOT / "planner" / "plan.py")}
    assert not names & {f"meshplan.planner.{name}" for name in ("search", "serve", "partition", "builders", "space")}
    assert "meshplan.planner.search" in {name for _, name in imported_names(ROOT / "planner" / "builders.py")}
