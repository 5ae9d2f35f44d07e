"""Residency events for KV-aware routers: which pages lmkv holds, and where, as they change.

A router (llm-d's, Dynamo's) sends a request to the engine that holds its prefix, so an
event must say what *is*: a page is reported stored when it is committed, never when a
store is only planned (a planned store can be dropped), and removed when it leaves.
The scheduler says what it expects to be stored (:meth:`EventLog.expect`, with
whatever the engine adapter needs to name the page: its own block hash, tokens);
the worker's memory tier reports what it gained and lost (a
:class:`~lmkv.engine.residency.ResidencyDelta`); :meth:`EventLog.apply` turns those
into events. A page that leaves memory but is held by a lower tier (written through,
or demoted) is reported stored there, with that tier's placement, and removed from
memory; a page no tier holds is removed. :meth:`EventLog.cleared` reports every page
as removed (a scoped reset of lmkv's own residency).

Held pages are remembered with their adapter info, bounded: past ``max_held`` the
oldest is forgotten and reported removed (a router then never counts on it). A lower
tier drops pages by itself (its own eviction, Redis's TTL or ``maxmemory``, another
engine clearing a shared server), which no delta tells: :meth:`EventLog.audit` asks
the lower tiers about the pages reported there, a bounded batch at a time, longest
unchecked first, and reports those gone (or moved to another tier). Until a page's
turn comes, a router that sends a request for it gets a miss that lmkv recomputes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import islice
from typing import Any

from lmkv.engine.residency import ResidencyDelta
from lmkv.keys import PageKey


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a page lives, in the terms routers use: medium (``CPU`` for lmkv's memory,
    ``STORAGE`` below it) and locality (``LOCAL`` on this host, ``REMOTE`` on a server)."""

    medium: str
    locality: str


MEMORY = Placement("CPU", "LOCAL")


def placement_of(tier: str) -> Placement:
    """A lower tier's placement by its name: the disk tier is local storage, network tiers remote."""
    return Placement("STORAGE", "LOCAL" if tier == "disk" else "REMOTE")


@dataclass(frozen=True, slots=True)
class PageEvent:
    """A page stored in or removed from a tier (``where``: its medium and locality), for KV events."""

    stored: bool  # False: removed
    info: Any  # the adapter's description of the page (from expect)
    where: Placement


@dataclass(slots=True)
class _Held:
    info: Any
    places: set[Placement] = field(default_factory=set)


class EventLog:
    """What lmkv holds where, for KV-aware routers: pages stored once committed, removed when a tier lets them go.

    Fed by the scheduler side (the pages a step is expected to store) and the workers' residency
    reports; lower tiers are audited now and then for what they dropped by themselves. One
    thread (the scheduler's) uses it."""

    def __init__(self, max_expected: int = 1 << 16, max_held: int = 1 << 20) -> None:
        self._expected: OrderedDict[PageKey, Any] = OrderedDict()
        self._held: OrderedDict[PageKey, _Held] = OrderedDict()
        self._below_only: OrderedDict[PageKey, None] = OrderedDict()  # held, not in memory: to audit
        self._max_expected = max_expected
        self._max_held = max_held

    def expect(self, key: PageKey, info: Any) -> None:
        """A store of ``key`` is planned; ``info`` names it in the events once it is committed."""
        self._expected[key] = info
        self._expected.move_to_end(key)
        while len(self._expected) > self._max_expected:  # plans that never landed
            self._expected.popitem(last=False)

    def apply(self, delta: ResidencyDelta, below: Callable[[Sequence[PageKey]], Sequence[str | None]]
              ) -> list[PageEvent]:
        """Events for what memory gained and lost; ``below(keys)``: per key, the name of the fastest
        lower tier that holds it (or None), asked only about pages that left memory."""
        events: list[PageEvent] = []
        for key in delta.added:
            held = self._held.get(key)
            if held is None:
                info = self._expected.pop(key, None)
                if info is None:
                    continue  # not a page this engine stored (another engine's, promoted here)
                held = self._held[key] = _Held(info)
            if MEMORY not in held.places:
                held.places.add(MEMORY)
                self._below_only.pop(key, None)
                events.append(PageEvent(True, held.info, MEMORY))
        gone = [k for k in delta.removed if k in self._held and MEMORY in self._held[k].places]
        for key, tier in zip(gone, below(gone) if gone else ()):
            held = self._held[key]
            held.places.discard(MEMORY)
            events.append(PageEvent(False, held.info, MEMORY))
            if tier is not None:
                where = placement_of(tier)
                if where not in held.places:
                    held.places.add(where)
                    events.append(PageEvent(True, held.info, where))
                self._held.move_to_end(key)
            # held below, or not yet: a write-through copy may still be on its way down; the
            # next audit reports it stored where it landed, or forgets it
            self._below_only[key] = None
        while len(self._held) > self._max_held:  # oldest first: pages long gone from memory
            key, held = self._held.popitem(last=False)
            self._below_only.pop(key, None)
            events.extend(PageEvent(False, held.info, where) for where in held.places)
        return events

    def audit(self, below: Callable[[Sequence[PageKey]], Sequence[str | None] | None],
              limit: int) -> list[PageEvent]:
        """Ask ``below`` (as in :meth:`apply`; ``None``: a tier could not answer, try later) about up
        to ``limit`` pages reported on lower tiers only, the longest unchecked first; events for
        those no tier holds any more (removed) or that another tier holds now."""
        keys = self.audit_batch(limit)
        where = below(keys) if keys else None
        return self.audited(keys, where) if where is not None else []

    def audit_batch(self, limit: int) -> list[PageKey]:
        """The next ``limit`` pages an audit asks about (see :meth:`audit`), for a caller that asks
        the lower tiers elsewhere (off the scheduler's thread) and hands the answer to :meth:`audited`."""
        return list(islice(self._below_only, limit))

    def audited(self, keys: Sequence[PageKey], where: Sequence[str | None]) -> list[PageEvent]:
        """The events of an audit's answer (``where``: per key, the fastest lower tier that holds it);
        pages back in memory or forgotten since they were asked about are left as they are."""
        events: list[PageEvent] = []
        for key, tier in zip(keys, where):
            if key not in self._below_only:
                continue
            held = self._held[key]
            now = {placement_of(tier)} if tier is not None else set()
            events.extend(PageEvent(False, held.info, w) for w in sorted(held.places - now, key=_order))
            events.extend(PageEvent(True, held.info, w) for w in now - held.places)
            held.places = now
            if now:
                self._below_only.move_to_end(key)
            else:
                del self._held[key], self._below_only[key]
        return events

    def cleared(self) -> list[PageEvent]:
        """lmkv dropped its residency (a scoped reset): every page it reported is removed."""
        events = [PageEvent(False, h.info, w) for h in self._held.values() for w in sorted(h.places, key=_order)]
        self._held.clear()
        self._below_only.clear()
        self._expected.clear()
        return events


def _order(p: Placement) -> tuple[str, str]:
    return p.medium, p.locality
