"""The disk tier's files: where a page's file lives, and one page file read and written every
way the tier needs.

On disk a page is its header padded to :data:`~lmkv.page.ALIGN`, then its payload padded to
ALIGN, so every I/O engine (buffered POSIX, O_DIRECT, cuFile) reads and writes the same files.

Layout of the directory::

    tmp/<key>.<pid>.<nonce>       pages being written (a dead writer's are removed at start-up)
    d/<domain>/<k0k1>/<key>.page  one hard link per owning residency domain

:class:`PageFiles` reads one file whole (buffered, or O_DIRECT through a bounce buffer where
the caller's buffer is not aligned), into an engine's unit buffers, by ranges, or its payload
into device memory with cuFile; and writes a page to a flushed temp file. Every read checks
the header against the key and layout asked for and verifies what it read.
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from lmkv.config import DiskConfig
from lmkv.domains import check_domain
from lmkv.keys import PageKey, key_hex, parse_key_hex
from lmkv.layout import GroupLayout
from lmkv.page import (
    ALIGN,
    PageHeader,
    as_bytes_view,
    disk_header_bytes,
    padded,
    units_in_ranges,
    unpack_header,
    verify_payload,
    verify_unit_buffers,
    verify_units,
)
from lmkv.tiers import gds
from lmkv.tiers.base import Range
from lmkv.tiers.changes import ChangeNotes
from lmkv.tiers.disk_log import LogReader, Op
from lmkv.tiers.posix_io import Bounce, aligned, pid_alive, pwritev_all, read_exact

SUFFIX = ".page"
_log = logging.getLogger("lmkv.tiers.disk")


class Blocked(enum.Enum):
    """A read that the page cache alone could not serve (``RWF_NOWAIT``)."""

    WOULD_BLOCK = "a page the page cache does not hold (read it on an I/O thread)"


WOULD_BLOCK = Blocked.WOULD_BLOCK


def page_path(data_dir: Path, key: PageKey, domain: str) -> str:
    """A page's file (a string: reads open one per page, and pathlib would cost more than the read)."""
    h = key_hex(key)
    return f"{data_dir}/{domain}/{h[:2]}/{h}{SUFFIX}"


def domains_in(data_dir: Path) -> list[str]:
    """The residency domains that have a directory under ``data_dir``."""
    try:
        return [d.name for d in data_dir.iterdir()]
    except OSError:
        return []


def remove_dead_writers(tmp_dir: Path) -> None:
    """Remove temp files whose writer is gone (or is this process, restarted under its pid)."""
    for tmp in tmp_dir.iterdir():
        parts = tmp.name.split(".")
        writer = int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None
        if writer is None or writer == os.getpid() or not pid_alive(writer):
            tmp.unlink(missing_ok=True)


def scan(data_dir: Path, log, stop: Callable[[], bool] = lambda: False,
         remove_malformed: bool = True) -> Iterator[tuple[float, PageKey, str, int]]:
    """Every page file under ``data_dir``: (mtime, key, domain, size); a malformed one is removed
    (unless not ``remove_malformed``: a reader that does not own the directory) and an unexpected
    directory skipped, each logged. Ends early once ``stop()``."""
    try:
        tops = sorted(p for p in data_dir.iterdir() if p.is_dir())
    except OSError:
        return
    for dom_dir in tops:
        try:
            check_domain(dom_dir.name)
        except ValueError:
            log.warning("lmkv: disk tier: ignoring unexpected directory %s", dom_dir)
            continue
        for sub in os.scandir(dom_dir):
            if stop():
                return
            for f in os.scandir(sub.path) if sub.is_dir() else ():
                try:
                    key = parse_key_hex(f.name.removesuffix(SUFFIX))
                    st = f.stat()
                except (ValueError, OSError):
                    continue
                if not f.name.endswith(SUFFIX) or st.st_size < 2 * ALIGN or st.st_size % ALIGN:
                    if remove_malformed:
                        log.warning("lmkv: disk tier: removing malformed page file %s", f.path)
                        Path(f.path).unlink(missing_ok=True)
                    continue
                yield st.st_mtime, key, dom_dir.name, st.st_size


