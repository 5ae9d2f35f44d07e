"""One connection to ``lmkv serve``: its requests, answered in order by the thread that serves it.

- Tenants (:mod:`lmkv.serve.tenants`): a token is a tenant; the namespace a client names in
  ``HELLO`` must be one its token was granted. Every key it sends is qualified by that
  namespace before it touches a tier, and the page header is re-keyed both ways, so one
  tenant's keys can never name another's pages. Residency domains are qualified by tenant and
  namespace (too long: refused, not cut); a PUT's new domains count against the tenant's cap.
- Bulk bytes go from the socket straight into memory-tier slots reserved for them, and from
  those slots straight to the socket; a Unix-socket client may pass sealed memfds
  (:mod:`lmkv.wire.shm_window`), whose memory the bytes cross instead. No path a client sends
  is ever opened.
- Bounds: every length and count a client sends is bounded before anything is allocated; a
  malformed request gets an error reply, a broken frame closes this connection only.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import xxhash

from lmkv.config import LMKVConfig
from lmkv.domains import check_namespace, qualified
from lmkv.errors import PageError, TierFullError
from lmkv.keys import KEY_BYTES, PageKey
from lmkv.layout import GroupLayout, Segment, StateKind
from lmkv.page import PageHeader, packed_as, rekey, units_in_ranges, unpack_header
from lmkv.serve.admission import AuthFailures
from lmkv.serve.arenas import ArenaId, Arenas
from lmkv.serve.tenants import Counters, Tenant, Tenants
from lmkv.store import StoreSession, TieredStore
from lmkv.wire import shm_window
from lmkv.wire.protocol import (
    MAX_KEYS,
    PROTOCOL_VERSION,
    Count,
    Empty,
    ErrorReply,
    Exists,
    GetReply,
    HelloReply,
    Op,
    Opened,
    PeerClosed,
    ProtocolError,
    Stats,
    Stored,
    block_with_timeout,
    decode_request,
    encode,
    frame,
    next_frame,
    read_frame,
    send_buffers,
)
from lmkv.wire.socket_reader import SocketReader

log = logging.getLogger(__name__)


class Host(Protocol):
    """What a connection needs of the server that accepted it (:class:`lmkv.serve.server.Server`)."""

    cfg: LMKVConfig
    store: TieredStore
    tenants: Tenants
    counters: dict[str, Counters]
    stopping: threading.Event
    auth_failures: AuthFailures
    shm_uids: set[int]
    unix_name: str | None
    arenas: Arenas

    def admit(self, client: Client) -> None: ...

    def stats(self, tenant: Tenant | None) -> dict[str, dict[str, int]]: ...


def opaque_layout(header: PageHeader) -> GroupLayout:
    """What the server needs to reserve room for a page it stores but never interprets: its size.

    Reads name the real layout (the client sends it with GET), and the stored header keeps
    the real layout's fingerprint, so a page is only ever served as the layout it was made for.
    """
    return GroupLayout("opaque", StateKind.FULL_ATTENTION, 1, (Segment("payload", header.payload_len),), 1, "uint8")


#: put sessions one connection may hold open at once (a step's, and the next one's while it ends)
MAX_OPEN_PUTS = 4


@dataclass
class OpenPut:
    """A put session (``PUT_OPEN``): the pages' room in a store session, filled by ``PUT_RANGE``."""

    keys: list[bytes]  # as the client names them
    layouts: list[GroupLayout]
    session: StoreSession


class Refused(Exception):
    """A request the server answers with an error reply (the connection stays open)."""


def _check_keys(keys: list[bytes]) -> None:
    if len(keys) > MAX_KEYS:
        raise Refused(f"{len(keys)} keys in one request; at most {MAX_KEYS}")
    for k in keys:
        if len(k) != KEY_BYTES:
            raise Refused(f"a key has {KEY_BYTES} bytes, got {len(k)}")


