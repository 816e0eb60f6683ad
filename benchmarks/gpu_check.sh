#!/usr/bin/env bash
# The GPU check in one command (issue 21; docs/calibration.md, "The GPU check"). Installs what the device image lacks
# from the carried wheels (.whl/, made by benchmarks/gpu_wheels.sh) into a venv that sees the image's torch, installs
# meshplan from this tree, and runs benchmarks/gpu_check.py within $DEADLINE seconds (default 480) into $OUT/gpu
# (or ./gpu-check-out/gpu). Whatever exists is packed into logs.tgz on any exit, a hang or a kill included.
set -uo pipefail
cd "$(dirname "$0")/.."
DEST="${OUT:-$PWD/gpu-check-out}/gpu"
DEADLINE="${DEADLINE:-480}"
mkdir -p "$DEST"
trap 'tar czf "$DEST/logs.tgz" -C "$DEST" . --exclude=logs.tgz 2>/dev/null || true' EXIT
start=$(date +%s)
PY="${PYTHON:-python3}"
# a venv that sees the image's torch (GPU_CHECK_VENV=0: install into $PYTHON's own environment instead)
if [ "${GPU_CHECK_VENV:-1}" = 1 ] && "$PY" -m venv --system-site-packages .gpu-venv >> "$DEST/install.log" 2>&1; then
    PY="$PWD/.gpu-venv/bin/python"
fi
if [ -d .whl ]; then
    "$PY" -m pip install -q --no-index --find-links .whl pydantic typer rich networkx numpy setuptools wheel \
        >> "$DEST/install.log" 2>&1 || echo "wheel install failed: see install.log" >> "$DEST/summary.txt"
fi
if ! "$PY" -m pip install -q --no-deps --no-build-isolation . >> "$DEST/install.log" 2>&1; then
    echo "meshplan install failed: see install.log" | tee -a "$DEST/summary.txt"
    exit 1
fi
left=$(( DEADLINE - ($(date +%s) - start) - 10 ))
"$PY" benchmarks/gpu_check.py --out "$DEST" --deadline "$left"
