"""What the network tiers (Redis, the lmkv server) share.

A remote page is its packed header followed by its payload, the same bytes as
a page file without the padding. Every page read over the network is checked
here, once, against the header the writer made (``remote.verify``), so a
backend or a link that damages bytes costs a recomputation, never a wrong token.

A backend that cannot be reached is a miss, not an error the engine sees:
:class:`Health` marks it down after the first failure, makes every call fail at
once (no timeout per request while it is down), and a background thread pings
it with backoff until it answers again. So an engine starts and serves while
Redis or the server is not up yet, and picks the tier up when it is.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import NamedTuple

import numpy as np

from lmkv import threads
from lmkv.config import RemoteConfig
from lmkv.errors import LMKVError, PageError, PageFormatError, PartlyStoredError, TierUnavailableError
from lmkv.keys import PageKey
from lmkv.layout import GroupLayout
from lmkv.page import (
    PageHeader,
    as_bytes_view,
    units_in_ranges,
    unpack_header,
    verify_payload,
    verify_units,
)
from lmkv.tiers.allocator import RoomBefore
from lmkv.tiers.arena import HostArena
from lmkv.tiers.base import Range, Tier, WriteSession
from lmkv.tiers.quarantine import Quarantine

log = logging.getLogger(__name__)

#: a write's pages are published (made visible to readers) this many bytes at a time, or a page at
#: a time if pages are larger: a reader (a P/D consumer) pulls a prompt's first pages while the
#: rest are on their way, not all 250 MiB of an 8B model's 2k-token prompt at once
PUBLISH_BYTES = 32 << 20
#: step streams (put sessions) a tier runs at once, beyond which a step's pages go whole after its
#: commit (:meth:`RemoteTier._stream_slot`)
STREAMS_OPEN = 4


def batches(sizes: Sequence[int], limit: int, most: int) -> list[range]:
    """Consecutive index ranges of at most ``limit`` bytes (at least one item) and ``most`` items."""
    out: list[range] = []
    i = 0
    while i < len(sizes):
        j, total = i, 0
        while j < len(sizes) and j - i < most and (j == i or total + sizes[j] <= limit):
            total += sizes[j]
            j += 1
        out.append(range(i, j))
        i = j
    return out


class Health:
    """Up or down, with a background reconnect loop while down.

    ``ping`` raises when the backend is unreachable (and may return a note on how it is
    reachable again). The first failure is logged (once per outage), later calls fail fast
    until a ping succeeds; the recovery is logged once too.
    """

    def __init__(self, name: str, ping: Callable[[], str | None], min_backoff: float = 0.2, max_backoff: float = 5.0):
        self.name = name
        self._ping = ping
        self._min, self._max = min_backoff, max_backoff
        self._down_since: float | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def up(self) -> bool:
        return self._down_since is None

    def guard(self) -> None:
        """Fail at once while the backend is known to be down."""
        if self._down_since is not None:
            raise TierUnavailableError(f"{self.name}: unreachable since {time.ctime(self._down_since)}; reconnecting")

    def failed(self, err: BaseException) -> None:
        with self._lock:
            if self._down_since is not None or self._stop.is_set():
                return
            self._down_since = time.time()
            log.warning("lmkv: %s unreachable (%s: %s); serving without it, reconnecting in the background",
                        self.name, type(err).__name__, err)
            self._thread = threads.start(self._reconnect, f"lmkv-{self.name.replace(' ', '-')}-reconnect")

    def _reconnect(self) -> None:
        delay = self._min
        while not self._stop.wait(delay):
            try:
                note = self._ping()
            except Exception:  # any failure: still down
                delay = min(delay * 2, self._max)
                continue
            with self._lock:
                down_for = time.time() - (self._down_since or 0)
                log.warning("lmkv: %s reachable again after %.1f s%s", self.name, down_for,
                            f" ({note})" if note else "")
                self._down_since = None
            return

    def close(self) -> None:
        self._stop.set()


class BufferedSession(WriteSession):
    """A write session for a remote tier: pages fill host buffers, commit sends them in one batch."""

    def __init__(self, tier: RemoteTier, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], domain: str) -> None:
        super().__init__(keys, layouts)
        self._tier = tier
        self._domain = domain
        self._bufs = [np.empty(lay.payload_bytes, np.uint8) for lay in self.layouts]

    def buffer(self, i: int) -> np.ndarray:
        return self._bufs[i]

    def commit(self, headers: Sequence[PageHeader | None] | None = None) -> list[bool]:
        made = self.headers() if headers is None else headers
        self.closed = True
        todo = [(i, h) for i, h in enumerate(made) if h is not None]
        ok = self._tier.put([(h, self._bufs[i]) for i, h in todo], self._domain)
        out = [False] * len(self.keys)
        for (i, _), stored in zip(todo, ok):
            out[i] = stored
        self._bufs = []
        return out

    def abort(self) -> None:
        self.closed = True
        self._bufs = []


class Checked(NamedTuple):
    """A read whose header a subclass already parsed and whose payload it already verified
    (e.g. while the next page was still arriving). (A tuple: one is made for every page read, and
    a frozen dataclass costs twice as much to make.)"""

    header: PageHeader


class RemoteTier(Tier):
    """A tier behind a network connection. Subclasses move bytes; this class checks them.

    Subclasses implement the primitives below and raise :class:`TierUnavailableError`
    for anything that means the backend cannot be reached or did not answer in time.

    Raises (every call): TierUnavailableError while the backend is down or slower than
    ``remote.timeout`` (the store counts it and serves from its other tiers); TierBusyError when
    every pooled connection is in use (a miss, not an outage).
    """

    #: a network round trip per call (callers on an engine's scheduler thread ask only other tiers)
    networked = True

    @property
    def wants_arena(self) -> bool:
        """Whether the memory tier's arena should be a shared-memory window this tier's backend can
        map (a same-host lmkv server: :meth:`share_arena` is then given one)."""
        return False

    #: bytes this tier would have the memory tier keep free before each slot (see :meth:`share_arena`)
    header_room = 0

    def share_arena(self, arena: HostArena, quarantine: Quarantine, room_before: RoomBefore | None = None) -> None:
        """Let the backend move pages straight into and out of the memory tier's ``arena`` (a same-host
        lmkv server maps its window; Mooncake registers its memory); slots lent to a request given up
        on wait in ``quarantine`` (:mod:`lmkv.tiers.quarantine`); ``room_before(offset, nbytes)``:
        the bytes free before a slot (:attr:`header_room` of them, kept for this tier). Without it,
        pages cross a buffer of the tier's own."""

    def _stream_slot(self, limit: int) -> bool:
        """Take one of ``limit`` places for a step stream (:meth:`Tier.stream`), or say there is none: a
        tier slower than the engine stores then takes the step's pages whole after its commit (the
        write-through's own backlog rules), not an unbounded queue of streams. The stream gives its
        place back through :meth:`_stream_closed`."""
        with self._streams_lock:
            if self._streams_open >= limit:
                return False
            self._streams_open += 1
            return True

    def _stream_closed(self, _: Future) -> None:
        with self._streams_lock:
            self._streams_open -= 1

    def connect_soon(self) -> None:
        """Start connecting in the background, so that an engine's first lookups and loads do not wait
        for it (Mooncake's client setup registers its buffers with the master: a lookup waiting on it
        looks like a stalled network; a same-host lmkv server maps the arena). Redis connects on
        first use."""

    def __init__(self, name: str, cfg: RemoteConfig) -> None:
        super().__init__(name)
        self.cfg = cfg
        self._streams_open = 0  # step streams started and not ended yet (under _streams_lock)
        self._streams_lock = threading.Lock()
        self.verifies = cfg.verify
        self.health = Health(f"{name} tier", self._ping)
        self._usage = (0, 0, 0)
        self._usage_at = 0.0

    # -- primitives ----------------------------------------------------------

    @abstractmethod
    def _ping(self) -> None: ...

    @abstractmethod
    def _exists(self, keys: Sequence[PageKey]) -> list[bool]: ...

    @abstractmethod
    def _read(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence,
              ranges: Sequence[Range] | None) -> list:
        """Per key, its header (packed bytes, or a :class:`PageHeader` already parsed; ``None``:
        missing), the payload written into ``out`` at page offsets (every byte, or only ``ranges``)."""

    @abstractmethod
    def _write(self, pages: Sequence[tuple[PageHeader, memoryview]], domain: str) -> list[bool]: ...

    @abstractmethod
    def _delete(self, keys: Sequence[PageKey]) -> int: ...

    @abstractmethod
    def _clear(self, domain: str) -> int: ...

    @abstractmethod
    def _fetch_usage(self) -> tuple[int, int, int]:
        """(used bytes, capacity bytes, pages), for stats."""

    @staticmethod
    def _parsed(key: PageKey, raw: bytes | PageHeader, layout: GroupLayout) -> bytes | PageHeader:
        """The header of a page a subclass landed (``raw`` itself when it is parsed already), or
        ``raw`` for :meth:`_check` to count and drop."""
        if isinstance(raw, PageHeader):
            return raw
        try:
            return unpack_header(raw, expect_key=key, layout=layout)
        except PageError:
            return raw

    def _verified(self, key: PageKey, raw: bytes | PageHeader, layout: GroupLayout, out, units: Sequence[int]):
        """Parse (unless ``raw`` is a header already parsed) and verify one page a subclass landed
        (while the next is still on its way): :class:`Checked`, or ``raw`` for :meth:`_check` to
        count and drop."""
        h = self._parsed(key, raw, layout)
        if not isinstance(h, PageHeader):
            return raw
        try:
            verify_units(h, layout, out, units)
        except PageError:
            return raw
        return Checked(h)

    # -- guarded calls ---------------------------------------------------------

    def _call(self, fn, *args):
        self.health.guard()
        try:
            return fn(*args)
        except PartlyStoredError:  # some of a cluster's nodes are down: they keep their own health
            raise
        except TierUnavailableError as err:
            self.stats.errors += 1
            self.health.failed(err)
            raise

    # -- Tier --------------------------------------------------------------

    def contains(self, keys: Sequence[PageKey]) -> list[bool]:
        return self._call(self._exists, keys) if keys else []

    def _check(self, key: PageKey, raw, layout: GroupLayout, out, units: Sequence[int] | None,
               nbytes: int) -> PageHeader | None:
        """Parse and verify what a read returned; a bad page is counted, deleted and a miss."""
        if raw is None:
            self.stats.misses += 1
            return None
        try:
            checked = isinstance(raw, Checked)
            if checked:
                h = raw.header
            else:
                h = raw if isinstance(raw, PageHeader) else unpack_header(raw, expect_key=key, layout=layout)
            if h.key != key or h.layout_fp != layout.fingerprint:
                raise PageFormatError(f"page {h.key.hex()} of layout {h.layout_fp:#x} asked for as {key.hex()}")
            if self.verifies and not checked:
                if units is None:
                    verify_payload(h, layout, out)
                else:
                    verify_units(h, layout, out, units)
        except PageError as err:
            self.stats.corrupt += 1
            log.warning("lmkv: %s tier served a bad page (%s); dropping it", self.name, err)
            try:
                self._call(self._delete, [key])
            except TierUnavailableError:
                pass
            return None
        self.stats.hits += units is None or units[0] == 0  # a page read layer by layer is one hit
        self.stats.get_bytes += nbytes
        return h

    def get(self, keys: Sequence[PageKey], layout: GroupLayout, outs: Sequence) -> list[PageHeader | None]:
        if not keys:
            return []
        raws = self._call(self._read, keys, layout, outs, None)
        return [self._check(k, r, layout, o, None, layout.payload_bytes) for k, r, o in zip(keys, raws, outs)]

    def read_ranges(self, key: PageKey, layout: GroupLayout, ranges: Sequence[Range], out) -> PageHeader | None:
        return self.get_ranges([key], layout, ranges, [out])[0]

    def get_ranges(self, keys: Sequence[PageKey], layout: GroupLayout, ranges: Sequence[Range],
                   outs: Sequence) -> list[PageHeader | None]:
        """One request for every page's ranges (the server's ranged GET, a Redis pipeline)."""
        if not keys:
            return []
        units = units_in_ranges(layout, ranges)
        raws = self._call(self._read, keys, layout, outs, list(ranges))
        nbytes = sum(b - a for a, b in ranges)
        return [self._check(k, r, layout, o, units, nbytes) for k, r, o in zip(keys, raws, outs)]

    def put(self, pages: Sequence[tuple[PageHeader, object]], domain: str) -> list[bool]:
        if not pages:
            return []
        views = [(h, as_bytes_view(p)) for h, p in pages]
        for h, v in views:
            if len(v) != h.payload_len:
                raise ValueError(f"payload of {len(v)} bytes, header says {h.payload_len}")
        try:
            ok = self._call(self._write, views, domain)
        except PartlyStoredError as err:
            self._count_puts(views, err.stored)
            raise
        self._count_puts(views, ok)
        return ok

    def _count_puts(self, views: Sequence[tuple[PageHeader, memoryview]], ok: Sequence[bool]) -> None:
        for (h, _), stored in zip(views, ok):
            if stored:
                self.stats.stored(h.payload_len)

    def delete(self, keys: Sequence[PageKey]) -> int:
        return self._call(self._delete, keys) if keys else 0

    def clear(self, domain: str) -> int:
        return self._call(self._clear, domain)

    def open_session(self, keys: Sequence[PageKey], layouts: Sequence[GroupLayout], domain: str) -> WriteSession:
        return BufferedSession(self, keys, layouts, domain)

    def _usage_now(self) -> tuple[int, int, int]:
        """Occupancy for stats: the last figures known, refreshed in the background at most every 2 s
        and never while the backend is down (a stats call, a metrics scrape, never waits for it)."""
        if self.health.up and time.monotonic() - self._usage_at > 2.0:
            self._usage_at = time.monotonic()
            threads.start(self._refresh_usage, f"lmkv-{self.name}-usage")
        return self._usage

    def _refresh_usage(self) -> None:
        try:
            self._usage = self._call(self._fetch_usage)
        except (LMKVError, OSError):
            pass

    @property
    def used_bytes(self) -> int:
        return self._usage_now()[0]

    @property
    def capacity_bytes(self) -> int:
        return self._usage_now()[1]

    def __len__(self) -> int:
        return self._usage_now()[2]

    def close(self) -> None:
        self.health.close()
