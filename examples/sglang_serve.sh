#!/usr/bin/env bash
# lmkv as SGLang's HiCache storage backend (L3 beneath SGLang's host memory), loaded through
# SGLang's "dynamic" backend. Needs a GPU machine with sglang==0.5.23 installed.
#
#   bash examples/sglang_serve.sh MODEL_DIR [PORT]
#
# page_first_direct is the host layout whose pages match lmkv's (each page's layers are
# contiguous); the others work too, at the cost of a strided copy. "interface_v1" makes SGLang
# use the zero-copy methods. Every other key in the JSON is lmkv configuration.
set -euo pipefail
MODEL=${1:?usage: sglang_serve.sh MODEL_DIR [PORT]}
PORT=${2:-30000}
exec python -m sglang.launch_server --model-path "$MODEL" --port "$PORT" --host 127.0.0.1 \
  --page-size 64 \
  --enable-hierarchical-cache --hicache-ratio 2 --hicache-mem-layout page_first_direct \
  --hicache-write-policy write_through --hicache-storage-prefetch-policy timeout \
  --hicache-storage-backend dynamic \
  --hicache-storage-backend-extra-config '{
    "backend_name": "lmkv",
    "module_path": "lmkv.connectors.sglang",
    "class_name": "LMKVHiCacheStorage",
    "interface_v1": 1,
    "memory": {"capacity": "8GiB"},
    "disk": {"path": "/var/cache/lmkv", "capacity": "200GiB"}
  }'
