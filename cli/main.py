"""meshplan's command line: a thin typer layer over the Python API (meshplan/api.py) and the packages below it.

Every command is a few lines over a library call and a rich table. `main()` runs the app and turns bad input
(hardware_db.errors.InputError, and any pydantic / file / JSON / TOML error that slips through) and click's
usage errors into ONE line `error: <message>` on stderr with exit code 2: no traceback.
"""

import json
import os
import sys
import tomllib
import warnings
from importlib import metadata
from pathlib import Path
from typing import Annotated

import typer
from pydantic import ValidationError

from meshplan.cli import catalog, compare, launch, serve, sweep, train
from meshplan.cli.options import EXIT_INPUT, one_line, print_error
from meshplan.hardware_db.errors import InputError

# typer >= 0.2x vendors click; find its exception classes through the public typer.BadParameter (a UsageError).
ClickException: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
NoArgsIsHelpError = getattr(sys.modules[ClickException.__module__], "NoArgsIsHelpError", None)

app = typer.Typer(
    name="meshplan",
    help="Parallelism planner for LLM training: search the fastest parallel plan that fits, or estimate one.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's plain help: rich's option tables cut flags and help at 80 columns ("Time-to-first-to…")
    rich_markup_mode=None,
)
models_app = typer.Typer(help="Built-in model zoo and model files (docs/models.md).", no_args_is_help=True,
                         rich_markup_mode=None)
hardware_app = typer.Typer(help="Built-in GPU specifications, every number with its source (docs/hardware.md).",
                           no_args_is_help=True, rich_markup_mode=None)
app.add_typer(models_app, name="models")
app.add_typer(hardware_app, name="hardware")



def _version() -> str:
    try:
        return metadata.version("meshplan")
    except metadata.PackageNotFoundError:  # running from a checkout without `pip install`
        pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
        return tomllib.loads(pyproject.read_text())["project"]["version"] if pyproject.is_file() else "unknown"


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"meshplan {_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option("--version", help="Print meshplan's version and exit.", is_eager=True,
                                          callback=_show_version)] = False,
) -> None:
    """Parallelism planner for LLM training: estimate step time, throughput, MFU and memory of a configuration."""



# the commands, in the order --help lists them (one file per group: train, serve, launch, catalog)
for command, name in ((train.estimate, "estimate"), (train.plan, "plan"), (sweep.sweep, "sweep"),
                      (serve.serve, "serve"),
                      (catalog.profile, "profile"), (launch.export_, "export"), (launch.import_, "import"),
                      (launch.show, "show"), (compare.compare, "compare"),
                      (launch.verify, "verify")):
    app.command(name)(command)
models_app.command("list")(catalog.models_list)
models_app.command("show")(catalog.models_show)
hardware_app.command("list")(catalog.hardware_list)
hardware_app.command("show")(catalog.hardware_show)


# ---- entry point ---------------------------------------------------------------------------------------------------

# the option a value of these types comes from, to name it in the error line
_FLAGS = {"ClusterSpec": {"num_gpus": "--gpus", "gpus_per_node": "--gpus-per-node", "nic_gbps": "--nic-gbps",
                          "nvlink_gb_s": "--nvlink-gbs"},
          "Workload": {"global_batch": "--gbs", "seq_len": "--seq"}}


def _validation_message(exc: ValidationError) -> str:
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    flag = _FLAGS.get(exc.title, {}).get(where)
    if flag is not None:
        return f"{flag} {first.get('input')!s:.24}: {first['msg']}"
    return f"{exc.title}: field '{where}': {first['msg']}" if where else f"{exc.title}: {first['msg']}"


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; return the exit code. Bad input prints one line `error: ...` on stderr and returns 2.

    Warnings raised on the way (numpy's overflow or invalid-value notes on an input that is then refused) are
    held back: a failing command prints its one line only; a command that succeeds shows them after its output."""
    with warnings.catch_warnings(record=True) as held:
        warnings.simplefilter("default")
        code = _main(argv)
    if code == 0:
        for w in held:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return code


def _main(argv: list[str] | None) -> int:
    try:
        rv = app(args=argv, prog_name="meshplan", standalone_mode=False)
    except ClickException as exc:  # usage errors: unknown option, bad value, missing option
        if NoArgsIsHelpError is not None and isinstance(exc, NoArgsIsHelpError):
            return 0  # a bare `meshplan` / `meshplan models`: typer has printed the help
        message = one_line(exc.format_message())  # type: ignore[attr-defined]
        if "import" in (argv if argv is not None else sys.argv[1:]) and message.startswith("No such option: --"):
            message += ("; arguments that start with a dash go after `--`: meshplan import --from megatron -- "
                        "\"--tensor-model-parallel-size 8 ...\"")
        print_error(message)
        return exc.exit_code  # type: ignore[attr-defined]
    except typer.Abort:
        print_error("aborted")
        return 1
    except BrokenPipeError:  # `meshplan ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except ValidationError as exc:
        print_error(one_line(_validation_message(exc)))
        return EXIT_INPUT
    except (InputError, OSError, json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        print_error(one_line(exc))
        return EXIT_INPUT
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
