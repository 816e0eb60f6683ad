"""The README's examples run as written: every `meshplan` line of its bash blocks, in order, in one scratch folder
(with the repository's `examples/` beside them), exits 0; and its Python example runs. The Quickstart's pip lines
are what CI itself runs (.ci/run)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
NEEDS_TORCH = ("profile", "verify")


def readme_blocks(language: str) -> list[str]:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    return re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)


def meshplan_lines() -> list[str]:
    lines = []
    for block in readme_blocks("bash"):
        for raw in block.splitlines():
            for part in raw.split(" && "):  # the Quickstart chains pip and meshplan
                part = part.strip()
                if part.startswith("meshplan "):
                    lines.append(part)
    return lines


def test_the_readme_has_examples_of_every_command():
    from meshplan.cli.main import app

    used = {shlex.split(line, comments=True)[1] for line in meshplan_lines()}
    commands = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert commands <= used, f"commands without a README example: {sorted(commands - used)}"


def test_every_readme_command_runs_as_written(tmp_path, quick_profile, capsys):
    """In order, as a reader would paste them; `profile --quick --out cpu.json` is the session's one run of that
    command (tests/conftest.py), its file copied where the README writes it."""
    from meshplan.cli.main import main

    (tmp_path / "examples").symlink_to(REPO / "examples")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        for line in meshplan_lines():
            argv = shlex.split(line, comments=True)[1:]
            if argv[:3] == ["profile", "--quick", "--out"] and len(argv) == 4:
                shutil.copy(quick_profile, argv[3])
                continue
            if argv and argv[0] in NEEDS_TORCH:
                pytest.importorskip("torch")
            try:
                code = main(argv)
            except SystemExit as exc:  # --help and --version exit through click
                code = exc.code or 0
            out, err = capsys.readouterr()
            assert code == 0, f"README line failed ({code}): {line}\n{err[-2000:]}"
    finally:
        os.chdir(cwd)
    for written in ("plan.json", "step.json", "mt.json", "megatron.sh", "today.json", "titan.json", "serve.json",
                    "sweep/sweep.html", "serve-report/serve.html", "small.json"):
        assert (tmp_path / written).exists(), written


def test_the_readme_python_example_runs(capsys):
    (block,) = readme_blocks("python")
    exec(compile(block, "README.md", "exec"), {})
    tp, pp, dp, step = capsys.readouterr().out.split()
    assert int(tp) * int(pp) * int(dp) <= 64 and float(step) > 0


def test_no_generated_plan_is_committed():
    """A plan committed at the root went stale as the cost model moved (`show` re-priced it 28.26 s against the
    25.54 s saved): no tracked JSON file anywhere in the repository is a plan, the schema's examples aside."""
    import shutil
    import subprocess

    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    tracked = subprocess.run(["git", "ls-files", "*.json"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    def is_plan(name: str) -> bool:
        doc = json.loads((REPO / name).read_text(encoding="utf-8"))
        return isinstance(doc, dict) and {"schema_version", "inputs", "prediction"} <= set(doc)

    assert [name for name in tracked if is_plan(name)] == []
