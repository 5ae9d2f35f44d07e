"""One store per engine per process, shared by the engine's scheduler and worker sides.

vLLM builds a connector twice, once for its scheduler and once per worker;
with one worker (the CPU engine, one GPU) both live in the engine-core process
and must see the same tiers, so they share the store through this registry,
keyed by the engine's id. The last holder to release it closes it.
"""

from __future__ import annotations

import threading

from lmkv.config import LMKVConfig
from lmkv.store import TieredStore

_lock = threading.Lock()
_stores: dict[str, tuple[TieredStore, int]] = {}


def acquire_store(scope: str, cfg: LMKVConfig) -> TieredStore:
    with _lock:
        entry = _stores.get(scope)
        if entry is None:
            store = TieredStore(cfg)
            _stores[scope] = (store, 1)
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
