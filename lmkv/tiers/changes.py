"""A tier's change notes: how many pages it gained and lost, and which it lost lately.

An engine's scheduler looks a waiting request up again every step it waits, and a long prompt
has thousands of pages. With notes, a repeated lookup asks a tier nothing about pages it found
there before unless the tier lost one of them since (:func:`lmkv.lookup.find_prefix`), and asks
about pages it lacked only when the tier gained some. A tier without notes (a network tier,
which other processes change) is asked again each time.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from lmkv.keys import PageKey

#: how many recent losses a tier remembers; a lookup whose mark is older re-asks what it found there
KEEP = 1 << 16


@dataclass(frozen=True)
class Mark:
    """A tier's counts at one moment: what a later lookup compares against."""

    gained: int
    lost: int


class ChangeNotes:
    """Counts of pages gained and lost, and the last :data:`KEEP` keys lost. Any thread."""

    def __init__(self, keep: int = KEEP, refresh: Callable[[], None] | None = None) -> None:
        """``refresh``: brings the tier's view up to date before a mark is taken (a disk tier reads
        the changes other processes sharing its directory logged)."""
        self._refresh = refresh
        self._lock = threading.Lock()
        self._gained = 0
        self._lost = 0
        self._recent: deque[PageKey] = deque(maxlen=keep)

    def gained(self, n: int = 1) -> None:
        with self._lock:
            self._gained += n

    def lost(self, key: PageKey) -> None:
        with self._lock:
            self._lost += 1
            self._recent.append(key)

    def lost_many(self, keys: list[PageKey]) -> None:
        with self._lock:
            self._lost += len(keys)
            self._recent.extend(keys)

    def mark(self) -> Mark:
        if self._refresh is not None:
            self._refresh()
        with self._lock:
            return Mark(self._gained, self._lost)

    def lost_since(self, mark: Mark) -> list[PageKey] | None:
        """Keys lost since ``mark`` (a key may repeat), or None if more were lost than are remembered."""
        with self._lock:
            n = self._lost - mark.lost
            if n > len(self._recent):
                return None
            return list(itertools.islice(reversed(self._recent), n))
