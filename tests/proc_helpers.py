"""Processes read off Linux's /proc, for the tests that check no rank outlives its caller."""

from __future__ import annotations

import os


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (state, parent, ...); raises OSError when pid is gone."""
    with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
        return f.read().rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    """Running, not a zombie waiting to be reaped."""
    try:
        return _stat(pid)[0] != "Z"
    except OSError:
        return False


def parent(pid: int) -> int:
    return int(_stat(pid)[1])


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if int(_stat(int(entry))[1]) == pid:
                    out.append(int(entry))
            except OSError:
                continue
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
