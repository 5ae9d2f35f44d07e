"""The local disk tier: one file per page, in lmkv's page format (:mod:`lmkv.tiers.page_files`).

A page is written to ``tmp/``, flushed (``fsync``), and only then linked into place, so a
reader never sees a half-written page and a writer killed mid-page leaves only a temp file.
The index is rebuilt from the file names on start-up, in the background: the tier serves at
once, and until the scan ends a key the index lacks is looked for on disk. Processes sharing the
directory (two engines, an engine's scheduler) learn of each other's pages from the directory's
change logs (:mod:`lmkv.tiers.disk_log`), never by a ``stat`` per key. A file that was torn or
flipped afterwards is caught by its checksum when read, and deleted. Ownership is one hard link per
residency domain: clearing a domain unlinks its links, and the bytes go when the last owner
does. A full file system is a clean per-page failure: the temp file is removed and nothing
half-written remains.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import threading
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

from lmkv import threads
from lmkv.config import DiskConfig
from lmkv.domains import DomainRegistry, check_domain
from lmkv.errors import PageError, TierFullError
from lmkv.keys import PageKey, key_hex
from lmkv.layout import GroupLayout
from lmkv.page import (
    ALIGN,
    PageHeader,
    as_bytes_view,
    disk_page_bytes,
    padded,
)
from lmkv.tiers import gds
from lmkv.tiers.accounts import Accounts
from lmkv.tiers.base import LocalTier, Range, ReadsInPlace, WriteSession
from lmkv.tiers.changes import ChangeNotes
from lmkv.tiers.disk_log import Change, LogReader, LogWriter, Op, remove_dead_logs
from lmkv.tiers.eviction import EvictionPolicy, make_policy
from lmkv.tiers.gds import DeviceBuffer
from lmkv.tiers.header_cache import HeaderCache
from lmkv.tiers.page_files import WOULD_BLOCK, Blocked, PageFiles, domains_in, page_path, remove_dead_writers, scan
from lmkv.tiers.posix_io import FULL_ERRNOS, aligned, place, probe_direct_io, unlink
from lmkv.tiers.quarantine import settled_map

log = logging.getLogger(__name__)

#: headers of pages read by ranges, kept for the later spans of a layerwise load
HEADERS_KEPT = 16384
INLINE_RUNS = min(4, os.cpu_count() or 1)  # parallel runs of reads the page cache serves
MIN_RUN_PAGES = 16
#: bytes a page's read must move for runs in parallel to pay: below it a read is mostly the
#: interpreter's work, and parallel runs contend for its lock (one 32 KiB layer of 64 pages,
#: measured here: 17-23 ms in one run, 39-45 ms in two; 64 KiB: 11-13 against 20-26 ms)
MIN_PARALLEL_READ = 128 << 10


@dataclass(slots=True)
class _Entry:
    file_bytes: int
    domains: int
    account: str


class DiskTier(LocalTier, ReadsInPlace):
    """Pages as files under ``disk.path``, indexed in memory, charged to accounts, evicted by policy.

    Thread-safe: the index is under one lock, file I/O runs outside it (on the caller's thread or
    the tier's I/O threads). Opened at once, its index rebuilt from the files there in the
    background (:meth:`wait_indexed`); other processes sharing the directory add and remove pages,
    found by the next lookup through their change logs. :meth:`close` ends its threads.
    """

    def __init__(self, cfg: DiskConfig, name: str = "disk", accounts: Accounts | None = None) -> None:
        """``accounts``: who the pages are charged to and their limits (default: one, unlimited)."""
        super().__init__(name)
        if not cfg.path:
            raise ValueError("disk.path must be set to use the disk tier")
        self.cfg = cfg
        self.root = Path(cfg.path)
        self._tmp = self.root / "tmp"
        self._data = self.root / "d"
        self._tmp.mkdir(parents=True, exist_ok=True)
        self._data.mkdir(parents=True, exist_ok=True)
        engine = gds.choose(self._tmp, required=cfg.io == "gds") if cfg.io in ("auto", "gds") else None
        self.direct = engine is not None or cfg.io == "direct" or (cfg.io == "auto" and probe_direct_io(self._tmp))
        if cfg.io == "direct" and not probe_direct_io(self._tmp):
            raise ValueError(f"disk.io = 'direct': the file system under {self.root} refuses O_DIRECT")
        self._lock = threading.Lock()
        self._index: dict[PageKey, _Entry] = {}
        log_dir = self.root / "log"
        self._log = LogWriter(log_dir)
        self._others = LogReader(log_dir, own=self._log.name)
        self._following = threading.Lock()
        #: what it gained and lost, for lookups repeated every step (:mod:`lmkv.tiers.changes`)
        self.notes = ChangeNotes(refresh=self._follow)
        self._accounts = accounts or Accounts()
        self._domains = DomainRegistry(self._accounts.account_of, on_forget=self._remove_domain_dir)
        self._policies: dict[str, EvictionPolicy] = {}  # account -> its pages' eviction order
        self._used = 0
        self._reserved = 0
        self._files = PageFiles(cfg, self._tmp, self.direct, engine)
        self._headers = HeaderCache(HEADERS_KEPT)  # (pages read by ranges lately: a load's later spans)
        self._io = threads.pool(cfg.io_threads, "lmkv-disk")
        remove_dead_writers(self._tmp)  # (before this process writes any)
        self._others.skip_to_end()  # (what the logs said so far, the scan finds)
        self._indexed = threading.Event()
        self._closing = False
        threading.Thread(target=self._rebuild, name="lmkv-disk-index", daemon=True).start()

    @property
    def gds(self):
        """cuFile (or hipFile), where GDS moves payloads between page files and device memory
        (``disk.io``); None: POSIX I/O alone."""
        return self._files.gds

    @gds.setter
    def gds(self, engine) -> None:
        self._files.gds = engine

    # -- files -------------------------------------------------------------

    def _path(self, key: PageKey, domain: str) -> str:
        return page_path(self._data, key, domain)

    def _rebuild(self) -> None:
        """Index the files that are there, oldest first (the eviction order), then remove the change
        logs of writers that are gone. (On a thread of its own: the tier serves meanwhile.)"""
        t0 = time.monotonic()
        try:
            found = sorted(scan(self._data, log, stop=lambda: self._closing))
            for i in range(0, len(found), 4096):
                with self._lock:
                    for _, key, domain, size in found[i : i + 4096]:
                        self._index_file(key, domain, size)
            remove_dead_logs(self._log.dir)
        except OSError as err:
            log.warning("lmkv: disk tier %s: indexing the files failed (%s); pages not indexed are looked for "
                        "on disk", self.root, err)
            return
        finally:
            self._indexed.set()
        if found:
            log.info("lmkv: disk tier %s: %d pages, %d bytes indexed in %.1f s", self.root, len(found), self._used,
                     time.monotonic() - t0)

    def wait_indexed(self, timeout: float | None = None) -> bool:
        """Wait until the files there at opening are indexed; whether they are."""
        return self._indexed.wait(timeout)

    def _follow(self) -> None:
        """Apply what other processes sharing the directory logged since the last call (one thread
        at a time; another thread's call finds it done)."""
        if not self._following.acquire(blocking=False):
            return
        try:
            changes = list(self._others.follow())
            if changes:
                with self._lock:
                    for op, key, domain, size in changes:
                        if op == Op.LINKED:
                            self._index_file(key, domain, size)
                        else:
                            self._unindex_link(key, domain)
        finally:
            self._following.release()

    def _unindex_link(self, key: PageKey, domain: str) -> None:
        """Under the lock: another process unlinked a page's file for one domain; a page with no
        owner left leaves the index (its files are gone already)."""
        e = self._index.get(key)
        if e is None or not e.domains & self._domains.mask(domain):
            return
        e.domains = self._domains.remove(e.domains, domain)
        if not e.domains:
            self._forget(key)  # (no owner's file left to unlink)

    def _index_file(self, key: PageKey, domain: str, size: int) -> None:
        """Under the lock (or alone, at start-up): a page file found on disk joins the index, charged
        to its domain's account even beyond its limit (the next write of that account evicts)."""
        e = self._index.get(key)
        if e is None:
            account = self._accounts.account_of(domain)
            e = self._new_entry(key, size, account)
            self._accounts.charge(account, size)
        e.domains = self._domains.add(e.domains, domain)

    def _add(self, key: PageKey, domain: str, size: int, account: str) -> None:
        """Under the lock: a page file this process linked into place joins the index (its room is
        charged already) and the directory's log."""
        e = self._new_entry(key, size, account)
        e.domains = self._domains.add(0, domain)
        self._log.write(Change(Op.LINKED, key, domain, size))

    def _new_entry(self, key: PageKey, size: int, account: str) -> _Entry:
        """Under the lock: a page new to the index, owned by no domain yet (its caller adds them)."""
        e = self._index[key] = _Entry(size, 0, account)
        self._policy(account).insert(key)
        self._used += size
        self.notes.gained()
        return e

    def _policy(self, account: str) -> EvictionPolicy:
        p = self._policies.get(account)
        if p is None:
            p = self._policies[account] = make_policy(self.cfg.policy)
        return p

    def _remove_domain_dir(self, domain: str) -> None:
        """The domain's last page went (told by the registry, under the lock): its directories go too,
        so a domain that is gone costs nothing to the scans of the directory (a
        :class:`~lmkv.tiers.page_files.DiskView`).
        A directory another process still fills is not empty and stays."""
        top = self._data / domain
        with contextlib.suppress(OSError):
            for sub in os.scandir(top):
                with contextlib.suppress(OSError):
                    os.rmdir(sub.path)
            os.rmdir(top)

    def _open_any(self, key: PageKey, e: _Entry, flags: int) -> int:
        for domain in self._domains.names(e.domains):
            try:
                return os.open(self._path(key, domain), flags)
            except FileNotFoundError:
                continue
        raise FileNotFoundError(key_hex(key))

    def _unlink_all(self, key: PageKey, domains: int) -> None:
        for domain in self._domains.names(domains):
            self._unlink(key, domain)

    def _unlink(self, key: PageKey, domain: str) -> None:
        """Unlink one owner's file of a page, and log it for the processes sharing the directory."""
        unlink(self._path(key, domain))
        self._log.write(Change(Op.UNLINKED, key, domain, 0))

    def _forget(self, key: PageKey, evicted: bool = False) -> _Entry | None:
        """Under the lock: drop a page from the index and unlink its files (``evicted``: the
        victim's order already let it go)."""
        e = self._index.pop(key, None)
        self._headers.forget([key])
        if e is not None:
            if not evicted:
                self._policy(e.account).remove(key)
            self._unlink_all(key, e.domains)
            self._domains.release(e.domains)
            self._used -= e.file_bytes
            self._accounts.refund(e.account, e.file_bytes)
            self.notes.lost(key)
        return e

    def _discard(self, key: PageKey, why: str) -> None:
        with self._lock:
            self._forget(key)
            self.stats.corrupt += 1
        log.warning("lmkv: disk tier: discarded page %s: %s", key_hex(key), why)

    def _reserve(self, nbytes: int, account: str, pages: int = 1) -> bool:
        """Under the lock: room for ``pages`` pages of ``nbytes`` in all, charged to ``account``:
        its own pages go while it is at its limit, then (the tier is full) the pages of whoever
        holds the most of its share (:mod:`lmkv.tiers.accounts`)."""
        cap = int(self.cfg.capacity)
        accounts = self._accounts
        if nbytes > cap or not accounts.can_hold(account, nbytes, pages):
            return False
        while not accounts.fits(account, nbytes, pages):
            if not self._evict([account]):
                return False
        while self._used + self._reserved + nbytes > cap:
            if not self._evict(accounts.by_pressure([a for a, p in self._policies.items() if len(p)], cap)):
                return False
        accounts.charge(account, nbytes, pages)
        self._reserved += nbytes
        return True

    def _settle(self, nbytes: int, account: str, resident: bool) -> None:
        """Under the lock: one page's reservation ends; its charge stays if it became ``resident``."""
        self._reserved -= nbytes
        if not resident:
            self._accounts.refund(account, nbytes)

    def _evict(self, accounts: list[str]) -> bool:
        """Under the lock: evict one page of the first of ``accounts`` that has one."""
        for account in accounts:
            key = self._policy(account).victim(lambda k: True)
            if key is not None:
                self._forget(key, evicted=True)
                self.stats.evictions += 1
                return True
        return False

    # -- reading -----------------------------------------------------------

    def _read_page(self, key: PageKey, layout: GroupLayout, out, ranges: Sequence[Range] | None,
                   nowait: bool = False) -> PageHeader | None | Blocked:
        """One page into ``out`` (a buffer, or with buffered I/O a list of one buffer per unit), or
        only ``ranges`` of it; ``nowait`` (buffered I/O into host memory): :data:`WOULD_BLOCK`
        unless the OS page cache holds all of it, so that cached pages are read without a thread
        hand-off. A page that fails its checks is dropped; any failure is a miss (``None``)."""
        e = self._entry(key)
        if e is None:
            self.stats.misses += 1
            return None
        units = out if isinstance(out, list) else None
        device = out if isinstance(out, DeviceBuffer) else None
        dst = None if units is not None or device is not None else as_bytes_view(out)
        direct = device is not None or self.direct and dst is not None and (
            ranges is None or all(s % ALIGN == 0 and aligned(dst[s:t], t - s) for s, t in ranges)
        )
        try:
            fd = self._open_any(key, e, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        except FileNotFoundError:
            self._discard(key, "file vanished")
            self.stats.misses += 1
            return None
        header: PageHeader | Blocked
        try:
            if device is not None:
                header = self._files.read_to_device(fd, key, layout, device)
            elif units is not None:
                header = self._files.read_units(fd, key, layout, units, nowait)
            elif ranges is None:
                assert dst is not None
                header = self._files.read_whole(fd, key, layout, dst, direct, nowait and not direct)
            else:
                assert dst is not None
                known = self._headers.get([key])[0]
                if known is not None and known.layout_fp != layout.fingerprint:
                    known = None  # (the page asked for as another layout: its own header says no)
                header = self._files.read_ranges(fd, key, layout, dst, ranges, nowait and not direct, known)
                if known is None and header is not WOULD_BLOCK:
                    self._headers.put(key, header)
        except PageError as err:
            self._discard(key, str(err))
            self.stats.misses += 1
            return None
        except OSError as err:
            self.stats.errors += 1
            self.stats.misses += 1
            log.warning("lmkv: disk tier: reading %s failed: %s", key_hex(key), err)
            return None
        finally:
            os.close(fd)
        if header is not WOULD_BLOCK:
            self.stats.hits += ranges is None or ranges[0][0] == 0  # a page read layer by layer is one hit
            self.stats.get_bytes += layout.payload_bytes if ranges is None else sum(t - s for s, t in ranges)
        return header

    def _read(self, key: PageKey, layout: GroupLayout, out, ranges: Sequence[Range] | None = None) -> PageHeader | None:
        """:meth:`_read_page`, waiting for the device."""
        got = self._read_page(key, layout, out, ranges)
        assert got is not WOULD_BLOCK
        return got

    # -- writing -----------------------------------------------------------

    def _publish(self, header: PageHeader, tmp: Path, domain: str, account: str) -> bool:
        """Link a flushed temp file into place for ``domain``, its reservation settled; under the lock."""
        key = header.key
        size = header.disk_bytes
        e = self._index.get(key)
        if e is not None:  # a twin was published meanwhile
            self._settle(size, account, resident=False)
            tmp.unlink(missing_ok=True)
            self._link_domain(key, e, domain)
            return True
        final = self._path(key, domain)
        try:
            place(tmp, final)
        except OSError as err:
            self._settle(size, account, resident=False)
            tmp.unlink(missing_ok=True)
            self.stats.errors += 1
            log.warning("lmkv: disk tier: publishing %s failed: %s", key_hex(key), err)
            return False
        self._settle(size, account, resident=True)
        self._add(key, domain, size, account)
        self.stats.stored(header.payload_len)
        return True

    def _link_domain(self, key: PageKey, e: _Entry, domain: str) -> None:
        """Under the lock: add an owner to a resident page (a hard link, no bytes copied)."""
        if e.domains & self._domains.mask(domain):
            return
        src = next(self._path(key, d) for d in self._domains.names(e.domains))
        try:
            place(src, self._path(key, domain), link=True)
        except FileExistsError:
            pass
        except OSError as err:
            log.warning("lmkv: disk tier: linking %s for %s failed: %s", key_hex(key), domain, err)
            return
        e.domains = self._domains.add(e.domains, domain)
        self._log.write(Change(Op.LINKED, key, domain, e.file_bytes))

    def _store(self, header: PageHeader, payload, domain: str, account: str) -> bool:
        """Write a page whose room is reserved, then publish it."""
        size = header.disk_bytes
        try:
            tmp = self._files.write_tmp(header, payload)
        except OSError as err:
            with self._lock:
                self._settle(size, account, resident=False)
            if err.errno in FULL_ERRNOS:
                self.stats.full += 1
                log.warning("lmkv: disk tier: file system full writing %s", key_hex(header.key))
            else:
                self.stats.errors += 1
                log.warning("lmkv: disk tier: writing %s failed: %s", key_hex(header.key), err)
            return False
        with self._lock:
            return self._publish(header, tmp, domain, account)

    # -- Tier --------------------------------------------------------------

    @property
    def capacity_bytes(self) -> int:
        return int(self.cfg.capacity)

    def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        """From the index, brought up to date with the other processes' logs; while the files there
        at opening are still being indexed, a key the index lacks is looked for on disk."""
        self._follow()
        with self._lock:
            found = [k in self._index for k in keys]
        if not all(found) and not self._indexed.is_set():
            domains = domains_in(self._data)
            for i, k in enumerate(keys):
                if not found[i]:
                    found[i] = self._adopt(k, domains)
        return found

    def _entry(self, key: PageKey) -> _Entry | None:
        """A page's entry for a read (its use noted for eviction): from the index, brought up to date
        with the other processes' logs where it lacks the key, or (while the index is rebuilt) from
        the files."""
        e = self._touched(key)
        if e is None:
            self._follow()
            e = self._touched(key)
        if e is None and not self._indexed.is_set() and self._adopt(key, domains_in(self._data)):
            e = self._touched(key)
        return e

    def _touched(self, key: PageKey) -> _Entry | None:
        """The index's entry for a page, its use noted for eviction."""
        with self._lock:
            e = self._index.get(key)
            if e is not None:
                self._policy(e.account).touch(key)
            return e

    def _adopt(self, key: PageKey, domains: list[str]) -> bool:
        """Index a page found on disk that the index does not hold yet (while it is rebuilt)."""
        for domain in domains:
            path = self._path(key, domain)
            try:
                size = os.stat(path).st_size
                check_domain(domain)
            except (OSError, ValueError):
                continue
            with self._lock:
                self._index_file(key, domain, size)
        with self._lock:
            return key in self._index

    def get(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence) -> list[PageHeader | None]:
        """Pages the OS page cache holds are read in a few long runs, one in this thread (a memory
        copy: handing pages one by one to threads cost more than it saved, 1.4-1.9x slower here);
        the others page by page in parallel, because a device needs queue depth. ``outs`` may also
        be lists of unit buffers (see :meth:`get_units`)."""
        return self._read_cached_first(keys, layout, outs, None)

    def _read_cached_first(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence,
                           ranges: Sequence[Range] | None) -> list[PageHeader | None]:
        if len(keys) < 2:
            return [self._read(k, layout, out, ranges) for k, out in zip(keys, outs)]
        results: list[PageHeader | None | Blocked] = [WOULD_BLOCK] * len(keys)
        if not self.direct:
            # a few long runs (one here, the others on I/O threads): a page's copy out of the page
            # cache runs without the GIL while another run hashes (measured 1.5-1.7x one run on 2 cores)
            def run(lo: int, hi: int) -> list[PageHeader | None | Blocked]:
                return [self._read_page(keys[i], layout, outs[i], ranges, nowait=True) for i in range(lo, hi)]

            per_page = layout.payload_bytes if ranges is None else sum(b - a for a, b in ranges)
            parts = max(1, min(INLINE_RUNS, len(keys) // MIN_RUN_PAGES)) if per_page >= MIN_PARALLEL_READ else 1
            cuts = [len(keys) * j // parts for j in range(parts + 1)]
            others = [self._io.submit(run, cuts[j], cuts[j + 1]) for j in range(1, parts)]
            try:
                here = run(cuts[0], cuts[1])
            finally:  # (a failure here must not return while the others still read into ``outs``)
                futures.wait(others)
            results = here + [r for f in others for r in f.result()]
        todo = [i for i, r in enumerate(results) if r is WOULD_BLOCK]
        if todo:
            for i, r in zip(todo, settled_map(self._io, lambda i: self._read(keys[i], layout, outs[i], ranges), todo)):
                results[i] = r
        return [None if r is WOULD_BLOCK else r for r in results]  # (none is left)

    @property
    def reads_in_place(self) -> bool:
        """Whether :meth:`get_units` reads into the caller's buffers without staging (buffered I/O)."""
        return not self.direct

    def get_units(self, keys: Sequence[PageKey], layout: GroupLayout, units: Sequence[list]) -> list[PageHeader | None]:
        """Buffered I/O reads each page straight into its unit buffers (one ``preadv``); the page
        cache is this tier's memory, so nothing is staged in lmkv's memory tier on the way."""
        if not self.reads_in_place:
            raise ValueError("disk tier: O_DIRECT reads need aligned buffers; stage pages through fetch")
        n = len(layout.unit_ranges)
        if any(len(u) != n for u in units):
            raise ValueError(f"group {layout.name!r}: a page has {n} units")
        return self.get(keys, layout, [list(u) for u in units])

    def read_ranges(self, key: PageKey, layout: GroupLayout, ranges: Sequence[Range], out) -> PageHeader | None:
        return self._read(key, layout, out, list(ranges))

    def get_ranges(self, keys: Sequence[PageKey], layout: GroupLayout, ranges: Sequence[Range],
                   outs: Sequence) -> list[PageHeader | None]:
        """As :meth:`get`, each page's ``ranges`` alone (a layerwise load's span of layers): those
        the page cache holds in a few long runs, the others in parallel."""
        return self._read_cached_first(keys, layout, outs, list(ranges))

    def _read_parallel(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence) -> list[PageHeader | None]:
        """Pages in parallel on the tier's I/O threads (a device needs queue depth); a single page in
        this thread."""
        if len(keys) < 2:
            return [self._read(k, layout, o) for k, o in zip(keys, outs)]
        return settled_map(self._io, lambda i: self._read(keys[i], layout, outs[i]), range(len(keys)))

    def get_device(self, keys: Sequence[PageKey], layout: GroupLayout,
                   outs: Sequence[DeviceBuffer]) -> list[PageHeader | None]:
        """GDS: each page's payload into device memory (``padded(payload_bytes)`` bytes at each
        ``outs[i].ptr``), verified there in one launch; a page that fails any check is a miss and
        is dropped, as on the host path. Pages are written by :meth:`put` with ``DeviceBuffer``
        payloads, or by any engine: the files are the same."""
        if self.gds is None:
            raise ValueError(f"disk tier {self.root}: GPUDirect Storage is not in use (disk.io)")
        from lmkv.kernels.digests import verify_on_device

        heads = self._read_parallel(keys, layout, outs)
        read = [i for i, h in enumerate(heads) if h is not None]
        ok = verify_on_device([outs[i].ptr for i in read], layout, [h for h in heads if h is not None],
                              device=self.gds.device) if read else []
        for i, good in zip(read, ok):
            if not good:
                self._discard(keys[i], "payload digest mismatch (verified on the device)")
                self.stats.hits -= 1
                self.stats.misses += 1
                heads[i] = None
        return heads

    def put(self, pages: Sequence[tuple[PageHeader, object]], domain: str) -> list[bool]:
        r"""``pages``' payloads are host buffers, or with GDS :class:`~lmkv.tiers.gds.DeviceBuffer`\ s."""
        check_domain(domain)
        if self.gds is None and any(isinstance(p, DeviceBuffer) for _, p in pages):
            raise ValueError(f"disk tier {self.root}: a page in device memory, and GPUDirect Storage is not in use")
        if len(pages) < 2:
            return [self._put_one(header, payload, domain) for header, payload in pages]
        return settled_map(self._io, lambda hp: self._put_one(hp[0], hp[1], domain), pages)

    def _put_one(self, header: PageHeader, payload, domain: str) -> bool:
        size = header.disk_bytes
        account = self._accounts.account_of(domain)
        with self._lock:
            e = self._index.get(header.key)
            if e is not None:
                self._link_domain(header.key, e, domain)
                self._policy(e.account).touch(header.key)
                return True
            room = self._reserve(size, account)
        if not room:
            self.stats.full += 1
            return False
        return self._store(header, payload, domain, account)

    def delete(self, keys: Sequence[PageKey]) -> int:
        n = 0
        for k in keys:
            with self._lock:
                n += self._forget(k) is not None
        return n

    def clear(self, domain: str) -> int:
        check_domain(domain)
        with self._lock:
            bit = self._domains.mask(domain)
            deleted = 0
            for key, e in list(self._index.items()) if bit else ():
                if not e.domains & bit:
                    continue
                if e.domains == bit:  # its last owner: the page goes
                    self._forget(key)
                    deleted += 1
                    continue
                self._unlink(key, domain)
                e.domains = self._domains.remove(e.domains, domain)
            return deleted

    def close(self) -> None:
        self._closing = True
        self._io.shutdown(wait=True)
        self._indexed.wait()
        self._log.close()
        self._others.close()

    def open_session(self, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], domain: str) -> DiskSession:
        return DiskSession(self, keys, layouts, check_domain(domain))



class DiskSession(WriteSession):
    """Pages are filled in aligned host buffers; commit writes them all, then publishes them together."""

    def __init__(self, tier: DiskTier, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], domain: str) -> None:
        super().__init__(keys, layouts)
        self._tier = tier
        self._domain = domain
        self._account = tier._accounts.account_of(domain)
        self._sizes = [disk_page_bytes(lay) for lay in layouts]
        with tier._lock:
            if not tier._reserve(sum(self._sizes), self._account, len(self._sizes)):
                tier.stats.full += 1
                raise TierFullError(f"{tier.name}: no room for a {len(keys)}-page session")
        self._bufs = [mmap.mmap(-1, padded(lay.payload_bytes)) for lay in layouts]

    def buffer(self, i: int) -> memoryview:
        return memoryview(self._bufs[i])[: self.layouts[i].payload_bytes]

    def commit(self, headers: Sequence[PageHeader | None] | None = None) -> list[bool]:
        tier = self._tier
        tmps: list[tuple[PageHeader, Path] | None] = []  # each page's header and written file
        headers = self.headers() if headers is None else headers
        try:
            for h, buf in zip(headers, self._bufs):
                if h is None:
                    tmps.append(None)
                    continue
                try:
                    tmps.append((h, tier._files.write_tmp(h, memoryview(buf))))
                except OSError as err:
                    tier.stats.full += err.errno in FULL_ERRNOS
                    tier.stats.errors += err.errno not in FULL_ERRNOS
                    log.warning("lmkv: disk tier: session write of %s failed: %s", key_hex(h.key), err)
                    tmps.append(None)
            with tier._lock:
                out = []
                for t, size in zip(tmps, self._sizes):
                    if t is None:
                        tier._settle(size, self._account, resident=False)
                        out.append(False)
                    else:
                        out.append(tier._publish(t[0], t[1], self._domain, self._account))
                return out
        finally:
            self.closed = True

    def abort(self) -> None:
        if not self.closed:
            with self._tier._lock:
                for size in self._sizes:
                    self._tier._settle(size, self._account, resident=False)
        self.closed = True
