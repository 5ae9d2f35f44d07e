"""Shared-memory windows: how a client on the server's host moves page bytes without the socket.

A window is an anonymous ``memfd`` whose size is sealed (``F_SEAL_SHRINK``, ``F_SEAL_GROW``,
``F_SEAL_SEAL``: from then on nobody, its creator included, can resize it or unseal it). The
client creates and seals it, then hands the descriptor itself to the server over a Unix domain
socket (``SCM_RIGHTS``, :func:`send` / :func:`receive`). The server maps a descriptor only after
:func:`attach` has checked the seals and the size, so

- it maps exactly memory the client created: no path is ever opened, so a client cannot name
  another user's file, another process's descriptor, or the server's own log;
- it can never fault on it: memory that cannot shrink cannot raise ``SIGBUS`` under a copy.

Nothing lives in a file system: the memory goes when the last process holding it does, even
after a ``SIGKILL``. A client has one window per connection (a staging area for any caller's
buffers) and may also share its memory tier's arena: pages then move from the server's memory
straight into the arena slot the engine loads from.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import socket
import struct
from dataclasses import dataclass

import numpy as np

#: the seals a window must carry before a server maps it
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
#: the byte that carries the descriptors after HELLO (ancillary data needs at least one byte)
MARKER = b"F"


@dataclass
class Window:
    """A sealed memfd mapped here: its descriptor, its mapping and its bytes."""

    fd: int
    map: mmap.mmap
    buf: np.ndarray  # the window's bytes

    def close(self) -> None:
        self.buf = np.empty(0, np.uint8)
        try:
            self.map.close()
        except BufferError:  # a view is still alive; the mapping goes with it
            pass
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def create(size: int, label: str = "lmkv-window") -> Window:
    """A new sealed window of ``size`` bytes."""
    fd = os.memfd_create(label, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        m = mmap.mmap(fd, size)
    except BaseException:
        os.close(fd)
        raise
    return Window(fd, m, np.frombuffer(m, np.uint8))


def check(fd: int, max_bytes: int) -> int:
    """The size of the window behind ``fd`` once it passed the checks (the descriptor stays open).

    Raises:
        ValueError: not a memfd sealed against resizing, or empty, or larger than ``max_bytes``.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # (EINVAL for anything that is not a memfd)
        raise ValueError("not a memfd") from None
    if seals & SEALS != SEALS:
        raise ValueError("a window must be sealed against shrinking, growing and unsealing")
    size = os.fstat(fd).st_size
    if not 0 < size <= max_bytes:
        raise ValueError(f"a window of {size} bytes (at most {max_bytes})")
    return size


def attach(fd: int, max_bytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """Map a window a client passed, after :func:`check`; the descriptor is closed either way.

    Raises:
        ValueError: as :func:`check`.
    """
    try:
        m = mmap.mmap(fd, check(fd, max_bytes))
    finally:
        os.close(fd)
    return m, np.frombuffer(m, np.uint8)


def send(sock: socket.socket, windows: list[Window]) -> None:
    """Pass the windows' descriptors to the peer (a Unix domain socket), after the message they
    belong to; no-op without windows."""
    if windows:
        socket.send_fds(sock, [MARKER], [w.fd for w in windows])


def receive(sock: socket.socket, count: int) -> list[int]:
    """The ``count`` descriptors the peer sent with :func:`send`; the caller owns them.

    Raises:
        ValueError: the peer sent other than ``count`` descriptors (those it sent are closed).
    """
    data, fds, flags, _ = socket.recv_fds(sock, 1, max(count, 1))
    if data != MARKER or len(fds) != count or flags & socket.MSG_CTRUNC:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"expected {count} descriptors after HELLO, got {len(fds)}")
    return list(fds)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a Unix domain socket, from the kernel."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return pid, uid, gid


def _address(buf) -> int | None:
    """Where a contiguous buffer's first byte is; None for one that is not contiguous or is empty.
    (``ctypes`` reads a writable buffer's address in a third to a half of the time numpy's array interface
    takes: a read of 64 pages asked it 64 times.)"""
    try:
        return ctypes.addressof(_first_byte(buf))
    except (TypeError, ValueError):  # read-only, or not contiguous, or empty
        if not isinstance(buf, np.ndarray):
            buf = np.frombuffer(buf, np.uint8)
        return buf.__array_interface__["data"][0] if buf.flags.c_contiguous and buf.nbytes else None


_first_byte = ctypes.c_char.from_buffer


def offsets_in(window: np.ndarray, bufs) -> list[int | None]:
    """Where each contiguous buffer starts inside ``window``, or None for one not wholly inside it."""
    base = window.__array_interface__["data"][0]
    out: list[int | None] = []
    for buf in bufs:
        at = _address(buf)
        if at is None:
            out.append(None)
            continue
        off = at - base
        nbytes = buf.nbytes if isinstance(buf, (np.ndarray, memoryview)) else len(buf)
        out.append(off if 0 <= off and off + nbytes <= window.nbytes else None)
    return out
