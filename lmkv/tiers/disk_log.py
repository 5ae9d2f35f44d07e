"""The disk directory's change log: how processes sharing one disk tier directory learn of each
other's pages without a ``stat`` per key.

Every process with a disk tier over the directory appends one fixed-size record to a log of
its own (``log/<pid>.<nonce>.log``) for every page file it links into place or unlinks. The
others (another engine's disk tier, an engine scheduler's :class:`~lmkv.tiers.page_files.DiskView`)
follow every log but their own: a lookup then answers from an index in memory, and a page
another process wrote is found by the first lookup after its record (a new writer's log within
:data:`LIST_S`, or at once where the directory's modification time shows it).

A record is written after the link (or unlink) it reports, so a reader that applies it finds
the file as it says. A log is only appended to; past :data:`ROTATE_BYTES` its writer starts a
new one and unlinks the one before the old (a reader that lists the directory once per rotation
misses no log), and a reader with an unlinked log open reads it to its end first (an open file
outlives its name). Logs of writers that are gone are removed by the next process that
opens the directory, once its index holds what they said (:func:`remove_dead_logs`).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import logging
import os
import struct
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from lmkv.domains import check_domain
from lmkv.keys import PageKey
from lmkv.tiers.posix_io import pid_alive

log = logging.getLogger(__name__)

#: op, domain length, key, file bytes, domain (padded)
RECORD = struct.Struct("<BB16sQ64s")
#: a writer starts a new log past this size
ROTATE_BYTES = 64 << 20
#: how often a reader lists the log directory for new writers' logs even if its modification time
#: did not change (file systems stamp it coarsely: two changes within a tick look like one)
LIST_S = 0.25
SUFFIX = ".log"


class Op(enum.IntEnum):
    """What a record says happened to a page file."""

    LINKED = 1
    UNLINKED = 2


class Change(NamedTuple):
    """One page file linked into place or unlinked, for one domain (a tuple: a reader makes one per
    record, thousands a step when many pages are written)."""

    op: int  # an Op
    key: PageKey
    domain: str
    file_bytes: int


def _pack(change: Change) -> bytes:
    dom = change.domain.encode()
    return RECORD.pack(change.op, len(dom), change.key, change.file_bytes, dom)


@functools.lru_cache(maxsize=4096)
def _domain(raw: bytes) -> str | None:
    """A record's domain, checked once per distinct name (a log repeats a few names)."""
    try:
        return check_domain(raw.decode())
    except (ValueError, UnicodeDecodeError):
        return None


def _changes(data: bytes) -> Iterator[Change]:
    """The records in ``data`` (whole records); a malformed one (a hostile or broken writer) is skipped."""
    for op, dlen, key, size, dom in RECORD.iter_unpack(data):
        domain = _domain(dom[:dlen])
        if domain is not None and (op == Op.LINKED or op == Op.UNLINKED):
            yield Change(op, PageKey(key), domain, size)


class LogWriter:
    """This process's log: one record per page file it links or unlinks. Thread-safe."""

    def __init__(self, log_dir: Path) -> None:
        self.dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._fd, self.name = self._open()
        self._size = 0
        self._previous: str | None = None  # the log before this one (kept until the next rotation)

    def _open(self) -> tuple[int, str]:
        name = f"{os.getpid()}.{uuid.uuid4().hex}{SUFFIX}"
        return os.open(self.dir / name, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_APPEND, 0o644), name

    def write(self, change: Change) -> None:
        """Append one record (a failing log is logged: other processes then see the page late, at
        their next scan, and this one loses nothing)."""
        raw = _pack(change)
        with self._lock:
            try:
                if self._size + len(raw) > ROTATE_BYTES:
                    if self._previous is not None:
                        (self.dir / self._previous).unlink(missing_ok=True)
                    os.close(self._fd)
                    self._previous = self.name
                    self._fd, self.name = self._open()
                    self._size = 0
                os.write(self._fd, raw)
                self._size += len(raw)
            except OSError as err:
                log.warning("lmkv: disk tier: writing the change log %s failed: %s", self.dir / self.name, err)

    def close(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            os.close(self._fd)


class LogReader:
    """Follows the logs of every other process in the directory. Not thread-safe (its owner locks)."""

    def __init__(self, log_dir: Path, own: str | None = None) -> None:
        """``own``: this process's log (not followed)."""
        self.dir = log_dir
        self.own = own
        self._open: dict[str, tuple[int, int]] = {}  # log name -> (fd, bytes read)
        self._partial: dict[str, bytes] = {}  # a record cut by a read that raced its write
        self._listed = 0.0
        self._dir_mtime = -1

    def skip_to_end(self) -> None:
        """Start every log there now at its end: what they said so far is in the files a scan finds."""
        for name in self._names():
            fd = self._open_log(name)
            if fd is not None:
                self._open[name] = (fd, os.fstat(fd).st_size // RECORD.size * RECORD.size)
        self._listed = time.monotonic()

    def _names(self) -> list[str]:
        try:
            return [e.name for e in os.scandir(self.dir) if e.name.endswith(SUFFIX) and e.name != self.own]
        except OSError:
            return []

    def _open_log(self, name: str) -> int | None:
        try:
            return os.open(self.dir / name, os.O_RDONLY)
        except OSError:
            return None

    def follow(self) -> Iterator[Change]:
        """The changes recorded since the last call: a read of each log (nothing to read costs one
        ``pread``), the directory listed again where it changed."""
        now = time.monotonic()
        try:
            mtime = os.stat(self.dir).st_mtime_ns
        except OSError:
            mtime = -1
        if mtime != self._dir_mtime or now - self._listed >= LIST_S:
            self._listed, self._dir_mtime = now, mtime
            names = set(self._names())
            for name in names - self._open.keys():
                fd = self._open_log(name)
                if fd is not None:
                    self._open[name] = (fd, 0)
            gone = self._open.keys() - names
        else:
            gone = set()
        for name, (fd, offset) in list(self._open.items()):
            yield from self._read_log(name, fd, offset)
            if name in gone:  # rotated or removed: read to its end (above), then let it go
                os.close(fd)
                del self._open[name]
                self._partial.pop(name, None)

    def _read_log(self, name: str, fd: int, offset: int) -> Iterator[Change]:
        while True:
            try:
                chunk = os.pread(fd, 1 << 20, offset)
            except OSError:
                return
            if not chunk:
                return
            offset += len(chunk)
            self._open[name] = (fd, offset)
            data = self._partial.pop(name, b"") + chunk
            whole = len(data) // RECORD.size * RECORD.size
            if whole < len(data):
                self._partial[name] = data[whole:]
            yield from _changes(data[:whole])

    def close(self) -> None:
        for fd, _ in self._open.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._open.clear()


def remove_dead_logs(log_dir: Path) -> None:
    """Remove the logs of writers that are gone (their pages are on disk: whoever opens the directory
    finds them by scanning)."""
    with contextlib.suppress(OSError):
        for e in os.scandir(log_dir):
            pid = e.name.split(".", 1)[0]
            if e.name.endswith(SUFFIX) and pid.isdigit() and not pid_alive(int(pid)):
                Path(e.path).unlink(missing_ok=True)
