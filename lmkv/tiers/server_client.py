"""The lmkv server as a tier (``remote.url: lmkv://host:port``; ``lmkvs://`` for TLS).

A pool of blocking connections, one per concurrent caller (the store's I/O
threads, a layerwise loader). Page bytes are received with ``recv_into``
straight into the caller's buffers and sent from the caller's buffers; nothing
is copied into intermediate ``bytes``. On the server's host (``shm: auto`` and a
loopback address) the first connection's HELLO names the server's Unix domain socket;
connections then go there instead, each passing a sealed shared-memory window
(:mod:`lmkv.wire.shm_window`, and the memory tier's arena when it is shared) whose memory
the bulk bytes cross instead of the socket. The client first checks that the socket's
peer is the process that answered on the TCP port. A connection that fails is
dropped; the next call opens a fresh one, so a restarted server is picked up without
the engine noticing more than a few misses. A server that refuses HELLO (a wrong
token, too many clients) is a tier that is down, not an error the engine sees.

A same-host server writes into arena slots the client names, on its own time: a request given
up on (a timeout) may still be copied into them later. Such a connection is not closed but
reaped (:meth:`ServerTier._reap`), its unanswered requests' slots held in the memory tier's
quarantine (:mod:`lmkv.tiers.quarantine`) until the server is known to be done with them.
"""

from __future__ import annotations

import functools
import logging
import queue
import select
import socket
import threading
from collections.abc import Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from urllib.parse import urlsplit

import numpy as np

from lmkv import threads
from lmkv.config import ConfigError, RemoteConfig
from lmkv.errors import LMKVError, PageError, TierBusyError, TierUnavailableError
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.page import Chunk, PageHeader, as_bytes_view, landing_chunks, units_in_ranges, unpack_header, verify_units
from lmkv.tiers import remote
from lmkv.tiers.allocator import RoomBefore
from lmkv.tiers.arena import HostArena
from lmkv.tiers.base import Range
from lmkv.tiers.put_stream import StepPutStream
from lmkv.tiers.quarantine import Quarantine, lendable
from lmkv.tiers.remote import Checked, RemoteTier, batches
from lmkv.tiers.server_connection import Connection, UnixEndpoint
from lmkv.tiers.server_puts import server_session
from lmkv.wire import shm_window
from lmkv.wire.protocol import (
    MAX_KEYS,
    Clear,
    Count,
    Empty,
    Exists,
    Get,
    GetReply,
    Keys,
    LayoutMsg,
    Op,
    ProtocolError,
    Put,
    RemoteError,
    Stats,
    Stored,
    is_loopback,
)
from lmkv.wire.socket_reader import SocketReader

log = logging.getLogger(__name__)

#: how much one request of a read into the shared arena asks for: the next chunk is copied while
#: this one is verified
ARENA_CHUNK_BYTES = 8 << 20
#: chunk requests sent ahead of the one being answered (the server never waits for the next)
ARENA_AHEAD = 3
#: a read into the shared arena goes in at least this many chunks where its pages allow: a read of
#: small pages in one chunk is copied whole, then checked whole, one after the other
ARENA_SPLIT = ARENA_AHEAD + 1


def parse_url(url: str) -> tuple[str, int, bool]:
    parts = urlsplit(url)
    if not parts.hostname or not parts.port:
        raise ConfigError(f"remote.url = {url!r}: expected lmkv://host:port")
    return parts.hostname, parts.port, parts.scheme == "lmkvs"


@functools.lru_cache(maxsize=1024)
def _read_plan(layout: GroupLayout, ranges: tuple[tuple[int, int], ...] | None
               ) -> tuple[tuple[tuple[int, int], ...], Sequence[int], int, tuple[Chunk, ...]]:
    """What a read of ``ranges`` (None: whole pages) of ``layout``'s pages needs, worked out once per
    layout and ranges (worked out per call, they were several µs of every one-page GET): the
    ranges, their units, bytes per page and landing chunks."""
    want = ((0, layout.payload_bytes),) if ranges is None else ranges
    return want, units_in_ranges(layout, want), sum(b - a for a, b in want), landing_chunks(layout, want)


