"""Output files all or none (planner/outputs.py): every target checked before any work, every text staged before
the first rename; the CLI's plan, serve, import, show, verify, export and profile go through it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cli_helpers import assert_input_error, run

from meshplan.hardware_db.errors import InputError
from meshplan.planner.outputs import OutputFile, check_distinct, check_target, write_all

PLAN = ["plan", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "2048",
        "--max-mbs", "2"]


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.rglob("*"))


def test_an_empty_out_is_one_line(capsys):
    assert_input_error(*run(capsys, *PLAN, "--out", ""), "--out", "empty")
    assert_input_error(*run(capsys, *PLAN, "--trace", ""), "--trace", "empty")


def test_a_bad_trace_is_found_before_the_search_and_writes_no_plan(capsys, tmp_path):
    """A trace to a missing directory used to fail after the plan was written: now nothing is written, and the
    error comes before the search (no ranking printed)."""
    plan = tmp_path / "plan.json"
    code, out, err = run(capsys, *PLAN, "--out", str(plan), "--trace", str(tmp_path / "no" / "t.json"))
    assert_input_error(code, out, err, "--trace", "does not exist")
    assert out == "" and not plan.exists() and leftovers(tmp_path) == []


def test_two_flags_naming_one_file_are_refused(capsys, tmp_path):
    same = str(tmp_path / "x.json")
    assert_input_error(*run(capsys, *PLAN, "--out", same, "--trace", same), "--out", "--trace")
    assert leftovers(tmp_path) == []


def test_a_directory_is_not_a_file_target(capsys, tmp_path):
    assert_input_error(*run(capsys, *PLAN, "--out", str(tmp_path)), "is a directory")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: permission bits are not enforced")
def test_an_unwritable_directory_is_refused_before_work(capsys, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert_input_error(*run(capsys, *PLAN, "--out", str(locked / "p.json")), "cannot write")


def test_plan_trace_and_export_all_written(capsys, tmp_path):
    code, out, err = run(capsys, *PLAN, "--out", str(tmp_path / "p.json"), "--trace", str(tmp_path / "t.json"),
                         "--export", "torchtitan", "--export-out", str(tmp_path / "titan"))
    assert code == 0, err
    assert (tmp_path / "p.json").is_file() and (tmp_path / "t.json").is_file()
    assert any((tmp_path / "titan").iterdir())
    assert not [n for n in leftovers(tmp_path) if n.endswith(".tmp")]


def test_write_all_touches_nothing_when_one_file_cannot_be_staged(tmp_path):
    """The second target sits under a file, so staging it fails: the first target keeps its old text, the
    directory made for the export is removed, no temporary file is left, and the error says nothing was written."""
    first = tmp_path / "plan.json"
    first.write_text("old\n")
    blocker = tmp_path / "blocker"
    blocker.write_text("a file\n")
    files = [OutputFile(first, "new\n"), OutputFile(tmp_path / "made" / "deeper" / "a.toml", "x"),
             OutputFile(blocker / "b.json", "y")]
    with pytest.raises(InputError, match="nothing was written"):
        write_all(files)
    assert first.read_text() == "old\n"
    assert leftovers(tmp_path) == ["blocker", "plan.json"]


def test_write_all_writes_every_file(tmp_path):
    files = [OutputFile(tmp_path / "a.json", "A"), OutputFile(tmp_path / "d" / "b.toml", "B")]
    assert write_all(files) == [f.path for f in files]
    assert (tmp_path / "a.json").read_text() == "A" and (tmp_path / "d" / "b.toml").read_text() == "B"
    assert leftovers(tmp_path) == ["a.json", "b.toml", "d"]


def test_check_target_rules(tmp_path):
    assert check_target(None, "--out") is None
    assert check_target(tmp_path / "ok.json", "--out") == tmp_path / "ok.json"
    assert check_target(tmp_path / "new" / "dir", "--export-out", directory_ok=True) == tmp_path / "new" / "dir"
    assert check_target(tmp_path, "--export-out", directory_ok=True) == tmp_path
    (tmp_path / "f").write_text("")
    with pytest.raises(InputError, match="is a file"):
        check_target(tmp_path / "f" / "x", "--export-out", directory_ok=True)
    with pytest.raises(InputError, match="does not exist"):
        check_target(tmp_path / "missing" / "x.json", "--out")
    with pytest.raises(InputError, match="both name"):
        check_distinct({"--out": tmp_path / "a", "--trace": tmp_path / "." / "a"})


@pytest.mark.parametrize("argv", [PLAN, ["serve", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8",
                                         "--isl", "1000", "--osl", "100"]], ids=["plan", "serve"])
def test_the_same_input_writes_a_byte_identical_plan(capsys, tmp_path, argv):
    """The search's wall time is the one field two runs differ in: it is left out unless --timing asks for it
    (the table prints it either way)."""
    import json

    first, second, timed = tmp_path / "1.json", tmp_path / "2.json", tmp_path / "t.json"
    for path, extra in ((first, []), (second, []), (timed, ["--timing"])):
        code, out, err = run(capsys, *argv, "--out", str(path), *extra)
        assert code == 0, err
    assert first.read_bytes() == second.read_bytes()
    assert json.loads(first.read_text())["search"]["seconds"] is None
    assert json.loads(timed.read_text())["search"]["seconds"] >= 0


def test_export_names_its_own_flag(capsys, tmp_path):
    """export's target is --out (a folder when the export has several files): the error names that flag."""
    plan = tmp_path / "p.json"
    assert run(capsys, *PLAN, "--out", str(plan))[0] == 0
    assert_input_error(*run(capsys, "export", str(plan), "--to", "megatron", "--out", ""), "--out ", "empty")
    assert_input_error(*run(capsys, "export", str(plan), "--to", "megatron", "--out",
                            str(tmp_path / "p.json" / "x")), "--out ", "is a file")
