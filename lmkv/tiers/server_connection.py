"""One connection to ``lmkv serve``: authenticated, over TCP (TLS optional) or, on the server's
host, its Unix socket with shared memory.

Over the Unix socket the connection passes a sealed staging window of its own and, when the
store shares it, the memory tier's arena (:mod:`lmkv.wire.shm_window`), after checking that the
socket's peer is the process that answered on the TCP port. It remembers every request sent
and the arena ranges the request lent the server until its reply is read, so a tier that gives
up on it knows what the server may still copy into (:mod:`lmkv.tiers.quarantine`).
"""

from __future__ import annotations

import os
import socket
import ssl
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lmkv.config import RemoteConfig
from lmkv.page import as_bytes_view
from lmkv.wire import shm_window
from lmkv.wire.protocol import (
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    HelloReply,
    Op,
    ProtocolError,
    RemoteError,
    decode_reply,
    encode,
    frame,
    next_frame,
    send_buffers,
)
from lmkv.wire.socket_reader import SocketReader


@dataclass(frozen=True)
class UnixEndpoint:
    """The server's Unix domain socket, and the pid that must be listening on it."""

    name: str
    pid: int


class Connection:
    """One authenticated connection, with its staging window and the shared arena on the server's host.

    Used by one thread at a time (the tier's pool hands it out). Every request sent is remembered
    with the arena slots it lends the server until its reply has been read (:attr:`lent`).
    """

    def __init__(self, cfg: RemoteConfig, host: str, port: int, tls: bool, namespace: str,
                 arena: shm_window.Window | None = None, unix: UnixEndpoint | None = None,
                 arena_whole: bool = False) -> None:
        """Over TCP to ``host:port``, or over ``unix`` (then with shared memory). ``arena_whole``: the
        arena is mapped whole in this process (the server then maps its view of it whole too)."""
        self.window: np.ndarray | None = None  # this connection's staging window
        self.arena = False  # whether the server mapped the shared arena
        self.unix: UnixEndpoint | None = None  # where the server takes same-host connections
        self.via_unix = unix  # the socket this connection went over (None: TCP)
        self.pidfd: int | None = None  # the server process, on its host: readable once it has exited
        #: per request sent and not answered yet, the arena ranges (offset, bytes) it lent the server
        self._unanswered: deque[list[tuple[int, int]]] = deque()
        self._win: shm_window.Window | None = None
        sock = open_socket(cfg, host, port, tls, unix)
        try:
            self.sock = sock
            self.reader = SocketReader(sock, ProtocolError)  # (replies: the server sends no descriptors)
            self.max_bulk = 1 << 20
            shared: list[shm_window.Window] = []
            if unix is not None:
                try:
                    self._win = shm_window.create(int(cfg.shm_size))
                    shared.append(self._win)
                except OSError:
                    self._win = None
                if arena is not None:
                    shared.append(arena)
            hello = Hello(PROTOCOL_VERSION, namespace, cfg.token, window=self._win is not None,
                          arena=unix is not None and arena is not None, arena_whole=arena_whole)
            self.send(Op.HELLO, hello)
            shm_window.send(sock, shared)
            rep, bulk = self.reply(HelloReply)
            if bulk:
                raise ProtocolError(f"unexpected {bulk}-byte bulk in a HELLO reply")
            self.max_bulk = rep.max_bulk
            self.arena = rep.arena
            if rep.unix_socket and rep.pid:
                self.unix = UnixEndpoint(rep.unix_socket, rep.pid)
            if rep.shm and self._win is not None:
                self.window = self._win.buf
            elif self._win is not None:
                self._win.close()
                self._win = None
            if unix is not None and self.arena:
                try:
                    self.pidfd = os.pidfd_open(unix.pid)
                except OSError:  # (gone already, or no pidfds here: its replies and hang-up still tell)
                    self.pidfd = None
        except BaseException:
            sock.close()
            if self._win is not None:
                self._win.close()
            raise

    @property
    def lent(self) -> list[tuple[int, int]]:
        """The arena ranges lent to requests whose replies have not been read."""
        return [r for ranges in self._unanswered for r in ranges]

    def send(self, op: Op, meta, bulks: Sequence = (), lent: Sequence[tuple[int, int]] = ()) -> None:
        """A request; ``lent``: the arena ranges ``(offset, bytes)`` it names for the server to copy
        into or out of (a GET's ``dst``, a PUT's ``src``)."""
        self._unanswered.append(list(lent))
        views = [as_bytes_view(b) for b in bulks]
        send_buffers(self.sock, [frame(op, encode(meta), sum(len(v) for v in views)), *views])

    def reply(self, typ: type):
        """(reply, bulk length left on the socket); an error reply raises RemoteError."""
        status, meta, bulk = next_frame(self.reader, self.max_bulk)
        self._unanswered.popleft()  # (the server answers in order, after its copies)
        if status != 0:
            raise RemoteError(decode_reply(meta, ErrorReply).error)
        return decode_reply(meta, typ), bulk

    def call(self, op: Op, meta, typ: type, bulks: Sequence = (), lent: Sequence[tuple[int, int]] = ()):
        self.send(op, meta, bulks, lent)
        rep, bulk = self.reply(typ)
        if bulk:
            raise ProtocolError(f"unexpected {bulk}-byte bulk in a {op.name} reply")
        return rep

    def close(self) -> None:
        self.window = None
        try:
            self.sock.close()
        except OSError:
            pass
        if self._win is not None:
            self._win.close()
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def open_socket(cfg: RemoteConfig, host: str, port: int, tls: bool, unix: UnixEndpoint | None) -> socket.socket:
    """A connected socket: to ``unix`` (checking that its peer is the server's pid), or TCP."""
    if unix is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(cfg.connect_timeout)
            sock.connect(unix.name)
            pid = shm_window.peer_credentials(sock)[0]
            if pid != unix.pid:
                raise ProtocolError(f"the server's Unix socket is held by pid {pid}, not {unix.pid}")
            sock.settimeout(cfg.timeout)
        except BaseException:
            sock.close()
            raise
        return sock
    sock = socket.create_connection((host, port), timeout=cfg.connect_timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(cfg.timeout)
        if tls:
            ctx = ssl.create_default_context(cafile=cfg.tls_ca)
            if not cfg.tls_verify:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            sock = ctx.wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise
    return sock