class DiskView:
    """A disk tier directory seen from a process that does not own it (an engine's scheduler, whose
    workers own the tier): an index of its pages in memory, built by a scan in the background and
    kept up to date from the writers' change logs (:mod:`lmkv.tiers.disk_log`), so pages other
    processes write or evict are seen by the next lookup, and a key it lacks costs no ``stat``
    (until the scan ends, a key the index lacks is looked for on disk)."""

    def __init__(self, path: str | os.PathLike[str], name: str = "disk") -> None:
        self.name = name
        self._data = Path(path) / "d"
        self._lock = threading.Lock()
        self._owners: dict[PageKey, int] = {}  # key -> bits of the domains whose file it has
        self._bits: dict[str, int] = {}
        self._logs = LogReader(Path(path) / "log")
        self._logs.skip_to_end()
        self.notes = ChangeNotes(refresh=self._follow)
        self._indexed = threading.Event()
        self._closing = False
        threading.Thread(target=self._scan, name="lmkv-disk-view", daemon=True).start()

    def _bit(self, domain: str) -> int:
        bit = self._bits.get(domain)
        if bit is None:
            bit = self._bits[domain] = 1 << len(self._bits)
        return bit

    def _linked(self, key: PageKey, domain: str) -> bool:
        """Under the lock: a domain's file of a page exists; whether the page is new here."""
        had = self._owners.get(key, 0)
        self._owners[key] = had | self._bit(domain)
        return not had

    def _scan(self) -> None:
        try:
            files = [(key, domain) for _, key, domain, _ in scan(self._data, _log, lambda: self._closing, False)]
            with self._lock:
                self.notes.gained(sum(self._linked(key, domain) for key, domain in files))
        finally:
            self._indexed.set()

    def wait_indexed(self, timeout: float | None = None) -> bool:
        return self._indexed.wait(timeout)

    def _follow(self) -> None:
        with self._lock:
            gained, lost = 0, []
            for op, key, domain, _ in self._logs.follow():
                if op == Op.LINKED:
                    gained += self._linked(key, domain)
                elif (had := self._owners.get(key)) is not None:
                    if left := had & ~self._bit(domain):
                        self._owners[key] = left
                    else:
                        del self._owners[key]
                        lost.append(key)
            if gained:
                self.notes.gained(gained)
            if lost:
                self.notes.lost_many(lost)

    def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        self._follow()
        with self._lock:
            found = [k in self._owners for k in keys]
        if not all(found) and not self._indexed.is_set():
            domains = domains_in(self._data)
            found = [f or any(os.path.exists(page_path(self._data, k, d)) for d in domains)
                     for f, k in zip(found, keys)]
        return found

    def close(self) -> None:
        self._closing = True
        self._indexed.wait()
        with self._lock:
            self._logs.close()


