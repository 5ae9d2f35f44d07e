"""The tiered store: tiers stacked fastest first, used as one.

- Lookups are prefix-ordered and batched: page ``i`` counts only if pages
  ``0..i-1`` do, and each tier is asked once, only about the pages the tiers
  above it lacked.
- A hit in a lower tier is promoted into memory (``store.promote_on_hit``).
- Write policy (``store.write_policy``): ``write_through`` puts every page in
  every tier; ``write_back`` puts it in memory and demotes it to the next tier
  when memory evicts it.
- Residency domains: every put names its owner (``domain`` in the config by
  default); :meth:`TieredStore.clear` drops one domain's residency in every tier.

All methods are thread-safe; ``a*`` variants run on the store's I/O threads
for async callers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from lmkv import threads
from lmkv.config import LMKVConfig
from lmkv.errors import LMKVError, PartlyStoredError, TierFullError
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.lookup import Lookup, PrefixMemo, find_prefix, locate, prefix_lookup, tier_failed
from lmkv.metrics import Metrics
from lmkv.page import PageHeader, copy_units, make_header
from lmkv.retries import RetryQueue, WriteStats
from lmkv.tiers.accounts import Accounts
from lmkv.tiers.base import LocalTier, StepStream, Tier, WriteSession, in_place_reader
from lmkv.tiers.disk import DiskTier
from lmkv.tiers.factory import open_tiers
from lmkv.tiers.gds import DeviceBuffer
from lmkv.tiers.link import LinkRates
from lmkv.tiers.memory import MemorySession

if TYPE_CHECKING:
    from lmkv.tiers.device_staging import DeviceStaging

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class Fetched:
    """Views of fetched pages (host buffers; device ones with GPUDirect Storage) and their headers
    (``None`` = failed); release once copied."""

    views: list
    headers: list
    _leases: list

    def release(self) -> None:
        for lease in self._leases:
            lease.release()
        self._leases = []

    def __enter__(self) -> Fetched:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclass
class Landing:
    """Where pages read from lower tiers land for an engine load: fresh memory slots, published once
    read (the load itself promotes them), or temporary buffers where memory has no room.
    ``headers[at[i]]``: page ``i``'s header once read, ``None`` if it failed."""

    store: TieredStore
    missing: list[int]
    at: dict[int, int]
    keys: list[PageKey]
    bufs: list
    headers: list[PageHeader | None]
    session: WriteSession | None

    def buf(self, i: int):
        return self.bufs[self.at[i]]

    def settle(self, views: list, found: list, leases: list) -> None:
        """Publish what was read (leased again for the engine's copies: ``leases`` gains it) and
        set each landed page's view and header in ``views`` / ``found``; failed pages are None."""
        bufs, headers = self.bufs, self.headers
        if self.session is not None:
            self.session.commit(headers)
            promoted = self.store.memory.borrow(self.keys, count=False)
            leases.append(promoted)
            bufs = promoted.views
            headers = [h if h is not None and p is not None else None for h, p in zip(headers, promoted.headers)]
        for i, b, h in zip(self.missing, bufs, headers):
            views[i] = b if h is not None else None
            found[i] = h


def tier_read(tier: Tier, call: Callable[..., list[T]], *args) -> list[T] | None:
    """A call on a tier's read path; a tier that fails is counted and logged, and holds nothing for
    this read (``None``): the caller's other tiers serve, or the engine recomputes."""
    try:
        return call(*args)
    except (LMKVError, OSError) as err:
        tier_failed(tier, "read", err)
        return None


