"""The lines a command writes on stderr (error, note, progress) and the exit code of bad input: what cli/main.py
needs before any command module is imported, so it stays light (`meshplan --version` imports no library)."""

import sys

EXIT_INPUT = 2  # bad input, the same code click uses for usage errors


def one_line(text: object) -> str:
    return " ".join(str(text).split()).replace("Value error, ", "")


def stderr_line(kind: str, message: str) -> None:
    """`kind: message` on stderr in a single write: ranks under torchrun share stderr, unbuffered (print writes the
    text and the newline apart, and two ranks' lines then interleave)."""
    sys.stderr.write(f"{kind}: {message}\n")
    sys.stderr.flush()


def note(message: str) -> None:
    """A line on stderr beside a command's output (a re-priced plan under an export printed to stdout)."""
    stderr_line("note", message)


def print_error(message: str) -> None:
    """The one `error:` line."""
    stderr_line("error", message)
