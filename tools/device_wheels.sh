#!/usr/bin/env bash
# Build wheels of the core and every plugin into .whl/kb (ignored), so a GPU machine without
# network can install them (with their entry points) next to the carried third-party wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl/kb && mkdir -p .whl/kb
py=${PYTHON:-.venv/bin/python}
for pkg in ./core ./plugins/*/ ; do
  "$py" -m pip wheel -q --no-deps --no-build-isolation -w .whl/kb "$pkg"
done
ls .whl/kb
