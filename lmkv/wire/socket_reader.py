"""A stream socket read in as few system calls as its bytes arrive in.

Small things (a frame's head and metadata, a reply line) come through a buffer, filled by one
``recv_into`` with whatever has arrived, often a whole request or reply at once; bulk bytes go
from what is buffered, then straight from the socket, into the caller's memory. A one-page
request paid a system call each for its head, its metadata and its bulk: three of them were a
fifth of a 64 KiB GET's cost on loopback.

Everything read from the socket after the reader starts must go through it (it may hold the
next message's first bytes). Used by one thread at a time.
"""

from __future__ import annotations

import socket
import time

#: bytes the buffer starts with: a frame's head and metadata, and the first bytes of its bulk (more of
#: the bulk would be copied twice)
BUFFER_BYTES = 8 << 10


class SocketReader:
    """Buffered reads from ``sock``; a peer that closes mid-read raises ``closed(message)``."""

    def __init__(self, sock: socket.socket, closed: type[Exception], size: int = BUFFER_BYTES) -> None:
        self.sock = sock
        self._closed = closed
        self._size = size
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._at = self._end = 0  # unread bytes: self._buf[_at:_end]

    @property
    def unread(self) -> int:
        """Bytes buffered and not read yet."""
        return self._end - self._at

    def _recv(self, dst: memoryview, deadline: float | None) -> int:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the bytes did not arrive in time")
            self.sock.settimeout(left)
        try:
            n = self.sock.recv_into(dst)
        except BlockingIOError:  # (a blocking socket's kernel timeout: see protocol.block_with_timeout)
            raise TimeoutError("nothing arrived within the socket's timeout") from None
        if n == 0:
            raise self._closed("connection closed mid-message")
        return n

    def fill(self, deadline: float | None = None) -> None:
        """One ``recv`` more into the buffer (moved to its start, or grown, when it is full; back to
        its first size once emptied, so that one large message leaves no large buffer behind)."""
        if self._at == self._end:
            self._at = self._end = 0
            if len(self._buf) > self._size:
                self._view.release()
                self._buf = bytearray(self._size)
                self._view = memoryview(self._buf)
        elif self._end == len(self._buf):
            self._buf[: self._end - self._at] = self._buf[self._at : self._end]
            self._end -= self._at
            self._at = 0
            if self._end == len(self._buf):
                self._view.release()  # (a bytearray with a view on it cannot grow)
                self._buf.extend(bytes(len(self._buf)))
                self._view = memoryview(self._buf)
        self._end += self._recv(self._view[self._end :], deadline)

    def take(self, n: int, deadline: float | None = None) -> bytes:
        """The next ``n`` bytes (for small things: the buffer grows to hold them)."""
        while self._end - self._at < n:
            self.fill(deadline)
        out = bytes(self._view[self._at : self._at + n])
        self._at += n
        return out

    def line(self, sep: bytes = b"\r\n") -> bytes:
        """Bytes up to ``sep``, which is read and dropped."""
        while True:
            i = self._buf.find(sep, self._at, self._end)
            if i >= 0:
                out = bytes(self._buf[self._at : i])
                self._at = i + len(sep)
                return out
            self.fill()

    def into(self, dst: memoryview, deadline: float | None = None) -> None:
        """Exactly ``len(dst)`` bytes into ``dst``: what is buffered, then straight from the socket."""
        k = min(self._end - self._at, len(dst))
        if k:
            dst[:k] = self._view[self._at : self._at + k]
            self._at += k
        while k < len(dst):
            k += self._recv(dst[k:], deadline)

    def skip(self, n: int) -> None:
        """Read and drop ``n`` bytes."""
        k = min(self._end - self._at, n)
        self._at += k
        if k < n:
            self._at = self._end = 0
            n -= k
            while n:
                n -= self._recv(self._view[: min(n, len(self._buf))], None)
