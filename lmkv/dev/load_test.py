"""A bounded load test of a cache server: N clients, M seconds of mixed put / get / exists.

Each client owns a pool of keys whose content is fixed (derived from the key),
so every page read back can be checked byte for byte, and it remembers which
pages the server acknowledged. A page acknowledged and later reported missing
is *lost* (the server's memory must hold the whole working set for that to mean
anything: :func:`run_load` reports the server's evictions beside it); a page
whose bytes differ is *corrupt*. ``lmkv bench server`` and the tests use it.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import xxhash

from lmkv.config import RemoteConfig
from lmkv.errors import LMKVError
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.page import make_header
from lmkv.tiers.server_client import ServerTier


@dataclass
class LoadResult:
    """What a load test against ``lmkv serve`` saw: requests, pages checked, lost or corrupt pages, errors."""

    clients: int
    seconds: float
    ops: int = 0
    pages_checked: int = 0
    lost: int = 0
    corrupt: int = 0
    errors: int = 0
    put_bytes: int = 0
    get_bytes: int = 0
    server_evictions: int = 0
    server_memory_used: int = 0
    server_memory_capacity: int = 0
    notes: list[str] = field(default_factory=list)


def _content(key: bytes, nbytes: int) -> np.ndarray:
    return np.random.default_rng(int.from_bytes(key[:8], "little")).integers(0, 256, nbytes, dtype=np.uint8)


def run_load(url: str, clients: int, seconds: float, layout: GroupLayout, keys_per_client: int = 32,
             batch: int = 4, seed: int = 0, **remote) -> LoadResult:
    """Drive the server at ``url`` from ``clients`` threads, each with its own connections."""
    result = LoadResult(clients, seconds)
    lock = threading.Lock()
    deadline = time.monotonic() + seconds

    def client(ci: int) -> None:
        tier = ServerTier(RemoteConfig(url=url, **remote), namespace=f"load-{seed}")
        rng = random.Random(seed * 1000 + ci)
        keys = [PageKey(xxhash.xxh3_128_digest(f"{seed}/{ci}/{j}".encode())) for j in range(keys_per_client)]
        content = {k: _content(k, layout.payload_bytes) for k in keys}
        headers = {k: make_header(k, layout, content[k]) for k in keys}
        acked: set[PageKey] = set()
        outs = [np.empty(layout.payload_bytes, np.uint8) for _ in range(batch)]
        mine = LoadResult(1, seconds)
        try:
            while time.monotonic() < deadline:
                pick = rng.sample(keys, batch)
                op = rng.random()
                try:
                    if op < 0.4:
                        stored = tier.put([(headers[k], content[k]) for k in pick], "load")
                        acked.update(k for k, ok in zip(pick, stored) if ok)
                        mine.put_bytes += sum(stored) * layout.payload_bytes
                    elif op < 0.85:
                        got = tier.get(pick, layout, outs)
                        for k, h, o in zip(pick, got, outs):
                            if h is None:
                                mine.lost += k in acked
                                continue
                            mine.pages_checked += 1
                            mine.get_bytes += layout.payload_bytes
                            mine.corrupt += not np.array_equal(o, content[k])
                    else:
                        present = tier.contains(pick)
                        mine.lost += sum(k in acked and not p for k, p in zip(pick, present))
                    mine.ops += 1
                except LMKVError as e:
                    mine.errors += 1
                    mine.notes.append(f"client {ci}: {e}")
            mine.corrupt += tier.stats.corrupt  # caught by the checksum before the byte comparison
        finally:
            tier.close()
            with lock:
                for f in ("ops", "pages_checked", "lost", "corrupt", "errors", "put_bytes", "get_bytes"):
                    setattr(result, f, getattr(result, f) + getattr(mine, f))
                result.notes += mine.notes[:5]

    threads = [threading.Thread(target=client, args=(i,), name=f"lmkv-load-{i}") for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    probe = ServerTier(RemoteConfig(url=url, **remote))
    try:
        mem = probe.server_stats()["memory"]
        result.server_evictions = mem["evictions"]
        result.server_memory_used = mem["used_bytes"]
        result.server_memory_capacity = mem["capacity_bytes"]
    finally:
        probe.close()
    return result