class TieredStore:
    """The tiers used as one: memory first, then disk, then a network tier.

    Thread-safe; the engine's threads call it directly and its own I/O threads run write-through
    copies and asynchronous calls (:meth:`submit`). Opened with the configured tiers; :meth:`close`
    finishes background writes (flushing memory down under write-back) and closes the tiers."""

    def __init__(self, cfg: LMKVConfig, lower: Sequence[Tier] = (),
                 accounts: Mapping[str, Accounts] | None = None) -> None:
        """Memory first, then the disk tier if configured, then ``lower`` tiers, then ``remote.url``'s
        tier. ``accounts``: who pages are charged to in the local tiers, and the limits (the server's
        tenants; an engine's store has one account)."""
        self.cfg = cfg
        self.domain = cfg.domain
        # (under write-through each page went down as it was stored: eviction is free, no hook)
        demote = self._demote if cfg.store.write_policy == "write_back" else None
        self.memory, below = open_tiers(cfg, on_evict=demote, lower=lower, accounts=accounts)
        self.tiers: list[Tier] = [self.memory, *below]
        self.writes = WriteStats()
        self.metrics = Metrics(lambda: self.tiers, lambda: self.writes)
        self.link = LinkRates()  # each lower tier's measured read rate (the layerwise path's inputs)
        self._pool = threads.pool(cfg.store.io_threads, "lmkv-io")
        self._pending: set[Future] = set()
        self._pending_lock = threading.Lock()
        self.retries = RetryQueue(cfg.store.retry_pages, cfg.store.failed_writes == "retry", self.writes)

    # -- lookup ------------------------------------------------------------

    def lookup(self, keys: Sequence[PageKey]) -> Lookup:
        """The longest prefix of ``keys`` resident in some tier."""
        with self.metrics.timed("lookup"):
            return prefix_lookup(keys, self.tiers)

    def find_prefix(self, keys_of: Callable[[int, int], Sequence[PageKey]], start: int, end: int,
                    memo: PrefixMemo | None = None, local: bool = False) -> tuple[Lookup, PrefixMemo]:
        """:func:`lmkv.lookup.find_prefix` over these tiers (``local``: only those in this process):
        the lookup an engine's scheduler repeats every step a request waits."""
        with self.metrics.timed("lookup"):
            return find_prefix(keys_of, start, end, self.local_tiers if local else self.tiers, memo)

    def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        """Per key, whether any tier holds it (not prefix-ordered)."""
        return [w is not None for w in locate(keys, self.tiers)]

    def contains_local(self, keys: Sequence[PageKey]) -> list[bool]:
        """As :meth:`contains`, asking only the tiers in this process (memory, disk): never a network
        round trip, for callers on an engine's scheduler thread."""
        return [w is not None for w in locate(keys, self.local_tiers)]

    # -- reads -------------------------------------------------------------

    def get(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence) -> list[PageHeader | None]:
        """Read each page from the fastest tier that has it; ``None`` where none could."""
        with self.metrics.timed("get"):
            results: list[PageHeader | None] = [None] * len(keys)
            todo = list(range(len(keys)))
            for depth, tier in enumerate(self.tiers):
                if not todo:
                    break
                present = tier_read(tier, tier.contains, [keys[i] for i in todo])
                here = [i for i, p in zip(todo, present or ()) if p]
                got = (tier_read(tier, tier.get, [keys[i] for i in here], layout, [outs[i] for i in here])
                       if here else [])
                if got is None:
                    continue
                if here:
                    for i, h in zip(here, got):
                        results[i] = h
                    if depth > 0 and self.cfg.store.promote_on_hit:
                        owners = self._owners(tier, [keys[i] for i in here])
                        by_owner: dict[str, list] = {}
                        for i, h, owner in zip(here, got, owners):
                            if h is not None:
                                by_owner.setdefault(owner, []).append((h, outs[i]))
                        for owner, promote in by_owner.items():
                            self.memory.put(promote, owner)
                todo = [i for i in todo if results[i] is None]
            return results

    def fetch(self, keys: Sequence[PageKey], layout: GroupLayout, device: DeviceStaging | None = None,
              count: bool = True) -> Fetched:
        r"""Views of pages for an engine load, pinned until released; ``None`` where a page failed.

        Memory hits are lent as they are (zero copy). Pages only a lower tier has are
        read (and verified) straight into fresh memory slots, which are then published
        there: the load itself promotes them. When memory has no room, they are read
        into temporary buffers instead.

        ``device``: staging slots in device memory for the disk tier's GPUDirect Storage
        path. Pages only that disk tier holds are read into them with cuFile and verified
        on the device (their views are then :class:`~lmkv.tiers.gds.DeviceBuffer`\ s, not
        promoted: the file is their copy); what does not fit in the free slots is read
        into memory as above.

        ``count=False``: not a new access to these pages (the later layers of a read already
        counted): eviction's recency and frequency are left as they are.
        """
        with self.metrics.timed("fetch"):
            lease = self.memory.borrow(keys, count=count, layout=layout)
            views: list = list(lease.views)
            found: list = list(lease.headers)
            missing = [i for i, v in enumerate(views) if v is None]
            if not missing or len(self.tiers) == 1:
                return Fetched(views, found, [lease])
            holders = self.holders(keys, missing)  # (asked before reserving room)
            leases: list = [lease]
            if device is not None:
                holders = self._read_to_device(keys, layout, holders, device, views, found, leases)
            landing = self.landing(keys, layout, holders)
            if landing is None:
                return Fetched(views, found, leases)
            for tier, held in holders:
                t0 = time.perf_counter()
                got = tier_read(tier, tier.get, [keys[i] for i in held], layout, [landing.buf(i) for i in held])
                if got is not None:
                    self.link.fetched(tier.name, len(held) * layout.payload_bytes, time.perf_counter() - t0)
                for i, h in zip(held, got or ()):
                    landing.headers[landing.at[i]] = h
            landing.settle(views, found, leases)
            return Fetched(views, found, leases)

    def landing(self, keys: Sequence[PageKey], layout: GroupLayout,
                holders: list[tuple[Tier, list[int]]]) -> Landing | None:
        """Buffers for the pages of ``keys`` that ``holders`` hold (None: there are none)."""
        missing = sorted(i for _, held in holders for i in held)
        if not missing:
            return None
        at = {i: j for j, i in enumerate(missing)}
        want = [keys[i] for i in missing]
        session = None
        if self.cfg.store.promote_on_hit:
            try:
                owners = [""] * len(want)
                for tier, held in holders:
                    for i, owner in zip(held, self._owners(tier, [keys[i] for i in held])):
                        owners[at[i]] = owner
                session = self.memory.open_session(want, [layout] * len(want), self.domain, owners)
            except TierFullError:
                pass
        if session is not None:
            bufs = [session.buffer(j) for j in range(len(want))]
        else:
            bufs = [np.empty(layout.payload_bytes, np.uint8) for _ in want]
        return Landing(self, missing, at, want, bufs, [None] * len(want), session)

    def _read_to_device(self, keys: Sequence[PageKey], layout: GroupLayout, holders: list[tuple[Tier, list[int]]],
                        device: DeviceStaging, views: list, found: list, leases: list) -> list[tuple[Tier, list[int]]]:
        """Read the pages a GPUDirect Storage disk tier on ``device``'s cuFile holds into free staging
        slots (their views and headers set in place, the slots' lease added to ``leases``); the
        holders left for the host path."""
        rest = []
        for tier, held in holders:
            if not isinstance(tier, DiskTier) or tier.gds is not device.io:
                rest.append((tier, held))
                continue
            slots = device.take(len(held))
            leases.append(slots)
            here, left = held[: len(slots.ptrs)], held[len(slots.ptrs):]
            bufs = [DeviceBuffer(p) for p in slots.ptrs]
            got = tier_read(tier, tier.get_device, [keys[i] for i in here], layout, bufs) if here else []
            for i, buf, h in zip(here, bufs, got or [None] * len(here)):
                views[i], found[i] = (buf if h is not None else None), h
            if left:
                rest.append((tier, left))
        return rest

    def get_units(self, keys: Sequence[PageKey], layout: GroupLayout, units: Sequence[list]) -> list[PageHeader | None]:
        """Pages straight into an engine's memory: ``units[i][u]`` receives page i's unit u (one
        layer of one block). Memory pages are copied from the arena; a lower tier that reads in
        place (a buffered disk tier: one read per page, checksums verified where the bytes land)
        reads into them directly, without a stop in lmkv's memory (the OS page cache is the disk
        tier's memory); pages of other tiers are fetched (and promoted) as :meth:`fetch` does.
        ``None`` where a page failed: its buffers may then hold anything."""
        with self.metrics.timed("get_units"):
            results: list[PageHeader | None] = [None] * len(keys)
            with self.memory.borrow(keys, layout=layout) as lease:
                for i, (view, header) in enumerate(zip(lease.views, lease.headers)):
                    if view is not None:
                        copy_units(layout, view, units[i])
                        results[i] = header
            missing = [i for i, r in enumerate(results) if r is None]
            if not missing or len(self.tiers) == 1:
                return results
            staged = []
            for tier, held in self.holders(keys, missing):
                reader = in_place_reader(tier)
                if reader is None:
                    staged.extend(held)
                    continue
                got = tier_read(tier, reader.get_units, [keys[i] for i in held], layout, [units[i] for i in held])
                for i, header in zip(held, got or ()):
                    results[i] = header
            if staged:
                with self.fetch([keys[i] for i in staged], layout) as fetched:
                    for i, view, header in zip(staged, fetched.views, fetched.headers):
                        if view is not None and header is not None:
                            copy_units(layout, view, units[i])
                            results[i] = header
            return results

    def _owners(self, tier: Tier, keys: Sequence[PageKey]) -> list[str]:
        """Who a promoted copy of each page belongs to: the domain owning it in the tier it came
        from (on a server, a tenant's, so its quota pays for the copy), else this store's."""
        if not isinstance(tier, LocalTier):
            return [self.domain] * len(keys)
        return [(tier.owners(k) or [self.domain])[0] for k in keys]

    def holders(self, keys: Sequence[PageKey], todo: Sequence[int]) -> list[tuple[Tier, list[int]]]:
        """Pages ``todo`` of ``keys`` that a lower tier holds, grouped by the fastest one that does
        (each tier asked once, only about the pages the ones above it lacked)."""
        where = locate([keys[i] for i in todo], self.tiers[1:])
        return [(t, held) for t in self.tiers[1:] if (held := [i for i, w in zip(todo, where) if w == t.name])]

    # -- writes ------------------------------------------------------------

    def put(
        self,
        keys: Sequence[PageKey],
        layouts: Sequence[GroupLayout],
        payloads: Sequence,
        domain: str | None = None,
    ) -> list[bool]:
        """Make pages (checksums computed once, here) and store them by the write policy."""
        with self.metrics.timed("put"):
            pages = [(make_header(k, lay, p), p) for k, lay, p in zip(keys, layouts, payloads)]
            return self.put_pages(pages, domain)

    def put_pages(self, pages: Sequence[tuple[PageHeader, object]], domain: str | None = None) -> list[bool]:
        """Store pages whose headers are made (e.g. moved from another store or a server frame)."""
        domain = domain or self.domain
        stored = self.memory.put(pages, domain)
        if self.cfg.store.write_policy == "write_through":
            for tier in self.tiers[1:]:
                stored = [a or b for a, b in zip(stored, self.write_down(tier, pages, domain))]
        return stored

    def write_down(self, tier: Tier, pages: Sequence[tuple[PageHeader, object]], domain: str,
                   from_memory: bool = True) -> list[bool]:
        """Copy pages to a lower tier. A tier that fails never fails the caller: the failure is
        counted and, under ``store.failed_writes: retry``, the pages are copied again from memory
        the next time that tier takes a write (``from_memory=False``: memory is losing them, so
        they are dropped)."""
        try:
            stored = tier.put(pages, domain)
        except PartlyStoredError as err:  # a cluster node is down (its health logged it): only its pages failed
            self.retries.failed(tier.name, [pages[i][0].key for i in err.unreachable], domain, from_memory)
            return err.stored
        except (LMKVError, OSError) as err:
            tier_failed(tier, "write", err)
            self.retries.failed(tier.name, [h.key for h, _ in pages], domain, from_memory)
            return [False] * len(pages)
        self.retry_failed(tier)
        return stored

    def retry_failed(self, tier: Tier) -> None:
        """``tier`` just took a write: copy again from memory the pages it failed to take before
        (``store.failed_writes: retry``)."""
        if self.retries.pending(tier.name):
            self.retries.run(tier, self.memory)

    def _demote(self, evicted: list[tuple[PageHeader, np.ndarray, list[str]]]) -> None:
        """Write-back: memory evicted these pages; keep them in the next tier down unless it holds
        them already (promoted from there): a page is never written to a tier twice.

        Under write-through this hook is not installed: each page went down when it was stored (or
        came up from there), so eviction is free, and a page the tier below has dropped since was
        its coldest: writing it again would evict fresher pages there. (Measured: a prefill engine
        re-uploading evicted pages to a full lmkv server pushed out the prompt it had just written,
        and the decode engine found 0 of its 84 pages.)"""
        if len(self.tiers) < 2:
            return
        nxt = self.tiers[1]
        held = tier_read(nxt, nxt.contains, [h.key for h, _, _ in evicted]) or [False] * len(evicted)
        for (header, view, owners), there in zip(evicted, held):
            if there:
                continue
            for domain in owners or [self.domain]:
                self.write_down(nxt, [(header, view)], domain, from_memory=False)

    def open_session(
        self, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], domain: str | None = None,
        streamed: bool = False,
    ) -> StoreSession:
        """Reserve pages in memory for one step; see :class:`StoreSession` (``streamed``: the caller
        reports ranges as they fill).

        Raises:
            TierFullError: memory has no room for them (nothing is reserved).
        """
        return StoreSession(self, keys, layouts, domain or self.domain, streamed)

    # -- ownership -----------------------------------------------------------

    def clear(self, domain: str | None = None) -> int:
        """Drop ``domain``'s residency in every tier; pages other owners hold stay."""
        domain = domain or self.domain
        return sum(t.clear(domain) for t in self.tiers)

    def delete(self, keys: Sequence[PageKey]) -> int:
        return sum(t.delete(keys) for t in self.tiers)

    @property
    def gds_disk(self) -> DiskTier | None:
        """The disk tier when it moves pages with GPUDirect Storage (``disk.io``), else None."""
        return next((t for t in self.tiers if isinstance(t, DiskTier) and t.gds is not None), None)

    @property
    def local_tiers(self) -> list[LocalTier]:
        """The tiers whose index is in this process (memory, disk): where accounts are kept."""
        return [t for t in self.tiers if isinstance(t, LocalTier)]

    def domains(self, account: str) -> set[str]:
        """The residency domains charged to ``account`` that own pages in a local tier."""
        return set().union(*(t.domains(account) for t in self.local_tiers))

    # -- async -------------------------------------------------------------

    def submit(self, fn, *args) -> Future:
        """Run a store call on the I/O threads (engine adapters overlap I/O with compute)."""
        fut = self._pool.submit(fn, *args)
        with self._pending_lock:
            self._pending.add(fut)
        fut.add_done_callback(self._settled)
        return fut

    def submit_after(self, waits: Sequence[Future], fn, *args) -> Future:
        """:meth:`submit` ``fn(*args)`` once every future in ``waits`` is done (however it ended); no
        thread waits for them meanwhile. :meth:`drain` waits for it from now on."""
        out: Future = Future()
        with self._pending_lock:
            self._pending.add(out)
        out.add_done_callback(self._settled)
        left = [len(waits)]
        lock = threading.Lock()

        def start(_: Future | None = None) -> None:
            with lock:
                left[0] -= 1
                if left[0] > 0:
                    return
            try:
                inner = self._pool.submit(fn, *args)
            except RuntimeError as err:  # (the store is closing)
                out.set_exception(err)
                return
            inner.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() is not None
                                    else out.set_result(f.result()))

        if not waits:
            left[0] = 1
            start()
        for w in waits:
            w.add_done_callback(start)
        return out

    def _settled(self, fut: Future) -> None:
        with self._pending_lock:
            self._pending.discard(fut)

    def drain(self, timeout: float | None = None) -> None:
        """Wait for the background work submitted so far (write-through copies, fetches)."""
        with self._pending_lock:
            pending = list(self._pending)
        concurrent.futures.wait(pending, timeout=timeout)

    async def alookup(self, keys: Sequence[PageKey]) -> Lookup:
        return await asyncio.wrap_future(self.submit(self.lookup, keys))

    async def aget(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence) -> list[PageHeader | None]:
        return await asyncio.wrap_future(self.submit(self.get, keys, layout, outs))

    async def aput(self, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], payloads: Sequence) -> list[bool]:
        return await asyncio.wrap_future(self.submit(self.put, keys, layouts, payloads))

    # -- lifecycle -----------------------------------------------------------

    def stats(self) -> dict[str, dict[str, int]]:
        """Per tier: counters and occupancy, for ``lmkv stats`` and the demo."""
        out = {}
        for t in self.tiers:
            d = dict(vars(t.stats))
            d.update(pages=len(t), used_bytes=t.used_bytes, capacity_bytes=t.capacity_bytes,
                     quarantined_bytes=t.quarantined_bytes)
            out[t.name] = d
        return out

    def flush(self) -> int:
        """Write-back: copy every memory page the next tier lacks down to it; returns pages written."""
        if len(self.tiers) < 2:
            return 0
        nxt = self.tiers[1]
        keys = self.memory.keys()
        todo = [k for k, present in zip(keys, nxt.contains(keys)) if not present]
        written = 0
        for i in range(0, len(todo), 64):
            with self.memory.borrow(todo[i : i + 64], count=False) as lease:
                for h, v, owners in zip(lease.headers, lease.views, lease.owners):
                    if h is not None:
                        for domain in owners or [self.domain]:
                            written += nxt.put([(h, v)], domain)[0]
        return written

    def close(self) -> None:
        """Finish background writes; under write-back, flush memory down first so nothing is lost."""
        self.drain()  # (write-throughs that wait for a tier's put session are not on the pool yet)
        self._pool.shutdown(wait=True)
        if self.cfg.store.write_policy == "write_back":
            try:
                n = self.flush()
                if n:
                    log.info("lmkv: flushed %d pages from memory to %s on close", n, self.tiers[1].name)
            except Exception:
                log.exception("lmkv: flushing memory on close failed")
        for t in self.tiers:
            t.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StoreSession:
    """A step's pages, filled in memory range by range, committed atomically to the store.

    Commit publishes every page in memory at once, then (write-through) copies them
    down. An aborted session leaves nothing in any tier.
    """

    def __init__(self, store: TieredStore, keys: Sequence[PageKey], layouts: Sequence[GroupLayout],
                 domain: str, streamed: bool = False) -> None:
        """``streamed``: the caller says which byte ranges of the pages are filled as they fill
        (:meth:`filled`, the worker layer by layer): lower tiers that can may take them then."""
        self._store = store
        self._domain = domain
        self._inner: MemorySession = store.memory.open_session(keys, layouts, domain)
        self.keys = self._inner.keys
        self.layouts = self._inner.layouts
        self.written_through: Future | None = None
        #: lower tiers that take the step's pages as they fill (Mooncake's put sessions), by name
        self._streams: dict[str, StepStream] = {}
        if streamed and store.cfg.store.write_policy == "write_through" and self.keys:
            bufs = [self._inner.buffer(i) for i in range(len(self.keys))]
            for tier in store.tiers[1:]:
                stream = tier.stream(self.keys, self.layouts, bufs, domain)
                if stream is not None:
                    self._streams[tier.name] = stream

    def buffer(self, i: int):
        return self._inner.buffer(i)

    def write(self, i: int, offset: int, data) -> None:
        self._inner.write(i, offset, data)

    @property
    def streaming(self) -> bool:
        """Whether a lower tier takes the pages as they fill (then tell it: :meth:`filled`)."""
        return bool(self._streams)

    def filled(self, indices: Sequence[int], start: int, end: int, ready: Callable[[], object] | None = None) -> None:
        """Bytes ``[start, end)`` of the pages at ``indices`` are in their buffers (once ``ready``
        returns: a GPU copy's events): lower tiers that stream a step's pages take them now."""
        for stream in self._streams.values():
            stream.filled(indices, start, end, ready)

    def commit(self, headers: Sequence[PageHeader | None] | None = None,
               below: Mapping[str, set[PageKey]] | None = None) -> list[bool]:
        """Publish in memory now; under write-through, the copies down run on the I/O threads.

        ``headers`` as in :meth:`WriteSession.commit` (pages whose header arrived with them).
        ``below``: per lower tier's name, pages the caller writes to it itself (the worker's
        GPUDirect Storage writes from device memory); they are not copied there from memory.
        A tier that streamed the pages (:meth:`filled`) is told to make them readable; the pages
        it could not take are copied down whole like the others."""
        store = self._store
        if not self._streams:
            results = self._inner.commit(headers)
            if store.cfg.store.write_policy == "write_through" and len(store.tiers) > 1:
                lease = store.memory.borrow(self.keys, count=False)
                self.written_through = store.submit(self._write_through, lease, below or {}, {})
            return results
        results, lease = self._inner.commit_pinned(headers)  # (the slots stay the pages' until streamed)
        slots = [None if v is None else v.__array_interface__["data"][0] for v in lease.views]
        finished = {name: s.finish(lease.headers, slots) for name, s in self._streams.items()}
        self.written_through = store.submit_after(list(finished.values()), self._write_through, lease, below or {},
                                                  finished)
        return results

    def _write_through(self, lease, below: Mapping[str, set[PageKey]],
                       finished: Mapping[str, Future[set[PageKey]]]) -> None:
        with lease:
            pages = [(h, v) for h, v in zip(lease.headers, lease.views) if h is not None]
            for tier in self._store.tiers[1:]:
                done = set(below.get(tier.name, ()))
                fut = finished.get(tier.name)
                if fut is not None:  # (done: this runs once every stream finished)
                    try:
                        done |= fut.result()
                    except (Exception, concurrent.futures.CancelledError):  # (its pages are copied below instead)
                        log.exception("lmkv: %s tier: a step's put session failed", tier.name)
                todo = [(h, v) for h, v in pages if h.key not in done] if done else pages
                if todo:
                    self._store.write_down(tier, todo, self._domain)
                elif fut is not None and done:  # (the stream took them all: the tier took a write)
                    self._store.retry_failed(tier)

    def abort(self) -> None:
        for stream in self._streams.values():
            stream.abort()
        self._inner.abort()

    def __enter__(self) -> StoreSession:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self._inner.closed:
            self.abort()


__all__ = ["Lookup", "StoreSession", "TieredStore", "TierFullError"]
