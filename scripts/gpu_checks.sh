#!/usr/bin/env bash
# The GPU checks, in one run on a machine with an NVIDIA GPU (the device tool's H200: torch, CuPy,
# cuda-bindings, nvidia-cufile and pytest installed, no package index). lmkv's own small
# dependencies come from ./wheels when it is there (pip download them for that machine's Python).
#   bash scripts/gpu_checks.sh [OUT_DIR]
# Writes pytest's log and the JSON of `lmkv bench copy`, `lmkv bench gds`, `lmkv bench layerwise` to OUT_DIR ($OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-${OUT:-/tmp/lmkv-gpu}}
mkdir -p "$OUT"
if [ -d wheels ]; then
    python -m pip install --quiet --no-index --find-links wheels --no-deps wheels/*.whl >"$OUT/pip.log" 2>&1
fi
export PYTHONPATH=$PWD/.gpu-pkg:$PWD
rm -rf .gpu-pkg && mkdir -p .gpu-pkg/lmkv  # the package as installed: connectors, benchmarks, cuda inside
for e in lmkv/*; do ln -s "$PWD/$e" .gpu-pkg/lmkv/; done
for d in connectors benchmarks cuda; do ln -s "$PWD/$d" ".gpu-pkg/lmkv/$d"; done
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$OUT/gpu.txt" 2>&1
DIR=${GDS_DIR:-/tmp/lmkv-gds}  # a file system cuFile reads (ext4/xfs), not tmpfs
mkdir -p "$DIR"
timeout 300 python -m pytest -q -p no:cacheprovider -o addopts="" tests/test_cuda_kernels.py tests/test_gpu_digests.py \
    tests/test_gds.py tests/test_worker.py -k "gpu or device or gds or kernel or digest or stream" >"$OUT/pytest.log" 2>&1
echo "pytest rc=$?" >>"$OUT/pytest.log"
timeout 120 python -m lmkv.cli bench copy --json >"$OUT/bench-copy.json" 2>"$OUT/bench-copy.log"
timeout 240 python -m lmkv.cli bench gds --json --dir "$DIR" >"$OUT/bench-gds.json" 2>"$OUT/bench-gds.log"
timeout 180 python -m lmkv.cli bench layerwise --json >"$OUT/bench-layerwise.json" 2>"$OUT/bench-layerwise.log"
rm -rf .gpu-pkg
tail -3 "$OUT/pytest.log"
