"""The host-memory tier: pages in one preallocated arena.

Space comes from :class:`~lmkv.tiers.allocator.SlabAllocator`; each size class has its
own eviction policy (pages of a class are interchangeable, so evicting within
the class always frees a usable slot). Readers pin what they copy from, so a
page is never evicted or overwritten under a copy in flight. Evicted pages are
handed to ``on_evict`` (the store demotes them to a lower tier) before their
slot is reused; that happens outside the tier's lock.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from lmkv.config import MemoryConfig
from lmkv.domains import DomainRegistry, check_domain
from lmkv.errors import PageError, TierFullError
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.page import PageHeader, as_bytes_view, units_in_ranges, verify_payload, verify_units
from lmkv.tiers.accounts import Accounts
from lmkv.tiers.allocator import SlabAllocator
from lmkv.tiers.arena import HostArena
from lmkv.tiers.base import LocalTier, Range, ResidencyListener, WriteSession
from lmkv.tiers.changes import ChangeNotes
from lmkv.tiers.eviction import EvictionPolicy, make_policy
from lmkv.tiers.quarantine import Quarantine

#: called with (header, payload view, owning domains) of each evicted page, before its slot is reused
EvictHook = Callable[[list[tuple[PageHeader, np.ndarray, list[str]]]], None]


@dataclass(slots=True)
class _Entry:
    offset: int
    header: PageHeader
    domains: int
    account: str
    policy: EvictionPolicy  # (its size class's and account's: looked up once, not on every read)
    pins: int = 0
    deleted: bool = False


class Lease:
    """Zero-copy views of resident pages, pinned until :meth:`release`."""

    def __init__(self, tier: MemoryTier, entries: list[_Entry | None]) -> None:
        """``entries``: pinned pages (``None`` for a key the tier does not hold)."""
        self._tier = tier
        self._entries = entries
        self.headers = [e.header if e else None for e in entries]
        self.views = [tier._view(e) if e else None for e in entries]

    @property
    def owners(self) -> list[list[str]]:
        """Per page, the residency domains that own it (asked for by write-back alone: not computed
        for every load), read while the lease holds the pages."""
        return [self._tier._domains.names(e.domains) if e else [] for e in self._entries]

    def release(self) -> None:
        if self._entries:
            self._tier._unpin(self._entries)
            self._entries = []

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


#: slabs a small arena is cut into at least (slabs never shrink below 1 MiB)
MIN_SLABS = 8
POPULATE_AHEAD = 128 << 20  # the arena is mapped this far beyond the highest slot handed out (see arena.py)


class MemoryTier(LocalTier):
    """Pages in one arena, indexed by key; every copy out of a slot holds a pin on it.

    Pins, not copies, keep readers safe: a lease hands out views of the arena itself (an
    engine load reads them zero-copy), so a page that is evicted, deleted or found corrupt
    while pinned leaves the index at once (no new reader finds it) but keeps its slot: the
    slot is freed at its last unpin (``_Entry.deleted``). The invariant is that a slot is in
    the allocator's free lists only when no index entry, no pin and no writer that may still
    finish late (:attr:`quarantine`) refer to it, so neither an eviction nor an abandoned
    request can hand a slot to a writer while a copy still reads or writes it.

    Thread-safe: the engine's threads, the store's I/O threads and a same-host server's late
    replies (through the quarantine) all go through one lock.
    """

    def __init__(self, cfg: MemoryConfig, name: str = "memory", on_evict: EvictHook | None = None,
                 shared: bool = False, accounts: Accounts | None = None, header_room: int = 0) -> None:
        """``shared``: the arena is a shared-memory window an lmkv server on this host can map;
        ``accounts``: who the pages are charged to and their limits (default: one, unlimited);
        ``header_room``: bytes kept free before every slot, where a tier below lands a page's
        header read with its payload in one piece (:meth:`room_before`)."""
        super().__init__(name)
        self.cfg = cfg
        self.verifies = cfg.verify_checksums
        self.on_evict = on_evict
        #: told of every key published or removed (see :mod:`lmkv.engine.residency`)
        self.listener: ResidencyListener | None = None
        #: what it gained and lost, for lookups repeated every step (:mod:`lmkv.tiers.changes`)
        self.notes = ChangeNotes()
        self._arena = HostArena(int(cfg.capacity), cfg.pin, cfg.prefault, shared)
        # Each page size (a model's cache groups differ) needs slabs of its own: a small arena is
        # cut into at least MIN_SLABS of them rather than into one slab of slab_size.
        slab = min(int(cfg.slab_size), max(int(cfg.capacity) // MIN_SLABS, 1 << 20))
        self._alloc = SlabAllocator(int(cfg.capacity), slab, header_room)
        self._policies: dict[tuple[int, str], EvictionPolicy] = {}  # (slot size, account) -> order
        self._index: dict[PageKey, _Entry] = {}
        self._accounts = accounts or Accounts()
        self._domains = DomainRegistry(self._accounts.account_of)
        self._lock = threading.Lock()
        self._used = 0
        limit = cfg.quarantine_limit if cfg.quarantine_limit is not None else int(cfg.capacity) // 4
        #: slots lent to writers that were given up on and may still write (a stalled same-host server)
        self.quarantine = Quarantine(self._lock, self._free_slot, int(limit), self.stats)

    # -- space -------------------------------------------------------------

    @property
    def pinned(self) -> bool:
        return self._arena.pinned

    def device_visible(self, address: int, nbytes: int) -> bool:
        """Whether a host buffer lies in the pinned arena (a GPU copy kernel can reach it)."""
        return self._arena.device_visible(address, nbytes)

    @property
    def arena(self) -> HostArena:
        """The arena pages live in (its ``window``: shared memory, unless page-locked or not shared)."""
        return self._arena

    def room_before(self, offset: int, nbytes: int) -> int:
        """The free bytes before the arena slot of ``nbytes`` at ``offset`` (0 for anything but the
        start of a slot), for a tier that reads or writes a page's header right before its payload."""
        return self._alloc.room_before(offset, nbytes)

    def _view(self, e: _Entry) -> np.ndarray:
        return self._arena.view(e.offset, e.header.payload_len)

    def _policy(self, nbytes: int, account: str) -> EvictionPolicy:
        key = (self._alloc.size_class(nbytes), account)
        p = self._policies.get(key)
        if p is None:
            p = self._policies[key] = make_policy(self.cfg.policy)
        return p

    def _candidates(self, nbytes: int, account: str, own: bool) -> list[EvictionPolicy]:
        """Under the lock: the orders to evict from. ``own``: the account is at its limit and makes
        room among its own pages; else the tier is full and room comes from the account holding
        the most of its share (:mod:`lmkv.tiers.accounts`). The size class that needs the room
        goes first (evicting there frees a usable slot), then the fullest others."""
        size = self._alloc.size_class(nbytes)
        live = [(k, p) for k, p in self._policies.items() if len(p) and (not own or k[1] == account)]
        here = [k[1] for k, _ in live if k[0] == size]
        first = [self._policies[(size, a)] for a in self._accounts.by_pressure(here, self.capacity_bytes)]
        rest = sorted((p for k, p in live if k[0] != size), key=len, reverse=True)
        return first + rest

    def _take_victim(self, nbytes: int, account: str, own: bool) -> tuple[_Entry, list[str]] | None:
        """Under the lock: remove one evictable page (see :meth:`_candidates`); it and its owners."""
        for policy in self._candidates(nbytes, account, own):
            key = policy.victim(lambda k: self._index[k].pins == 0)
            if key is not None:
                e = self._index.pop(key)
                owners = self._domains.names(e.domains)
                self._domains.release(e.domains)
                self.stats.evictions += 1
                self.notes.lost(key)
                if self.listener is not None:
                    self.listener.removed(key)
                return e, owners
        return None

    def _reserve(self, nbytes: int, account: str) -> int | None:
        """An arena offset for ``nbytes`` charged to ``account``, evicting (and demoting) as needed:
        the account's own pages while it is at its limit, then whose the tier's full state calls
        for. None when the limit is smaller than the page or all that could go is pinned."""
        accounts = self._accounts
        if not accounts.can_hold(account, nbytes):
            return None
        while True:
            with self._lock:
                own = not accounts.fits(account, nbytes)
                off = None if own else self._alloc.alloc(nbytes)
                if off is not None:
                    self._used += nbytes
                    accounts.charge(account, nbytes)
                    if off + nbytes + POPULATE_AHEAD > self._arena.prefault.target:
                        self._arena.prefault.advance(off + nbytes + POPULATE_AHEAD)
                    return off
                taken = self._take_victim(nbytes, account, own)
                if taken is None:
                    return None
            victim, owners = taken
            if self.on_evict is not None:
                self.on_evict([(victim.header, self._view(victim), owners)])
            with self._lock:
                self._release_slot(victim.offset, victim.header.payload_len, victim.account)

    def _release_slot(self, offset: int, nbytes: int, account: str) -> None:
        """Under the lock: a slot nobody refers to goes back to the allocator, unless a writer that
        was given up on may still touch it (then when that writer's fate is known)."""
        if not self.quarantine.defer(offset, nbytes, account):
            self._free_slot(offset, nbytes, account)

    def _free_slot(self, offset: int, nbytes: int, account: str) -> None:
        self._alloc.free(offset, nbytes)
        self._used -= nbytes
        self._accounts.refund(account, nbytes)

    def _unpin(self, entries: Sequence[_Entry | None]) -> None:
        with self._lock:
            for e in entries:
                if e is None:
                    continue
                e.pins -= 1
                if e.pins == 0 and e.deleted:
                    self._release_slot(e.offset, e.header.payload_len, e.account)

    def _pin(self, keys: Sequence[PageKey], count: bool = True) -> list[_Entry | None]:
        """Pin pages; ``count`` says whether this is a read to count (not lmkv's own bookkeeping)."""
        with self._lock:
            out = []
            for k in keys:
                e = self._index.get(k)
                if e is None:
                    self.stats.misses += count
                else:
                    e.pins += 1
                    if count:
                        e.policy.touch(k)
                        self.stats.hits += 1
                out.append(e)
            return out

    def _insert(self, header: PageHeader, offset: int, domain: str, account: str) -> bool:
        """Under the lock: publish a filled slot; a concurrent twin wins and this slot is freed."""
        twin = self._index.get(header.key)
        if twin is not None:
            twin.domains = self._domains.add(twin.domains, domain)
            self._release_slot(offset, header.payload_len, account)
            return True
        policy = self._policy(header.payload_len, account)
        self._index[header.key] = _Entry(offset, header, self._domains.add(0, domain), account, policy)
        policy.insert(header.key)
        self.notes.gained()
        if self.listener is not None:
            self.listener.added(header.key)
        self.stats.stored(header.payload_len)
        return True

    def _drop(self, e: _Entry) -> None:
        """Under the lock: forget a page already removed from the index."""
        e.policy.remove(e.header.key)
        self._domains.release(e.domains)
        self.notes.lost(e.header.key)
        if self.listener is not None:
            self.listener.removed(e.header.key)
        if e.pins:
            e.deleted = True
        else:
            self._release_slot(e.offset, e.header.payload_len, e.account)

    def _discard_corrupt(self, e: _Entry) -> None:
        with self._lock:
            if self._index.get(e.header.key) is e:
                del self._index[e.header.key]
                self._drop(e)
            self.stats.corrupt += 1

    # -- Tier --------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return int(self.cfg.capacity)

    @property
    def quarantined_bytes(self) -> int:
        return self.quarantine.held_bytes

    def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        with self._lock:
            return [k in self._index for k in keys]

    def borrow(self, keys: Sequence[PageKey], count: bool = True, layout: GroupLayout | None = None) -> Lease:
        """Pin pages and return zero-copy views; release the lease when the copies are done.

        A counted borrow is a read (hits, misses, bytes); lmkv's own copies between tiers pass
        ``count=False``. ``layout``: the pages are lent to an engine load; with
        ``memory.verify_checksums`` each one is verified first, and one that fails is dropped
        and lent as missing (the engine recomputes it).
        """
        entries = self._pin(keys, count)
        if layout is not None and self.verifies:
            entries = [self._verified(e, layout) if e is not None else None for e in entries]
        if count:
            self.stats.get_bytes += sum(e.header.payload_len for e in entries if e is not None)
        return Lease(self, entries)

    def _verified(self, e: _Entry, layout: GroupLayout) -> _Entry | None:
        """A pinned page if its payload passes its checksums; else it is dropped and unpinned."""
        try:
            verify_payload(e.header, layout, self._view(e))
        except PageError:
            self._discard_corrupt(e)
            self._unpin([e])
            return None
        return e

    def get(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence) -> list[PageHeader | None]:
        entries = self._pin(keys)
        results: list[PageHeader | None] = []
        try:
            for e, out in zip(entries, outs):
                if e is None:
                    results.append(None)
                    continue
                src = self._view(e)
                dst = as_bytes_view(out)
                np.copyto(np.frombuffer(dst, np.uint8, len(src)), src)
                if self.verifies:
                    try:
                        verify_payload(e.header, layout, dst)
                    except PageError:
                        self._discard_corrupt(e)
                        results.append(None)
                        continue
                self.stats.get_bytes += len(src)
                results.append(e.header)
        finally:
            self._unpin(entries)
        return results

    def read_ranges(self, key: PageKey, layout: GroupLayout, ranges: Sequence[Range], out) -> PageHeader | None:
        (e,) = self._pin([key])
        if e is None:
            return None
        try:
            src = self._view(e)
            dst = np.frombuffer(as_bytes_view(out), np.uint8)
            for start, end in ranges:
                dst[start:end] = src[start:end]
            if self.verifies:
                try:
                    verify_units(e.header, layout, dst, units_in_ranges(layout, ranges))
                except PageError:
                    self._discard_corrupt(e)
                    return None
            self.stats.get_bytes += sum(end - start for start, end in ranges)
            return e.header
        finally:
            self._unpin([e])

    def put(self, pages: Sequence[tuple[PageHeader, object]], domain: str) -> list[bool]:
        check_domain(domain)
        account = self._accounts.account_of(domain)
        results = []
        for header, payload in pages:
            with self._lock:
                e = self._index.get(header.key)
                if e is not None:
                    e.domains = self._domains.add(e.domains, domain)
                    e.policy.touch(header.key)
                    results.append(True)
                    continue
            src = np.frombuffer(as_bytes_view(payload), np.uint8)
            if len(src) != header.payload_len:
                raise ValueError(f"payload has {len(src)} bytes, header says {header.payload_len}")
            off = self._reserve(header.payload_len, account)
            if off is None:
                self.stats.full += 1
                results.append(False)
                continue
            np.copyto(self._arena.view(off, header.payload_len), src)
            with self._lock:
                results.append(self._insert(header, off, domain, account))
        return results

    def delete(self, keys: Sequence[PageKey]) -> int:
        n = 0
        with self._lock:
            for k in keys:
                e = self._index.pop(k, None)
                if e is not None:
                    self._drop(e)
                    n += 1
        return n

    def clear(self, domain: str) -> int:
        with self._lock:
            bit = self._domains.mask(domain)
            if not bit:
                return 0
            doomed = []
            for k, e in self._index.items():
                if e.domains & bit:
                    e.domains = self._domains.remove(e.domains, domain)
                    if not e.domains:
                        doomed.append(k)
            for k in doomed:
                self._drop(self._index.pop(k))
            return len(doomed)

    def keys(self) -> list[PageKey]:
        with self._lock:
            return list(self._index)

    def open_session(self, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], domain: str,
                     owners: Sequence[str] | None = None) -> MemorySession:
        """``owners``: a domain per page instead of ``domain`` for all (copies promoted from a lower
        tier keep the owner they had there).

        Raises:
            TierFullError: no room for every page (nothing stays reserved).
        """
        return MemorySession(self, keys, layouts, domain, owners)



