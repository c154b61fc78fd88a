#!/usr/bin/env bash
# Build wheels of the core and every plugin into .whl/kb (ignored), so a GPU machine without
# network can install them (with their entry points) next to the carried third-party wheels.
# Built from the committed tree (HEAD), so what runs there is exactly what a commit holds.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
rm -rf .whl/kb && mkdir -p .whl/kb
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
git archive "${REF:-HEAD}" | tar -x -C "$src"
py=${PYTHON:-$root/.venv/bin/python}
for pkg in "$src"/core "$src"/plugins/*/ ; do
  "$py" -m pip wheel -q --no-deps --no-build-isolation -w "$root/.whl/kb" "$pkg"
done
ls .whl/kb
