"""Helpers to run vLLM's CPU engine with lmkv on a locally generated model."""

from __future__ import annotations

import gc
import os
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

BLOCK = 32


def make_llm(model: str, *, lmkv: dict | None, multiprocess: bool = False, prefix_caching: bool = True,
             kv_bytes: int = 64 << 20, batched_tokens: int | None = 128, max_seqs: int = 8, max_len: int = 2048,
             by_name: bool = False, log_stats: bool = False, kv_events_endpoint: str | None = None,
             dtype: str = "bfloat16"):
    """An engine; ``lmkv=None`` runs without a connector. Chunked prefill is on (prompts > batched_tokens;
    ``None``: vLLM's default token budget).

    ``by_name`` names the connector only, relying on lmkv's vLLM plugin to register it; ``log_stats``:
    vLLM's stat loggers run (its Prometheus metrics, lmkv's among them, in this process's registry);
    ``kv_events_endpoint``: vLLM publishes KV events there (its ZMQ publisher); ``dtype``: float32 where a
    test compares tokens across different batch shapes (bfloat16 rounding then flips a greedy token)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if multiprocess else "0"
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kw: dict[str, Any] = {}
    if lmkv is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMKVConnector", kv_connector_module_path=None if by_name else "lmkv.connectors.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute", kv_connector_extra_config=lmkv,
        )
        kw["worker_extension_cls"] = "lmkv.connectors.vllm.LMKVWorkerExtension"
    if kv_events_endpoint is not None:
        from vllm.config import KVEventsConfig

        kw["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                endpoint=kv_events_endpoint, topic="kv")
    if batched_tokens is not None:
        kw["max_num_batched_tokens"] = batched_tokens
    return LLM(
        model=model, skip_tokenizer_init=True, enforce_eager=True, max_model_len=max_len, block_size=BLOCK,
        dtype=dtype, max_num_seqs=max_seqs,
        kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=prefix_caching, seed=0,
        disable_log_stats=not log_stats, **kw,
    )


@contextmanager
def engine(model: str, **kw):
    llm = make_llm(model, **kw)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm, prompts: list[list[int]], max_tokens: int = 8, salt: str | None = None) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in run(llm, prompts, max_tokens, salt)]


def run(llm, prompts: list[list[int]], max_tokens: int = 8, salt: str | None = None):
    """vLLM's RequestOutputs (``num_cached_tokens``: tokens vLLM's cache or lmkv supplied)."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, temperature=0)
    items = []
    for p in prompts:
        item: dict[str, Any] = {"prompt_token_ids": list(p)}
        if salt is not None:
            item["cache_salt"] = salt
        items.append(item)
    return llm.generate(items, sp, use_tqdm=False)


def lmkv_stats(llm) -> dict:
    return llm.collective_rpc("lmkv_stats")[0]


def scheduler_stats(llm) -> dict | None:
    """lmkv's scheduler-side counts (lookups, those answered locally as a tier was presumed stalled)
    of an in-process engine; None for a multiprocess one (its scheduler lives in another process)."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    connector = getattr(getattr(core, "scheduler", None), "connector", None)
    lmkv = getattr(connector, "scheduler", None)
    return None if lmkv is None else dict(vars(lmkv.stats))


def prompt(n: int, seed: int) -> list[int]:
    return [(i * 37 + seed * 101) % 1000 + 3 for i in range(n)]


def scraped(name: str, **labels: str) -> float:
    """A metric as vLLM's ``/metrics`` would show it (this process's Prometheus registry), summed
    over the series whose labels include ``labels``."""
    from prometheus_client import REGISTRY

    return sum(s.value for m in REGISTRY.collect() for s in m.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
