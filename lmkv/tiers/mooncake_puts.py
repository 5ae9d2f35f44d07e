"""A step's pages streamed to Mooncake Store while the step computes them: one put session per step.

When a step opens its store session, its pages are reserved in Mooncake
(``batch_put_session_start``: one master round trip, nothing readable yet). As each layer lands in
the pages' memory-tier slots, that layer's range of every page is put from the slots
(``batch_put_from_multi_buffer_ranges``: no master), while the later layers compute. When the step
commits, each page's header goes to the front of its object and the session ends
(``batch_put_session_end``): only then can any reader see an object, so none ever sees a
half-written page, and the step's write-through has only the headers left to move.

A page is ended only if every one of its ranges was put from the slot it was gathered into, and
that slot is still its page's in memory (pinned from the commit on: the memory tier published it,
not a twin another writer stored first). Everything else is revoked (``batch_put_session_revoke``)
and written through whole like any other page: a step that aborts, a range that failed, a call past
``remote.timeout``, a page evicted before the commit. A call given up on may still read a slot after
it was reused; its object is revoked, never readable, so what it read reaches nobody.

Every call of every stream runs on the tier's one streaming thread, in the order the step made
them (a layer's ranges after the session's start, the end after every range).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import numpy as np

from lmkv.errors import TierUnavailableError
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.page import PageHeader, header_bytes
from lmkv.tiers.base import TierStats, covered

log = logging.getLogger(__name__)

#: Mooncake's return code for an object that exists already (the same key: the same page)
EXISTS = -705


class PutStream:
    """One step's pages in one Mooncake put session; see the module's docstring.

    Made by :meth:`lmkv.tiers.mooncake.MooncakeTier.stream` from the step's memory slots (``ptrs``:
    each page's payload address in the registered arena). The step calls :meth:`filled` as layers
    land, then :meth:`finish` (committed) or :meth:`abort`; each returns at once, the calls run in
    order on the tier's streaming thread."""

    def __init__(self, tier: str, call: Callable[..., list[int]], submit: Callable[..., Future],
                 header_buf: np.ndarray, keys: Sequence[PageKey], names: Sequence[str],
                 layouts: Sequence[GroupLayout], ptrs: Sequence[int], closed: Callable[[Future], object],
                 stats: TierStats) -> None:
        """``call(fn, *args)``: ``fn(client, *args)`` on the tier's client, bounded by ``remote.timeout``
        (raises TierUnavailableError); ``submit``: the tier's streaming thread; ``header_buf``: memory
        registered with the client, this stream's while it finishes; ``closed``: called with the
        future of the stream's last call (its finish or abort) once done; ``stats``: the tier's, where
        the pages it stored are counted."""
        self._tier = tier
        self._call = call
        self._submit = submit
        self._header_buf = header_buf
        self.keys = list(keys)
        self._names = list(names)
        self._hdrs = [header_bytes(lay) for lay in layouts]
        self._sizes = [lay.payload_bytes for lay in layouts]
        self._put_ranges: list[set[tuple[int, int]]] = [set() for _ in self.keys]  # per page, what was put
        self._ptrs = list(ptrs)
        self._started = [False] * len(self.keys)  # reserved by this session (and not ended or revoked yet)
        self._live = [False] * len(self.keys)  # started, and every range so far put
        self._present = [False] * len(self.keys)  # the object was there already (the same page)
        self._closed = False
        self._on_closed = closed
        self._stats = stats
        self._submit(self._start, [h + lay.payload_bytes for h, lay in zip(self._hdrs, layouts)])

    def _start(self, sizes: list[int]) -> None:
        try:
            rcs = self._call(lambda c, n, z: c.batch_put_session_start(n, z), self._names, sizes)
        except TierUnavailableError as err:
            log.info("lmkv: %s tier: a step's put session did not start (%s); its pages are written "
                     "through whole", self._tier, err)
            return
        for i, rc in enumerate(rcs):
            self._started[i] = self._live[i] = rc == 0
            self._present[i] = rc == EXISTS

    def filled(self, indices: Sequence[int], start: int, end: int, ready: Callable[[], object] | None = None) -> None:
        """Bytes ``[start, end)`` of the pages at ``indices`` are in their slots (once ``ready``
        returns: a GPU copy's events); they are put while the step goes on."""
        if not self._closed:
            self._submit(self._put_range, list(indices), start, end, ready)

    def _put_range(self, indices: list[int], start: int, end: int, ready: Callable[[], object] | None) -> None:
        live = [i for i in indices if self._live[i]]
        if not live:
            return
        if ready is not None:
            try:
                ready()
            except Exception:  # (the device failed: these ranges never came)
                log.exception("lmkv: %s tier: waiting for a step's copies failed", self._tier)
                for i in live:
                    self._live[i] = False
                return
        self._put(live, [self._ptrs[i] + start for i in live], [end - start] * len(live),
                  [self._hdrs[i] + start for i in live])
        for i in live:
            self._put_ranges[i].add((start, end))

    def _put(self, live: list[int], ptrs: list[int], sizes: list[int], offsets: list[int]) -> None:
        """One range of each page at ``live`` (from ``ptrs``, into its object at ``offsets``); a page
        whose range did not all go is not live any more."""
        try:
            rcs = self._call(lambda c, n, p, z, o: c.batch_put_from_multi_buffer_ranges(n, p, z, o),
                             [self._names[i] for i in live], [[p] for p in ptrs], [[z] for z in sizes],
                             [[o] for o in offsets])
        except TierUnavailableError:
            rcs = [-1] * len(live)
        for i, rc, z in zip(live, rcs, sizes):
            if rc != z:
                self._live[i] = False

    def finish(self, headers: Sequence[PageHeader | None], slots: Sequence[int | None]) -> Future[set[PageKey]]:
        """The step committed: ``headers`` of its pages (None: not stored) and the arena address each
        one's payload is at now, pinned (None: not in memory). Resolves to the pages now readable in
        Mooncake (ended here, or there already); the others are revoked."""
        self._closed = True
        fut = self._submit(self._finish, list(headers), list(slots))
        fut.add_done_callback(self._on_closed)
        return fut

    def _finish(self, headers: list[PageHeader | None], slots: list[int | None]) -> set[PageKey]:
        for i, (h, at) in enumerate(zip(headers, slots)):
            if h is None or at != self._ptrs[i]:  # (not stored, or a twin's slot: not what was streamed)
                self._live[i] = False
        gaps = [i for i, ok in enumerate(self._live) if ok and not covered(self._put_ranges[i], self._sizes[i])]
        if gaps:  # (bytes the step never said were filled: put from the pinned slots now)
            self._put(gaps, [self._ptrs[i] for i in gaps], [self._sizes[i] for i in gaps],
                      [self._hdrs[i] for i in gaps])
        buf = self._header_buf
        live = [i for i, ok in enumerate(self._live) if ok]
        while live:  # (as many headers as the buffer holds at a time)
            part, at, ptrs = [], 0, []
            while live and at + self._hdrs[live[0]] <= buf.nbytes:
                i = live.pop(0)
                packed = headers[i].pack()  # type: ignore[union-attr]
                buf[at : at + len(packed)] = np.frombuffer(packed, np.uint8)
                part.append(i)
                ptrs.append(buf.ctypes.data + at)
                at += len(packed)
            self._put(part, ptrs, [self._hdrs[i] for i in part], [0] * len(part))  # (each fits: see stream())
        ended = [i for i, ok in enumerate(self._live) if ok]
        if ended:
            try:
                rcs = self._call(lambda c, n: c.batch_put_session_end(n), [self._names[i] for i in ended])
            except TierUnavailableError:
                rcs = [-1] * len(ended)
            for i, rc in zip(ended, rcs):
                self._live[i] = rc == 0
                self._started[i] = rc != 0
                if rc == 0:
                    self._stats.stored(self._sizes[i])
        self._revoke()
        return {k for k, ok, there in zip(self.keys, self._live, self._present) if ok or there}

    def abort(self) -> None:
        """The step aborted: every page of it is revoked (after :meth:`finish`: nothing to do)."""
        if self._closed:
            return
        self._closed = True
        self._submit(self._abort).add_done_callback(self._on_closed)

    def _abort(self) -> None:
        self._live = [False] * len(self.keys)
        self._revoke()

    def _revoke(self) -> None:
        """Pages started and not ended go (never readable); on failure the master reclaims them."""
        doomed = [i for i, s in enumerate(self._started) if s and not self._live[i]]
        if not doomed:
            return
        try:
            self._call(lambda c, n: c.batch_put_session_revoke(n), [self._names[i] for i in doomed])
        except TierUnavailableError:
            pass
        for i in doomed:
            self._started[i] = False