class ServerTier(RemoteTier):
    """``lmkv serve`` as a tier: a pool of connections, shared memory on the server's host.

    Thread-safe: each caller takes a connection from the pool for its request. Connections open on
    first use (an engine starts while the server is down); one given up on mid-request is reaped
    in the background (:meth:`_reap`); :meth:`close` closes the idle ones."""

    def __init__(self, cfg: RemoteConfig, namespace: str = "default", name: str = "server") -> None:
        super().__init__(name, cfg)
        self.host, self.port, self.tls = parse_url(cfg.url or "")
        self.namespace = namespace
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        # A token per connection a caller may hold (a queue of them: taking and returning one is a
        # C call, where a semaphore's acquire and release are Python, a few µs of every request)
        self._slots: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(cfg.max_connections):
            self._slots.put(None)
        self._layouts: dict[int, LayoutMsg] = {}
        self._arena: shm_window.Window | None = None
        self._arena_whole = False  # the arena is mapped whole: the server maps its view whole too
        self._quarantine: Quarantine | None = None  # where slots lent to an abandoned request wait
        self._unix: UnixEndpoint | None = None  # learned from a TCP HELLO; forgotten when it fails
        self._streamer = threads.pool(remote.STREAMS_OPEN, f"lmkv-{name}-stream")  # (a thread a stream)
        self._closing = threading.Event()

    @property
    def wants_arena(self) -> bool:
        return self.cfg.shm == "auto" and is_loopback(self.host)

    def share_arena(self, arena: HostArena, quarantine: Quarantine, room_before: RoomBefore | None = None) -> None:
        """The server copies pages straight into the memory tier's ``arena`` when it is a shared-memory
        window (:attr:`wants_arena`); slots lent to a request this client gives up on wait in
        ``quarantine`` until the server is done with them."""
        if arena.window is not None:
            self._arena = arena.window
            self._arena_whole = arena.whole
            self._quarantine = quarantine

    def connect_soon(self) -> None:
        """Open the first connection in the background: the engine's first load then finds one, and
        a same-host server has mapped the arena by then (whole, where this process maps it whole:
        :mod:`lmkv.serve.arenas`). A server that is down is connected to on first use, as ever."""
        threads.start(self._connect_now, f"lmkv-{self.name}-connect")

    def _connect_now(self) -> None:
        try:
            with self._conn():
                pass
        except LMKVError as err:
            log.debug("lmkv: %s: not connected yet (%s)", self.name, err)
        if self._closing.is_set():  # (closed meanwhile: the connection just pooled goes too)
            with self._lock:
                idle, self._idle = self._idle, []
            for c in idle:
                c.close()

    def stream(self, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], bufs: Sequence,
               domain: str) -> StepPutStream | None:
        """A put session for a step's pages, sent layer by layer from ``bufs`` (their memory slots)
        as they fill (:mod:`lmkv.tiers.server_puts`); None where it cannot be: ``remote.stream_stores``
        off, the tier down, more pages than one request names, or :data:`~lmkv.tiers.remote.STREAMS_OPEN`
        (or half the connection pool) streaming."""
        if not self.cfg.stream_stores or not keys or len(keys) > MAX_KEYS or not self.health.up:
            return None
        # (each holds a connection a step long: at most half the pool, lookups and loads need the rest)
        if not self._stream_slot(min(remote.STREAMS_OPEN, self.cfg.max_connections // 2)):
            return None
        opener = server_session(keys, layouts, bufs, domain, self._conn, lambda c: self._arena_offsets(c, bufs),
                                self._layout_msg)
        return StepPutStream(self.name, keys, layouts, bufs, opener, self._call, self.cfg.timeout,
                             self._streamer.submit, self._stream_closed, self.stats)

    @contextmanager
    def _conn(self):
        """A pooled connection; any transport failure drops it and means the server is unreachable."""
        try:
            self._slots.get(timeout=self.cfg.timeout)
        except queue.Empty:
            raise TierBusyError(f"{self.name}: all {self.cfg.max_connections} connections busy") from None
        conn = None
        try:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                conn = self._connect()
            yield conn
        except RemoteError:
            raise  # the server refused this request; the connection is fine
        except (OSError, ProtocolError) as err:
            if conn is not None:
                self._drop(conn)
                conn = None
            raise TierUnavailableError(f"{self.name} {self.host}:{self.port}: {err}") from err
        except BaseException:
            if conn is not None:  # mid-request: the stream may be out of step
                self._drop(conn)
                conn = None
            raise
        finally:
            if conn is not None and conn.via_unix is None and self._unix is not None:
                conn.close()  # a same-host TCP connection retires: the next one shares memory
            elif conn is not None:
                with self._lock:
                    self._idle.append(conn)
            self._slots.put(None)

    def _drop(self, conn: Connection) -> None:
        """A connection given up on mid-request: closed, unless the server may still copy into arena
        slots one of its unanswered requests lent it. Those are quarantined and the connection is
        reaped in the background (:meth:`_reap`): closing it would not stop a server that is merely
        stalled (a paused process, a swap storm), which would copy into the slots once it resumes."""
        lent = conn.lent
        if not lent or self._quarantine is None:
            conn.close()
            return
        fate: Future = Future()
        self._quarantine.hold(lent, fate)
        log.warning("lmkv: %s: gave up on a request whose %d pages the server may still copy into memory; "
                    "holding their slots until it is done", self.name, len(lent))
        threads.start(self._reap, f"lmkv-{self.name}-reap", conn, fate)

    def _reap(self, conn: Connection, fate: Future) -> None:
        """Wait until the server can no longer copy into what ``conn``'s requests lent it, then settle
        ``fate``. This side stops sending (``SHUT_WR``): the server's thread for the connection answers
        what it was sent, reads the end and closes, and a server closes a connection only once its
        copies into that client's memory have stopped; so the connection's end means done, as does
        the server process's exit. A server that never returns keeps the slots held."""
        try:
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # (already broken: the reads below see its end)
            watched: list = [conn.sock] + ([conn.pidfd] if conn.pidfd is not None else [])
            scratch = bytearray(1 << 16)
            conn.sock.settimeout(None)
            while not self._closing.is_set():
                ready = select.select(watched, [], [], 1.0)[0]
                if conn.pidfd is not None and conn.pidfd in ready:
                    break  # the server process is gone
                if conn.sock in ready:
                    try:
                        if conn.sock.recv_into(scratch) == 0:
                            break  # the server closed the connection: its copies have stopped
                    except OSError:
                        break  # reset by the server (or its exit)
            else:
                return  # the tier is closing: the slots stay held (the arena goes with the process)
            fate.set_result(None)
        finally:
            conn.close()

    def _connect(self) -> Connection:
        """A new connection: over the server's Unix socket when it is on this host (shared memory),
        else TCP. A refused HELLO means the server is unavailable to this client."""
        try:
            if self._unix is not None:
                try:
                    return self._open(self._unix)
                except (OSError, ProtocolError):
                    self._unix = None  # a restarted server has another socket: ask over TCP again
            conn = self._open(None)
            if conn.unix is None or not self.wants_arena:
                return conn
            try:
                upgraded = self._open(conn.unix)
            except (OSError, ProtocolError) as err:
                log.info("lmkv: %s: its Unix socket is not usable (%s); staying on TCP", self.name, err)
                return conn
            except RemoteError:  # refused for now (full: this TCP connection holds a slot)
                self._unix = conn.unix  # connections made later go there; this one retires after use
                return conn
            self._unix = conn.unix
            conn.close()
            return upgraded
        except RemoteError as err:
            raise TierUnavailableError(f"{self.name} {self.host}:{self.port} refused the connection: {err}") from err

    def _open(self, unix: UnixEndpoint | None) -> Connection:
        return Connection(self.cfg, self.host, self.port, self.tls, self.namespace, self._arena, unix,
                          self._arena_whole)

    def _layout_msg(self, layout: GroupLayout) -> LayoutMsg:
        msg = self._layouts.get(layout.fingerprint)
        if msg is None:
            msg = self._layouts[layout.fingerprint] = LayoutMsg.of(layout)
        return msg

    # -- primitives ----------------------------------------------------------

    def _ping(self) -> None:
        with self._conn() as c:
            c.call(Op.PING, Empty(), Empty)

    def _exists(self, keys: Sequence[PageKey]) -> list[bool]:
        out: list[bool] = []
        with self._conn() as c:
            for i in range(0, len(keys), MAX_KEYS):
                out += c.call(Op.EXISTS, Keys(list(keys[i : i + MAX_KEYS])), Exists).present
        return out

    def _arena_offsets(self, c: Connection, bufs: Sequence) -> list[int] | None:
        """Offsets of every buffer in the shared arena, if the server mapped it (see
        :func:`~lmkv.tiers.quarantine.lendable`)."""
        return lendable(self._arena.buf, self._quarantine, bufs) if c.arena and self._arena is not None else None

    def _read_into_arena(self, c: Connection, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence,
                         msg: LayoutMsg, wire_ranges: list[tuple[int, int]] | None, dst: list[int],
                         units: Sequence[int], per_page: int) -> list:
        """Pages the server copies straight into the caller's arena slots, asked for in chunks with
        the next :data:`ARENA_AHEAD` chunks' requests already sent: the server copies the next
        chunks while this thread checks chunk k where it landed (one after the other, the check
        would add its whole time to the copy's). The check runs here, not on a thread of its own:
        on two cores, with the server copying on one, a verifier thread waited for a core up to
        half a millisecond after it was handed each chunk, and the requests ahead keep the server
        busy meanwhile anyway."""
        step = max(1, min(MAX_KEYS, ARENA_CHUNK_BYTES // max(1, per_page), -(-len(keys) // ARENA_SPLIT)))
        starts = list(range(0, len(keys), step))

        def ask(i: int) -> None:
            c.send(Op.GET, Get(list[bytes](keys[i : i + step]), msg, wire_ranges, dst=dst[i : i + step]),
                   lent=[(o, layout.payload_bytes) for o in dst[i : i + step]])

        results: list = []
        sent = 0
        for k, i in enumerate(starts):
            while sent < min(k + 1 + ARENA_AHEAD, len(starts)):
                ask(starts[sent])
                sent += 1
            try:
                rep, bulk = c.reply(GetReply)
            except RemoteError:
                for _ in range(sent - k - 1):  # keep the stream in step: requests already sent get answers too
                    try:
                        c.reply(GetReply)
                    except RemoteError:
                        pass
                raise
            if bulk:
                raise ProtocolError(f"unexpected {bulk}-byte bulk in a GET reply")
            if not self.verifies:
                results += rep.headers
                continue
            for j, raw in enumerate(rep.headers):
                results.append(None if raw is None else self._verified(keys[i + j], raw, layout, outs[i + j], units))
        return results

    def _read(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence,
              ranges: Sequence[Range] | None) -> list:
        want, units, per_page, chunks = _read_plan(layout, None if ranges is None else tuple(map(tuple, ranges)))
        msg = self._layout_msg(layout)
        wire_ranges = None if ranges is None else list(want)
        out: list = []
        with self._conn() as c:
            dst = self._arena_offsets(c, outs)
            if dst is not None:  # the server copies straight into the caller's arena slots
                return self._read_into_arena(c, keys, layout, outs, msg, wire_ranges, dst, units, per_page)
            staged = c.window is not None and layout.payload_bytes <= len(c.window)
            if staged:
                step = min(MAX_KEYS, len(c.window) // layout.payload_bytes)
            else:
                step = max(1, min(MAX_KEYS, c.max_bulk // per_page))
            for i in range(0, len(keys), step):
                batch, dsts = list[bytes](keys[i : i + step]), [as_bytes_view(o) for o in outs[i : i + step]]
                c.send(Op.GET, Get(batch, msg, wire_ranges, staged))
                rep, bulk = c.reply(GetReply)
                found = [j for j, h in enumerate(rep.headers) if h is not None]
                if bulk != (0 if staged else len(found) * per_page) or len(rep.headers) != len(batch):
                    raise ProtocolError(f"GET reply of {len(rep.headers)} pages and {bulk} bytes does not match")
                results: list = list(rep.headers)
                for j in found:
                    src = c.window[j * layout.payload_bytes :] if staged else c.reader
                    results[j] = self._land(keys[i + j], rep.headers[j], layout, dsts[j], chunks, src)
                out += results
        return out

    def _land(self, key: PageKey, raw: bytes, layout: GroupLayout, dst: memoryview,
              chunks: Sequence[Chunk], src: SocketReader | np.ndarray) -> bytes | Checked:
        """One page's bytes into ``dst`` from the socket or the staging window (``src``, at the page's
        offsets), chunk by chunk (:func:`~lmkv.page.landing_chunks`), each chunk's units verified as
        soon as it lands, still in cache (with 2 cores, a second thread verifying whole pages
        competed with the receive; a raw receive of whole pages was slower too). A page that fails
        is still read to its end (the stream stays in step) and left for the caller's check to
        count and drop. (Reads into the shared arena are copied by the server, in parallel with
        the check here: see :meth:`_read_into_arena`.)"""
        header = None
        if self.verifies:
            try:
                header = unpack_header(raw, expect_key=key, layout=layout)
            except PageError:
                pass
        ok = header is not None
        for start, end, units in chunks:
            if isinstance(src, SocketReader):
                src.into(dst[start:end])
            else:
                np.copyto(np.frombuffer(dst[start:end], np.uint8), src[start:end])
            if ok and header is not None:
                try:
                    verify_units(header, layout, dst, units)
                except PageError:
                    ok = False
        return Checked(header) if ok and header is not None else raw

    def _write(self, pages: Sequence[tuple[PageHeader, memoryview]], domain: str) -> list[bool]:
        out: list[bool] = []
        sizes = [len(v) for _, v in pages]
        with self._conn() as c:
            src = self._arena_offsets(c, [v for _, v in pages])
            if src is not None:  # the server copies straight from the caller's arena slots
                for r in batches(sizes, remote.PUBLISH_BYTES, MAX_KEYS):  # (the server publishes each PUT)
                    headers = [h.pack() for h, _ in pages[r.start : r.stop]]
                    lent = [(src[i], sizes[i]) for i in r]
                    out += c.call(Op.PUT, Put(headers, domain, src=src[r.start : r.stop]), Stored, lent=lent).stored
                return out
            limit = min(remote.PUBLISH_BYTES, len(c.window) if c.window is not None else c.max_bulk)
            for r in batches(sizes, limit, MAX_KEYS):
                batch = pages[r.start : r.stop]
                size = sum(sizes[i] for i in r)
                headers = [h.pack() for h, _ in batch]
                if c.window is not None and size <= len(c.window):
                    off = 0
                    for _, v in batch:
                        c.window[off : off + len(v)] = np.frombuffer(v, np.uint8)
                        off += len(v)
                    out += c.call(Op.PUT, Put(headers, domain, shm=True), Stored).stored
                else:
                    out += c.call(Op.PUT, Put(headers, domain), Stored, [v for _, v in batch]).stored
        return out

    def _delete(self, keys: Sequence[PageKey]) -> int:
        with self._conn() as c:
            return sum(c.call(Op.DELETE, Keys(list(keys[i : i + MAX_KEYS])), Count).count
                       for i in range(0, len(keys), MAX_KEYS))

    def _clear(self, domain: str) -> int:
        with self._conn() as c:
            return c.call(Op.CLEAR, Clear(domain), Count).count

    def clear_tenant(self, tenant: str) -> int:
        """Drop every page of ``tenant`` (the admin token's right); returns pages deleted."""
        def call() -> int:
            with self._conn() as c:
                return c.call(Op.CLEAR, Clear(tenant=tenant), Count).count
        return self._call(call)

    def _fetch_usage(self) -> tuple[int, int, int]:
        """Bytes used, capacity and pages over the server's tiers (for a tenant: its share of them)."""
        tiers = {n: t for n, t in self._stats().items() if "capacity_bytes" in t}
        return (sum(t.get("used_bytes", 0) for t in tiers.values()),
                sum(t.get("capacity_bytes", 0) for t in tiers.values()),
                max((t.get("pages", 0) for t in tiers.values()), default=0))

    def server_stats(self) -> dict[str, dict[str, int]]:
        """The server's per-tier statistics."""
        return self._call(self._stats)

    def _stats(self):
        with self._conn() as c:
            return c.call(Op.STATS, Empty(), Stats).tiers

    def close(self) -> None:
        super().close()
        self._closing.set()
        self._streamer.shutdown(wait=False)  # (a stream still waiting for its step gives up on its own)
        with self._lock:
            idle, self._idle = self._idle, []
        for c in idle:
            c.close()
