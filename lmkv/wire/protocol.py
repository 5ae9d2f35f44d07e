"""The wire protocol between the lmkv server and its clients.

Every message is a frame::

    offset size field
    0      4    magic b"LKV1"
    4      1    op (requests) / status (replies: 0 ok, 1 error)
    5      3    reserved (0)
    8      4    meta_len   msgpack metadata that follows (<= MAX_META)
    12     8    bulk_len   raw page bytes after the metadata (<= the server's max_bulk)

The metadata is one msgspec ``Struct`` per op, so every field is type-checked
on decode. Bulk bytes are the pages' payloads (or the requested ranges of each
page) back to back in the order of the metadata; they are read with
``recv_into`` straight into their destination, never through a ``bytes`` copy.
Same-host clients may instead name shared-memory windows (:mod:`lmkv.wire.shm_window`):
bulk then travels through them and ``bulk_len`` is 0.

Every length and count read from the peer is bounded before anything is
allocated; a bad frame is an error reply (or, if the framing itself is broken,
a closed connection), never a crash.
"""

from __future__ import annotations

import enum
import functools
import ipaddress
import socket
import ssl
import struct
import time
from collections.abc import Sequence

import msgspec

from lmkv.errors import LMKVError
from lmkv.layout import GroupLayout, Growth, Segment, StateKind
from lmkv.page import MAX_UNITS, as_bytes_view
from lmkv.wire.socket_reader import SocketReader

MAGIC = b"LKV1"
FRAME = struct.Struct("<4sB3xIQ")
FRAME_BYTES = FRAME.size  # 20
MAX_META = 1 << 20
MAX_KEYS = 4096
PROTOCOL_VERSION = 1


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only: a server bound there may run without a token,
    and a client talking to it may offer shared memory."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Op(enum.IntEnum):
    """A request's operation code."""

    HELLO = 1
    EXISTS = 2
    GET = 3
    PUT = 4
    DELETE = 5
    CLEAR = 6
    STATS = 7
    PING = 8
    PUT_OPEN = 9
    PUT_RANGE = 10
    PUT_END = 11
    PUT_ABORT = 12


class ProtocolError(LMKVError):
    """The peer sent something that is not a valid frame; the connection is closed."""


class PeerClosed(ProtocolError):
    """The peer closed the connection between frames (a normal end, not an error)."""


class RemoteError(LMKVError):
    """The server refused a request (the message says why); the connection stays usable."""


# -- metadata ------------------------------------------------------------------


class LayoutMsg(msgspec.Struct, array_like=True, frozen=True):
    """A group layout on the wire (a GET names the layout its pages must have). Frozen, so it is
    hashable: the server maps a message to its layout through a cache keyed by the message."""

    name: str
    kind: str
    num_layers: int
    segments: tuple[tuple[str, int], ...]
    tokens_per_page: int
    dtype: str
    tp_size: int
    tp_rank: int
    tp_replicas: int
    sliding_window: int | None
    growth: str
    pp_size: int = 1
    pp_rank: int = 0

    @classmethod
    def of(cls, lay: GroupLayout) -> LayoutMsg:
        return cls(lay.name, lay.kind.value, lay.num_layers, tuple((s.name, s.nbytes) for s in lay.segments),
                   lay.tokens_per_page, lay.dtype, lay.tp_size, lay.tp_rank, lay.tp_replicas,
                   lay.sliding_window, lay.growth.value, lay.pp_size, lay.pp_rank)

    def layout(self) -> GroupLayout:
        """The layout, validated and bounded (raises ValueError on anything inconsistent); the same
        object for the same message (a connection's GETs name one layout over and over, and a
        layout's derived ranges are computed once)."""
        return _layout(self)


@functools.lru_cache(maxsize=256)
def _layout(m: LayoutMsg) -> GroupLayout:
    """(A message that raises is not cached: a bad one costs its sender each time, not the cache.)"""
    if not 0 < len(m.segments) <= 64 or not 0 < m.num_layers * len(m.segments) <= MAX_UNITS:
        raise ValueError(f"{m.num_layers} layers x {len(m.segments)} segments is out of bounds")
    return GroupLayout(m.name, StateKind(m.kind), m.num_layers, tuple(Segment(n, b) for n, b in m.segments),
                       m.tokens_per_page, m.dtype, m.tp_size, m.tp_rank, m.tp_replicas, m.sliding_window,
                       Growth(m.growth), m.pp_size, m.pp_rank)


class Hello(msgspec.Struct):
    """The first request on a connection. Over a Unix domain socket, ``window`` and ``arena`` say
    that the client's sealed memfds follow the frame (:func:`lmkv.wire.shm_window.send`): a staging
    window for this connection, then its memory tier's arena. Over TCP they are ignored.
    ``arena_whole``: the client maps its arena whole (``memory.prefault``), so the server maps its
    own view of it whole as well, in the background, and its copies there do not fault."""

    version: int
    namespace: str
    token: str | None = None
    window: bool = False
    arena: bool = False
    arena_whole: bool = False


