"""Headers kept between reads of a page's ranges: a layerwise load reads each page in spans, and
only the first needs the header (remote tiers, where it is a round trip; the disk tier, where it
is a read of its own)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from lmkv.keys import PageKey
from lmkv.page import PageHeader


class HeaderCache:
    """The headers of pages a tier read or wrote lately, the least recently used dropped beyond
    ``capacity``; thread-safe. A page's key names its content, so a header kept verifies every
    later read of the page's ranges without reading the header again (a layerwise load's later
    spans); a tier forgets a page's header when the page fails it or is deleted."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._headers: OrderedDict[PageKey, PageHeader] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, keys: Sequence[PageKey]) -> list[PageHeader | None]:
        with self._lock:
            out = [self._headers.get(k) for k in keys]
            for k, h in zip(keys, out):
                if h is not None:
                    self._headers.move_to_end(k)
            return out

    def put(self, key: PageKey, header: PageHeader) -> None:
        self.put_many([(key, header)])

    def put_many(self, items: Sequence[tuple[PageKey, PageHeader]]) -> None:
        """Every ``(key, header)`` kept, under one lock (a read keeps a header for each page it verified)."""
        with self._lock:
            for key, header in items:
                self._headers[key] = header
                self._headers.move_to_end(key)
            while len(self._headers) > self.capacity:
                self._headers.popitem(last=False)

    def forget(self, keys: Sequence[PageKey]) -> None:
        with self._lock:
            for k in keys:
                self._headers.pop(k, None)
