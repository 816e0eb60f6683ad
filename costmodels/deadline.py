"""A wall-clock limit that long computations check as they go, so that a caller's time limit can stop one midway
(a pipeline simulation of a million passes, a partition DP over a thousand layers) and keep what it had."""

from __future__ import annotations

import time
from dataclasses import dataclass


class TimeLimitReached(Exception):
    """Raised from inside a computation once its caller's deadline has passed; the caller decides what it keeps."""


@dataclass(frozen=True)
class Deadline:
    at: float  # time.perf_counter() seconds

    def check(self) -> None:
        if time.perf_counter() > self.at:
            raise TimeLimitReached


def check(deadline: Deadline | None) -> None:
    """deadline.check() where there is one (no limit: nothing to check)."""
    if deadline is not None:
        deadline.check()
