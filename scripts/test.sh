#!/usr/bin/env bash
# The test command (README, .ci/run): install what tests need, then run them all.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/python -m pytest "$@"