class Client:
    """One connected client: its namespace, its shared-memory window, its requests.

    Served by one thread (:meth:`serve`), which alone copies into and out of the client's shared
    memory and closes the connection. A client that gave up on a request learns that the copies
    have stopped from the connection's end (:meth:`lmkv.tiers.server_client.ServerTier._reap`), so
    anyone else who ends it (:meth:`Server.stop`) first revokes the copies (:meth:`revoke`).
    """

    def __init__(self, server: Host, sock: socket.socket, peer: str, origin: str, pending_key: int,
                 unix_uid: int | None = None, local: bool = False) -> None:
        """``origin``: what admission counts it under (its address, or its uid locally); ``unix_uid``:
        the peer's uid (kernel-checked) when it came over the Unix domain socket; ``local``: a TCP
        peer on this host (it is told where that socket is)."""
        self.server = server
        self.sock = sock
        self.peer = peer
        self.origin = origin
        self.pending_key = pending_key  # (the server's key for it while it is not authenticated)
        self.authenticated = False
        self.unix_uid = unix_uid
        self.local = local
        self.tenant: Tenant | None = None
        self.ns_seed: bytes | None = None
        self.ns_tag = ""
        self.window: np.ndarray | None = None  # the connection's staging window
        self.arena: np.ndarray | None = None  # the client's memory-tier arena
        self._arena_id: ArenaId | None = None  # (the server's mapping of it, shared by its connections)
        self._maps: list[mmap.mmap] = []
        #: held around every copy into or out of the client's shared memory; ``revoked`` under it
        self._copying = threading.Lock()
        self._puts: dict[int, OpenPut] = {}  # put sessions open on this connection, by number
        self._armed: float | None = None  # the socket's timeout in the kernel (:meth:`arm_timeout`)
        self._put_numbers = itertools.count(1)
        self._revoked = False
        #: requests after HELLO come through a buffer (HELLO itself is read exactly: the descriptors
        #: a Unix-socket client passes after it must not be read as plain bytes)
        self._reader = SocketReader(sock, ProtocolError)

    def revoke(self) -> None:
        """From another thread: no copy into or out of the client's shared memory starts after this
        returns, and none is running (the connection may then be ended)."""
        with self._copying:
            self._revoked = True

    @contextmanager
    def _shared(self) -> Iterator[None]:
        """Around copies into or out of shared memory: refuses the request once revoked."""
        with self._copying:
            if self._revoked:
                raise Fatal("the server is stopping")
            yield

    # -- helpers ---------------------------------------------------------------

    def inner(self, key: bytes) -> PageKey:
        """The server-side key: the client's key qualified by its namespace."""
        assert self.ns_seed is not None
        return PageKey(xxhash.xxh3_128_digest(self.ns_seed + key))

    def domain(self, name: str) -> str:
        """The client's residency domain qualified by its tenant and namespace (too long: refused)."""
        try:
            return qualified(self.ns_tag, name)
        except ValueError as e:
            raise Refused(str(e)) from None

    def owned_domain(self, name: str) -> str:
        """A domain a PUT gives pages to: a new one only within the tenant's cap on live domains
        (they are forgotten with their last page, so a cleared domain frees its place)."""
        domain = self.domain(name)
        assert self.tenant is not None
        live = self.server.store.domains(self.tenant.tag)
        cap = self.tenant.quota.domains
        if domain not in live and len(live) >= cap:
            raise Refused(f"tenant {self.tenant.name!r} has {len(live)} residency domains owning pages, its "
                           f"quota (quota.domains = {cap}); clear one first")
        return domain

    @property
    def counters(self) -> Counters:
        assert self.tenant is not None
        return self.server.counters[self.tenant.name]

    def reply(self, obj, bulk_len: int = 0) -> None:
        self.sock.sendall(frame(0, encode(obj), bulk_len))

    def error(self, message: str) -> None:
        self.sock.sendall(frame(1, encode(ErrorReply(message))))

    # -- the loop ----------------------------------------------------------------

    def serve(self) -> None:
        store = self.server.store
        max_bulk = int(self.server.cfg.server.max_bulk)
        try:
            while not self.server.stopping.is_set():
                try:
                    if self.tenant is None:
                        op, meta, bulk = read_frame(self.sock, max_bulk)
                    else:
                        op, meta, bulk = next_frame(self._reader, max_bulk)
                except PeerClosed:
                    return  # the client hung up between requests
                except (ProtocolError, OSError) as e:
                    log.info("lmkv serve: %s: %s; closing its connection", self.peer, e)
                    try:
                        self.error(str(e))
                    except OSError:
                        pass
                    return
                try:
                    known, req = decode_request(op, meta)
                    if self.tenant is None and known is not Op.HELLO:
                        raise Refused("the first request must be HELLO")
                    if known in PAGE_OPS and self.ns_seed is None:
                        raise Refused("the admin token grants stats and clears, not pages")
                    self.handle(known, req, bulk, store)
                except (Refused, ValueError) as e:  # refused before its bulk was read: drop the bulk
                    if bulk:
                        self._reader.skip(bulk)
                    self.error(str(e))
                    if isinstance(e, Fatal):
                        return
        except (ProtocolError, OSError) as e:
            log.info("lmkv serve: %s: %s; closing its connection", self.peer, e)
        finally:
            self.close()

    def handle(self, op: Op, req, bulk: int, store: TieredStore) -> None:
        if op is Op.HELLO:
            self.hello(req)
        elif op is Op.PING:
            self.reply(Empty())
        elif op is Op.EXISTS:
            _check_keys(req.keys)
            self.reply(Exists(store.contains([self.inner(k) for k in req.keys])))
        elif op is Op.GET:
            self.get(req, store)
        elif op is Op.PUT:
            self.put(req, bulk, store)
        elif op is Op.PUT_OPEN:
            self.put_open(req, store)
        elif op is Op.PUT_RANGE:
            self.put_range(req, bulk)
        elif op is Op.PUT_END:
            self.put_end(req)
        elif op is Op.PUT_ABORT:
            self._close_put(req.session).session.abort()
            self.reply(Empty())
        elif op is Op.DELETE:
            _check_keys(req.keys)
            self.reply(Count(store.delete([self.inner(k) for k in req.keys])))
        elif op is Op.CLEAR:
            self.reply(Count(self.clear(req, store)))
        elif op is Op.STATS:
            assert self.tenant is not None
            self.reply(Stats(self.server.stats(None if self.tenant.admin else self.tenant)))

    def clear(self, req, store: TieredStore) -> int:
        """One of the caller's domains, or (admin) every page of a tenant."""
        assert self.tenant is not None
        if req.tenant is None:
            if self.ns_seed is None:
                raise Refused("name the tenant to clear (the admin token holds no domains)")
            return store.clear(self.domain(req.domain))
        if not self.tenant.admin:
            raise Refused("clearing a tenant needs the admin token")
        target = self.server.tenants.by_name(req.tenant)
        if target is None:
            raise Refused(f"no tenant {req.tenant!r}")
        log.warning("lmkv serve: %s clears every page of tenant %r", self.peer, target.name)
        return sum(store.clear(d) for d in store.domains(target.tag))

    def hello(self, req) -> None:
        cfg = self.server.cfg.server
        if self.tenant is not None:
            raise Fatal("HELLO twice on one connection")
        if req.version != PROTOCOL_VERSION:
            raise Fatal(f"protocol version {req.version}; this server speaks {PROTOCOL_VERSION}")
        tenant = self.server.tenants.authenticate(req.token)
        if tenant is None:
            time.sleep(self.server.auth_failures.failed(self.origin, "wrong token" if req.token else "no token"))
            raise Fatal("authentication failed")
        try:
            check_namespace(req.namespace)
        except ValueError as e:
            raise Fatal(str(e)) from None
        if tenant.holds_pages:
            if not tenant.grants(req.namespace):
                log.warning("lmkv serve: %s: tenant %r may not use namespace %r", self.peer, tenant.name,
                            req.namespace)
                raise Fatal(f"namespace {req.namespace!r} is not granted to this token")
            self.ns_seed = xxhash.xxh3_128_digest(b"lmkv-ns\0" + req.namespace.encode())
            self.ns_tag = f"{tenant.tag}.{xxhash.xxh3_64_hexdigest(req.namespace.encode())[:12]}"
        self.tenant = tenant
        if self.unix_uid is not None:
            self.window, self.arena = self.receive_windows(req.window, req.arena, req.arena_whole)
        self.server.admit(self)
        unix = self.server.unix_name if self.local else None
        self.reply(HelloReply(PROTOCOL_VERSION, self.window is not None, int(cfg.max_bulk), self.arena is not None,
                              unix, os.getpid() if unix else None))

    def receive_windows(self, window: bool, arena: bool,
                        arena_whole: bool = False) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Map the sealed memfds a Unix-socket client passed after HELLO (its staging window, its
        arena: mapped once for all its connections, :mod:`lmkv.serve.arenas`), if its uid may share
        memory; each one that fails the checks is closed unmapped and its bytes go over the socket.
        Only descriptors are ever mapped, never a path."""
        arena_at = [is_arena for is_arena, passed in ((False, window), (True, arena)) if passed]
        if not arena_at:
            return None, None
        try:
            fds = shm_window.receive(self.sock, len(arena_at))
        except ValueError as e:
            raise Fatal(str(e)) from None
        allowed = self.unix_uid in self.server.shm_uids
        if not allowed:
            log.info("lmkv serve: %s: uid %s may not share memory (server.shm_uids); using the socket",
                     self.peer, self.unix_uid)
        mapped: list[np.ndarray | None] = []
        for fd, is_arena in zip(fds, arena_at):
            if not allowed:
                os.close(fd)
                mapped.append(None)
                continue
            max_bytes = int(self.server.cfg.server.max_shm)
            try:
                if is_arena:
                    self._arena_id, buf = self.server.arenas.attach(fd, max_bytes, arena_whole)
                else:
                    m, buf = shm_window.attach(fd, max_bytes)
                    self._maps.append(m)
            except (ValueError, OSError) as e:
                log.info("lmkv serve: %s: not mapping a window it passed (%s)", self.peer, e)
                mapped.append(None)
                continue
            mapped.append(buf)
        it = iter(mapped)
        return (next(it) if window else None), (next(it) if arena else None)

    def destinations(self, req, page_bytes: int) -> tuple[np.ndarray, list[int]] | None:
        """Where a GET's pages go in shared memory (the arena at ``dst``, or the window in order),
        every page bounds-checked; None: over the socket."""
        if req.dst is not None:
            mem, offsets = self.arena, req.dst
            if mem is None:
                raise Refused("no shared arena on this connection")
            if len(offsets) != len(req.keys):
                raise Refused("dst: one offset per key")
        elif req.shm:
            mem, offsets = self.window, [i * page_bytes for i in range(len(req.keys))]
            if mem is None:
                raise Refused("no shared-memory window on this connection")
        else:
            return None
        if any(not 0 <= o <= len(mem) - page_bytes for o in offsets):
            raise Refused(f"a page does not fit the {len(mem)}-byte shared region")
        return mem, offsets

    def get(self, req, store: TieredStore) -> None:
        _check_keys(req.keys)
        try:
            layout = req.layout.layout()
        except ValueError as e:
            raise Refused(f"bad layout: {e}") from None
        max_bulk = int(self.server.cfg.server.max_bulk)
        if layout.payload_bytes > max_bulk:
            raise Refused(f"a page of {layout.payload_bytes} bytes exceeds max_bulk {max_bulk}")
        if req.ranges is None:
            ranges = [(0, layout.payload_bytes)]
        else:
            ranges = [tuple(r) for r in req.ranges]
            units_in_ranges(layout, ranges)  # ValueError -> refused: ranges must be whole units
        dst = self.destinations(req, layout.payload_bytes)
        per_page = sum(b - a for a, b in ranges)
        # A layerwise load reads each page in several ranged GETs, layer order: one read, one access
        # (counted as many, a page read once looks hot to S3-FIFO and outlives pages not read yet).
        fetched = store.fetch([self.inner(k) for k in req.keys], layout, count=any(a == 0 for a, _ in ranges))
        with fetched:
            headers: list[bytes | None] = []
            found = []
            for i, (k, v, h) in enumerate(zip(req.keys, fetched.views, fetched.headers)):
                if v is None or h is None:
                    headers.append(None)
                    continue
                headers.append(packed_as(h, k))
                found.append((i, v))
            counters = self.counters
            counters.hits += len(found)
            counters.misses += len(req.keys) - len(found)
            counters.get_bytes += len(found) * per_page
            if dst is not None:
                mem, offsets = dst
                with self._shared():
                    for i, v in found:
                        base = offsets[i]
                        for a, b in ranges:
                            mem[base + a : base + b] = v[a:b]
                self.reply(GetReply(headers))
                return
            if len(found) * per_page > max_bulk:
                raise Refused(f"reply of {len(found) * per_page} bytes exceeds max_bulk {max_bulk}")
            send_buffers(self.sock, [frame(0, encode(GetReply(headers)), len(found) * per_page),
                                     *(v[a:b] for _, v in found for a, b in ranges)])

    def sources(self, req, headers: list[PageHeader]) -> tuple[np.ndarray, list[int]] | None:
        """Where a PUT's payloads are in shared memory, bounds-checked; None: in the bulk."""
        sizes = [h.payload_len for h in headers]
        if req.src is not None:
            mem, offsets = self.arena, req.src
            if mem is None:
                raise Refused("no shared arena on this connection")
            if len(offsets) != len(headers):
                raise Refused("src: one offset per page")
        elif req.shm:
            mem = self.window
            if mem is None:
                raise Refused("no shared-memory window on this connection")
            offsets = [0, *itertools.accumulate(sizes)][:-1]
        else:
            return None
        if any(not 0 <= o <= len(mem) - n for o, n in zip(offsets, sizes)):
            raise Refused(f"a page lies outside the {len(mem)}-byte shared region")
        return mem, offsets

    def put(self, req, bulk: int, store: TieredStore) -> None:
        _check_keys([b"\0" * KEY_BYTES] * len(req.headers))
        try:
            headers = [unpack_header(h) for h in req.headers]
        except PageError as e:
            raise Refused(f"bad page header: {e}") from None
        lays = [opaque_layout(h) for h in headers]
        total = sum(h.payload_len for h in headers)
        src = self.sources(req, headers)
        if src is not None and bulk:
            raise Refused("pages in shared memory and a bulk as well")
        if src is None and bulk != total:
            raise Refused(f"bulk of {bulk} bytes; the headers describe {total}")
        inner = [rekey(h, self.inner(h.key)) for h in headers]
        domain = self.owned_domain(req.domain)
        try:
            session = store.open_session([h.key for h in inner], lays, domain)
        except TierFullError:
            self._reader.skip(bulk)
            self.counters.refused += len(headers)
            self.reply(Stored([False] * len(headers)))
            return
        # The pages' room is reserved now: they must arrive soon, or the reservation is dropped
        # (the connection with it) instead of holding room for the idle timeout.
        deadline = time.monotonic() + self.server.cfg.server.payload_timeout
        with session:
            if src is not None:
                mem, offsets = src
                with self._shared():
                    for i, h in enumerate(headers):
                        session.buffer(i)[:] = mem[offsets[i] : offsets[i] + h.payload_len]
            else:
                for i in range(len(headers)):
                    self._reader.into(memoryview(session.buffer(i)), deadline)
            stored = session.commit(inner)
        self.arm_timeout()
        self._count_stored(headers, stored)
        self.reply(Stored(stored))

    def _count_stored(self, headers: list[PageHeader], stored: list[bool]) -> None:
        counters = self.counters
        counters.puts += sum(stored)
        counters.put_bytes += sum(h.payload_len for h, ok in zip(headers, stored) if ok)
        counters.refused += len(stored) - sum(stored)

    def arm_timeout(self) -> None:
        """While a put session is open its client has ``payload_timeout`` between requests (its room is
        reserved: a client that went quiet loses the session with the connection, not after the idle
        timeout); otherwise ``idle_timeout``. Each call on the socket gives up in the kernel
        (:func:`~lmkv.wire.protocol.block_with_timeout`), set again only when it changes."""
        cfg = self.server.cfg.server
        want = cfg.payload_timeout if self._puts else cfg.idle_timeout
        if want != self._armed or self.sock.gettimeout() is not None:  # (a read with a deadline sets one)
            block_with_timeout(self.sock, want)
            self._armed = want

    # -- put sessions: a step's pages streamed as they are computed ---------------

    def put_open(self, req, store: TieredStore) -> None:
        _check_keys(req.keys)
        if len(req.layouts) != len(req.keys):
            raise Refused("PUT_OPEN: one layout per key")
        if len(self._puts) >= MAX_OPEN_PUTS:
            raise Refused(f"{MAX_OPEN_PUTS} put sessions open on this connection already")
        try:
            lays = [m.layout() for m in req.layouts]
        except ValueError as e:
            raise Refused(f"bad layout: {e}") from None
        max_bulk = int(self.server.cfg.server.max_bulk)
        if any(lay.payload_bytes > max_bulk for lay in lays):
            raise Refused(f"a page exceeds max_bulk {max_bulk}")
        domain = self.owned_domain(req.domain)
        try:
            session = store.open_session([self.inner(k) for k in req.keys], lays, domain)
        except TierFullError:
            self.counters.refused += len(req.keys)
            self.reply(Opened(None))
            return
        number = next(self._put_numbers)
        self._puts[number] = OpenPut(list(req.keys), lays, session)
        self.arm_timeout()
        self.reply(Opened(number))

    def _open_put(self, number: int) -> OpenPut:
        put = self._puts.get(number)
        if put is None:
            raise Refused(f"no put session {number} on this connection")
        return put

    def _close_put(self, number: int) -> OpenPut:
        """The session, no longer open on this connection (ended or aborted by the caller)."""
        put = self._open_put(number)
        del self._puts[number]
        self.arm_timeout()
        return put

    def put_range(self, req, bulk: int) -> None:
        put = self._open_put(req.session)
        n = len(put.keys)
        if not req.pages or len(req.pages) > n or any(not 0 <= i < n for i in req.pages):
            raise Refused(f"PUT_RANGE: pages out of the session's {n}")
        start, end = req.start, req.end
        if any(not 0 <= start < end <= put.layouts[i].payload_bytes for i in req.pages):
            raise Refused(f"PUT_RANGE: [{start}, {end}) lies outside a page")
        size = end - start
        if req.src is None:
            if bulk != size * len(req.pages):
                raise Refused(f"bulk of {bulk} bytes; the range describes {size * len(req.pages)}")
            deadline = time.monotonic() + self.server.cfg.server.payload_timeout
            for i in req.pages:
                self._reader.into(memoryview(put.session.buffer(i)[start:end]), deadline)
            self.arm_timeout()
        else:
            mem = self.arena
            if mem is None:
                raise Refused("no shared arena on this connection")
            if bulk or len(req.src) != len(req.pages):
                raise Refused("src: one offset per page, and no bulk")
            if any(o < 0 or o + end > len(mem) for o in req.src):
                raise Refused(f"a range lies outside the {len(mem)}-byte shared region")
            with self._shared():
                for i, o in zip(req.pages, req.src):
                    put.session.buffer(i)[start:end] = mem[o + start : o + end]
        self.reply(Empty())

    def put_end(self, req) -> None:
        put = self._close_put(req.session)
        with put.session:  # (refused: every page dropped)
            if len(req.headers) != len(put.keys):
                raise Refused("PUT_END: one header (or none) per page")
            headers: list[PageHeader | None] = []
            for raw, key, lay in zip(req.headers, put.keys, put.layouts):
                if raw is None:
                    headers.append(None)
                    continue
                try:
                    h = unpack_header(raw)
                except PageError as e:
                    raise Refused(f"bad page header: {e}") from None
                if h.key != key or h.layout_fp != lay.fingerprint or h.payload_len != lay.payload_bytes:
                    raise Refused("PUT_END: a header is not its page's (key, layout or size)")
                headers.append(h)
            stored = put.session.commit([None if h is None else rekey(h, self.inner(h.key)) for h in headers])
        given = [(h, ok) for h, ok in zip(headers, stored) if h is not None]  # (pages left out: not refused)
        self._count_stored([h for h, _ in given], [ok for _, ok in given])
        self.reply(Stored(stored))

    def close(self) -> None:
        for put in self._puts.values():  # (never ended: none of their pages become readable)
            put.session.abort()
        self._puts.clear()
        self.window = self.arena = None
        if self._arena_id is not None:
            self.server.arenas.release(self._arena_id)
            self._arena_id = None
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view is still alive in a reply being torn down; the mapping goes with it
                pass
        self._maps = []
        try:
            self.sock.close()
        except OSError:
            pass


class Fatal(Refused):
    """Refused, and the connection is closed (failed authentication, wrong protocol)."""


#: requests that touch pages: only a token granted namespaces may send them
PAGE_OPS = {Op.EXISTS, Op.GET, Op.PUT, Op.DELETE, Op.PUT_OPEN, Op.PUT_RANGE, Op.PUT_END, Op.PUT_ABORT}


