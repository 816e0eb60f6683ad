"""The files one command writes, all or none: every target is checked before any work, and every text is produced
and staged beside its target before the first one is renamed into place.

os.replace makes each file atomic on its own; what it cannot give is a set of files that either all appear or none
do (a plan written and then a failing trace left it behind). Staging every file first leaves only the renames, which
fail only if the directory changes under the command, after the checks.
"""

from __future__ import annotations

import contextlib
import fnmatch
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


def check_folder_contents(files: dict[str, Path | None], folders: dict[str, tuple[Path | None, tuple[str, ...]]]
                          ) -> None:
    """Refuse, before any work, what a folder flag (an export's or a report's) would collide with: another flag's
    file that is one of the folder's files by its real name (`names`: fnmatch patterns), or a directory standing
    where the folder writes a file."""
    for flag, (folder, names) in folders.items():
        if folder is None:
            continue
        for other, path in files.items():
            if path is None or other == flag or Path(os.path.abspath(path)).parent != Path(os.path.abspath(folder)):
                continue
            name = next((n for n in names if fnmatch.fnmatch(path.name, n)), None)
            if name is not None:
                raise InputError(f"{other} {path} is a file {flag} {folder} writes; give {other} another name or "
                                 f"folder")
        if folder.is_dir():
            blocked = next((p for p in sorted(folder.iterdir()) if p.is_dir()
                            and any(fnmatch.fnmatch(p.name, n) for n in names)), None)
            if blocked is not None:
                raise InputError(f"{flag} {folder}: {blocked} is a directory where it writes a file; remove it or "
                                 f"choose another folder")


def write_all(files: list[OutputFile]) -> list[Path]:
    """Stage every file (a temporary file beside its target, flushed), then rename each into place, all or none:
    a failure while staging touches no target; a rename that fails part-way puts back what the earlier renames
    replaced (kept as hard links until the end) and removes what they created, and the error says so, or names
    exactly the files it could not put back."""
    for f in files:
        if f.path.is_dir():
            raise InputError(f"cannot write {f.path}: it is a directory; remove it or choose another path")
    staged: list[tuple[Path, Path]] = []
    made: list[Path] = []
    done: list[tuple[Path, bool, Path | None]] = []  # (target, a file was there, the hard link of it)
    current = None
    try:
        for f in files:
            current = f.path
            made += _make_parents(f.path.parent)
            staged.append((stage_text(f.path, f.text), f.path))
        for tmp, path in staged:
            current = path
            existed, backup = path.exists(), _keep(path)
            try:
                os.replace(tmp, path)
            except OSError:
                if backup is not None:
                    backup.unlink(missing_ok=True)
                raise
            done.append((path, existed, backup))
    except OSError as exc:
        left = _roll_back(done)
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        for d in reversed(made):
            with contextlib.suppress(OSError):
                d.rmdir()
        written = (f"; written and not undone: {', '.join(map(str, left))}" if left else "; nothing was written")
        raise InputError(f"cannot write {current} ({exc.strerror or exc}){written}") from None
    for _, _, backup in done:
        if backup is not None:
            backup.unlink(missing_ok=True)
    return [f.path for f in files]


def _keep(path: Path) -> Path | None:
    """A hard link to the file at `path`, to put it back if a later rename fails; None when there is none (no
    file, or a filesystem without hard links: then that file is named if it cannot be put back)."""
    if not path.is_file():
        return None
    link = path.with_name(f".{path.name}.{secrets.token_hex(4)}.old")
    try:
        os.link(path, link)
    except OSError:
        return None
    return link


def _roll_back(done: list[tuple[Path, bool, Path | None]]) -> list[Path]:
    """Undo renames, last first: the replaced file put back, or the new one removed where there was none; the
    targets that could not be undone (a replaced file with no link kept of it)."""
    left = []
    for path, existed, backup in reversed(done):
        try:
            if backup is not None:
                os.replace(backup, path)
            elif existed:
                left.append(path)
            else:
                path.unlink()
        except OSError:
            left.append(path)
    return left


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