class PageFiles:
    """One page file's reads and writes for a disk tier; any thread (the bounce buffer is per thread)."""

    def __init__(self, cfg: DiskConfig, tmp_dir: Path, direct: bool, gds_engine) -> None:
        """``direct``: O_DIRECT; ``gds_engine``: cuFile (or hipFile) where payloads move to device memory."""
        self.cfg = cfg
        self.tmp = tmp_dir
        self.direct = direct
        self.gds = gds_engine
        self._bounce = Bounce()

    # -- reading -----------------------------------------------------------

    def read_whole(self, fd: int, key: PageKey, layout: GroupLayout, dst: memoryview, direct: bool,
                   nowait: bool) -> PageHeader | Blocked:
        """Header and payload in one ``preadv``: the payload straight into ``dst``, or through an
        aligned bounce buffer where O_DIRECT cannot use ``dst`` as it is."""
        hdr_bytes, plen = disk_header_bytes(layout), layout.payload_bytes
        if direct and not aligned(dst, padded(plen)):
            scratch = self._bounce.get(hdr_bytes + padded(plen))
            read_exact(fd, [scratch], hdr_bytes + plen, nowait=False)
            hdr = scratch[:hdr_bytes]
            dst[:plen] = scratch[hdr_bytes : hdr_bytes + plen]
        else:
            hdr = self._bounce.get(hdr_bytes)
            if not read_exact(fd, [hdr, dst[: padded(plen) if direct else plen]], hdr_bytes + plen, nowait):
                return WOULD_BLOCK
        header = unpack_header(hdr, expect_key=key, layout=layout)
        verify_payload(header, layout, dst)
        return header

    def read_to_device(self, fd: int, key: PageKey, layout: GroupLayout, out: gds.DeviceBuffer) -> PageHeader:
        """GDS: the header into a host buffer (parsed and checked here), the payload with cuFile
        into device memory; its digests are checked on the device by the tier."""
        assert self.gds is not None
        header = self.read_header(fd, key, layout)
        self.gds.read(fd, out.ptr, padded(layout.payload_bytes), disk_header_bytes(layout))
        return header

    def read_units(self, fd: int, key: PageKey, layout: GroupLayout, units: list,
                   nowait: bool) -> PageHeader | Blocked:
        """Header and payload in one ``preadv``, each unit into its own buffer (an engine's block rows)."""
        hdr_bytes = disk_header_bytes(layout)
        hdr = self._bounce.get(hdr_bytes)
        if not read_exact(fd, [hdr, *units], hdr_bytes + layout.payload_bytes, nowait):
            return WOULD_BLOCK
        header = unpack_header(hdr, expect_key=key, layout=layout)
        verify_unit_buffers(header, layout, units)
        return header

    def read_header(self, fd: int, key: PageKey, layout: GroupLayout) -> PageHeader:
        """The page's header alone (its padded block at the file's start), parsed and checked."""
        header = self._header(fd, key, layout, nowait=False)
        assert header is not WOULD_BLOCK
        return header

    def _header(self, fd: int, key: PageKey, layout: GroupLayout, nowait: bool) -> PageHeader | Blocked:
        hdr_bytes = disk_header_bytes(layout)
        hdr = self._bounce.get(hdr_bytes)
        if not read_exact(fd, [hdr], hdr_bytes, nowait):
            return WOULD_BLOCK
        return unpack_header(hdr, expect_key=key, layout=layout)

    def read_ranges(self, fd: int, key: PageKey, layout: GroupLayout, dst: memoryview,
                    ranges: Sequence[Range], nowait: bool, known: PageHeader | None = None) -> PageHeader | Blocked:
        """The header (unless ``known``: read lately, its checks passed), then each range into
        ``dst`` at its page offset; only those units are verified. ``nowait``: :data:`WOULD_BLOCK`
        unless the OS page cache holds all of it."""
        hdr_bytes = disk_header_bytes(layout)
        header = known if known is not None else self._header(fd, key, layout, nowait)
        if header is WOULD_BLOCK:
            return WOULD_BLOCK
        for start, end in ranges:
            if not read_exact(fd, [dst[start:end]], end - start, nowait, hdr_bytes + start):
                return WOULD_BLOCK
        verify_units(header, layout, dst, units_in_ranges(layout, ranges))
        return header

    # -- writing -----------------------------------------------------------

    def _header_block(self, packed: bytes, hdr_bytes: int) -> memoryview:
        """A packed header zero-padded to its on-disk size, in this thread's aligned bounce buffer."""
        hdr = self._bounce.get(hdr_bytes)
        hdr[: len(packed)] = packed
        hdr[len(packed) :] = bytes(hdr_bytes - len(packed))
        return hdr

    def write_tmp(self, header: PageHeader, payload) -> Path:
        """Write one page to a temp file, flushed (``disk.fsync``); raises OSError (the temp file
        removed) on failure."""
        hdr_bytes = header.disk_header_bytes
        plen = header.payload_len
        tmp = self.tmp / f"{key_hex(header.key)}.{os.getpid()}.{uuid.uuid4().hex}"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY | (os.O_DIRECT if self.direct else 0), 0o644)
        try:
            packed = header.pack()
            if isinstance(payload, gds.DeviceBuffer):  # GDS: the header from here, the payload with cuFile
                assert self.gds is not None
                pwritev_all(fd, [self._header_block(packed, hdr_bytes)])
                self.gds.write(fd, payload.ptr, padded(plen), hdr_bytes)
                iov = []
            elif self.direct and aligned(src := as_bytes_view(payload), padded(plen)):
                iov = [self._header_block(packed, hdr_bytes), src[: padded(plen)]]
            else:
                src = as_bytes_view(payload)
                total = hdr_bytes + padded(plen)
                scratch = self._bounce.get(total)
                scratch[: len(packed)] = packed
                scratch[len(packed) : hdr_bytes] = bytes(hdr_bytes - len(packed))
                scratch[hdr_bytes : hdr_bytes + plen] = src[:plen]
                scratch[hdr_bytes + plen :] = bytes(total - hdr_bytes - plen)
                iov = [scratch]
            if iov:
                pwritev_all(fd, iov)
            if self.cfg.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        return tmp
