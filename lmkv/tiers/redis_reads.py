"""Redis replies read straight into the buffers pages land in.

redis-py (with hiredis) builds a ``bytes`` object of every reply, which the tier then copies into
the page's buffer: on a P/D consumer's 496 MiB load of 4 MiB pages, layer by layer, the tier
delivered 0.65-0.8 GB/s where redis-py's own pipelines of the same ``GETRANGE`` s reached 1.3 and
one ``GET`` per page 2.1 (loopback, 2 cores). Here the commands go out on one of redis-py's own
pooled connections (its connect, ``AUTH``, TLS and database selection are kept), and each bulk
reply meant for a buffer is received into it with ``recv_into``: the bytes cross from the kernel
once, and nothing the size of a page is allocated.

Replies come back one by one as they are read, so the caller checks a page while the next is still
on its way, and the commands go in chunks with the next chunk already sent while this one's replies
are read: Redis answers it while the caller checks these (one chunk after another, Redis sat idle
through every check and every round trip between chunks).

Only the replies of ``GET`` and ``GETRANGE`` are read, in RESP2 or RESP3 (redis-py 8 speaks RESP3
where the server does): a bulk string, null, or an error. Anything else is a protocol error, and
the connection is dropped, as on any failure mid-read (the stream would be out of step).
"""

from __future__ import annotations

import socket
from collections.abc import Generator, Sequence
from typing import Any

from redis import exceptions as rexc

#: bytes a header line is read with: the line, and then some of the next payload, copied once more
LINE_READ = 4096
#: chunks of commands sent before the replies of the one being read
AHEAD = 1


class _Replies:
    """RESP2 replies from a socket, lines through a small buffer, bulk bodies into the caller's memory."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray(LINE_READ)
        self._view = memoryview(self._buf)
        self._at = self._end = 0  # unread bytes: self._buf[_at:_end]

    def _fill(self) -> None:
        if self._at == self._end:
            self._at = self._end = 0
        elif self._end == len(self._buf):  # (a line longer than the buffer: keep it, grow)
            self._buf[: self._end - self._at] = self._buf[self._at : self._end]
            self._end -= self._at
            self._at = 0
            if self._end == len(self._buf):
                self._buf.extend(bytes(len(self._buf)))
                self._view = memoryview(self._buf)
        n = self._sock.recv_into(self._view[self._end :])
        if n == 0:
            raise rexc.ConnectionError("Redis closed the connection mid-reply")
        self._end += n

    def line(self) -> bytes:
        while True:
            i = self._buf.find(b"\r\n", self._at, self._end)
            if i >= 0:
                out = bytes(self._buf[self._at : i])
                self._at = i + 2
                return out
            self._fill()

    def into(self, dst: memoryview) -> None:
        """Exactly ``len(dst)`` bytes: what is buffered, then straight from the socket."""
        k = min(self._end - self._at, len(dst))
        dst[:k] = self._view[self._at : self._at + k]
        self._at += k
        while k < len(dst):
            n = self._sock.recv_into(dst[k:])
            if n == 0:
                raise rexc.ConnectionError("Redis closed the connection mid-reply")
            k += n

    def reply(self, sink: memoryview | None) -> Any:
        """One reply: ``None`` (nil), a ``ResponseError``, the value's length where it went into
        ``sink`` (or was skipped: not ``len(sink)`` bytes long), else the value as ``bytes``."""
        head = self.line()
        kind, rest = head[:1], head[1:]
        if kind == b"-":
            return rexc.ResponseError(rest.decode(errors="replace"))
        if kind == b"_":  # (RESP3's null)
            return None
        if kind == b"!":  # (RESP3's blob error)
            return rexc.ResponseError(self._body(int(rest)).decode(errors="replace"))
        if kind != b"$":
            raise rexc.InvalidResponse(f"unexpected reply {head[:40]!r} to GET/GETRANGE")
        n = int(rest)
        if n < 0:
            return None
        if sink is None:
            return self._body(n)
        if n == len(sink):
            self.into(sink)
            self._crlf()
        else:
            self._body(n)  # (read aside: the buffer is left as it was)
        return n

    def _body(self, n: int) -> bytes:
        """A bulk body of ``n`` bytes and its CRLF, as ``bytes``."""
        body = bytearray(n)
        self.into(memoryview(body))
        self._crlf()
        return bytes(body)

    def _crlf(self) -> None:
        while self._end - self._at < 2:
            self._fill()
        if self._buf[self._at : self._at + 2] != b"\r\n":
            raise rexc.InvalidResponse("a bulk reply not ended by CRLF")
        self._at += 2


def read_pipelined(pool, chunks: Sequence[Sequence[tuple]],
                   sinks: Sequence[memoryview | None]) -> Generator[Any, None, None]:
    """Send ``chunks`` of commands (``GET``/``GETRANGE``), each in one write, on a connection of
    redis-py's ``pool``, :data:`AHEAD` chunks ahead of the replies being read, and yield each reply
    as it is read, one meant for a buffer read straight into its ``sinks`` entry (``sinks``: one per
    command, in order; see :meth:`_Replies.reply` for what each comes back as). Raises redis-py's
    ``ConnectionError`` / ``TimeoutError`` when the server cannot be reached or stalls past the
    socket timeout. A caller that stops reading early drops the connection (its stream is out of step)."""
    conn = pool.get_connection()
    complete = False
    try:
        sent, at = 0, 0
        replies = None
        for k, chunk in enumerate(chunks):
            while sent < min(k + 1 + AHEAD, len(chunks)):
                conn.send_packed_command(conn.pack_commands(chunks[sent]))
                sent += 1
            if replies is None:  # (redis-py's parser has nothing buffered: its reply reads no more)
                replies = _Replies(conn._sock)
            for _ in chunk:
                yield replies.reply(sinks[at])
                at += 1
        complete = True
    except TimeoutError as err:  # (the socket's timeout: redis-py sets it to remote.timeout)
        raise rexc.TimeoutError(f"Redis did not answer in {conn.socket_timeout} s") from err
    except OSError as err:
        raise rexc.ConnectionError(f"reading from Redis: {err}") from err
    finally:
        if not complete:  # (a failure, or a caller that stopped early: replies may still be coming)
            conn.disconnect()
        pool.release(conn)
