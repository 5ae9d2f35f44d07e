"""Development harnesses: what the demo, the tests and the benchmarks run lmkv against.

Locally generated models (:mod:`~lmkv.dev.tinymodels`), vLLM's CPU engine in this process
(:mod:`~lmkv.dev.local_engine`), real ``redis-server`` and ``lmkv serve`` processes
(:mod:`~lmkv.dev.redis_server`, :mod:`~lmkv.dev.server_process`), a bounded load test
(:mod:`~lmkv.dev.load_test`) and the demo. Product code never imports this package; these
modules (with :mod:`lmkv.offload.sim`) are the only ones that import vLLM or transformers.
"""
