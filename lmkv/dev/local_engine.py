"""Running vLLM's CPU engine inside this process (the demo and the engine benchmarks).

One engine at a time: vLLM keeps its connector in a process global, so an engine is
shut down before the next one starts.
"""

from __future__ import annotations

import gc
import os


def prepare_env() -> None:
    """In-process engine core, CPU platform, no hub access, quiet logs (unless already set)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def close(llm) -> None:
    """Shut an engine down and drop it, so its connector releases lmkv's store."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def scheduler_connector(llm):
    """The scheduler-side connector of an in-process engine (the benchmarks switch its load path)."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector
