"""A time limit that long computations check as they go, so that a caller's time limit can stop one midway
(a pipeline simulation of a million passes, a partition DP over a thousand layers) and keep what it had.

The clock is this process's CPU time (time.process_time), not the wall: a search given 0.5 s does the same work on
an idle machine and on one with other jobs beside it, so what it returns under a limit does not depend on the load.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


class TimeLimitReached(Exception):
    """Raised from inside a computation once its caller's deadline has passed; the caller decides what it keeps."""


def cpu_now() -> float:
    """The clock every time limit is counted on: this process's CPU seconds."""
    return time.process_time()


@dataclass(frozen=True)
class Deadline:
    at: float  # cpu_now() seconds

    def check(self) -> None:
        if cpu_now() > self.at:
            raise TimeLimitReached


def check(deadline: Deadline | None) -> None:
    """deadline.check() where there is one (no limit: nothing to check)."""
    if deadline is not None:
        deadline.check()
