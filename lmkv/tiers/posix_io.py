"""POSIX file I/O the disk tier builds on: O_DIRECT's alignment rules, whole-buffer reads and
writes, a per-thread aligned bounce buffer, and moving files into place.

O_DIRECT moves bytes between the device and the caller's buffer without the page cache, but
only in :data:`~lmkv.page.ALIGN`-aligned buffers, offsets and lengths; a buffer that is not
goes through :class:`Bounce`. A buffered read may ask the page cache alone (``RWF_NOWAIT``):
what it holds is read in the caller's thread, the rest on I/O threads.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
import uuid
from pathlib import Path

import numpy as np

from lmkv.errors import ShortReadError
from lmkv.page import ALIGN, padded

#: errnos that mean the file system is full (a clean per-page failure, not an I/O error)
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def probe_direct_io(directory: Path) -> bool:
    """Whether this file system accepts O_DIRECT (tmpfs and some overlays do not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / f".direct-probe-{uuid.uuid4().hex}"
    buf = mmap.mmap(-1, ALIGN)
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY | os.O_DIRECT, 0o600)
        try:
            os.write(fd, buf)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)
        buf.close()


def aligned(view: memoryview, nbytes: int) -> bool:
    """Whether a buffer can take part in O_DIRECT I/O of ``nbytes`` as it is."""
    addr = np.frombuffer(view, np.uint8).ctypes.data if len(view) else 0
    return addr % ALIGN == 0 and nbytes % ALIGN == 0 and len(view) >= nbytes


def pwritev_all(fd: int, iov: list[memoryview]) -> None:
    """Write every buffer from the file's start; a short write is retried, so a full file system
    surfaces as ENOSPC."""
    offset = 0
    for buf in iov:
        done = 0
        while done < len(buf):
            n = os.pwrite(fd, buf[done:], offset + done)
            if n <= 0:
                raise OSError(errno.ENOSPC, "no progress writing page")
            done += n
        offset += len(buf)


def read_exact(fd: int, bufs: list, need: int, nowait: bool, offset: int = 0) -> bool:
    """``preadv`` ``need`` bytes from ``offset`` (a whole page: its file's start) into ``bufs``; a
    short read raises. ``nowait``: False (nothing raised) unless the OS page cache holds them all."""
    if nowait:
        try:
            got = os.preadv(fd, bufs, offset, os.RWF_NOWAIT)
        except BlockingIOError:
            return False
        if got < need:  # partly cached (or truncated: the blocking read tells)
            return False
    else:
        got = os.preadv(fd, bufs, offset)
    if got < need:
        raise ShortReadError(f"read {got} of {need} bytes at offset {offset} of a page file")
    return True


class Bounce(threading.local):
    """A per-thread aligned scratch buffer for I/O that cannot use the caller's buffer."""

    def get(self, nbytes: int) -> memoryview:
        buf = getattr(self, "buf", None)
        if buf is None or len(buf) < nbytes:
            self.buf = mmap.mmap(-1, padded(nbytes))
        return memoryview(self.buf)[:nbytes]


def unlink(path: str) -> None:
    """Remove a file that may be gone already."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def place(src: str | Path, dst: str, link: bool = False) -> None:
    """Move (or hard-link) a file into its directory, making the directory if needed (again, if the
    last file in it went meanwhile and took the directory with it)."""
    for attempt in (0, 1):
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        try:
            (os.link if link else os.replace)(src, dst)
            return
        except FileNotFoundError:
            if attempt or not os.path.exists(src):
                raise


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a temp file's writer may still be writing it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
