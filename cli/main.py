"""meshplan's command line: a thin typer layer over the Python API (meshplan/api.py) and the packages below it.

Every command is a few lines over a library call and a rich table. `main()` runs the app and turns bad input
(hardware_db.errors.InputError, and any pydantic / file / JSON / TOML error that slips through) and click's
usage errors into ONE line `error: <message>` on stderr with exit code 2: no traceback.
"""

import importlib
import json
import os
import sys
import tomllib
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from meshplan.cli.lines import EXIT_INPUT, one_line, print_error
from meshplan.hardware_db.errors import InputError

# typer >= 0.2x vendors click; find its exception classes through the public typer.BadParameter (a UsageError).
ClickException: type[Exception] = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")
NoArgsIsHelpError = getattr(sys.modules[ClickException.__module__], "NoArgsIsHelpError", None)

# the commands, in the order --help lists them: (module, the function or sub-app, the line --help gives it). One
# file per group of commands (train, sweep, serve, catalog, launch, compare); a module is imported only when one of
# its commands runs or shows its help (_LazyCommands), so `meshplan --version` imports no library and `meshplan plan`
# only what planning needs.
COMMANDS: dict[str, tuple[str, str, str]] = {
    "estimate": ("meshplan.cli.train", "estimate",
                 "Estimate one configuration: step time, throughput, MFU and memory per GPU."),
    "plan": ("meshplan.cli.train", "plan", "Search the fastest parallel plan that fits, proven optimal."),
    "sweep": ("meshplan.cli.sweep", "sweep", "Plan every GPU type x count and say which to rent."),
    "serve": ("meshplan.cli.serve", "serve", "Search serving deployments under latency targets."),
    "profile": ("meshplan.cli.catalog", "profile", "Measure this device into a calibration file."),
    "calibrate": ("meshplan.cli.calibrate", "calibrate",
                  "Fit the cost model's factors (or a serving engine's) to what you measured."),
    "export": ("meshplan.cli.launch", "export_", "Turn a plan into a launcher's configuration."),
    "import": ("meshplan.cli.launch", "import_", "Read the launch configuration you run today into a plan."),
    "show": ("meshplan.cli.launch", "show", "Print a plan file, every figure re-derived."),
    "compare": ("meshplan.cli.compare", "compare", "Compare plans knob by knob and term by term."),
    "verify": ("meshplan.cli.launch", "verify", "Run the plan's exact layout on torch.distributed and check it."),
    "models": ("meshplan.cli.catalog", "models_app", "Built-in model zoo and model files."),
    "hardware": ("meshplan.cli.catalog", "hardware_app", "Built-in GPU specifications, every number sourced."),
}


def load_command(name: str) -> Any:
    """The click command (or group) of one entry of COMMANDS, its module imported now."""
    module, attr, _ = COMMANDS[name]
    target = getattr(importlib.import_module(module), attr)
    if isinstance(target, typer.Typer):
        return typer.main.get_group(target)
    single = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)
    single.command(name)(target)
    return typer.main.get_command(single)


class _LazyCommands(dict):
    """The group's commands by name, each built on first lookup (load_command): click and typer read `commands`
    for the command to run and for their "did you mean" suggestions; only the one asked for is built."""

    def __init__(self) -> None:
        super().__init__(dict.fromkeys(COMMANDS))

    def __getitem__(self, name: str) -> Any:
        if dict.__getitem__(self, name) is None:
            self[name] = load_command(name)
        return dict.__getitem__(self, name)

    def get(self, name: str, default: Any = None) -> Any:
        return self[name] if dict.__contains__(self, name) else default


class LazyGroup(TyperGroup):
    """meshplan's top-level group: commands from COMMANDS, imported when used; --help lists them from the table."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.commands = _LazyCommands()

    def list_commands(self, ctx: Any) -> list[str]:
        return list(COMMANDS)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        with formatter.section("Commands"):
            formatter.write_dl([(name, line) for name, (_, _, line) in COMMANDS.items()])


app = typer.Typer(
    name="meshplan",
    help="Parallelism planner for LLM training: search the fastest parallel plan that fits, or estimate one.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's plain help: rich's option tables cut flags and help at 80 columns ("Time-to-first-to…")
    rich_markup_mode=None,
    cls=LazyGroup,
)


def _version() -> str:
    from importlib import metadata  # 40 ms: only for --version

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


# ---- entry point ---------------------------------------------------------------------------------------------------

# the option a value of these types comes from, to name it in the error line
_FLAGS = {"ClusterSpec": {"num_gpus": "--gpus", "gpus_per_node": "--gpus-per-node", "nic_gbps": "--nic-gbps",
                          "nvlink_gb_s": "--nvlink-gbs"},
          "Workload": {"global_batch": "--gbs", "seq_len": "--seq"}}


def _validation_error() -> type[Exception] | None:
    """pydantic's ValidationError where pydantic is loaded (a command that got this far imported it), else None:
    main does not import pydantic for `--version` or a usage error."""
    pydantic = sys.modules.get("pydantic")
    return getattr(pydantic, "ValidationError", None) if pydantic is not None else None


def _validation_message(exc: Any) -> str:
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
            typer.echo(exc.format_message())  # type: ignore[attr-defined]  # a bare `meshplan` / `meshplan models`
            return 0
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
    except (InputError, OSError, json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        print_error(one_line(exc))
        return EXIT_INPUT
    except Exception as exc:
        validation = _validation_error()
        if validation is None or not isinstance(exc, validation):
            raise
        print_error(one_line(_validation_message(exc)))
        return EXIT_INPUT
    return rv if isinstance(rv, int) else 0


if __name__ == "__main__":
    sys.exit(main())
