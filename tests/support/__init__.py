"""Helpers the tests share: vLLM's CPU engine with lmkv (``vllm_engine``), SGLang's real host
pools on the CPU (``sglang_pools``), one tensor-parallel rank as a process (``tp_rank``) and
cuFile's interface over host memory (``host_gds``)."""
