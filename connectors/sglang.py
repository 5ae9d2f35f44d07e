"""lmkv as an SGLang HiCache storage backend (L3 beneath SGLang's host pools).

Loaded with SGLang's ``dynamic`` backend::

    --enable-hierarchical-cache --hicache-mem-layout page_first_direct
    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "lmkv",
        "module_path": "lmkv.connectors.sglang", "class_name": "LMKVHiCacheStorage",
        "interface_v1": 1, "disk": {"path": "/var/cache/lmkv"}, "remote": {"url": "lmkv://host:7420"}}'

Every key other than SGLang's own (:data:`SGLANG_KEYS`: the factory's, ``interface_v1``,
``allocator``, the prefetch settings) is lmkv configuration, validated like the vLLM
connector's: a misspelt lmkv key fails the attach. ``interface_v1`` makes SGLang call the zero-copy methods
(``batch_get_v1``/``batch_set_v1``): pages move between SGLang's host pool and
lmkv's tiers without the flat-page copy of the generic path. Sidecar pools
(Mamba state, sliding-window KV) go through the v2 methods.

SGLang's page hashes (already chained over the prefix and its namespace seed)
become lmkv chain hashes under the model's :class:`~lmkv.keys.KeySpace`; each
pool's descriptor (:mod:`lmkv.connectors.sglang_pools`) then binds them to its
bytes and shard. Nothing here raises into SGLang's I/O threads: a failed page
is ``False`` (SGLang recomputes from there), a failed query is a miss, and so is
every call after :meth:`LMKVHiCacheStorage.close`. Pages a ``batch_set`` acknowledged
reach the lower tiers even if the process exits without ``close()``
(:func:`lmkv.engine.stores.close_at_exit`).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from lmkv.config import load_config
from lmkv.engine.stores import acquire_store, release_store
from lmkv.errors import LMKVError, TierFullError
from lmkv.keys import KeySpace, PageKey, page_key
from lmkv.store import TieredStore

from .sglang_pools import PoolPages, describe_pool

log = logging.getLogger(__name__)

#: keys of the backend's extra config that SGLang consumes itself (its dynamic-backend factory,
#: its cache controller and host allocator, sglang 0.5.23); every other key is lmkv's
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "allocator", "tp_lcm_size",
               "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
               "hicache_storage_pass_prefix_keys")
KV = "kv"

F = TypeVar("F", bound=Callable[..., Any])


def _never_raises(fallback: Callable[..., Any]) -> Callable[[F], F]:
    """SGLang calls a backend from its I/O threads, where an exception is a dead thread or a
    crashed engine: anything unexpected (or a call after ``close()``) is logged and answered
    with ``fallback(*args)``, a miss or ``False``, and SGLang recomputes."""
    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(self, *args, **kwargs):
            if self.store is None:
                if not self._warned_closed:
                    self._warned_closed = True
                    log.warning("lmkv: SGLang called %s after close(); answering misses", fn.__name__)
                return fallback(*args, **kwargs)
            try:
                return fn(self, *args, **kwargs)
            except Exception:
                log.exception("lmkv: %s failed; answering a miss (SGLang recomputes)", fn.__name__)
                return fallback(*args, **kwargs)
        return call  # type: ignore[return-value]
    return wrap


def _no_pages(keys, *args, **kwargs) -> list[bool]:
    return [False] * len(keys)


def _no_pool_pages(transfers, *args, **kwargs) -> dict:
    return {t.name: [False] * len(t.keys or []) for t in transfers}


def _pool_name(name) -> str:
    """A ``PoolName`` (a str enum) or a plain string, as the key of a registered pool."""
    return str(getattr(name, "value", name))


def _model_id(cfg_model: str | None, sc: HiCacheStorageConfig) -> str:
    """The model identity keys carry, qualified by what splits layers or tokens across ranks."""
    model = cfg_model or sc.model_name or "sglang-model"
    if sc.pp_size > 1:  # each pipeline stage holds other layers under the same page hash
        model += f"|pp{sc.pp_rank}/{sc.pp_size}"
    if sc.attn_cp_size > 1:
        model += f"|cp{sc.attn_cp_rank}/{sc.attn_cp_size}"
    return model


class LMKVHiCacheStorage(HiCacheStorage):
    """HiCache L3 over lmkv's tiered store (memory, disk, ``lmkv serve``, Redis)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = {k: v for k, v in (storage_config.extra_config or {}).items() if k not in SGLANG_KEYS}
        self.cfg = load_config(extra)
        self.storage_config = storage_config
        self.space = KeySpace(_model_id(self.cfg.model_id, storage_config), self.cfg.namespace)
        self._scope = f"sglang:{os.getpid()}:{id(self)}"
        self.store: TieredStore | None = acquire_store(self._scope, self.cfg)
        self._warned_closed = False
        self._host_pools: dict[str, Any] = {}  # SGLang's host pools, by pool name
        self._pages: dict[str, PoolPages] = {}
        self._lock = threading.Lock()
        self._metrics = None
        if storage_config.enable_storage_metrics:
            # (imported only when SGLang collects metrics: that module pulls in SGLang's model configs)
            from sglang.srt.observability.metrics_collector import StorageMetrics

            self._metrics_cls = StorageMetrics
            self._metrics = StorageMetrics()

    @property
    def _live(self) -> TieredStore:
        """The store, while the backend is open (every public method checks first)."""
        if self.store is None:
            raise LMKVError("the backend is closed")
        return self.store

    # -- registration --------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._host_pools.setdefault(KV, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._host_pools[_pool_name(host_pool_name)] = host_pool

    def on_host_pools_registered(self) -> None:
        """Derive every pool's descriptor now, so an unsupported pool fails the attach, not a transfer."""
        for name in self._host_pools:
            log.info("lmkv: SGLang pool %s", self.pool(name).layout.describe())

    def pool(self, name: str) -> PoolPages:
        """The descriptor of a registered pool (built on first use)."""
        with self._lock:
            pages = self._pages.get(name)
            if pages is None:
                if name not in self._host_pools:
                    raise KeyError(f"no SGLang host pool {name!r} registered (have {sorted(self._host_pools)})")
                kv = self._host_pools.get(KV)
                sc = self.storage_config
                pages = describe_pool(
                    self._host_pools[name], name,
                    tokens_per_page=getattr(kv, "page_size", None) or self._host_pools[name].page_size,
                    tp_size=sc.tp_size, tp_rank=sc.tp_rank,
                    # MLA latents (and SWA KV of an MLA model) are the same on every rank; Mamba never is
                    replicated=sc.is_mla_model and name != "mamba")
                self._pages[name] = pages
            return pages

    def keys_for(self, name: str, keys: Sequence[str]) -> list[PageKey]:
        layout = self.pool(name).layout
        return [page_key(self.space.adopt(k.encode()), layout) for k in keys]

    # -- queries ---------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    @_never_raises(lambda *a, **k: 0)
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        try:
            return self._live.lookup(self.keys_for(KV, keys)).pages
        except (LMKVError, OSError, KeyError) as err:
            log.warning("lmkv: existence query failed, answering a miss: %s", err)
            return 0

    @_never_raises(lambda *a, **k: PoolTransferResult(0, {}, []))
    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """KV: the longest stored prefix. A sidecar restricts the restorable prefix lengths:
        ``all_pages`` needs its page at every position, ``trailing_pages`` only the last
        ``len(transfer.keys)`` pages before a prefix end (a Mamba state, an SWA window)."""
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[str, int] = {KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = _pool_name(transfer.name)
            try:
                have = self._live.contains(self.keys_for(name, keys[:kv_pages]))
            except (LMKVError, OSError, KeyError) as err:
                log.warning("lmkv: %s existence query failed, answering a miss: %s", name, err)
                have = [False] * kv_pages
            if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(transfer.keys or ()))
                ok = {n for n in restorable if all(have[max(0, n - window):n])}
            else:
                first_gap = next((i for i, h in enumerate(have) if not h), kv_pages)
                ok = set(range(1, first_gap + 1))
            if ok:
                hits[name] = max(ok)
            restorable &= ok
        ordered = sorted(restorable)
        return PoolTransferResult(ordered[-1] if ordered else 0, hits, ordered)

    # -- zero-copy transfers ---------------------------------------------------

    @_never_raises(_no_pages)
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._load(KV, keys, host_indices)

    @_never_raises(_no_pages)
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._save(KV, keys, host_indices)

    @_never_raises(_no_pool_pages)
    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return {t.name: self._load(_pool_name(t.name), t.keys or [], t.host_indices)
                for t in transfers}

    @_never_raises(_no_pool_pages)
    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return {t.name: self._save(_pool_name(t.name), t.keys or [], t.host_indices)
                for t in transfers}

    def _load(self, name: str, keys: Sequence[str], host_indices) -> list[bool]:
        parts_of = self._host_parts(name, keys, host_indices)
        return self._read(name, keys, parts_of) if parts_of else [False] * len(keys)

    def _save(self, name: str, keys: Sequence[str], host_indices) -> list[bool]:
        parts_of = self._host_parts(name, keys, host_indices)
        return self._write(name, keys, parts_of) if parts_of else [False] * len(keys)

    def _host_parts(self, name: str, keys: Sequence[str], host_indices) -> Callable[[int], list] | None:
        """Key i -> its page's segment views in the host pool; None when the transfer is unusable."""
        try:
            pages = self.pool(name)
        except (KeyError, NotImplementedError) as err:
            log.error("lmkv: %s", err)
            return None
        if host_indices is None or host_indices.numel() != len(keys) * pages.slots_per_page:
            log.error("lmkv: pool %s: %d keys but %s host indices (%d per key expected)", name, len(keys),
                      None if host_indices is None else host_indices.numel(), pages.slots_per_page)
            return None
        host = [pages.page_of(int(i)) for i in host_indices[:: pages.slots_per_page].tolist()]
        bad = [p for p in host if not 0 <= p < pages.num_pages]
        if bad:  # (a negative index would wrap around to another page, silently)
            log.error("lmkv: pool %s: host pages %s outside its %d pages", name, bad[:4], pages.num_pages)
            return None
        return lambda i: pages.segments(pages.page_slice(host[i]))

    def _read(self, name: str, keys: Sequence[str], parts_of: Callable[[int], list[torch.Tensor]]) -> list[bool]:
        """Pages from lmkv into SGLang's memory (``parts_of(i)``: key i's segment views);
        per key, whether it landed (checksums verified on the way)."""
        try:
            pages = self.pool(name)
            t0 = time.perf_counter()
            with self._live.fetch(self.keys_for(name, keys), pages.layout) as got:
                done = []
                for i, (view, header) in enumerate(zip(got.views, got.headers)):
                    ok = header is not None and view is not None
                    if ok:
                        pages.scatter(view, parts_of(i))
                    done.append(ok)
            self._measured("prefetch", sum(done), pages.layout.payload_bytes, time.perf_counter() - t0)
            return done
        except (LMKVError, OSError, KeyError, NotImplementedError) as err:
            log.warning("lmkv: load of %d %s pages failed; SGLang recomputes them: %s", len(keys), name, err)
            return [False] * len(keys)

    def _write(self, name: str, keys: Sequence[str], parts_of: Callable[[int], list[torch.Tensor]]) -> list[bool]:
        """SGLang's pages into lmkv, in one session (pages lmkv already holds are not copied again)."""
        try:
            pages = self.pool(name)
            if not pages.layout.is_writer:
                return [True] * len(keys)  # another rank of the replica set writes these bytes
            lkeys = self.keys_for(name, keys)
            t0 = time.perf_counter()
            have = self._live.contains(lkeys)
            todo = [i for i, h in enumerate(have) if not h]
            if todo:
                with self._live.open_session([lkeys[i] for i in todo], [pages.layout] * len(todo)) as session:
                    for j, i in enumerate(todo):
                        pages.gather(parts_of(i), session.buffer(j))
                    for i, ok in zip(todo, session.commit()):
                        have[i] = ok
                self._measured("backup", sum(have[i] for i in todo), pages.layout.payload_bytes,
                               time.perf_counter() - t0)
            return list(have)
        except TierFullError as err:
            log.warning("lmkv: no room for %d %s pages: %s", len(keys), name, err)
        except (LMKVError, OSError, KeyError, NotImplementedError) as err:
            log.warning("lmkv: store of %d %s pages failed: %s", len(keys), name, err)
        return [False] * len(keys)

    # -- SGLang's storage metrics -------------------------------------------------

    def _measured(self, op: str, pages: int, page_bytes: int, seconds: float) -> None:
        """One transfer for SGLang's storage histograms (pages per operation, GB/s), when enabled."""
        if self._metrics is None or not pages:
            return
        with self._lock:
            getattr(self._metrics, f"{op}_pgs").append(pages)
            getattr(self._metrics, f"{op}_bandwidth").append(pages * page_bytes / max(seconds, 1e-9) / 1e9)

    def get_stats(self):
        """What SGLang's ``--enable-storage-metrics`` exports (``sglang:*prefetch*``/``*backup*``
        histograms): the transfers since the last call, as SGLang's own backends report them."""
        if self._metrics is None:
            return None
        with self._lock:
            out, self._metrics = self._metrics, self._metrics_cls()
        return out

    # -- the generic (flat page) path, used when interface_v1 is off -------------

    def _flat_parts(self, flat: torch.Tensor) -> list[torch.Tensor]:
        pages = self.pool(KV)
        return pages.segments(flat.view(pages.flat_shape()))

    def get(self, key: str, target_location=None, target_sizes=None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    @_never_raises(lambda keys, *a, **k: [None] * len(keys))
    def batch_get(self, keys: list[str], target_locations=None, target_sizes=None) -> list[torch.Tensor | None]:
        done = self._read(KV, keys, lambda i: self._flat_parts(target_locations[i]))
        return [t if ok else None for t, ok in zip(target_locations, done)]

    def set(self, key: str, value=None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    @_never_raises(lambda *a, **k: False)
    def batch_set(self, keys: list[str], values=None, target_locations=None, target_sizes=None) -> bool:
        return all(self._write(KV, keys, lambda i: self._flat_parts(values[i])))

    # -- lifecycle ---------------------------------------------------------------

    @_never_raises(lambda *a, **k: None)
    def clear(self) -> None:
        """``POST /hicache/storage-backend/clear``: drop this engine's residency (other owners keep theirs)."""
        self._live.clear()

    def close(self) -> None:
        if self.store is not None:
            self.store = None
            release_store(self._scope)
