#!/usr/bin/env bash
# Lint and type checks (run by scripts/test.sh): ruff over the repository, mypy over lmkv/ and
# connectors/ as they are installed (pyproject's package-dir puts connectors/, benchmarks/ and
# kernels/ inside the lmkv package, so they are staged there as links for mypy to resolve imports).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PY:-$ROOT/.venv/bin/python}
"$PY" -m ruff check .
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
mkdir "$STAGE/lmkv"
for entry in lmkv/*; do ln -s "$ROOT/$entry" "$STAGE/lmkv/"; done
for dir in connectors benchmarks kernels; do ln -s "$ROOT/$dir" "$STAGE/lmkv/$dir"; done
cd "$STAGE"
"$PY" -m mypy --config-file "$ROOT/pyproject.toml" --cache-dir "$ROOT/.mypy_cache" -p lmkv
