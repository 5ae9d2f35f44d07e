"""Prefix-ordered lookups over tiers fastest first: which tier holds each page of a prefix.

Shared by the store (its own tiers) and by a scheduler in another process
(:class:`lmkv.engine.residency.ResidencyMirror`: mirrored worker memory, then the tiers it
can see itself). A tier that cannot answer holds nothing for now; it never fails a lookup.

:func:`find_prefix` is the lookup an engine's scheduler repeats every step a request waits: it
hashes and asks only as far as the prefix goes (a chunk at a time, so a prompt no tier holds
costs one small chunk, not its thousands of pages), and with the last lookup's
:class:`PrefixMemo` it asks a tier only what can have changed since: a tier's
:class:`~lmkv.tiers.changes.ChangeNotes` tell which pages it lost and whether it gained any.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from lmkv.errors import LMKVError
from lmkv.keys import PageKey
from lmkv.tiers.changes import Mark

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lookup:
    """Where each page of the hit prefix lives (the tier name), fastest first."""

    tiers: tuple[str, ...]
    #: pages per tier over all of ``tiers``, where the lookup kept count (:func:`find_prefix` adds
    #: only a step's new pages to its last count)
    counted: Mapping[str, int] | None = None

    @property
    def pages(self) -> int:
        return len(self.tiers)

    def per_tier(self, pages: int) -> dict[str, int]:
        """How many of the hit's first ``pages`` pages each tier holds (a long prompt's hit has
        thousands of pages: counting them again every step cost a scheduler step ~0.1 ms)."""
        if pages >= len(self.tiers) and self.counted is not None:
            return dict(self.counted)
        return Counter(self.tiers[:pages])


class HasContains(Protocol):
    """What a lookup asks of a tier (a real tier, or the scheduler's mirror of a worker's memory)."""

    name: str

    def contains(self, keys: Sequence[PageKey]) -> list[bool]: ...


def locate(keys: Sequence[PageKey], tiers: Sequence[HasContains], strict: bool = False) -> list[str | None]:
    """Per key, the first tier that holds it; each tier is asked only about keys the ones above lacked.

    A tier that cannot answer (down, timed out) holds nothing for now; with ``strict`` its error
    is raised instead (for a caller that must not take "cannot answer" for "does not hold").
    """
    where: list[str | None] = [None] * len(keys)
    for tier in tiers:
        todo = [i for i, w in enumerate(where) if w is None]
        if not todo:
            break
        try:
            present = tier.contains([keys[i] for i in todo])
        except (LMKVError, OSError) as err:
            tier_failed(tier, "lookup", err)
            if strict:
                raise
            continue
        for i, p in zip(todo, present):
            if p:
                where[i] = tier.name
    return where


_last_warning: dict[str, float] = {}


def tier_failed(tier, what: str, err: BaseException) -> None:
    """Count a failing tier call and log it, at most once a minute per tier."""
    stats = getattr(tier, "stats", None)
    if stats is not None:
        stats.errors += 1
    now = time.monotonic()
    if now - _last_warning.get(tier.name, -1e9) > 60:
        _last_warning[tier.name] = now
        log.warning("lmkv: %s tier failed a %s (%s); serving from the other tiers", tier.name, what, err)


def prefix_lookup(keys: Sequence[PageKey], tiers: Sequence[HasContains]) -> Lookup:
    """The longest prefix of ``keys`` that some tier holds, page by page."""
    where = locate(keys, tiers)
    n = next((i for i, w in enumerate(where) if w is None), len(keys))
    return Lookup(tuple(w for w in where[:n] if w is not None))


#: pages of the first chunk a prefix lookup hashes and asks about; each next chunk is 4x larger
FIRST_CHUNK = 16


@dataclass
class PrefixMemo:
    """What one lookup of a request's pages found: a repeated lookup starts from it."""

    start: int  # the page the lookup started at (the pages below were the engine's own)
    where: list[str]  # the tier holding each page of the hit, from ``start``
    marks: dict[str, Mark]  # each noting tier's counts, taken before it was asked
    ended_by_miss: bool  # the hit ended at a page no tier held (not at the end of what was asked)
    pos: dict[PageKey, int] = field(default_factory=dict)  # key -> page - start, for the hit's first pages
    counts: Counter[str] = field(default_factory=Counter)  # pages of ``where`` per tier

    def position(self, key: PageKey, keys_of: Callable[[int, int], Sequence[PageKey]]) -> int | None:
        """Where ``key`` lies in the hit (relative to ``start``), or None."""
        if len(self.pos) < len(self.where):
            first = len(self.pos)
            for i, k in enumerate(keys_of(self.start + first, self.start + len(self.where)), first):
                self.pos[k] = i
        at = self.pos.get(key)
        return at if at is not None and at < len(self.where) else None


