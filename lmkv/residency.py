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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from lmkv.store import Lookup


@dataclass
class ResidencyDelta:
    """Keys a memory tier gained and lost since the last delta, in order."""

    added: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)

    def merge(self, other: ResidencyDelta) -> ResidencyDelta:
        return ResidencyDelta(self.added + other.added, self.removed + other.removed)


class ResidencyLog:
    """Collects a memory tier's changes (called under the tier's lock) until drained."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._delta = ResidencyDelta()
        self._order: list[tuple[bool, bytes]] = []

    def added(self, key: bytes) -> None:
        with self._lock:
            self._order.append((True, key))

    def removed(self, key: bytes) -> None:
        with self._lock:
            self._order.append((False, key))

    def drain(self) -> ResidencyDelta:
        """The net change since the last drain: a key added then removed is reported removed."""
        with self._lock:
            order, self._order = self._order, []
        final: dict[bytes, bool] = {}
        for present, key in order:
            final[key] = present
        delta = ResidencyDelta()
        for key, present in final.items():
            (delta.added if present else delta.removed).append(key)
        return delta


class ResidencyMirror:
    """The scheduler's view: mirrored worker memory, then tiers it can see itself."""

    name = "worker-memory"

    def __init__(self, lower: Sequence = ()) -> None:
        self._keys: set[bytes] = set()
        self.lower = list(lower)

    def apply(self, delta: ResidencyDelta) -> None:
        self._keys.difference_update(delta.removed)
        self._keys.update(delta.added)

    def __len__(self) -> int:
        return len(self._keys)

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        found = [k in self._keys for k in keys]
        for tier in self.lower:
            todo = [i for i, f in enumerate(found) if not f]
            if not todo:
                break
            for i, present in zip(todo, tier.contains([keys[i] for i in todo])):
                found[i] = present
        return found

    def lookup(self, keys: Sequence[bytes]) -> Lookup:
        where = ["memory" if k in self._keys else None for k in keys]
        for tier in self.lower:
            todo = [i for i, w in enumerate(where) if w is None]
            if not todo:
                break
            for i, present in zip(todo, tier.contains([keys[i] for i in todo])):
                if present:
                    where[i] = tier.name
        n = next((i for i, w in enumerate(where) if w is None), len(keys))
        return Lookup(tuple(where[:n]))  # type: ignore[arg-type]


def merge_deltas(deltas: Iterable[ResidencyDelta]) -> ResidencyDelta:
    out = ResidencyDelta()
    for d in deltas:
        out = out.merge(d)
    return out
