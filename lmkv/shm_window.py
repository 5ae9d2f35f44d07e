"""Shared-memory windows: how a client on the server's host moves page bytes without the socket.

A window is an anonymous ``memfd`` the client maps; the server maps the same
memory through ``/proc/<client pid>/fd/<fd>``, which the kernel lets only the
same user (or root) open. The client writes a random secret into the first
:data:`HEADER` bytes and names the window and the secret in ``HELLO``; the
server maps it only if the secret matches, so a client cannot make the server
read or write memory it did not create. Nothing lives in a file system: the
memory goes when the last process holding it does, even after a ``SIGKILL``.

A client has one window per connection (a staging area for any caller's
buffers) and may also share its memory tier's arena: pages then move from the
server's memory straight into the arena slot the engine loads from.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from dataclasses import dataclass

import numpy as np

HEADER = 4096  # the secret lives here; usable bytes start after it
_NAME = re.compile(r"/proc/[0-9]{1,10}/fd/[0-9]{1,10}")


@dataclass
class Window:
    name: str  # what the server opens
    secret: bytes
    fd: int
    map: mmap.mmap
    buf: np.ndarray  # the usable bytes

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
    """A new window of ``size`` usable bytes."""
    fd = os.memfd_create(label, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, HEADER + size)
        m = mmap.mmap(fd, HEADER + size)
    except BaseException:
        os.close(fd)
        raise
    secret = secrets.token_bytes(32)
    m[: len(secret)] = secret
    buf = np.frombuffer(m, np.uint8)[HEADER:]
    return Window(f"/proc/{os.getpid()}/fd/{fd}", secret, fd, m, buf)


def attach(name: str, secret: bytes) -> tuple[mmap.mmap, np.ndarray]:
    """Map a client's window (ValueError: not a window name, or the secret does not match;
    OSError: not reachable from here, e.g. the client is on another host)."""
    if not _NAME.fullmatch(name) or len(secret) < 16:
        raise ValueError(f"not an lmkv window: {name!r}")
    fd = os.open(name, os.O_RDWR)
    try:
        m = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    buf = np.frombuffer(m, np.uint8)
    if len(buf) <= HEADER or bytes(buf[: len(secret)]) != secret:
        del buf
        m.close()
        raise ValueError("window secret does not match")
    return m, buf[HEADER:]


def offset_in(window: np.ndarray, arr) -> int | None:
    """Where a contiguous buffer starts inside ``window``, or None if it is not wholly inside."""
    if not isinstance(arr, np.ndarray):
        arr = np.frombuffer(arr, np.uint8)
    if not arr.flags.c_contiguous:
        return None
    base = window.__array_interface__["data"][0]
    ptr = arr.__array_interface__["data"][0]
    off = ptr - base
    return off if 0 <= off and off + arr.nbytes <= window.nbytes else None
