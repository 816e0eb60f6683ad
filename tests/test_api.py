"""The Python API (docs/api.md, meshplan/api.py): its documented example runs as written, and the CLI commands give
what the API returns."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import run

import meshplan
from meshplan.planner.plan import Plan, ServingPlan, write_plan

ROOT = Path(__file__).resolve().parents[1]


def test_the_documented_example_runs():
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "docs/api.md has no python example"
    done = subprocess.run([sys.executable, "-c", blocks[0]], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(r"tp \d+, pp \d+, dp \d+: [\d.]+ s per step", done.stdout), done.stdout
    assert "tokens/s/GPU" in done.stdout


def test_plan_is_what_the_cli_writes(capsys):
    args = dict(model="llama3.1-8b", cluster=meshplan.ClusterSpec(gpu="h100-sxm", num_gpus=16),
                workload=meshplan.Workload(global_batch=64, seq_len=4096))
    doc = meshplan.plan(**args)
    assert isinstance(doc, Plan) and doc.search is not None and doc.search.rank == 1
    code, out, err = run(capsys, "plan", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "16", "--gbs", "64",
                         "--seq", "4096", "--json")
    assert code == 0, err
    assert json.loads(out) == json.loads(doc.model_dump_json())


def test_estimate_is_what_the_cli_prints(capsys):
    cluster = meshplan.ClusterSpec(gpu="h100-sxm", num_gpus=8)
    est = meshplan.estimate("llama3.1-8b", cluster, meshplan.Workload(global_batch=32, seq_len=4096),
                            meshplan.ParallelConfig(tp=2, zero=1))
    code, out, err = run(capsys, "estimate", "-m", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "32",
                         "--seq", "4096", "--tp", "2", "--zero", "1", "--json")
    assert code == 0, err
    assert json.loads(out) == json.loads(json.dumps(est.to_dict()))
    assert est.layout.tp == 2 and est.layout.dp == 4


def test_serve_and_load_plan_round_trip(tmp_path):
    doc = meshplan.serve("llama3.1-8b", meshplan.ClusterSpec(gpu="h100-sxm", num_gpus=8),
                         meshplan.ServeWorkload(isl=1000, osl=200), meshplan.ServeTargets(tpot_ms=30))
    assert isinstance(doc, ServingPlan) and doc.prediction.meets_targets
    path = tmp_path / "serving.json"
    write_plan(doc, path)
    assert meshplan.load_plan(path) == doc


def test_bad_input_is_an_input_error(tmp_path):
    with pytest.raises(meshplan.InputError, match="no-such-model"):
        meshplan.plan("no-such-model", meshplan.ClusterSpec(gpu="h100-sxm", num_gpus=8),
                      meshplan.Workload(global_batch=8, seq_len=1024))
    path = tmp_path / "plan.json"
    path.write_text('{"kind": "training"}')
    with pytest.raises(meshplan.InputError, match="plan.json"):
        meshplan.load_plan(path)
    with pytest.raises(AttributeError, match="no_such_call"):
        meshplan.no_such_call  # noqa: B018


def test_import_meshplan_loads_no_search():
    """The API's names are imported on first use: `import meshplan.costmodels.config` costs that module only."""
    code = ("import sys, meshplan, meshplan.costmodels.config\n"
            "assert 'meshplan.planner.search' not in sys.modules and 'meshplan.api' not in sys.modules\n"
            "meshplan.plan\nassert 'meshplan.planner.search' in sys.modules\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_every_package_folder_is_installed():
    """pyproject.toml names the packages setuptools installs (package-dir maps them under meshplan.): a new
    subpackage missing there imports in a checkout and fails once installed."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(("meshplan",) + init.parent.relative_to(ROOT).parts) if init.parent.name != "meshplan"
               else "meshplan"
               for top in ("meshplan", "planner", "costmodels", "hardware_db", "cli", "executor")
               for init in (ROOT / top).rglob("__init__.py")}
    assert "meshplan.planner.partition" in folders and listed == folders, folders ^ listed


def test_the_installed_distribution_is_one_namespace(tmp_path):
    """Installed (CI's `pip install .`), every module lives under meshplan/: no top-level cli, planner, ... to collide
    with other distributions. An editable install (a development checkout) maps the folders instead: skipped."""
    code = ("import json\nfrom importlib import metadata\n"
            "dist = metadata.distribution('meshplan')\n"
            "print(json.dumps([json.loads(dist.read_text('direct_url.json') or '{}'), "
            "sorted({f.parts[0] for f in dist.files if f.suffix == '.py'})]))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.skip(f"meshplan is not installed here: {done.stderr.strip().splitlines()[-1:]}")
    origin, tops = json.loads(done.stdout)
    if origin.get("dir_info", {}).get("editable"):
        pytest.skip("an editable install maps the checkout's folders; CI installs the wheel")
    assert tops == ["meshplan"], tops
