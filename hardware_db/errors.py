"""The one error type for bad user input.

It lives in the lowest package so that every layer (hardware_db, costmodels, planner, cli) can raise it;
the CLI turns it into one line on stderr and exit code 2.
"""


class InputError(ValueError):
    """Bad user input: the message says what is wrong and how to fix it, in one line."""


def field_error(exc: Exception) -> str:
    """"field 'a.b': message" of a pydantic ValidationError's first error: the one line a bad file gets (a rule
    over several fields names them in its message)."""
    first = exc.errors()[0]  # type: ignore[attr-defined]
    where = ".".join(str(p) for p in first["loc"])
    message = " ".join(str(first["msg"]).split()).removeprefix("Value error, ")
    return f"field '{where}': {message}" if where else message


def did_you_mean(name: str, choices: list[str]) -> str:
    """' did you mean X?' for the closest of `choices` to a misspelt name, else '': the names it begins (h100 ->
    h100-nvl, h100-sxm, h100-pcie, shortest first), then difflib's two closest (ratio >= 0.6); at most five."""
    import difflib

    key = name.strip().lower()
    prefixed = sorted((c for c in choices if key and c.startswith(key)), key=lambda c: (len(c), c))
    close = [c for c in difflib.get_close_matches(key, choices, n=2, cutoff=0.6) if c not in prefixed]
    shown = (prefixed + close)[:5]
    return f" did you mean {', '.join(shown[:-1]) + ' or ' + shown[-1] if len(shown) > 1 else shown[0]}?" \
        if shown else ""