class HelloReply(msgspec.Struct):
    """``shm``/``arena``: whether the server mapped the window / the arena. To a client on its
    host over TCP, the server names its Unix domain socket (an abstract name) and its pid: the
    client checks the pid against the socket's peer credentials before it passes memory there."""

    version: int
    shm: bool
    max_bulk: int
    arena: bool = False
    unix_socket: str | None = None
    pid: int | None = None


class Keys(msgspec.Struct):
    """The keys of an EXISTS or DELETE."""

    keys: list[bytes]


class Exists(msgspec.Struct):
    """EXISTS' answer: per key, whether the server holds it."""

    present: list[bool]


class Get(msgspec.Struct):
    """A GET: pages (or ranges of them) of one layout, into the bulk, the shared window or the client's arena."""

    keys: list[bytes]
    layout: LayoutMsg
    ranges: list[tuple[int, int]] | None = None  # None: whole payloads
    shm: bool = False  # write page i at i * (bytes per page) of the client's window
    dst: list[int] | None = None  # or: write page i at dst[i] of the client's arena


class GetReply(msgspec.Struct):
    """GET's answer: per key, its packed header or ``None`` (missing); found pages' bytes follow."""

    headers: list[bytes | None]  # packed headers; bulk carries the found pages' bytes in order


class Put(msgspec.Struct):
    """A PUT: pages' headers, their payloads in the bulk, the shared window or the client's arena."""

    headers: list[bytes]  # packed headers; bulk (or the window, from 0) carries the payloads in order
    domain: str
    shm: bool = False  # payloads back to back from 0 of the client's window
    src: list[int] | None = None  # or: page i's payload at src[i] of the client's arena


class Stored(msgspec.Struct):
    """PUT's answer: per page, whether it was stored."""

    stored: list[bool]


class PutOpen(msgspec.Struct):
    """A put session: room for a step's pages, filled range by range (``PUT_RANGE``) while the step
    computes them, readable only once ``PUT_END`` gives their headers (``PUT_ABORT``, or the
    connection's end: nothing)."""

    keys: list[bytes]
    layouts: list[LayoutMsg]  # page i's
    domain: str


class Opened(msgspec.Struct):
    """PUT_OPEN's answer: the session's number on this connection; None: no room for the pages."""

    session: int | None


class PutRange(msgspec.Struct):
    """Bytes ``[start, end)`` of the session's pages at ``pages``: from the client's arena at ``src[i]``
    plus ``start`` (each page's payload offset there), or in the bulk, page after page."""

    session: int
    pages: list[int]
    start: int
    end: int
    src: list[int] | None = None


class PutEnd(msgspec.Struct):
    """The session's pages made readable: their packed headers (None: the page is not stored)."""

    session: int
    headers: list[bytes | None]


class PutAbort(msgspec.Struct):
    """The session's pages dropped, none readable."""

    session: int


class Clear(msgspec.Struct):
    """Drop a residency domain of the caller's (``domain``), or, with admin rights, every page of
    the tenant named ``tenant``."""

    domain: str = ""
    tenant: str | None = None


class Count(msgspec.Struct):
    """How many pages a DELETE or CLEAR removed."""

    count: int


class Stats(msgspec.Struct):
    """STATS' answer: per tier (or tenant), its counters and occupancy."""

    tiers: dict[str, dict[str, int]]


class Empty(msgspec.Struct):
    """A request or answer without fields (PING, STATS)."""

    pass


class ErrorReply(msgspec.Struct):
    """A refused request's reason."""

    error: str


REQUESTS: dict[Op, type] = {
    Op.HELLO: Hello, Op.EXISTS: Keys, Op.GET: Get, Op.PUT: Put, Op.DELETE: Keys,
    Op.CLEAR: Clear, Op.STATS: Empty, Op.PING: Empty, Op.PUT_OPEN: PutOpen, Op.PUT_RANGE: PutRange,
    Op.PUT_END: PutEnd, Op.PUT_ABORT: PutAbort,
}
#: keyed by the op's number as it comes off the wire (an ``Op(n)`` per request costs more than the decode)
_decoders: dict[int, tuple[Op, msgspec.msgpack.Decoder]] = {
    int(op): (op, msgspec.msgpack.Decoder(t)) for op, t in REQUESTS.items()
}
_encoder = msgspec.msgpack.Encoder()


def encode(obj) -> bytes:
    return _encoder.encode(obj)


def decode_request(op: int, meta: bytes) -> tuple[Op, msgspec.Struct]:
    """The request's op and its metadata, decoded and type-checked; raises ValueError with the reason."""
    try:
        known, dec = _decoders[op]
    except KeyError:
        raise ValueError(f"unknown op {op}") from None
    try:
        return known, dec.decode(meta)
    except msgspec.DecodeError as e:
        raise ValueError(f"bad {known.name} request: {e}") from None
    except RecursionError:  # metadata nested deeper than any request is
        raise ValueError(f"bad {known.name} request: nested too deeply") from None


def decode_reply(meta: bytes, typ: type):
    try:
        return msgspec.msgpack.decode(meta, type=typ)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"bad reply: {e}") from None