def find_prefix(keys_of: Callable[[int, int], Sequence[PageKey]], start: int, end: int,
                tiers: Sequence[HasContains], memo: PrefixMemo | None = None) -> tuple[Lookup, PrefixMemo]:
    """The longest prefix of pages ``[start, end)`` some tier holds, and the memo for the next call.

    ``keys_of(a, b)``: the keys of pages ``[a, b)`` (hashed on demand). With ``memo`` (this
    request's last lookup over the same tiers), a tier with change notes is asked nothing about
    the pages it held then unless it lost some of them since, and nothing past the hit unless it
    gained pages; a tier without notes is asked again from the first page it held."""
    marks = {t.name: notes.mark() for t in tiers if (notes := getattr(t, "notes", None)) is not None}
    where: list[str] = []
    pos: dict[PageKey, int] = {}
    counts: Counter[str] = Counter()
    ended = False
    if memo is not None and memo.start <= start:
        shift = start - memo.start
        kept = _still_held(keys_of, memo, tiers)
        where = memo.where[shift : min(kept, end - memo.start)]
        pos = memo.pos if shift == 0 else {}
        counts = Counter(memo.counts) if shift == 0 and len(where) == len(memo.where) else Counter(where)
        gained = any(t.name not in marks or t.name not in memo.marks
                     or marks[t.name].gained != memo.marks[t.name].gained for t in tiers)
        # nothing can be held past a hit that ended at a miss if no tier lost or gained a page since
        ended = kept == len(memo.where) and memo.ended_by_miss and not gained and end - memo.start >= kept
    p, chunk = start + len(where), FIRST_CHUNK
    while not ended and p < end:
        hi = min(end, p + chunk)
        found = locate(keys_of(p, hi), tiers)
        n = next((i for i, w in enumerate(found) if w is None), len(found))
        new = [w for w in found[:n] if w is not None]
        where += new
        counts.update(new)
        ended = n < len(found)
        p, chunk = hi, chunk * 4
    return Lookup(tuple(where), counts), PrefixMemo(start, where, marks, ended, pos, counts)


def find_last(keys_of: Callable[[int, int], Sequence[PageKey]], start: int, end: int,
              contains: Callable[[Sequence[PageKey]], list[bool]]) -> int:
    """One past the last page in ``[start, end)`` whose key ``contains`` holds, or ``start`` if none.

    A state group keeps one state per stored boundary, and a hit ends at the last boundary whose
    state is held: asked from ``end`` back a chunk at a time (:data:`FIRST_CHUNK`, then 4x larger),
    stopping at the first chunk with one, so a long prompt whose last boundary holds a state costs
    one small question a step, not one key per page of its hit."""
    hi, chunk = end, FIRST_CHUNK
    while hi > start:
        lo = max(start, hi - chunk)
        present = contains(keys_of(lo, hi))
        last = next((i for i in range(len(present) - 1, -1, -1) if present[i]), None)
        if last is not None:
            return lo + last + 1
        hi, chunk = lo, chunk * 4
    return start


def _still_held(keys_of: Callable[[int, int], Sequence[PageKey]], memo: PrefixMemo,
                tiers: Sequence[HasContains]) -> int:
    """How many pages of the memo's hit are surely still where they were: up to the first page a
    tier lost since (or, for a tier without notes or whose notes ran out, the first page it held)."""
    cut = len(memo.where)
    for t in tiers:
        notes = getattr(t, "notes", None)
        lost = notes.lost_since(memo.marks[t.name]) if notes is not None and t.name in memo.marks else None
        if lost is None:
            cut = next((i for i, w in enumerate(memo.where[:cut]) if w == t.name), cut)
            continue
        for k in lost:
            i = memo.position(k, keys_of)
            if i is not None and i < cut and memo.where[i] == t.name:
                cut = i
    return cut
