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


# ---- outputs as one transaction (issue 43) --------------------------------------------------------------------------

SERVE = ["serve", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--isl", "1000", "--osl", "100"]


@pytest.mark.parametrize("argv,inside", [
    ([*PLAN, "--zero", "3", "--export", "torchtitan", "--export-out", "{d}/D", "--out", "{d}/D/torchtitan.toml"],
     "D"),
    ([*SERVE, "--report", "{d}/R", "--out", "{d}/R/serve.html"], "R"),
    ([*SERVE, "--export", "vllm", "--export-out", "{d}/V", "--out", "{d}/V/node-0.sh"], "V"),
    (["sweep", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8", "--gbs", "16", "--seq", "2048",
      "--out", "{d}/S", "--objective", "time"], None),
], ids=["plan-export", "serve-report", "serve-export", "sweep-clean"])
def test_a_file_another_flag_writes_by_its_real_name_is_refused_before_any_work(capsys, tmp_path, argv, inside):
    """`--out D/torchtitan.toml` beside `--export-out D` used to exit 0 with the export replacing the plan: now
    the collision is one line before the search (nothing printed, nothing written)."""
    if inside is not None:
        (tmp_path / inside).mkdir()
    args = [a.replace("{d}", str(tmp_path)) for a in argv]
    code, out, err = run(capsys, *args)
    if inside is None:  # the control: a report folder of its own writes its files
        assert code == 0, err
        assert {p.name for p in (tmp_path / "S").iterdir()} >= {"sweep.csv", "sweep.html"}
        return
    assert_input_error(code, out, err, "writes", "another name")
    assert out == "" and leftovers(tmp_path) == [inside]


@pytest.mark.parametrize("command", [
    ["export", "{plan}", "--to", "torchtitan", "--out", "{d}/D"],
    [*PLAN, "--zero", "3", "--export", "torchtitan", "--export-out", "{d}/D"],
    [*SERVE, "--report", "{d}/D"],
], ids=["export", "plan-export-out", "serve-report"])
def test_a_directory_where_a_folder_writes_a_file_is_refused_before_any_work(capsys, tmp_path, command):
    """`mkdir -p D/torchtitan_config.py` then an export into D used to write D/torchtitan.toml and then say
    "nothing was written": now it is refused before any file is made."""
    plan = tmp_path / "z3.json"
    assert run(capsys, *PLAN, "--zero", "3", "--out", str(plan))[0] == 0
    blocked = "serve.html" if "serve" in command else "torchtitan_config.py"
    (tmp_path / "D" / blocked).mkdir(parents=True)
    args = [a.replace("{d}", str(tmp_path)).replace("{plan}", str(plan)) for a in command]
    assert_input_error(*run(capsys, *args), "is a directory where it writes a file")
    assert leftovers(tmp_path / "D") == [blocked]


def test_every_export_and_report_writes_only_the_names_it_declares(capsys, tmp_path):
    """EXPORT_NAMES, SWEEP_FILES and SERVE_FILES are what the collision check compares with: each export target's
    and each report's actual files are held to them."""
    import fnmatch

    from meshplan.planner.launchers import EXPORT_NAMES, SERVING_TARGETS, export_plan
    from meshplan.planner.plan import read_any_plan
    from meshplan.planner.report import SERVE_FILES, SWEEP_FILES

    plans = {"training": tmp_path / "t.json", "serving": tmp_path / "s.json"}
    assert run(capsys, *PLAN, "--zero", "3", "--out", str(plans["training"]))[0] == 0
    assert run(capsys, *SERVE, "--gpus", "16", "--out", str(plans["serving"]), "--report", str(tmp_path / "R"))[0] == 0
    assert run(capsys, "sweep", "--model", "llama3.1-8b", "--gpu", "h100-sxm", "--gpus", "8,16", "--gbs", "16",
               "--seq", "2048", "--out", str(tmp_path / "S"))[0] == 0
    for target, names in EXPORT_NAMES.items():
        doc = read_any_plan(plans["serving" if target in SERVING_TARGETS else "training"])
        produced = [f.name for f in export_plan(doc, target).files]
        assert produced and all(any(fnmatch.fnmatch(n, p) for p in names) for n in produced), (target, produced)
    for folder, names in ((tmp_path / "R", SERVE_FILES), (tmp_path / "S", SWEEP_FILES)):
        produced = [p.name for p in folder.iterdir()]
        assert produced and all(any(fnmatch.fnmatch(n, p) for p in names) for n in produced), produced


def test_a_rename_that_fails_part_way_is_rolled_back(tmp_path, monkeypatch):
    """The third of three renames fails (as when a directory appears at its target after the checks): the first
    target's old text is back, the second (new) file is gone, and the error says nothing was written."""
    old = tmp_path / "plan.json"
    old.write_text("old\n")
    files = [OutputFile(old, "new\n"), OutputFile(tmp_path / "new.toml", "B"), OutputFile(tmp_path / "c.py", "C")]
    real, calls = os.replace, []

    def third_fails(src, dst):
        calls.append(dst)
        if Path(dst) == tmp_path / "c.py":
            raise IsADirectoryError(21, "Is a directory")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", third_fails)
    with pytest.raises(InputError, match="nothing was written"):
        write_all(files)
    assert old.read_text() == "old\n"
    assert leftovers(tmp_path) == ["plan.json"]


def test_a_rename_that_cannot_be_undone_is_named(tmp_path, monkeypatch):
    """Where no hard link could be kept of a replaced file (a filesystem without them), a failure after it names
    that file as written instead of claiming nothing was."""
    old = tmp_path / "plan.json"
    old.write_text("old\n")
    files = [OutputFile(old, "new\n"), OutputFile(tmp_path / "c.py", "C")]
    real = os.replace

    def no_links(src, dst):
        raise OSError(1, "Operation not permitted")

    def second_fails(src, dst):
        if Path(dst) == tmp_path / "c.py":
            raise IsADirectoryError(21, "Is a directory")
        return real(src, dst)

    monkeypatch.setattr(os, "link", no_links)
    monkeypatch.setattr(os, "replace", second_fails)
    with pytest.raises(InputError, match=r"written and not undone: .*plan\.json"):
        write_all(files)
    assert old.read_text() == "new\n"
    assert leftovers(tmp_path) == ["plan.json"]
