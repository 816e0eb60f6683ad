"""`meshplan compare`: training plans side by side (planner/compare.py), and the table `import` ends with."""

from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from meshplan import api
from meshplan.cli.options import check_budget, console
from meshplan.costmodels.economics import Budget
from meshplan.hardware_db.errors import InputError
from meshplan.planner.compare import Comparison, compare_plans
from meshplan.planner.plan import Plan, ServingPlan


def compare(
    plan_files: Annotated[list[Path], typer.Argument(metavar="PLAN...", help=(
        "Two or more training plans (`meshplan plan --out`, `import --out`)."))],
    price: Annotated[float | None, typer.Option("--price-per-gpu-hour", min=0.0, help=(
        "USD per GPU-hour for plans written without an economics section; default the hardware database's."))] = None,
) -> None:
    """Compare plans: the knobs that differ, predicted step time and each of its terms, memory per stage, cost, and
    why the fastest wins."""
    check_budget("--price-per-gpu-hour", price)
    docs: list[Plan] = []
    notes: list[str] = []
    for path in plan_files:
        opened = api.open_plan(path)
        doc = opened.plan
        for line in (opened.repriced, opened.note):
            if line:
                notes.append(line)
        if isinstance(doc, ServingPlan):
            raise InputError(f"{path} is a serving plan; compare reads training plans")
        docs.append(doc if doc.economics is not None else api.priced(doc, Budget(usd_per_gpu_hour=price)))
    names = [p.stem for p in plan_files]
    if len(set(names)) < len(names):
        names = [str(p) for p in plan_files]
    con = console()
    for line in notes:
        con.print(line)
    print_comparison(con, compare_plans(docs, names))


def print_comparison(con: Console, c: Comparison) -> None:
    table = Table(title="plans side by side")
    table.add_column("", overflow="fold")
    for name in c.names:
        table.add_column(name, justify="right", overflow="fold")
    if c.knobs:
        for row in c.knobs:
            table.add_row(row.label, *row.values)
        table.add_section()
    else:
        con.print("the plans set every knob alike")
    for row in c.metrics:
        table.add_row(row.label, *row.values)
    con.print(table)
    for line in c.verdict:
        con.print(line)
