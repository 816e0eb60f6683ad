"""One reader for every file meshplan takes (model, GPU, cluster, calibration, plan, torchtitan TOML): text, JSON or
TOML, and the limits every document keeps, before any schema reads it. The schemas then validate with STRICT
(pydantic strict types, finite floats), so no reader has checks of its own for these.

Python's parsers accept what no meshplan file holds and what breaks later: JSON's NaN and Infinity, TOML's inf and
nan, integers of thousands of digits (int() refuses past 4,300 with a ValueError, float arithmetic overflows long
before), nesting deep enough to exhaust the recursion limit. Each becomes one InputError that names the file.
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict

from meshplan.hardware_db.errors import InputError

# every schema a file is read into: frozen, no unknown keys, no coercion (true is not 1, "4096" is not 4096, 0.5
# is not a count), no inf or nan
STRICT = ConfigDict(defer_build=True, frozen=True, extra="forbid", strict=True, allow_inf_nan=False)

MAX_DEPTH = 64  # no meshplan document nests deeper than a handful of levels
MAX_INT_DIGITS = 18  # integers up to 10**18: every count, size and byte figure fits, and stays exact in a float


class _Refused(ValueError):
    pass


def read_text(path: str | Path, what: str) -> str:
    """The UTF-8 text of a file: the one place meshplan decodes a file it is given. InputError, naming the file, for a
    missing, unreadable, non-UTF-8 or directory path; `what` says what the file should be, for the error line."""
    origin = str(path)
    try:
        return Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{origin}: no such file; check the path") from None
    except IsADirectoryError:
        raise InputError(f"{origin}: is a directory; give {what} file") from None
    except UnicodeDecodeError as exc:
        raise InputError(f"{origin}: not UTF-8 text (byte {exc.start}); save the file as UTF-8") from None
    except (OSError, RuntimeError) as exc:  # RuntimeError: pathlib cannot expand a ~user that does not exist
        raise InputError(f"{origin}: cannot read the file ({getattr(exc, 'strerror', None) or exc})") from None


def read_document(path: str | Path, what: str, formats: tuple[str, ...] = ("json", "toml")) -> tuple[Any, str]:
    """(the parsed document, its origin) of a .json or .toml file; InputError for a missing, unreadable, non-UTF-8
    or malformed file, or one past the limits above. `what` says what the file should be, for the error line."""
    path = Path(path)
    origin = str(path)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in formats:
        raise InputError(f"{origin}: {what} must be a {' or '.join('.' + f for f in formats)} file")
    return parse_document(read_text(path, what), fmt, origin), origin  # type: ignore[arg-type]


def parse_document(text: str, fmt: Literal["json", "toml"], origin: str) -> Any:
    """JSON or TOML text to Python values within the limits; InputError naming `origin` otherwise."""
    try:
        if fmt == "json":
            doc = json.loads(text, parse_int=_int, parse_float=_float, parse_constant=_constant)
        else:
            doc = tomllib.loads(text, parse_float=_float)
    except _Refused as exc:
        raise InputError(f"{origin}: {exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{origin}: not valid JSON ({exc}); fix the syntax at that position") from None
    except tomllib.TOMLDecodeError as exc:
        raise InputError(f"{origin}: not valid TOML ({exc}); fix the syntax at that position") from None
    except ValueError as exc:  # tomllib's int() of a literal past Python's 4,300-digit limit (it has no int hook)
        if "digits" not in str(exc):
            raise
        raise InputError(f"{origin}: an integer of thousands of digits; numbers here have at most "
                         f"{MAX_INT_DIGITS} digits") from None
    except RecursionError:
        raise InputError(f"{origin}: nested too deeply (a meshplan file nests at most {MAX_DEPTH} levels)") from None
    problem = _check_values(doc)
    if problem:
        raise InputError(f"{origin}: {problem}")
    return doc


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise _Refused(f"an integer of {len(text.lstrip('-'))} digits ({text[:12]}...); numbers here have at most "
                       f"{MAX_INT_DIGITS} digits")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused(f"{text!r} is not a finite number; give a finite value")
    return value


def _constant(name: str) -> float:
    raise _Refused(f"{name} is not a number a meshplan file takes; give a finite value")


def _check_values(doc: Any) -> str | None:
    """Depth and integer size of a parsed document (TOML integers have no hook), without recursion."""
    stack = [(doc, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_DEPTH:
            return f"nested too deeply (a meshplan file nests at most {MAX_DEPTH} levels)"
        if isinstance(value, dict):
            stack.extend((v, depth + 1) for v in value.values())
        elif isinstance(value, list):
            stack.extend((v, depth + 1) for v in value)
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**MAX_INT_DIGITS:
            return f"the integer {str(value)[:12]}... is too large; numbers here have at most {MAX_INT_DIGITS} digits"
    return None
