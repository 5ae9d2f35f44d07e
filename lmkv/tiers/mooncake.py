"""Mooncake Store as a tier: pages as objects of the field's distributed KV store (FAST'25).

``remote.url: mooncake://MASTER:PORT``. Each page is one object, its packed header followed by
its payload (lmkv's remote page format, :mod:`lmkv.tiers.remote`), under
``remote.key_prefix`` + the page key in hex: the page key carries the model and the namespace,
so tenants never share an object. Every read, whole or ranged, is verified against the header's
per-unit digests (Mooncake's own checksum is opt-in and skips ranged reads). Like Redis pages,
Mooncake objects belong to no residency domain: clearing a domain leaves them, and Mooncake's
own eviction and leases decide how long they live.

This client contributes ``remote.mooncake.segment_size`` of memory to the store (objects other
clients write may live in it). Mooncake moves bytes only between registered buffers (its TCP
transport too, since 0.3.12): the memory tier's arena is registered (:meth:`MooncakeTier.share_arena`),
so pages land in and leave from the slots the engine's loads and stores use, in one call per batch.
The memory tier keeps :attr:`MooncakeTier.header_room` free before each slot: a page's header lands
there and leaves from there, its object moving as one buffer (as two, header and payload apart, it
moved at 0.73-0.94x the rate). Pages outside the arena go through a registered staging buffer of
this tier's.

A call given up on (``remote.timeout``) may still move bytes: the arena slots it was lent stay in
the memory tier's quarantine until it returns, and the staging buffer it was given is replaced
(:mod:`lmkv.tiers.quarantine`).

Mooncake's calls block in C++: each runs on a thread of this tier's and is waited for at most
``remote.timeout`` (a master that stopped answering costs that once; the tier is then marked
down, and every call fails at once until it answers a ping). Connecting waits for the master to
listen (Mooncake's ``setup`` would retry for as long as it is away, holding the interpreter
lock): an engine starts and serves while the master is down, and the tier comes up when the
master does.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import TypeVar
from urllib.parse import urlsplit

import numpy as np

from lmkv import threads
from lmkv.config import ConfigError, RemoteConfig
from lmkv.errors import TierUnavailableError
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.page import ALIGN, PageHeader, header_bytes, units_in_ranges
from lmkv.tiers.allocator import RoomBefore
from lmkv.tiers.arena import HostArena
from lmkv.tiers.base import Range
from lmkv.tiers.header_cache import HeaderCache
from lmkv.tiers.mooncake_client import MooncakeClient
from lmkv.tiers.mooncake_puts import PutStream
from lmkv.tiers.quarantine import Quarantine, lendable
from lmkv.tiers.remote import STREAMS_OPEN, Checked, RemoteTier, batches
from lmkv.wire.shm_window import offsets_in

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Mooncake's error codes from here down: the master did not answer (its RPC failed)
RPC_FAILED = -900
#: a ranged read's codes for an object whose get session is gone (-600: not in one, as after an end
#: elsewhere; -707: its lease ran out), not for an object that is gone
SESSION_GONE = (-600, -707)
#: threads Mooncake's blocking calls run on (a stalled master holds one each until it answers)
CALL_THREADS = 4
#: headers of pages read lately, kept so a layerwise load's later spans read only their ranges
HEADERS_KEPT = 16384
#: how long an object stays in the client's get session after its last ranged read, for the next
#: span of a layerwise load (spans follow each other by a layer's compute; a read right after the
#: session's start costs ~1.5 ms more than one in a session already open, on loopback), and how
#: many objects stay in it at most
SESSION_IDLE_S = 0.5
SESSION_KEYS = 65536
#: registered memory for the headers a step's put session writes last (~0.6 KiB a page of 64 units)
STREAM_HEADER_BYTES = 1 << 20


@dataclass
class _InSession:
    """An object in the client's get session: whether the session's start found it, when it was last
    read, and the reads holding it now (an object is ended only once none does)."""

    found: bool
    used: float
    reads: int = 0


@dataclass
class _Moving:
    """A Mooncake call that moves page bytes, and the arena slots ``(offset, bytes)`` it was lent."""

    fut: Future
    lent: list[tuple[int, int]]


def master_address(url: str) -> str:
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise ConfigError(f"remote.url = {url!r}: expected mooncake://host:port (the master's RPC address)")
    return f"{parts.hostname}:{parts.port}"


class MooncakeTier(RemoteTier):
    """Mooncake Store through its Python client. Thread-safe (the staging buffer is taken under a
    lock, one read or write at a time)."""

    #: free bytes before each memory slot, for its page's header (a header of up to 504 units)
    header_room = ALIGN

    def __init__(self, cfg: RemoteConfig, name: str = "mooncake") -> None:
        super().__init__(name, cfg)
        assert cfg.url is not None
        self.master = master_address(cfg.url)
        self.mc = cfg.mooncake
        self.prefix = cfg.key_prefix
        self._calls = threads.pool(CALL_THREADS, "lmkv-mooncake")
        self._streamer = threads.pool(1, "lmkv-mooncake-stream")  # every put session's calls, in order
        self._stream_headers = np.zeros(STREAM_HEADER_BYTES, np.uint8)
        self._lock = threading.Lock()
        self._store: MooncakeClient | None = None  # the connected client
        self._closed = False
        self._connecting: Future | None = None
        self._staging = np.zeros(int(self.mc.staging_size), np.uint8)
        self._staging_lock = threading.Lock()
        self._arena: np.ndarray | None = None  # the memory tier's, registered with each client
        self._quarantine: Quarantine | None = None  # where arena slots lent to a call given up on wait
        self._room_before: RoomBefore | None = None  # the free bytes before an arena slot
        self._headers = HeaderCache(HEADERS_KEPT)  # (the pages verified reads found: see _read)
        # the client's get session, per object (Mooncake keeps it per key), least recently read first
        self._session_keys: OrderedDict[str, _InSession] = OrderedDict()
        self._sessions_lock = threading.Lock()

    def share_arena(self, arena: HostArena, quarantine: Quarantine, room_before: RoomBefore | None = None) -> None:
        """Pages land in and leave from the memory tier's ``arena``: it is registered with the client
        (when it connects: the store shares it before the first call); their headers in the room
        before their slots where ``room_before`` says there is some."""
        self._arena = arena.buf
        self._quarantine = quarantine
        self._room_before = room_before

    def stream(self, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], bufs: Sequence,
               domain: str) -> PutStream | None:
        """A put session for a step's pages, put layer by layer from ``bufs`` (their memory slots) as
        they fill (:mod:`lmkv.tiers.mooncake_puts`); None where it cannot be: ``mooncake.stream_stores``
        off, the tier down or not connected yet (a step never waits for a connection), the arena not
        registered, or a buffer outside it."""
        if not self.mc.stream_stores or not keys or not self.health.up:
            return None
        with self._lock:
            client, arena = self._store, self._arena
        if client is None or arena is None or max(header_bytes(lay) for lay in layouts) > STREAM_HEADER_BYTES:
            return None
        offsets = offsets_in(arena, bufs)
        if any(o is None for o in offsets) or not self._stream_slot(STREAMS_OPEN):
            return None
        base = arena.ctypes.data

        def call(fn: Callable[..., list[int]], *args) -> list[int]:
            return self._call(lambda: self._wait(self._calls.submit(fn, client, *args)))

        return PutStream(self.name, call, self._streamer.submit, self._stream_headers, keys,
                         [self._name(k) for k in keys], layouts,
                         [base + o for o in offsets], self._stream_closed, self.stats)  # type: ignore[operator]

    # -- the client ------------------------------------------------------------

    def _connect(self):
        """A client set up with the master, if the master accepts a connection now: Mooncake's
        ``setup`` retries for as long as the master is away, holding Python's interpreter lock
        (measured: every thread of the process stopped for 90 s), so it is called only once the
        master is seen listening."""
        from mooncake.store import MooncakeDistributedStore  # (pip install 'lmkv[mooncake]')

        host, port = self.master.rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=self.cfg.connect_timeout).close()
        except OSError as err:
            raise TierUnavailableError(f"{self.name}: master {self.master}: {err}") from err
        store = MooncakeDistributedStore()
        mc = self.mc
        rc = store.setup(mc.local_hostname, mc.metadata_server, int(mc.segment_size), int(mc.local_buffer_size),
                         mc.protocol, mc.device_names, self.master)
        if rc != 0:
            raise TierUnavailableError(f"{self.name}: setting up the client with master {self.master} failed ({rc})")
        rc = store.register_buffer(self._staging.ctypes.data, self._staging.nbytes)
        if rc != 0:
            store.close()
            raise TierUnavailableError(f"{self.name}: registering {self._staging.nbytes} bytes of staging "
                                       f"failed ({rc})")
        if store.register_buffer(self._stream_headers.ctypes.data, self._stream_headers.nbytes) != 0:
            store.close()
            raise TierUnavailableError(f"{self.name}: registering the put sessions' header buffer failed")
        if self._arena is not None and store.register_buffer(self._arena.ctypes.data, self._arena.nbytes) != 0:
            log.warning("lmkv: %s tier: registering the %d-byte memory arena failed; pages go through staging",
                        self.name, self._arena.nbytes)
            self._arena = None
        with self._lock:
            if self._closed:  # (closed while this connected: the new client goes too)
                store.close()
                raise TierUnavailableError(f"{self.name}: closed")
            self._store = client = MooncakeClient(store)
        with self._sessions_lock:  # (a new client has no get session: its objects start afresh)
            self._session_keys.clear()
        log.info("lmkv: %s tier connected to master %s", self.name, self.master)
        return client

    def _client(self) -> MooncakeClient:
        """The connected client; while there is none, a connection is started (one at a time) and
        waited for at most ``remote.connect_timeout``."""
        with self._lock:
            if self._store is not None:
                return self._store
            if self._closed:
                raise TierUnavailableError(f"{self.name}: closed")
            fut = self._start_connecting()
        try:
            return fut.result(timeout=self.cfg.connect_timeout)
        except FutureTimeout:
            raise TierUnavailableError(f"{self.name}: master {self.master} did not answer in "
                                       f"{self.cfg.connect_timeout} s") from None

    @property
    def connected(self) -> bool:
        """Whether a client is set up with the master (it stays so while the master is away)."""
        return self._store is not None

    def connect_soon(self) -> None:
        with self._lock:
            if self._store is None and not self._closed:
                self._start_connecting()

    def _start_connecting(self) -> Future:
        """The connection in progress, started if there is none (under ``_lock``)."""
        if self._connecting is None or self._connecting.done():
            self._connecting = self._calls.submit(self._connect)
        return self._connecting

    def _run(self, call: Callable[..., T], *args) -> T:
        """``call(client, *args)`` on a call thread, waited for at most ``remote.timeout``."""
        return self._wait(self._calls.submit(call, self._client(), *args))

    def _wait(self, fut: Future[T]) -> T:
        """A call's result, waited for at most ``remote.timeout``; any failure is the tier's."""
        try:
            return fut.result(timeout=self.cfg.timeout)
        except FutureTimeout:
            raise TierUnavailableError(f"{self.name}: master {self.master} did not answer in {self.cfg.timeout} s") \
                from None
        except (RuntimeError, ValueError, TypeError) as err:  # the binding's own failures: the tier's
            raise TierUnavailableError(f"{self.name}: {type(err).__name__}: {err}") from err

    def _name(self, key: PageKey) -> str:
        return self.prefix + key.hex()

    # -- primitives ------------------------------------------------------------

    def _ping(self) -> None:
        """The client's health and a question the master must answer (``health_check`` alone says 0
        with the master gone; a restarted master knows this client again a few seconds later)."""
        rc = self._run(lambda c: c.health_check())
        asked = self._run(lambda c: c.batch_is_exist([self.prefix + "ping"]))
        if rc != 0 or asked[0] < 0:
            raise TierUnavailableError(f"{self.name}: health check answered {rc}, the master {asked[0]}")

    def _exists(self, keys: Sequence[PageKey]) -> list[bool]:
        names = [self._name(k) for k in keys]
        found = self._run(lambda c: c.batch_is_exist(names))
        if any(r < 0 for r in found):
            raise TierUnavailableError(f"{self.name}: the master could not answer for {sum(r < 0 for r in found)} keys")
        return [r == 1 for r in found]

    def _read(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence,
              ranges: Sequence[Range] | None) -> list:
        """A batch at a time, in one Mooncake call each: pages whose ``outs`` lie in the memory tier's
        registered arena land there directly, their headers in the room before their slots (or in
        staging where there is none: one batch, unless there are more than half of staging holds),
        and are verified once it returns (checking one part while the next moved was slower here:
        23 against 15 ms for 128 pages of 256 KiB in parts of 8 MiB, the call's threads and the
        checking thread contending); the others land in staging, the two halves of it in turn, and
        are copied into their ``outs`` while Mooncake moves the next batch (its calls release the
        interpreter lock). Each page lands as its header and payload, or as ``ranges`` alone when
        this tier has read its header lately (a layerwise load's later spans: a page's key names its
        content, so a header read once verifies every range), else its header and ``ranges``; every
        one is verified where it landed."""
        hdr = header_bytes(layout)
        want = [(0, layout.payload_bytes)] if ranges is None else [(a, b) for a, b in ranges]
        units = units_in_ranges(layout, want)
        body = sum(b - a for a, b in want)
        known: list[PageHeader | None] = [None] * len(keys) if ranges is None else self._headers.get(keys)
        out: list = []
        with self._staging_lock:
            client = self._client()
            arena = self._arena
            direct = lendable(arena, self._quarantine, outs)  # (offsets in the arena: pages land there)
            place = 0 if arena is None else arena.ctypes.data
            base = self._staging.ctypes.data  # (a ctypes object per access: asked once)
            roomy = self._roomy(direct, [(layout.payload_bytes, hdr)] * len(keys))  # (a header lands before its slot)
            staged = [(hdr if h is None and not room else 0) + (body if direct is None else 0)
                      for h, room in zip(known, roomy)]  # (into staging)
            half = self._staging.nbytes // 2
            if max(staged, default=0) > half:
                raise TierUnavailableError(f"{self.name}: a {max(staged)}-byte page does not fit half of "
                                           "remote.mooncake.staging_size")
            landing: tuple[_Moving, Sequence[int], list[int], list[np.ndarray | None]] | None = None
            moving: list[_Moving] = []
            try:
                for n, r in enumerate(batches(staged, half, len(keys))):
                    at = (n % 2) * half
                    offsets = [at + int(o) for o in np.cumsum([0] + [staged[i] for i in r[:-1]])]
                    plan = [self._plan(known[i] is None, hdr, want,
                                       place + direct[i] - hdr if roomy[i] else base + pos,  # type: ignore[index]
                                       None if direct is None else place + direct[i])
                            for i, pos in zip(r, offsets)]
                    heads = [None if known[i] is not None else
                             arena[direct[i] - hdr : direct[i]] if roomy[i] else  # type: ignore[index]
                             self._staging[pos : pos + hdr] for i, pos in zip(r, offsets)]
                    names = [self._name(keys[i]) for i in r]
                    lent = [] if direct is None else [(direct[i], layout.payload_bytes) for i in r]
                    ptrs, lens, srcs = ([p[k] for p in plan] for k in range(3))
                    call = self._calls.submit(self._fetch, client, names, ptrs, lens, srcs, ranges is None)
                    moving.append(_Moving(call, lent))
                    if landing is not None:
                        out += self._land(*landing, keys, known, layout, outs, hdr, want, units, direct is None)
                    landing = (moving[-1], r, offsets, heads)
                if landing is not None:
                    out += self._land(*landing, keys, known, layout, outs, hdr, want, units, direct is None)
            except BaseException:
                self._abandon(client, moving)
                raise
        return out

    def _roomy(self, direct: list[int] | None, sizes: Sequence[tuple[int, int]]) -> list[bool]:
        """Per page landing in (or leaving from) the arena at ``direct`` (``sizes``: its payload's
        and its header's bytes), whether its header fits the room before its slot (a slot the
        memory tier gave, not a view into one)."""
        room = self._room_before
        if direct is None or room is None:
            return [False] * len(sizes)
        return [room(o, n) >= z for o, (n, z) in zip(direct, sizes)]

    @staticmethod
    def _plan(head: bool, hdr: int, want: list[tuple[int, int]], at: int,
              page: int | None) -> tuple[list[int], list[int], list[int]]:
        """Where one page's object lands: (buffers, their lengths, the object offsets they take). Its
        header (``head``) lands at ``at`` (staging, or the room before its slot); its ranges at
        ``page`` (its payload's address in the arena: at their page offsets) or, when None, in
        staging after the header. Parts next to each other both in memory and in the object are one
        buffer (a header in its slot's room and a range from the payload's start: a whole page)."""
        ptrs: list[int] = []
        lens: list[int] = []
        srcs: list[int] = []

        def part(ptr: int, n: int, src: int) -> None:
            if ptrs and ptrs[-1] + lens[-1] == ptr and srcs[-1] + lens[-1] == src:
                lens[-1] += n
            else:
                ptrs.append(ptr)
                lens.append(n)
                srcs.append(src)

        if head:
            part(at, hdr, 0)
            at += hdr
        for a, b in want:
            part(at if page is None else page + a, b - a, hdr + a)
            at += b - a
        return ptrs, lens, srcs

    def _abandon(self, client, moving: Sequence[_Moving]) -> None:
        """Calls given up on (a timeout, an error on the way) may still move bytes: the arena slots they
        were lent stay in the quarantine until each returns, and the staging buffer they were given
        is replaced (the old one unregistered once they have all returned)."""
        running = [m for m in moving if not m.fut.done()]
        if not running:
            return
        if self._quarantine is not None:
            for m in running:
                self._quarantine.hold(m.lent, m.fut)
        old, self._staging = self._staging, np.zeros_like(self._staging)
        try:
            registered = client.register_buffer(self._staging.ctypes.data, self._staging.nbytes) == 0
        except (RuntimeError, ValueError):
            registered = False
        if not registered:
            with self._lock:  # (the next call connects afresh and registers the new staging)
                if self._store is client:
                    self._store = None
        log.warning("lmkv: %s tier: gave up on %d calls that may still move bytes; their memory is "
                    "held until they return", self.name, len(running))

        def unregister() -> None:
            futures_wait([m.fut for m in running])
            try:
                client.unregister_buffer(old.ctypes.data)
            except (RuntimeError, ValueError):
                pass  # (the client is closed: nothing left registered)
        threads.start(unregister, f"lmkv-{self.name}-retire")

    def _fetch(self, client, names: list[str], ptrs: list[list[int]], lens: list[list[int]],
               srcs: list[list[int]], whole: bool) -> list[bool]:
        """One Mooncake read of each object's bytes into the buffers ``ptrs`` (``lens`` bytes each,
        from offsets ``srcs`` of the object); per page, whether all of it came.

        A whole page's buffers take its object in order, header first. Ranges go through the
        client's get session (:meth:`_session`): its start asks the master where the objects are
        (one round trip), ranged reads then move bytes from those replicas without the master.
        (Mooncake 0.3.13's ``get_into_ranges`` crashes the process when its own query of the master
        fails, as when the master dies during the call; an object the session's start does not find
        is a miss.) An object whose session went away since it was started (:data:`SESSION_GONE`: its
        lease ran out between two spans of a load) is started again and read once more: it may
        well be there still."""
        if whole:
            got = client.batch_get_into_multi_buffers(names, ptrs, lens)
            return [g == sum(z) for g, z in zip(got, lens)]
        live = self._session(client, names)
        ok = [False] * len(names)

        def ranges(which: list[int]) -> list[int]:
            got = client.batch_get_into_multi_buffer_ranges([names[i] for i in which], [ptrs[i] for i in which],
                                                            [lens[i] for i in which], [srcs[i] for i in which])
            for i, g in zip(which, got):
                ok[i] = g == sum(lens[i])
            return [i for i, g in zip(which, got) if g in SESSION_GONE]

        try:
            gone = ranges(live) if live else []
            if gone:
                started = client.batch_get_session_start([names[i] for i in gone])
                self._reachable(started)
                ranges([i for i, rc in zip(gone, started) if rc >= 0])
            return ok
        finally:
            # (a page that failed, missing, its lease expired or its object gone, is started afresh next time)
            self._done_with(client, names, [n for n, good in zip(names, ok) if not good])

    def _session(self, client, names: list[str]) -> list[int]:
        """``names`` in the client's get session, started for those not in it yet (the earlier
        spans of a layerwise load started the others); the indices of those the start found.
        Objects idle for :data:`SESSION_IDLE_S` leave the session on the way. A start the master
        does not answer is the tier's outage."""
        now = time.monotonic()
        with self._sessions_lock:
            keys = self._session_keys
            idle = []
            for n, e in keys.items():  # (least recently read first)
                if now - e.used <= SESSION_IDLE_S:
                    break
                if not e.reads:
                    idle.append(n)
            for n in idle:
                del keys[n]
            new = [n for n in names if n not in keys]
            for n in names:  # (held: no other read ends them meanwhile)
                keys.setdefault(n, _InSession(False, now)).reads += 1
        self._end(client, idle)
        if new:
            try:
                started = client.batch_get_session_start(new)
                self._reachable(started)
            except BaseException:
                self._done_with(client, names, names)
                raise
            with self._sessions_lock:
                for n, rc in zip(new, started):
                    self._session_keys[n].found = rc >= 0
        with self._sessions_lock:
            return [i for i, n in enumerate(names) if self._session_keys[n].found]

    def _done_with(self, client, names: list[str], failed: list[str]) -> None:
        """A read of ``names`` is over: each stays in the session, but those in ``failed`` (and the
        least recently read beyond :data:`SESSION_KEYS`) leave it once no other read holds them."""
        now = time.monotonic()
        bad = set(failed)
        with self._sessions_lock:
            keys = self._session_keys
            for n in names:
                e = keys[n]
                e.used, e.reads = now, e.reads - 1
                keys.move_to_end(n)
            over = len(keys) - SESSION_KEYS
            ended = [n for n in bad if not keys[n].reads]
            if over > 0:
                ended += [n for n, e in itertools.islice(keys.items(), over) if not e.reads and n not in bad]
            for n in ended:
                del keys[n]
        self._end(client, ended)

    def _leave_session(self, names: list[str]) -> None:
        """These objects out of the get session now, unless a read holds them."""
        with self._sessions_lock:
            gone = [n for n in names if n in self._session_keys and not self._session_keys[n].reads]
            for n in gone:
                del self._session_keys[n]
        with self._lock:
            client = self._store
        if client is not None:
            self._end(client, gone)

    def _end(self, client, names: list[str]) -> None:
        if not names:
            return
        try:
            client.batch_get_session_end(names)
        except (RuntimeError, ValueError) as err:  # (the client going away: nothing left to free)
            log.debug("lmkv: %s tier: ending get sessions: %s", self.name, err)

    def _reachable(self, rcs: Sequence[int]) -> None:
        """A batch call's return codes: every one an RPC failure is the master's outage, not misses."""
        if rcs and all(rc <= RPC_FAILED for rc in rcs):
            raise TierUnavailableError(f"{self.name}: master {self.master} unreachable ({rcs[0]})")

    def _land(self, moving: _Moving, r: Sequence[int], offsets: list[int], heads: list[np.ndarray | None],
              keys: Sequence[PageKey], known: list[PageHeader | None], layout: GroupLayout, outs: Sequence,
              hdr: int, want: list[tuple[int, int]], units: Sequence[int], staged: bool) -> list:
        """A batch's pages once Mooncake moved them (``heads``: where each header read landed):
        copied from staging into their ``outs`` when ``staged`` (else they landed there), each
        verified right after (a :class:`Checked` header; with ``remote.verify`` off, its header
        parsed: either is kept for later reads of the page), or its raw header for the caller's
        check to count and drop (a kept header it failed is forgotten: whichever of the two was
        wrong, the object is dropped), or None where the object was not there."""
        came = self._wait(moving.fut)
        results: list = []
        kept: list[tuple[PageKey, PageHeader]] = []
        for j, (i, ok) in enumerate(zip(r, came)):
            if not ok:
                results.append(None)
                continue
            head = heads[j]
            raw: bytes | PageHeader = bytes(head) if head is not None else known[i]  # type: ignore[assignment]
            dst = outs[i]
            if staged:
                pos = offsets[j] + (hdr if head is not None else 0)
                dst = np.frombuffer(memoryview(dst).cast("B"), np.uint8)
                for a, b in want:
                    np.copyto(dst[a:b], self._staging[pos : pos + b - a])
                    pos += b - a
            if self.verifies:
                got = self._verified(keys[i], raw, layout, dst, units)
            else:
                got = self._parsed(keys[i], raw, layout)
            header = got.header if isinstance(got, Checked) else got
            if isinstance(header, PageHeader):  # (kept unverified too: later spans need not read it again)
                kept.append((keys[i], header))
            else:  # (its object may have gone or changed since the session found it: start afresh)
                self._headers.forget([keys[i]])
                self._leave_session([self._name(keys[i])])
            results.append(got)
        self._headers.put_many(kept)
        return results

    def _write(self, pages: Sequence[tuple[PageHeader, memoryview]], domain: str) -> list[bool]:
        """A batch at a time, one ``batch_put_from_multi_buffers`` each: a page in the memory tier's
        registered arena leaves from there, its header written into the room before its slot (or
        into staging where there is none), others are copied into staging (header, then payload).
        An object is readable only once all of it is there."""
        hdrs = [h.header_bytes for h, _ in pages]
        stored: list[bool] = []
        with self._staging_lock:
            client = self._client()
            arena = self._arena
            direct = lendable(arena, self._quarantine, [v for _, v in pages])  # (pages leave from there)
            place = 0 if arena is None else arena.ctypes.data
            roomy = self._roomy(direct, [(len(v), z) for z, (_, v) in zip(hdrs, pages)])
            staged = [0 if room else z if direct is not None else z + len(v)
                      for room, z, (_, v) in zip(roomy, hdrs, pages)]
            if max(staged, default=0) > self._staging.nbytes:
                raise TierUnavailableError(f"{self.name}: a {max(staged)}-byte page does not fit "
                                           "remote.mooncake.staging_size")
            base = self._staging.ctypes.data
            for r in batches(staged, self._staging.nbytes, len(pages)):
                names, ptrs, lens, at = [], [], [], 0
                for i in r:
                    h, v = pages[i]
                    packed = np.frombuffer(h.pack(), np.uint8)
                    if roomy[i]:  # (one buffer: the header right before the payload)
                        o = direct[i] - hdrs[i]  # type: ignore[index]
                        arena[o : o + hdrs[i]] = packed  # type: ignore[index]
                        ptrs.append([place + o])
                        lens.append([hdrs[i] + len(v)])
                    else:
                        self._staging[at : at + hdrs[i]] = packed
                        if direct is not None:
                            ptrs.append([base + at, place + direct[i]])
                            lens.append([hdrs[i], len(v)])
                        else:
                            self._staging[at + hdrs[i] : at + staged[i]] = np.frombuffer(v, np.uint8)
                            ptrs.append([base + at])
                            lens.append([staged[i]])
                    names.append(self._name(h.key))
                    at += staged[i]
                lent = [] if direct is None else [(direct[i], len(pages[i][1])) for i in r]
                call = _Moving(self._calls.submit(client.batch_put_from_multi_buffers, names, ptrs, lens), lent)
                try:
                    rcs = self._wait(call.fut)
                except BaseException:
                    self._abandon(client, [call])
                    raise
                self._reachable(rcs)
                for rc in rcs:
                    if rc != 0 and rc != -705:  # (-705: the object is there already)
                        self.stats.full += 1
                stored += [rc in (0, -705) for rc in rcs]
        return stored

    def _delete(self, keys: Sequence[PageKey]) -> int:
        self._headers.forget(keys)
        names = [self._name(k) for k in keys]
        self._leave_session(names)
        return sum(rc == 0 for rc in self._run(lambda c: c.batch_remove(names, True)))

    def _clear(self, domain: str) -> int:
        """Mooncake objects belong to no engine's domain (see the module docstring): nothing to drop."""
        return 0

    def _fetch_usage(self) -> tuple[int, int, int]:
        """Mooncake's client does not say how full the store is: unknown (0)."""
        return 0, 0, 0

    def close(self) -> None:
        super().close()
        with self._lock:
            client, self._store, self._closed = self._store, None, True
        if client is not None:
            with self._sessions_lock:
                names, self._session_keys = list(self._session_keys), OrderedDict()
            buffers = [b for b in (self._staging, self._stream_headers, self._arena) if b is not None]

            def last(store) -> None:  # (once no call is in flight: see lmkv.tiers.mooncake_client)
                try:
                    self._end(store, names)
                    for b in buffers:
                        store.unregister_buffer(b.ctypes.data)
                finally:
                    store.close()

            client.close(last)
        self._streamer.shutdown(wait=False, cancel_futures=True)
        self._calls.shutdown(wait=False, cancel_futures=True)
