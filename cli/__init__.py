"""The meshplan command line: a thin typer layer over costmodels and hardware_db (see cli/main.py)."""
