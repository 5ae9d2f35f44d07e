"""``lmkv bench NAME``: benchmarks that print figures beside a baseline measured in the same run.

Each module here has ``run(quick: bool) -> Report``; the output shape is
described in :mod:`lmkv.benchmarks.report`.
"""

from __future__ import annotations

import importlib

BENCHES = {
    "tiers": "host-memory and disk tier put/get GB/s beside memcpy and raw file I/O",
    "vllm": "TTFT and a working set over the KV budget on vLLM's CPU engine, vs vLLM and ExampleConnector",
    "faults": "requests served on vLLM's CPU engine while disk-tier loads fail, vs a fault-free run",
    "redis": "the Redis tier's put/get GB/s beside raw redis-py SET/GET on a real redis-server",
    "server": "lmkv serve put/get GB/s beside a raw loopback socket and memcpy, exists ops/s, a load test",
    "offload": "eager vs eviction-aware lazy offload vs the offline oracle on vLLM's real KVCacheManager",
    "copy": "KV blocks gathered into pages and scattered back (the CUDA kernel on a GPU) beside a contiguous copy",
    "layerwise": "a step's layerwise loads and stores on the worker's copy streams beside the forward alone "
                 "and the forward's-stream path (GPU only)",
    "pd": "prefill/decode hand-off between two vllm serve engines through a shared tier: D's loads, TTFT, "
          "a stalled tier's cost",
    "scale": "scheduler lookups of a 131k-token prompt, a disk tier opening over 100k pages, a 1M-page memory index",
    "mooncake": "the Mooncake Store tier put/get GB/s beside raw Mooncake client calls on a real master",
    "gds": "disk-tier pages read into / written from device memory with GPUDirect Storage, beside raw cuFile "
           "and the POSIX + pinned-host path (GPU only)",
}


def load(name: str):
    if name not in BENCHES:
        raise KeyError(f"unknown bench {name!r}; available: {', '.join(sorted(BENCHES))}")
    return importlib.import_module(f"lmkv.benchmarks.{name}")
