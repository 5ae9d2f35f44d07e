"""Copies down to lower tiers that failed, kept to be retried from memory (``store.failed_writes``).

A tier that refuses a write (down, full, a cluster node away) never fails the writer: the pages'
keys wait here, per tier, oldest first and at most ``store.retry_pages`` of them, and are copied
again from memory the next time that tier takes a write. A page memory evicted meanwhile is
dropped (counted): nothing else holds its bytes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from lmkv.errors import LMKVError, PartlyStoredError
from lmkv.keys import PageKey
from lmkv.lookup import tier_failed
from lmkv.tiers.base import Tier
from lmkv.tiers.memory import MemoryTier

#: pages a retry copies down at a time
BATCH = 256


@dataclass
class WriteStats:
    """Copies down to lower tiers that failed, were retried from memory, or were given up."""

    failed: int = 0
    retried: int = 0
    dropped: int = 0

    @property
    def queued(self) -> int:
        return self.failed - self.retried - self.dropped


class RetryQueue:
    """Per lower tier, the keys (and owning domain) of pages whose copy down failed; thread-safe."""

    def __init__(self, cap: int, retry: bool, stats: WriteStats) -> None:
        """``cap``: keys kept per tier (the oldest are dropped); ``retry``: whether failures are kept
        at all (``store.failed_writes: retry``) or dropped at once."""
        self.cap = cap
        self.retry = retry
        self.stats = stats
        self._queues: dict[str, OrderedDict[PageKey, str]] = {}  # tier -> key -> domain, oldest first
        self._lock = threading.Lock()

    def failed(self, tier: str, keys: Sequence[PageKey], domain: str, from_memory: bool = True) -> None:
        """A copy of these pages to ``tier`` failed; ``from_memory``: memory still holds them (a
        demotion's pages are leaving memory: nothing to retry from)."""
        self.stats.failed += len(keys)
        if from_memory and self.retry:
            self._queue(tier, keys, domain)
        else:
            self.stats.dropped += len(keys)

    def pending(self, tier: str) -> bool:
        return bool(self._queues.get(tier))

    def _queue(self, tier: str, keys: Sequence[PageKey], domain: str) -> None:
        with self._lock:
            q = self._queues.setdefault(tier, OrderedDict())
            for k in keys:
                q[k] = domain
                q.move_to_end(k)
            while len(q) > self.cap:
                q.popitem(last=False)
                self.stats.dropped += 1

    def run(self, tier: Tier, memory: MemoryTier) -> None:
        """``tier`` took a write: copy down what it refused before, from ``memory``, a batch at a time."""
        with self._lock:
            q = self._queues.get(tier.name)
            batch = [q.popitem(last=False) for _ in range(min(len(q), BATCH))] if q else []
        by_domain: dict[str, list[PageKey]] = {}
        for k, d in batch:
            by_domain.setdefault(d, []).append(k)
        for domain, keys in by_domain.items():
            with memory.borrow(keys, count=False) as lease:
                pages = [(h, v) for h, v in zip(lease.headers, lease.views) if h is not None]
                self.stats.dropped += len(keys) - len(pages)  # memory evicted them meanwhile
                if not pages:
                    continue
                try:
                    ok = tier.put(pages, domain)
                except PartlyStoredError as err:
                    self._queue(tier.name, [pages[i][0].key for i in err.unreachable], domain)
                    self.stats.retried += sum(err.stored)
                    return
                except (LMKVError, OSError) as err:
                    tier_failed(tier, "write", err)
                    self._queue(tier.name, [h.key for h, _ in pages], domain)
                    return
                self.stats.retried += sum(ok)
