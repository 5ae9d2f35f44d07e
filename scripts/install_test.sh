#!/usr/bin/env bash
# Installs what the tests need beyond the demo (scripts/install.sh first), idempotent:
#   redis-server and openssl (Debian packages; the tests start their own servers on loopback);
#   the Mooncake Store client (lmkv[mooncake]) and the Debian libraries it loads;
#   the HIP compilers for the kernels' compile checks (optional: those tests skip without them);
#   lmkv[test]; sglang 0.5.23 without its dependencies (they pin CUDA torch and GPU kernels) plus
#   the few small packages its storage and host-pool modules import beyond vLLM's; lmcache 0.5.6
#   without its dependencies (its lazy offload policy runs beside lmkv's in `lmkv bench offload`).
# pip reports that sglang and lmcache pin other versions than vLLM's: expected, and silenced.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
if ! command -v redis-server >/dev/null || ! command -v openssl >/dev/null; then
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server openssl >/dev/null
fi
# The Mooncake Store client's libraries (its tests start their own mooncake_master on loopback).
if ! dpkg -s libibverbs1 librdmacm1 libnuma1 liburing2 libcurl4 >/dev/null 2>&1; then
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libibverbs1 librdmacm1 libnuma1 liburing2 libcurl4 >/dev/null
fi
# Debian's package starts a redis-server on 6379 as a service; lmkv's tests start their own.
# Debian's hipcc (ROCm 5.2) for gfx90a, and LLVM 19 with ROCm's HIP headers for gfx942 (newer than
# ROCm 5.2).
if ! command -v hipcc >/dev/null || ! command -v clang-19 >/dev/null; then
    { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq hipcc libamdhip64-dev clang-19 >/dev/null; } ||
        echo "install_test.sh: hipcc / clang-19 not installed; the HIP compile checks will be skipped" >&2
fi
VENV=.venv
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
have() { "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }
"${PIP[@]}" -e ".[test,mooncake]"
have sglang 0.5.23 || "${PIP[@]}" --no-deps sglang==0.5.23
have lmcache 0.5.6 || "${PIP[@]}" --no-deps lmcache==0.5.6
"${PIP[@]}" orjson ipython gguf 2>&1 | grep -v "dependency resolver\|requires .* which is not installed\|which is incompatible" || true
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
