"""Test-suite settings: hypothesis draws the same examples on every run (derandomize), so a property test that
passes in CI passes everywhere and a failure reproduces; the per-test @settings still choose their example counts."""

from hypothesis import settings

settings.register_profile("meshplan", derandomize=True, database=None)
settings.load_profile("meshplan")
