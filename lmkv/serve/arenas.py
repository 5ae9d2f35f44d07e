"""The clients' arenas as this server maps them: one mapping per arena, however many connections.

A same-host client passes its memory tier's arena (a sealed memfd, :mod:`lmkv.wire.shm_window`)
on every connection of its pool. Every mapping has page tables of its own, so a page copied
through one mapping faults there even when another mapping touched it before: mapped once per
connection, a 500 MiB load into fresh slots cost the server 127,000 page faults, its copies at
2.5-3.2 GB/s against 8.5-10 GB/s into mapped memory (:mod:`lmkv.prefault`). So the server maps
each arena once, known by its memfd's inode, shared by the connections that passed it and
unmapped after the last one ends. When the client maps its arena whole (``memory.prefault``,
an engine's default; HELLO's ``arena_whole``) the server's view is mapped whole as well, in the
background, so its copies into the arena run at the mapped rate from the first load.

Sharing a mapping grants nothing: a descriptor of the same memfd comes only from a process its
creator gave it to, and each connection still copies only where its own requests say
(:meth:`lmkv.serve.connection.Client.destinations`), under its own revocation.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass

import numpy as np

from lmkv.prefault import Prefault
from lmkv.wire import shm_window

ArenaId = tuple[int, int]  # (st_dev, st_ino) of the memfd


@dataclass
class _Mapped:
    map: mmap.mmap
    buf: np.ndarray
    prefault: Prefault
    users: int = 1


class Arenas:
    """The arenas mapped now, by memfd; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: dict[ArenaId, _Mapped] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._maps)

    def attach(self, fd: int, max_bytes: int, whole: bool) -> tuple[ArenaId, np.ndarray]:
        """The arena behind ``fd`` (closed either way), mapped here or already; ``whole``: its client
        maps it whole, so map this view whole too. :meth:`release` the id when the connection ends.

        Raises:
            ValueError: as :func:`lmkv.wire.shm_window.check`.
        """
        try:
            size = shm_window.check(fd, max_bytes)
            st = os.fstat(fd)
            key = (st.st_dev, st.st_ino)
            with self._lock:
                m = self._maps.get(key)
                if m is None:
                    mapping = mmap.mmap(fd, size)
                    buf = np.frombuffer(mapping, np.uint8)
                    m = self._maps[key] = _Mapped(mapping, buf, Prefault(buf, "lmkv-serve-arena-map"))
                else:
                    m.users += 1
                if whole:
                    m.prefault.advance(len(m.buf))
                return key, m.buf
        finally:
            os.close(fd)

    def release(self, key: ArenaId) -> None:
        """One connection less for this arena; the last one unmaps it."""
        with self._lock:
            m = self._maps[key]
            m.users -= 1
            if m.users:
                return
            del self._maps[key]
        m.prefault.stop()
        try:
            m.map.close()
        except BufferError:  # a view is still alive in a reply being torn down; the mapping goes with it
            pass