class MemorySession(WriteSession):
    """Reserves arena slots up front; the engine's bytes are written straight into them."""

    def __init__(self, tier: MemoryTier, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], domain: str,
                 owners: Sequence[str] | None = None) -> None:
        super().__init__(keys, layouts)
        self._tier = tier
        self._domains = list(owners) if owners is not None else [domain] * len(self.keys)
        for d in set(self._domains):
            check_domain(d)
        self._accounts = [tier._accounts.account_of(d) for d in self._domains]
        self._offsets: list[int] = []
        for lay, account in zip(self.layouts, self._accounts):
            off = tier._reserve(lay.payload_bytes, account)
            if off is None:
                self.abort()
                tier.stats.full += 1
                raise TierFullError(f"{tier.name}: no room for a {len(self.keys)}-page session")
            self._offsets.append(off)

    def buffer(self, i: int) -> np.ndarray:
        return self._tier._arena.view(self._offsets[i], self.layouts[i].payload_bytes)

    def commit(self, headers: Sequence[PageHeader | None] | None = None) -> list[bool]:
        return self._commit(headers, pin=False)[0]

    def commit_pinned(self, headers: Sequence[PageHeader | None] | None = None) -> tuple[list[bool], Lease]:
        """:meth:`commit`, with each page it published (or the twin another writer published first)
        pinned in the same hold of the tier's lock: no eviction comes between the two (a put session
        still reading the slots after the commit needs them unchanged)."""
        results, lease = self._commit(headers, pin=True)
        assert lease is not None
        return results, lease

    def _commit(self, headers: Sequence[PageHeader | None] | None, pin: bool) -> tuple[list[bool], Lease | None]:
        headers = self.headers() if headers is None else headers
        tier = self._tier
        with tier._lock:
            results = []
            for h, off, lay, domain, account in zip(headers, self._offsets, self.layouts, self._domains,
                                                    self._accounts):
                if h is None:
                    tier._release_slot(off, lay.payload_bytes, account)
                    results.append(False)
                else:
                    results.append(tier._insert(h, off, domain, account))
            lease = None
            if pin:
                entries = [tier._index.get(k) for k in self.keys]
                for e in entries:
                    if e is not None:
                        e.pins += 1
                lease = Lease(tier, entries)
        self._offsets = []
        self.closed = True
        return results, lease

    def abort(self) -> None:
        with self._tier._lock:
            for off, lay, account in zip(self._offsets, self.layouts, self._accounts):
                self._tier._release_slot(off, lay.payload_bytes, account)
        self._offsets = []
        self.closed = True
