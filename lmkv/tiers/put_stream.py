"""A step's pages streamed to a network tier while the step computes them: one put session per step.

When a step opens its store session, a tier that can opens a put session for its pages (the lmkv
server's ``PUT_OPEN``, :mod:`lmkv.tiers.server_puts`; staging keys in Redis,
:mod:`lmkv.tiers.redis_puts`): nothing of it is readable yet. As each layer lands in the pages'
memory-tier slots, that layer's range of every page goes to the tier while the later layers
compute. When the step commits, the session ends: the pages become readable at once, and the
step's write-through has nothing left to move, so a decode engine waiting for a prefill engine's
pages finds them as the prefill answers (measured before streams, on 2 cores: 62 pages of 4 MiB
reached the server 0.2-0.6 s after their step committed, Redis 0.8 s).

A page is ended only if every range of it went from the slot it was gathered into, and that slot is
still its page's at the commit (pinned from then on, not a twin another writer published first);
the session drops the others, and they are written through whole after the commit like any page of
a tier that takes no stream. So does every page of a stream that fails: a refused request, the tier
gone or slower than ``remote.timeout``, no word from the step for that long.

Every call of a stream goes from one thread, in the order the step made them.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

from lmkv.errors import LMKVError
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.page import PageHeader
from lmkv.tiers.base import TierStats, covered

log = logging.getLogger(__name__)


class PutTarget(Protocol):
    """One open put session of a tier, driven by :class:`StepPutStream` from its thread. Pages are
    named by their index in the step; every call raises what the tier raises for a backend that is
    down or slow (:class:`~lmkv.errors.TierUnavailableError`), and the stream then gives up."""

    def send(self, pages: list[int], start: int, end: int) -> list[int]:
        """Bytes ``[start, end)`` of ``pages`` from their slots; the pages whose range the tier now
        holds (or needs no more: the page is there already)."""

    def end(self, headers: list[PageHeader | None]) -> list[bool]:
        """Publish the pages with a header (every byte of each was sent); drop the others. Per page,
        whether it is readable in the tier now."""

    def abort(self) -> None:
        """Drop every page of the session: none becomes readable."""


#: a tier's way to open a put session for a step on the stream's thread: a context manager giving
#: the session (None: the tier has no room now) and closing what it holds when the stream ends
Opener = Callable[[], AbstractContextManager["PutTarget | None"]]


@dataclass
class _Finish:
    headers: list[PageHeader | None]
    slots: list[int | None]


_ABORT = object()


class StepPutStream:
    """One step's pages in one put session of a tier; see the module's docstring.

    Made by a tier's :meth:`~lmkv.tiers.base.Tier.stream`. The step calls :meth:`filled` as layers
    land, then :meth:`finish` (committed) or :meth:`abort`; each returns at once."""

    def __init__(self, tier: str, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], bufs: Sequence,
                 open_session: Opener, guarded: Callable[..., object], timeout: float,
                 submit: Callable[..., Future], closed: Callable[[Future], object], stats: TierStats) -> None:
        """``bufs``: the pages' memory-tier slots; ``open_session``: the tier's put session for them
        (:data:`Opener`); ``guarded(fn)``: ``fn()`` under the tier's health; ``timeout``: the longest
        wait for the step; ``submit``: the thread the stream runs on; ``closed``: called once it
        ends; ``stats``: the tier's, where the pages it stored are counted."""
        self._tier = tier
        self.keys = list(keys)
        self._sizes = [lay.payload_bytes for lay in layouts]
        self._slots = [b.__array_interface__["data"][0] for b in bufs]
        self._open = open_session
        self._timeout = timeout
        self._stats = stats
        self._sent: list[list[tuple[int, int]]] = [[] for _ in self.keys]  # per page, the ranges the tier holds
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._result: Future[set[PageKey]] = Future()
        self._closed = False
        submit(self._run, guarded).add_done_callback(closed)

    def filled(self, indices: Sequence[int], start: int, end: int, ready: Callable[[], object] | None = None) -> None:
        """Bytes ``[start, end)`` of the pages at ``indices`` are in their slots (once ``ready``
        returns: a GPU copy's events); they go to the tier while the step goes on."""
        if not self._closed:
            self._events.put((list(indices), start, end, ready))

    def finish(self, headers: Sequence[PageHeader | None], slots: Sequence[int | None]) -> Future[set[PageKey]]:
        """The step committed: ``headers`` of its pages (None: not stored) and the arena address each
        one's payload is at now, pinned (None: not in memory). Resolves to the pages now readable in
        the tier; the others are dropped there."""
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

    def _run(self, guarded: Callable[..., set[PageKey]]) -> None:
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
        with self._open() as target:
            if target is None:  # (no room in the tier now: the write-through will find out per page)
                return set()
            while True:
                event = self._events.get(timeout=self._timeout)  # (queue.Empty: the step went quiet)
                if event is _ABORT:
                    target.abort()
                    return set()
                if isinstance(event, _Finish):
                    return self._end(target, event)
                indices, start, end, ready = event
                if ready is not None:
                    ready()
                self._send(target, indices, start, end)

    def _send(self, target: PutTarget, pages: list[int], start: int, end: int) -> None:
        for i in target.send(pages, start, end):
            self._sent[i].append((start, end))

    def _end(self, target: PutTarget, fin: _Finish) -> set[PageKey]:
        ok = [h is not None and at == slot for h, at, slot in zip(fin.headers, fin.slots, self._slots)]
        by_size: dict[int, list[int]] = {}  # (pages the step never said were filled: sent whole now)
        for i, good in enumerate(ok):
            if good and not covered(self._sent[i], self._sizes[i]):
                by_size.setdefault(self._sizes[i], []).append(i)
        for size, pages in by_size.items():
            self._send(target, pages, 0, size)
        ok = [good and covered(sent, size) for good, sent, size in zip(ok, self._sent, self._sizes)]
        stored = target.end([h if good else None for h, good in zip(fin.headers, ok)])
        if len(stored) != len(self.keys):
            raise LMKVError(f"a put session's end answered for {len(stored)} pages of {len(self.keys)}")
        for size, s in zip(self._sizes, stored):
            if s:
                self._stats.stored(size)
        return {k for k, s in zip(self.keys, stored) if s}
