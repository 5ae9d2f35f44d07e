"""One store per engine per process, shared by the engine's scheduler and worker sides.

vLLM builds a connector twice, once for its scheduler and once per worker;
with one worker (the CPU engine, one GPU) both live in the engine-core process
and must see the same tiers, so they share the store through this registry,
keyed by the engine's id. The last holder to release it closes it.
"""

from __future__ import annotations

import atexit
import logging
import threading

from lmkv.config import LMKVConfig
from lmkv.store import TieredStore

log = logging.getLogger(__name__)

_lock = threading.Lock()
_stores: dict[str, tuple[TieredStore, int]] = {}
_hooked = False


def close_at_exit() -> None:
    """Close every store still open when the process exits: the copies down to lower tiers that
    an engine was told are done (SGLang's ``batch_set_v1`` acknowledged them) are finished and
    flushed, not lost; copies that fail are logged. Runs before Python shuts its thread pools
    down (after that, a copy still queued could not run, and its failure went unseen)."""
    with _lock:
        stores = [s for s, _ in _stores.values()]
        _stores.clear()
    for store in stores:
        try:
            store.close()
        except Exception:
            log.exception("lmkv: closing a store at exit failed")
            continue
        if store.writes.failed:
            log.warning("lmkv: %d page copies to lower tiers failed (%d dropped) before exit",
                        store.writes.failed, store.writes.dropped)


def _hook_exit() -> None:
    """Register :func:`close_at_exit` once, where it runs before the thread pools stop: Python runs
    threading's exit callbacks last-registered first, and ``concurrent.futures`` registered its
    own at import (``threading._register_atexit`` is that mechanism; ``atexit`` runs too late)."""
    global _hooked
    if _hooked:
        return
    _hooked = True
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(close_at_exit)
    except RuntimeError:  # (interpreter already shutting down, or another Python)
        atexit.register(close_at_exit)


def engine_config(cfg: LMKVConfig) -> LMKVConfig:
    """``cfg`` with an engine's defaults where the user left a setting unset: the memory tier's
    arena mapped whole from the start (``memory.prefault``: a step lands all its pages at once)."""
    if cfg.memory.prefault is None:
        return cfg.model_copy(update={"memory": cfg.memory.model_copy(update={"prefault": True})})
    return cfg


def acquire_store(scope: str, cfg: LMKVConfig) -> TieredStore:
    """The engine's store for ``scope``, opened with :func:`engine_config` the first time."""
    with _lock:
        entry = _stores.get(scope)
        if entry is None:
            store = TieredStore(engine_config(cfg))
            _stores[scope] = (store, 1)
            _hook_exit()
            return store
        store, refs = entry
        _stores[scope] = (store, refs + 1)
        return store


def find_store(scope: str) -> TieredStore | None:
    """The store a worker of this process opened for ``scope``, taking a reference; None if none."""
    with _lock:
        entry = _stores.get(scope)
        if entry is None:
            return None
        store, refs = entry
        _stores[scope] = (store, refs + 1)
        return store


def release_store(scope: str) -> None:
    with _lock:
        entry = _stores.get(scope)
        if entry is None:
            return
        store, refs = entry
        if refs > 1:
            _stores[scope] = (store, refs - 1)
            return
        del _stores[scope]
    store.close()


def live_stores() -> dict[str, TieredStore]:
    """Stores alive in this process (for stats in the demo and in tests)."""
    with _lock:
        return {k: s for k, (s, _) in _stores.items()}
