"""The files one command writes, all or none: every target is checked before any work, and every text is produced
and staged beside its target before the first one is renamed into place.

os.replace makes each file atomic on its own; what it cannot give is a set of files that either all appear or none
do (a plan written and then a failing trace left it behind). Staging every file first leaves only the renames, which
fail only if the directory changes under the command, after the checks.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from meshplan.hardware_db.errors import InputError


@dataclass(frozen=True)
class OutputFile:
    path: Path
    text: str | bytes  # bytes for a picture (PNG)


def check_target(path: Path | None, flag: str, directory_ok: bool = False) -> Path | None:
    """Refuse, before any work, a target that cannot be written: a directory (unless the flag takes one), a
    directory that does not exist, or one this user cannot write. An empty argument reaches here as '.'."""
    if path is None:
        return None
    if str(path) in ("", "."):
        raise InputError(f"{flag} is empty; give a file path (e.g. {flag} plan.json)")
    if path.is_dir():
        if directory_ok:
            _writable_dir(path, path, flag)
            return path
        raise InputError(f"{flag} {path} is a directory; give a file path inside it")
    parent = _existing_parent(path) if directory_ok else path.parent
    if not parent.exists():
        raise InputError(f"{flag} {path}: the directory {parent} does not exist; create it or choose another path")
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: {parent} is a file, not a directory; choose another path")
    _writable_dir(parent, path, flag)
    return path


def check_distinct(targets: dict[str, Path | None]) -> None:
    """Two flags naming one file would have the second overwrite the first."""
    seen: dict[Path, str] = {}
    for flag, path in targets.items():
        if path is None:
            continue
        key = Path(os.path.abspath(path))
        if key in seen:
            raise InputError(f"{seen[key]} and {flag} both name {path}; give each its own file")
        seen[key] = flag


def write_all(files: list[OutputFile]) -> list[Path]:
    """Stage every file (a temporary file beside its target, flushed), then rename each into place; any failure
    while staging removes what was staged and the directories made for it, and no target is touched."""
    staged: list[tuple[Path, Path]] = []
    made: list[Path] = []
    current = None
    try:
        for f in files:
            current = f.path
            made += _make_parents(f.path.parent)
            staged.append((stage_text(f.path, f.text), f.path))
        for tmp, path in staged:
            current = path
            os.replace(tmp, path)
    except OSError as exc:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise InputError(f"cannot write {current} ({exc.strerror or exc}); nothing was written") from None
    return [f.path for f in files]


def stage_text(path: Path, text: str | bytes) -> Path:
    """`text` in a new hidden temporary file beside `path`, flushed to disk; its path (to os.replace onto `path`).
    On failure nothing is left. planner.plan.write_text_atomic is this and the rename."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask decides the mode, as open() would
        with os.fdopen(fd, "wb") as out:
            out.write(text.encode("utf-8") if isinstance(text, str) else text)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _make_parents(directory: Path) -> list[Path]:
    """Make a missing directory (an export's folder) and return those made, outermost first."""
    missing = []
    d = directory
    while not d.exists():
        missing.append(d)
        d = d.parent
    for m in reversed(missing):
        m.mkdir()
    return list(reversed(missing))


def _existing_parent(path: Path) -> Path:
    d = path.parent
    while not d.exists() and d != d.parent:
        d = d.parent
    return d


def _writable_dir(directory: Path, path: Path, flag: str) -> None:
    if not os.access(directory, os.W_OK | os.X_OK):
        raise InputError(f"{flag} {path}: cannot write in {directory} (permission denied); choose another path")
