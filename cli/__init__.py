"""The meshplan command line: a thin typer layer over the Python API (meshplan/api.py). main.py builds the app from
its COMMANDS table, imports a command's module only when that command runs (so `--version` imports no library and
`plan` none of the other commands' modules), and turns bad input into one error line (lines.py: the error, note
and progress lines); options.py holds what the commands share; one file per group of commands: train.py
(estimate, plan), sweep.py, serve.py, launch.py (export, import, show, verify), compare.py, catalog.py (profile,
models, hardware). The command modules keep their annotations evaluated (no `from __future__ import annotations`):
typer reads them on every run, and as strings it would evaluate them each time (3x the cost of a refused command).
"""
