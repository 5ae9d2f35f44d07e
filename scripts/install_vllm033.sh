#!/usr/bin/env bash
# A second venv, ./.venv-vllm033, with vLLM 0.33.0 (the release GPU users run) for the
# scheduler-side tests: vLLM 0.33's wheel pins a CUDA torch, so it is installed --no-deps beside
# the local CPU torch, with its pure-Python requirements (GPU-only ones are skipped; nothing
# here runs a model forward). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv-vllm033
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
have() { "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('$1') != '$2')" 2>/dev/null; }
have torch 2.13.0+cpu || "${PIP[@]}" torch==2.13.0
have vllm 0.33.0 || "${PIP[@]}" --no-deps vllm==0.33.0
"${PIP[@]}" packaging
"$VENV/bin/python" - > "$VENV/vllm-reqs.txt" <<'PYEOF'
import importlib.metadata as md
from packaging.requirements import Requirement
gpu = {"torch", "torchaudio", "torchvision", "torchcodec", "flashinfer-python", "flashinfer-cubin",
       "nvidia-cutlass-dsl", "tilelang", "triton", "xformers", "cupy-cuda12x", "ray", "zentorch",
       "quack-kernels", "deep-gemm", "flashinfer-jit-cache", "apache-tvm-ffi", "xgrammar", "nixl",
       "pynvvideocodec", "fastsafetensors", "instanttensor", "tokenspeed-mla", "humming-kernels"}
for line in md.requires("vllm") or []:
    r = Requirement(line)
    if r.name.lower() in gpu or r.name.lower().startswith("nvidia-"):
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    print(str(r).split(";")[0])
PYEOF
"${PIP[@]}" -r "$VENV/vllm-reqs.txt"
# xgrammar's own requirements pull GPU packages; the scheduler only needs it (and tvm-ffi) to import
"${PIP[@]}" --no-deps xgrammar==0.2.8 apache-tvm-ffi==0.1.11
"$VENV/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
"${PIP[@]}" -e ".[test]"
echo "installed into $VENV: $("$VENV/bin/python" -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)')"
