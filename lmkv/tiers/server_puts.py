"""A step's pages streamed to an lmkv server while the step computes them: one put session per step.

When a step opens its store session, a put session is opened on one of the tier's connections
(``PUT_OPEN``: the server reserves room for the pages; nothing is readable). As each layer lands
in the pages' memory-tier slots, that layer's range of every page goes to the server
(``PUT_RANGE``) while the later layers compute: on the same host the server copies it out of the
shared arena, across hosts it travels in the request. When the step commits, the headers go
(``PUT_END``) and the pages are readable at once: the step's write-through has nothing left to
move, so a decode engine waiting for a prefill engine's pages finds them as the prefill answers
(measured before this, on 2 cores: 62 pages of 4 MiB reached the server 0.2-0.6 s after their
step committed).

A page is ended only if every range of it was sent from the slot it was gathered into, and that
slot is still its page's at the commit (pinned from then on, not a twin another writer published
first); the server drops the others, and they are written through whole after the commit like
any page of a tier that takes no stream. So does every page of a stream that fails: a refused
request, the server gone or slower than ``remote.timeout``, no word from the step for that long.
The connection goes with such a stream, and the server drops the session with it.

Every request of a stream goes on one connection, held for the stream's life, from one thread,
in the order the step made them.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from lmkv.errors import LMKVError
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.page import PageHeader
from lmkv.tiers.base import TierStats, covered
from lmkv.wire.protocol import Empty, LayoutMsg, Op, Opened, PutAbort, PutEnd, PutOpen, PutRange, RemoteError, Stored

log = logging.getLogger(__name__)


@dataclass
class _Finish:
    headers: list[PageHeader | None]
    slots: list[int | None]


_ABORT = object()


class ServerPutStream:
    """One step's pages in one put session of an lmkv server; see the module's docstring.

    Made by :meth:`lmkv.tiers.server_client.ServerTier.stream`. The step calls :meth:`filled` as
    layers land, then :meth:`finish` (committed) or :meth:`abort`; each returns at once."""

    def __init__(self, tier: str, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], bufs: Sequence,
                 domain: str, connect: Callable[[], AbstractContextManager[Any]],
                 offsets: Callable[[Any], list[int] | None], layout_msg: Callable[[GroupLayout], LayoutMsg],
                 guarded: Callable[..., Any], timeout: float, submit: Callable[..., Future],
                 closed: Callable[[Future], object], stats: TierStats) -> None:
        """``connect()``: one of the tier's connections (a context manager); ``offsets(conn)``: the
        pages' arena offsets if the server maps the arena (else None: bytes travel in requests);
        ``guarded(fn)``: ``fn()`` under the tier's health; ``timeout``: the longest wait for the step
        or the server; ``submit``: the thread the stream runs on; ``closed``: called once it ends;
        ``stats``: the tier's, where the pages it stored are counted."""
        self._tier = tier
        self.keys = list(keys)
        self._layouts = list(layouts)
        self._bufs = list(bufs)
        self._slots = [b.__array_interface__["data"][0] for b in self._bufs]
        self._domain = domain
        self._connect, self._offsets, self._layout_msg = connect, offsets, layout_msg
        self._timeout = timeout
        self._stats = stats
        self._sent: list[list[tuple[int, int]]] = [[] for _ in self.keys]  # per page, the ranges sent
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._result: Future[set[PageKey]] = Future()
        self._closed = False
        submit(self._run, guarded).add_done_callback(closed)

    def filled(self, indices: Sequence[int], start: int, end: int, ready: Callable[[], object] | None = None) -> None:
        """Bytes ``[start, end)`` of the pages at ``indices`` are in their slots (once ``ready``
        returns: a GPU copy's events); they go to the server while the step goes on."""
        if not self._closed:
            self._events.put((list(indices), start, end, ready))

    def finish(self, headers: Sequence[PageHeader | None], slots: Sequence[int | None]) -> Future[set[PageKey]]:
        """The step committed: ``headers`` of its pages (None: not stored) and the arena address each
        one's payload is at now, pinned (None: not in memory). Resolves to the pages now readable on
        the server; the others are dropped there."""
        if not self._closed:
            self._closed = True
            self._events.put(_Finish(list(headers), list(slots)))
        return self._result

    def abort(self) -> None:
        """The step aborted: none of its pages becomes readable."""
        if not self._closed:
            self._closed = True
            self._events.put(_ABORT)

    # -- the stream's thread ---------------------------------------------------------

    def _run(self, guarded: Callable[..., Any]) -> None:
        try:
            done = guarded(self._serve)
        except Exception as err:  # (whatever it was, the pages are written through whole: never lost)
            expected = isinstance(err, (LMKVError, OSError, queue.Empty))
            (log.info if expected else log.exception)(
                "lmkv: %s tier: a step's put session ended early (%s); its pages are written through whole",
                self._tier, "no word from the step" if isinstance(err, queue.Empty) else err)
            done = set()
        self._result.set_result(done)

    def _serve(self) -> set[PageKey]:
        with self._connect() as c:
            src = self._offsets(c)
            msgs = [self._layout_msg(lay) for lay in self._layouts]
            number = c.call(Op.PUT_OPEN, PutOpen([bytes(k) for k in self.keys], msgs, self._domain), Opened).session
            if number is None:  # (no room on the server now: the write-through will find out per page)
                return set()
            try:
                while True:
                    event = self._events.get(timeout=self._timeout)  # (queue.Empty: the step went quiet)
                    if event is _ABORT:
                        c.call(Op.PUT_ABORT, PutAbort(number), Empty)
                        return set()
                    if isinstance(event, _Finish):
                        return self._end(c, number, src, event)
                    indices, start, end, ready = event
                    if ready is not None:
                        ready()
                    self._send(c, number, src, indices, start, end)
            except RemoteError:  # (refused: the connection stays the pool's, so the session must not)
                c.call(Op.PUT_ABORT, PutAbort(number), Empty)
                raise

    def _send(self, c, number: int, src: list[int] | None, pages: list[int], start: int, end: int) -> None:
        """Bytes ``[start, end)`` of ``pages``, in requests of at most the server's bulk limit."""
        size = end - start
        per = max(1, c.max_bulk // size) if src is None else len(pages)
        for k in range(0, len(pages), per):
            part = pages[k : k + per]
            if src is None:
                c.call(Op.PUT_RANGE, PutRange(number, part, start, end), Empty,
                       [self._bufs[i][start:end] for i in part])
            else:
                c.call(Op.PUT_RANGE, PutRange(number, part, start, end, [src[i] for i in part]), Empty,
                       lent=[(src[i] + start, size) for i in part])
            for i in part:
                self._sent[i].append((start, end))

    def _end(self, c, number: int, src: list[int] | None, fin: _Finish) -> set[PageKey]:
        ok = [h is not None and at == slot for h, at, slot in zip(fin.headers, fin.slots, self._slots)]
        by_size: dict[int, list[int]] = {}  # (pages the step never said were filled: sent whole now)
        for i, good in enumerate(ok):
            if good and not covered(self._sent[i], self._layouts[i].payload_bytes):
                by_size.setdefault(self._layouts[i].payload_bytes, []).append(i)
        for size, pages in by_size.items():
            self._send(c, number, src, pages, 0, size)
        headers = [h.pack() if good and h is not None else None for h, good in zip(fin.headers, ok)]
        stored = c.call(Op.PUT_END, PutEnd(number, headers), Stored).stored
        if len(stored) != len(self.keys):
            raise LMKVError(f"PUT_END answered for {len(stored)} pages of {len(self.keys)}")
        for lay, s in zip(self._layouts, stored):
            if s:
                self._stats.stored(lay.payload_bytes)
        return {k for k, s in zip(self.keys, stored) if s}
