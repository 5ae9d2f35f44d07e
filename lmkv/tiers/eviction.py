"""Eviction policies: LRU, and S3-FIFO for scan resistance.

A policy orders keys; the tier asks it for a victim and skips keys it cannot
evict right now (pinned by a reader or a copy in flight). S3-FIFO (Yang et al.,
SOSP 2023) keeps one-hit wonders in a small FIFO so a long scan of pages that
are never reused cannot flush the pages that are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable

from lmkv.keys import PageKey


class EvictionPolicy(ABC):
    """Orders resident keys for eviction."""

    @abstractmethod
    def insert(self, key: PageKey) -> None: ...

    @abstractmethod
    def touch(self, key: PageKey) -> None: ...

    @abstractmethod
    def remove(self, key: PageKey) -> None: ...

    @abstractmethod
    def victim(self, evictable: Callable[[PageKey], bool]) -> PageKey | None:
        """Choose, remove and return the next key to evict (one ``evictable`` accepts)."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    def __init__(self) -> None:
        self._order: OrderedDict[PageKey, None] = OrderedDict()

    def insert(self, key: PageKey) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: PageKey) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: PageKey) -> None:
        self._order.pop(key, None)

    def victim(self, evictable: Callable[[PageKey], bool]) -> PageKey | None:
        for key in self._order:
            if evictable(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


class S3FIFOPolicy(EvictionPolicy):
    """Small FIFO (10%) for new keys, main FIFO for keys seen twice, ghost FIFO of recent victims."""

    SMALL_FRACTION = 0.1
    MAX_FREQ = 3

    def __init__(self) -> None:
        self._small: OrderedDict[PageKey, None] = OrderedDict()
        self._main: OrderedDict[PageKey, None] = OrderedDict()
        self._ghost: OrderedDict[PageKey, None] = OrderedDict()
        self._freq: dict[PageKey, int] = {}

    def insert(self, key: PageKey) -> None:
        if key in self._freq:
            self.touch(key)
            return
        self._freq[key] = 0
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = None
        else:
            self._small[key] = None

    def touch(self, key: PageKey) -> None:
        f = self._freq.get(key)
        if f is not None:
            self._freq[key] = min(f + 1, self.MAX_FREQ)

    def remove(self, key: PageKey) -> None:
        if self._freq.pop(key, None) is not None:
            self._small.pop(key, None)
            self._main.pop(key, None)

    def _evict_from(self, fifo: OrderedDict, evictable: Callable[[PageKey], bool], small: bool) -> PageKey | None:
        # Keys in main may need MAX_FREQ passes to age out; pinned keys go round again.
        for _ in range(len(fifo) * (self.MAX_FREQ + 1)):
            if not fifo:
                return None
            key, _ = fifo.popitem(last=False)
            f = self._freq[key]
            if small and f > 1:
                self._freq[key] = 0
                self._main[key] = None
            elif not small and f > 0:
                self._freq[key] = f - 1
                fifo[key] = None
            elif not evictable(key):
                fifo[key] = None
            else:
                del self._freq[key]
                if small:
                    self._ghost[key] = None
                    while len(self._ghost) > max(len(self._main), 1):
                        self._ghost.popitem(last=False)
                return key
        return None

    def victim(self, evictable: Callable[[PageKey], bool]) -> PageKey | None:
        if len(self._small) >= self.SMALL_FRACTION * len(self._freq):
            order = ((self._small, True), (self._main, False), (self._small, True))
        else:
            order = ((self._main, False), (self._small, True), (self._main, False))
        for fifo, small in order:
            key = self._evict_from(fifo, evictable, small)
            if key is not None:
                return key
        return None

    def __len__(self) -> int:
        return len(self._freq)


def make_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "s3fifo":
        return S3FIFOPolicy()
    raise ValueError(f"eviction policy {name!r}: accepted are 'lru' and 's3fifo'")
