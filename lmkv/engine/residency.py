"""Which pages a worker's memory tier holds, as seen from the engine's scheduler process.

When the engine's scheduler and its workers share a process they share one
store and the scheduler asks it directly. When they do not (vLLM's
multiprocess executor, tensor parallelism), every worker logs what its memory
tier gains and loses (:class:`ResidencyLog`); the log travels to the scheduler
with each step's output, and the scheduler keeps a mirror of it
(:class:`ResidencyMirror`). Lower tiers that every process can see (a shared
disk directory, the lmkv server, Redis) are asked directly. The mirror may lag
one step behind an eviction; the load that then misses is recomputed like any
other failed load.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lmkv.keys import PageKey
from lmkv.lookup import Lookup, PrefixMemo, find_prefix, locate
from lmkv.tiers.changes import ChangeNotes


@dataclass
class ResidencyDelta:
    """Keys a memory tier gained and lost since the last delta, in order."""

    added: list[PageKey] = field(default_factory=list)
    removed: list[PageKey] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)

    def merge(self, other: ResidencyDelta) -> ResidencyDelta:
        return ResidencyDelta(self.added + other.added, self.removed + other.removed)


class ResidencyLog:
    """Collects a memory tier's changes (called under the tier's lock) until drained."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delta = ResidencyDelta()
        self._order: list[tuple[bool, PageKey]] = []

    def added(self, key: PageKey) -> None:
        with self._lock:
            self._order.append((True, key))

    def removed(self, key: PageKey) -> None:
        with self._lock:
            self._order.append((False, key))

    def drain(self) -> ResidencyDelta:
        """The net change since the last drain: a key added then removed is reported removed."""
        with self._lock:
            order, self._order = self._order, []
        final: dict[PageKey, bool] = {}
        for present, key in order:
            final[key] = present
        delta = ResidencyDelta()
        for key, present in final.items():
            (delta.added if present else delta.removed).append(key)
        return delta


class _MirroredMemory:
    name = "memory"

    def __init__(self) -> None:
        self.keys: set[PageKey] = set()
        self.notes = ChangeNotes()

    def apply(self, delta: ResidencyDelta) -> None:
        self.keys.difference_update(delta.removed)
        self.keys.update(delta.added)
        self.notes.lost_many(delta.removed)
        self.notes.gained(len(delta.added))

    def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        return [k in self.keys for k in keys]


class ResidencyMirror:
    """The scheduler's view: mirrored worker memory, then tiers it can see itself."""

    def __init__(self, lower: Sequence = ()) -> None:
        self._memory = _MirroredMemory()
        self.tiers = [self._memory, *lower]

    def apply(self, delta: ResidencyDelta) -> None:
        self._memory.apply(delta)

    def __len__(self) -> int:
        return len(self._memory.keys)

    def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        return [w is not None for w in locate(keys, self.tiers)]

    @property
    def _local(self) -> list:
        """What answers without a network round trip (the mirrored memory and the disk directory)."""
        return [t for t in self.tiers if not getattr(t, "networked", False)]

    def contains_local(self, keys: Sequence[PageKey]) -> list[bool]:
        return [w is not None for w in locate(keys, self._local)]

    def find_prefix(self, keys_of: Callable[[int, int], Sequence[PageKey]], start: int, end: int,
                    memo: PrefixMemo | None = None, local: bool = False) -> tuple[Lookup, PrefixMemo]:
        """:func:`lmkv.lookup.find_prefix` over these tiers (``local``: without the network)."""
        return find_prefix(keys_of, start, end, self._local if local else self.tiers, memo)
