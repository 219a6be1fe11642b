#!/usr/bin/env bash
# The wheels a lent GPU's image lacks, for its Python 3.12, at the versions this checkout's venv runs (so the pins live
# in one place: pyproject.toml, as installed): scripts/device_wheels.sh DIR PACKAGE...
# Used by scripts/device_pack.sh pack and scripts/gpu_bench.sh --wheels.
set -euo pipefail
PYTHON="${PYTHON:-.venv/bin/python}"
dir=$1
shift
pins=()
for package in "$@"; do
  pins+=("$package==$("$PYTHON" -c 'import importlib.metadata as m, sys; print(m.version(sys.argv[1]))' "$package")")
done
exec "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dir" "${pins[@]}"
