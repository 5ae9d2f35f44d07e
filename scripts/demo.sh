#!/usr/bin/env bash
# The main job (README): install lmkv with vLLM's CPU engine into ./.venv, then run the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec .venv/bin/lmkv demo "$@"
