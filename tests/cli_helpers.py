"""Helpers shared by the CLI tests: run `meshplan` in-process, and the one-line bad-input contract."""

from meshplan.cli.main import main


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def assert_input_error(code: int, out: str, err: str, *words: str) -> str:
    """Exit 2, one `error: ...` line on stderr naming each of `words`, no traceback; returns that line. `progress:`
    lines (a long step's, piped: cli/options.ProgressBar) may come before it."""
    lines = [x for x in err.strip().splitlines() if not x.startswith("progress: ")]
    assert code == 2, (code, out, err)
    assert len(lines) == 1, err
    assert lines[0].startswith("error: "), err
    assert "Traceback" not in err and "Traceback" not in out
    for w in words:
        assert w.lower() in lines[0].lower(), (w, err)
    return lines[0]
