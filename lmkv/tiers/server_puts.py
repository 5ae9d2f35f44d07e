"""A step's pages streamed to an lmkv server: the server's put sessions (:mod:`lmkv.tiers.put_stream`).

The stream holds one of the tier's connections for the step's life. ``PUT_OPEN`` reserves room for
the pages in a store session on the server (none readable); each ``PUT_RANGE`` sends a byte range of
some pages: on the same host the server copies it out of the shared arena, across hosts it travels
in the request; ``PUT_END`` gives each page its header (or none: dropped) and publishes the pages at
once. A refused request aborts the session (the connection stays the pool's); a connection given up
on takes its sessions with it on the server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.page import PageHeader
from lmkv.wire.protocol import Empty, LayoutMsg, Op, Opened, PutAbort, PutEnd, PutOpen, PutRange, RemoteError, Stored


class ServerPutTarget:
    """One open put session on one connection (:class:`~lmkv.tiers.put_stream.PutTarget`)."""

    def __init__(self, conn, number: int, bufs: Sequence, src: list[int] | None) -> None:
        """``src``: the pages' arena offsets if the server maps the arena (else bytes travel in requests)."""
        self._c, self._number, self._bufs, self._src = conn, number, bufs, src

    def send(self, pages: list[int], start: int, end: int) -> list[int]:
        """In requests of at most the server's bulk limit; a refusal raises (the stream gives up)."""
        c, src, size = self._c, self._src, end - start
        per = max(1, c.max_bulk // size) if src is None else len(pages)
        for k in range(0, len(pages), per):
            part = pages[k : k + per]
            if src is None:
                c.call(Op.PUT_RANGE, PutRange(self._number, part, start, end), Empty,
                       [self._bufs[i][start:end] for i in part])
            else:
                c.call(Op.PUT_RANGE, PutRange(self._number, part, start, end, [src[i] for i in part]), Empty,
                       lent=[(src[i] + start, size) for i in part])
        return pages

    def end(self, headers: list[PageHeader | None]) -> list[bool]:
        return self._c.call(Op.PUT_END, PutEnd(self._number, [h.pack() if h else None for h in headers]),
                            Stored).stored

    def abort(self) -> None:
        self._c.call(Op.PUT_ABORT, PutAbort(self._number), Empty)


def server_session(keys: Sequence[PageKey], layouts: Sequence[GroupLayout], bufs: Sequence, domain: str,
                   connect: Callable[[], AbstractContextManager[Any]],
                   offsets: Callable[[Any], list[int] | None],
                   layout_msg: Callable[[GroupLayout], LayoutMsg]) -> Callable[[], AbstractContextManager]:
    """The :data:`~lmkv.tiers.put_stream.Opener` of a step's put session: ``connect()``, one of the
    tier's connections (a context manager); ``offsets(conn)``, the pages' arena offsets if the server
    maps the arena; ``layout_msg``, a layout as the protocol names it."""

    @contextmanager
    def opened() -> Iterator[ServerPutTarget | None]:
        with connect() as c:
            src = offsets(c)
            msgs = [layout_msg(lay) for lay in layouts]
            number = c.call(Op.PUT_OPEN, PutOpen([bytes(k) for k in keys], msgs, domain), Opened).session
            if number is None:
                yield None
                return
            target = ServerPutTarget(c, number, bufs, src)
            try:
                yield target
            except RemoteError:  # (refused: the connection stays the pool's, so the session must not)
                target.abort()
                raise

    return opened
