#!/usr/bin/env bash
# The wheels the GPU machine's image lacks (issue 21: it has Python 3.12 and torch with CUDA, no pydantic), for
# benchmarks/gpu_check.sh to install offline: run here before carrying .whl/ (git-ignored) to the device.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir .whl
python3 -m pip download -q --only-binary=:all: --python-version "${PY_VERSION:-3.12}" --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d .whl "pydantic>=2.6" "typer>=0.17" "rich>=13.7" "networkx>=3.2" "numpy>=1.26" "setuptools>=77" wheel
du -sh .whl
