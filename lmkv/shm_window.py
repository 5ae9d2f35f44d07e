"""Shared-memory windows: how a client on the server's host moves page bytes without the socket.

The client creates a file in ``/dev/shm`` (mode 0600: only its own user, and so a
server running as that user, can map it), writes a random secret into its first
:data:`HEADER` bytes, and names file and secret in ``HELLO``. The server maps it
only if the secret matches, so a client cannot make the server read or write a
window it did not create. The client unlinks the file once the server has
answered: the mapping lives on in both processes and nothing is left behind if
either dies.
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
from pathlib import Path

DIR = Path("/dev/shm")
HEADER = 4096  # the secret lives here; pages start after it
_NAME = re.compile(r"lmkv-[0-9a-f]{32}")


def create(size: int) -> tuple[str, bytes, mmap.mmap]:
    """A new window of ``size`` usable bytes: (name, secret, mapping)."""
    name = f"lmkv-{secrets.token_hex(16)}"
    fd = os.open(DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, HEADER + size)
        m = mmap.mmap(fd, HEADER + size)
    finally:
        os.close(fd)
    secret = secrets.token_bytes(32)
    m[: len(secret)] = secret
    return name, secret, m


def attach(name: str) -> mmap.mmap:
    """Map a client's window by name (ValueError for a name lmkv did not make, OSError if absent)."""
    if not _NAME.fullmatch(name):
        raise ValueError(f"not an lmkv window name: {name!r}")
    fd = os.open(DIR / name, os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def unlink(name: str) -> None:
    try:
        os.unlink(DIR / name)
    except FileNotFoundError:
        pass
