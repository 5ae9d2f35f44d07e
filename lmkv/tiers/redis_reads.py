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

from lmkv.wire.socket_reader import SocketReader

#: bytes a header line is read with: the line, and then some of the next payload, copied once more
LINE_READ = 4096
#: chunks of commands sent before the replies of the one being read
AHEAD = 1


class _Replies:
    """RESP2 replies from a socket: lines through a small buffer, bulk bodies into the caller's memory."""

    def __init__(self, sock: socket.socket) -> None:
        self._in = SocketReader(sock, rexc.ConnectionError, LINE_READ)

    def reply(self, sink: memoryview | None) -> Any:
        """One reply: ``None`` (nil), a ``ResponseError``, the value's length where it went into
        ``sink`` (or was skipped: not ``len(sink)`` bytes long), else the value as ``bytes``."""
        head = self._in.line()
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
            self._in.into(sink)
            self._crlf()
        else:
            self._body(n)  # (read aside: the buffer is left as it was)
        return n

    def _body(self, n: int) -> bytes:
        """A bulk body of ``n`` bytes and its CRLF, as ``bytes``."""
        body = self._in.take(n)
        self._crlf()
        return body

    def _crlf(self) -> None:
        if self._in.take(2) != b"\r\n":
            raise rexc.InvalidResponse("a bulk reply not ended by CRLF")


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
                reply = replies.reply(sinks[at])
                at += 1
                # (in step once the last reply is read: a caller takes exactly its replies and closes
                # the generator there, and a connection dropped then was reconnected on every read)
                complete = at == len(sinks)
                yield reply
    except TimeoutError as err:  # (the socket's timeout: redis-py sets it to remote.timeout)
        raise rexc.TimeoutError(f"Redis did not answer in {conn.socket_timeout} s") from err
    except OSError as err:
        raise rexc.ConnectionError(f"reading from Redis: {err}") from err
    finally:
        if not complete:  # (a failure, or a caller that stopped early: replies may still be coming)
            conn.disconnect()
        pool.release(conn)
