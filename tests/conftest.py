"""Test-suite settings: hypothesis draws the same examples on every run (derandomize), so a property test that
passes in CI passes everywhere and a failure reproduces; the per-test @settings still choose their example counts."""

import os

import pytest
from hypothesis import settings

settings.register_profile("meshplan", derandomize=True, database=None)
settings.load_profile("meshplan")


# `meshplan profile --quick --out cpu.json`, once per session: the calibration tests and the README's example of the
# same command read its file (about a minute of measuring on a 2-core machine)
PROFILE_ARGS = ("profile", "--quick", "--out")


@pytest.fixture(scope="session")
def quick_profile(tmp_path_factory):
    pytest.importorskip("torch")
    from meshplan.cli.main import main

    out = tmp_path_factory.mktemp("profile") / "cpu.json"
    assert main([*PROFILE_ARGS, str(out)]) == 0
    return out


@pytest.fixture(autouse=True, scope="session")
def piped_output_width():
    """The CLI's output as a pipe gets it (140 columns, cli/options.console), which the tests read: pytest-xdist's
    workers set COLUMNS=80, and rich would wrap paths and tables at 80."""
    width = os.environ.pop("COLUMNS", None)
    yield
    if width is not None:
        os.environ["COLUMNS"] = width
