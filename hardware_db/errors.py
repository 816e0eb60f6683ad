"""The one error type for bad user input.

It lives in the lowest package so that every layer (hardware_db, costmodels, planner, cli) can raise it;
the CLI turns it into one line on stderr and exit code 2.
"""


class InputError(ValueError):
    """Bad user input: the message says what is wrong and how to fix it, in one line."""