# -- framing --------------------------------------------------------------------


def frame(op_or_status: int, meta: bytes, bulk_len: int = 0) -> bytes:
    return FRAME.pack(MAGIC, op_or_status, len(meta), bulk_len) + meta


#: buffers handed to one ``sendmsg`` at most (the kernel's IOV_MAX is 1024)
IOV_BATCH = 512
#: a send larger than this, on a socket whose calls time out in the kernel, goes through Python's
#: socket timeout instead (:func:`send_buffers`): more than a socket's send buffer holds at once
BULK_SEND = 1 << 20


def send_buffers(sock: socket.socket, buffers: Sequence) -> None:
    """Send ``buffers`` in order in as few system calls as the kernel takes them (``sendmsg``: a
    reply's frame and its pages in one); one buffer (most requests), or over TLS, one ``sendall``
    each. A bulk send on a socket that blocks with a kernel timeout (:func:`block_with_timeout`)
    goes through Python's timeout for its duration, whose ``poll`` wakes once half the send buffer
    is free (a server sending 32 pages of 2 MiB blocking was 20-30% slower)."""
    views = [v for v in map(as_bytes_view, buffers) if len(v)]
    if sock.gettimeout() is not None or sum(map(len, views)) <= BULK_SEND:
        _send(sock, views)
        return
    sec, usec = struct.unpack("ll", sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, 16))
    sock.settimeout(sec + usec / 1e6 if sec or usec else None)
    try:
        _send(sock, views)
    finally:
        sock.settimeout(None)


def _send(sock: socket.socket, views: list[memoryview]) -> None:
    if len(views) == 1 or isinstance(sock, ssl.SSLSocket):
        for v in views:
            sock.sendall(v)
        return
    i = 0
    while i < len(views):
        sent = sock.sendmsg(views[i : i + IOV_BATCH])
        while i < len(views) and sent >= len(views[i]):
            sent -= len(views[i])
            i += 1
        if sent:
            views[i] = views[i][sent:]


def block_with_timeout(sock: socket.socket, seconds: float) -> None:
    """Blocking calls on ``sock`` that each give up after ``seconds`` in the kernel (``SO_RCVTIMEO``,
    ``SO_SNDTIMEO``), where Python's own timeout waits in a ``poll`` before each call: a second
    system call, and a second time the thread lets go of the interpreter lock and waits to take it
    back. ``lmkv serve``'s threads (one a connection) contend for that lock: with kernel timeouts it
    answered 15-25% more one-page 64 KiB GETs from 8 and 64 clients on a 2-core host. (Its clients
    keep Python's timeouts: kernel ones there made 32-page transfers of 2 MiB 20-30% slower in one
    day's runs, and in a later day's changed neither those nor a client's CPU time per small GET.)
    A call that runs out of time raises ``BlockingIOError`` (the socket reader says
    ``TimeoutError``); a bulk send switches to Python's timeout (:func:`send_buffers`)."""
    sock.settimeout(None)
    micros = max(1, round(seconds * 1e6))  # (0 would mean never)
    tv = struct.pack("ll", micros // 1_000_000, micros % 1_000_000)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from the socket; a closed peer mid-way is a ProtocolError. ``deadline`` (a
    ``time.monotonic()`` instant): all of it by then, however the bytes trickle in (``TimeoutError``)."""
    got = 0
    n = len(view)
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{got} of {n} bytes arrived in time")
            sock.settimeout(left)
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise (PeerClosed if got == 0 else ProtocolError)(f"connection closed after {got} of {n} bytes")
        got += k


def _check_frame(magic: bytes, meta_len: int, bulk_len: int, max_bulk: int) -> None:
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not an lmkv peer")
    if meta_len > MAX_META:
        raise ProtocolError(f"metadata of {meta_len} bytes exceeds {MAX_META}")
    if bulk_len > max_bulk:
        raise ProtocolError(f"bulk of {bulk_len} bytes exceeds {max_bulk}")


def read_frame(sock: socket.socket, max_bulk: int) -> tuple[int, bytes, int]:
    """One frame's (op or status, metadata, bulk length); the bulk is left on the socket."""
    head = bytearray(FRAME_BYTES)
    recv_exact(sock, memoryview(head))
    magic, op, meta_len, bulk_len = FRAME.unpack(head)
    _check_frame(magic, meta_len, bulk_len, max_bulk)
    meta = bytearray(meta_len)
    recv_exact(sock, memoryview(meta))
    return op, bytes(meta), bulk_len


def next_frame(reader: SocketReader, max_bulk: int) -> tuple[int, bytes, int]:
    """:func:`read_frame` through a reader: a frame's head and metadata (often with the first
    bytes of its bulk) in one system call."""
    if not reader.unread:
        try:
            reader.fill()
        except ProtocolError:
            raise PeerClosed("connection closed between frames") from None
    magic, op, meta_len, bulk_len = FRAME.unpack(reader.take(FRAME_BYTES))
    _check_frame(magic, meta_len, bulk_len, max_bulk)
    return op, reader.take(meta_len), bulk_len
